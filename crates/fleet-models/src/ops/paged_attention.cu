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

// Partition blockIdx.x of row blockIdx.z and KV head blockIdx.y, as both partition kernels see
// it: its first token, its token count (0 when it starts at or past the row's length, which is
// clamped to the table's capacity: the row's table is all it may read) and its tokens' K or V
// rows. Block sizes are powers of two: a shift and a mask, not a division, per token.
template <typename T, int D> struct Partition {
    const uint32_t *table;
    int kv_heads, h, block_shift, start, n;
    __device__ Partition(const uint32_t *tables, const uint32_t *seq_lens, int kv_heads_, int block_shift_,
                         int max_blocks, int part)
        : table(tables + (size_t)blockIdx.z * max_blocks), kv_heads(kv_heads_), h(blockIdx.y),
          block_shift(block_shift_), start(blockIdx.x * part) {
        const int len = min((int)seq_lens[blockIdx.z], max_blocks << block_shift);
        n = max(0, min(part, len - start));
    }
    // The K or V row of the partition's token j (of the row's token start + j).
    __device__ __forceinline__ const T *row(const T *cache, int j) const {
        const int t = start + j, block_size = 1 << block_shift;
        const size_t blk = table[t >> block_shift];
        return cache + ((blk * kv_heads + h) * block_size + (t & (block_size - 1))) * D;
    }
};

// Pass 1's softmax statistics, shared by both partition kernels: warp w takes heads w, w + 4,
// ... of the group; lane l takes tokens l, l + 32, ... of the head's scores s_s[head][0..n) in
// order: their max, then each score replaced by exp(s - max) and summed, the 32 lanes by the
// butterfly; zeros from n to `zero_to`. The max goes to max_s[head], the sum to sum_s[head].
__device__ __forceinline__ void partition_softmax(float *s_s, float *max_s, float *sum_s, int part, int n,
                                                  int group, int zero_to) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int g = warp; g < group; g += THREADS / 32) {
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
        for (int j = n + lane; j < zero_to; j += 32) sg[j] = 0.f;
        if (lane == 0) {
            max_s[g] = m;
            sum_s[g] = l;
        }
    }
}

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
    const Partition<T, D> pt(tables, seq_lens, kv_heads, block_shift, max_blocks, part);
    const int n = pt.n;
    if (n == 0) return;
    const int heads = kv_heads * group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

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
                const T *kr = pt.row(kc, j);
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

    // Zeros past the partition's tokens, which the p·V pass reads four at a time.
    partition_softmax(s_s, stat_s, stat_s + group, part, n, group, part);
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
        const T *vr = pt.row(vc, j) + col;
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

