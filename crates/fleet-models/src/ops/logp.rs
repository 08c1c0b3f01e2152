//! Per-token log-probabilities and entropies of the vocabulary projection (`logp_entropy`), and the gradient of the log-softmax written down directly (`logp_grad`): one kernel per row on CUDA, no `[rows, vocab]` f32 intermediates.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, WithDType, D};

use super::*;

/// The gradient of `sum_i g[i] * log_softmax(logits[i] / T)[targets[i]]` with respect to
/// `logits` (`[n, vocab]`, any float dtype; targets `[n]` u32, `g` `[n]` f32): `g[i] / T *
/// (onehot(targets[i]) - softmax(logits[i] / T))`, in the logits' dtype, with no graph. One
/// fused kernel on CUDA (the `[n, vocab]` intermediates of the autograd version are what made
/// the vocabulary projection's backward slow); composed ops on the CPU.
pub fn logp_grad(
    logits: &Tensor,
    targets: &Tensor,
    g: &Tensor,
    temperature: f64,
) -> candle_core::Result<Tensor> {
    let (logits, targets, g) = (
        logits.detach().contiguous()?,
        targets.contiguous()?,
        g.detach().to_dtype(DType::F32)?.contiguous()?,
    );
    if logits.device().is_cuda() {
        return logits.apply_op3_no_bwd(
            &targets,
            &g,
            &LogpGrad {
                inv_t: (1.0 / temperature) as f32,
            },
        );
    }
    let z = (logits.to_dtype(DType::F32)? / temperature)?;
    let m = z.max_keepdim(D::Minus1)?;
    let e = z.broadcast_sub(&m)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    let n = targets.dim(0)?;
    let ones = Tensor::ones((n, 1), DType::F32, logits.device())?;
    let onehot = p
        .zeros_like()?
        .scatter_add(&targets.unsqueeze(1)?, &ones, 1)?;
    let scale = (g.unsqueeze(1)? / temperature)?;
    (onehot - p)?
        .broadcast_mul(&scale)?
        .to_dtype(logits.dtype())
}

/// Per row of `logits` (`[n, vocab]`, any float dtype) and `targets` (`[n]` u32): the
/// log-probability of the target and the entropy of `softmax(logits / T)`, as two `[n]` f32
/// tensors, with no graph. One pass over each row for its maximum, one for `sum exp(z)` and
/// `sum exp(z) z` (`z = logits / T - max`): `logp = z[target] - log Z`, `H = log Z - sum p z`.
/// Nothing of the row's size is kept: the composed version held four f32 `[n, vocab]` tensors
/// (logits, shifted, exp and `exp * z`), a GiB per chunk of 441 rows of a 152k vocabulary.
/// One kernel per row on CUDA; on the CPU the same formula, row by row in f32.
pub fn logp_entropy(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let n = targets.dim(0)?;
    if n == 0 {
        let none = Tensor::zeros(0, DType::F32, logits.device())?;
        return Ok((none.clone(), none));
    }
    let out = contig(&logits.detach())?.apply_op2_no_bwd(
        &contig(targets)?,
        &LogpEntropy {
            inv_t: (1.0 / temperature) as f32,
        },
    )?;
    Ok((
        out.narrow(1, 0, 1)?.squeeze(1)?,
        out.narrow(1, 1, 1)?.squeeze(1)?,
    ))
}

struct LogpEntropy {
    inv_t: f32,
}

impl LogpEntropy {
    /// The CPU twin: per row, the kernel's formula with f32 sums taken in index order.
    fn rows<T: WithDType>(&self, logits: &[T], targets: &[u32], vocab: usize) -> Vec<f32> {
        use rayon::prelude::*;
        let mut out = vec![0f32; targets.len() * 2];
        out.par_chunks_mut(2)
            .zip(logits.par_chunks(vocab))
            .zip(targets.par_iter())
            .for_each(|((o, row), &t)| {
                let z = |x: T| x.to_f64() as f32 * self.inv_t;
                let m = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(z(x)));
                let (mut s, mut sz) = (0f32, 0f32);
                for &x in row {
                    let zi = z(x) - m;
                    let e = zi.exp();
                    s += e;
                    sz += e * zi;
                }
                let lse = s.ln();
                o[0] = z(row[t as usize]) - m - lse;
                o[1] = lse - sz / s;
            });
        out
    }
}

impl CustomOp2 for LogpEntropy {
    fn name(&self) -> &'static str {
        "fleet-logp-entropy"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, vocab) = l1.shape().dims2()?;
        if vocab == 0 {
            candle_core::bail!("logp_entropy: logits {:?} have no vocabulary", l1.dims());
        }
        let (Some((a, b)), Some((ta, tb))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("logp_entropy: inputs must be contiguous")
        };
        let targets = match s2 {
            CpuStorage::U32(t) if l2.dims() == [n] => &t[ta..tb],
            _ => candle_core::bail!(
                "logp_entropy: targets must be [{n}] u32, got {:?} {:?}",
                l2.dims(),
                s2.dtype()
            ),
        };
        if let Some(&t) = targets.iter().find(|&&t| t as usize >= vocab) {
            candle_core::bail!("logp_entropy: target {t} is outside the vocabulary of {vocab}");
        }
        let out = match s1 {
            CpuStorage::F32(x) => self.rows(&x[a..b], targets, vocab),
            CpuStorage::BF16(x) => self.rows(&x[a..b], targets, vocab),
            CpuStorage::F16(x) => self.rows(&x[a..b], targets, vocab),
            other => candle_core::bail!("logp_entropy: unsupported dtype {:?}", other.dtype()),
        };
        Ok((CpuStorage::F32(out), Shape::from((n, 2))))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::logp_entropy(self.inv_t, s1, l1, s2, l2)
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct LogpGrad {
    inv_t: f32,
}

