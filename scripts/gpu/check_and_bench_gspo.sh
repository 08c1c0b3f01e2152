#!/usr/bin/env bash
# One call: the GPU kernel tests of training, a profile of the 1.5B shape, then gspo-train
# against TRL (run_gspo_vs_trl.sh) with its per-batch summary.
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
mkdir -p /tmp/t; for n in ops_grad fleet_gspo; do xz -dc dist/carry/tests/$n.xz > /tmp/t/$n; chmod +x /tmp/t/$n; done
(cd crates/fleet-models && /tmp/t/ops_grad cuda_kernels_match --nocapture 2>&1 | tail -25) > $OUT/tests.txt
/tmp/t/fleet_gspo fused_gpu --nocapture >> $OUT/tests.txt 2>&1
cat $OUT/tests.txt | grep -E "test result|FAILED|panicked|worst|gradient of input" | head -40
SHAPES=1.5b bash scripts/gpu/profile_gspo.sh > /dev/null 2>&1; grep -v "attn\.\|mlp\.\|  norm \|  head " $OUT/profile-1.5b.txt | grep profile
SHAPES="0.5b 1.5b" STEPS=16 WORK=/tmp/gb bash scripts/gpu/run_gspo_vs_trl.sh > /dev/null 2>&1; python3 -c "
import json; r=json.load(open('$OUT/gspo_vs_trl.json'))
for s,bs in r.items():
  for b,v in bs.items():
    if 'fleet' in v and 'trl' in v: print(s, 'batch', b, 'fleet', round(v['fleet']['seconds_per_generation_batch'],3), v['fleet'].get('peak_mib'), 'MiB  trl', round(v['trl']['seconds_per_generation_batch'],3), v['trl'].get('peak_mib'), 'MiB  speedup', round(v.get('speedup_fleet',0),2))"