// Split-KV decode attention, pass 1, on the tensor cores: paged_attn_partition's block,
// workspace and softmax (bf16 or f16, head_dim D of 64 or 128, a query group of at most 8),
// with the two products as mma.sync m16n8k16 (f32 sums in the tensor cores' order) instead of
// per-lane multiply-adds. Why: a group of 8 heads multiplies each K and V element 8 times, and
// the per-lane kernel spent more issue slots on those multiply-adds, its shared-memory reads of
// q and p and its conversions than the loads needed (ncu, 30B-A3B judge decode: 44% of the
// bandwidth). Dynamic shared memory: scores [8][part], then max and sum [2][8] (f32).
//
// 1. Scores, a 16-token tile per warp at a time: S[token][head] = K_tile · Qᵀ. Lane (g, c)
//    (g = lane / 4, c = lane % 4) loads 16 bytes of K rows g and g + 8 and of q head g at dims
//    32s + 8c ..: a product is the same sum over any order of its k, so those 8 dims are the
//    lane's two k-pairs of two mma k-steps (the skinny GEMM's trick); q is read once.
// 2. The softmax statistics as paged_attn_partition.
// 3. p·V: Oᵀ[dim][head] = V_tileᵀ · Pᵀ over 16-token tiles, warp w taking dims w D/4 ..; the
//    mma's rows are the warp's dims relabelled so that lane (g, c)'s two rows are adjacent
//    dims of one V row (one load a token), its k the tokens 2c, 2c + 1, 2c + 8, 2c + 9 of the
//    tile, four tiles' V loaded before their products. p is rounded to T for the product, as
//    transformers' eager attention rounds the probabilities to the dtype before p·V.
template <typename T, int D>
__device__ void paged_attn_partition_mma(const T *q, const T *kc, const T *vc, const uint32_t *tables,
                                         const uint32_t *seq_lens, float *ws_max, float *ws_sum,
                                         float *ws_out, int kv_heads, int group, int block_shift,
                                         int max_blocks, int n_parts, int part, float scale) {
    constexpr int KS = D / 32;   // 32-dim steps of a score product (two mma k-steps each)
    constexpr int DW = D / 4;    // p·V: dims of a warp
    constexpr int MT = DW / 16;  // p·V: mma row tiles of a warp (1 or 2)
    extern __shared__ float4 smem4[];
    float *s_s = reinterpret_cast<float *>(smem4);
    float *stat_s = s_s + 8 * part;

    const int p = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const Partition<T, D> pt(tables, seq_lens, kv_heads, block_shift, max_blocks, part);
    const int n = pt.n;
    if (n == 0) return;
    const int heads = kv_heads * group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, c = lane & 3;
    const int tiles = (n + 15) / 16;

    {
        uint4 qf[KS];
        const T *qh = q + ((size_t)b * heads + (size_t)h * group + g) * D;
#pragma unroll
        for (int s = 0; s < KS; ++s)
            qf[s] = g < group ? *reinterpret_cast<const uint4 *>(qh + 32 * s + 8 * c) : make_uint4(0, 0, 0, 0);
        for (int t = warp; t < tiles; t += 4) {
            const int ja = t * 16 + g, jb = ja + 8;
            const T *ra = ja < n ? pt.row(kc, ja) : nullptr;
            const T *rb = jb < n ? pt.row(kc, jb) : nullptr;
            uint4 ka[KS], kb[KS];
#pragma unroll
            for (int s = 0; s < KS; ++s) {
                ka[s] = ra ? *reinterpret_cast<const uint4 *>(ra + 32 * s + 8 * c) : make_uint4(0, 0, 0, 0);
                kb[s] = rb ? *reinterpret_cast<const uint4 *>(rb + 32 * s + 8 * c) : make_uint4(0, 0, 0, 0);
            }
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int s = 0; s < KS; ++s) {
                const uint32_t a0[4] = {ka[s].x, kb[s].x, ka[s].y, kb[s].y};
                const uint32_t b0[2] = {qf[s].x, qf[s].y};
                mma16816<T>(acc, a0, b0);
                const uint32_t a1[4] = {ka[s].z, kb[s].z, ka[s].w, kb[s].w};
                const uint32_t b1[2] = {qf[s].z, qf[s].w};
                mma16816<T>(acc, a1, b1);
            }
            // acc: tokens ja (0, 1) and jb (2, 3); heads 2c (0, 2) and 2c + 1 (1, 3).
            const int h0 = 2 * c, h1 = 2 * c + 1;
            if (ja < n) {
                if (h0 < group) s_s[h0 * part + ja] = acc[0] * scale;
                if (h1 < group) s_s[h1 * part + ja] = acc[1] * scale;
            }
            if (jb < n) {
                if (h0 < group) s_s[h0 * part + jb] = acc[2] * scale;
                if (h1 < group) s_s[h1 * part + jb] = acc[3] * scale;
            }
        }
    }
    __syncthreads();

    // Zeros past the partition's tokens up to its last whole tile, which pass 3 reads.
    partition_softmax(s_s, stat_s, stat_s + 8, part, n, group, tiles * 16);
    __syncthreads();

    // This lane's 2 MT adjacent dims of every V row: tile u's row g is dim base + 2u, its row
    // g + 8 dim base + 2u + 1.
    const int base = warp * DW + 2 * MT * g;
    float o[MT][4];
