// Fused kernels of the Qwen decoder that candle has no single kernel for. Compiled to PTX by
// build.rs (feature `cuda`); crates/fleet-models/src/ops.rs launches them and has the CPU twins
// that the parity tests run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// Softmax over the last axis of attention scores with the causal and left-padding mask applied
// on the fly (no mask tensor). Row r of the [n_rows, kv_len] scores belongs to batch row
// r / rows_per_batch and query i = r % q_len, at absolute position offset + i. Key j is visible
// when j <= offset + i and (j >= pad[batch] or j is the query itself). Statistics in f32.
// One warp per row.
template <typename T>
__device__ void masked_softmax(const T *x, T *y, const uint32_t *pad, int n_rows,
                               int rows_per_batch, int q_len, int kv_len, int offset) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    const int lane = threadIdx.x;
    if (row >= n_rows) return;
    const int qi = offset + row % q_len;
    const int p = (int)pad[row / rows_per_batch];
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

// SwiGLU on the fused gate/up projection: x is [n_rows, 2 * n_cols] (gate then up), y is
// [n_rows, n_cols] = silu(gate) * up, rounded to T after the silu as transformers does.
template <typename T>
__device__ void swiglu(const T *x, T *y, int n_rows, int n_cols) {
    const size_t n = (size_t)n_rows * n_cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_cols, c = i % n_cols;
        const float g = to_f(x[r * 2 * n_cols + c]);
        const float u = to_f(x[r * 2 * n_cols + n_cols + c]);
        const float act = to_f(from_f<T>(g / (1.f + expf(-g))));
        y[i] = from_f<T>(act * u);
    }
}

// Sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), returned to every
// thread. Call it with every thread of the block; a second call in the same kernel needs a
// __syncthreads() before it (the partials are reused).
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (blockDim.x + 31) / 32 ? partial[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    return partial[0];
}

// The value `x` holds once rounded to T.
template <typename T> __device__ __forceinline__ float rnd(float x) { return to_f(from_f<T>(x)); }

// RMSNorm as transformers' Qwen2RMSNorm computes it: y = w * T(x * rsqrt(mean(x^2) + eps)),
// statistics in f32, the normalised value rounded to T before the product with the weight.
// One block per row.
template <typename T>
__device__ void rms_norm(const T *x, const T *w, T *y, int n_rows, int n, float eps) {
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const T *xr = x + (size_t)row * n;
    T *yr = y + (size_t)row * n;
    float ss = 0.f;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const float f = to_f(xr[c]);
        ss += f * f;
    }
    const float inv = rsqrtf(block_sum(ss) / n + eps);
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        yr[c] = from_f<T>(rnd<T>(to_f(xr[c]) * inv) * to_f(w[c]));
    }
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
    const float inv = rsqrtf(block_sum(ss) / n + eps);
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const float normed = to_f(from_f<T>(to_f(sr[c]) * inv));
        yr[c] = from_f<T>(normed * to_f(w[c]));
    }
}

// Splits the fused q/k/v projection [b, t, (h + 2 kvh) * d] into head-major q [b, h, t, d],
// k and v [b, kvh, t, d] (consecutive regions of `out`), adding the projection bias and
// rotating q and k with RoPE (rotate-half convention, math in f32, one rounding). `cs` holds
// cos then sin for each position: [t, d], or [b, t, d] when `per_row`. One block per
// (token, head), d/2 threads.
template <typename T>
__device__ void qkv_rope(const T *x, const T *bias, const T *cs, T *out, int b, int t, int h,
                         int kvh, int d, int per_row) {
    const int heads = h + 2 * kvh;
    const int half = d / 2;
    const int blk = blockIdx.x; // (bi * t + ti) * heads + hh
    const int hh = blk % heads;
    const int tok = blk / heads;
    const int ti = tok % t, bi = tok / t;
    const int i = threadIdx.x;
    if (bi >= b || i >= half) return;
    const T *src = x + (size_t)tok * heads * d + (size_t)hh * d;
    const float x0 = to_f(src[i]) + to_f(bias[hh * d + i]);
    const float x1 = to_f(src[i + half]) + to_f(bias[hh * d + i + half]);
    const size_t q_size = (size_t)b * h * t * d, kv_size = (size_t)b * kvh * t * d;
    if (hh >= h + kvh) {
        T *dst = out + q_size + kv_size + (((size_t)bi * kvh + (hh - h - kvh)) * t + ti) * d;
        dst[i] = from_f<T>(x0);
        dst[i + half] = from_f<T>(x1);
        return;
    }
    const T *row = cs + (per_row ? (size_t)tok : (size_t)ti) * d;
    const float c = to_f(row[i]), s = to_f(row[half + i]);
    T *dst = hh < h ? out + (((size_t)bi * h + hh) * t + ti) * d
                    : out + q_size + (((size_t)bi * kvh + (hh - h)) * t + ti) * d;
    dst[i] = from_f<T>(x0 * c - x1 * s);
    dst[i + half] = from_f<T>(x1 * c + x0 * s);
}

