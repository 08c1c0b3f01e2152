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


// y[m][col] = sum_k x[m][k] w[col][k] for 5..64 rows of x on the tensor cores
// (mma.sync.m16n8k16, f32 accumulators): a decode step of 5 to 64 sequences, still bound by
// reading w once, where cuBLAS's kernels for so few rows reached 1.0-1.6 TB/s of an H100's
// 3.35 (ncu, 0.5B at 64 rows).
//
// The product is computed transposed, w as the mma's A operand (16 output columns per warp)
// and x as B (8 of its rows per n-tile, NT tiles): the few rows fill the mma's narrow side.
// Fragments are loaded straight from memory, 16 bytes per thread: within each 32-wide block of
// k, thread q of a quad loads elements 8q..8q+7 of its row, which the fragment layout reads as
// k = {2q, 2q+1, 2q+8, 2q+9} of two consecutive k-steps. Both operands use the same
// permutation of k, so the sum over k is the product's. w streams from memory once (evict
// first); the block's 64 columns share x, staged in shared memory 128 k at a time. Long k with
// few column tiles is split over blocks (gridDim.y): each split writes f32 partials and the
// split that finishes last sums them in split order (deterministic: replays and plain steps
// give the same values) and rounds once to T; its counter is reset for the next launch.
#define SK_WARPS 4
#define SK_COLS (16 * SK_WARPS)
#define SK_KB 32
#define SK_UNROLL 4
#define SK_KCHUNK (SK_KB * SK_UNROLL)
#define SK_XSTRIDE (SK_KCHUNK + 8)

// This thread's 16-byte pieces of its two w rows (g and g + 8 of the warp's 16) for the
// SK_UNROLL k-blocks of the chunk at kc (zeros past `kn` or for a warp past the last column).
template <typename T>
__device__ __forceinline__ void skinny_load_w(const T *w0, const T *w8, int kc, int kn, int q, bool live,
                                              uint4 *wa, uint4 *wb) {
#pragma unroll
    for (int u = 0; u < SK_UNROLL; ++u) {
        if (live && u * SK_KB < kn) {
            wa[u] = __ldcs(reinterpret_cast<const uint4 *>(w0 + kc + u * SK_KB + 8 * q));
            wb[u] = __ldcs(reinterpret_cast<const uint4 *>(w8 + kc + u * SK_KB + 8 * q));
        } else {
            wa[u] = make_uint4(0, 0, 0, 0);
            wb[u] = make_uint4(0, 0, 0, 0);
        }
    }
}

template <typename T, int NT>
__device__ void skinny_gemm(const T *x, const T *w, T *y, float *partial, unsigned *counters, int m, int n,
                            int k, int k_per_split) {
    __shared__ __align__(16) T xs[NT * 8][SK_XSTRIDE];
    __shared__ bool last_split;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, q = lane & 3;
    const int col0 = blockIdx.x * SK_COLS + warp * 16;  // n is a multiple of 16
    const bool live = col0 < n;
    const int splits = gridDim.y;
    const int k0 = blockIdx.y * k_per_split, k1 = min(k, k0 + k_per_split);
    const T *w0 = w + (size_t)(live ? col0 + g : 0) * k;
    const T *w8 = w0 + (size_t)8 * k;
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    uint4 wa[SK_UNROLL], wb[SK_UNROLL], na[SK_UNROLL], nb[SK_UNROLL];
    skinny_load_w<T>(w0, w8, k0, k1 - k0, q, live, wa, wb);
    for (int kc = k0; kc < k1; kc += SK_KCHUNK) {
        const int kn = min(SK_KCHUNK, k1 - kc);  // a multiple of 32
        __syncthreads();  // the chunk before is read
        for (int i = threadIdx.x; i < NT * 8 * (SK_KCHUNK / 8); i += blockDim.x) {
            const int r = i / (SK_KCHUNK / 8), c = i % (SK_KCHUNK / 8);
            uint4 v = make_uint4(0, 0, 0, 0);
            if (r < m && c * 8 < kn) v = __ldg(reinterpret_cast<const uint4 *>(x + (size_t)r * k + kc + c * 8));
            *reinterpret_cast<uint4 *>(&xs[r][c * 8]) = v;
        }
        __syncthreads();
        // The next chunk's w is in flight while this one is multiplied.
        if (kc + SK_KCHUNK < k1) skinny_load_w<T>(w0, w8, kc + SK_KCHUNK, k1 - kc - SK_KCHUNK, q, live, na, nb);
#pragma unroll
        for (int u = 0; u < SK_UNROLL; ++u) {
            if (u * SK_KB < kn) {
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const uint4 xv = *reinterpret_cast<const uint4 *>(&xs[t * 8 + g][u * SK_KB + 8 * q]);
                    const uint32_t a0[4] = {wa[u].x, wb[u].x, wa[u].y, wb[u].y};
                    const uint32_t b0[2] = {xv.x, xv.y};
                    mma16816<T>(acc[t], a0, b0);
                    const uint32_t a1[4] = {wa[u].z, wb[u].z, wa[u].w, wb[u].w};
                    const uint32_t b1[2] = {xv.z, xv.w};
                    mma16816<T>(acc[t], a1, b1);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < SK_UNROLL; ++u) {
            wa[u] = na[u];
            wb[u] = nb[u];
        }
    }
    // acc[t]: columns col0 + g (0, 1) and col0 + g + 8 (2, 3), x rows t * 8 + 2q and + 1.
    if (splits == 1) {
        if (!live) return;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = t * 8 + 2 * q + (e & 1), col = col0 + g + (e >> 1) * 8;
                if (row < m) y[(size_t)row * n + col] = from_f<T>(acc[t][e]);
            }
        }
        return;
    }
    if (live) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = t * 8 + 2 * q + (e & 1), col = col0 + g + (e >> 1) * 8;
                if (row < m) partial[((size_t)blockIdx.y * m + row) * n + col] = acc[t][e];
            }
        }
    }
    __threadfence();  // the partials are visible before this split counts as done
    __syncthreads();
    if (threadIdx.x == 0) last_split = atomicAdd(&counters[blockIdx.x], 1u) == (unsigned)(splits - 1);
    __syncthreads();
    if (!last_split) return;
    __threadfence();
    for (int i = threadIdx.x; i < m * SK_COLS; i += blockDim.x) {
        const int row = i / SK_COLS, col = blockIdx.x * SK_COLS + i % SK_COLS;
        if (col >= n) continue;
        float s = 0.f;
        for (int p = 0; p < splits; ++p) s += __ldcg(&partial[((size_t)p * m + row) * n + col]);
        y[(size_t)row * n + col] = from_f<T>(s);
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

#define SKINNY(T, SUFFIX, NT)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * SK_WARPS)                                \
        skinny_gemm_##SUFFIX##_t##NT(const T *x, const T *w, T *y, float *partial,             \
                                     unsigned *counters, int m, int n, int k, int k_per_split) { \
        skinny_gemm<T, NT>(x, w, y, partial, counters, m, n, k, k_per_split);                  \
    }
#define SKINNYS(T, SUFFIX)                                                                     \
    SKINNY(T, SUFFIX, 1)                                                                       \
    SKINNY(T, SUFFIX, 2)                                                                       \
    SKINNY(T, SUFFIX, 4)                                                                       \
    SKINNY(T, SUFFIX, 8)
SKINNYS(__half, f16)
SKINNYS(__nv_bfloat16, bf16)
