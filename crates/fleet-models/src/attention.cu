// Fused attention (softmax(q kᵀ · scale) v) in one pass over the keys, the scores never written
// to memory: FlashAttention-2's forward (Dao, 2023) on mma.sync tensor-core instructions.
// Compiled to PTX by build.rs (feature `cuda`); crates/fleet-models/src/attention.rs launches it
// and has the CPU twin that the tests compare it with.
//
// Layouts: q [B, Lq, H, D], k and v [B, Lk, KVH, D] with any element strides over (batch,
// position, head) and the head dimension contiguous; out [B, Lq, H, D] contiguous. Query head h
// reads key/value head h / (H / KVH) (grouped-query attention).
//
// Mask (the decoder's masked_softmax): query i sits at absolute position qabs = i + Lk - Lq.
// With `causal`, key j is visible when j <= qabs; with `key_start` (one u32 per batch row, the
// row's left padding), key j is visible when j >= key_start[b] or j == qabs (a padding query
// sees itself, so no row is empty). With `ks_per_query`, key_start holds one u32 per query
// instead ([B, Lq]: query i's first key, nondecreasing in i within a row — sequences packed
// into one row, each seeing only its own keys), read per query the same way. Statistics in
// f32; the probabilities are rounded to T before they multiply v, as the unfused path rounds
// them before its second matmul.
//
// One block = 4 warps of RT row tiles of 16 queries of one (batch, head); the warps walk the
// keys in tiles of 64, staged in shared memory by cp.async and shared by the 4 warps (V_t is
// copied while S = Q K_t is computed, K_{t+1} while P V_t is). S lands in mma accumulators whose
// layout is the A operand's of P V, so P is rounded to T and packed in registers (the first
// kernel, on WMMA, had to write P to shared memory: WMMA's fragment layouts are not defined).
// Q fragments are read once by ldmatrix and held; K fragments by ldmatrix, V's by
// ldmatrix.trans (V is row-major [key][d], P V wants it k-major). Each K/V fragment read serves
// the warp's RT row tiles. Shared memory stays under 48 KiB for head dimensions up to 128.
#include "ops/common.cuh"

