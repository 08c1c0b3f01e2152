// The fused kernels of ops/linear.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include <cuda.h>  // CUtensorMap (the skinny GEMM's TMA copies)

#include "common.cuh"
#include "gemv.cuh"

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


// SWIGLU: w is the MLP's fused [gate; up] projection (2 n rows): warp `col` sums rows col and
// n + col (their loads together) as the plain kernel sums each, rounds both to T and writes
// silu_mul of them (the
// `swiglu` kernel's arithmetic), so y is the bits of the GEMV followed by that kernel, with
// one launch and one [m, 2 n] round trip fewer.
template <typename T, int M, bool PIPE, bool SWIGLU>
__device__ void gemv(const T *x, const T *w, T *y, int n, int k) {
    const int lane = threadIdx.x % 32;
    const int col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (col >= n) return;
    constexpr int R = SWIGLU ? 2 : 1;
    const uint4 *wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint4 *>(w + ((size_t)r * n + col) * k);
    const T *xr[M];
    float acc[R][M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        xr[m] = x + (size_t)m * k;
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] = 0.f;
    }
    gemv_lane_sums<T, M, true, false, PIPE, R>(xr, wr, k / 8, lane, acc);
    if (lane == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m)
            y[(size_t)m * n + col] =
                from_f<T>(SWIGLU ? silu_mul<T>(rnd<T>(acc[0][m]), rnd<T>(acc[R - 1][m])) : acc[0][m]);
    }
}

// gemv_pipe: the same sums with eight loads in flight a lane (PIPE), for grids smaller than a
// wave of the SMs (the launcher chooses); the _swiglu kernels end in the SwiGLU (SWIGLU).
#define GEMV(T, SUFFIX, M)                                                                     \
    extern "C" __global__ void gemv_##SUFFIX##_m##M(const T *x, const T *w, T *y, int n,       \
                                                    int k) {                                   \
        gemv<T, M, false, false>(x, w, y, n, k);                                               \
    }                                                                                          \
    extern "C" __global__ void gemv_pipe_##SUFFIX##_m##M(const T *x, const T *w, T *y, int n,  \
                                                         int k) {                              \
        gemv<T, M, true, false>(x, w, y, n, k);                                                \
    }                                                                                          \
    extern "C" __global__ void gemv_swiglu_##SUFFIX##_m##M(const T *x, const T *w, T *y,       \
                                                           int n, int k) {                     \
        gemv<T, M, false, true>(x, w, y, n, k);                                                \
    }                                                                                          \
    extern "C" __global__ void gemv_pipe_swiglu_##SUFFIX##_m##M(const T *x, const T *w, T *y,  \
                                                                int n, int k) {                \
        gemv<T, M, true, true>(x, w, y, n, k);                                                 \
    }
#define GEMVS(T, SUFFIX)                                                                       \
    GEMV(T, SUFFIX, 1)                                                                         \
    GEMV(T, SUFFIX, 2)                                                                         \
    GEMV(T, SUFFIX, 3)                                                                         \
    GEMV(T, SUFFIX, 4)
GEMVS(__half, f16)
GEMVS(__nv_bfloat16, bf16)

