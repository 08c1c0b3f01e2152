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
        const float act = to_f(from_f<T>(g / (1.f + expf(-g))));
        y[i] = from_f<T>(act * u);
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

#define OPS(T, SUFFIX)                                                                             \
    extern "C" __global__ void swiglu_##SUFFIX(const T *x, T *y, int n_rows, int n_cols) {    \
        swiglu<T>(x, y, n_rows, n_cols);                                                      \
    }                                                                                         \
    extern "C" __global__ void swiglu_bwd_##SUFFIX(const T *x, const T *g, T *dx, int n_rows, \
                                                   int n_cols) {                              \
        swiglu_bwd<T>(x, g, dx, n_rows, n_cols);                                              \
    }
OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)
