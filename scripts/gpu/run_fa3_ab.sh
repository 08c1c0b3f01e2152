#!/usr/bin/env bash
# FlashAttention-3 (the `fa3` build) against fleet's own flash kernel, one call, alternating:
# the 7B prefill (`fleet bench generate`, prompt PROMPT, batches 1 and 32, 2 new tokens) with
# transformers in the same call, and the 8B judge (`edit-score bench`, SIZE px, BATCH) with
# FLEET_FA3=0 / 1.
# Carried: dist/carry/fleet.xz and dist/carry/edit-score.xz, both built with `fa3`.
#
#   bash scripts/gpu/run_fa3_ab.sh     # ROUNDS (2), PROMPT (512), SIZE (1024), BATCH (16),
#                                      # SAMPLES (48), HF (1: transformers' prefill too)
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/fa3ab; mkdir -p $W
xz -dc dist/carry/fleet.xz > $W/fleet; chmod +x $W/fleet
[ -f dist/carry/edit-score.xz ] && { xz -dc dist/carry/edit-score.xz > $W/edit-score; chmod +x $W/edit-score; }
C7=configs/models/qwen2.5-7b.json
C8=configs/models/qwen3-vl-8b.json
P=${PROMPT:-512}
if [ "${HF:-1}" = 1 ]; then
  echo "== transformers prefill"
  timeout 150 python3 benches/transformers_generate.py --config $C7 --dtype bf16 --prompt-len $P \
    --new-tokens 2 --batch 1,32 --device cuda --json $OUT/hf_prefill.json > $W/hf.log 2>&1 \
    || tail -5 $W/hf.log
  python3 -c "import json; d=json.load(open('$OUT/hf_prefill.json')); [print('hf', r['batch'], round(r['prefill_tok_s'])) for r in d['runs']]" || true
fi
for i in $(seq 1 ${ROUNDS:-2}); do for f in 0 1; do
  echo "== prefill FLEET_FA3=$f round $i"
  FLEET_FA3=$f timeout 120 $W/fleet bench generate --config $C7 --batch 1,32 --prompt-len $P \
    --new-tokens 2 --repeats 3 --batching static --json $OUT/prefill_f${f}_$i.json 2>&1 | grep -E '^batch|rror'
done; done
if [ -x $W/edit-score ]; then
  $W/edit-score bench --config $C8 --image-size 512 --batch 2 --samples 2 --new-tokens 4 > /dev/null 2>&1
  for i in $(seq 1 ${ROUNDS:-2}); do for f in 0 1; do
    j=$OUT/judge_f${f}_$i.json
    FLEET_FA3=$f timeout 200 $W/edit-score bench --config $C8 --image-size ${SIZE:-1024} --batch ${BATCH:-16} \
      --samples ${SAMPLES:-48} --new-tokens 128 --json $j > $W/j$f$i.log 2>&1 || tail -5 $W/j$f$i.log
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('judge FLEET_FA3=$f round $i', round(d['samples_per_s'],3), 'samples/s, prefill', round(d['prefill_s'],2), 'decode', round(d['decode_s'],2), 's a batch, peak GiB', round(d['peak_used_bytes']/2**30,1))" $j || true
  done; done
fi
