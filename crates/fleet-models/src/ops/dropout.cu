// The kernel of ops/dropout.rs, compiled to PTX by build.rs (feature `cuda`); the launcher and
// the CPU twin are in the .rs file of the same name.
#include "common.cuh"

namespace {

// SplitMix64's output for state z (the CPU twin's `splitmix`).
__device__ __forceinline__ unsigned long long splitmix(unsigned long long z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// Element i of a dropout mask of `key`: keep (the scale 1 / (1 - p)) when the uniform draw
// u = top 24 bits of splitmix(key ^ i * C) / 2^24 is at least p, else 0 — the CPU twin's
// arithmetic, so a key gives the same mask on both. Stateless: no generator to seed, and the
// same values inside a CUDA graph.
template <typename T>
__device__ void dropout_mask(T *out, unsigned long long n, unsigned long long key, float p,
                             float keep) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        const float u = (float)(splitmix(key ^ (i * 0xd1b54a32d192ed03ULL)) >> 40) / 16777216.0f;
        out[i] = from_f<T>(u >= p ? keep : 0.0f);
    }
}

} // namespace

#define OPS(T, SUFFIX)                                                                          \
    extern "C" __global__ void dropout_mask_##SUFFIX(T *out, unsigned long long n,             \
                                                     unsigned long long key, float p,          \
                                                     float keep) {                             \
        dropout_mask<T>(out, n, key, p, keep);                                                  \
    }
OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)
