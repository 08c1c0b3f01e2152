//! Dimensions 1 and 2 of a rank-4 tensor swapped into a contiguous copy, one vectorized kernel
//! on CUDA: the training attention's backward reads its token-major output gradient head-major.

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use super::{contig, EnvSwitch};
use crate::error::{ModelError, Result};

/// `x.transpose(1, 2)` made contiguous, for `x` of rank 4: on CUDA (f32, f16, bf16, rows of
/// whole 16-byte vectors) one kernel copies it unless `FLEET_TRANSPOSE_KERNEL=0` or
/// [`set_transpose12_kernel`] says otherwise; otherwise candle's transpose and
/// copy run (its reference: the same elements, moved). No gradient (the backward passes use
/// it on detached tensors).
pub fn transpose12(x: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    if dims.len() != 4 {
        return Err(ModelError::BadInput(format!(
            "transpose12: a tensor of rank 4, not {dims:?}"
        )));
    }
    let per_vec = 16 / x.dtype().size_in_bytes();
    let kernel = KERNEL.on()
        && x.device().is_cuda()
        && matches!(
            x.dtype(),
            candle_core::DType::F32 | candle_core::DType::F16 | candle_core::DType::BF16
        )
        && dims[3].is_multiple_of(per_vec);
    if !kernel {
        return Ok(x.transpose(1, 2)?.contiguous()?);
    }
    let x = contig(x)?;
    if !x.layout().start_offset().is_multiple_of(per_vec) {
        return Ok(x.transpose(1, 2)?.contiguous()?);
    }
    Ok(x.detach().apply_op1_no_bwd(&Transpose12)?)
}

static KERNEL: EnvSwitch = EnvSwitch::new("FLEET_TRANSPOSE_KERNEL", true);

/// Test switch for [`transpose12`]'s kernel: `Some(on)` forces it, `None` leaves it to
/// `FLEET_TRANSPOSE_KERNEL`.
pub fn set_transpose12_kernel(on: Option<bool>) {
    KERNEL.force(on);
}

struct Transpose12;

impl candle_core::CustomOp1 for Transpose12 {
    fn name(&self) -> &'static str {
        "fleet-transpose12"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("transpose12's kernel runs on CUDA only (the CPU takes candle's copy)")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let d = l.dims();
        let out = cuda::transpose12(s, l)?;
        Ok((out, Shape::from((d[0], d[2], d[1], d[3]))))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/transpose.ptx"));
    const MODULE: &str = "fleet_transpose";

    pub(super) fn transpose12(s: &CudaStorage, l: &Layout) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            s: &CudaStorage,
            l: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s.device().clone();
            let x = input::<T>(s, l)?;
            let d = l.dims();
            let n = l.shape().elem_count();
            let name = format!("transpose12_vec_{}", suffix(s.dtype())?);
            let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            // SAFETY: the kernel writes every element.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&out);
            let dims: [u64; 4] = [d[0] as u64, d[1] as u64, d[2] as u64, d[3] as u64];
            for v in &dims {
                b.arg(v);
            }
            // SAFETY: the grid-stride loop writes out[0..n] once, each vector read within x.
            unsafe { b.launch(grid_stride(n / vector_len::<T>())) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        match s.dtype() {
            DType::F32 => run::<f32>(s, l),
            DType::F16 => run::<f16>(s, l),
            DType::BF16 => run::<bf16>(s, l),
            other => candle_core::bail!("transpose12: unsupported dtype {other:?}"),
        }
    }
}