namespace {

constexpr int WARPS = 4;
constexpr int ROWS = 16;            // query rows per row tile
constexpr int BLOCK_N = 64;         // keys per tile

// Rows [row0, row0 + n_rows) of one head of q/k/v into shared memory rows of width DP (leading
// dimension DP + 8), zero past `len` rows and past D columns. D is a multiple of 8, so a row is
// whole 16-byte vectors; the caller checks the alignment of the base pointer and strides.
template <typename T, int DP>
__device__ __forceinline__ void stage_rows(T *dst, const T *src, long stride_l, int row0,
                                           int n_rows, int len, int D) {
    constexpr int LD = DP + 8;
    constexpr int VEC = 8; // elements per 16 bytes
    constexpr int PER_ROW = DP / VEC;
    for (int i = threadIdx.x; i < n_rows * PER_ROW; i += blockDim.x) {
        const int r = i / PER_ROW, c = (i % PER_ROW) * VEC;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (row0 + r < len && c < D) {
            val = *reinterpret_cast<const uint4 *>(src + (long)(row0 + r) * stride_l + c);
        }
        *reinterpret_cast<uint4 *>(dst + r * LD + c) = val;
    }
}

// The same rows copied asynchronously (cp.async, sm_80+): 16-byte copies that zero-fill what
// lies outside the rows or the head dimension; the caller commits and waits. (Unrolled with a
// stride known when compiling, the copies' addresses stay live across the key loop and the
// kernels spill.)
template <typename T, int DP>
__device__ __forceinline__ void stage_rows_async(T *dst, const T *src, long stride_l, int row0,
                                                 int len, int D) {
    constexpr int LD = DP + 8;
    constexpr int VEC = 8;
    constexpr int PER_ROW = DP / VEC;
    for (int i = threadIdx.x; i < BLOCK_N * PER_ROW; i += blockDim.x) {
        const int r = i / PER_ROW, c = (i % PER_ROW) * VEC;
        const bool inside = row0 + r < len && c < D;
        const T *from = inside ? src + (long)(row0 + r) * stride_l + c : src;
        const unsigned to = (unsigned)__cvta_generic_to_shared(dst + r * LD + c);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from),
                     "r"(inside ? 16 : 0));
    }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 2^x by the SFU alone (ex2.approx.ftz: relative error ~2^-22, results below 2^-126 flushed to
// zero). exp2f adds range checks around the same instruction, and the scores' exponent is
// most of the softmax's issue slots (ncu: the integer/logic pipe was the busiest, 38%).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The mask of flash_mma and its backward (see the top of this file).
__device__ __forceinline__ bool key_visible(int qi, int j, int Lq, int Lk, int shift, int causal,
                                            int ks) {
    const int qabs = qi + shift;
    return qi < Lq && j < Lk && (!causal || j <= qabs) && (j >= ks || j == qabs);
}

// Query qi's first key (0 without key_start; one per row or one per query).
__device__ __forceinline__ int first_key(const uint32_t *key_start, int ks_per_query, int b,
                                         int qi, int Lq) {
    if (!key_start) return 0;
    if (ks_per_query) return qi < Lq ? (int)key_start[(long)b * Lq + qi] : 0;
    return (int)key_start[b];
}

// acc (16 rows by NT 8-column tiles) = A Bᵀ: A the warp's 16 rows held as KD k-step
// fragments, B a tile of NT * 8 rows in shared memory (leading dimension LD), read by
// ldmatrix in pairs of 8-row tiles (k_row, k_col: this lane's row and column offsets).

// The keys [k_begin, k_end) a block of queries q0..q_last sees: up to the last query's
// position when causal; from the block's first key start (or its first query's own position,
// always visible) with key starts, rounded down to a key tile.
__device__ __forceinline__ void block_keys(int q0, int q_last, int shift, int Lk, int causal,
                                           bool starts, int kstart, int &k_begin, int &k_end) {
    k_end = causal ? min(Lk, q_last + shift + 1) : Lk;
    k_begin = starts ? min(kstart, max(q0 + shift, 0)) : 0;
    k_begin = (k_begin / BLOCK_N) * BLOCK_N;
}

// Causal blocks are visited last query block first, so the longest finish earliest.
template <typename T, int DP, int RT>
__device__ void flash_mma(const T *__restrict__ q, const T *__restrict__ k,
                          const T *__restrict__ v, T *__restrict__ out,
                          const uint32_t *__restrict__ key_start, int H, int KVH, int Lq, int Lk,
                          int D, long qsb, long qsl, long qsh, long ksb, long ksl, long ksh,
                          long vsb, long vsl, long vsh, float scale, int causal,
                          int ks_per_query) {
    constexpr int LD = DP + 8;
    constexpr int KD = DP / 16;           // k-steps of Q Kᵀ
    constexpr int DT = DP / 8;            // 8-wide column tiles of O
    constexpr int NT = BLOCK_N / 8;       // 8-key column tiles of S
    constexpr int WARP_ROWS = RT * ROWS;
    constexpr int BM = WARPS * WARP_ROWS;
    static_assert(DT % 2 == 0 && NT % 2 == 0, "ldmatrix.x4 reads tiles in pairs");
    __shared__ __align__(16) T tiles[2 * BLOCK_N * LD]; // K tile then V tile (Q staging first)
    static_assert(2 * BLOCK_N >= BM, "Q staging fits the K and V tiles");

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, qd = lane & 3;
    const int qblock = causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int q0 = qblock * BM;
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KVH);
    const int shift = Lk - Lq;
    // The block's first and last queries' starts (one start for a row's every query unless
    // ks_per_query; nondecreasing in the query either way).
    const int q_last = min(q0 + BM, Lq) - 1;
    const int kstart = first_key(key_start, ks_per_query, b, min(q0, q_last), Lq);
    const int kstart_last =
        ks_per_query && key_start ? (int)key_start[(long)b * Lq + q_last] : kstart;

    const T *qh = q + b * qsb + h * qsh;
    stage_rows<T, DP>(tiles, qh, qsl, q0, BM, Lq, D);
    __syncthreads();
    uint32_t qf[RT][KD][4];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int c = 0; c < KD; ++c)
            ldmatrix_x4(qf[r][c], tiles + (warp * WARP_ROWS + r * ROWS + (lane & 15)) * LD +
                                      c * 16 + (lane >> 4) * 8);

    int row_base[RT];
    float m[RT][2], l[RT][2];
    float o[RT][DT][4];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        row_base[r] = q0 + warp * WARP_ROWS + r * ROWS + g;
        m[r][0] = m[r][1] = -INFINITY;
        l[r][0] = l[r][1] = 0.f;
