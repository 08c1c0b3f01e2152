// What every fused kernel of ops/ shares: conversions between the storage type T and f32,
// rounding to T, and block-wide reductions. Included by each ops/<op>.cu.
#pragma once
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

// SwiGLU of one element as transformers rounds it, to be rounded once more to T by the caller:
// g and u are the gate and up projections' values (already T's), silu(g) is rounded to T
// before the product. One definition for the `swiglu` kernels and the GEMVs that end in it.
template <typename T> __device__ __forceinline__ float silu_mul(float g, float u) {
    return rnd<T>(g / (1.f + expf(-g))) * u;
}

// One row of RMSNorm (transformers' arithmetic, as the `rms_norm` kernels) by the whole block,
// on 16-byte vectors (n a multiple of V = 16 / sizeof(T), rows 16-byte aligned): s = x + h
// rounded to T (h == nullptr: s = x), written to s_out unless it is null, and
// y = T(T(s * rsqrt(mean(s^2) + eps)) * w). Thread t holds vectors t, t + blockDim.x, ... (at
// most VPT of them: blockDim.x * VPT >= n / V) in registers, so x, h and w are read once, and
// one block_sum gives the statistics: y's bits depend on blockDim.x through that sum's order
// only. y may point to shared memory. Every thread of the block calls it (block_sum).
template <typename T, int VPT>
__device__ void norm_row_vec(const T *x, const T *h, const T *w, T *s_out, T *y, int n,
                             float eps) {
    constexpr int V = 16 / sizeof(T);
    const int nv = n / V;
    const uint4 *xr = reinterpret_cast<const uint4 *>(x);
    const uint4 *hr = h ? reinterpret_cast<const uint4 *>(h) : nullptr;
    const uint4 *wv = reinterpret_cast<const uint4 *>(w);
    uint4 sv[VPT], wvals[VPT];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        if (v >= nv) continue;
        uint4 a = xr[v];
        wvals[i] = wv[v];
        T *pa = reinterpret_cast<T *>(&a);
        if (hr) {
            uint4 b = hr[v];
            const T *pb = reinterpret_cast<const T *>(&b);
#pragma unroll
            for (int j = 0; j < V; ++j) pa[j] = from_f<T>(to_f(pa[j]) + to_f(pb[j]));
            if (s_out) reinterpret_cast<uint4 *>(s_out)[v] = a;
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float f = to_f(pa[j]);
            ss += f * f;
        }
        sv[i] = a;
    }
    const float inv = rsqrtf(block_sum(ss) / n + eps);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int v = threadIdx.x + i * blockDim.x;
        if (v >= nv) continue;
        uint4 o;
        const T *pa = reinterpret_cast<const T *>(&sv[i]);
        const T *pw = reinterpret_cast<const T *>(&wvals[i]);
        T *po = reinterpret_cast<T *>(&o);
#pragma unroll
        for (int j = 0; j < V; ++j) po[j] = from_f<T>(rnd<T>(to_f(pa[j]) * inv) * to_f(pw[j]));
        reinterpret_cast<uint4 *>(y)[v] = o;
    }
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


// Tensor-core building blocks (sm_80+; instantiated only by kernels built for it).
// c (16x8 f32) += a (16x16, row-major) * b (16x8, k-major) in T: the operands' registers as
// PTX's m16n8k16 fragment layouts (lane = 4 g + q: a holds rows g, g + 8 and columns 2q,
// 2q + 1, 2q + 8, 2q + 9; b columns g, rows 2q, 2q + 1, 2q + 8, 2q + 9; c rows g, g + 8 and
// columns 2q, 2q + 1).
template <typename T> __device__ __forceinline__ void mma16816(float *c, const uint32_t *a, const uint32_t *b);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma16816<__half>(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 matrices of 16-bit elements from shared memory: lane l gives the address of row
// l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); r[i] is this lane's piece of matrix i
// (row lane / 4, columns 2 (lane % 4) and + 1). `_trans` hands out the transpose (row
// 2 (lane % 4) and + 1 of column lane / 4), a k-major B fragment of a row-major tile.
__device__ __forceinline__ void ldmatrix_x4(uint32_t *r, const void *smem) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t *r, const void *smem) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// L2 policies for data read once (evicted first: a decode step's weights) and for data many
// blocks read again (kept last: the few rows of x every block of a skinny GEMM reads).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

// Two f32 values rounded to T and packed into one register, `lo` in the low half (the lower
// column of a fragment pair).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

// 16 bytes of T (8 bf16/f16 or 4 f32 elements), loaded and stored as one uint4: the element-wise
// kernels' vector path, for pointers the launcher has checked to be 16-byte aligned.
template <typename T> struct Vec16 {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
};

template <typename T> __device__ __forceinline__ Vec16<T> load16(const T *p) {
    Vec16<T> out;
    const uint4 raw = *reinterpret_cast<const uint4 *>(p);
    memcpy(out.v, &raw, 16);
    return out;
}

template <typename T> __device__ __forceinline__ void store16(T *p, const Vec16<T> &val) {
    uint4 raw;
    memcpy(&raw, val.v, 16);
    *reinterpret_cast<uint4 *>(p) = raw;
}
