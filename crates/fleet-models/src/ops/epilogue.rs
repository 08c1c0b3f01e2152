//! Linear layers whose bias, and GELU in its tanh form, ride in the GEMM's epilogue (cuBLASLt):
//! the product is written once, already biased and activated, instead of being written by the
//! GEMM, then read and written again by a bias kernel and by an activation kernel. The CPU
//! twin computes the product in f32, adds the bias, applies the activation and rounds once, as
//! the epilogue does.
//!
//! Only functions the model computes ride in an epilogue: cuBLASLt's GELU is the tanh
//! approximation, which is the vision MLP's `gelu_pytorch_tanh`; an exact (erf) GELU, as in the
//! patch merger, keeps its own kernel after a bias epilogue.

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use super::*;
use crate::error::Result;

/// What the GEMM's epilogue computes from `acc = x · wᵀ` (f32 accumulators), before the one
/// rounding to the output dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// `acc + bias`.
    Bias,
    /// `gelu_tanh(acc + bias)`, transformers' `gelu_pytorch_tanh`:
    /// `0.5 v (1 + tanh(sqrt(2/π) (v + 0.044715 v³)))`.
    BiasGeluTanh,
}

/// `epilogue(x · wᵀ + b)` for `x` `[rows, k]`, `w` `[n, k]`, `b` `[n]` of one dtype: on CUDA
/// (f16 or bf16) one cuBLASLt GEMM with the epilogue; on the CPU the twin (f32 sums, one
/// rounding). Returns `[rows, n]`. No gradients: callers take it only when nothing is tracked.
pub fn linear_epilogue(x: &Tensor, w: &Tensor, b: &Tensor, epilogue: Epilogue) -> Result<Tensor> {
    Ok(contig(x)?.apply_op3_no_bwd(&contig(w)?, &contig(b)?, &LinearEpilogue(epilogue))?)
}

/// `x · wᵀ + b` of a linear layer, with the bias in the GEMM's cuBLASLt epilogue where it can
/// run (CUDA, f16 or bf16, nothing tracked, a bias of the input's dtype, more than
/// [`super::SKINNY_MAX_ROWS`] rows, `FLEET_LT_EPILOGUE` not `0`), else [`super::linear`]
/// (which adds the bias by a kernel of its own after cuBLAS's product: two roundings where the
/// epilogue, and PyTorch's `addmm` on a GPU, make one). For inference-only layers (the vision
/// tower): a layer that a training step also runs with gradients keeps [`super::linear`], so
/// its forward without gradients (GSPO's old log-probabilities) rounds as the tracked one
/// does, bit for bit.
pub fn linear_bias_epilogue(layer: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    linear_with(layer, x, Epilogue::Bias)
}

/// [`linear_bias_epilogue`] or [`linear_gelu_tanh`]: the epilogue's GEMM where it can run,
/// else [`super::linear`] and, for the GELU, candle's `gelu` (the tanh form).
fn linear_with(layer: &candle_nn::Linear, x: &Tensor, epilogue: Epilogue) -> Result<Tensor> {
    let (w, bias) = (layer.weight(), layer.bias());
    let dims = x.dims();
    let k = dims.last().copied().unwrap_or(0);
    let rows = x.elem_count() / k.max(1);
    let Some(bias) = bias.filter(|b| epilogue_takes(x, w, b, rows)) else {
        let y = super::linear(layer, x)?;
        return Ok(match epilogue {
            Epilogue::Bias => y,
            Epilogue::BiasGeluTanh => y.gelu()?,
        });
    };
    let y = linear_epilogue(&x.reshape((rows, k))?, w, bias, epilogue)?;
    let mut out_dims = dims.to_vec();
    *out_dims.last_mut().expect("rank >= 1") = w.dim(0)?;
    Ok(y.reshape(out_dims)?)
}

/// Whether a layer's bias (and activation) may ride in a cuBLASLt epilogue:
/// on CUDA (a cuBLASLt handle made outside any graph capture), f16 or bf16, nothing tracked, a
/// bias of the input's dtype, more rows than the decode kernels take, and `FLEET_LT_EPILOGUE`
/// not `0` (which keeps cuBLAS and the separate
/// bias and activation kernels, for comparison).
fn epilogue_takes(x: &Tensor, w: &Tensor, bias: &Tensor, rows: usize) -> bool {
    static ON: super::EnvSwitch = super::EnvSwitch::new("FLEET_LT_EPILOGUE", true);
    let on = ON.on();
    on && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && bias.dtype() == x.dtype()
        && w.rank() == 2
        && rows > super::SKINNY_MAX_ROWS
        && !(x.track_op() || w.track_op() || bias.track_op())
        && handle_ready(x.device())
}

/// Whether `dev` is a GPU with a cuBLASLt handle, or one that can be made now (not inside a
/// capture).
fn handle_ready(dev: &candle_core::Device) -> bool {
    match dev {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => matches!(cuda::handle(d), Ok(Some(_))),
        _ => false,
    }
}

