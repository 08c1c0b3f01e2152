#!/usr/bin/env bash
# Issue 24 on one GPU, one call: logical devices' smoke test and memory cap
# (logical_smoke.sh, logical_cap.sh), both copy races caught with either wait off
# (tests/logical_races.rs), and transformers' goldens with the layers split over 2 and 3 logical
# devices: text and Qwen3-VL (dense and MoE) logits (tests/parity.rs, tests/qwen3_vl_parity.rs)
# and the training gradients with the policy split (tests/train_grads.rs), each also on one
# device.
#
# Carried: dist/carry/fleet.xz (scripts/cuda/build.sh -p fleet) and
# dist/carry/fleet-models-gpu-tests.tar.xz (the test executables `parity`, `qwen3_vl_parity`,
# `train_grads`, `logical_races`, built here with scripts/cuda/env.sh sourced by
# `cargo test --release --no-run -p fleet-models -p fleet --features fleet/cuda,fleet/nccl
# --test parity --test qwen3_vl_parity --test train_grads --test logical_races`, stripped). The
# executables find tests/fixtures through the path they were built at (BUILT_AT, default
# /work/main), so that path is made a link to this checkout when it is not one.
#   bash scripts/gpu/run_logical_checks.sh   # writes $OUT/logical_checks.log and
#                                            # $OUT/logical_runs.tgz (smoke and cap results)
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_logical_checks}"
W=/tmp/logical_checks
mkdir -p "$OUT" "$W" dist/cuda
LOG="$OUT/logical_checks.log"
exec > >(tee -a "$LOG") 2>&1
BUILT_AT="${BUILT_AT:-/work/main}"
if [ ! -e "$BUILT_AT/tests/fixtures" ]; then
  mkdir -p "$(dirname "$BUILT_AT")" && ln -sfn "$PWD" "$BUILT_AT"
fi
ls "$BUILT_AT/tests/fixtures" > /dev/null || echo "fixtures not reachable at $BUILT_AT"
[ -x dist/cuda/fleet ] || { xz -dc dist/carry/fleet.xz > dist/cuda/fleet && chmod +x dist/cuda/fleet; }
xz -dc dist/carry/fleet-models-gpu-tests.tar.xz | tar xf - -C "$W"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
status=0
check() { # name, command...
  local name="$1"; shift
  echo "== $name"
  "$@"
  local rc=$?
  echo "== $name: exit $rc"
  [ "$rc" = 0 ] || status=1
}

echo "### smoke"
bash scripts/gpu/logical_smoke.sh
echo "### cap"
bash scripts/gpu/logical_cap.sh
echo "### races"
check logical_races "$W/logical_races" --nocapture --test-threads 1

echo "### goldens on split layers"
# One device, then the layers split over 2 and 3 logical devices (8 GiB each) of this GPU.
for devices in cuda:0 cuda:0,cuda:1 cuda:0,cuda:1,cuda:2; do
  for t in parity qwen3_vl_parity train_grads; do
    if [ "$devices" = cuda:0 ]; then
      check "$t on $devices (physical)" env FLEET_TEST_DEVICES="$devices" "$W/$t" --test-threads 1
    else
      check "$t on $devices (logical devices on one GPU)" env FLEET_LOGICAL_GPUS=3:8GiB \
        FLEET_TEST_DEVICES="$devices" "$W/$t" --test-threads 1
    fi
  done
done
echo "overall: exit $status"
# A call brings back few files: the smoke and cap results travel as one archive.
tar -C "$OUT" -czf "$OUT/logical_runs.tgz" logical logical_cap && rm -rf "$OUT/logical" "$OUT/logical_cap"
exit $status
