// The kernel of ops/embedding_grad.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include "common.cuh"

// The embedding's backward added to its gradient sum in place: for each distinct token id d
// (blockIdx.x), the rows of g that hold it (rows[offsets[d] .. offsets[d + 1]], increasing)
// are summed in f32 in that order, the sum rounded to T and added to row ids[d] of acc (the
// add rounded to T: the arithmetic of an f32 index_add, a cast and a scatter_add in T). One
// thread a column; blockIdx.y covers the columns in blocks of 256. `packed` is offsets
// (n_distinct + 1), rows (n_rows), ids (n_distinct), one u32 array.
template <typename T, typename G>
__device__ void embedding_grad_add(T *acc, const G *g, const unsigned *packed, int n_distinct,
                                   int n_rows, int hs) {
    const int d = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (d >= n_distinct || c >= hs) return;
    const unsigned *offsets = packed, *rows = packed + n_distinct + 1,
                   *ids = packed + n_distinct + 1 + n_rows;
    float sum = 0.f;
    for (unsigned k = offsets[d]; k < offsets[d + 1]; ++k) sum += to_f(g[(size_t)rows[k] * hs + c]);
    T *dst = acc + (size_t)ids[d] * hs + c;
    *dst = from_f<T>(to_f(*dst) + rnd<T>(sum));
}

#define OPS(T, G, SUFFIX)                                                                         \
    extern "C" __global__ void embedding_grad_add_##SUFFIX(                                     \
        T *acc, const G *g, const unsigned *packed, int n_distinct, int n_rows, int hs) {       \
        embedding_grad_add<T, G>(acc, g, packed, n_distinct, n_rows, hs);                       \
    }
OPS(float, float, f32_f32)
OPS(float, __nv_bfloat16, f32_bf16)
OPS(float, __half, f32_f16)
OPS(__nv_bfloat16, __nv_bfloat16, bf16_bf16)
OPS(__nv_bfloat16, float, bf16_f32)
OPS(__half, __half, f16_f16)
OPS(__half, float, f16_f32)