/// The device's cuBLASLt handle, shared by every op that runs a cuBLASLt GEMM (`None` inside a
/// capture before it exists).
#[cfg(feature = "cuda")]
pub(super) fn cublaslt_handle(
    dev: &candle_core::CudaDevice,
) -> candle_core::Result<
    Option<std::sync::Arc<candle_core::cuda_backend::cudarc::cublaslt::CudaBlasLT>>,
> {
    cuda::handle(dev)
}

/// `gelu_tanh(x · wᵀ + b)` of a linear layer with a bias (the vision MLP's first projection
/// and its activation): one cuBLASLt GEMM as in [`linear_bias_epilogue`], else
/// [`super::linear`] then candle's `gelu` (the tanh form).
pub fn linear_gelu_tanh(layer: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    linear_with(layer, x, Epilogue::BiasGeluTanh)
}

/// `gelu_tanh(v)` in f32, transformers' `gelu_pytorch_tanh`.
fn gelu_tanh(v: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * v * (1.0 + (SQRT_2_OVER_PI * (v + 0.044_715 * v * v * v)).tanh())
}

/// The CPU twin: per output, the product summed in f32 in `k` order, the bias, the
/// activation, one rounding.
fn epilogue_cpu<T: Float>(x: &[T], w: &[T], b: &[T], k: usize, epilogue: Epilogue) -> Vec<T> {
    let n = b.len();
    let mut out = Vec::with_capacity(x.len() / k.max(1) * n);
    for row in x.chunks(k) {
        for (col, wr) in w.chunks(k).enumerate() {
            let acc: f32 = row
                .iter()
                .zip(wr)
                .map(|(a, c)| a.to_f32() * c.to_f32())
                .sum::<f32>()
                + b[col].to_f32();
            out.push(T::from_f32(match epilogue {
                Epilogue::Bias => acc,
                Epilogue::BiasGeluTanh => gelu_tanh(acc),
            }));
        }
    }
    out
}

struct LinearEpilogue(Epilogue);

impl LinearEpilogue {
    /// `(rows, n, k)` after checking x `[rows, k]`, w `[n, k]`, b `[n]`.
    fn dims(l1: &Layout, l2: &Layout, l3: &Layout) -> candle_core::Result<(usize, usize, usize)> {
        let (rows, k) = l1.shape().dims2()?;
        let (n, wk) = l2.shape().dims2()?;
        if wk != k || l3.dims() != [n] {
            candle_core::bail!(
                "linear_epilogue: x {:?}, w {:?}, bias {:?} (want [rows, k], [n, k], [n])",
                l1.dims(),
                l2.dims(),
                l3.dims()
            );
        }
        Ok((rows, n, k))
    }
}