// A decode step's projection fused with the RMSNorm before it and, for the MLP's gate/up
// projection (SWIGLU), the SwiGLU after it: three launches of a layer's ten become one. Each
// block first normalises the M rows (1..4) of s = x + p (p == nullptr: s = x) into shared
// memory with `norm_row_vec`, launched with as many threads as add_rms_norm's vector kernel
// (n / 8 rounded up to warps), so the block sums in the same order and the normalised rows are
// that kernel's bits; block 0 also writes s to s_out (when p is given). The weights' first
// loads are asked of L2 before that, so the prologue overlaps their latency. Then each warp is
// `gemv`'s warp for one output column, reading the rows from shared memory: the same sums in
// the same order. SWIGLU: w is [gate; up] with 2 n rows; warp `col` sums rows col and n + col
// (their loads together) and writes silu(T(gate)) * T(up) rounded as the `swiglu` kernel rounds it. So y is the bits
// of the unfused ops. Dynamic shared memory: M * k elements.
template <typename T, int M, bool SWIGLU>
__device__ void norm_gemv(const T *x, const T *p, const T *nw, float eps, T *s_out, const T *w,
                          T *y, int n, int k) {
    extern __shared__ __align__(16) unsigned char norm_gemv_smem[];
    T *hs = reinterpret_cast<T *>(norm_gemv_smem);
    const int lane = threadIdx.x % 32;
    const int col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int chunks = k / 8;
    const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)col * k);
    const uint4 *ur = wr + (size_t)n * chunks;
    if (col < n) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int c = lane + 32 * u;
            if (c >= chunks) break;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(wr + c));
            if (SWIGLU) asm volatile("prefetch.global.L2 [%0];" ::"l"(ur + c));
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
        if (m) __syncthreads(); // block_sum's partials are reused
        const size_t row = (size_t)m * k;
        T *s_row = p && blockIdx.x == 0 ? s_out + row : nullptr;
        norm_row_vec<T, 1>(x + row, p ? p + row : nullptr, nw, s_row, hs + row, k, eps);
    }
    __syncthreads();
    if (col >= n) return;
    constexpr int R = SWIGLU ? 2 : 1;
    const uint4 *rows[2] = {wr, ur};
    const T *xr[M];
    float acc[R][M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        xr[m] = hs + (size_t)m * k;
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] = 0.f;
    }
    gemv_lane_sums<T, M, true, true, false, R>(xr, rows, chunks, lane, acc);
    if (lane == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            y[(size_t)m * n + col] =
                from_f<T>(SWIGLU ? silu_mul<T>(rnd<T>(acc[0][m]), rnd<T>(acc[R - 1][m])) : acc[0][m]);
        }
    }
}

#define NORM_GEMV(T, SUFFIX, M)                                                                \
    extern "C" __global__ void norm_gemv_##SUFFIX##_m##M(                                      \
        const T *x, const T *p, const T *nw, float eps, T *s_out, const T *w, T *y, int n,     \
        int k) {                                                                               \
        norm_gemv<T, M, false>(x, p, nw, eps, s_out, w, y, n, k);                              \
    }                                                                                          \
    extern "C" __global__ void norm_gemv_swiglu_##SUFFIX##_m##M(                               \
        const T *x, const T *p, const T *nw, float eps, T *s_out, const T *w, T *y, int n,     \
        int k) {                                                                               \
        norm_gemv<T, M, true>(x, p, nw, eps, s_out, w, y, n, k);                               \
    }
#define NORM_GEMVS(T, SUFFIX)                                                                  \
    NORM_GEMV(T, SUFFIX, 1)                                                                    \
    NORM_GEMV(T, SUFFIX, 2)                                                                    \
    NORM_GEMV(T, SUFFIX, 3)                                                                    \
    NORM_GEMV(T, SUFFIX, 4)
NORM_GEMVS(__half, f16)
NORM_GEMVS(__nv_bfloat16, bf16)

// The routed slots' products with their experts' weights, for a MoE decode step: for slot s
// (token s / k's j-th expert e, in the order sorted by expert), y[s][col] = sum_k
// x[s / in_div][k] w[e][col][k] (in_div: k for the gate/up projection, whose input is the
// token's row; 1 for down, whose input is the slot's own row). Block (b, e) takes expert e's
// slots bounds[e]..bounds[e + 1] (`moe_bounds`, launched just before) and `cols` columns per
// warp of it (the warps' columns interleaved), one at a time as `gemv`, up to MOE_ROWS slots
// sharing each load of the expert's row: every touched expert's weights are read once a step
// for up to MOE_ROWS tokens, an untouched expert's block returns after reading its bounds.
// Each output is `gemv`'s sum in `gemv`'s order.
//
// Why the bounds come from a kernel of their own: each block searching the sorted ids itself
// (two binary searches, ~16 dependent reads) cost several times the few loads of real work a
// block has at the 30B-A3B's shapes (k = 768 for down), over tens of thousands of blocks a
// launch; and why several columns a warp: a quarter of the blocks, each still short.
#define MOE_ROWS 4
__device__ __forceinline__ int lower_bound_u32(const uint32_t *v, int n, uint32_t key) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (v[mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// bounds[e] = the first position of expert e in the ascending ids sorted[0..slots), for
// e = 0..experts (bounds[experts] = slots).
extern "C" __global__ void moe_bounds(const uint32_t *sorted, int slots, int experts,
                                      uint32_t *bounds) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e <= experts) bounds[e] = lower_bound_u32(sorted, slots, e);
}