#pragma unroll
        for (int t = 0; t < DT; ++t) o[r][t][0] = o[r][t][1] = o[r][t][2] = o[r][t][3] = 0.f;
    }

    int k_begin, k_end;
    block_keys(q0, q_last, shift, Lk, causal, key_start != nullptr, kstart, k_begin, k_end);

    const T *kh = k + b * ksb + kvh * ksh;
    const T *vh = v + b * vsb + kvh * vsh;
    T *ks = tiles, *vs = tiles + BLOCK_N * LD;
    const float scale_log2 = scale * 1.4426950408889634f;
    // ldmatrix row addresses of this lane: K pairs of 8-key tiles (key, d half), V pairs of
    // 8-wide d tiles (key within 16, d tile).
    const int k_row = (lane >> 4) * 8 + (lane & 7), k_col = ((lane >> 3) & 1) * 8;
    const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8, v_col = (lane >> 4) * 8;

    __syncthreads(); // every warp holds its Q fragments: the staging area becomes the K tile
    if (k_begin < k_end) stage_rows_async<T, DP>(ks, kh, ksl, k_begin, Lk, D);
    cp_async_commit();
    for (int kt = k_begin; kt < k_end; kt += BLOCK_N) {
        stage_rows_async<T, DP>(vs, vh, vsl, kt, Lk, D);
        cp_async_commit();
        cp_async_wait<1>(); // K_t has landed (V_t may still be in flight)
        __syncthreads();

        float s[RT][NT][4];
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int n = 0; n < NT; ++n) s[r][n][0] = s[r][n][1] = s[r][n][2] = s[r][n][3] = 0.f;
#pragma unroll
        for (int c = 0; c < KD; ++c)
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                uint32_t kb[4];
                ldmatrix_x4(kb, ks + (n * 8 + k_row) * LD + c * 16 + k_col);
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    mma16816<T>(s[r][n], qf[r][c], kb);
                    mma16816<T>(s[r][n + 1], qf[r][c], kb + 2);
                }
            }

        const bool whole = kt + BLOCK_N <= Lk && q0 + BM <= Lq && kt >= kstart_last &&
                           (!causal || kt + BLOCK_N - 1 <= q0 + shift);
        uint32_t pa[RT][NT / 2][4];
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int rs = e >> 1;
                    bool visible = true;
                    if (!whole) {
                        const int qi = row_base[r] + 8 * rs;
                        const int j = kt + n * 8 + 2 * qd + (e & 1);
                        const int ks = ks_per_query && qi < Lq
                                           ? (int)key_start[(long)b * Lq + qi]
                                           : kstart;
                        visible = key_visible(qi, j, Lq, Lk, shift, causal, ks);
                    }
                    // Raw scores here; the scale is folded into the exponent's FMA below.
                    const float x = visible ? s[r][n][e] : -INFINITY;
                    s[r][n][e] = x;
                    tile_max[rs] = fmaxf(tile_max[rs], x);
                }
            float alpha[2], m_new[2], neg_m[2], sum[2] = {0.f, 0.f};
#pragma unroll
            for (int rs = 0; rs < 2; ++rs) {
                tile_max[rs] = fmaxf(tile_max[rs], __shfl_xor_sync(0xffffffff, tile_max[rs], 1));
                tile_max[rs] = fmaxf(tile_max[rs], __shfl_xor_sync(0xffffffff, tile_max[rs], 2));
                m_new[rs] = fmaxf(m[r][rs], tile_max[rs] * scale_log2);
                alpha[rs] = m_new[rs] == -INFINITY ? 1.f : exp2_approx(m[r][rs] - m_new[rs]);
                // A row that has seen only hidden keys has every score -inf: exp2(-inf) = 0
                // with no per-element test.
                neg_m[rs] = m_new[rs] == -INFINITY ? 0.f : -m_new[rs];
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                float p[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int rs = e >> 1;
                    p[e] = exp2_approx(fmaf(s[r][n][e], scale_log2, neg_m[rs]));
                    sum[rs] += p[e];
                }
                // Key tile n is half of P's 16-key k-step n / 2: rows g and g + 8.
                pa[r][n / 2][(n & 1) * 2 + 0] = pack2<T>(p[0], p[1]);
                pa[r][n / 2][(n & 1) * 2 + 1] = pack2<T>(p[2], p[3]);
            }
#pragma unroll
            for (int rs = 0; rs < 2; ++rs) {
                sum[rs] += __shfl_xor_sync(0xffffffff, sum[rs], 1);
                sum[rs] += __shfl_xor_sync(0xffffffff, sum[rs], 2);
                l[r][rs] = l[r][rs] * alpha[rs] + sum[rs];
                m[r][rs] = m_new[rs];
            }
#pragma unroll
            for (int t = 0; t < DT; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[r][t][e] *= alpha[e >> 1];
        }

        cp_async_wait<0>(); // V_t has landed
        __syncthreads();    // ... for every warp, and no warp reads K_t any more
        if (kt + BLOCK_N < k_end) stage_rows_async<T, DP>(ks, kh, ksl, kt + BLOCK_N, Lk, D);
        cp_async_commit();

