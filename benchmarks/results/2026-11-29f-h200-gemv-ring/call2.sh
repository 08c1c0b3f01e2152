set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p $R/graphs
OUT=$R/graphs PART=graphs TESTS=0 BATCHES=1 \
  MODES="continuous-sync8 continuous-sync8-noring continuous-sync8@2 continuous-sync8-noring@2" \
  ROLLOUT_MODES=" " bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
python3 - $R/graphs <<'PY'
import json,glob,sys,os,tarfile
d=sys.argv[1]
t=glob.glob(d+'/*.tgz')
if t: tarfile.open(t[0]).extractall('/tmp/xx')
for f in sorted(glob.glob('/tmp/xx/*.json')+glob.glob(d+'/*.json')):
    try:
        j=json.load(open(f)); print(os.path.basename(f), [(r.get('batch'), round(r.get('decode_tok_s',0),1), (r.get('paged') or {}).get('graphs_captured')) for r in j['runs']])
    except Exception as e: print(f, 'unparsed', e)
PY
for r in 1 2; do for mb in 512 64 32 16; do
  FLEET_PAGED_MIN_BLOCKS=$mb timeout 150 /tmp/fleet bench generate --config configs/models/qwen2.5-7b.json --batch 1 \
    --prompt-len 512 --new-tokens 128 --repeats 2 --batching continuous --num-scheduler-steps 8 \
    --json $R/graphs/minblocks_${mb}_r$r.json 2>&1 | grep -E "decode" | head -1 | sed "s/^/minblocks $mb r$r: /"
done; done
M=launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers,launch__waves_per_multiprocessor,sm__warps_active.avg.pct_of_peak_sustained_active,launch__shared_mem_config_size
for ring in 1 0; do
  FLEET_GEMV_RING=$ring OUT=$R/profile$ring TAG=ring$ring NCU_METRICS=$M SHAPES="7b:1" PROMPT=512 bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
  head -4 $R/profile$ring/decode_7b_b1_ring$ring.txt
done