impl CustomOp3 for LogpGrad {
    fn name(&self) -> &'static str {
        "fleet-logp-grad"
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
        candle_core::bail!("fleet-logp-grad's kernel runs on CUDA (logp_grad composes on the CPU)")
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
        cuda::logp_grad(self.inv_t, s1, l1, s2, l2, s3, l3)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout, Shape};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/logp.ptx"));
    const MODULE: &str = "fleet_logp";

    /// `logp_grad` (see `ops::logp_grad`): logits `[n, vocab]`, targets `[n]` u32, g `[n]` f32.
    pub(super) fn logp_grad(
        inv_t: f32,
        ls: &CudaStorage,
        ll: &Layout,
        ts: &CudaStorage,
        tl: &Layout,
        gs: &CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(
            inv_t: f32,
            ls: &CudaStorage,
            ll: &Layout,
            ts: &CudaStorage,
            tl: &Layout,
            gs: &CudaStorage,
            gl: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = ls.device().clone();
            let logits = input::<T>(ls, ll)?;
            let targets = input::<u32>(ts, tl)?;
            let g = input::<f32>(gs, gl)?;
            let (n_rows, vocab) = ll.shape().dims2()?;
            let func = dev.get_or_load_custom_func(
                &format!("logp_grad_{}", suffix(ls.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: every element is written by the kernel.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n_rows * vocab)? };
            let cfg = row_blocks(n_rows);
            let mut b = func.builder();
            b.arg(&logits);
            b.arg(&targets);
            b.arg(&g);
            b.arg(&out);
            let (rows, v) = (n_rows as i32, vocab as i32);
            b.arg(&rows);
            b.arg(&v);
            b.arg(&inv_t);
            // SAFETY: one block per row of vocab values.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        let (n, _) = ll.shape().dims2()?;
        if tl.dims() != [n]
            || gl.dims() != [n]
            || ts.dtype() != candle_core::DType::U32
            || gs.dtype() != candle_core::DType::F32
        {
            candle_core::bail!(
                "logp_grad: logits {:?}, targets {:?} {:?} (u32), g {:?} {:?} (f32) do not match",
                ll.dims(),
                tl.dims(),
                ts.dtype(),
                gl.dims(),
                gs.dtype()
            );
        }
        let out = match ls.dtype() {
            candle_core::DType::F32 => run::<f32>(inv_t, ls, ll, ts, tl, gs, gl)?,
            candle_core::DType::F16 => run::<f16>(inv_t, ls, ll, ts, tl, gs, gl)?,
            candle_core::DType::BF16 => run::<bf16>(inv_t, ls, ll, ts, tl, gs, gl)?,
            other => candle_core::bail!("logp_grad: unsupported dtype {other:?}"),
        };
        Ok((out, ll.shape().clone()))
    }

    /// `logp_entropy` (see `ops::logp_entropy`): logits `[n, vocab]`, targets `[n]` u32; out
    /// `[n, 2]` f32.
    pub(super) fn logp_entropy(
        inv_t: f32,
        ls: &CudaStorage,
        ll: &Layout,
        ts: &CudaStorage,
        tl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let n_rows = ll.shape().dims2()?.0;
        if tl.dims() != [n_rows] || ts.dtype() != candle_core::DType::U32 {
            candle_core::bail!(
                "logp_entropy: logits {:?}, targets {:?} {:?} (u32 expected) do not match",
                ll.dims(),
                tl.dims(),
                ts.dtype()
            );
        }
        fn run<T: CudaDType + DeviceRepr>(
            inv_t: f32,
            ls: &CudaStorage,
            ll: &Layout,
            ts: &CudaStorage,
            tl: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = ls.device().clone();
            let logits = input::<T>(ls, ll)?;
            let targets = input::<u32>(ts, tl)?;
            let (n_rows, vocab) = ll.shape().dims2()?;
            let func = dev.get_or_load_custom_func(
                &format!("logp_entropy_{}", suffix(ls.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: the kernel writes both values of every row.
            let out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(n_rows * 2)? };
            let cfg = row_blocks(n_rows);
            let mut b = func.builder();
            b.arg(&logits);
            b.arg(&targets);
            b.arg(&out);
            let (rows, v) = (n_rows as i32, vocab as i32);
            b.arg(&rows);
            b.arg(&v);
            b.arg(&inv_t);
            // SAFETY: one block per row of vocab values; a target outside the vocabulary gives
            // NaN, not a read past the row.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        let out = match ls.dtype() {
            candle_core::DType::F32 => run::<f32>(inv_t, ls, ll, ts, tl)?,
            candle_core::DType::F16 => run::<f16>(inv_t, ls, ll, ts, tl)?,
            candle_core::DType::BF16 => run::<bf16>(inv_t, ls, ll, ts, tl)?,
            other => candle_core::bail!("logp_entropy: unsupported dtype {other:?}"),
        };
        Ok((out, Shape::from((n_rows, 2))))
    }
}
