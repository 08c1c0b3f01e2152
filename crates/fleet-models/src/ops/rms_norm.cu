// The fused kernels of ops/rms_norm.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include "common.cuh"

// RMSNorm as transformers' Qwen2RMSNorm computes it: y = w * T(x * rsqrt(mean(x^2) + eps)),
// statistics in f32, the normalised value rounded to T before the product with the weight.
// One block per row.
// The second pass of both RMSNorm kernels: yr = T(T(sr * inv) * w) over one row, with
// inv = rsqrt(mean(s^2) + eps) from the block's sum of squares `ss` (every thread calls it).
template <typename T>
__device__ void write_normed(const T *sr, const T *w, T *yr, int n, float ss, float eps) {
    const float inv = rsqrtf(block_sum(ss) / n + eps);
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        yr[c] = from_f<T>(rnd<T>(to_f(sr[c]) * inv) * to_f(w[c]));
    }
}

template <typename T>
__device__ void rms_norm(const T *x, const T *w, T *y, int n_rows, int n, float eps) {
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const T *xr = x + (size_t)row * n;
    float ss = 0.f;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const float f = to_f(xr[c]);
        ss += f * f;
    }
    write_normed(xr, w, y + (size_t)row * n, n, ss, eps);
}

// Residual add fused with the RMSNorm that follows it: out[0] = x + h (rounded to T), and
// out[1] = w * T(s * rsqrt(mean(s^2) + eps)) with s = out[0], rounded as transformers rounds
// (the normalised value to T first, then the product with the weight). One block per row.
template <typename T>
__device__ void add_rms_norm(const T *x, const T *h, const T *w, T *out, int n_rows, int n,
                             float eps) {
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const T *xr = x + (size_t)row * n;
    const T *hr = h + (size_t)row * n;
    T *sr = out + (size_t)row * n;
    T *yr = out + (size_t)n_rows * n + (size_t)row * n;
    float ss = 0.f;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const T s = from_f<T>(to_f(xr[c]) + to_f(hr[c]));
        sr[c] = s;
        const float f = to_f(s);
        ss += f * f;
    }
    // Each thread reads back only the sums it wrote itself.
    write_normed(sr, w, yr, n, ss, eps);
}

// One-pass variants of both for rows of n = V * k elements (V = 16 / sizeof(T): 16-byte
// vectors, 16-byte aligned rows): `norm_row_vec` (common.cuh) on row blockIdx.x. A decode
// step's norms are one block per row: the scalar kernel's three dependent trips to memory were
// most of its ~7 us. h == nullptr: plain RMSNorm (s = x, nothing written but y).
template <typename T, int VPT>
__device__ void norm_rows_vec(const T *x, const T *h, const T *w, T *s_out, T *y, int n_rows,
                              int n, float eps) {
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const size_t base = (size_t)row * n;
    norm_row_vec<T, VPT>(x + base, h ? h + base : nullptr, w, h ? s_out + base : nullptr,
                         y + base, n, eps);
}

// Backward of RMSNorm (y = w * T(s * r), r = rsqrt(mean(s^2) + eps)) for one row per block:
// dn = gy * w, ds = r * (dn - n * mean(dn * n)) with n = s * r, plus gs (the gradient of the
// residual output of add_rms_norm) when has_gs. Writes ds in f32 and r per row (for dw).
template <typename T>
__device__ void rms_norm_bwd_rows(const T *s, const T *w, const T *gs, const T *gy, float *ds,
                                  float *inv_out, int n_rows, int n, float eps, int has_gs) {
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const T *sr = s + (size_t)row * n;
    const T *gr = gy + (size_t)row * n;
    float ss = 0.f;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const float f = to_f(sr[c]);
        ss += f * f;
    }
    const float r = rsqrtf(block_sum(ss) / n + eps);
    __syncthreads(); // block_sum's shared memory is reused below
    float dot = 0.f;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        dot += to_f(gr[c]) * to_f(w[c]) * (to_f(sr[c]) * r);
    }
    const float proj = block_sum(dot) / n;
    float *dr = ds + (size_t)row * n;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const float normed = to_f(sr[c]) * r;
        float v = r * (to_f(gr[c]) * to_f(w[c]) - normed * proj);
        if (has_gs) v += to_f(gs[(size_t)row * n + c]);
        dr[c] = v;
    }
    if (threadIdx.x == 0) inv_out[row] = r;
}

// The same backward for rows of whole 16-byte vectors (as norm_rows_vec), each thread holding
// up to VPT vectors of s, gy and w in registers: every input read once, where the kernel above
// walks each row three times with one element a thread (ncu: 17% of the bandwidth on a 1.5B
// micro-step). The same formula; its sums run in another order, so the results may differ
// from the kernel above in the last bits.
template <typename T, int VPT>
__device__ void rms_norm_bwd_rows_vec(const T *s, const T *w, const T *gs, const T *gy,
                                      float *ds, float *inv_out, int n_rows, int n, float eps,
                                      int has_gs) {
    constexpr int V = Vec16<T>::N;
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const int nv = n / V;
    const size_t base = (size_t)row * n;
    Vec16<T> sv[VPT], gv[VPT], wv[VPT];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        if (v >= nv) continue;
        sv[i] = load16(s + base + (size_t)v * V);
        gv[i] = load16(gy + base + (size_t)v * V);
        wv[i] = load16(w + (size_t)v * V);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float f = to_f(sv[i].v[j]);
            ss += f * f;
        }
    }
    const float r = rsqrtf(block_sum(ss) / n + eps);
    __syncthreads(); // block_sum's shared memory is reused below
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        if (v >= nv) continue;
#pragma unroll
        for (int j = 0; j < V; ++j)
            dot += to_f(gv[i].v[j]) * to_f(wv[i].v[j]) * (to_f(sv[i].v[j]) * r);
    }
    const float proj = block_sum(dot) / n;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        if (v >= nv) continue;
        const size_t at = base + (size_t)v * V;
        Vec16<T> g2;
        if (has_gs) g2 = load16(gs + at);
        float out[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float normed = to_f(sv[i].v[j]) * r;
            float x = r * (to_f(gv[i].v[j]) * to_f(wv[i].v[j]) - normed * proj);
            if (has_gs) x += to_f(g2.v[j]);
            out[j] = x;
        }