#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk)
#pragma unroll
            for (int t = 0; t < DT; t += 2) {
                uint32_t vb[4];
                ldmatrix_x4_trans(vb, vs + (kk * 16 + v_row) * LD + t * 8 + v_col);
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    mma16816<T>(o[r][t], pa[r][kk], vb);
                    mma16816<T>(o[r][t + 1], pa[r][kk], vb + 2);
                }
            }
        __syncthreads(); // V_t is read before the next tile overwrites it
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < RT; ++r) {
        const float inv[2] = {l[r][0] > 0.f ? 1.f / l[r][0] : 0.f,
                              l[r][1] > 0.f ? 1.f / l[r][1] : 0.f};
#pragma unroll
        for (int t = 0; t < DT; ++t)
#pragma unroll
            for (int rs = 0; rs < 2; ++rs) {
                const int qi = row_base[r] + 8 * rs;
                const int col = t * 8 + 2 * qd;
                if (qi < Lq && col < D)
                    *reinterpret_cast<uint32_t *>(out + (((long)b * Lq + qi) * H + h) * D + col) =
                        pack2<T>(o[r][t][2 * rs] * inv[rs], o[r][t][2 * rs + 1] * inv[rs]);
            }
    }
}

// The backward of flash_mma's function (FlashAttention-2's backward, Dao 2023, in its
// deterministic form: no atomics), in two kernels that each recompute the probabilities from
// q and k. `flash_bwd_dq` (one block per 64 queries of a head, as the forward) walks the keys
// twice: first for each query's log-sum-exp (the forward's running max and sum; written to
// `lse` in the scaled log2 units the second kernel reads), then for dq = dS k with
// dS = P (dP - D) scale, dP = dO vᵀ and D = rowsum(dO o) (`dvec`, [B, Lq, H] f32, from
// `flash_bwd_rowdot` before it).
// `flash_bwd_dkv` (one block per 64 keys of a KV head, 16 keys a warp) walks every query head
// of its group and the queries 16 at a time for dv = Pᵀ dO and dk = dSᵀ q, summed in registers
// in a fixed order. Probabilities and dS are rounded to T before they multiply, as the unfused
// path's matmuls take them in T. Layouts and mask as flash_mma; dq [B, Lq, H, D], dk and dv
// [B, Lk, KVH, D] contiguous. Staging is plain loads (no cp.async pipeline): a first version.
template <typename T, int KD, int NT, int LD>
__device__ __forceinline__ void rows_times_tile(float (*acc)[4], const uint32_t (*a)[4],
                                                const T *tile, int k_row, int k_col) {
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
    for (int c = 0; c < KD; ++c)
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            uint32_t b[4];
            ldmatrix_x4(b, tile + (n * 8 + k_row) * LD + c * 16 + k_col);
            mma16816<T>(acc[n], a[c], b);
            mma16816<T>(acc[n + 1], a[c], b + 2);
        }
}

template <typename T, int DP>
__device__ void flash_bwd_dq(const T *__restrict__ q, const T *__restrict__ k,
                             const T *__restrict__ v, const T *__restrict__ go,
                             const float *__restrict__ dvec, const uint32_t *__restrict__ key_start,
                             T *__restrict__ dq, float *__restrict__ lse_out, int H, int KVH,
                             int Lq, int Lk, int D, long qsb, long qsl, long qsh, long ksb,
                             long ksl, long ksh, long vsb, long vsl, long vsh, long gsb, long gsl,
                             long gsh, float scale, int causal, int ks_per_query) {
    constexpr int LD = DP + 8;
    constexpr int KD = DP / 16;
    constexpr int DT = DP / 8;
    constexpr int NT = BLOCK_N / 8;
    constexpr int BM = WARPS * ROWS;
    static_assert(DT % 2 == 0 && NT % 2 == 0, "ldmatrix.x4 reads tiles in pairs");
    __shared__ __align__(16) T tiles[2 * BLOCK_N * LD]; // K then V tile (q and dO staging first)

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, qd = lane & 3;
    const int q0 = blockIdx.x * BM;
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KVH);
    const int shift = Lk - Lq;
    const int q_last = min(q0 + BM, Lq) - 1;
    const int kstart = first_key(key_start, ks_per_query, b, min(q0, q_last), Lq);

    stage_rows<T, DP>(tiles, q + b * qsb + h * qsh, qsl, q0, BM, Lq, D);
    stage_rows<T, DP>(tiles + BLOCK_N * LD, go + b * gsb + h * gsh, gsl, q0, BM, Lq, D);
    __syncthreads();
    uint32_t qf[KD][4], gf[KD][4];
