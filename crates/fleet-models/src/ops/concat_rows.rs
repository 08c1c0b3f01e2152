//! Projections that read the same input stacked into one weight (q/k/v; gate/up), so that one
//! GEMM does their work, with the attention scale folded into the first: one kernel on CUDA.
//! The training passes build every block from the master weights this way, twice a micro-step
//! (the forward and the recompute), so the stacking is on the update's path.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

use super::{contig, wanted, EnvSwitch};
use crate::error::{ModelError, Result};

/// `parts` (two or three tensors of one dtype whose dimensions after the first agree) stacked
/// along the first dimension, the first part multiplied by `first_scale` when given: the first
/// part cast to f32, multiplied there and rounded back, as [`concat_rows_reference`] computes
/// it with candle's cast, affine and cast, and the result the same bits, forward and backward.
/// On CUDA (f32, f16, bf16) one kernel writes the result; elsewhere, or with
/// `FLEET_CONCAT_KERNEL=0`, the reference runs.
pub fn concat_rows(parts: &[&Tensor], first_scale: Option<f64>) -> Result<Tensor> {
    check(parts)?;
    let first = parts[0];
    let on_kernel = KERNEL.on()
        && (2..=3).contains(&parts.len())
        && first.device().is_cuda()
        && matches!(first.dtype(), DType::F32 | DType::F16 | DType::BF16);
    if !on_kernel {
        return concat_rows_reference(parts, first_scale);
    }
    let parts: Vec<Tensor> = parts
        .iter()
        .map(|t| contig(t))
        .collect::<candle_core::Result<_>>()?;
    let op = ConcatRows {
        scale: first_scale.map(|s| s as f32),
    };
    Ok(match &parts[..] {
        [a, b] => {
            let op: Arc<Box<dyn CustomOp2 + Send + Sync>> = Arc::new(Box::new(op));
            a.apply_op2_arc(b, op)?
        }
        [a, b, c] => {
            let op: Arc<Box<dyn CustomOp3 + Send + Sync>> = Arc::new(Box::new(op));
            a.apply_op3_arc(b, c, op)?
        }
        _ => unreachable!("two or three parts"),
    })
}

/// [`concat_rows`] in candle's ops: `scaled(parts[0])` and the rest, concatenated. The CPU's
/// path and the kernel's reference.
pub fn concat_rows_reference(parts: &[&Tensor], first_scale: Option<f64>) -> Result<Tensor> {
    check(parts)?;
    let first = match first_scale {
        Some(s) => scaled(parts[0], s)?,
        None => parts[0].clone(),
    };
    let mut all: Vec<&Tensor> = vec![&first];
    all.extend(&parts[1..]);
    Ok(Tensor::cat(&all, 0)?)
}

/// `t` times `factor`, computed in f32 and rounded back to `t`'s dtype.
pub fn scaled(t: &Tensor, factor: f64) -> Result<Tensor> {
    Ok(scaled_in_f32(t, factor)?)
}

/// [`scaled`] for the backward, which works in candle's errors.
fn scaled_in_f32(t: &Tensor, factor: f64) -> candle_core::Result<Tensor> {
    (t.to_dtype(DType::F32)? * factor)?.to_dtype(t.dtype())
}

/// Whether [`concat_rows`] takes its kernel on CUDA: on by default, `FLEET_CONCAT_KERNEL=0`
/// turns it off (candle's cast, affine and cat instead), or as [`set_concat_rows_kernel`] sets
/// it.
static KERNEL: EnvSwitch = EnvSwitch::new("FLEET_CONCAT_KERNEL", true);

/// Test switch for [`concat_rows`]'s kernel: `Some(on)` forces it, `None` leaves it to
/// `FLEET_CONCAT_KERNEL`.
pub fn set_concat_rows_kernel(on: Option<bool>) {
    KERNEL.force(on);
}

fn check(parts: &[&Tensor]) -> Result<()> {
    let Some(first) = parts.first() else {
        return Err(ModelError::BadInput("concat_rows: no parts".into()));
    };
    let tail = |t: &Tensor| t.dims().get(1..).map(<[usize]>::to_vec);
    if first.rank() == 0
        || parts
            .iter()
            .any(|p| p.dtype() != first.dtype() || p.rank() == 0 || tail(p) != tail(first))
    {
        let shapes: Vec<_> = parts.iter().map(|p| (p.dims(), p.dtype())).collect();
        return Err(ModelError::BadInput(format!(
            "concat_rows: parts {shapes:?} must share a dtype and every dimension after the first"
        )));
    }
    Ok(())
}

struct ConcatRows {
    /// The first part's factor.
    scale: Option<f32>,
}