template <typename T>
__device__ void moe_gemv(const T *x, const T *w, const uint32_t *sorted, const uint32_t *bounds,
                         T *y, int slots, int in_div, int n, int k, int cols) {
    // sorted: [2][slots], the expert ids in ascending order, then each one's slot.
    const uint32_t e = blockIdx.y;
    const int lo = bounds[e];
    const int hi = bounds[e + 1];
    const int lane = threadIdx.x % 32;
    const int warps = blockDim.x / 32;
    if (lo == hi) return;
    for (int j = 0; j < cols; ++j) {
        const int col = (blockIdx.x * cols + j) * warps + threadIdx.x / 32;
        if (col >= n) return;
        const uint4 *wr[1] = {reinterpret_cast<const uint4 *>(w + ((size_t)e * n + col) * k)};
        for (int r = lo; r < hi; r += MOE_ROWS) {
            const int rows = min(MOE_ROWS, hi - r);
            const T *xr[MOE_ROWS];
            float acc[1][MOE_ROWS];
#pragma unroll
            for (int m = 0; m < MOE_ROWS; ++m) {
                // Past the expert's last slot: its last row again, summed and not written.
                const uint32_t slot = sorted[slots + r + min(m, rows - 1)];
                xr[m] = x + (size_t)(slot / in_div) * k;
                acc[0][m] = 0.f;
            }
            gemv_lane_sums<T, MOE_ROWS, false>(xr, wr, k / 8, lane, acc);
            if (lane == 0) {
#pragma unroll
                for (int m = 0; m < MOE_ROWS; ++m)
                    if (m < rows) y[(size_t)sorted[slots + r + m] * n + col] = from_f<T>(acc[0][m]);
            }
        }
    }
}

#define MOE_GEMV(T, SUFFIX)                                                                    \
    extern "C" __global__ void moe_gemv_##SUFFIX(const T *x, const T *w, const uint32_t *sorted, \
                                                 const uint32_t *bounds, T *y, int slots,      \
                                                 int in_div, int n, int k, int cols) {         \
        moe_gemv<T>(x, w, sorted, bounds, y, slots, in_div, n, k, cols);                       \
    }
MOE_GEMV(__half, f16)
MOE_GEMV(__nv_bfloat16, bf16)


// The MoE decode's products on the tensor cores (mma.sync.m16n8k16, f32 accumulators): a
// few routed slots' rows of x against an expert's w, bound by reading w once.
//
// The product is computed transposed, w as the mma's A operand (16 output columns per warp)
// and x as B (8 of its rows per n-tile, NT tiles): the few rows fill the mma's narrow side.
// Fragments are loaded straight from memory, 16 bytes per thread: within each 32-wide block of
// k, thread q of a quad loads elements 8q..8q+7 of its row, which the fragment layout reads as
// k = {2q, 2q+1, 2q+8, 2q+9} of two consecutive k-steps. Both operands use the same
// permutation of k, so the sum over k is the product's. The block's 64 columns share x,
// staged in shared memory 128 k at a time, while the next chunk's w is already in flight.
// (The dense skinny GEMM below streams w through a TMA ring instead.)
#define SK_WARPS 4
#define SK_COLS (16 * SK_WARPS)
#define SK_KB 32
#define SK_UNROLL 4
#define SK_KCHUNK (SK_KB * SK_UNROLL)
#define SK_XSTRIDE (SK_KCHUNK + 8)
// Blocks an SM holds (the launch bounds cap the registers to fit them).
#define SK_BLOCKS_PER_SM 3

// This thread's 16-byte pieces of its two w rows (g and g + 8 of the warp's 16) for the
// SK_UNROLL k-blocks of the chunk at kc (zeros past `kn` or for a warp past the last column).
// `stream`: w is read once a launch, so its loads evict first; otherwise they stay cached (a
// MoE expert with more than one group of slots reads its rows again).
template <typename T>
__device__ __forceinline__ void skinny_load_w(const T *w0, const T *w8, int kc, int kn, int q, bool live,
                                              bool stream, uint4 *wa, uint4 *wb) {
    auto load = [&](const T *p) {
        const uint4 *v = reinterpret_cast<const uint4 *>(p);
        return stream ? __ldcs(v) : __ldg(v);
    };
#pragma unroll
    for (int u = 0; u < SK_UNROLL; ++u) {
        if (live && u * SK_KB < kn) {
            wa[u] = load(w0 + kc + u * SK_KB + 8 * q);
            wb[u] = load(w8 + kc + u * SK_KB + 8 * q);
        } else {
            wa[u] = make_uint4(0, 0, 0, 0);
            wb[u] = make_uint4(0, 0, 0, 0);
        }
    }
}

