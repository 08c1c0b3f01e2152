#!/usr/bin/env bash
# The judge with two edit-score builds in one call, alternating A B A B (`edit-score bench`,
# random weights of SHAPE's config, SIZE px, BATCH, SAMPLES samples, 128 greedy tokens; fleet
# alone): samples/s and the prefill and decode seconds a batch of each run. Carried:
# dist/carry/edit-score-base.xz (A) and dist/carry/edit-score.xz (B). SHAPE (8b), SIZE (1024),
# BATCH (16), SAMPLES (48), ROUNDS (2).
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/ja; mkdir -p $W
xz -dc dist/carry/edit-score-base.xz > $W/A; xz -dc dist/carry/edit-score.xz > $W/B; chmod +x $W/A $W/B
case "${SHAPE:-8b}" in 8b) C=configs/models/qwen3-vl-8b.json ;; *) C=configs/models/qwen3-vl-30b-a3b.json ;; esac
# Warm-up: the first process JIT-compiles the PTX into the driver's cache.
$W/A bench --config $C --image-size ${SIZE:-1024} --batch 2 --samples 2 --new-tokens 4 > /dev/null 2>&1
for i in $(seq 1 ${ROUNDS:-2}); do for v in A B; do
  j=$OUT/judge_${v}_$i.json
  $W/$v bench --config $C --image-size ${SIZE:-1024} --batch ${BATCH:-16} --samples ${SAMPLES:-48} \
    --new-tokens 128 --json $j > $W/$v-$i.log 2>&1 || tail -5 $W/$v-$i.log
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], round(d['samples_per_s'],3), 'samples/s, prefill', round(d['prefill_s'],2), 'decode', round(d['decode_s'],2), 's a batch, peak GiB', round(d['peak_used_bytes']/2**30,1))" $j "$v $i" || true
done; done
