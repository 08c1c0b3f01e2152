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
    const int kstart = !key_start ? 0
                       : ks_per_query ? (int)key_start[(long)b * Lq + min(q0, q_last)]
                                      : (int)key_start[b];
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

    const int k_end = causal ? min(Lk, q_last + shift + 1) : Lk;
    int k_begin = 0;
    if (key_start) k_begin = min(kstart, max(q0 + shift, 0));
    k_begin = (k_begin / BLOCK_N) * BLOCK_N;

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
                        const int qi = row_base[r] + 8 * rs, qabs = qi + shift;
                        const int j = kt + n * 8 + 2 * qd + (e & 1);
                        const int ks = ks_per_query && qi < Lq
                                           ? (int)key_start[(long)b * Lq + qi]
                                           : kstart;
                        visible = qi < Lq && j < Lk && (!causal || j <= qabs) &&
                                  (j >= ks || j == qabs);
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
