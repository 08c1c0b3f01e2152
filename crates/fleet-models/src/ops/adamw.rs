//! The fused AdamW step, in place, as torch.optim.AdamW (foreach=False) computes it.

use candle_core::{CpuStorage, DType, Layout, Tensor};

/// AdamW's hyper-parameters for one step of one parameter (see [`adamw_step_`]).
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    /// `1 - lr * weight_decay` (1 without decay).
    pub decay: f32,
    /// `1 - beta1` (computed in f64, then rounded).
    pub one_minus_beta1: f32,
    /// beta2.
    pub beta2: f32,
    /// `1 - beta2` (computed in f64, then rounded).
    pub one_minus_beta2: f32,
    /// epsilon.
    pub eps: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
}

/// One AdamW step in place on a CUDA parameter `p` and its moments `m`, `v` (all f32, or all
/// bf16 as torch holds them for a bf16 parameter) from the gradient `g` (the parameter's
/// dtype), in one kernel computing in f32 (the composed version reads and writes each tensor
/// about a dozen times). Returns `Ok(false)`, touching nothing, when the tensors are not all
/// contiguous tensors of one of those dtypes on one CUDA device: the caller then computes the
/// step itself. `m` and `v` must not share their storage with any other tensor.
pub fn adamw_step_(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    step: AdamWStep,
) -> candle_core::Result<bool> {
    let ok = |t: &Tensor, dtype: DType| {
        t.device().is_cuda()
            && t.dtype() == dtype
            && t.is_contiguous()
            && t.dims() == p.dims()
            && t.device().same_device(p.device())
    };
    // FLEET_FUSED_ADAMW=0 keeps the composed step (to compare the two on a GPU).
    if std::env::var("FLEET_FUSED_ADAMW").is_ok_and(|v| v == "0") {
        return Ok(false);
    }
    let d = p.dtype();
    let kinds = matches!(d, DType::F32 | DType::BF16);
    if !(cfg!(feature = "cuda") && kinds && ok(p, d) && ok(g, d) && ok(m, d) && ok(v, d)) {
        return Ok(false);
    }
    p.inplace_op1(&AdamWOp {
        g: g.clone(),
        m: m.clone(),
        v: v.clone(),
        step,
    })?;
    Ok(true)
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct AdamWOp {
    g: Tensor,
    m: Tensor,
    v: Tensor,
    step: AdamWStep,
}

impl candle_core::InplaceOp1 for AdamWOp {
    fn name(&self) -> &'static str {
        "fleet-adamw"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("fleet-adamw runs on CUDA only")
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> candle_core::Result<()> {
        cuda::adamw(s, l, &self.g, &self.m, &self.v, self.step)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout};
    use half::bf16;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx"));
    const MODULE: &str = "fleet_adamw";

    /// The fused AdamW step (see `ops::adamw_step_`): `p` in place, `m` and `v` written through
    /// their device pointers (their storages are the optimizer's own).
    pub(super) fn adamw(
        ps: &mut CudaStorage,
        pl: &Layout,
        g: &candle_core::Tensor,
        m: &candle_core::Tensor,
        v: &candle_core::Tensor,
        h: super::AdamWStep,
    ) -> candle_core::Result<()> {
        use candle_core::cuda_backend::cudarc::driver::DevicePtr;
        let dev = ps.device().clone();
        let stream = dev.cuda_stream();
        let n = pl.shape().elem_count();
        let ptr = |t: &candle_core::Tensor| -> candle_core::Result<u64> {
            let (st, l) = t.storage_and_layout();
            let candle_core::Storage::Cuda(cs) = &*st else {
                candle_core::bail!("fleet-adamw: a tensor is not on the GPU")
            };
            let (base, width) = match t.dtype() {
                candle_core::DType::F32 => (cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0, 4),
                candle_core::DType::BF16 => (cs.as_cuda_slice::<bf16>()?.device_ptr(&stream).0, 2),
                other => candle_core::bail!("fleet-adamw: {other:?} tensors"),
            };
            Ok(base + width * l.start_offset() as u64)
        };
        let (gp, mp, vp) = (ptr(g)?, ptr(m)?, ptr(v)?);
        let p_off = pl.start_offset();
        let (pp, kernel) = match ps.dtype() {
            candle_core::DType::F32 => (
                ps.as_cuda_slice_mut::<f32>()?
                    .slice_mut(p_off..p_off + n)
                    .device_ptr(&stream)
                    .0,
                "adamw_f32",
            ),
            candle_core::DType::BF16 => (
                ps.as_cuda_slice_mut::<bf16>()?
                    .slice_mut(p_off..p_off + n)
                    .device_ptr(&stream)
                    .0,
                "adamw_bf16",
            ),
            other => candle_core::bail!("fleet-adamw: {other:?} parameters"),
        };
        let func = dev.get_or_load_custom_func(kernel, MODULE, PTX)?;
        let cfg = super::super::cuda_util::grid_stride(n);
        let mut b = func.builder();
        b.arg(&pp);
        b.arg(&gp);
        b.arg(&mp);
        b.arg(&vp);
        let n = n as i64;
        b.arg(&n);
        b.arg(&h.decay);
        b.arg(&h.one_minus_beta1);
        b.arg(&h.beta2);
        b.arg(&h.one_minus_beta2);
        b.arg(&h.eps);
        b.arg(&h.step_size);
        b.arg(&h.bc2_sqrt);
        // SAFETY: p, g, m, v each hold n contiguous values of the kernel's dtypes on this
        // device (checked by `adamw_step_` and the matches above); the grid-stride loop
        // touches each element once.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}