// Where the MoE kernel's x rows are: an expert's slots (the sorted slots from `slot` on), slot
// s reading row s / in_div (the gate/up projection reads its token's row, down the slot's own).
template <typename T> struct SlotRows {
    const T *x;
    const uint32_t *slot;
    int in_div, k;
    __device__ __forceinline__ const T *operator()(int r) const {
        return x + (size_t)(slot[r] / in_div) * k;
    }
};

// k from k0 to k1 into acc: the warp's 16 columns by the block's m x rows (`row(r)`); w's
// loads streamed or cached as `stream` says (skinny_load_w). The next chunk's w is loaded
// while this one is multiplied; with `prefetch_x` its x too (loaded before this chunk's
// products instead of just before the next chunk's staging): without it each chunk waits for
// its x rows' loads (an L2 round trip) between two barriers, which the MoE decode's kernel and
// the skinny GEMM, whose blocks hold few warps, cannot hide. The same sums either way.
template <typename T, int NT, typename Rows>
__device__ __forceinline__ void skinny_segment(const Rows &row, const T *w0, const T *w8, T (*xs)[SK_XSTRIDE],
                                               float (*acc)[4], int m, int k0, int k1, int q,
                                               int g, bool live, bool stream, bool prefetch_x) {
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    uint4 wa[SK_UNROLL], wb[SK_UNROLL], na[SK_UNROLL], nb[SK_UNROLL];
    skinny_load_w<T>(w0, w8, k0, k1 - k0, q, live, stream, wa, wb);
    // x staging: NT * 8 rows of SK_KCHUNK / 8 vectors, NT vectors a thread (128 threads), each
    // thread's vectors at the same rows and columns of every chunk: their rows are found once.
    constexpr int XV = NT * 8 * (SK_KCHUNK / 8) / (32 * SK_WARPS);
    const T *xrow[XV];
#pragma unroll
    for (int j = 0; j < XV; ++j) {
        const int r = (threadIdx.x + j * 32 * SK_WARPS) / (SK_KCHUNK / 8);
        xrow[j] = r < m ? row(r) : nullptr;
    }
    // This thread's x vectors of the chunk at kc (zeros past k1 or past the m rows).
    uint4 xv[XV];
    auto load_x = [&](int kc) {
        const int kn = min(SK_KCHUNK, k1 - kc);
#pragma unroll
        for (int j = 0; j < XV; ++j) {
            const int c = (threadIdx.x + j * 32 * SK_WARPS) % (SK_KCHUNK / 8);
            xv[j] = make_uint4(0, 0, 0, 0);
            if (xrow[j] && c * 8 < kn) xv[j] = __ldg(reinterpret_cast<const uint4 *>(xrow[j] + kc + c * 8));
        }
    };
    if (prefetch_x) load_x(k0);
    for (int kc = k0; kc < k1; kc += SK_KCHUNK) {
        const int kn = min(SK_KCHUNK, k1 - kc);  // a multiple of 32
        const bool more = kc + SK_KCHUNK < k1;
        // The next chunk's w is in flight while this one's x is staged and multiplied.
        if (more) skinny_load_w<T>(w0, w8, kc + SK_KCHUNK, k1 - kc - SK_KCHUNK, q, live, stream, na, nb);
        if (!prefetch_x) load_x(kc);
        __syncthreads();  // the chunk before is read
#pragma unroll
        for (int j = 0; j < XV; ++j) {
            const int i = threadIdx.x + j * 32 * SK_WARPS;
            *reinterpret_cast<uint4 *>(&xs[i / (SK_KCHUNK / 8)][(i % (SK_KCHUNK / 8)) * 8]) = xv[j];
        }
        // The next chunk's x is in flight while this one is multiplied.
        if (prefetch_x && more) load_x(kc + SK_KCHUNK);
        __syncthreads();
#pragma unroll
        for (int u = 0; u < SK_UNROLL; ++u) {
            if (u * SK_KB < kn) {
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const uint4 xq = *reinterpret_cast<const uint4 *>(&xs[t * 8 + g][u * SK_KB + 8 * q]);
                    const uint32_t a0[4] = {wa[u].x, wb[u].x, wa[u].y, wb[u].y};
                    const uint32_t b0[2] = {xq.x, xq.y};
                    mma16816<T>(acc[t], a0, b0);
                    const uint32_t a1[4] = {wa[u].z, wb[u].z, wa[u].w, wb[u].w};
                    const uint32_t b1[2] = {xq.z, xq.w};
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
}

// The skinny GEMM on Hopper: the (column tile, 64-k chunk) units of a block stream through a
// ring of shared-memory stages filled by the tensor memory accelerator (TMA). A producer warp
// (one thread) asks for each unit's w tile ([SKT_COLS rows][64 k], 32 KiB) and x rows
// ([NT * 8][64 k]) with two bulk tensor copies that complete on the stage's `full` mbarrier,
// as soon as the eight consumer warps have released the stage's previous unit on its `empty`
// mbarrier; each consumer warp multiplies its two 16-column tiles of every unit and releases
// it. One block an SM keeps five or six units — 160-192 KiB of w — in flight. Why: at 32 rows
// an SM needs ~140 KiB in flight for its share of the bandwidth (cuBLAS's 32-row kernels keep
// 128-144 KiB: nvjet's 384x32 tiles in four 64-k stages, 128x32 in ten); per-thread cp.async
// copies could not deliver it (2026-11-29g: ~2.7 TB/s with the products left out), and the
// first TMA ring (16 KiB units, a block-wide barrier before each copy) streamed at 2.6-3.3
// TB/s. With the producer warp the stream alone (products and partials left out, ncu
// 2026-11-29h) reaches 81-86% of the DRAM's peak on the 7B's gate/up and down. The copies use
// the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)), so the fragments' ldmatrix
// loads (eight rows of one chunk a phase) fall on distinct banks. Only for sm_90 and later
// (the launcher checks).
//
// Work is spread stream-K fashion: the units, tile-major, are cut into equal contiguous
// ranges, one per block, as many blocks as fit the GPU at once, so no partial wave idles most
// SMs at the end. A tile whose chunks all fall in one block's range is written directly; a
// tile cut by range ends gets f32 partials from each of its blocks (slot = block - the tile's
// first block), which `skinny_reduce`, launched next on the stream, sums.
// Consumer warps (the producer is one more), each SKT_MT tiles of 16 columns.
#define SKT_WARPS 8
#define SKT_MT 2
#define SKT_COLS (16 * SKT_MT * SKT_WARPS)
#define SKT_KCHUNK 64
// Most blocks a cut tile's units may spread over (SKINNY_MAX_SLOTS in linear.rs).
#define SKINNY_MAX_SLOTS 16
template <int NT> struct SkStages {
    static constexpr int value = NT >= 8 ? 5 : 6;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
// Arrives once on `bar` and tells it to expect `bytes` more of transactions this phase.
__device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}
// Arrives once on `bar`.
__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Returns once `bar`'s phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}
// The box of `map` at (c0 innermost, c1) into shared memory at dst, completing on bar.
__device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, int c0, int c1, uint64_t *bar,
                                            uint64_t policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar)), "l"(policy)
        : "memory");
}
// The 16-byte chunk `c` of row `r` of a 128-byte-swizzled tile whose rows are 128 bytes.
__device__ __forceinline__ const void *swizzled(const unsigned char *tile, int r, int c) {
    return tile + r * 128 + ((c ^ (r & 7)) << 4);
}