impl ConcatRows {
    /// The gradient of each tracked part: its rows of `grad`, the first scaled as the
    /// reference's backward scales it (cast to f32, affine, cast back).
    fn grads(&self, parts: &[&Tensor], grad: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let mut start = 0;
        parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let n = p.dim(0)?;
                let g = grad.narrow(0, start, n)?;
                start += n;
                wanted(p, || match self.scale {
                    Some(s) if i == 0 => scaled_in_f32(&g, f64::from(s)),
                    _ => Ok(g),
                })
            })
            .collect()
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn out_shape(layouts: &[&Layout]) -> Shape {
    let mut dims = layouts[0].dims().to_vec();
    dims[0] = layouts.iter().map(|l| l.dims()[0]).sum();
    Shape::from(dims)
}

impl CustomOp2 for ConcatRows {
    fn name(&self) -> &'static str {
        "fleet-concat-rows"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("concat_rows' kernel runs on CUDA only (the CPU takes the reference)")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = cuda::concat_rows(self, &[(s1, l1), (s2, l2)])?;
        Ok((out, out_shape(&[l1, l2])))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl CustomOp3 for ConcatRows {
    fn name(&self) -> &'static str {
        "fleet-concat-rows"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("concat_rows' kernel runs on CUDA only (the CPU takes the reference)")
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
        let out = cuda::concat_rows(self, &[(s1, l1), (s2, l2), (s3, l3)])?;
        Ok((out, out_shape(&[l1, l2, l3])))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b, c], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
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

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/concat_rows.ptx"));
    const MODULE: &str = "fleet_concat_rows";

    pub(super) fn concat_rows(
        op: &super::ConcatRows,
        parts: &[(&CudaStorage, &Layout)],
    ) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            op: &super::ConcatRows,
            parts: &[(&CudaStorage, &Layout)],
        ) -> candle_core::Result<CudaStorage> {
            let dtype = suffix(parts[0].0.dtype())?;
            let dev = parts[0].0.device().clone();
            let views = parts
                .iter()
                .map(|(s, l)| input::<T>(s, l))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let lens: Vec<usize> = parts.iter().map(|(_, l)| l.shape().elem_count()).collect();
            let total: usize = lens.iter().sum();
            // Whole 16-byte vectors: every part's length and first element.
            let vec = parts
                .iter()
                .zip(&lens)
                .all(|((_, l), &n)| whole_vectors::<T>(n, [l.start_offset()]));
            let name = format!("concat_rows_{}{dtype}", if vec { "vec_" } else { "" });
            let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            // SAFETY: the kernel writes every element.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(total)? };
            let cfg = grid_stride(if vec {
                total / vector_len::<T>()
            } else {
                total
            });
            let mut b = func.builder();
            b.arg(&out);
            // Two parts: the third is the second again, with no elements.
            let third = views.get(2).unwrap_or(&views[1]);
            b.arg(&views[0]);
            b.arg(&views[1]);
            b.arg(third);
            let ns: [u64; 3] = [
                lens[0] as u64,
                lens[1] as u64,
                lens.get(2).copied().unwrap_or(0) as u64,
            ];
            for n in &ns {
                b.arg(n);
            }
            let scale = op.scale.unwrap_or(1.0);
            let scaled = i32::from(op.scale.is_some());
            b.arg(&scale);
            b.arg(&scaled);
            // SAFETY: the grid-stride loop writes out[0..total] once, reading each part within
            // its length.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        match parts[0].0.dtype() {
            DType::F32 => run::<f32>(op, parts),
            DType::F16 => run::<f16>(op, parts),
            DType::BF16 => run::<bf16>(op, parts),
            other => candle_core::bail!("concat_rows: unsupported dtype {other:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The reference is the arithmetic the blocks were built with: q's rows times the scale in
    /// f32, rounded once to bf16, then k and v as they are.
    #[test]
    fn the_reference_scales_the_first_part_in_f32_and_stacks_the_rest() {
        let dev = Device::Cpu;
        let q = Tensor::new(&[[1.0f32, 3.0], [5.0, 7.0]], &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let k = Tensor::new(&[[2.0f32, 4.0]], &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let s = 1.0 / 3.0;
        let out = concat_rows(&[&q, &k], Some(s)).unwrap();
        assert_eq!(out.dims(), [3, 2]);
        let got: Vec<f32> = out
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap();
        let want: Vec<f32> = [1.0f32, 3.0, 5.0, 7.0]
            .iter()
            .map(|v| half::bf16::from_f32(v * s as f32).to_f32())
            .chain([2.0, 4.0])
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn parts_of_other_widths_or_dtypes_are_refused() {
        let dev = Device::Cpu;
        let a = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
        let b = Tensor::zeros((2, 4), DType::F32, &dev).unwrap();
        let c = Tensor::zeros((2, 3), DType::BF16, &dev).unwrap();
        assert!(concat_rows(&[&a, &b], None).is_err());
        assert!(concat_rows(&[&a, &c], None).is_err());
        assert!(concat_rows(&[], None).is_err());
    }
}
