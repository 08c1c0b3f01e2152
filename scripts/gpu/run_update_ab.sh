#!/usr/bin/env bash
# The GSPO update with two gspo-train builds in one call (configs/gspo/bench.toml, bf16
# masters, STEPS optimizer steps, alternating A B A B): per-step update seconds from each run's
# metrics.jsonl (the first generation batch's steps left out; every file in
# $OUT/metrics.tar.xz), then the ncu kernel table of B's micro-step (scripts/gpu/profile_stage.sh). Carried: dist/carry/gspo-train-base.xz (A) and
# dist/carry/gspo-train.xz (B). SHAPES (default "1.5b 0.5b"), STEPS (default 12).
# One build against itself under two environments: SAME_BIN=1 (gspo-train.xz for both) with
# A_ENV / B_ENV, e.g. SAME_BIN=1 A_ENV=FLEET_TRAIN_FLASH=0 B_ENV=FLEET_TRAIN_FLASH=1; the ncu
# table is then B's environment.
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/ua; mkdir -p $W
if [ "${SAME_BIN:-0}" = 1 ]; then xz -dc dist/carry/gspo-train.xz > $W/A; cp $W/A $W/B
else xz -dc dist/carry/gspo-train-base.xz > $W/A; xz -dc dist/carry/gspo-train.xz > $W/B; fi
chmod +x $W/A $W/B
envof() { if [ "$1" = A ]; then echo "${A_ENV:-}"; else echo "${B_ENV:-}"; fi; }
python3 scripts/gpu/make_gspo_prompts.py --out $W/prompts.jsonl --n 512 > /dev/null
for shape in ${SHAPES:-1.5b 0.5b}; do
  [ -f $W/q$shape/config.json ] || python3 scripts/gpu/make_random_checkpoint.py --config configs/models/qwen2.5-$shape.json \
    --out $W/q$shape --tokenizer-from tests/fixtures/qwen2-tiny --dtype bf16 > /dev/null 2>&1
  $W/A --config configs/gspo/bench.toml --model $W/q$shape --dataset $W/prompts.jsonl --output-dir $W/warm \
    --max-steps 1 --dtype bf16 --torch-dtype bfloat16 > /dev/null 2>&1; rm -rf $W/warm
  for i in 1 2; do for v in A B; do
    d=$W/$shape-$v-$i; rm -rf $d
    env $(envof $v) $W/$v --config configs/gspo/bench.toml --model $W/q$shape --dataset $W/prompts.jsonl --output-dir $d \
      --max-steps ${STEPS:-12} --dtype bf16 --torch-dtype bfloat16 > $d.log 2>&1 || tail -5 $d.log
    mkdir -p $W/m; cp $d/metrics.jsonl $W/m/metrics_${shape}_${v}_$i.jsonl
    python3 scripts/gpu/update_seconds.py $d/metrics.jsonl "$shape $v $i" --losses
  done; done
done
# One archive: a call brings back at most 8 files.
tar cJf $OUT/metrics.tar.xz -C $W/m .
[ "${NCU:-1}" = 1 ] || exit 0
env ${B_ENV:-} NAME=update_patched STAGE=train.micro_step@3 bash scripts/gpu/profile_stage.sh $W/B --config configs/gspo/bench.toml \
  --model $W/q1.5b --dataset $W/prompts.jsonl --output-dir $W/p --max-steps 3 --dtype bf16 --torch-dtype bfloat16
