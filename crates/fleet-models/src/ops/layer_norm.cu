// The kernels of ops/layer_norm.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include "common.cuh"

// LayerNorm as torch.nn.LayerNorm computes it for T inputs: mean and variance of the row in
// f32 (the variance about the mean, not E[x^2] - mean^2), y = T((x - mean) * rstd * w + b).
// `wb` is the weight followed by the bias (2n values). With h: s = T(x + h) is written to
// s_out first and normalised (the residual add before the norm). One block per row.
//
// The scalar kernel, for any row length and alignment: a thread reads back only the sums it
// wrote itself.
template <typename T>
__device__ void layer_norm_rows(const T *x, const T *h, const T *wb, T *s_out, T *y, int n_rows,
                                int n, float eps) {
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const size_t base = (size_t)row * n;
    const T *src = h ? s_out + base : x + base;
    float sum = 0.f;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        float f = to_f(x[base + c]);
        if (h) {
            const T s = from_f<T>(f + to_f(h[base + c]));
            s_out[base + c] = s;
            f = to_f(s);
        }
        sum += f;
    }
    const float mean = block_sum(sum) / n;
    __syncthreads(); // block_sum's shared memory is reused below
    float sq = 0.f;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const float d = to_f(src[c]) - mean;
        sq += d * d;
    }
    const float rstd = rsqrtf(block_sum(sq) / n + eps);
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        y[base + c] = from_f<T>((to_f(src[c]) - mean) * rstd * to_f(wb[c]) + to_f(wb[n + c]));
    }
}

// The one-pass kernel for rows of n = V * k elements (V = 16 / sizeof(T), 16-byte aligned
// rows): each thread holds up to VPT vectors of the row in registers, so x and h are read once
// and s written once; the same arithmetic as the scalar kernel.
template <typename T, int VPT>
__device__ void layer_norm_vec(const T *x, const T *h, const T *wb, T *s_out, T *y, int n_rows,
                               int n, float eps) {
    constexpr int V = 16 / sizeof(T);
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const int nv = n / V;
    const size_t base = (size_t)row * nv;
    const uint4 *xr = reinterpret_cast<const uint4 *>(x) + base;
    const uint4 *hr = h ? reinterpret_cast<const uint4 *>(h) + base : nullptr;
    uint4 sv[VPT];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        if (v >= nv) continue;
        uint4 a = xr[v];
        T *pa = reinterpret_cast<T *>(&a);
        if (hr) {
            uint4 b = hr[v];
            const T *pb = reinterpret_cast<const T *>(&b);
#pragma unroll
            for (int j = 0; j < V; ++j) pa[j] = from_f<T>(to_f(pa[j]) + to_f(pb[j]));
            reinterpret_cast<uint4 *>(s_out)[base + v] = a;
        }
#pragma unroll
        for (int j = 0; j < V; ++j) sum += to_f(pa[j]);
        sv[i] = a;
    }
    const float mean = block_sum(sum) / n;
    __syncthreads(); // block_sum's shared memory is reused below
    float sq = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        if (v >= nv) continue;
        const T *pa = reinterpret_cast<const T *>(&sv[i]);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float d = to_f(pa[j]) - mean;
            sq += d * d;
        }
    }
    const float rstd = rsqrtf(block_sum(sq) / n + eps);
    const uint4 *wv = reinterpret_cast<const uint4 *>(wb);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        if (v >= nv) continue;
        const uint4 wvec = wv[v], bvec = wv[nv + v];
        const T *pa = reinterpret_cast<const T *>(&sv[i]);
        const T *pw = reinterpret_cast<const T *>(&wvec);
        const T *pb = reinterpret_cast<const T *>(&bvec);
        uint4 o;
        T *po = reinterpret_cast<T *>(&o);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            po[j] = from_f<T>((to_f(pa[j]) - mean) * rstd * to_f(pw[j]) + to_f(pb[j]));
        }
        reinterpret_cast<uint4 *>(y)[base + v] = o;
    }
}

// out holds y (layer_norm) or s then y (add_layer_norm, 2 * n_rows * n values).
#define OPS(T, SUFFIX)                                                                           \
    extern "C" __global__ void layer_norm_##SUFFIX(const T *x, const T *wb, T *out, int n_rows, \
                                                   int n, float eps) {                          \
        layer_norm_rows<T>(x, nullptr, wb, nullptr, out, n_rows, n, eps);                        \
    }                                                                                            \
    extern "C" __global__ void add_layer_norm_##SUFFIX(const T *x, const T *h, const T *wb,     \
                                                       T *out, int n_rows, int n, float eps) {  \
        layer_norm_rows<T>(x, h, wb, out, out + (size_t)n_rows * n, n_rows, n, eps);            \
    }
#define VEC_OPS(T, SUFFIX, VPT)                                                                  \
    extern "C" __global__ void layer_norm_vec##VPT##_##SUFFIX(const T *x, const T *wb, T *out,  \
                                                              int n_rows, int n, float eps) {   \
        layer_norm_vec<T, VPT>(x, nullptr, wb, nullptr, out, n_rows, n, eps);                    \
    }                                                                                            \
    extern "C" __global__ void add_layer_norm_vec##VPT##_##SUFFIX(                              \
        const T *x, const T *h, const T *wb, T *out, int n_rows, int n, float eps) {            \
        layer_norm_vec<T, VPT>(x, h, wb, out, out + (size_t)n_rows * n, n_rows, n, eps);        \
    }
#define ALL_OPS(T, SUFFIX) OPS(T, SUFFIX) VEC_OPS(T, SUFFIX, 1) VEC_OPS(T, SUFFIX, 2) VEC_OPS(T, SUFFIX, 4)
ALL_OPS(float, f32)
ALL_OPS(__half, f16)
ALL_OPS(__nv_bfloat16, bf16)