#pragma unroll
    for (int c = 0; c < KD; ++c) {
        const int off = (warp * ROWS + (lane & 15)) * LD + c * 16 + (lane >> 4) * 8;
        ldmatrix_x4(qf[c], tiles + off);
        ldmatrix_x4(gf[c], tiles + BLOCK_N * LD + off);
    }
    const int row0 = q0 + warp * ROWS + g; // this lane's rows: row0 and row0 + 8
    int ks_row[2];
    float drow[2];
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        const int qi = row0 + 8 * rs;
        ks_row[rs] = first_key(key_start, ks_per_query, b, qi, Lq);
        drow[rs] = qi < Lq ? dvec[((long)b * Lq + qi) * H + h] : 0.f;
    }

    int k_begin, k_end;
    block_keys(q0, q_last, shift, Lk, causal, key_start != nullptr, kstart, k_begin, k_end);
    const T *kh = k + b * ksb + kvh * ksh;
    const T *vh = v + b * vsb + kvh * vsh;
    T *ks = tiles, *vs = tiles + BLOCK_N * LD;
    const float scale_log2 = scale * 1.4426950408889634f;
    const int k_row = (lane >> 4) * 8 + (lane & 7), k_col = ((lane >> 3) & 1) * 8;
    const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8, v_col = (lane >> 4) * 8;

    // S = q kᵀ of key tile kt (raw scores, hidden keys -inf) into s.
    auto scores = [&](int kt, float (*s)[4]) {
        rows_times_tile<T, KD, NT, LD>(s, qf, ks, k_row, k_col);
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rs = e >> 1, j = kt + n * 8 + 2 * qd + (e & 1);
                if (!key_visible(row0 + 8 * rs, j, Lq, Lk, shift, causal, ks_row[rs]))
                    s[n][e] = -INFINITY;
            }
    };

    // Sweep 1: each query's running max and sum over its visible keys.
    __syncthreads(); // the fragments are held: the staging area becomes the K tile
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    for (int kt = k_begin; kt < k_end; kt += BLOCK_N) {
        stage_rows<T, DP>(ks, kh, ksl, kt, BLOCK_N, Lk, D);
        __syncthreads();
        float s[NT][4];
        scores(kt, s);
        __syncthreads(); // the K tile is read before the next one overwrites it
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
        float m_new[2], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            tile_max[rs] = fmaxf(tile_max[rs], __shfl_xor_sync(0xffffffff, tile_max[rs], 1));
            tile_max[rs] = fmaxf(tile_max[rs], __shfl_xor_sync(0xffffffff, tile_max[rs], 2));
            m_new[rs] = fmaxf(m[rs], tile_max[rs] * scale_log2);
        }
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rs = e >> 1;
                if (m_new[rs] != -INFINITY)
                    sum[rs] += exp2_approx(fmaf(s[n][e], scale_log2, -m_new[rs]));
            }
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            sum[rs] += __shfl_xor_sync(0xffffffff, sum[rs], 1);
            sum[rs] += __shfl_xor_sync(0xffffffff, sum[rs], 2);
            const float alpha = m_new[rs] == -INFINITY ? 1.f : exp2_approx(m[rs] - m_new[rs]);
            l[rs] = l[rs] * alpha + sum[rs];
            m[rs] = m_new[rs];
        }
    }
    // In scaled log2 units: p = exp2(s * scale_log2 - lse). A row past Lq sees no key: +inf
    // makes every p 0.
    float lse[2];
#pragma unroll
    for (int rs = 0; rs < 2; ++rs) {
        lse[rs] = l[rs] > 0.f ? m[rs] + __log2f(l[rs]) : INFINITY;
        const int qi = row0 + 8 * rs;
        if (qd == 0 && qi < Lq) lse_out[((long)b * H + h) * Lq + qi] = lse[rs];
    }

    // Sweep 2: dq.
    float acc[DT][4];
#pragma unroll
    for (int t = 0; t < DT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    for (int kt = k_begin; kt < k_end; kt += BLOCK_N) {
        stage_rows<T, DP>(ks, kh, ksl, kt, BLOCK_N, Lk, D);
        stage_rows<T, DP>(vs, vh, vsl, kt, BLOCK_N, Lk, D);
        __syncthreads();
        float s[NT][4], dp[NT][4];
        scores(kt, s);
        rows_times_tile<T, KD, NT, LD>(dp, gf, vs, k_row, k_col); // dP = dO vᵀ
        uint32_t dsa[NT / 2][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            float ds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rs = e >> 1;
                const float p = rnd<T>(exp2_approx(fmaf(s[n][e], scale_log2, -lse[rs])));
                ds[e] = p * (dp[n][e] - drow[rs]) * scale;
            }
            dsa[n / 2][(n & 1) * 2 + 0] = pack2<T>(ds[0], ds[1]);
            dsa[n / 2][(n & 1) * 2 + 1] = pack2<T>(ds[2], ds[3]);
        }
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk)
#pragma unroll
            for (int t = 0; t < DT; t += 2) {
                uint32_t kb[4];
                ldmatrix_x4_trans(kb, ks + (kk * 16 + v_row) * LD + t * 8 + v_col);
                mma16816<T>(acc[t], dsa[kk], kb);
                mma16816<T>(acc[t + 1], dsa[kk], kb + 2);
            }
        __syncthreads(); // K and V are read before the next tiles overwrite them
    }
