// The fused kernels of ops/qkv_rope.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include "common.cuh"
#include "gemv.cuh"

// Where a k or v head of token `tok` goes. Without a cache (`cache` null): `out + offset`, the
// head-major output. With one (the paged decode and prefill): the token's slot of the paged
// cache [num_blocks, kvh, block_size, d], or null for a slot of u32::MAX (a padding token) or
// past the cache, which the caller skips, as paged_kv_write does.
template <typename T>
__device__ T *kv_dst(T *out, size_t offset, T *cache, const uint32_t *slots, int tok, int head,
                     int kvh, int d, int block_size, long long num_slots) {
    if (cache == nullptr) return out + offset;
    const uint32_t slot = slots[tok];
    if (slot == 0xffffffffu || (long long)slot >= num_slots) return nullptr;
    const size_t blk = slot / block_size, off = slot % block_size;
    return cache + ((blk * kvh + head) * block_size + off) * d;
}

// Splits the fused q/k/v projection [b, t, (h + 2 kvh) * d] into head-major q [b, h, t, d],
// k and v [b, kvh, t, d] (consecutive regions of `out`), adding the projection bias and
// rotating q and k with RoPE (rotate-half convention, math in f32, one rounding). `cs` holds
// cos then sin for each position: [t, d], or [b, t, d] when `per_row`, in T (the text model's
// tables) or f32 (C = float: the vision tower's, as transformers computes them). With `kc` set,
// k and v go to the paged caches kc, vc at `slots` instead (kv_dst) and `out` holds q only.
// One block per (token, group of `hpb` consecutive heads), d/2 threads per head: blocks of one
// head's d/2 threads (36 for the vision tower's d = 72) kept the SMs a quarter full.
// P consecutive elements of type E as one aligned load or store (P * sizeof(E) bytes).
template <typename E, int P> struct alignas(P * sizeof(E)) Pack {
    E v[P];
};
template <typename E, int P> __device__ __forceinline__ Pack<E, P> load_pack(const E *p) {
    return *reinterpret_cast<const Pack<E, P> *>(p);
}

// The rotate-half RoPE of one pair (x0, x1) = (x[i], x[i + d/2]) with cos c and sin s, in f32,
// rounded once: one definition for qkv_rope and the GEMV that ends in it (gemv_qkv_rope).
template <typename T>
__device__ __forceinline__ void rope_rotate(float x0, float x1, float c, float s, T &o0, T &o1) {
    o0 = from_f<T>(x0 * c - x1 * s);
    o1 = from_f<T>(x1 * c + x0 * s);
}

// `P` pairs (i, i + d/2) a thread (P = 4: each thread's index arithmetic serves eight elements,
// loaded as packs; ncu had the one-pair kernel compute-bound at 21% of the bandwidth on the
// 7B's prefill), the same arithmetic per element for any P. The launcher takes P = 4 only with
// FLEET_QKV_ROPE_P4=1 until its GPU test has run.
template <typename T, typename C, int P>
__device__ void qkv_rope(const T *x, const T *bias, const C *cs, T *out, int b, int t, int h,
                         int kvh, int d, int per_row, T *kc, T *vc, const uint32_t *slots,
                         int block_size, long long num_slots, int hpb) {
    const int heads = h + 2 * kvh;
    const int half = d / 2;
    const int per_head = half / P;  // threads a head
    const int groups = (heads + hpb - 1) / hpb;
    const int blk = blockIdx.x; // (bi * t + ti) * groups + group
    const int hh = (blk % groups) * hpb + threadIdx.x / per_head;
    const int tok = blk / groups;
    const int ti = tok % t, bi = tok / t;
    const int i = (threadIdx.x % per_head) * P;
    if (bi >= b || hh >= heads) return;
    const T *src = x + (size_t)tok * heads * d + (size_t)hh * d;
    const Pack<T, P> s0 = load_pack<T, P>(src + i), s1 = load_pack<T, P>(src + i + half);
    const Pack<T, P> b0 = load_pack<T, P>(bias + hh * d + i), b1 = load_pack<T, P>(bias + hh * d + i + half);
    float x0[P], x1[P];
#pragma unroll
    for (int e = 0; e < P; ++e) {
        x0[e] = to_f(s0.v[e]) + to_f(b0.v[e]);
        x1[e] = to_f(s1.v[e]) + to_f(b1.v[e]);
    }
    const size_t q_size = (size_t)b * h * t * d, kv_size = (size_t)b * kvh * t * d;
    Pack<T, P> o0, o1;
    if (hh >= h + kvh) {
        const int vh = hh - h - kvh;
        T *dst = kv_dst(out, q_size + kv_size + (((size_t)bi * kvh + vh) * t + ti) * d, vc, slots,
                        tok, vh, kvh, d, block_size, num_slots);
        if (dst == nullptr) return;
#pragma unroll
        for (int e = 0; e < P; ++e) {
            o0.v[e] = from_f<T>(x0[e]);
            o1.v[e] = from_f<T>(x1[e]);
        }
        *reinterpret_cast<Pack<T, P> *>(dst + i) = o0;
        *reinterpret_cast<Pack<T, P> *>(dst + i + half) = o1;
        return;
    }
    const C *row = cs + (per_row ? (size_t)tok : (size_t)ti) * d;
    const Pack<C, P> cp = load_pack<C, P>(row + i), sp = load_pack<C, P>(row + half + i);
    T *dst = hh < h ? out + (((size_t)bi * h + hh) * t + ti) * d
                    : kv_dst(out, q_size + (((size_t)bi * kvh + (hh - h)) * t + ti) * d, kc,
                             slots, tok, hh - h, kvh, d, block_size, num_slots);
    if (dst == nullptr) return;
#pragma unroll
    for (int e = 0; e < P; ++e) {
        rope_rotate<T>(x0[e], x1[e], to_f(cp.v[e]), to_f(sp.v[e]), o0.v[e], o1.v[e]);
    }
    *reinterpret_cast<Pack<T, P> *>(dst + i) = o0;
    *reinterpret_cast<Pack<T, P> *>(dst + i + half) = o1;
}

