// The fused kernels of ops/masked_softmax.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include "common.cuh"

// Softmax over the last axis of attention scores with the causal and left-padding mask applied
// on the fly (no mask tensor). Row r of the [n_rows, kv_len] scores belongs to batch row
// r / rows_per_batch and query i = r % q_len, at absolute position offset + i. Key j is visible
// when j <= offset + i and (j >= pad[batch] or j is the query itself); with `per_query`, pad
// holds one start per query ([batch][q_len]: sequences packed into one row) and pad[batch][i]
// takes pad[batch]'s place. Statistics in f32. One warp per row.
template <typename T>
__device__ void masked_softmax(const T *x, T *y, const uint32_t *pad, int n_rows,
                               int rows_per_batch, int q_len, int kv_len, int offset,
                               int per_query) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    const int lane = threadIdx.x;
    if (row >= n_rows) return;
    const int qi = offset + row % q_len;
    const int p = per_query ? (int)pad[(long)(row / rows_per_batch) * q_len + row % q_len]
                            : (int)pad[row / rows_per_batch];
    const T *xr = x + (size_t)row * kv_len;
    T *yr = y + (size_t)row * kv_len;
    const int end = min(kv_len, qi + 1);

    float m = -INFINITY;
    for (int j = lane; j < end; j += 32) {
        if (j >= p || j == qi) m = fmaxf(m, to_f(xr[j]));
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    float s = 0.f;
    for (int j = lane; j < end; j += 32) {
        if (j >= p || j == qi) s += expf(to_f(xr[j]) - m);
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    const float inv = 1.f / s;
    for (int j = lane; j < kv_len; j += 32) {
        const bool visible = j < end && (j >= p || j == qi);
        yr[j] = from_f<T>(visible ? expf(to_f(xr[j]) - m) * inv : 0.f);
    }
}

// Backward of `masked_softmax`: dx = y * (g - sum(g * y)) per row (masked keys have y = 0, so
// dx = 0 there), in f32, rounded once to T. One warp per row, as the forward.
template <typename T>
__device__ void masked_softmax_bwd(const T *y, const T *g, T *dx, int n_rows, int kv_len) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    const int lane = threadIdx.x;
    if (row >= n_rows) return;
    const T *yr = y + (size_t)row * kv_len;
    const T *gr = g + (size_t)row * kv_len;
    T *dr = dx + (size_t)row * kv_len;
    float dot = 0.f;
    for (int j = lane; j < kv_len; j += 32) dot += to_f(gr[j]) * to_f(yr[j]);
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, o);
    for (int j = lane; j < kv_len; j += 32) {
        const float yv = to_f(yr[j]);
        dr[j] = from_f<T>(yv * (to_f(gr[j]) - dot));
    }
}

#define OPS(T, SUFFIX)                                                                             \
    extern "C" __global__ void masked_softmax_##SUFFIX(const T *x, T *y, const uint32_t *pad, \
                                                       int n_rows, int rows_per_batch,       \
                                                       int q_len, int kv_len, int offset,    \
                                                       int per_query) {                      \
        masked_softmax<T>(x, y, pad, n_rows, rows_per_batch, q_len, kv_len, offset,          \
                          per_query);                                                         \
    }                                                                                         \
    extern "C" __global__ void masked_softmax_bwd_##SUFFIX(const T *y, const T *g, T *dx,   \
                                                           int n_rows, int kv_len) {         \
        masked_softmax_bwd<T>(y, g, dx, n_rows, kv_len);                                      \
    }
OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)