template <typename T, int NT>
__device__ void skinny_gemm(const CUtensorMap *wmap, const CUtensorMap *xmap, T *y, float *partial, int m,
                            int n, int k, int chunks_per_tile, int units_per_block, int max_slots) {
    constexpr int S = SkStages<NT>::value;
    constexpr unsigned WBYTES = SKT_COLS * SKT_KCHUNK * 2, XBYTES = NT * 8 * SKT_KCHUNK * 2;
    extern __shared__ unsigned char skt_raw[];
    // The 128-byte swizzle repeats every 1024 bytes: stages start on 1024 (the launcher asks
    // for 1024 bytes more than the stages).
    unsigned char *ws =
        reinterpret_cast<unsigned char *>((reinterpret_cast<uintptr_t>(skt_raw) + 1023) & ~uintptr_t(1023));
    unsigned char *xs = ws + S * WBYTES;
    // full[s]: stage s holds its unit (the TMA's bytes landed); empty[s]: every consumer warp
    // has read it.
    __shared__ __align__(8) uint64_t full[S], empty[S];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, q = lane & 3;
    const int cpt = chunks_per_tile;
    const int tiles = (n + SKT_COLS - 1) / SKT_COLS;
    const int u_begin = blockIdx.x * units_per_block;
    const int units = min(u_begin + units_per_block, tiles * cpt) - u_begin;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], SKT_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp == SKT_WARPS) {
        // The producer: one thread walks the block's units, each into the next stage once
        // the consumers have released what it held (TMA zero-fills rows past n or m and k
        // past k), never waiting for the consumers' own progress otherwise.
        if (lane == 0) {
            const uint64_t evict_first = l2_evict_first_policy(), evict_last = l2_evict_last_policy();
            int tile = u_begin / cpt, chunk = u_begin % cpt;
            for (int j = 0; j < units; ++j) {
                const int s = j % S;
                if (j >= S) mbar_wait(&empty[s], (j / S - 1) & 1);
                mbar_expect_tx(&full[s], WBYTES + XBYTES);
                tma_load_2d(ws + s * WBYTES, wmap, chunk * SKT_KCHUNK, tile * SKT_COLS, &full[s], evict_first);
                tma_load_2d(xs + s * XBYTES, xmap, chunk * SKT_KCHUNK, 0, &full[s], evict_last);
                if (++chunk == cpt) {
                    chunk = 0;
                    ++tile;
                }
            }
        }
        return;  // the consumers wait for every unit the producer asked for
    }
    float acc[SKT_MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < SKT_MT; ++mt)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[mt][t][0] = acc[mt][t][1] = acc[mt][t][2] = acc[mt][t][3] = 0.f;
    int tile = u_begin / cpt, chunk = u_begin % cpt;
    int c0 = chunk;  // the first chunk of the tile segment being summed
    // This lane's ldmatrix rows: of w, row (l / 8 odd: + 8) of a 16-row tile, chunk + l / 16;
    // of x, row l % 8 of an 8-row tile, chunk + l / 8.
    const int a_row = warp * 16 * SKT_MT + (lane & 7) + ((lane >> 3) & 1) * 8, a_chunk = lane >> 4;
    const int b_row = lane & 7, b_chunk = lane >> 3;
    for (int j = 0; j < units; ++j) {
        const int s = j % S;
        mbar_wait(&full[s], (j / S) & 1);
        const int kn = min(SKT_KCHUNK, k - chunk * SKT_KCHUNK);  // 32 or 64
        const unsigned char *wt = ws + s * WBYTES, *xt = xs + s * XBYTES;
#pragma unroll
        for (int kk = 0; kk < SKT_KCHUNK / 16; kk += 2) {
            if (kk * 16 >= kn) break;
            // Two k-steps of 16: A fragments of each w tile for each, B fragments of each x
            // tile for both.
            uint32_t a[SKT_MT][2][4];
#pragma unroll
            for (int mt = 0; mt < SKT_MT; ++mt) {
                ldmatrix_x4(a[mt][0], swizzled(wt, a_row + mt * 16, 2 * kk + a_chunk));
                ldmatrix_x4(a[mt][1], swizzled(wt, a_row + mt * 16, 2 * kk + 2 + a_chunk));
            }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                uint32_t b[4];
                ldmatrix_x4(b, swizzled(xt, t * 8 + b_row, 2 * kk + b_chunk));
#pragma unroll
                for (int mt = 0; mt < SKT_MT; ++mt) {
                    mma16816<T>(acc[mt][t], a[mt][0], b);
                    mma16816<T>(acc[mt][t], a[mt][1], b + 2);
                }
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);  // this warp is done with stage s
        const int this_tile = tile, this_chunk = chunk;
        if (++chunk == cpt) {
            chunk = 0;
            ++tile;
        }
        if (this_chunk != cpt - 1 && j != units - 1) continue;
        // The end of a tile segment: acc[mt][t] holds columns col0 + g (0, 1) and col0 + g + 8
        // (2, 3) of the warp's 16-column tile mt, x rows t * 8 + 2q and + 1, over chunks
        // c0..this_chunk of k.
        const bool whole = c0 == 0 && this_chunk == cpt - 1;
        c0 = 0;  // the next segment starts a tile
        if (whole) {
#pragma unroll
            for (int mt = 0; mt < SKT_MT; ++mt) {
                const int col0 = this_tile * SKT_COLS + (warp * SKT_MT + mt) * 16;  // n: a multiple of 16
#pragma unroll
                for (int t = 0; t < NT; ++t) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = t * 8 + 2 * q + (e & 1), col = col0 + g + (e >> 1) * 8;
                        if (col0 < n && row < m) y[(size_t)row * n + col] = from_f<T>(acc[mt][t][e]);
                        acc[mt][t][e] = 0.f;
                    }
                }
            }
            continue;
        }
        // Part of the tile: its slot of partial[tile] ([max_slots][m][SKT_COLS] f32), summed by
        // skinny_reduce after this launch. Why not by the tile's last block: that block's
        // fence, count and serial sum (up to sixteen slots of [m][256] f32) stalled its
        // consumers and ended the launch late: 2026-11-29h, ncu at 32 rows, 12-16 us of each
        // product (7B gate/up 80 us with them, 67 without; q/k/v 26 and 12).
        const int slot = blockIdx.x - this_tile * cpt / units_per_block;
        float *mine = partial + ((size_t)this_tile * max_slots + slot) * m * SKT_COLS;