impl candle_core::CustomOp3 for LinearEpilogue {
    fn name(&self) -> &'static str {
        "fleet-linear-epilogue"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, n, k) = Self::dims(l1, l2, l3)?;
        let out = float_cpu!("linear_epilogue", (s1, l1) => x, (s2, l2) => w, (s3, l3) => b;
            epilogue_cpu(x, w, b, k, self.0));
        Ok((out, Shape::from((rows, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let dims = Self::dims(l1, l2, l3)?;
        let y = cuda::linear_epilogue(s1, l1, s2, l2, s3, l3, dims, self.0)?;
        Ok((y, Shape::from((dims.0, dims.1))))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::{Arc, Mutex, OnceLock};

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::cublaslt::{
        Activation, CudaBlasLT, Matmul, MatmulConfig,
    };
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaStorage, Layout};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::Epilogue;

    type Handles = Mutex<Vec<(candle_core::cuda_backend::DeviceId, Arc<CudaBlasLT>)>>;

    /// The device's cuBLASLt handle (and its 32 MiB workspace), one per opened GPU or logical
    /// device ([`per_device`]: `None` inside a capture before it exists).
    pub(super) fn handle(
        dev: &candle_core::CudaDevice,
    ) -> candle_core::Result<Option<Arc<CudaBlasLT>>> {
        static HANDLES: OnceLock<Handles> = OnceLock::new();
        per_device(HANDLES.get_or_init(Default::default), dev, || {
            CudaBlasLT::new(dev.cuda_stream())
                .map_err(|e| candle_core::Error::Cuda(Box::new(e)).bt())
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_epilogue(
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
        dims: (usize, usize, usize),
        epilogue: Epilogue,
    ) -> candle_core::Result<CudaStorage> {
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + DeviceRepr>(
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
            (rows, n, k): (usize, usize, usize),
            epilogue: Epilogue,
        ) -> candle_core::Result<CudaStorage>
        where
            CudaBlasLT: Matmul<T>,
        {
            let dev = s1.device().clone();
            let (x, w, b) = (
                input::<T>(s1, l1)?,
                input::<T>(s2, l2)?,
                input::<T>(s3, l3)?,
            );
            // Column-major, as cuBLAS sees it: yᵀ [n, rows] = W [n, k] (stored as k x n, so
            // transposed) · xᵀ [k, rows]; the bias runs along yᵀ's rows (the outputs).
            let cfg = MatmulConfig {
                transa: true,
                transb: false,
                transc: false,
                m: n as u64,
                n: rows as u64,
                k: k as u64,
                alpha: 1.0,
                lda: k as i64,
                ldb: k as i64,
                beta: 0.0,
                ldc: n as i64,
                stride_a: None,
                stride_b: None,
                stride_c: None,
                stride_bias: None,
                batch_size: None,
            };
            // SAFETY: beta is 0, so the GEMM writes every output without reading it.
            let mut y: CudaSlice<T> = unsafe { dev.alloc::<T>(rows * n)? };
            let act = match epilogue {
                Epilogue::Bias => None,
                Epilogue::BiasGeluTanh => Some(Activation::Gelu),
            };
            let Some(lt) = handle(&dev)? else {
                candle_core::bail!("linear_epilogue: no cuBLASLt handle yet inside a capture")
            };
            // SAFETY: x holds rows * k, w n * k and b n elements (dims checked them against
            // the layouts); y rows * n.
            unsafe { lt.matmul(cfg, &w, &x, &mut y, Some(&b), act.as_ref()) }
                .map_err(|e| candle_core::Error::Cuda(Box::new(e)).bt())?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev))
        }
        match s1.dtype() {
            candle_core::DType::F16 => run::<f16>(s1, l1, s2, l2, s3, l3, dims, epilogue),
            candle_core::DType::BF16 => run::<bf16>(s1, l1, s2, l2, s3, l3, dims, epilogue),
            other => candle_core::bail!("linear_epilogue: {other:?} on CUDA (f16 or bf16)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn twin_is_the_biased_product_then_the_activation() {
        let x = Tensor::new(&[[1f32, 2.0, -1.0], [0.5, 0.0, 3.0]], &Device::Cpu).unwrap();
        let w = Tensor::new(&[[0.5f32, -1.0, 2.0], [1.0, 1.0, 1.0]], &Device::Cpu).unwrap();
        let b = Tensor::new(&[0.25f32, -4.0], &Device::Cpu).unwrap();
        let want = x
            .matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&b)
            .unwrap();
        let got = linear_epilogue(&x, &w, &b, Epilogue::Bias).unwrap();
        assert_eq!(
            got.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap()
        );
        // candle's `gelu` is the tanh form.
        let act = linear_epilogue(&x, &w, &b, Epilogue::BiasGeluTanh).unwrap();
        let diff = max_abs_diff(&act, &want.gelu().unwrap());
        assert!(diff < 1e-6, "{diff}");
    }

    #[test]
    fn mismatched_shapes_are_refused() {
        let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::zeros((4, 5), DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
        let err = linear_epilogue(&x, &w, &b, Epilogue::Bias).unwrap_err();
        assert!(err.to_string().contains("linear_epilogue"), "{err}");
    }
}

#[cfg(all(test, feature = "cuda"))]
mod kernel_tests {
    use super::*;
    use candle_core::Device;

    /// The cuBLASLt epilogues on the GPU against the CPU twin, bf16 and f16, at the vision
    /// tower's widths (and an odd row count): within two units in the last place of the output
    /// dtype relative to the output's scale (the GPU's f32 sums run in another order).
    #[test]
    fn epilogues_match_the_twin() {
        let Some(gpu) = test_gpu("epilogues_match_the_twin") else {
            return;
        };
        let (rows, k, n) = (333, 1152, 4304);
        let rnd = |shape: &[usize], seed: u64, scale: f64| -> Tensor {
            (test_tensor(shape, seed) * scale).unwrap()
        };
        let (x, w, b) = (
            rnd(&[rows, k], 1, 1.0),
            rnd(&[n, k], 2, 0.05),
            rnd(&[n], 3, 0.5),
        );
        for dtype in [DType::BF16, DType::F16] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            for epilogue in [Epilogue::Bias, Epilogue::BiasGeluTanh] {
                let want = linear_epilogue(&cast(&x), &cast(&w), &cast(&b), epilogue)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap();
                let on = |t: &Tensor| cast(t).to_device(&gpu).unwrap();
                let got = linear_epilogue(&on(&x), &on(&w), &on(&b), epilogue)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap();
                let diff = max_abs_diff(&got, &want);
                let scale = max_abs_diff(&want, &want.zeros_like().unwrap());
                let ulp = if dtype == DType::BF16 {
                    2f32.powi(-8)
                } else {
                    2f32.powi(-11)
                };
                assert!(
                    diff <= 2.0 * ulp * scale,
                    "{dtype:?} {epilogue:?}: max diff {diff} at scale {scale}"
                );
            }
        }
    }
}
