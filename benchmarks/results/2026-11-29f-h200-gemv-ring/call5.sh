set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p /tmp/lt $R/tests && xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
for t in generation paged_generation; do
  timeout 200 /tmp/lt/$t --test-threads 1 > $R/tests/test_$t.txt 2>&1; echo "$t rc $?"
  grep -E "test result|FAILED|panicked" $R/tests/test_$t.txt | head -5
done
(cd $R && tar czf tests.tgz tests && rm -r tests)
OUT=$R/graphs PART=graphs TESTS=0 BATCHES=1,32 \
  MODES="continuous-sync8 continuous-sync8@2 continuous-sync8@3" \
  ROLLOUT_MODES="continuous-sync8" bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
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
OUT=$R/profile SHAPES="0.5b:64" PROMPT=128 bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
head -24 $R/profile/decode_0.5b_b64.txt
(cd $R && tar czf profile.tgz profile && rm -r profile)
