//! Dropout masks that can be drawn again: LoRA's dropout on the adapters' input must give the
//! backward's recompute of a block the mask its forward used, so a mask is a function of a key.

use candle_core::{DType, Device, Shape, Tensor};

use crate::error::Result;

/// A dropout mask of `shape` in `dtype`: each element `1 / (1 - p)` with probability `1 - p`,
/// else 0 (torch's `nn.Dropout` scaling), the same for the same `key` on every device: element
/// `i` keeps when the top 24 bits of SplitMix64 of `key` and `i`, over 2^24, are at least `p`.
/// On a GPU one kernel (`dropout.cu`) computes it, stateless (no generator to seed: reseeding
/// candle's curand generator made a new one for every mask, about 2 ms each, and LoRA's
/// update took three times full fine-tuning's); on the CPU its twin.
pub fn dropout_mask(
    shape: &Shape,
    p: f64,
    key: u64,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let mask = Tensor::zeros(shape, dtype, device)?;
    mask.inplace_op1(&DropoutMask {
        key,
        p: p as f32,
        keep: (1.0 / (1.0 - p)) as f32,
    })?;
    Ok(mask)
}

/// Fills a contiguous tensor (from offset 0) with [`dropout_mask`]'s values.
struct DropoutMask {
    key: u64,
    p: f32,
    keep: f32,
}

impl DropoutMask {
    /// Element `i`'s value, as f32 (the kernel's arithmetic).
    fn value(&self, i: u64) -> f32 {
        let u = (splitmix(self.key ^ i.wrapping_mul(0xd1b5_4a32_d192_ed03)) >> 40) as f32
            / (1u64 << 24) as f32;
        if u >= self.p {
            self.keep
        } else {
            0.0
        }
    }
}

impl candle_core::InplaceOp1 for DropoutMask {
    fn name(&self) -> &'static str {
        "fleet-dropout-mask"
    }

    fn cpu_fwd(
        &self,
        s: &mut candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        use candle_core::backend::BackendStorage;
        use candle_core::CpuStorage as S;
        let n = l.shape().elem_count();
        let fill = |i: usize| self.value(i as u64);
        match s {
            S::F32(v) => v[..n]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = fill(i)),
            S::BF16(v) => v[..n]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = half::bf16::from_f32(fill(i))),
            S::F16(v) => v[..n]
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = half::f16::from_f32(fill(i))),
            other => candle_core::bail!(
                "dropout masks are f32, bf16 or f16, not {:?}",
                other.dtype()
            ),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &mut candle_core::CudaStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        cuda::fill(self, s, l)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, DType, Layout};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/dropout.ptx"));
    const MODULE: &str = "fleet_dropout";

    pub(super) fn fill(
        op: &super::DropoutMask,
        s: &mut CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<()> {
        let dev = s.device().clone();
        let stream = dev.cuda_stream();
        let n = l.shape().elem_count();
        // The mask is a fresh tensor of its own (`dropout_mask`): offset 0, contiguous.
        let (ptr, kernel) = match s.dtype() {
            DType::F32 => (
                s.as_cuda_slice_mut::<f32>()?
                    .slice_mut(0..n)
                    .device_ptr(&stream)
                    .0,
                "dropout_mask_f32",
            ),
            DType::BF16 => (
                s.as_cuda_slice_mut::<half::bf16>()?
                    .slice_mut(0..n)
                    .device_ptr(&stream)
                    .0,
                "dropout_mask_bf16",
            ),
            DType::F16 => (
                s.as_cuda_slice_mut::<half::f16>()?
                    .slice_mut(0..n)
                    .device_ptr(&stream)
                    .0,
                "dropout_mask_f16",
            ),
            other => candle_core::bail!("dropout masks are f32, bf16 or f16, not {other:?}"),
        };
        let func = dev.get_or_load_custom_func(kernel, MODULE, PTX)?;
        let cfg = super::super::cuda_util::grid_stride(n);
        let mut b = func.builder();
        b.arg(&ptr);
        let n = n as u64;
        b.arg(&n);
        b.arg(&op.key);
        b.arg(&op.p);
        b.arg(&op.keep);
        // SAFETY: `ptr` holds n values of the kernel's dtype on this device; the grid-stride
        // loop writes each once.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

/// SplitMix64's output for state `z` (its finaliser of `z` plus the golden-ratio step): the
/// crate's one counter-based hash (dropout draws, LoRA's starting `A`, dropout keys).
pub(crate) fn splitmix(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_gives_one_mask_and_keeps_about_one_minus_p() {
        let shape = Shape::from((64, 512));
        let m = |key| dropout_mask(&shape, 0.25, key, DType::F32, &Device::Cpu).unwrap();
        let (a, b, c) = (m(7), m(7), m(8));
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(v(&a), v(&b));
        assert_ne!(v(&a), v(&c));
        let kept = v(&a).iter().filter(|&&x| x != 0.0).count() as f64 / (64.0 * 512.0);
        assert!((kept - 0.75).abs() < 0.01, "{kept}");
        assert!(v(&a)
            .iter()
            .all(|&x| x == 0.0 || (x - 1.0 / 0.75).abs() < 1e-6));
    }

    /// The kernel against its twin: a key gives the CPU's mask, element for element, in each
    /// dtype, also past one grid-stride round (65,535 blocks of 256).
    #[cfg(feature = "cuda")]
    #[test]
    fn the_kernel_draws_the_cpu_mask() {
        let Some(gpu) = crate::ops::test_gpu("the_kernel_draws_the_cpu_mask") else {
            return;
        };
        for (shape, dtype) in [
            (Shape::from((33, 517)), DType::F32),
            (Shape::from((7, 1000)), DType::BF16),
            (Shape::from((3, 1000)), DType::F16),
            (Shape::from(65_535 * 256 + 1000), DType::F32),
        ] {
            let m = |d: &Device| {
                dropout_mask(&shape, 0.1, 42, dtype, d)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_device(&Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            assert_eq!(m(&gpu), m(&Device::Cpu), "{shape:?} {dtype:?}");
        }
    }
}
