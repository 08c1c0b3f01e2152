// Fused attention (softmax(q kᵀ · scale) v) in one pass over the keys, the scores never written
// to memory: the online softmax of FlashAttention-2 (Dao, 2023) on tensor cores through WMMA.
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
// sees itself, so no row is empty). Statistics in f32; the probabilities are rounded to T
// before they multiply v, as the unfused path rounds them before its second matmul.
//
// One block = 4 warps = 64 queries of one (batch, head); each warp owns 16 query rows and walks
// the keys in tiles of 32 (staged in shared memory and shared by the 4 warps). Per tile a warp
// computes S = Q Kᵀ with WMMA, updates its rows' running max and sum (two lanes per row), writes
// P in T and accumulates P V with WMMA into f32 registers. Shared memory stays under 48 KiB for
// head dimensions up to 128.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdint.h>

using namespace nvcuda;

namespace {

constexpr int WARPS = 4;
constexpr int ROWS = 16;            // query rows per warp
constexpr int BLOCK_M = WARPS * ROWS;
constexpr int BLOCK_N = 32;         // keys per tile
constexpr int S_LD = BLOCK_N + 4;   // f32 scratch leading dimension (a multiple of 4)
constexpr int P_LD = BLOCK_N + 8;   // probabilities' leading dimension (a multiple of 8)

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// Rows [row0, row0 + n_rows) of one head of q/k/v into shared memory rows of width DP (leading
// dimension DP + 8), zero past `len` rows and past D columns. D is a multiple of 8, so a row is
// whole 16-byte vectors; the caller checks the alignment of the base pointer and strides.
template <typename T, int DP>
__device__ __forceinline__ void stage_rows(T *dst, const T *src, long stride_l, int row0,
                                           int n_rows, int len, int D) {
    constexpr int LD = DP + 8;
    constexpr int VEC = 8; // elements per 16 bytes
    const int per_row = DP / VEC;
    for (int i = threadIdx.x; i < n_rows * per_row; i += blockDim.x) {
        const int r = i / per_row, c = (i % per_row) * VEC;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (row0 + r < len && c < D) {
            val = *reinterpret_cast<const uint4 *>(src + (long)(row0 + r) * stride_l + c);
        }
        *reinterpret_cast<uint4 *>(dst + r * LD + c) = val;
    }
}

template <typename T, int DP>
__device__ void flash_attention(const T *__restrict__ q, const T *__restrict__ k,
                                const T *__restrict__ v, T *__restrict__ out,
                                const uint32_t *__restrict__ key_start, int H, int KVH, int Lq,
                                int Lk, int D, long qsb, long qsl, long qsh, long ksb, long ksl,
                                long ksh, long vsb, long vsl, long vsh, float scale, int causal) {
    constexpr int LD = DP + 8;
    constexpr int KD = DP / 16; // 16-wide chunks of the head dimension
    __shared__ __align__(32) T tiles[2 * BLOCK_N * LD]; // K tile then V tile (Q staging first)
    __shared__ __align__(32) float scratch[WARPS][ROWS * S_LD];
    __shared__ __align__(32) T probs[WARPS][ROWS * P_LD];
    static_assert(2 * BLOCK_N >= BLOCK_M, "Q staging fits the K and V tiles");

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q0 = blockIdx.x * BLOCK_M;
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (H / KVH);
    const int shift = Lk - Lq;
    const int kstart = key_start ? (int)key_start[b] : 0;

    // Q: staged, then held as WMMA fragments for the whole pass.
    const T *qh = q + b * qsb + h * qsh;
    stage_rows<T, DP>(tiles, qh, qsl, q0, BLOCK_M, Lq, D);
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qf[KD];
#pragma unroll
    for (int c = 0; c < KD; ++c) wmma::load_matrix_sync(qf[c], tiles + warp * ROWS * LD + c * 16, LD);

    // Each lane owns one query row (lane / 2) and half of every 16-wide output chunk.
    const int r = lane / 2, half = lane % 2;
    const int qi = q0 + warp * ROWS + r;
    const int qabs = qi + shift;
    float m = -INFINITY, l = 0.f;
    float o[KD][8];
#pragma unroll
    for (int c = 0; c < KD; ++c)
#pragma unroll
        for (int e = 0; e < 8; ++e) o[c][e] = 0.f;

    // Keys this block can see: from the first tile holding an unpadded key (a padding query's
    // own key lies before it; those tiles are visited too when the block has such queries) to
    // the causal limit of its last query.
    const int q_last = min(q0 + BLOCK_M, Lq) - 1;
    const int k_end = causal ? min(Lk, q_last + shift + 1) : Lk;
    int k_begin = 0;
    if (key_start) {
        const int first_pad_query = q0 + shift; // smallest qabs in the block
        k_begin = min(kstart, max(first_pad_query, 0));
    }
    k_begin = (k_begin / BLOCK_N) * BLOCK_N;

    const T *kh = k + b * ksb + kvh * ksh;
    const T *vh = v + b * vsb + kvh * vsh;
    T *ks = tiles, *vs = tiles + BLOCK_N * LD;
    float *sw = scratch[warp];
    T *pw = probs[warp];

    for (int kt = k_begin; kt < k_end; kt += BLOCK_N) {
        __syncthreads(); // the previous tile (or the Q staging) is no longer read
        stage_rows<T, DP>(ks, kh, ksl, kt, BLOCK_N, Lk, D);
        stage_rows<T, DP>(vs, vh, vsl, kt, BLOCK_N, Lk, D);
        __syncthreads();

        // S = Q Kᵀ for this warp's 16 rows and the tile's 32 keys.
#pragma unroll
        for (int n = 0; n < BLOCK_N / 16; ++n) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int c = 0; c < KD; ++c) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
                wmma::load_matrix_sync(kf, ks + n * 16 * LD + c * 16, LD);
                wmma::mma_sync(acc, qf[c], kf, acc);
            }
            wmma::store_matrix_sync(sw + n * 16, acc, S_LD, wmma::mem_row_major);
        }
        __syncwarp();

        // Online softmax: this lane's 16 of the row's 32 scores.
        float s[16];
        float tile_max = -INFINITY;
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            const int j = kt + half * 16 + e;
            const bool visible = qi < Lq && j < Lk && (!causal || j <= qabs) &&
                                 (j >= kstart || j == qabs);
            s[e] = visible ? sw[r * S_LD + half * 16 + e] * scale : -INFINITY;
            tile_max = fmaxf(tile_max, s[e]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
        const float m_new = fmaxf(m, tile_max);
        float alpha = 1.f, sum = 0.f;
        if (m_new != -INFINITY) {
            alpha = expf(m - m_new); // 0 when m was -inf
#pragma unroll
            for (int e = 0; e < 16; ++e) {
                const float p = expf(s[e] - m_new); // 0 for masked keys
                sum += p;
                pw[r * P_LD + half * 16 + e] = from_f<T>(p);
            }
        } else {
#pragma unroll
            for (int e = 0; e < 16; ++e) pw[r * P_LD + half * 16 + e] = from_f<T>(0.f);
        }
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        l = l * alpha + sum;
        m = m_new;
        __syncwarp();

        // O = O * alpha + P V, one 16-wide chunk of the head dimension at a time.
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf[BLOCK_N / 16];
#pragma unroll
        for (int n = 0; n < BLOCK_N / 16; ++n) wmma::load_matrix_sync(pf[n], pw + n * 16, P_LD);
#pragma unroll
        for (int c = 0; c < KD; ++c) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int n = 0; n < BLOCK_N / 16; ++n) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
                wmma::load_matrix_sync(vf, vs + n * 16 * LD + c * 16, LD);
                wmma::mma_sync(acc, pf[n], vf, acc);
            }
            __syncwarp(); // everyone has read the scores / the previous chunk
            wmma::store_matrix_sync(sw, acc, S_LD, wmma::mem_row_major);
            __syncwarp();
