set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p /tmp/lt $R/graphs $R/tests && xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
timeout 200 /tmp/lt/fleet_models --test-threads 1 ops::linear::kernel_tests > $R/tests/test_lib.txt 2>&1; echo "lib rc $?"
grep -E "^test |test result|panicked" $R/tests/test_lib.txt | head -30
for t in paged_generation generation; do
  FLEET_SKINNY_GEMM=1 timeout 200 /tmp/lt/$t --test-threads 1 > $R/tests/test_${t}_skinny.txt 2>&1; echo "$t skinny rc $?"
  grep -E "test result|FAILED|panicked" $R/tests/test_${t}_skinny.txt | head -5
done
(cd $R && tar czf tests.tgz tests && rm -r tests)
OUT=$R/graphs PART=graphs TESTS=0 HF=0 BATCHES=8,16,32,64 \
  MODES="continuous-sync8 continuous-sync8-skinny continuous-sync8@2 continuous-sync8-skinny@2" \
  ROLLOUT_MODES="continuous-sync8 continuous-sync8-skinny" bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
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
OUT=$R/profile SHAPES="7b:32" PROMPT=512 TAG=skinny FLEET_SKINNY_GEMM=1 bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
head -24 $R/profile/decode_7b_b32_skinny.txt
(cd $R && tar czf profile.tgz profile && rm -r profile)