#pragma unroll
    for (int u = 0; u < MT; ++u) o[u][0] = o[u][1] = o[u][2] = o[u][3] = 0.f;
    for (int t0 = 0; t0 < tiles; t0 += 4) {
        // v[i][r][u]: tile t0 + i, token row r (2c, 2c + 1, 2c + 8, 2c + 9), dims base + 2u, + 1.
        uint32_t v[4][4][MT];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int j = (t0 + i) * 16 + 2 * c + (r & 1) + (r >> 1) * 8;
                if (j < n) {
                    const T *vr = pt.row(vc, j) + base;
                    if constexpr (MT == 2) {
                        const uint2 w = *reinterpret_cast<const uint2 *>(vr);
                        v[i][r][0] = w.x;
                        v[i][r][MT - 1] = w.y;
                    } else {
                        v[i][r][0] = *reinterpret_cast<const uint32_t *>(vr);
                    }
                } else {
#pragma unroll
                    for (int u = 0; u < MT; ++u) v[i][r][u] = 0u;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int j0 = (t0 + i) * 16;
            if (j0 >= n) break;
            // Pᵀ: head g's probabilities of tokens 2c, 2c + 1 and 2c + 8, 2c + 9.
            float2 pa = make_float2(0.f, 0.f), pb = make_float2(0.f, 0.f);
            if (g < group) {
                pa = *reinterpret_cast<const float2 *>(s_s + g * part + j0 + 2 * c);
                pb = *reinterpret_cast<const float2 *>(s_s + g * part + j0 + 2 * c + 8);
            }
            const uint32_t bf[2] = {pack2<T>(pa.x, pa.y), pack2<T>(pb.x, pb.y)};
#pragma unroll
            for (int u = 0; u < MT; ++u) {
                // Row g: the low halves (dim base + 2u), row g + 8: the high ones; k pairs
                // (2c, 2c + 1) from rows 0 and 1, (2c + 8, 2c + 9) from rows 2 and 3.
                const uint32_t a[4] = {__byte_perm(v[i][0][u], v[i][1][u], 0x5410),
                                       __byte_perm(v[i][0][u], v[i][1][u], 0x7632),
                                       __byte_perm(v[i][2][u], v[i][3][u], 0x5410),
                                       __byte_perm(v[i][2][u], v[i][3][u], 0x7632)};
                mma16816<T>(o[u], a, bf);
            }
        }
    }
    // o[u]: dims base + 2u (0, 1) and + 1 (2, 3); heads 2c (0, 2) and 2c + 1 (1, 3).
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int hh = 2 * c + e;
        if (hh < group) {
            const size_t row = ((size_t)b * heads + (size_t)h * group + hh) * n_parts + p;
#pragma unroll
            for (int u = 0; u < MT; ++u)
                *reinterpret_cast<float2 *>(ws_out + row * D + base + 2 * u) = make_float2(o[u][e], o[u][2 + e]);
        }
    }
    if (threadIdx.x < group) {
        const size_t row = ((size_t)b * heads + (size_t)h * group + threadIdx.x) * n_parts + p;
        ws_max[row] = stat_s[threadIdx.x];
        ws_sum[row] = stat_s[8 + threadIdx.x];
    }
}

// Split-KV decode attention, pass 2: one block per (query head, batch row) rescales the row's
// partitions to their common max (log-sum-exp) and writes out = sum_p w_p acc_p / sum_p w_p l_p
// with w_p = exp(max_p - max), rounded once to T; a row of length 0 gets zeros. Every thread
// walks the partitions in order, so the sums are those of the twin. Dynamic shared memory:
// the weights w_p and the partitions' sums (2 n_parts floats). The statistics are loaded once
// by the block together and each thread's partial outputs eight at a time, so the walks read
// shared memory or loads already in flight: a walk of dependent global loads per partition
// took ~8 us a launch at batch 1 (33 partitions; ncu, 2026-11-29d).
template <typename T>
__device__ void paged_attn_combine(const float *ws_max, const float *ws_sum, const float *ws_out,
                                   const uint32_t *seq_lens, T *out, int heads, int head_dim,
                                   int max_tokens, int n_parts, int part) {
    extern __shared__ float w_s[];
    float *l_s = w_s + ((n_parts + 3) & ~3); // 16-byte aligned, as the launcher sizes it
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
    for (int p = threadIdx.x; p < np; p += blockDim.x) {
        w_s[p] = mx[p];
        l_s[p] = sm[p];
    }
    __syncthreads();
    float m = -INFINITY;
    for (int p = 0; p < np; ++p) m = fmaxf(m, w_s[p]);
    __syncthreads(); // every thread has read the maxima before they become weights
    for (int p = threadIdx.x; p < np; p += blockDim.x) w_s[p] = expf(w_s[p] - m);
    __syncthreads();
    float l = 0.f;
    for (int p = 0; p < np; ++p) l += l_s[p] * w_s[p];
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.f;
#pragma unroll 8
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

// The tensor-core partition kernel for head_dim 64 and 128 (bf16, f16), 4 blocks an SM.
#define PARTITION_MMA(T, SUFFIX, D)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS, 4) paged_attn_partition_mma_##SUFFIX##_d##D( \
        const T *q, const T *kc, const T *vc, const uint32_t *tables, const uint32_t *seq_lens,     \
        float *ws_max, float *ws_sum, float *ws_out, int kv_heads, int group, int block_shift,     \
        int max_blocks, int n_parts, int part, float scale) {                                       \
        paged_attn_partition_mma<T, D>(q, kc, vc, tables, seq_lens, ws_max, ws_sum, ws_out,         \
                                       kv_heads, group, block_shift, max_blocks, n_parts, part,     \
                                       scale);                                                      \
    }
OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)
PARTITION_MMA(__half, f16, 64)
PARTITION_MMA(__half, f16, 128)
PARTITION_MMA(__nv_bfloat16, bf16, 64)
PARTITION_MMA(__nv_bfloat16, bf16, 128)