// Qwen3's attention input: the fused q/k/v projection [b, t, (h + 2 kvh) * d] split into
// head-major q [b, h, t, d], k and v [b, kvh, t, d] (consecutive regions of `out`). Per head,
// s = T(x + bias) (when has_bias); v heads are s; q and k heads are normalised as
// transformers' Qwen3RMSNorm (y = T(T(s * rsqrt(mean(s^2) + eps)) * w), with qw for q heads,
// kw for k heads), then rotated as apply_rotary_pos_emb does in the model dtype:
// T(T(y0 c) - T(y1 s)) and T(T(y1 c) + T(y0 s)). `cs` holds cos then sin for each position,
// as for qkv_rope: [t, d], or [b, t, d] when `per_row`; `kc`, `vc`, `slots` as for qkv_rope.
// One warp per (token, head), blockDim.x / 32 of them a block: blocks of one warp (the first
// launch shape) left the SMs at most half full (32 resident blocks an SM) and ran at ~0.4 TB/s
// on the judges' prefill (ncu, 2026-11-28f). Each warp's work and arithmetic are unchanged.
template <typename T>
__device__ void qk_norm_rope(const T *x, const T *bias, const T *cs, const T *qw, const T *kw,
                             T *out, int b, int t, int h, int kvh, int d, int per_row,
                             int has_bias, float eps, T *kc, T *vc, const uint32_t *slots,
                             int block_size, long long num_slots) {
    const int heads = h + 2 * kvh;
    const int half = d / 2;
    // (bi * t + ti) * heads + hh: this warp's (token, head).
    const int blk = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int hh = blk % heads;
    const int tok = blk / heads;
    const int ti = tok % t, bi = tok / t;
    if (bi >= b) return; // uniform over the warp (past the last (token, head))
    const int lane = threadIdx.x % 32;
    const T *src = x + ((size_t)tok * heads + hh) * d;
    const T *bs = bias + (size_t)hh * d;
    auto at = [&](int i) -> float {
        return has_bias ? rnd<T>(to_f(src[i]) + to_f(bs[i])) : to_f(src[i]);
    };
    const size_t q_size = (size_t)b * h * t * d, kv_size = (size_t)b * kvh * t * d;
    if (hh >= h + kvh) {
        const int vh = hh - h - kvh;
        T *dst = kv_dst(out, q_size + kv_size + (((size_t)bi * kvh + vh) * t + ti) * d, vc, slots,
                        tok, vh, kvh, d, block_size, num_slots);
        if (dst == nullptr) return; // uniform over the warp: one slot per token
        for (int i = lane; i < d; i += 32) dst[i] = from_f<T>(at(i));
        return;
    }
    T *dst = hh < h ? out + (((size_t)bi * h + hh) * t + ti) * d
                    : kv_dst(out, q_size + (((size_t)bi * kvh + (hh - h)) * t + ti) * d, kc,
                             slots, tok, hh - h, kvh, d, block_size, num_slots);
    if (dst == nullptr) return; // uniform over the warp
    float ss = 0.f;
    for (int i = lane; i < d; i += 32) {
        const float f = at(i);
        ss += f * f;
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    const float inv = rsqrtf(ss / d + eps);
    const T *w = hh < h ? qw : kw;
    const T *row = cs + (per_row ? (size_t)tok : (size_t)ti) * d;
    for (int i = lane; i < half; i += 32) {
        const float y0 = rnd<T>(rnd<T>(at(i) * inv) * to_f(w[i]));
        const float y1 = rnd<T>(rnd<T>(at(i + half) * inv) * to_f(w[i + half]));
        const float c = to_f(row[i]), s = to_f(row[half + i]);
        // __fmul_rn keeps each product rounded on its own (no fused multiply-add), as the CPU
        // twin and transformers compute them.
        dst[i] = from_f<T>(rnd<T>(__fmul_rn(y0, c)) - rnd<T>(__fmul_rn(y1, s)));
        dst[i + half] = from_f<T>(rnd<T>(__fmul_rn(y1, c)) + rnd<T>(__fmul_rn(y0, s)));
    }
}

// A decode step's q/k/v projection fused with qkv_rope's paged epilogue (the bias, RoPE, the
// K/V write): one launch a layer fewer, and warps that read two rows of w each. Warp `pair`
// = (head hh, element i < d/2) sums rows hh d + i and hh d + i + d/2 of the fused projection
// w ([(h + 2 kvh) d, k]) against the M rows of x as `gemv` sums each (the register pipeline,
// eight loads a row in flight), rounds both to T as the GEMV's output is rounded, and then
// computes what qkv_rope computes from that output: x + bias in f32, rotated (q and k heads)
// with row m's cos/sin (cs [M, 1, d] when per_row, else [1, d]), one rounding; q heads to
// q_out [M, h, 1, d], k and v heads to the paged caches at slots[m] (kv_dst). So q and the
// caches get the bits of the GEMV followed by qkv_rope. Lane m writes row m.
template <typename T, int M>
__device__ void gemv_qkv_rope(const T *x, const T *w, const T *bias, const T *cs, int per_row,
                              T *q_out, int h, int kvh, int d, int k, T *kc, T *vc, const uint32_t *slots,
                              int block_size, long long num_slots) {
    const int lane = threadIdx.x % 32;
    const int half = d / 2, heads = h + 2 * kvh;
    const int pair = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (pair >= heads * half) return;
    const int hh = pair / half, i = pair % half;
    const uint4 *wr[2] = {reinterpret_cast<const uint4 *>(w + ((size_t)hh * d + i) * k),
                          reinterpret_cast<const uint4 *>(w + ((size_t)hh * d + i + half) * k)};
    const T *xr[M];
    float acc[2][M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        xr[m] = x + (size_t)m * k;
        acc[0][m] = acc[1][m] = 0.f;
    }
    gemv_lane_sums<T, M, true, false, true, 2>(xr, wr, k / 8, lane, acc);
    const float b0 = to_f(bias[hh * d + i]), b1 = to_f(bias[hh * d + i + half]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (lane != m) continue;
        const float x0 = rnd<T>(acc[0][m]) + b0, x1 = rnd<T>(acc[1][m]) + b1;
        T *dst;
        T o0, o1;
        if (hh >= h + kvh) {
            dst = kv_dst<T>(nullptr, 0, vc, slots, m, hh - h - kvh, kvh, d, block_size, num_slots);
            o0 = from_f<T>(x0);
            o1 = from_f<T>(x1);
        } else {
            dst = hh < h ? q_out + ((size_t)m * h + hh) * d
                         : kv_dst<T>(nullptr, 0, kc, slots, m, hh - h, kvh, d, block_size, num_slots);
            const T *row = cs + (per_row ? (size_t)m * d : 0);
            rope_rotate<T>(x0, x1, to_f(row[i]), to_f(row[half + i]), o0, o1);
        }
        if (dst == nullptr) continue;
        dst[i] = o0;
        dst[i + half] = o1;
    }
}

// Blocks of two warps, nine an SM (at most 113 registers a thread: 96 for one row): the 7B's
// 2,304 warps (36 heads of 64 pairs) in one wave of an H200's 132 SMs, where blocks of four
// warps at the 102 registers the pipeline took unbounded fitted four an SM, two waves.
#define GEMV_QKV_ROPE(T, SUFFIX, M)                                                                \
    extern "C" __global__ void __launch_bounds__(64, 9) gemv_qkv_rope_##SUFFIX##_m##M(             \
        const T *x, const T *w, const T *bias, const T *cs, int per_row, T *q_out, int h, int kvh, \
        int d, int k, T *kc, T *vc, const uint32_t *slots, int block_size, long long num_slots) {  \
        gemv_qkv_rope<T, M>(x, w, bias, cs, per_row, q_out, h, kvh, d, k, kc, vc, slots,           \
                            block_size, num_slots);                                                \
    }
