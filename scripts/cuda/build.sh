#!/usr/bin/env bash
# Build fleet's CUDA+NCCL binaries and put stripped copies in dist/cuda/.
#
# Usage: scripts/cuda/build.sh [extra cargo args...]
#   default package: -p fleet (left out when you pass -p/--package/--workspace)
#   e.g. scripts/cuda/build.sh                 -> dist/cuda/fleet
#        scripts/cuda/build.sh -p fleet --bin fleet
#
# Runs `cargo build --release --features cuda,nccl` with scripts/cuda/env.sh
# (toolkit from scripts/cuda/setup-toolkit.sh, CUDA_COMPUTE_CAP=90,
# CARGO_TARGET_DIR=target/cuda). The first build compiles candle-kernels with
# nvcc and takes ~15 min on 2 cores; later builds reuse target/cuda.
#
# Running on the GPU machine (CUDA 13.0 driver, NCCL 2.28 in
# /usr/lib/x86_64-linux-gnu): the binaries link libcuda.so.1 (the driver's),
# libcudart/cublas/cublasLt/curand/nvrtc (.so.13/.so.10) and libnccl.so.2, with
# no rpath. Always run them with
#     LD_LIBRARY_PATH=/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 ./fleet devices
# NCCL_NVLS_ENABLE=0 must ALWAYS be set there: NVLink multicast (NVLS) must stay
# off on those machines. Stripping keeps the binaries within the 64 MiB total
# that can be carried to the GPU machine.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
DIST="${FLEET_CUDA_DIST:-$REPO/dist/cuda}"

# shellcheck source=env.sh
source "$SCRIPT_DIR/env.sh"
cd "$REPO"

args=("$@")
pkg_given=0
for a in "${args[@]+"${args[@]}"}"; do
    case "$a" in
        -p|-p*|--package|--package=*|--workspace|--all) pkg_given=1 ;;
    esac
done
[ "$pkg_given" = 1 ] || args=(-p fleet "${args[@]+"${args[@]}"}")

msgs="$(mktemp)"
trap 'rm -f "$msgs"' EXIT

echo "[build] CUDA_HOME=$CUDA_HOME CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP CARGO_TARGET_DIR=$CARGO_TARGET_DIR" >&2
echo "[build] cargo build --release --features cuda,nccl ${args[*]}" >&2
start=$(date +%s)
cargo build --release --features cuda,nccl --message-format=json-render-diagnostics \
    "${args[@]}" >"$msgs"
echo "[build] cargo finished in $(( $(date +%s) - start ))s" >&2

# The executables cargo just produced (bins only; not examples/tests).
mapfile -t exes < <(python3 - "$msgs" <<'EOF'
import json, sys
seen = set()
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    if "bin" not in m["target"]["kind"]:
        continue
    if m["executable"] not in seen:
        seen.add(m["executable"])
        print(m["executable"])
EOF
)
[ "${#exes[@]}" -gt 0 ] || { echo "[build] no binaries were built" >&2; exit 1; }

mkdir -p "$DIST"
for exe in "${exes[@]}"; do
    out="$DIST/$(basename "$exe")"
    strip --strip-all -o "$out.tmp" "$exe"
    mv -f "$out.tmp" "$out"
    echo "[build] $out: $(du -h "$out" | cut -f1) stripped ($(du -h "$exe" | cut -f1) unstripped)" >&2
    echo "[build]   needs: $(readelf -d "$out" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')" >&2
done
echo "[build] total in $DIST: $(du -sh "$DIST" | cut -f1)" >&2
echo "[build] on the GPU machine: LD_LIBRARY_PATH=/usr/local/cuda/lib64 NCCL_NVLS_ENABLE=0 ./fleet devices" >&2
