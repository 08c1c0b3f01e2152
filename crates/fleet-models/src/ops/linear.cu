// The fused kernels of ops/linear.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include "common.cuh"

template <typename T>
__device__ void add_bias_rows(T *y, const T *bias, long long n_rows, int n_cols) {
    const long long n = n_rows * n_cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = from_f<T>(to_f(y[i]) + to_f(bias[i % n_cols]));
    }
}

#define ADD_BIAS(T, SUFFIX)                                                                    \
    extern "C" __global__ void add_bias_rows_##SUFFIX(T *y, const T *bias, long long n_rows,   \
                                                      int n_cols) {                            \
        add_bias_rows<T>(y, bias, n_rows, n_cols);                                             \
    }
ADD_BIAS(float, f32)
ADD_BIAS(__half, f16)
ADD_BIAS(__nv_bfloat16, bf16)


// y[m][col] = sum_k x[m][k] w[col][k] for M (1..4) rows of x: a decode step's product, bound
// by reading w once. One warp per output column `col`: lane l sums the 8-element chunks
// l, l + 32, ... of the row in order (f32 fused multiply-adds, the twin's order), four chunks'
// 16-byte loads of w in flight at a time (streamed: evict first), x's rows through L1; then
// the xor butterfly over the warp, rounded once to T.
template <typename T> __device__ __forceinline__ void unpack8(const uint4 &v, float *out) {
    T t[8];
    memcpy(t, &v, sizeof(uint4));
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = to_f(t[e]);
}

template <typename T, int M>
__device__ void gemv(const T *x, const T *w, T *y, int n, int k) {
    const int lane = threadIdx.x % 32;
    const int col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (col >= n) return;
    const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)col * k);
    const int chunks = k / 8;
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.f;
    auto fma_chunk = [&](const uint4 &wv, int c) {
        float wf[8];
        unpack8<T>(wv, wf);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xf[8];
            unpack8<T>(__ldg(reinterpret_cast<const uint4 *>(x + (size_t)m * k) + c), xf);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m] = __fmaf_rn(xf[e], wf[e], acc[m]);
        }
    };
    int c = lane;
    for (; c + 96 < chunks; c += 128) {
        uint4 wv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) wv[u] = __ldcs(wr + c + 32 * u);
#pragma unroll
        for (int u = 0; u < 4; ++u) fma_chunk(wv[u], c + 32 * u);
    }
    for (; c < chunks; c += 32) fma_chunk(__ldcs(wr + c), c);
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffff, acc[m], o);
    }
    if (lane == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) y[(size_t)m * n + col] = from_f<T>(acc[m]);
    }
}

#define GEMV(T, SUFFIX, M)                                                                     \
    extern "C" __global__ void gemv_##SUFFIX##_m##M(const T *x, const T *w, T *y, int n,       \
                                                    int k) {                                   \
        gemv<T, M>(x, w, y, n, k);                                                             \
    }
#define GEMVS(T, SUFFIX)                                                                       \
    GEMV(T, SUFFIX, 1)                                                                         \
    GEMV(T, SUFFIX, 2)                                                                         \
    GEMV(T, SUFFIX, 3)                                                                         \
    GEMV(T, SUFFIX, 4)
GEMVS(__half, f16)
GEMVS(__nv_bfloat16, bf16)