#define GEMV_QKV_ROPES(T, SUFFIX)                                                                  \
    GEMV_QKV_ROPE(T, SUFFIX, 1)                                                                    \
    GEMV_QKV_ROPE(T, SUFFIX, 2)                                                                    \
    GEMV_QKV_ROPE(T, SUFFIX, 3)                                                                    \
    GEMV_QKV_ROPE(T, SUFFIX, 4)
GEMV_QKV_ROPES(__half, f16)
GEMV_QKV_ROPES(__nv_bfloat16, bf16)

// One qkv_rope entry point: tables of type C, P pairs a thread.
#define QKV_ROPE(NAME, T, C, P)                                                                    \
    extern "C" __global__ void NAME(const T *x, const T *bias, const C *cs, T *out, int b, int t,  \
                                    int h, int kvh, int d, int per_row, T *kc, T *vc,              \
                                    const uint32_t *slots, int block_size, long long num_slots,    \
                                    int hpb) {                                                     \
        qkv_rope<T, C, P>(x, bias, cs, out, b, t, h, kvh, d, per_row, kc, vc, slots, block_size,  \
                          num_slots, hpb);                                                         \
    }

#define OPS(T, SUFFIX)                                                                             \
    QKV_ROPE(qkv_rope_##SUFFIX, T, T, 1)                                                           \
    QKV_ROPE(qkv_rope_##SUFFIX##_p4, T, T, 4)                                                      \
    extern "C" __global__ void qk_norm_rope_##SUFFIX(                                         \
        const T *x, const T *bias, const T *cs, const T *qw, const T *kw,                     \
        T *out, int b, int t, int h, int kvh, int d, int per_row, int has_bias, float eps,    \
        T *kc, T *vc, const uint32_t *slots, int block_size, long long num_slots) {           \
        qk_norm_rope<T>(x, bias, cs, qw, kw, out, b, t, h, kvh, d, per_row, has_bias, eps,   \
                        kc, vc, slots, block_size, num_slots);                                \
    }
OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)