#pragma unroll
        for (int mt = 0; mt < SKT_MT; ++mt) {
            const int c_in = (warp * SKT_MT + mt) * 16;
            const bool live = this_tile * SKT_COLS + c_in < n;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = t * 8 + 2 * q + (e & 1), col = c_in + g + (e >> 1) * 8;
                    if (live && row < m) mine[(size_t)row * SKT_COLS + col] = acc[mt][t][e];
                    acc[mt][t][e] = 0.f;
                }
            }
        }
    }
}
#define SKINNY_BODY(T, NT)                                                                     \
    skinny_gemm<T, NT>(&wmap, &xmap, y, partial, m, n, k, chunks_per_tile, units_per_block, max_slots)
#else
#define SKINNY_BODY(T, NT) __trap()
#endif

// One block an SM (its stages take up to 217 KiB of shared memory; SKINNY_BLOCKS_PER_SM in
// linear.rs sizes the grid to match): eight consumer warps and the producer's. The maps are
// the launcher's CUtensorMaps of w ([n, k], boxes of SKT_COLS x 64) and x ([m, k], boxes of
// NT * 8 x 64), both 128-byte swizzled.
#define SKINNY(T, SUFFIX, NT)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * (SKT_WARPS + 1), 1)                      \
        skinny_gemm_##SUFFIX##_t##NT(const __grid_constant__ CUtensorMap wmap,                 \
                                     const __grid_constant__ CUtensorMap xmap, T *y,           \
                                     float *partial, int m, int n, int k, int chunks_per_tile, \
                                     int units_per_block, int max_slots) {                     \
        SKINNY_BODY(T, NT);                                                                    \
    }
