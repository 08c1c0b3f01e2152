// The fused kernels of ops/logp.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include "common.cuh"

// The gradient of sum_i g[i] * log_softmax(logits[i] / T)[target[i]] with respect to the
// logits: g[i] / T * (onehot(target[i]) - softmax(logits[i] / T)), statistics in f32, rounded
// once to T. One block per row.
template <typename T>
__device__ void logp_grad(const T *logits, const uint32_t *target, const float *g, T *out,
                          int n_rows, int vocab, float inv_t) {
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const T *lr = logits + (size_t)row * vocab;
    T *orow = out + (size_t)row * vocab;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, to_f(lr[j]) * inv_t);
    m = block_max(m);
    float s = 0.f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) s += expf(to_f(lr[j]) * inv_t - m);
    s = block_sum(s);
    const float gi = g[row] * inv_t, inv_s = 1.f / s;
    const int t = (int)target[row];
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float p = expf(to_f(lr[j]) * inv_t - m) * inv_s;
        orow[j] = from_f<T>(gi * ((j == t ? 1.f : 0.f) - p));
    }
}

#define LOGP_GRAD(T, SUFFIX)                                                                  \
    extern "C" __global__ void logp_grad_##SUFFIX(const T *logits, const uint32_t *target,    \
                                                  const float *g, T *out, int n_rows,         \
                                                  int vocab, float inv_t) {                   \
        logp_grad<T>(logits, target, g, out, n_rows, vocab, inv_t);                           \
    }
LOGP_GRAD(float, f32)
LOGP_GRAD(__half, f16)
LOGP_GRAD(__nv_bfloat16, bf16)

// Per row: the log-probability of the target and the entropy of softmax(logits * inv_t), as
// out[2 row] and out[2 row + 1]. z = logits * inv_t - max; logp = z[t] - log Z, H = log Z -
// sum(exp(z) z) / Z with Z = sum exp(z). One block per row; nothing of the row's size is written.
// A target outside the vocabulary gives a NaN log-prob (the CPU twin refuses it).
template <typename T>
__device__ void logp_entropy(const T *logits, const uint32_t *target, float *out, int n_rows,
                             int vocab, float inv_t) {
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const T *lr = logits + (size_t)row * vocab;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, to_f(lr[j]) * inv_t);
    m = block_max(m);
    float s = 0.f, sz = 0.f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float z = to_f(lr[j]) * inv_t - m;
        const float e = expf(z);
        s += e;
        sz += e * z;
    }
    s = block_sum(s);
    // block_sum's shared partials are reused by the next call: every thread has read the
    // first result before any writes the second.
    __syncthreads();
    sz = block_sum(sz);
    if (threadIdx.x == 0) {
        const float lse = logf(s);
        const uint32_t t = target[row];
        out[2 * (size_t)row] = t < (uint32_t)vocab ? to_f(lr[t]) * inv_t - m - lse : NAN;
        out[2 * (size_t)row + 1] = lse - sz / s;
    }
}

#define LOGP_ENTROPY(T, SUFFIX)                                                               \
    extern "C" __global__ void logp_entropy_##SUFFIX(const T *logits, const uint32_t *target, \
                                                     float *out, int n_rows, int vocab,       \
                                                     float inv_t) {                           \
        logp_entropy<T>(logits, target, out, n_rows, vocab, inv_t);                           \
    }
LOGP_ENTROPY(float, f32)
LOGP_ENTROPY(__half, f16)
LOGP_ENTROPY(__nv_bfloat16, bf16)

