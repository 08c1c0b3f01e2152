set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p $R/graphs
OUT=$R/graphs PART=graphs TESTS=0 HF=0 BATCHES=8,32,64 \
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
OUT=$R/profile SHAPES="7b:32" PROMPT=512 TAG=skinny FLEET_SKINNY_GEMM=1 \
  NCU_METRICS=launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,launch__shared_mem_config_size,launch__waves_per_multiprocessor \
  bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
head -12 $R/profile/decode_7b_b32_skinny.txt
(cd $R && tar czf profile.tgz profile && rm -r profile)
