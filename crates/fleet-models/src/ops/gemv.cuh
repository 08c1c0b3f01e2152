// The GEMV's lane loop, shared by the kernels that end in their own epilogues: the plain and
// fused GEMVs and the MoE GEMV (linear.cu), the q/k/v projection fused with RoPE (qkv_rope.cu).
#pragma once
#include "common.cuh"

// y[m][col] = sum_k x[m][k] w[col][k] for M (1..4) rows of x: a decode step's product, bound
// by reading w once. One warp per output column `col`: lane l sums the 8-element chunks
// l, l + 32, ... of the row in order (f32 fused multiply-adds, the twin's order), four chunks'
// 16-byte loads of w in flight at a time (streamed: evict first), x's rows through L1; then
// the xor butterfly over the warp, rounded once to T.
template <typename T> __device__ __forceinline__ void unpack8(const uint4 &v, float *out) {
    T t[8];
    memcpy(t, &v, sizeof(uint4));
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = to_f(t[e]);
}

// Lane `lane`'s partial sums of the rows xr[0..M) against R rows of w, wr[0..R) (`chunks`
// 16-byte chunks each): chunks lane, lane + 32, ... in order, four chunks of every w row in
// flight at a time, each row's sums in the twin's order (R = 2: the gate and up rows of a
// SwiGLU, whose loads go out together and share the x chunk). STREAM: w's loads evict first
// (read once a launch); otherwise they stay cached (the MoE kernel reads an expert's row again
// for its next rows). X_SHARED: the rows xr point to shared memory (read plainly), else to
// global memory (read through the read-only cache). PIPE: the next four chunks' loads are
// issued before this four's products (eight a row in flight a lane, the same chunks in the same
// order), for grids too small to fill the SMs with warps, where each warp's bytes in flight set
// the bandwidth. acc[r][m]: row r of w against row m of x, summed over the warp.
template <typename T, int M, bool STREAM, bool X_SHARED = false, bool PIPE = false, int R = 1>
__device__ __forceinline__ void gemv_lane_sums(const T *const *xr, const uint4 *const *wr, int chunks,
                                               int lane, float (*acc)[M]) {
    auto load = [&](const uint4 *p) { return STREAM ? __ldcs(p) : __ldg(p); };
    auto fma_chunk = [&](const uint4 *wv, int c) {
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) unpack8<T>(wv[r], wf[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xf[8];
            const uint4 *xv = reinterpret_cast<const uint4 *>(xr[m]) + c;
            unpack8<T>(X_SHARED ? *xv : __ldg(xv), xf);
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][m] = __fmaf_rn(xf[e], wf[r][e], acc[r][m]);
            }
        }
    };
    int c = lane;
    if (PIPE) {
        if (c + 96 < chunks) {
            uint4 cur[4][R];
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int r = 0; r < R; ++r) cur[u][r] = load(wr[r] + c + 32 * u);
            for (; c + 128 + 96 < chunks; c += 128) {
                uint4 next[4][R];
#pragma unroll
                for (int u = 0; u < 4; ++u)
#pragma unroll
                    for (int r = 0; r < R; ++r) next[u][r] = load(wr[r] + c + 128 + 32 * u);
#pragma unroll
                for (int u = 0; u < 4; ++u) fma_chunk(cur[u], c + 32 * u);
#pragma unroll
                for (int u = 0; u < 4; ++u)
#pragma unroll
                    for (int r = 0; r < R; ++r) cur[u][r] = next[u][r];
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) fma_chunk(cur[u], c + 32 * u);
            c += 128;
        }
    } else {
        for (; c + 96 < chunks; c += 128) {
            uint4 wv[4][R];
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int r = 0; r < R; ++r) wv[u][r] = load(wr[r] + c + 32 * u);
#pragma unroll
            for (int u = 0; u < 4; ++u) fma_chunk(wv[u], c + 32 * u);
        }
    }
    for (; c < chunks; c += 32) {
        uint4 wv[R];
#pragma unroll
        for (int r = 0; r < R; ++r) wv[r] = load(wr[r] + c);
        fma_chunk(wv, c);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffff, acc[r][m], o);
        }
    }
}
