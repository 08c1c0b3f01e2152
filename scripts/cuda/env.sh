# Environment for CUDA builds of fleet. Source it (bash/zsh):
#
#   source scripts/cuda/env.sh
#   cargo build --release -p fleet --features cuda,nccl
#
# Toolkit: $FLEET_CUDA_TOOLKIT if set, else <repo>/.cuda/toolkit (made by
# scripts/cuda/setup-toolkit.sh from pinned CUDA 13.0 wheels). To use a normal
# CUDA install instead: FLEET_CUDA_TOOLKIT=/usr/local/cuda source scripts/cuda/env.sh
# (a real install has lib64/stubs/libcuda.so; nothing else here is wheel-specific).
#
# Compute capability defaults to 90 (H100/H200); override with CUDA_COMPUTE_CAP.
# CUDA builds go to target/cuda so they never mix with CPU builds in target/.

if [ -n "${BASH_SOURCE[0]:-}" ]; then
    _fleet_env_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
else # zsh
    _fleet_env_here="$(cd "$(dirname "${(%):-%x}")" && pwd)"
fi
_fleet_repo="$(cd "$_fleet_env_here/../.." && pwd)"
_fleet_tk="${FLEET_CUDA_TOOLKIT:-$_fleet_repo/.cuda/toolkit}"

if [ ! -x "$_fleet_tk/bin/nvcc" ]; then
    echo "scripts/cuda/env.sh: no nvcc in $_fleet_tk/bin; run scripts/cuda/setup-toolkit.sh first" >&2
    unset _fleet_env_here _fleet_repo _fleet_tk
    return 1 2>/dev/null || exit 1
fi

export FLEET_CUDA_TOOLKIT="$_fleet_tk"
export CUDA_HOME="$_fleet_tk"
export CUDA_PATH="$_fleet_tk"
case ":$PATH:" in
    *":$_fleet_tk/bin:"*) ;;
    *) export PATH="$_fleet_tk/bin:$PATH" ;;
esac
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"

# Link-time search path: lib (cudart, cublas, nccl, ...) and lib/stubs
# (libcuda.so). cudarc's build script also adds $CUDA_HOME/lib{,64}{,/stubs};
# candle-kernels links -lcudart without a search path of its own, so keep
# LIBRARY_PATH as a belt-and-braces for every linker invocation.
for _fleet_d in "$_fleet_tk/lib64/stubs" "$_fleet_tk/lib64" "$_fleet_tk/lib/stubs" "$_fleet_tk/lib"; do
    if [ -d "$_fleet_d" ]; then
        case ":${LIBRARY_PATH:-}:" in
            *":$_fleet_d:"*) ;;
            *) export LIBRARY_PATH="$_fleet_d${LIBRARY_PATH:+:$LIBRARY_PATH}" ;;
        esac
    fi
done

export CARGO_TARGET_DIR="${FLEET_CUDA_TARGET_DIR:-$_fleet_repo/target/cuda}"

# candle-kernels links a static library of quantized/MoE kernels as sm_90a
# cubins (~33 MB uncompressed inside every binary). nvcc appends these flags to
# every call; fatbin compression cuts that to ~8 MB, which matters for the
# 64 MiB that can be carried to the GPU machine. The 13.0 driver decompresses
# them at load. Cargo does not track this variable: after changing it, run
# `cargo clean --release -p candle-kernels` (with this env) to rebuild the kernels.
export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:---compress-mode=size}"

unset _fleet_env_here _fleet_repo _fleet_tk _fleet_d
