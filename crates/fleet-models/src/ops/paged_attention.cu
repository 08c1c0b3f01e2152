// The kernels of ops/paged_attention.rs, compiled to PTX by build.rs (feature `cuda`); the
// launchers and the CPU twins are in the .rs file of the same name.
//
// Both ops are meant for a CUDA-graph-captured decode step: everything that changes from one
// step to the next (slots, block tables, sequence lengths) is read from device memory, and the
// launch arguments are pointers, shapes and the model's constant scale only.
//
// Cache layout: [num_blocks, kv_heads, block_size, head_dim]; token t of a sequence lives in
// physical block table[t / block_size] at offset t % block_size.
#include "common.cuh"

#include <type_traits>

namespace {

// Sum over groups of 2 O lanes by the xor butterfly (offsets O, O/2, ..., 1):
// every lane of a group ends with the same value (each step adds the same two numbers on both
// lanes, in either order), the one the CPU twin's `butterfly` computes.
template <int O> __device__ __forceinline__ float butterfly_sum(float v) {
#pragma unroll
    for (int o = O; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// N consecutive elements at `p` as f32, loaded in the widest words (up to 16 bytes) that
// N * sizeof(T) is a multiple of; `p` is aligned to that width (the launcher checks the caches'
// alignment, and every offset used is a multiple of N elements within 16-byte-aligned rows).
template <typename T, int N> __device__ __forceinline__ void load_f(const T *p, float *out) {
    constexpr int BYTES = N * (int)sizeof(T);
    using W = std::conditional_t<
        BYTES % 16 == 0, uint4,
        std::conditional_t<BYTES % 8 == 0, uint2, std::conditional_t<BYTES % 4 == 0, uint32_t, T>>>;
    constexpr int PER = (int)(sizeof(W) / sizeof(T));
#pragma unroll
    for (int i = 0; i < N / PER; ++i) {
        const W w = reinterpret_cast<const W *>(p)[i];
        T t[PER];
        memcpy(t, &w, sizeof(W));
#pragma unroll
        for (int e = 0; e < PER; ++e) out[i * PER + e] = to_f(t[e]);
    }
}

// The partition kernel's shape (the twin follows it): 4 warps; the score pass gives each token
// TG lanes, lane i of a token holding chunks i, i + TG, ... of CHUNK elements of its K row; the
// p·V pass gives warp w columns [8E w, 8E (w + 1)), lane l columns 8E w + E (l % 8) + [0, E)
// over a contiguous quarter of the partition's tokens (set l / 8), the SETS token sets summed by
// the butterfly.
constexpr int THREADS = 128;
constexpr int TG = 4;
constexpr int CHUNK = 8;
constexpr int SETS = 4;

} // namespace

// Writes the rows of `src` ([tokens, kv_heads, head_dim], element strides s_tok, s_head, s_dim)
// into `cache` at slots[t] = block * block_size + offset. A slot of 0xffffffff (a padding row)
// or past the cache is skipped: the kernel cannot report it without a host sync. One block per
// token.
template <typename T>
__device__ void paged_kv_write(T *cache, const T *src, const uint32_t *slots, int kv_heads,
                               int block_size, int head_dim, long long num_slots, long long s_tok,
                               long long s_head, long long s_dim) {
    const int t = blockIdx.x;
    const uint32_t slot = slots[t];
    if (slot == 0xffffffffu || (long long)slot >= num_slots) return;
    const size_t blk = slot / block_size, off = slot % block_size;
    const T *row = src + (long long)t * s_tok;
    for (int i = threadIdx.x; i < kv_heads * head_dim; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        cache[((blk * kv_heads + h) * block_size + off) * head_dim + d] =
            row[h * s_head + d * s_dim];
    }
}

// Split-KV decode attention, pass 1: one block per (partition, kv head, batch row) computes, for
// the `group` (<= GB) query heads that read this KV head, the partition's score max, sum of exp
// and unnormalised p·V, all in f32, into the workspace ([batch, heads, n_parts] and
// [batch, heads, n_parts, D]). A partition at or past the row's length exits at once (pass 2
// reads only the partitions the length covers). D = 32 * E; K and V are read once for the
// whole group.
//
// Dynamic shared memory: q [group][D], scores [group][part], max and sum [2][group] (f32).
//
// 1. Scores: each warp takes 32 / TG tokens at a time; a token's TG lanes each sum q·k over
//    their chunks in order (16-byte loads), the TG lanes are summed by the butterfly;
//    score = dot * scale.
// 2. Softmax statistics: warp w takes heads w, w + 4, ...; lane l sums exp(s - max) over
//    tokens l, l + 32, ... in order, then the 32 lanes by the butterfly.
// 3. p·V: the lanes' token sets (see THREADS above) sum p[j] v[j][col] in token order, then the
//    SETS sets of a column (lanes 8 apart) are summed by the butterfly. A token past the
//    partition adds p = 0 times v = 0 (exactly nothing).
template <typename T, int E, int GB>
__device__ void paged_attn_partition(const T *q, const T *kc, const T *vc, const uint32_t *tables,
                                     const uint32_t *seq_lens, float *ws_max, float *ws_sum,
                                     float *ws_out, int kv_heads, int group, int block_shift,
                                     int max_blocks, int n_parts, int part, float scale) {
    constexpr int D = 32 * E;
    extern __shared__ float4 smem4[];
    float *q_s = reinterpret_cast<float *>(smem4);
    float *s_s = q_s + group * D;
    float *stat_s = s_s + group * part;

    const int p = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    // Block sizes are powers of two: a shift and a mask, not a division, per token.
    const int block_size = 1 << block_shift;
    // A length past the table's capacity is clamped: the row's table is all it may read.
    const int len = min((int)seq_lens[b], max_blocks * block_size);
    const int start = p * part;
    if (start >= len) return;
    const int n = min(part, len - start);
    const int heads = kv_heads * group;
    const uint32_t *table = tables + (size_t)b * max_blocks;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // Row t's K or V of this head.
    auto kv_row = [&](const T *cache, int t) {
        const size_t blk = table[t >> block_shift];
        return cache + ((blk * kv_heads + h) * block_size + (t & (block_size - 1))) * D;
    };

    const T *qh = q + ((size_t)b * heads + (size_t)h * group) * D;
    for (int i = threadIdx.x; i < group * D; i += THREADS) q_s[i] = to_f(qh[i]);
    __syncthreads();

    {
        constexpr int PER_WARP = 32 / TG;
        const int tl = lane % TG;
        // j0 is the same for the whole warp, so every lane reaches the shuffles.
        for (int j0 = warp * PER_WARP; j0 < n; j0 += 4 * PER_WARP) {
            const int j = j0 + lane / TG;
            float k[E][CHUNK];
            if (j < n) {
                const T *kr = kv_row(kc, start + j);
#pragma unroll
                for (int c = 0; c < E; ++c) load_f<T, CHUNK>(kr + (c * TG + tl) * CHUNK, k[c]);
            } else {
#pragma unroll
                for (int c = 0; c < E; ++c)
#pragma unroll
                    for (int e = 0; e < CHUNK; ++e) k[c][e] = 0.f;
            }
#pragma unroll
            for (int g = 0; g < GB; ++g) {
                if (g < group) {
                    float dot = 0.f;
#pragma unroll
                    for (int c = 0; c < E; ++c) {
                        const float4 *qc =
                            reinterpret_cast<const float4 *>(q_s + g * D + (c * TG + tl) * CHUNK);
                        const float4 a = qc[0], b4 = qc[1];
                        dot += a.x * k[c][0];
                        dot += a.y * k[c][1];
                        dot += a.z * k[c][2];
                        dot += a.w * k[c][3];
                        dot += b4.x * k[c][4];
                        dot += b4.y * k[c][5];
                        dot += b4.z * k[c][6];
                        dot += b4.w * k[c][7];
                    }
                    dot = butterfly_sum<TG / 2>(dot);
                    if (tl == 0 && j < n) s_s[g * part + j] = dot * scale;
                }
            }
        }
    }
    __syncthreads();

    for (int g = warp; g < group; g += 4) {
        float *sg = s_s + g * part;
        float m = -INFINITY;
        for (int j = lane; j < n; j += 32) m = fmaxf(m, sg[j]);
        m = warp_max(m);
        float l = 0.f;
        for (int j = lane; j < n; j += 32) {
            const float e = expf(sg[j] - m);
            sg[j] = e;
            l += e;
        }
        l = butterfly_sum<16>(l);
        // Zeros past the partition's tokens, which the p·V pass reads four at a time.
        for (int j = n + lane; j < part; j += 32) sg[j] = 0.f;
        if (lane == 0) {
            stat_s[g] = m;
            stat_s[group + g] = l;
        }
    }
    __syncthreads();

    const int set = lane / 8;
    const int col = warp * 8 * E + (lane % 8) * E;
    float acc[GB][E];
#pragma unroll
    for (int g = 0; g < GB; ++g)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
    // Set `set` takes tokens [set * q, set * q + q), q a multiple of 4, four at a time: the four
    // share a block (block sizes are powers of two from 4 on, partitions start on a block) and
    // their probabilities are one float4.
    const int q4 = ((n + SETS - 1) / SETS + 3) & ~3;
    const int end = min(n, (set + 1) * q4);
    for (int j = set * q4; j < end; j += 4) {
        const T *vr = kv_row(vc, start + j) + col;
        float v[4][E];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (j + u < end) {
                load_f<T, E>(vr + u * D, v[u]);
            } else {
#pragma unroll
                for (int e = 0; e < E; ++e) v[u][e] = 0.f;
            }
        }
#pragma unroll
        for (int g = 0; g < GB; ++g) {
            if (g < group) {
                const float4 pj = *reinterpret_cast<const float4 *>(s_s + g * part + j);
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    acc[g][e] += pj.x * v[0][e];
                    acc[g][e] += pj.y * v[1][e];
                    acc[g][e] += pj.z * v[2][e];
                    acc[g][e] += pj.w * v[3][e];
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        if (g < group) {
#pragma unroll
            for (int e = 0; e < E; ++e) {
                acc[g][e] += __shfl_xor_sync(0xffffffff, acc[g][e], 16);
                acc[g][e] += __shfl_xor_sync(0xffffffff, acc[g][e], 8);
            }
        }
    }
    if (set > 0) return;
#pragma unroll
    for (int g = 0; g < GB; ++g) {
        if (g < group) {
            const size_t row = ((size_t)b * heads + (size_t)h * group + g) * n_parts + p;
#pragma unroll
            for (int e = 0; e < E; ++e) ws_out[row * D + col + e] = acc[g][e];
            if (threadIdx.x == 0) {
                ws_max[row] = stat_s[g];
                ws_sum[row] = stat_s[group + g];
            }
        }
    }
}

// Split-KV decode attention, pass 2: one block per (query head, batch row) rescales the row's
// partitions to their common max (log-sum-exp) and writes out = sum_p w_p acc_p / sum_p w_p l_p
// with w_p = exp(max_p - max), rounded once to T; a row of length 0 gets zeros. Every thread
// walks the partitions in order, so the sums are those of the twin. Dynamic shared memory:
// the weights w_p (n_parts floats).
template <typename T>
__device__ void paged_attn_combine(const float *ws_max, const float *ws_sum, const float *ws_out,
                                   const uint32_t *seq_lens, T *out, int heads, int head_dim,
                                   int max_tokens, int n_parts, int part) {
    extern __shared__ float w_s[];
    const int hq = blockIdx.x, b = blockIdx.y;
    const size_t row = (size_t)b * heads + hq;
    T *o = out + row * head_dim;
    const int len = min((int)seq_lens[b], max_tokens);
    if (len == 0) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = from_f<T>(0.f);
        return;
    }
    const int np = (len + part - 1) / part;
    const float *mx = ws_max + row * n_parts;
    const float *sm = ws_sum + row * n_parts;
    const float *acc = ws_out + row * n_parts * head_dim;
    float m = -INFINITY;
    for (int p = 0; p < np; ++p) m = fmaxf(m, mx[p]);
    for (int p = threadIdx.x; p < np; p += blockDim.x) w_s[p] = expf(mx[p] - m);
    __syncthreads();
    float l = 0.f;
    for (int p = 0; p < np; ++p) l += sm[p] * w_s[p];
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.f;
        for (int p = 0; p < np; ++p) a += acc[(size_t)p * head_dim + d] * w_s[p];
        o[d] = from_f<T>(a / l);
    }
}

// Where the accumulators fit in 64 registers, 8 blocks per SM (occupancy, and two even waves
// at batch 64 x 8 partitions x 4 KV heads); measured 10% faster than the compiler's 72.
#define PARTITION(T, SUFFIX, E, GB)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS, E <= 4 && GB * E <= 32 ? 8 : 1)                   \
        paged_attn_partition_##SUFFIX##_e##E##_g##GB(                                               \
            const T *q, const T *kc, const T *vc, const uint32_t *tables,                           \
            const uint32_t *seq_lens, float *ws_max, float *ws_sum, float *ws_out, int kv_heads,    \
            int group, int block_shift, int max_blocks, int n_parts, int part, float scale) {       \
        paged_attn_partition<T, E, GB>(q, kc, vc, tables, seq_lens, ws_max, ws_sum, ws_out,         \
                                       kv_heads, group, block_shift, max_blocks, n_parts, part,     \
                                       scale);                                                      \
    }