#define SKINNYS(T, SUFFIX)                                                                     \
    SKINNY(T, SUFFIX, 1)                                                                       \
    SKINNY(T, SUFFIX, 2)                                                                       \
    SKINNY(T, SUFFIX, 4)                                                                       \
    SKINNY(T, SUFFIX, 8)
SKINNYS(__half, f16)
SKINNYS(__nv_bfloat16, bf16)

// The sums of the tiles the skinny GEMM cut: one thread per four columns of a row of a tile,
// the tile's slots added in slot order (deterministic: replays and plain steps give the same
// values) and rounded once to T. Tiles one block took whole were written by that block.
template <typename T>
__device__ void skinny_reduce(const float *partial, T *y, int m, int n, int chunks_per_tile, int units_per_block,
                              int max_slots) {
    const int per_tile = m * SKT_COLS / 4;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int tile = i / per_tile, r = i % per_tile;
    const int row = r / (SKT_COLS / 4), col = tile * SKT_COLS + (r % (SKT_COLS / 4)) * 4;
    if (col >= n) return;  // n is a multiple of 16: the four columns are all in or all out
    const int cpt = chunks_per_tile;
    const int slots = (tile * cpt + cpt - 1) / units_per_block - tile * cpt / units_per_block + 1;
    if (slots == 1) return;
    const float *p = partial + ((size_t)tile * max_slots * m + row) * SKT_COLS + (r % (SKT_COLS / 4)) * 4;
    // Every slot's load issued before the first add. (ncu, 2026-11-29h, caches flushed: 4.6-8.3
    // us a launch, as with four loads in flight: the launch, not the loads, sets its time.)
    float4 v[SKINNY_MAX_SLOTS];
#pragma unroll
    for (int s = 0; s < SKINNY_MAX_SLOTS; ++s)
        if (s < slots) v[s] = __ldcg(reinterpret_cast<const float4 *>(p + (size_t)s * m * SKT_COLS));
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < SKINNY_MAX_SLOTS; ++s)
        if (s < slots) {
            sum.x += v[s].x;
            sum.y += v[s].y;
            sum.z += v[s].z;
            sum.w += v[s].w;
        }
    T *out = y + (size_t)row * n + col;
    out[0] = from_f<T>(sum.x);
    out[1] = from_f<T>(sum.y);
    out[2] = from_f<T>(sum.z);
    out[3] = from_f<T>(sum.w);
}
#define SKINNY_REDUCE(T, SUFFIX)                                                                        \
    extern "C" __global__ void skinny_reduce_##SUFFIX(const float *partial, T *y, int m, int n,         \
                                                      int chunks_per_tile, int units_per_block,         \
                                                      int max_slots) {                                  \
        skinny_reduce<T>(partial, y, m, n, chunks_per_tile, units_per_block, max_slots);                \
    }