// Qwen3's attention input: the fused q/k/v projection [b, t, (h + 2 kvh) * d] split into
// head-major q [b, h, t, d], k and v [b, kvh, t, d] (consecutive regions of `out`). Per head,
// s = T(x + bias) (when has_bias); v heads are s; q and k heads are normalised as
// transformers' Qwen3RMSNorm (y = T(T(s * rsqrt(mean(s^2) + eps)) * w), with qw for q heads,
// kw for k heads), then rotated as apply_rotary_pos_emb does in the model dtype:
// T(T(y0 c) - T(y1 s)) and T(T(y1 c) + T(y0 s)). cos and sin are [t, d/2], or [b, t, d/2]
// when `per_row`. One warp (block of 32) per (token, head).
template <typename T>
__device__ void qk_norm_rope(const T *x, const T *bias, const T *cos, const T *sin,
                             const T *qw, const T *kw, T *out, int b, int t, int h, int kvh,
                             int d, int per_row, int has_bias, float eps) {
    const int heads = h + 2 * kvh;
    const int half = d / 2;
    const int blk = blockIdx.x; // (bi * t + ti) * heads + hh
    const int hh = blk % heads;
    const int tok = blk / heads;
    const int ti = tok % t, bi = tok / t;
    if (bi >= b) return; // uniform over the block
    const int lane = threadIdx.x;
    const T *src = x + ((size_t)tok * heads + hh) * d;
    const T *bs = bias + (size_t)hh * d;
    auto at = [&](int i) -> float {
        return has_bias ? rnd<T>(to_f(src[i]) + to_f(bs[i])) : to_f(src[i]);
    };
    const size_t q_size = (size_t)b * h * t * d, kv_size = (size_t)b * kvh * t * d;
    if (hh >= h + kvh) {
        T *dst = out + q_size + kv_size + (((size_t)bi * kvh + (hh - h - kvh)) * t + ti) * d;
        for (int i = lane; i < d; i += 32) dst[i] = from_f<T>(at(i));
        return;
    }
    float ss = 0.f;
    for (int i = lane; i < d; i += 32) {
        const float f = at(i);
        ss += f * f;
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    const float inv = rsqrtf(ss / d + eps);
    const T *w = hh < h ? qw : kw;
    const size_t cs_row = (per_row ? (size_t)tok : (size_t)ti) * half;
    T *dst = hh < h ? out + (((size_t)bi * h + hh) * t + ti) * d
                    : out + q_size + (((size_t)bi * kvh + (hh - h)) * t + ti) * d;
    for (int i = lane; i < half; i += 32) {
        const float y0 = rnd<T>(rnd<T>(at(i) * inv) * to_f(w[i]));
        const float y1 = rnd<T>(rnd<T>(at(i + half) * inv) * to_f(w[i + half]));
        const float c = to_f(cos[cs_row + i]), s = to_f(sin[cs_row + i]);
        // __fmul_rn keeps each product rounded on its own (no fused multiply-add), as the CPU
        // twin and transformers compute them.
        dst[i] = from_f<T>(rnd<T>(__fmul_rn(y0, c)) - rnd<T>(__fmul_rn(y1, s)));
        dst[i + half] = from_f<T>(rnd<T>(__fmul_rn(y1, c)) + rnd<T>(__fmul_rn(y0, s)));
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

// Backward of `swiglu`: with x = [gate | up] and g the output's gradient, d gate = g * up *
// silu'(gate) and d up = g * silu(gate), silu'(z) = sigmoid(z) + silu(z) * (1 - sigmoid(z)),
// in f32, rounded once to T.
template <typename T>
__device__ void swiglu_bwd(const T *x, const T *g, T *dx, int n_rows, int n_cols) {
    const size_t n = (size_t)n_rows * n_cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_cols, c = i % n_cols;
        const size_t gi = r * 2 * n_cols + c, ui = gi + n_cols;
        const float z = to_f(x[gi]), u = to_f(x[ui]), gy = to_f(g[i]);
        const float sig = 1.f / (1.f + expf(-z));
        const float silu = z * sig;
        const float dsilu = sig + silu * (1.f - sig);
        dx[gi] = from_f<T>(gy * u * dsilu);
        dx[ui] = from_f<T>(gy * silu);
    }
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

#define OPS(T, SUFFIX)                                                                        \
    extern "C" __global__ void masked_softmax_##SUFFIX(const T *x, T *y, const uint32_t *pad, \
                                                       int n_rows, int rows_per_batch,       \
                                                       int q_len, int kv_len, int offset) {  \
        masked_softmax<T>(x, y, pad, n_rows, rows_per_batch, q_len, kv_len, offset);         \
    }                                                                                         \
    extern "C" __global__ void swiglu_##SUFFIX(const T *x, T *y, int n_rows, int n_cols) {    \
        swiglu<T>(x, y, n_rows, n_cols);                                                      \
    }                                                                                         \
    extern "C" __global__ void masked_softmax_bwd_##SUFFIX(const T *y, const T *g, T *dx,   \
                                                           int n_rows, int kv_len) {         \
        masked_softmax_bwd<T>(y, g, dx, n_rows, kv_len);                                      \
    }                                                                                         \
    extern "C" __global__ void swiglu_bwd_##SUFFIX(const T *x, const T *g, T *dx, int n_rows, \
                                                   int n_cols) {                              \
        swiglu_bwd<T>(x, g, dx, n_rows, n_cols);                                              \
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
    }                                                                                         \
    extern "C" __global__ void add_rms_norm_##SUFFIX(const T *x, const T *h, const T *w,      \
                                                     T *out, int n_rows, int n, float eps) {  \
        add_rms_norm<T>(x, h, w, out, n_rows, n, eps);                                        \
    }                                                                                         \
    extern "C" __global__ void qkv_rope_##SUFFIX(const T *x, const T *bias, const T *cs,      \
                                                 T *out, int b, int t, int h, int kvh, int d, \
                                                 int per_row) {                               \
        qkv_rope<T>(x, bias, cs, out, b, t, h, kvh, d, per_row);                              \
    }                                                                                         \
    extern "C" __global__ void rms_norm_##SUFFIX(const T *x, const T *w, T *y, int n_rows,    \
                                                 int n, float eps) {                          \
        rms_norm<T>(x, w, y, n_rows, n, eps);                                                 \
    }                                                                                         \
    extern "C" __global__ void qk_norm_rope_##SUFFIX(                                         \
        const T *x, const T *bias, const T *cos, const T *sin, const T *qw, const T *kw,      \
        T *out, int b, int t, int h, int kvh, int d, int per_row, int has_bias, float eps) {  \
        qk_norm_rope<T>(x, bias, cos, sin, qw, kw, out, b, t, h, kvh, d, per_row, has_bias,   \
                        eps);                                                                 \
    }

OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)

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

// dw from the partial sums, added in order (deterministic): dw[c] = sum over y of partial[y][c].
extern "C" __global__ void sum_partials(const float *partial, float *out, int parts, int n) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float acc = 0.f;
    for (int y = 0; y < parts; ++y) acc += partial[(size_t)y * n + c];
    out[c] = acc;
}

// Max of `v` over the block (as block_sum, with partials of its own). Call it with every
// thread; a second call needs a __syncthreads() before it.
__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial_max[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (blockDim.x + 31) / 32 ? partial_max[lane] : -INFINITY;
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
        if (lane == 0) partial_max[0] = v;
    }
    __syncthreads();
    return partial_max[0];
}

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

// One AdamW step in place, as torch.optim.AdamW (foreach=False) computes it in f32:
// p *= 1 - lr * wd; m = m + (1 - b1) * (g - m); v = v * b2 + (1 - b2) * g * g;
// p += -step_size * m / (sqrt(v) / bc2_sqrt + eps). One thread per element. omb1 and omb2
// are 1 - b1 and 1 - b2 computed in f64 and rounded, as the composed version gets them; every
// product and sum is rounded on its own (no contraction), as candle's kernels compute them.
// T: the parameter's and moments' dtype (computed in f32, each rounded once on store, as the
// composed step's to_dtype does); G: the gradient's (read in f32, exactly).
template <typename T, typename G>
__device__ void adamw(T *p, const G *g, T *m, T *v, long long n, float decay, float omb1,
                      float b2, float omb2, float eps, float step_size, float bc2_sqrt) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float gi = to_f(g[i]), m0 = to_f(m[i]), v0 = to_f(v[i]);
        const float mi = __fadd_rn(__fmul_rn(__fsub_rn(gi, m0), omb1), m0);
        const float vi = __fadd_rn(__fmul_rn(v0, b2), __fmul_rn(__fmul_rn(gi, omb2), gi));
        const float denom = __fadd_rn(__fdiv_rn(sqrtf(vi), bc2_sqrt), eps);
        const float pi = __fmul_rn(to_f(p[i]), decay);
        p[i] = from_f<T>(__fadd_rn(pi, __fmul_rn(__fdiv_rn(mi, denom), -step_size)));
        m[i] = from_f<T>(mi);
        v[i] = from_f<T>(vi);
    }
}

#define ADAMW(T, G, NAME)                                                                      \
    extern "C" __global__ void NAME(T *p, const G *g, T *m, T *v, long long n, float decay,    \
                                    float omb1, float b2, float omb2, float eps,                \
                                    float step_size, float bc2_sqrt) {                          \
        adamw<T, G>(p, g, m, v, n, decay, omb1, b2, omb2, eps, step_size, bc2_sqrt);           \
    }
// f32 masters (f32 gradients), and bf16 masters as TRL trains a bf16-loaded model (bf16
// gradients and moments: torch keeps the moments in the parameter's dtype).
ADAMW(float, float, adamw_f32)
ADAMW(__nv_bfloat16, __nv_bfloat16, adamw_bf16)

// y[r, c] += bias[c] in place for y [n_rows, n_cols] contiguous: the bias of a linear layer
// after its GEMM (candle's broadcast add runs a strided kernel that takes several times the GEMM
// on wide activations). Grid-stride, one element per thread and step.
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

// Keeps the stream busy for `ns` nanoseconds of the GPU's global timer (one thread). Tests use
// it to make one device's work late, so that a race between devices happens every time.
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
