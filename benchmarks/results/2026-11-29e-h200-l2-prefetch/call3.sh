set -u
export NCCL_NVLS_ENABLE=0 FLEET_GEMV_SWIGLU=0
R=$OUT
OUT=$R/speed PART=graphs TESTS=0 HF=0 BATCHES=1,32 \
  MODES="continuous-sync8-nol2 continuous-sync8-lead0 continuous-sync8 continuous-sync8-side0 continuous-sync8-bulkside0 continuous-sync8-nol2@2 continuous-sync8-lead0@2" \
  ROLLOUT_MODES="continuous-sync8-nol2 continuous-sync8-lead0 continuous-sync8" bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
python3 - $R/speed <<'PY'
import json,glob,sys,os,tarfile
d=sys.argv[1]
t=glob.glob(d+'/*.tgz')
if t: tarfile.open(t[0]).extractall('/tmp/xx')
for f in sorted(glob.glob('/tmp/xx/*.json')):
    j=json.load(open(f)); print(os.path.basename(f), [(r['batch'], round(r['decode_tok_s'],1), r.get('paged',{}).get('graphs_captured')) for r in j['runs']])
PY
OUT=$R/prof_b1 NCU_CACHE=none FLEET_L2_PREFETCH_LEAD_MB=0 SHAPES="7b:1" PROMPT=512 bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
head -14 $R/prof_b1/decode_7b_b1.txt