// qkv_rope with f32 tables on half-precision inputs (the vision tower).
QKV_ROPE(qkv_rope_f16_csf32, __half, float, 1)
QKV_ROPE(qkv_rope_f16_csf32_p4, __half, float, 4)
QKV_ROPE(qkv_rope_bf16_csf32, __nv_bfloat16, float, 1)
QKV_ROPE(qkv_rope_bf16_csf32_p4, __nv_bfloat16, float, 4)

// Backward of qkv_rope (no cache) in one pass: from the flat output gradient g (q [b, h, t, d],
// then k and v [b, kvh, t, d], in T) and the tables cs (f32, [t, d] or [b, t, d] when per_row),
// out[r, c] (f32, r = token b * t + tt, c = column of [b, t, (h + 2 kvh) d]) is the gradient of
// qkv: q and k un-rotated (RoPE by the negative angle, as candle's rope with sin negated
// computes it), v as it is; and partial[part, c] the sum of out[r, c] over the rows
// r = part, part + parts, ... in order (the bias gradient, summed by sum_partials). One thread a
// column, gridDim.y = parts row slices; consecutive threads read consecutive elements of a head.
extern "C" __global__ void qkv_rope_bwd(const void *g_, const float *cs, float *out,
                                        float *partial, int b, int t, int h, int kvh, int d,
                                        int per_row, int bf16) {
    const int w = (h + 2 * kvh) * d;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= w) return;
    const int rows = b * t, half = d / 2;
    const int hd = c / d, i = c % d;
    const size_t qn = (size_t)b * h * t * d, kvn = (size_t)b * kvh * t * d;
    float acc = 0.f;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const int bb = r / t, tt = r % t;
        size_t base;
        bool rot = true;
        if (hd < h) {
            base = (((size_t)bb * h + hd) * t + tt) * d;
        } else if (hd < h + kvh) {
            base = qn + (((size_t)bb * kvh + (hd - h)) * t + tt) * d;
        } else {
            base = qn + kvn + (((size_t)bb * kvh + (hd - h - kvh)) * t + tt) * d;
            rot = false;
        }
        auto at = [&](size_t k) -> float {
            return bf16 ? to_f(reinterpret_cast<const __nv_bfloat16 *>(g_)[k])
                        : to_f(reinterpret_cast<const __half *>(g_)[k]);
        };
        float v;
        if (rot) {
            const size_t row = (size_t)(per_row ? r : tt) * d;
            const int j = i % half;
            const float co = cs[row + j], sp = -cs[row + half + j];
            const float x1 = at(base + j), x2 = at(base + j + half);
            v = i < half ? x1 * co - x2 * sp : x1 * sp + x2 * co;
        } else {
            v = at(base + i);
        }
        out[(size_t)r * w + c] = v;
        acc += v;
    }
    partial[(size_t)blockIdx.y * w + c] = acc;
}
