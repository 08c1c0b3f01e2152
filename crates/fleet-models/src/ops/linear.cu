// The fused kernels of ops/linear.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include "common.cuh"

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

