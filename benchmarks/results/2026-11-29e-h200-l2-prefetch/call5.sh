set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
OUT=$R/graphs PART=graphs SKINNY_TESTS="" BATCHES=1,32 LIB_TESTS="ops::linear::kernel_tests::gemv" \
  MODES="continuous-sync8 continuous-sync8-noswiglu continuous-sync8@2 continuous-sync8-noswiglu@2" \
  ROLLOUT_MODES=" " bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
grep -E "^== |^rc |test result|FAILED|panicked|^test ops" $R/graphs/graphs.log | head -40
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