SKINNY_REDUCE(__half, f16)
SKINNY_REDUCE(__nv_bfloat16, bf16)

// The MoE decode's products on the tensor cores: `moe_gemv`'s work (expert e's slots
// bounds[e]..bounds[e + 1] against its weights) as the skinny GEMM's warps do it. Block (b, e)
// takes expert e's columns b * SK_COLS.. (16 a warp) and its slots `group` (8 or 16) at a time
// (one or two of the mma's 8-wide sides against each load of the weights), their x rows
// gathered into shared memory 128 k at a time. w is streamed (read once) where the expert's
// slots fit one group; an expert with more keeps its rows cached for the next group. Why:
// `moe_gemv` reloads and converts every
// slot's input for each column, so its instructions, not its bytes, set its pace (ncu on an
// H200, 30B-A3B decode at batch 32: 0.7-0.9 TB/s, and holding the weights in registers changed
// nothing). Groups of 16: at batch 96 an expert has ~6 slots on average (768 routed over 128)
// and about one in seven has 9 to 16, whose weights groups of 8 read twice. A slot's sums do
// not depend on its group (each mma column is its own), so both group sizes give the same
// bits. Sums in f32 in the tensor cores' order, rounded once: within a unit in the last
// place of `moe_gemv`'s, not bit for bit. k a multiple of 32, n of 16 (the launcher checks).
template <typename T>
__device__ void moe_mma(const T *x, const T *w, const uint32_t *sorted, const uint32_t *bounds, T *y,
                        int slots, int in_div, int n, int k, int group, bool prefetch_x) {
    __shared__ __align__(16) T xs[16][SK_XSTRIDE];
    const uint32_t e = blockIdx.y;
    const int lo = bounds[e], hi = bounds[e + 1];
    if (lo == hi) return;  // the whole block: no barrier is skipped by some threads only
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, q = lane & 3;
    const int col0 = blockIdx.x * SK_COLS + warp * 16;
    const bool live = col0 < n;
    const T *w0 = w + ((size_t)e * n + (live ? col0 + g : 0)) * k;
    const T *w8 = w0 + (size_t)8 * k;
    const bool stream = hi - lo <= group;
    for (int r = lo; r < hi; r += group) {
        const int m = min(group, hi - r);
        const SlotRows<T> rows{x, sorted + slots + r, in_div, k};
        float acc[2][4];
        // m is the same for the whole block: every thread takes the same branch.
        if (m > 8)
            skinny_segment<T, 2>(rows, w0, w8, xs, acc, m, 0, k, q, g, live, stream, prefetch_x);
        else
            skinny_segment<T, 1>(rows, w0, w8, xs, acc, m, 0, k, q, g, live, stream, prefetch_x);
        // acc[t]: columns col0 + g (0, 1) and col0 + g + 8 (2, 3), slots r + 8t + 2q and + 1.
        if (!live) continue;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = 8 * t + 2 * q + (i & 1), col = col0 + g + (i >> 1) * 8;
                if (row < m) y[(size_t)sorted[slots + r + row] * n + col] = from_f<T>(acc[t][i]);
            }
        }
    }
}

#define MOE_MMA(T, SUFFIX)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * SK_WARPS, SK_BLOCKS_PER_SM)              \
        moe_mma_##SUFFIX(const T *x, const T *w, const uint32_t *sorted, const uint32_t *bounds, \
                         T *y, int slots, int in_div, int n, int k, int group,                 \
                         int prefetch_x) {                                                     \
        moe_mma<T>(x, w, sorted, bounds, y, slots, in_div, n, k, group, prefetch_x != 0);      \
    }
MOE_MMA(__half, f16)
MOE_MMA(__nv_bfloat16, bf16)
