#!/usr/bin/env bash
# Where gspo-train's time and memory go (FLEET_PROFILE=1: synchronized stages, peak GPU memory
# per coarse stage) on the Qwen2.5-0.5B and 1.5B shapes with configs/gspo/bench.toml; carried:
# dist/carry/gspo-train.xz (or $BIN). Writes $OUT/profile-<shape>.txt. EXTRA adds flags to the
# profiled runs (EXTRA="--torch-dtype bfloat16": bf16 master weights).
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/gb; mkdir -p $W
xz -dc ${BIN:-dist/carry/gspo-train.xz} > $W/gspo-prof; chmod +x $W/gspo-prof
[ -f $W/prompts.jsonl ] || python3 scripts/gpu/make_gspo_prompts.py --out $W/prompts.jsonl --n 512
for shape in ${SHAPES:-0.5b 1.5b}; do
  [ -f $W/q$shape/config.json ] || python3 scripts/gpu/make_random_checkpoint.py --config configs/models/qwen2.5-$shape.json --out $W/q$shape --tokenizer-from tests/fixtures/qwen2-tiny --dtype bf16 > /dev/null
  rm -rf $W/p-$shape $W/warm
  # Warm-up: the first process JIT-compiles PTX into the driver's cache.
  $W/gspo-prof --config configs/gspo/bench.toml --model $W/q$shape --dataset $W/prompts.jsonl --output-dir $W/warm --max-steps 1 --dtype bf16 > /dev/null 2>&1
  FLEET_PROFILE=1 $W/gspo-prof --config configs/gspo/bench.toml --model $W/q$shape --dataset $W/prompts.jsonl --output-dir $W/p-$shape --max-steps ${PROFILE_STEPS:-8} --dtype bf16 ${EXTRA:-} > $OUT/profile-$shape.out 2> $OUT/profile-$shape.txt
  cp $W/p-$shape/metrics.jsonl $OUT/profile-$shape.metrics.jsonl
done
[ "${NOCKPT:-0}" = 1 ] && rm -rf $W/p-nockpt && FLEET_PROFILE=1 $W/gspo-prof --config configs/gspo/bench.toml --model $W/q0.5b --dataset $W/prompts.jsonl --output-dir $W/p-nockpt --max-steps 8 --dtype bf16 --no-gradient-checkpointing > /dev/null 2> $OUT/profile-0.5b-nockpt.txt
grep profile $OUT/profile-*.txt
