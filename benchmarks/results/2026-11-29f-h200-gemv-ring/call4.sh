set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p /tmp/lt $R/graphs $R/tests && xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
ls /tmp/lt
timeout 200 /tmp/lt/fleet_models --test-threads 1 ops::qkv_rope::kernel_tests ops::linear::kernel_tests::gemv > $R/tests/test_lib.txt 2>&1; echo "lib rc $?"
grep -E "^test |test result|panicked" $R/tests/test_lib.txt
for t in generation paged_generation; do
  timeout 200 /tmp/lt/$t --test-threads 1 > $R/tests/test_$t.txt 2>&1; echo "$t rc $?"
  grep -E "test result|FAILED|panicked" $R/tests/test_$t.txt | head -5
done
(cd $R && tar czf tests.tgz tests && rm -r tests)
OUT=$R/graphs PART=graphs TESTS=0 BATCHES=1 \
  MODES="continuous-sync8 continuous-sync8-noqkvrope continuous-sync8@2 continuous-sync8-noqkvrope@2 continuous-sync8@3 continuous-sync8-noqkvrope@3" \
  ROLLOUT_MODES=" " bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
python3 - $R/graphs <<'PY'
import json,glob,sys,os,tarfile
d=sys.argv[1]
t=glob.glob(d+'/*.tgz')
if t: tarfile.open(t[0]).extractall('/tmp/xx')
for f in sorted(glob.glob('/tmp/xx/*.json')):
    try:
        j=json.load(open(f)); print(os.path.basename(f), [(r.get('batch'), round(r.get('decode_tok_s',0),1), round(r.get('prefill_tok_s',0)), (r.get('paged') or {}).get('graphs_captured')) for r in j['runs']])
    except Exception as e: print(f, 'unparsed', e)
PY
mkdir -p $R/profile
OUT=$R/profile SHAPES="7b:1" PROMPT=512 bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
head -16 $R/profile/decode_7b_b1.txt