#pragma unroll
            for (int e = 0; e < 8; ++e) o[c][e] = o[c][e] * alpha + sw[r * S_LD + half * 8 + e];
        }
    }

    if (qi < Lq) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        T *orow = out + (((long)b * Lq + qi) * H + h) * D;
#pragma unroll
        for (int c = 0; c < KD; ++c)
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int col = c * 16 + half * 8 + e;
                if (col < D) orow[col] = from_f<T>(o[c][e] * inv);
            }
    }
}

} // namespace

#define FLASH(NAME, T, DP)                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                     \
        NAME(const T *q, const T *k, const T *v, T *out, const uint32_t *key_start, int H,       \
             int KVH, int Lq, int Lk, int D, long qsb, long qsl, long qsh, long ksb, long ksl,   \
             long ksh, long vsb, long vsl, long vsh, float scale, int causal) {                  \
        flash_attention<T, DP>(q, k, v, out, key_start, H, KVH, Lq, Lk, D, qsb, qsl, qsh, ksb,   \
                               ksl, ksh, vsb, vsl, vsh, scale, causal);                         \
    }

// Head dimensions padded to a multiple of 16: 64 (tiny and small models), 80 (Qwen3-VL's vision
// tower: 72), 128 (Qwen text decoders).
FLASH(flash_attention_bf16_d64, __nv_bfloat16, 64)
FLASH(flash_attention_bf16_d80, __nv_bfloat16, 80)
FLASH(flash_attention_bf16_d128, __nv_bfloat16, 128)
FLASH(flash_attention_f16_d64, __half, 64)
FLASH(flash_attention_f16_d80, __half, 80)
FLASH(flash_attention_f16_d128, __half, 128)
