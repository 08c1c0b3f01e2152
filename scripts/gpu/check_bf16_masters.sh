#!/usr/bin/env bash
# --torch-dtype bfloat16 on the 0.5B and 1.5B shapes (configs/gspo/bench.toml, 12 steps): peak
# memory per step, and the metrics against an earlier call's ($REF/fleet-bf16-<shape>.metrics.jsonl,
# same seeds) to check a change of the update's arithmetic. Carried: dist/carry/gspo-train.xz.
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/gb; mkdir -p $W
REF=${REF:-benchmarks/results/2026-11-23-h200-gspo-vs-trl-3}
xz -dc dist/carry/gspo-train.xz > $W/gspo-train; chmod +x $W/gspo-train
[ -f $W/prompts.jsonl ] || python3 scripts/gpu/make_gspo_prompts.py --out $W/prompts.jsonl --n 512
for shape in ${SHAPES:-0.5b 1.5b}; do
  [ -f $W/q$shape/config.json ] || python3 scripts/gpu/make_random_checkpoint.py --config configs/models/qwen2.5-$shape.json --out $W/q$shape --tokenizer-from tests/fixtures/qwen2-tiny --dtype bf16 > /dev/null 2>&1
  rm -rf $W/b-$shape
  $W/gspo-train --config configs/gspo/bench.toml --model $W/q$shape --dataset $W/prompts.jsonl --output-dir $W/b-$shape --max-steps 12 --dtype bf16 --torch-dtype bfloat16 > /dev/null 2>&1
  echo "$shape exit $?"
  cp $W/b-$shape/metrics.jsonl $OUT/fleet-bf16-$shape.metrics.jsonl
  python3 - $W/b-$shape/metrics.jsonl $REF/fleet-bf16-$shape.metrics.jsonl <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
print(" peak GiB per step:", [round(r["peak_memory_bytes"]["cuda:0"] / 2**30, 2) for r in a])
print(" step_time:", [round(r["step_time"], 3) for r in a])
for k in ("loss", "grad_norm", "entropy"):
    d = max(abs(x[k] - y[k]) / (1e-9 + abs(y[k])) for x, y in zip(a, b) if x[k] is not None and y[k] is not None)
    print(f" {k}: worst relative difference to the reference run {d:.2e}")
PY
done
