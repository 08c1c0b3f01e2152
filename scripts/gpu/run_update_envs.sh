#!/usr/bin/env bash
# The GSPO update of one gspo-train build under several environments in one call, round-robin
# (configs/gspo/bench.toml, bf16 masters, STEPS optimizer steps a run, ROUNDS rounds): the
# default against each switch of the update's kernels turned off, and all of them off. Per-step update seconds
# (the median of the steps after the first generation batch) from each run's metrics.jsonl;
# every file in $OUT/metrics.tar.xz. Carried: dist/carry/gspo-train.xz.
#
#   SHAPES (default 1.5b), STEPS (default 8), ROUNDS (default 2), VARIANTS: a list of
#   environments separated by ';', each a space-separated list of VAR=value ("-" for none).
#   Default: the default path, then each switch off alone, then all three off:
#   "-;FLEET_TRAIN_FLASH=0;FLEET_QKV_ROPE_BWD=0;FLEET_EMBED_GRAD_KERNEL=0;
#    FLEET_TRAIN_FLASH=0 FLEET_QKV_ROPE_BWD=0 FLEET_EMBED_GRAD_KERNEL=0"
#   TESTS=1 first runs the GPU tests from dist/carry/tests-next.tar.xz (ops_grad's `cuda_`
#   tests, then every other binary there with FLEET_TEST_DEVICES=cuda:0; the repo must be at
#   /work/main, where the binaries find their fixtures) into $OUT/tests.txt; TEST_ENV (e.g.
#   "FLEET_COPY2D_MEMCPY=1") is set for all of them.
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/ue; mkdir -p $W/m
if [ "${TESTS:-0}" = 1 ]; then
  mkdir -p $W/t; xz -dc dist/carry/tests-next.tar.xz | tar xf - -C $W/t
  ( cd crates/fleet-models
    env ${TEST_ENV:-} timeout 300 $W/t/ops_grad cuda_ --nocapture --test-threads 1 2>&1 \
      | grep -E "vs |bit-identical|^test |test result|panicked"
    # Every other test binary of the tarball on the GPU (train_grads, parity, generation, ...),
    # one test at a time: a GPU's stream is shared by the process's threads.
    for t in $W/t/*; do
      [ "$(basename $t)" = ops_grad ] && continue
      echo "== $(basename $t)"
      env ${TEST_ENV:-} FLEET_TEST_DEVICES=cuda:0 timeout 300 $t --test-threads 1 2>&1 | grep -E "^test |test result|panicked"
    done
  ) > $OUT/tests.txt 2>&1
  grep -E "test result|FAILED" $OUT/tests.txt
fi
xz -dc dist/carry/gspo-train.xz > $W/gspo-train; chmod +x $W/gspo-train
python3 scripts/gpu/make_gspo_prompts.py --out $W/prompts.jsonl --n 512 > /dev/null
ALL="FLEET_TRAIN_FLASH=0 FLEET_QKV_ROPE_BWD=0 FLEET_EMBED_GRAD_KERNEL=0"
VARIANTS="${VARIANTS:--;FLEET_TRAIN_FLASH=0;FLEET_QKV_ROPE_BWD=0;FLEET_EMBED_GRAD_KERNEL=0;$ALL}"
IFS=';' read -r -a envs <<< "$VARIANTS"
for shape in ${SHAPES:-1.5b}; do
  [ -f $W/q$shape/config.json ] || python3 scripts/gpu/make_random_checkpoint.py \
    --config configs/models/qwen2.5-$shape.json --out $W/q$shape \
    --tokenizer-from tests/fixtures/qwen2-tiny --dtype bf16 > /dev/null 2>&1
  $W/gspo-train --config configs/gspo/bench.toml --model $W/q$shape --dataset $W/prompts.jsonl \
    --output-dir $W/warm --max-steps 1 --dtype bf16 --torch-dtype bfloat16 > /dev/null 2>&1
  rm -rf $W/warm
  for i in $(seq 1 ${ROUNDS:-2}); do
    for k in "${!envs[@]}"; do
      e="${envs[$k]}"; [ "$e" = "-" ] && e=""
      d=$W/$shape-v$k-$i; rm -rf $d
      env $e $W/gspo-train --config configs/gspo/bench.toml --model $W/q$shape \
        --dataset $W/prompts.jsonl --output-dir $d --max-steps ${STEPS:-8} --dtype bf16 \
        --torch-dtype bfloat16 > $d.log 2>&1 || tail -5 $d.log
      cp $d/metrics.jsonl $W/m/metrics_${shape}_v${k}_$i.jsonl 2>/dev/null
      python3 scripts/gpu/update_seconds.py $d/metrics.jsonl "$shape v$k round $i [${e:-default}]"
    done
  done
done
tar cJf $OUT/metrics.tar.xz -C $W/m .
