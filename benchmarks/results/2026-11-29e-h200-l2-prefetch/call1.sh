set -u
ln -sfn $PWD /work/main 2>/dev/null || true
export NCCL_NVLS_ENABLE=0
R=$OUT
# 1. 7B decode, prefetch modes alternating
OUT=$R/speed PART=graphs TESTS=0 HF=0 BATCHES=1,32 \
  MODES="continuous-sync8 continuous-sync8-nol2 continuous-sync8-lead0 continuous-sync8-lead16 continuous-sync8-nol2@2 continuous-sync8@2 continuous-sync8-lead0@2" \
  ROLLOUT_MODES="continuous-sync8 continuous-sync8-nol2" bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
tail -c 2500 $R/speed/graphs.log
# 2. ncu: b1 with caches kept (does o_proj come from L2?), b32 flushed (where b32 goes)
OUT=$R/prof_b1 NCU_CACHE=none SHAPES="7b:1" PROMPT=512 bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
head -20 $R/prof_b1/decode_7b_b1.txt
OUT=$R/prof_b32 SHAPES="7b:32" PROMPT=512 bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
head -24 $R/prof_b32/decode_7b_b32.txt
python3 - $R/speed <<'PY'
import json,glob,sys,os,tarfile
d=sys.argv[1]
t=glob.glob(d+'/*.tgz')
if t: tarfile.open(t[0]).extractall(d+'/x')
for f in sorted(glob.glob(d+'/x/*.json')):
    j=json.load(open(f)); print(os.path.basename(f), [(r['batch'], round(r['decode_tok_s'],1)) for r in j['runs']])
PY