// Group bounds 2, 4, 8, 16: the accumulators of the p·V pass are GB x E registers.
#define PARTITIONS(T, SUFFIX, E)                                                                    \
    PARTITION(T, SUFFIX, E, 2)                                                                      \
    PARTITION(T, SUFFIX, E, 4)                                                                      \
    PARTITION(T, SUFFIX, E, 8)                                                                      \
    PARTITION(T, SUFFIX, E, 16)

#define OPS(T, SUFFIX)                                                                              \
    extern "C" __global__ void paged_kv_write_##SUFFIX(                                             \
        T *cache, const T *src, const uint32_t *slots, int kv_heads, int block_size,                \
        int head_dim, long long num_slots, long long s_tok, long long s_head, long long s_dim) {    \
        paged_kv_write<T>(cache, src, slots, kv_heads, block_size, head_dim, num_slots, s_tok,      \
                          s_head, s_dim);                                                           \
    }                                                                                               \
    extern "C" __global__ void paged_attn_combine_##SUFFIX(                                         \
        const float *ws_max, const float *ws_sum, const float *ws_out,                              \
        const uint32_t *seq_lens, T *out, int heads, int head_dim, int max_tokens, int n_parts,     \
        int part) {                                                                                 \
        paged_attn_combine<T>(ws_max, ws_sum, ws_out, seq_lens, out, heads, head_dim,               \
                              max_tokens, n_parts, part);                                           \
    }                                                                                               \
    PARTITIONS(T, SUFFIX, 1)                                                                        \
    PARTITIONS(T, SUFFIX, 2)                                                                        \
    PARTITIONS(T, SUFFIX, 3)                                                                        \
    PARTITIONS(T, SUFFIX, 4)                                                                        \
    PARTITIONS(T, SUFFIX, 5)                                                                        \
    PARTITIONS(T, SUFFIX, 6)                                                                        \
    PARTITIONS(T, SUFFIX, 7)                                                                        \
    PARTITIONS(T, SUFFIX, 8)
OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)
