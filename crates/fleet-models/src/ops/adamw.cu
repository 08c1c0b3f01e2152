// The fused kernels of ops/adamw.rs, compiled to PTX by build.rs (feature `cuda`); the
// launcher and the CPU twin are in the .rs file of the same name.
#include "common.cuh"

// One AdamW step in place, as torch.optim.AdamW (foreach=False) computes it in f32:
// p *= 1 - lr * wd; m = m + (1 - b1) * (g - m); v = v * b2 + (1 - b2) * g * g;
// p += -step_size * m / (sqrt(v) / bc2_sqrt + eps). One thread per element. omb1 and omb2
// are 1 - b1 and 1 - b2 computed in f64 and rounded, as the composed version gets them; every
// product and sum is rounded on its own (no contraction), as candle's kernels compute them.
// T: the parameter's and moments' dtype (computed in f32, each rounded once on store, as the
// composed step's to_dtype does); G: the gradient's (read in f32, exactly).
template <typename T, typename G>
__device__ void adamw(T *p, const G *g, T *m, T *v, long long n, float decay, float omb1,
                      float b2, float omb2, float eps, float step_size, float bc2_sqrt) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float gi = to_f(g[i]), m0 = to_f(m[i]), v0 = to_f(v[i]);
        const float mi = __fadd_rn(__fmul_rn(__fsub_rn(gi, m0), omb1), m0);
        const float vi = __fadd_rn(__fmul_rn(v0, b2), __fmul_rn(__fmul_rn(gi, omb2), gi));
        const float denom = __fadd_rn(__fdiv_rn(sqrtf(vi), bc2_sqrt), eps);
        const float pi = __fmul_rn(to_f(p[i]), decay);
        p[i] = from_f<T>(__fadd_rn(pi, __fmul_rn(__fdiv_rn(mi, denom), -step_size)));
        m[i] = from_f<T>(mi);
        v[i] = from_f<T>(vi);
    }
}

#define ADAMW(T, G, NAME)                                                                      \
    extern "C" __global__ void NAME(T *p, const G *g, T *m, T *v, long long n, float decay,    \
                                    float omb1, float b2, float omb2, float eps,                \
                                    float step_size, float bc2_sqrt) {                          \
        adamw<T, G>(p, g, m, v, n, decay, omb1, b2, omb2, eps, step_size, bc2_sqrt);           \
    }
// f32 masters (f32 gradients), and bf16 masters as TRL trains a bf16-loaded model (bf16
// gradients and moments: torch keeps the moments in the parameter's dtype).
ADAMW(float, float, adamw_f32)
ADAMW(__nv_bfloat16, __nv_bfloat16, adamw_bf16)

// y[r, c] += bias[c] in place for y [n_rows, n_cols] contiguous: the bias of a linear layer
// after its GEMM (candle's broadcast add runs a strided kernel that takes several times the GEMM
// on wide activations). Grid-stride, one element per thread and step.
