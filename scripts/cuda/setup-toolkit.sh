#!/usr/bin/env bash
# Assemble a CUDA 13.0 + NCCL 2.28 build toolkit from PyPI wheels, for
# building fleet with `--features cuda,nccl` on a machine that has no CUDA
# install and no GPU. See docs/gpu.md.
#
# Usage: scripts/cuda/setup-toolkit.sh [DIR]      (default: <repo>/.cuda/toolkit)
#
# Result (a CUDA_HOME-style tree):
#   DIR/bin/         nvcc, ptxas, fatbinary, nvlink, cudafe++, ...
#   DIR/nvvm/        cicc and libdevice (nvcc finds them via bin/nvcc.profile)
#   DIR/include/     CUDA 13.0 headers, CCCL (include/cccl, holds nv/target), nccl.h
#   DIR/lib/         libcudart/cublas/cublasLt/curand/nvrtc/nccl .so + unversioned links
#   DIR/lib/stubs/   libcuda.so: a link-time stub of the driver API (soname libcuda.so.1)
#   DIR/lib64 -> lib (where nvcc's own link step looks)
#
# Idempotent: if DIR already holds a toolkit built from the same pins by the
# same version of this script, it only re-checks it and prints the env.
# Wheels are cached in $FLEET_CUDA_WHEELS (default: <parent of DIR>/wheels).
# Set FLEET_CUDA_FORCE=1 to rebuild DIR from the cached wheels anyway.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
REQS="$SCRIPT_DIR/requirements-cuda13.txt"
DIR="${1:-$REPO/.cuda/toolkit}"
mkdir -p "$(dirname "$DIR")"
DIR="$(cd "$(dirname "$DIR")" && pwd)/$(basename "$DIR")"
WHEELS="${FLEET_CUDA_WHEELS:-$(dirname "$DIR")/wheels}"
PYTHON="${PYTHON:-python3}"
CUDARC_VERSION_DEFAULT=0.19.10
# Bump when the layout this script produces changes.
LAYOUT_VERSION=2

log() { printf '[setup-toolkit] %s\n' "$*" >&2; }
die() { printf '[setup-toolkit] error: %s\n' "$*" >&2; exit 1; }

for tool in "$PYTHON" gcc; do
    command -v "$tool" >/dev/null || die "'$tool' is required"
done
[ -f "$REQS" ] || die "missing $REQS"

# --- which cudarc's driver bindings the libcuda stub must cover -------------
cudarc_version() {
    local v=""
    if [ -f "$REPO/Cargo.lock" ]; then
        v="$(awk '/^name = "cudarc"$/ { getline; gsub(/version = |"/, ""); print; exit }' "$REPO/Cargo.lock")"
    fi
    echo "${v:-$CUDARC_VERSION_DEFAULT}"
}

find_cudarc_bindings() {
    local ver="$1" f
    for f in "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"cudarc-$ver"/src/driver/sys/mod.rs; do
        [ -f "$f" ] && { echo "$f"; return 0; }
    done
    return 1
}

CUDARC_VER="$(cudarc_version)"
STAMP="layout=$LAYOUT_VERSION reqs=$(sha256sum "$REQS" | cut -c1-16) cudarc=$CUDARC_VER"

print_env() {
    cat <<EOF

CUDA toolkit ready in $DIR
Either:   source scripts/cuda/env.sh        (uses FLEET_CUDA_TOOLKIT, default .cuda/toolkit)
or set:
  export CUDA_HOME="$DIR"
  export PATH="$DIR/bin:\$PATH"
  export CUDA_COMPUTE_CAP=90
  export LIBRARY_PATH="$DIR/lib:$DIR/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
  export CARGO_TARGET_DIR="$REPO/target/cuda"
then:     cargo build --release -p fleet --features cuda,nccl     (or scripts/cuda/build.sh)
EOF
}

# --- sanity checks, run on every invocation ---------------------------------
check_toolkit() {
    local tk="$1" tmp ver
    tmp="$(mktemp -d)"
    ver="$("$tk/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')"
    [ "$ver" = "13.0" ] || { rm -rf "$tmp"; die "nvcc reports release '$ver', expected 13.0"; }
    cat >"$tmp/t.cu" <<'EOF'
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void axpy(float a, const float *x, float *y, __half *h, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { y[i] = a * x[i] + y[i]; h[i] = __float2half(y[i]); }
}
EOF
    "$tk/bin/nvcc" -arch=sm_90 --ptx -std=c++17 "$tmp/t.cu" -o "$tmp/t.ptx" \
        || { rm -rf "$tmp"; die "nvcc could not compile a trivial kernel to PTX for sm_90"; }
    # CUDA 13.0 emits PTX ISA 9.0; a newer ISA would not load on a 13.0 driver.
    grep -q '^\.version 9\.0$' "$tmp/t.ptx" \
        || { rm -rf "$tmp"; die "unexpected PTX ISA: $(grep '^\.version' "$tmp/t.ptx")"; }
    rm -rf "$tmp"
    for f in lib/libcudart.so lib/libcublas.so lib/libcublasLt.so lib/libcurand.so \
             lib/libnvrtc.so lib/libnccl.so lib/stubs/libcuda.so include/nccl.h \
             include/cccl/nv/target nvvm/bin/cicc; do
        [ -e "$tk/$f" ] || die "toolkit is missing $f"
    done
}

if [ "${FLEET_CUDA_FORCE:-0}" != 1 ] && [ -f "$DIR/.fleet-toolkit" ] \
   && [ "$(cat "$DIR/.fleet-toolkit")" = "$STAMP" ]; then
    log "already set up ($STAMP); checking it"
    check_toolkit "$DIR"
    print_env
    exit 0
fi

