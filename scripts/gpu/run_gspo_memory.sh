#!/usr/bin/env bash
# One device call for issue 10's memory and speed goal on one GPU: the CUDA tests that training
# relies on, the profiled memory cases of scripts/gpu/profile_gspo_memory.sh (driver, live and
# pool peaks per stage), then gspo-train against TRL (scripts/gpu/run_gspo_vs_trl.sh).
#
# Carried: dist/carry/gspo-train.xz, dist/carry/gpu-tests.tar.xz (test executables built with
# `cargo test --no-run --release --features cuda` and scripts/cuda/env.sh sourced, renamed
# `optim` = fleet-gspo's lib tests, `train_grads`, `ops_grad`, `parity` = fleet-models'
# integration tests; they find tests/fixtures through the checkout path they were built at,
# $BUILT_AT), .whl (TRL). TESTS lists `executable:filter` pairs to run (those present in the
# tar); they run with FLEET_TEST_DEVICES=cuda:0. Run from the repo root:
#
#     BUILT_AT=/work/main SHAPES="0.5b 1.5b" STEPS=12 bash scripts/gpu/run_gspo_memory.sh
#
# Writes $OUT/tests.log, $OUT/gspo_vs_trl.json and $OUT/all.tgz (the rest).
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_gspo_memory}"
export WORK="${WORK:-/tmp/gb}"
mkdir -p "$OUT" "$WORK/tests"
# The test executables look for the fixtures where they were built.
if [ -n "${BUILT_AT:-}" ] && [ ! -e "$BUILT_AT" ]; then
  mkdir -p "$(dirname "$BUILT_AT")" && ln -sfn "$PWD" "$BUILT_AT"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/tests.log"
if [ -f dist/carry/gpu-tests.tar.xz ]; then
  xz -dc dist/carry/gpu-tests.tar.xz | tar xf - -C "$WORK/tests"
  for t in ${TESTS:-optim:fused_gpu train_grads: ops_grad:kernels_match parity:}; do
    exe=${t%%:*}; filter=${t#*:}
    [ -x "$WORK/tests/$exe" ] || continue
    echo "== $exe $filter" >> "$OUT/tests.log"
    FLEET_TEST_DEVICES=cuda:0 timeout 300 "$WORK/tests/$exe" $filter --test-threads 1 --nocapture \
      >> "$OUT/tests.log" 2>&1
    echo "== $exe $filter: exit $?" >> "$OUT/tests.log"
  done
  grep -E '^== |test result|worst|panicked' "$OUT/tests.log"
fi
mkdir -p "$OUT/profile"
OUT="$OUT/profile" bash scripts/gpu/profile_gspo_memory.sh
mkdir -p "$OUT/vs"
OUT="$OUT/vs" bash scripts/gpu/run_gspo_vs_trl.sh
cp "$OUT/vs/gspo_vs_trl.json" "$OUT/" 2>/dev/null
(cd "$OUT" && tar czf all.tgz profile vs && rm -rf profile vs)
