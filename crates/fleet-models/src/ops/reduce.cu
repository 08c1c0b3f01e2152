// The kernels of ops/reduce.rs, compiled to PTX by build.rs (feature `cuda`); the launchers and
// the CPU twins are in the .rs file of the same name.
#include "common.cuh"

// Every kernel here runs blocks of a power-of-two count of threads (REDUCE_THREADS in
// reduce.rs) with that many floats of dynamic shared memory, both set by the launcher.
extern __shared__ float reduce_shared[];

namespace {

// The block's values v[tid] summed as a tree in shared memory (half the threads add the other
// half's, then half that, ...): the twin's order. Returns the sum in thread 0.
__device__ __forceinline__ float block_tree_sum(float v, float *sh) {
    const int tid = threadIdx.x;
    sh[tid] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) sh[tid] += sh[tid + s];
        __syncthreads();
    }
    return sh[0];
}

// Block b's partial sum of squares: thread t squares and adds (f32 fused multiply-adds)
// elements b * blockDim + t, then a grid's width further on, ...; then the block's tree.
template <typename T>
__device__ void sum_squares_partials(const T *x, unsigned long long n, float *partials) {
    float acc = 0.f;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        const float v = to_f(x[i]);
        acc = __fmaf_rn(v, v, acc);
    }
    const float s = block_tree_sum(acc, reduce_shared);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// x[i] = T(x[i] * c), c already rounded to T by the caller (as torch's `g.mul_(coef.to(g))`).
template <typename T> __device__ void scale_in_place(T *x, unsigned long long n, float c) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride)
        x[i] = from_f<T>(to_f(x[i]) * c);
}

} // namespace

// One block: the partials summed thread-strided, then the tree, into out[0].
extern "C" __global__ void sum_partials(const float *partials, int count, float *out) {
    float acc = 0.f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
    const float s = block_tree_sum(acc, reduce_shared);
    if (threadIdx.x == 0) out[0] = s;
}

#define OPS(T, SUFFIX)                                                                         \
    extern "C" __global__ void sum_squares_partials_##SUFFIX(const T *x, unsigned long long n, \
                                                             float *partials) {                \
        sum_squares_partials<T>(x, n, partials);                                               \
    }                                                                                          \
    extern "C" __global__ void scale_in_place_##SUFFIX(T *x, unsigned long long n, float c) {  \
        scale_in_place<T>(x, n, c);                                                            \
    }
OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)
