#!/usr/bin/env bash
# The diagnosis of 2026-11-27 on nvidia-h100-x2 (benchmarks/results/2026-11-27-h100x2-two-gpu-checks/):
# the three tests that failed with layers on two real GPUs, run again with cudarc's events kept
# (FLEET_CUDA_EVENTS=1), with blocking launches, with segment graphs off, and with everything on
# cuda:1 alone. Carried: dist/carry/two-gpu-tests.tar.xz, COMMIT.   bash scripts/gpu/diag_two_gpu.sh
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
T=/tmp/paged_tests; mkdir -p "$T"
[ -x "$T/train_grads" ] || xz -dc dist/carry/two-gpu-tests.tar.xz | tar xf - -C "$T"
[ -e /work/main/tests/fixtures ] || { mkdir -p /work; ln -sfn "$PWD" /work/main; }
for env in "X=1" "FLEET_CUDA_EVENTS=1" "CUDA_LAUNCH_BLOCKING=1" "FLEET_SEGMENT_GRAPHS=0"; do
  echo "######## $env"
  env $env FLEET_TEST_DEVICES=cuda:0,cuda:1 timeout 60 $T/train_grads --test-threads 1 tied 2>&1 | grep -E "rel err|test result"
  env $env FLEET_TEST_DEVICES=cuda:0,cuda:1 timeout 60 $T/qwen3_vl_parity --test-threads 1 dense_matches 2>&1 | grep -E "row|test result"
  env $env timeout 90 $T/decode_graph_segments --nocapture 2>&1 | grep -E "placement|test result|two real|logical"
done
echo "######## everything on cuda:1"
FLEET_TEST_DEVICES=cuda:1 timeout 60 $T/train_grads --test-threads 1 2>&1 | grep -E "rel err|test result"
FLEET_TEST_DEVICES=cuda:1 timeout 60 $T/qwen3_vl_parity --test-threads 1 dense_matches 2>&1 | grep -E "row|test result"
FLEET_TEST_DEVICES=cuda:1 timeout 60 $T/parity --test-threads 1 2>&1 | grep -E "test result|panicked"
