// The fused kernels of ops/sample.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include "common.cuh"

// One sampled token per row by the Gumbel-max trick (see ops.rs `sample_gumbel`): the argmax
// over v of logits[v] * inv_t - ln(-ln(u(seed, counter, v))), u from SplitMix64's finaliser.
// One block of 1024 threads per row; ties go to the lowest index, as on the CPU.
__device__ __forceinline__ float gumbel_uniform(unsigned long long seed, unsigned int counter,
                                                unsigned int v) {
    unsigned long long x = seed ^ ((unsigned long long)counter * 0x9E3779B97F4A7C15ull) ^
                           ((unsigned long long)v * 0xD1B54A32D192ED03ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return ((float)(x >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

extern "C" __global__ void sample_gumbel(const float *logits, const uint32_t *params,
                                         uint32_t *out, int vocab) {
    const int r = blockIdx.x;
    const uint32_t *p = params + 4 * (size_t)r;
    const unsigned long long seed = (unsigned long long)p[0] | ((unsigned long long)p[1] << 32);
    const unsigned int counter = p[2];
    const float inv_t = __uint_as_float(p[3]);
    const float *row = logits + (size_t)r * vocab;
    float best = -INFINITY;
    int best_v = 0x7fffffff;
    for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
        const float u = gumbel_uniform(seed, counter, (unsigned int)v);
        const float score = row[v] * inv_t - logf(-logf(u));
        if (score > best || (score == best && v < best_v)) {
            best = score;
            best_v = v;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float s = __shfl_xor_sync(0xffffffff, best, o);
        const int i = __shfl_xor_sync(0xffffffff, best_v, o);
        if (s > best || (s == best && i < best_v)) {
            best = s;
            best_v = i;
        }
    }
    __shared__ float sb[32];
    __shared__ int si[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        sb[warp] = best;
        si[warp] = best_v;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < (blockDim.x + 31) / 32 ? sb[lane] : -INFINITY;
        best_v = lane < (blockDim.x + 31) / 32 ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            const float s = __shfl_xor_sync(0xffffffff, best, o);
            const int i = __shfl_xor_sync(0xffffffff, best_v, o);
            if (s > best || (s == best && i < best_v)) {
                best = s;
                best_v = i;
            }
        }
        if (lane == 0) out[r] = (uint32_t)(best_v == 0x7fffffff ? 0 : best_v);
    }
}

