// The kernels of ops/moe_rows.rs, compiled to PTX by build.rs (feature `cuda`); the launchers
// and the references (candle's index_select; its cast, broadcast multiply and sum) are in the
// .rs file of the same name.
#include "common.cuh"

// out[r] = x[idx[r]] for the m rows of `units` copy units each (U: 16, 4 or 2 bytes, the
// largest that divides a row's bytes and both starts): a byte copy, whatever the dtype. A
// row index at or past n_rows (which the callers never pass) writes zeros rather than read
// outside x. candle's index_select ran at ~0.2 TB/s on the MoE prefill's rows (one thread an
// element, its index recomputed from the shape each time).
template <typename U>
__device__ void gather_rows(const U *x, const uint32_t *idx, U *out, long long m, int units,
                            long long n_rows) {
    const long long total = m * units;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / units;
        const int c = (int)(i - r * units);
        const uint32_t src = idx[r];
        U v;
        if (src < n_rows) {
            v = x[(long long)src * units + c];
        } else {
            memset(&v, 0, sizeof(U));
        }
        out[i] = v;
    }
}

#define GATHER(U, SUFFIX)                                                                        \
    extern "C" __global__ void gather_rows_##SUFFIX(const U *x, const uint32_t *idx, U *out,   \
                                                    long long m, int units, long long n_rows) { \
        gather_rows<U>(x, idx, out, m, units, n_rows);                                          \
    }
GATHER(int4, u16b)
GATHER(uint32_t, u4b)
GATHER(uint16_t, u2b)

// A MoE layer's output per token: out[t] = sum over j < k of rnd(rnd(w[t, j]) * y[p]) with
// p = pos[t k + j] (or t k + j when pos is null), summed in f32 in j's order and rounded once
// to T. A position at or past `slots` (y's rows; the routing's sort never gives one) adds
// nothing rather than read outside y. Every rounding is the reference's: the weight cast to T, the product rounded to T
// (candle's bf16/f16 multiply: the product of two 16-bit floats is exact in f32, rounded
// once), the f32 sum of candle's small-sum kernel; so the two agree bit for bit. `cols` a
// multiple of the 16-byte vector and the rows on 16 bytes for the vector kernel; the other
// takes one element a thread.
template <typename T, bool VEC>
__device__ void moe_combine(const T *y, const float *w, const uint32_t *pos, T *out, long long n,
                            int k, int cols, long long slots) {
    constexpr int V = VEC ? Vec16<T>::N : 1;
    const int per_row = cols / V;
    const long long total = n * per_row;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / per_row;
        const int c = (int)(i - t * per_row) * V;
        float acc[V];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = 0.f;
        for (int j = 0; j < k; ++j) {
            const long long s = t * k + j;
            const long long p = pos ? (long long)pos[s] : s;
            if (p >= slots) continue;
            const float wj = rnd<T>(w[s]);
            const T *row = y + p * cols + c;
            if constexpr (VEC) {
                const Vec16<T> v = load16(row);
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] += rnd<T>(wj * to_f(v.v[e]));
            } else {
                acc[0] += rnd<T>(wj * to_f(row[0]));
            }
        }
        if constexpr (VEC) {
            Vec16<T> o;
#pragma unroll
            for (int e = 0; e < V; ++e) o.v[e] = from_f<T>(acc[e]);
            store16(out + t * cols + c, o);
        } else {
            out[t * cols + c] = from_f<T>(acc[0]);
        }
    }
}

#define COMBINE(T, SUFFIX)                                                                       \
    extern "C" __global__ void moe_combine_vec_##SUFFIX(const T *y, const float *w,             \
                                                        const uint32_t *pos, T *out,            \
                                                        long long n, int k, int cols,           \
                                                        long long slots) {                      \
        moe_combine<T, true>(y, w, pos, out, n, k, cols, slots);                                \
    }                                                                                            \
    extern "C" __global__ void moe_combine_##SUFFIX(const T *y, const float *w,                 \
                                                    const uint32_t *pos, T *out, long long n,   \
                                                    int k, int cols, long long slots) {         \
        moe_combine<T, false>(y, w, pos, out, n, k, cols, slots);                               \
    }
COMBINE(__half, f16)
COMBINE(__nv_bfloat16, bf16)

// The sorted prefill's plan of a layer's routing, on the device (ops/moe_rows.rs, moe_plan):
// `ids` holds each routed slot's expert (slot s = token s / k's j-th choice). Two kernels of
// one block per expert, so that nothing is read back but the counts.
//
// counts[e] = the slots routed to expert e.
extern "C" __global__ void moe_plan_counts(const uint32_t *ids, int slots, uint32_t *counts) {
    __shared__ uint32_t warp_count[32];
    const uint32_t e = blockIdx.x;
    uint32_t c = 0;
    for (int s = threadIdx.x; s < slots; s += blockDim.x) c += ids[s] == e;
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffff, c, o);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) warp_count[warp] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t total = 0;
        for (int w = 0; w < (int)(blockDim.x / 32); ++w) total += warp_count[w];
        counts[e] = total;
    }
}

// A stable counting sort by expert: expert e's slots in slot order take the sorted rows
// offset[e] .. offset[e] + counts[e] (offset[e]: the counts of the experts below e), so that
// position[s] is slot s's sorted row and token_of[p] the token of sorted row p: the host's
// order exactly. blockDim.x a multiple of 32, at most 1024.
extern "C" __global__ void moe_plan_order(const uint32_t *ids, const uint32_t *counts, int slots,
                                          int k, uint32_t *position, uint32_t *token_of) {
    __shared__ uint32_t offset;
    __shared__ uint32_t warp_hits[32];
    const uint32_t e = blockIdx.x;
    if (threadIdx.x == 0) {
        uint32_t o = 0;
        for (uint32_t i = 0; i < e; ++i) o += counts[i];
        offset = o;
    }
    __syncthreads();
    uint32_t base = offset;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (int start = 0; start < slots; start += blockDim.x) {
        const int s = start + threadIdx.x;
        const bool hit = s < slots && ids[s] == e;
        const unsigned mask = __ballot_sync(0xffffffff, hit);
        if (lane == 0) warp_hits[warp] = __popc(mask);
        __syncthreads();
        uint32_t before = 0, chunk = 0;
        for (int w = 0; w < warps; ++w) {
            before += w < warp ? warp_hits[w] : 0;
            chunk += warp_hits[w];
        }
        if (hit) {
            const uint32_t p = base + before + __popc(mask & ((1u << lane) - 1));
            position[s] = p;
            token_of[p] = s / k;
        }
        base += chunk;
        __syncthreads();
    }
}