# --- 1. download the pinned wheels ------------------------------------------
mkdir -p "$WHEELS"
log "downloading pinned wheels into $WHEELS"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --dest "$WHEELS" -r "$REQS"

# Map each pin to its wheel file (name_version-*.whl).
WHEEL_FILES=()
while read -r pin; do
    name="${pin%%==*}"; ver="${pin##*==}"
    f="$(ls "$WHEELS/${name//-/_}-${ver}-"*.whl 2>/dev/null | head -n1 || true)"
    [ -n "$f" ] || die "no wheel for $pin in $WHEELS"
    WHEEL_FILES+=("$f")
done < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$REQS" | grep -v '^$')

# --- 2. unpack them into one tree -------------------------------------------
# We unzip every wheel ourselves instead of `pip install --target`: pip skips a
# wheel whose top-level folder (nvidia/cu13) already exists, which silently
# dropped e.g. the cccl headers (nv/target, needed by cuda_fp16.h).
STAGE="$DIR.partial"
rm -rf "$STAGE"
mkdir -p "$STAGE/unpacked"
for f in "${WHEEL_FILES[@]}"; do
    log "unpacking $(basename "$f")"
    if command -v unzip >/dev/null; then
        unzip -q -o "$f" 'nvidia/*' -d "$STAGE/unpacked"
    else
        "$PYTHON" - "$f" "$STAGE/unpacked" <<'EOF'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        if not info.filename.startswith("nvidia/"):
            continue
        path = z.extract(info, sys.argv[2])
        mode = (info.external_attr >> 16) & 0o777
        if mode:
            os.chmod(path, mode)
EOF
    fi
done
CU="$STAGE/unpacked/nvidia/cu13"
NCCL="$STAGE/unpacked/nvidia/nccl"
[ -x "$CU/bin/nvcc" ] || die "nvcc not found in the unpacked wheels"
[ -f "$NCCL/lib/libnccl.so.2" ] || die "libnccl.so.2 not found in the unpacked wheels"

# --- 3. assemble the CUDA_HOME layout ---------------------------------------
# cu13 is already laid out like a toolkit: bin/nvcc.profile points nvcc at
# ../nvvm (cicc, libdevice), ../include and ../include/cccl. Keep it intact.
for d in bin include lib nvvm; do
    mv "$CU/$d" "$STAGE/$d"
done
chmod +x "$STAGE"/bin/* "$STAGE/nvvm/bin/cicc" 2>/dev/null || true
cp -a "$NCCL/include/." "$STAGE/include/"
cp -a "$NCCL/lib/libnccl.so.2" "$STAGE/lib/"
rm -rf "$STAGE/unpacked"

# nvcc's own link step (bin/nvcc.profile) searches lib64 and lib64/stubs, as in
# a standard install; the wheels ship lib/. Only needed to link with nvcc itself.
ln -sfn lib "$STAGE/lib64"

# Unversioned names for `-lfoo` (wheels ship only the sonames).
(
    cd "$STAGE/lib"
    for soname in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 \
                  libnvrtc.so.13 libcurand.so.10 libnccl.so.2; do
        [ -e "$soname" ] || die "missing $soname"
        ln -sfn "$soname" "${soname%.so.*}.so"
    done
)

# --- 4. libcuda stub ---------------------------------------------------------
# candle/cudarc use cudarc's `dynamic-linking`, so the binary links -lcuda, and
# no wheel ships libcuda (it comes with the driver). We link against a stub that
# defines every cu* entry point named by cudarc's driver bindings; every stub
# returns CUDA_ERROR_STUB_LIBRARY (34). Its soname is libcuda.so.1, so at run
# time the driver's real libcuda.so.1 is loaded. It is regenerated from the
# crate source each time (never committed).
BINDINGS="$(find_cudarc_bindings "$CUDARC_VER" || true)"
if [ -z "$BINDINGS" ]; then
    log "cudarc-$CUDARC_VER source not in the cargo registry; running cargo fetch"
    (cd "$REPO" && cargo fetch --quiet) || log "cargo fetch failed (workspace in flux?)"
    BINDINGS="$(find_cudarc_bindings "$CUDARC_VER" || true)"
fi
[ -n "$BINDINGS" ] || die "cannot find cudarc-$CUDARC_VER/src/driver/sys/mod.rs under ${CARGO_HOME:-$HOME/.cargo}/registry/src; run 'cargo fetch' in $REPO"
mkdir -p "$STAGE/lib/stubs" "$STAGE/stub-src"
STUB_C="$STAGE/stub-src/libcuda_stub.c"
{
    echo "/* Generated by scripts/cuda/setup-toolkit.sh from $BINDINGS. Link-time stub only. */"
    echo "#define STUB(name) int name(void) { return 34; /* CUDA_ERROR_STUB_LIBRARY */ }"
    sed -n 's/^pub unsafe fn \(cu[A-Za-z0-9_]*\)(.*/\1/p' "$BINDINGS" | sort -u | sed 's/.*/STUB(&)/'
} >"$STUB_C"
NSYMS="$(grep -c '^STUB(' "$STUB_C")"
[ "$NSYMS" -gt 400 ] || die "only $NSYMS cu* functions found in $BINDINGS; binding format changed?"
gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$STAGE/lib/stubs/libcuda.so" "$STUB_C"
log "libcuda stub: $NSYMS symbols (from cudarc-$CUDARC_VER)"
# NCCL needs no stub: the wheel's libnccl.so.2 is a real library that needs
# only libc/libstdc++ (it dlopens libcuda), so it links as is.

# --- 5. check, then publish atomically ---------------------------------------
check_toolkit "$STAGE"
echo "$STAMP" >"$STAGE/.fleet-toolkit"
rm -rf "$DIR"
mv "$STAGE" "$DIR"
log "done"
print_env