#pragma unroll
    for (int t = 0; t < DT; ++t)
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            const int qi = row0 + 8 * rs, col = t * 8 + 2 * qd;
            if (qi < Lq && col < D)
                *reinterpret_cast<uint32_t *>(dq + (((long)b * Lq + qi) * H + h) * D + col) =
                    pack2<T>(acc[t][2 * rs], acc[t][2 * rs + 1]);
        }
}

// D = rowsum(dO ∘ O) per (batch, query, head), f32 [B, Lq, H]: one warp a row, 16-byte loads
// of both (the head dimension a multiple of 8, at most 256).
template <typename T>
__device__ void flash_bwd_rowdot(const T *__restrict__ go, const T *__restrict__ o,
                                 float *__restrict__ dvec, int B, int H, int Lq, int D, long gsb,
                                 long gsl, long gsh, long osb, long osl, long osh) {
    const long row = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= (long)B * Lq * H) return;
    const int h = row % H, qi = (row / H) % Lq, b = row / ((long)H * Lq);
    float acc = 0.f;
    if (lane * 8 < D) {
        const uint4 gv = *reinterpret_cast<const uint4 *>(go + b * gsb + qi * gsl + h * gsh + lane * 8);
        const uint4 ov = *reinterpret_cast<const uint4 *>(o + b * osb + qi * osl + h * osh + lane * 8);
        T gt[8], ot[8];
        memcpy(gt, &gv, 16);
        memcpy(ot, &ov, 16);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(to_f(gt[e]), to_f(ot[e]), acc);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, off);
    if (lane == 0) dvec[row] = acc;
}

constexpr int QT = 16; // queries per step of flash_bwd_dkv

