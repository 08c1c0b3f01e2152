// The fused kernels of ops/swiglu.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include "common.cuh"

// SwiGLU on the fused gate/up projection: x is [n_rows, 2 * n_cols] (gate then up), y is
// [n_rows, n_cols] = silu(gate) * up, rounded to T after the silu as transformers does.
template <typename T>
__device__ void swiglu(const T *x, T *y, int n_rows, int n_cols) {
    const size_t n = (size_t)n_rows * n_cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_cols, c = i % n_cols;
        const float g = to_f(x[r * 2 * n_cols + c]);
        const float u = to_f(x[r * 2 * n_cols + n_cols + c]);
        y[i] = from_f<T>(silu_mul<T>(g, u));
    }
}

// Backward of `swiglu`: with x = [gate | up] and g the output's gradient, d gate = g * up *
// silu'(gate) and d up = g * silu(gate), silu'(z) = sigmoid(z) + silu(z) * (1 - sigmoid(z)),
// in f32, rounded once to T.
template <typename T>
__device__ void swiglu_bwd(const T *x, const T *g, T *dx, int n_rows, int n_cols) {
    const size_t n = (size_t)n_rows * n_cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / n_cols, c = i % n_cols;
        const size_t gi = r * 2 * n_cols + c, ui = gi + n_cols;
        const float z = to_f(x[gi]), u = to_f(x[ui]), gy = to_f(g[i]);
        const float sig = 1.f / (1.f + expf(-z));
        const float silu = z * sig;
        const float dsilu = sig + silu * (1.f - sig);
        dx[gi] = from_f<T>(gy * u * dsilu);
        dx[ui] = from_f<T>(gy * silu);
    }
}

// The same two kernels on 16-byte vectors (8 bf16/f16 or 4 f32 elements a thread), for rows
// whose n_cols is a multiple of the vector and whose base is 16-byte aligned (the launcher
// checks): one index division per vector instead of a 64-bit division and remainder per
// element, which made the scalar kernels instruction-bound. Each element's arithmetic is the
// scalar kernels', so the results are the same bits.
template <typename T>
__device__ void swiglu_vec(const T *x, T *y, int n_rows, int n_cols) {
    constexpr int V = Vec16<T>::N;
    const size_t cv = n_cols / V, n = (size_t)n_rows * cv;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / cv, c = (i - r * cv) * V;
        const Vec16<T> g = load16(x + r * 2 * n_cols + c), u = load16(x + r * 2 * n_cols + n_cols + c);
        Vec16<T> out;
#pragma unroll
        for (int e = 0; e < V; ++e) out.v[e] = from_f<T>(silu_mul<T>(to_f(g.v[e]), to_f(u.v[e])));
        store16(y + i * V, out);
    }
}

template <typename T>
__device__ void swiglu_bwd_vec(const T *x, const T *g, T *dx, int n_rows, int n_cols) {
    constexpr int V = Vec16<T>::N;
    const size_t cv = n_cols / V, n = (size_t)n_rows * cv;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / cv, c = (i - r * cv) * V;
        const size_t gi = r * 2 * n_cols + c, ui = gi + n_cols;
        const Vec16<T> zv = load16(x + gi), uv = load16(x + ui), gv = load16(g + i * V);
        Vec16<T> dg, du;
#pragma unroll
        for (int e = 0; e < V; ++e) {
            const float z = to_f(zv.v[e]), u = to_f(uv.v[e]), gy = to_f(gv.v[e]);
            const float sig = 1.f / (1.f + expf(-z));
            const float silu = z * sig;
            const float dsilu = sig + silu * (1.f - sig);
            dg.v[e] = from_f<T>(gy * u * dsilu);
            du.v[e] = from_f<T>(gy * silu);
        }
        store16(dx + gi, dg);
        store16(dx + ui, du);
    }
}

#define OPS(T, SUFFIX)                                                                             \
    extern "C" __global__ void swiglu_##SUFFIX(const T *x, T *y, int n_rows, int n_cols) {    \
        swiglu<T>(x, y, n_rows, n_cols);                                                      \
    }                                                                                         \
    extern "C" __global__ void swiglu_bwd_##SUFFIX(const T *x, const T *g, T *dx, int n_rows, \
                                                   int n_cols) {                              \
        swiglu_bwd<T>(x, g, dx, n_rows, n_cols);                                              \
    }                                                                                         \
    extern "C" __global__ void swiglu_vec_##SUFFIX(const T *x, T *y, int n_rows, int n_cols) { \
        swiglu_vec<T>(x, y, n_rows, n_cols);                                                  \
    }                                                                                         \
    extern "C" __global__ void swiglu_bwd_vec_##SUFFIX(const T *x, const T *g, T *dx,          \
                                                       int n_rows, int n_cols) {              \
        swiglu_bwd_vec<T>(x, g, dx, n_rows, n_cols);                                          \
    }
OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)
