#!/usr/bin/env bash
# Issue 25's GPU check of the redesign, one call on one GPU: every fleet-models test that runs
# the CUDA kernels, on the GPU — the fused ops against their CPU twins forward and backward
# (ops_grad, the ops' own kernel tests in the library), fused attention against its reference
# (the library's attention tests), transformers' goldens for text and Qwen3-VL (parity,
# qwen3_vl_parity), the training gradients (train_grads), batched generation (generation), and
# fleet-serve's replicas in this process and in child processes (fleet_serve, replica_process).
#
# Carried: dist/carry/fleet-models-gpu-tests.tar.xz, the test executables built here with
# scripts/cuda/env.sh sourced:
#   cargo test --release --no-run -p fleet-models -p fleet-serve \
#     --features fleet-models/cuda,fleet-serve/cuda --lib --test ops_grad --test parity \
#     --test qwen3_vl_parity --test train_grads --test generation --test replica_process \
#     --test paged_attention --test paged_generation
# stripped and packed with their names (lib -> fleet_models). They find tests/fixtures through
# the path they were built at (BUILT_AT, default /work/main), made a link to this checkout.
#   bash scripts/gpu/run_redesign_checks.sh    # writes $OUT/redesign_checks.log
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_redesign_checks}"
W=/tmp/redesign_checks
mkdir -p "$OUT" "$W"
LOG="$OUT/redesign_checks.log"
exec > >(tee -a "$LOG") 2>&1
BUILT_AT="${BUILT_AT:-/work/main}"
if [ ! -e "$BUILT_AT/tests/fixtures" ]; then
  mkdir -p "$(dirname "$BUILT_AT")" && ln -sfn "$PWD" "$BUILT_AT"
fi
xz -dc dist/carry/fleet-models-gpu-tests.tar.xz | tar xf - -C "$W"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
cat COMMIT 2>/dev/null
status=0
for t in fleet_models ops_grad parity qwen3_vl_parity train_grads generation fleet_serve \
  replica_process paged_attention paged_generation; do
  [ -x "$W/$t" ] || continue
  echo "== $t"
  # replica_process has its own main (it is also the worker it starts): no harness flags.
  if [ "$t" = replica_process ]; then args=(); else args=(--test-threads 1); fi
  "$W/$t" "${args[@]}" 2>&1 | grep -E '^test |test result|tests passed|panicked|FAILED|failures'
  rc=${PIPESTATUS[0]}
  echo "== $t: exit $rc"
  [ "$rc" = 0 ] || status=1
done
echo "== all: exit $status"
exit $status
