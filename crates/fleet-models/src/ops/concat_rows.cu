// The kernel of ops/concat_rows.rs, compiled to PTX by build.rs (feature `cuda`); the launcher
// and the reference (candle's cat of the scaled first part) are in the .rs file of the same name.
#include "common.cuh"

// Up to three contiguous parts of n0, n1, n2 elements written one after the other into out;
// part 0 multiplied by `scale` in f32 and rounded back to T when `scaled` (the attention scale
// folded into q: candle's cast to f32, affine and cast back, the same bits). A grid-stride
// loop over 16-byte vectors: the launcher takes this kernel only when every part's length and
// start are whole vectors. candle's cat launched one unvectorized copy a part, at ~15% of the
// bandwidth on the training blocks' weights.
template <typename T>
__device__ void concat_rows_vec(T *out, const T *p0, const T *p1, const T *p2, size_t n0,
                                size_t n1, size_t n2, float scale, int scaled) {
    constexpr int V = Vec16<T>::N;
    const size_t n = (n0 + n1 + n2) / V;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t e = i * V;
        Vec16<T> v;
        if (e < n0) {
            v = load16(p0 + e);
            if (scaled) {
#pragma unroll
                for (int k = 0; k < V; ++k) v.v[k] = from_f<T>(to_f(v.v[k]) * scale);
            }
        } else if (e < n0 + n1) {
            v = load16(p1 + (e - n0));
        } else {
            v = load16(p2 + (e - n0 - n1));
        }
        store16(out + e, v);
    }
}

// The same, one element a thread, for parts that are not whole vectors.
template <typename T>
__device__ void concat_rows(T *out, const T *p0, const T *p1, const T *p2, size_t n0, size_t n1,
                            size_t n2, float scale, int scaled) {
    const size_t n = n0 + n1 + n2;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        if (e < n0) {
            out[e] = scaled ? from_f<T>(to_f(p0[e]) * scale) : p0[e];
        } else if (e < n0 + n1) {
            out[e] = p1[e - n0];
        } else {
            out[e] = p2[e - n0 - n1];
        }
    }
}

#define OPS(T, SUFFIX)                                                                           \
    extern "C" __global__ void concat_rows_vec_##SUFFIX(T *out, const T *p0, const T *p1,       \
                                                        const T *p2, size_t n0, size_t n1,      \
                                                        size_t n2, float scale, int scaled) {  \
        concat_rows_vec<T>(out, p0, p1, p2, n0, n1, n2, scale, scaled);                         \
    }                                                                                            \
    extern "C" __global__ void concat_rows_##SUFFIX(T *out, const T *p0, const T *p1,           \
                                                    const T *p2, size_t n0, size_t n1,          \
                                                    size_t n2, float scale, int scaled) {      \
        concat_rows<T>(out, p0, p1, p2, n0, n1, n2, scale, scaled);                             \
    }
OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)
