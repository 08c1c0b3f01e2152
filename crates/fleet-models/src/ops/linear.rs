//! A linear layer with its bias added in place after the GEMM.

use candle_core::{CpuStorage, Layout, Tensor};

use super::*;
use crate::error::Result;

/// `x · wᵀ + b` of a linear layer ([`candle_nn::Linear`]'s result). On CUDA, when nothing is
/// tracked for a backward, the bias is added in place by one kernel after the GEMM: candle's
/// broadcast add is a strided kernel that took 4x the GEMM itself on the vision tower's
/// `[65536, 4304]` activations (measured on an H200).
pub fn linear(layer: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    use candle_core::Module;
    let Some(bias) = layer.bias() else {
        return Ok(layer.forward(x)?);
    };
    let w = layer.weight();
    if !x.device().is_cuda() || x.track_op() || w.track_op() || bias.track_op() {
        return Ok(layer.forward(x)?);
    }
    let dims = x.dims();
    let k = dims[dims.len() - 1];
    let rows = x.elem_count() / k.max(1);
    let y = x.reshape((rows, k))?.matmul(&w.t()?)?;
    y.inplace_op2(&contig(bias)?, &AddBiasRows)?;
    let mut out_dims = dims.to_vec();
    *out_dims.last_mut().expect("rank >= 1") = w.dim(0)?;
    Ok(y.reshape(out_dims)?)
}

/// In place `y[r, :] += bias` (CUDA only; [`linear`] takes candle's path elsewhere).
struct AddBiasRows;

impl candle_core::InplaceOp2 for AddBiasRows {
    fn name(&self) -> &'static str {
        "fleet-add-bias-rows"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("add_bias_rows runs on CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        cuda::add_bias_rows(s1, l1, s2, l2)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/linear.ptx"));
    const MODULE: &str = "fleet_linear";

    pub(super) fn add_bias_rows(
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        fn run<T: CudaDType + DeviceRepr>(
            s1: &mut CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> candle_core::Result<()> {
            let dev = s1.device().clone();
            let (rows, cols) = l1.shape().dims2()?;
            let (Some((a, b)), Some(_)) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
                candle_core::bail!("add_bias_rows: inputs must be contiguous")
            };
            if l2.shape().elem_count() != cols {
                candle_core::bail!(
                    "add_bias_rows: bias of {} for {cols} columns",
                    l2.shape().elem_count()
                );
            }
            let bias = input::<T>(s2, l2)?;
            let func = dev.get_or_load_custom_func(
                &format!("add_bias_rows_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            let mut y = s1.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
            let n = rows * cols;
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(256).min(65535 * 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut builder = func.builder();
            builder.arg(&mut y);
            builder.arg(&bias);
            let (rows, cols) = (rows as i64, cols as i32);
            builder.arg(&rows);
            builder.arg(&cols);
            // SAFETY: the kernel reads the bias and updates the rows x cols outputs in place.
            unsafe { builder.launch(cfg) }.w()?;
            Ok(())
        }
        match s1.dtype() {
            candle_core::DType::F32 => run::<f32>(s1, l1, s2, l2),
            candle_core::DType::F16 => run::<f16>(s1, l1, s2, l2),
            candle_core::DType::BF16 => run::<bf16>(s1, l1, s2, l2),
            other => candle_core::bail!("add_bias_rows: unsupported dtype {other:?}"),
        }
    }
}

#[cfg(all(test, feature = "cuda"))]
mod kernel_tests {
    use super::*;

    /// [`linear`]'s in-place bias add gives candle's `Linear` result, in every float dtype,
    /// for 2-D and 3-D inputs.
    #[test]
    fn linear_bias_in_place_matches_candle() {
        use candle_core::Module;
        let dev = candle_core::Device::new_cuda(0).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for shape in [vec![37, 72], vec![3, 41, 72]] {
                let r = |s: &[usize]| {
                    Tensor::randn(0f32, 1.0, s, &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                let layer = candle_nn::Linear::new(r(&[136, 72]), Some(r(&[136])));
                let x = r(&shape);
                let want = layer.forward(&x).unwrap();
                let got = linear(&layer, &x).unwrap();
                assert_eq!(want.dims(), got.dims());
                let diff: f32 = (want.to_dtype(DType::F32).unwrap()
                    - got.to_dtype(DType::F32).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar()
                .unwrap();
                println!("linear {dtype:?} {shape:?}: max |candle - in place| = {diff}");
                assert_eq!(diff, 0.0, "the bias add rounds differently");
            }
        }
    }
}
