// The kernel of ops/transpose.rs, compiled to PTX by build.rs (feature `cuda`); the launcher is
// in the .rs file of the same name, whose reference is candle's transpose and copy.
#include "common.cuh"

// out[b][j][i][:] = x[b][i][j][:] for x contiguous [nb, ni, nj, d] with rows of d elements in
// whole 16-byte vectors: one vector a thread, written in order, read in 16-byte pieces of
// contiguous rows. candle's strided copy decomposes every element's index over four
// dimensions (ncu: ~5% of the bandwidth on the training attention's output gradient).
template <typename T>
__device__ void transpose12_vec(const T *x, T *out, size_t nb, size_t ni, size_t nj, size_t d) {
    constexpr int V = Vec16<T>::N;
    const size_t dv = d / V, n = nb * ni * nj * dv;
    for (size_t o = blockIdx.x * (size_t)blockDim.x + threadIdx.x; o < n;
         o += (size_t)gridDim.x * blockDim.x) {
        const size_t c = o % dv, row = o / dv;
        const size_t i = row % ni, bj = row / ni;
        const size_t j = bj % nj, b = bj / nj;
        store16(out + o * V, load16(x + (((b * ni + i) * nj + j) * dv + c) * V));
    }
}

#define OPS(T, SUFFIX)                                                                           \
    extern "C" __global__ void transpose12_vec_##SUFFIX(const T *x, T *out, size_t nb,          \
                                                        size_t ni, size_t nj, size_t d) {       \
        transpose12_vec<T>(x, out, nb, ni, nj, d);                                               \
    }
OPS(float, f32)
OPS(__half, f16)
OPS(__nv_bfloat16, bf16)