template <typename T, int DP>
__device__ void flash_bwd_dkv(const T *__restrict__ q, const T *__restrict__ k,
                              const T *__restrict__ v, const T *__restrict__ go,
                              const float *__restrict__ dvec, const float *__restrict__ lse,
                              const uint32_t *__restrict__ key_start, T *__restrict__ dk,
                              T *__restrict__ dv, int H, int KVH, int Lq, int Lk, int D, long qsb,
                              long qsl, long qsh, long ksb, long ksl, long ksh, long vsb, long vsl,
                              long vsh, long gsb, long gsl, long gsh, float scale, int causal,
                              int ks_per_query) {
    constexpr int LD = DP + 8;
    constexpr int KD = DP / 16;
    constexpr int DT = DP / 8;
    static_assert(DT % 2 == 0, "ldmatrix.x4 reads tiles in pairs");
    constexpr int BK = WARPS * ROWS; // keys a block
    __shared__ __align__(16) T kvs[2 * BK * LD];       // the block's K rows, then its V rows
    __shared__ __align__(16) T qgs[2 * QT * LD];       // a step's q rows, then its dO rows
    __shared__ float lse_s[QT], d_s[QT];
    __shared__ int ks_s[QT];

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, qd = lane & 3;
    const int k0 = blockIdx.x * BK;
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int group = H / KVH;
    const int shift = Lk - Lq;
    T *ksm = kvs, *vsm = kvs + BK * LD, *qs = qgs, *gs = qgs + QT * LD;
    stage_rows<T, DP>(ksm, k + b * ksb + kvh * ksh, ksl, k0, BK, Lk, D);
    stage_rows<T, DP>(vsm, v + b * vsb + kvh * vsh, vsl, k0, BK, Lk, D);

    const float scale_log2 = scale * 1.4426950408889634f;
    const int a_off = (warp * ROWS + (lane & 15)) * LD + (lane >> 4) * 8;
    const int k_row = (lane >> 4) * 8 + (lane & 7), k_col = ((lane >> 3) & 1) * 8;
    const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8, v_col = (lane >> 4) * 8;
    const int key0 = k0 + warp * ROWS + g; // this lane's keys: key0 and key0 + 8

    float dka[DT][4], dva[DT][4];
#pragma unroll
    for (int t = 0; t < DT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[t][e] = dva[t][e] = 0.f;

    // Causal: no query before the block's first key's position sees it.
    const int q_begin = causal ? (max(0, k0 - shift) / QT) * QT : 0;
    for (int hh = 0; hh < group; ++hh) {
        const int h = kvh * group + hh;
        for (int qt = q_begin; qt < Lq; qt += QT) {
            __syncthreads(); // the last step's q and dO are read
            stage_rows<T, DP>(qs, q + b * qsb + h * qsh, qsl, qt, QT, Lq, D);
            stage_rows<T, DP>(gs, go + b * gsb + h * gsh, gsl, qt, QT, Lq, D);
            if (threadIdx.x < QT) {
                const int qi = qt + threadIdx.x;
                lse_s[threadIdx.x] = qi < Lq ? lse[((long)b * H + h) * Lq + qi] : INFINITY;
                d_s[threadIdx.x] = qi < Lq ? dvec[((long)b * Lq + qi) * H + h] : 0.f;
                ks_s[threadIdx.x] = first_key(key_start, ks_per_query, b, qi, Lq);
            }
            __syncthreads();
            // Sᵀ = k qᵀ and dPᵀ = v dOᵀ: 16 keys by QT queries (two 8-query tiles).
            float st[2][4], dpt[2][4];
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
#pragma unroll
            for (int c = 0; c < KD; ++c) {
                uint32_t ka[4], va[4], qb[4], gb[4];
                ldmatrix_x4(ka, ksm + a_off + c * 16);
                ldmatrix_x4(va, vsm + a_off + c * 16);
                ldmatrix_x4(qb, qs + k_row * LD + c * 16 + k_col);
                ldmatrix_x4(gb, gs + k_row * LD + c * 16 + k_col);
                mma16816<T>(st[0], ka, qb);
                mma16816<T>(st[1], ka, qb + 2);
                mma16816<T>(dpt[0], va, gb);
                mma16816<T>(dpt[1], va, gb + 2);
            }
            // Pᵀ and dSᵀ, rounded to T as the A operands of dv and dk (rows: keys; k: queries).
            uint32_t pa[4], dsa[4];
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                float p[4], ds[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = key0 + 8 * (e >> 1), c = n * 8 + 2 * qd + (e & 1);
                    const int qi = qt + c;
                    const bool vis = key_visible(qi, j, Lq, Lk, shift, causal, ks_s[c]);
                    p[e] = vis ? rnd<T>(exp2_approx(fmaf(st[n][e], scale_log2, -lse_s[c]))) : 0.f;
                    ds[e] = p[e] * (dpt[n][e] - d_s[c]) * scale;
                }
                pa[n * 2 + 0] = pack2<T>(p[0], p[1]);
                pa[n * 2 + 1] = pack2<T>(p[2], p[3]);
                dsa[n * 2 + 0] = pack2<T>(ds[0], ds[1]);
                dsa[n * 2 + 1] = pack2<T>(ds[2], ds[3]);
            }
            // dv += Pᵀ dO, dk += dSᵀ q (B: the step's rows k-major, by ldmatrix.trans).
#pragma unroll
            for (int t = 0; t < DT; t += 2) {
                uint32_t gb[4], qb[4];
                ldmatrix_x4_trans(gb, gs + v_row * LD + t * 8 + v_col);
                ldmatrix_x4_trans(qb, qs + v_row * LD + t * 8 + v_col);
                mma16816<T>(dva[t], pa, gb);
                mma16816<T>(dva[t + 1], pa, gb + 2);
                mma16816<T>(dka[t], dsa, qb);
                mma16816<T>(dka[t + 1], dsa, qb + 2);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < DT; ++t)
#pragma unroll
        for (int rs = 0; rs < 2; ++rs) {
            const int j = key0 + 8 * rs, col = t * 8 + 2 * qd;
            if (j < Lk && col < D) {
                const long at = (((long)b * Lk + j) * KVH + kvh) * D + col;
                *reinterpret_cast<uint32_t *>(dk + at) = pack2<T>(dka[t][2 * rs], dka[t][2 * rs + 1]);
                *reinterpret_cast<uint32_t *>(dv + at) = pack2<T>(dva[t][2 * rs], dva[t][2 * rs + 1]);
            }
        }
}

} // namespace

// bf16 mma.sync, ldmatrix and cp.async need sm_80: built for an older GPU the kernels are
// empty, and attention.rs never launches them there (`fused_prefill`, `supported`).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define FLASH_BODY(T, DP, RT)                                                                    \
    flash_mma<T, DP, RT>(q, k, v, out, key_start, H, KVH, Lq, Lk, D, qsb, qsl, qsh, ksb, ksl,    \
                         ksh, vsb, vsl, vsh, scale, causal, ks_per_query);
#else
#define FLASH_BODY(T, DP, RT)
#endif

#define FLASH_MMA(NAME, T, DP, RT, MINB)                                                         \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)                               \
        NAME(const T *q, const T *k, const T *v, T *out, const uint32_t *key_start, int H,       \
             int KVH, int Lq, int Lk, int D, long qsb, long qsl, long qsh, long ksb, long ksl,   \
             long ksh, long vsb, long vsl, long vsh, float scale, int causal, int ks_per_query) {\
        FLASH_BODY(T, DP, RT)                                                                    \
    }

// Two row tiles a warp up to head dimension 80 (`_r1`: one, for FLEET_FLASH_R2=0), one at 128
// (its O accumulators alone take 64 registers a tile), held to 168 registers so that three
// blocks share an SM. On an H100 (the library's rates test): 208 TFLOP/s at the vision tower's
// shape (one tile a warp: 169; the former WMMA kernel: 124) and 177 causal at head dim 128
// with grouped heads (two blocks an SM: 130 before ex2.approx; WMMA: 98).
FLASH_MMA(flash_mma_bf16_d64, __nv_bfloat16, 64, 2, 2)
FLASH_MMA(flash_mma_bf16_d80, __nv_bfloat16, 80, 2, 2)
FLASH_MMA(flash_mma_bf16_d128, __nv_bfloat16, 128, 1, 3)
FLASH_MMA(flash_mma_f16_d64, __half, 64, 2, 2)
FLASH_MMA(flash_mma_f16_d80, __half, 80, 2, 2)
FLASH_MMA(flash_mma_f16_d128, __half, 128, 1, 3)
FLASH_MMA(flash_mma_bf16_d64_r1, __nv_bfloat16, 64, 1, 3)
FLASH_MMA(flash_mma_bf16_d80_r1, __nv_bfloat16, 80, 1, 3)
FLASH_MMA(flash_mma_f16_d64_r1, __half, 64, 1, 3)
FLASH_MMA(flash_mma_f16_d80_r1, __half, 80, 1, 3)

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define BWD_DQ_BODY(T, DP)                                                                       \
    flash_bwd_dq<T, DP>(q, k, v, go, dvec, key_start, dq, lse, H, KVH, Lq, Lk, D, qsb, qsl, qsh, \
                        ksb, ksl, ksh, vsb, vsl, vsh, gsb, gsl, gsh, scale, causal, ks_per_query);
#define BWD_DKV_BODY(T, DP)                                                                      \
    flash_bwd_dkv<T, DP>(q, k, v, go, dvec, lse, key_start, dk, dv, H, KVH, Lq, Lk, D, qsb, qsl, \
                         qsh, ksb, ksl, ksh, vsb, vsl, vsh, gsb, gsl, gsh, scale, causal,        \
                         ks_per_query);
#else
#define BWD_DQ_BODY(T, DP)
#define BWD_DKV_BODY(T, DP)
#endif

// The backward's two kernels (FLEET_FLASH_BWD=1; attention.rs `flash_backward_fused`).
#define FLASH_BWD(SUFFIX, T, DP)                                                                 \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) flash_bwd_dq_##SUFFIX(           \
        const T *q, const T *k, const T *v, const T *go, const float *dvec,                      \
        const uint32_t *key_start, T *dq, float *lse, int H, int KVH, int Lq, int Lk, int D,     \
        long qsb, long qsl, long qsh, long ksb, long ksl, long ksh, long vsb, long vsl,          \
        long vsh, long gsb, long gsl, long gsh, float scale, int causal, int ks_per_query) {     \
        BWD_DQ_BODY(T, DP)                                                                       \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) flash_bwd_dkv_##SUFFIX(          \
        const T *q, const T *k, const T *v, const T *go, const float *dvec, const float *lse,    \
        const uint32_t *key_start, T *dk, T *dv, int H, int KVH, int Lq, int Lk, int D,          \
        long qsb, long qsl, long qsh, long ksb, long ksl, long ksh, long vsb, long vsl,          \
        long vsh, long gsb, long gsl, long gsh, float scale, int causal, int ks_per_query) {     \
        BWD_DKV_BODY(T, DP)                                                                      \
    }
#define FLASH_BWD_ROWDOT(SUFFIX, T)                                                              \
    extern "C" __global__ void flash_bwd_rowdot_##SUFFIX(const T *go, const T *o, float *dvec,   \
                                                         int B, int H, int Lq, int D, long gsb,  \
                                                         long gsl, long gsh, long osb, long osl, \
                                                         long osh) {                             \
        flash_bwd_rowdot<T>(go, o, dvec, B, H, Lq, D, gsb, gsl, gsh, osb, osl, osh);             \
    }
FLASH_BWD_ROWDOT(bf16, __nv_bfloat16)
FLASH_BWD_ROWDOT(f16, __half)
FLASH_BWD(bf16_d64, __nv_bfloat16, 64)
FLASH_BWD(bf16_d128, __nv_bfloat16, 128)
FLASH_BWD(f16_d64, __half, 64)
FLASH_BWD(f16_d128, __half, 128)
