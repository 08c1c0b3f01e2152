set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
OUT=$R/graphs PART=graphs TESTS=0 HF=0 BATCHES=1 \
  MODES="continuous-sync8 continuous-sync8-noqkvrope continuous-sync8@2 continuous-sync8-noqkvrope@2" \
  ROLLOUT_MODES=" " bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
python3 - $R/graphs <<'PY'
import json,glob,sys,os,tarfile
d=sys.argv[1]
t=glob.glob(d+'/*.tgz')
if t: tarfile.open(t[0]).extractall('/tmp/xx7')
for f in sorted(glob.glob('/tmp/xx7/*.json')):
    try:
        j=json.load(open(f)); print(os.path.basename(f), [(r.get('batch'), round(r.get('decode_tok_s',0),1), (r.get('paged') or {}).get('graphs_captured')) for r in j['runs']])
    except Exception as e: print(f, 'unparsed', e)
PY