#pragma unroll
        for (int q = 0; q < V / 4; ++q)
            reinterpret_cast<float4 *>(ds + at)[q] =
                make_float4(out[4 * q], out[4 * q + 1], out[4 * q + 2], out[4 * q + 3]);
    }
    if (threadIdx.x == 0) inv_out[row] = r;
}

// dw partial sums: partial[y][c] = sum over rows r = y, y + gridDim.y, ... of
// gy[r, c] * T(s[r, c] * inv[r]) (the normalised value rounded as the forward rounds it).
// Threads walk consecutive columns, so each row is read coalesced.
template <typename T>
__device__ void rms_norm_dw_partial(const T *s, const T *gy, const float *inv, float *partial,
                                    int n_rows, int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float acc = 0.f;
    for (int r = blockIdx.y; r < n_rows; r += gridDim.y) {
        acc += to_f(gy[(size_t)r * n + c]) * rnd<T>(to_f(s[(size_t)r * n + c]) * inv[r]);
    }
    partial[(size_t)blockIdx.y * n + c] = acc;
}

// dw from the partial sums, added in order (deterministic): dw[c] = sum over y of partial[y][c].
extern "C" __global__ void sum_partials(const float *partial, float *out, int parts, int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float acc = 0.f;
    for (int y = 0; y < parts; ++y) acc += partial[(size_t)y * n + c];
    out[c] = acc;
}

#define OPS(T, SUFFIX)                                                                             \
    extern "C" __global__ void rms_norm_##SUFFIX(const T *x, const T *w, T *y, int n_rows,    \
                                                 int n, float eps) {                          \
        rms_norm<T>(x, w, y, n_rows, n, eps);                                                 \
    }                                                                                         \
    extern "C" __global__ void add_rms_norm_##SUFFIX(const T *x, const T *h, const T *w,      \
                                                     T *out, int n_rows, int n, float eps) {  \
        add_rms_norm<T>(x, h, w, out, n_rows, n, eps);                                        \
    }                                                                                         \
    extern "C" __global__ void rms_norm_bwd_rows_##SUFFIX(                                    \
        const T *s, const T *w, const T *gs, const T *gy, float *ds, float *inv, int n_rows,  \
        int n, float eps, int has_gs) {                                                       \
        rms_norm_bwd_rows<T>(s, w, gs, gy, ds, inv, n_rows, n, eps, has_gs);                  \
    }                                                                                         \
    extern "C" __global__ void rms_norm_dw_partial_##SUFFIX(const T *s, const T *gy,          \
                                                            const float *inv, float *partial, \
                                                            int n_rows, int n) {              \
        rms_norm_dw_partial<T>(s, gy, inv, partial, n_rows, n);                               \
    }
#define VEC_OPS(T, SUFFIX, VPT)                                                                    \
    extern "C" __global__ void rms_norm_vec##VPT##_##SUFFIX(const T *x, const T *w, T *y,     \
                                                            int n_rows, int n, float eps) {   \
        norm_rows_vec<T, VPT>(x, nullptr, w, nullptr, y, n_rows, n, eps);                     \
    }                                                                                         \
    extern "C" __global__ void add_rms_norm_vec##VPT##_##SUFFIX(                              \
        const T *x, const T *h, const T *w, T *out, int n_rows, int n, float eps) {           \
        norm_rows_vec<T, VPT>(x, h, w, out, out + (size_t)n_rows * n, n_rows, n, eps);        \
    }
// The backward holds three arrays of VPT vectors a thread: at 4 (up to 1024 threads) it needs
// more registers than a block has, so it stops at 2 (norm_launch_shape's max_vpt).
#define BWD_VEC_OPS(T, SUFFIX, VPT)                                                                \
    extern "C" __global__ void rms_norm_bwd_rows_vec##VPT##_##SUFFIX(                         \
        const T *s, const T *w, const T *gs, const T *gy, float *ds, float *inv, int n_rows,  \
        int n, float eps, int has_gs) {                                                       \
        rms_norm_bwd_rows_vec<T, VPT>(s, w, gs, gy, ds, inv, n_rows, n, eps, has_gs);         \
    }
#define ALL_VEC_OPS(T, SUFFIX)                                                                     \
    VEC_OPS(T, SUFFIX, 1)                                                                          \
    VEC_OPS(T, SUFFIX, 2) VEC_OPS(T, SUFFIX, 4) BWD_VEC_OPS(T, SUFFIX, 1) BWD_VEC_OPS(T, SUFFIX, 2)
ALL_VEC_OPS(float, f32)
ALL_VEC_OPS(__half, f16)
ALL_VEC_OPS(__nv_bfloat16, bf16)
OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)
