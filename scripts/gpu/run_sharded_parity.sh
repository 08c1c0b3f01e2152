#!/usr/bin/env bash
# The f32 parity tests (text: tests/parity.rs; vision-language: tests/qwen3_vl_parity.rs) with
# the decoder's layers split over two GPUs (FLEET_TEST_DEVICES=cuda:0,cuda:1), then on one GPU,
# on nvidia-h200-x2; then tests/ops_grad.rs's kernel checks. Checks the layer-sharded paths against transformers' goldens (1e-4), the
# VL deepstack features crossing to the second GPU included.
#
# Carried: dist/carry/fleet-models-gpu-tests.tar.xz (built here: with scripts/cuda/env.sh
# sourced, `cargo test --no-run --release -p fleet-models --features cuda --test parity
# --test qwen3_vl_parity --test ops_grad` in a worktree at /tmp/wt-cuda, the executables
# stripped and put in one tar as `parity`, `qwen3_vl_parity` and `ops_grad`). The binaries find tests/fixtures through the
# path they were built at, so /tmp/wt-cuda is made a link to this checkout. Run from the repo
# root; writes $OUT/sharded-parity.log.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_sharded_parity}"
W="${WORK:-/tmp/sharded_parity}"
mkdir -p "$OUT" "$W"
LOG="$OUT/sharded-parity.log"
exec > >(tee -a "$LOG") 2>&1
[ -e /tmp/wt-cuda ] || ln -sfn "$PWD" /tmp/wt-cuda
xz -dc dist/carry/fleet-models-gpu-tests.tar.xz | tar xf - -C "$W"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
status=0
for devices in cuda:0,cuda:1 cuda:0; do
  for t in parity qwen3_vl_parity; do
    echo "== $t on $devices"
    FLEET_TEST_DEVICES="$devices" "$W/$t" --test-threads 1
    rc=$?
    echo "== $t on $devices: exit $rc"
    [ "$rc" = 0 ] || status=1
  done
done
# The fused kernels against their CPU twins (the decoder's ops, and the training head's
# logp_entropy / logp_grad at the 152k vocabulary).
echo "== ops_grad kernels_match on cuda:0"
"$W/ops_grad" kernels_match --test-threads 1 --nocapture
rc=$?
echo "== ops_grad kernels_match: exit $rc"
[ "$rc" = 0 ] || status=1
exit $status
