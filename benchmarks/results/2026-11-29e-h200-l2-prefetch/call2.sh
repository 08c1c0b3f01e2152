set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
OUT=$R/speed PART=graphs TESTS=0 HF=0 BATCHES=1,32 \
  MODES="continuous-sync8 continuous-sync8-nol2 continuous-sync8-lead0 continuous-sync8-lead16 continuous-sync8-nol2@2 continuous-sync8@2 continuous-sync8-lead0@2" \
  ROLLOUT_MODES="continuous-sync8 continuous-sync8-nol2 continuous-sync8-lead0" bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
grep -E "error|Error|fell back|fallback" $R/speed/graphs.log | head -5
python3 - $R/speed <<'PY'
import json,glob,sys,os,tarfile
d=sys.argv[1]
t=glob.glob(d+'/*.tgz')
if t: tarfile.open(t[0]).extractall('/tmp/xx')
for f in sorted(glob.glob('/tmp/xx/*.json')):
    j=json.load(open(f)); print(os.path.basename(f), [(r['batch'], round(r['decode_tok_s'],1), r.get('paged',{}).get('graphs_captured')) for r in j['runs']])
PY
