//! Masked softmax over attention scores: the causal and left-padding mask applied on the fly, f32 statistics, one rounding to the model dtype; its backward as one kernel on CUDA.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor, D};

use super::*;
use crate::error::Result;

/// Softmax of `scores` (`[..., kv_len]`, contiguous) over keys a query may see. Row `r` of the
/// flattened scores is query `offset + r % q_len` of batch row `r / rows_per_batch`; `pad`
/// (u32, on the scores' device) counts the row's left-padding keys, one entry per batch row —
/// or one per query (`batch * q_len` entries, [`crate::attention::Mask::key_start`]'s packed
/// form), each query's first key. Masked keys get probability 0 (and gradient 0).
pub fn masked_softmax(
    scores: &Tensor,
    pad: &Tensor,
    rows_per_batch: usize,
    q_len: usize,
    offset: usize,
) -> Result<Tensor> {
    let op: Arc<Box<dyn CustomOp2 + Send + Sync>> = Arc::new(Box::new(MaskedSoftmax {
        rows_per_batch,
        q_len,
        offset,
    }));
    Ok(contig(scores)?.apply_op2_arc(pad, op)?)
}

struct MaskedSoftmax {
    rows_per_batch: usize,
    q_len: usize,
    offset: usize,
}

impl MaskedSoftmax {
    /// Whether `pad` has one entry per query (else one per batch row) for `n_rows` rows of
    /// scores; an error names the lengths when it has neither.
    fn per_query(&self, n_rows: usize, pad_len: usize) -> candle_core::Result<bool> {
        let batches = n_rows / self.rows_per_batch.max(1);
        if pad_len == batches {
            Ok(false)
        } else if pad_len == batches * self.q_len {
            Ok(true)
        } else {
            candle_core::bail!(
                "masked_softmax: {pad_len} padding counts for {batches} batch rows of {} \
                 queries (one per row or one per query)",
                self.q_len
            )
        }
    }

    fn cpu<T: Float>(&self, x: &[T], pad: &[u32], kv_len: usize) -> candle_core::Result<Vec<T>> {
        let per_query = self.per_query(x.len() / kv_len, pad.len())?;
        let mut y = vec![T::from_f32(0.0); x.len()];
        for (r, (xr, yr)) in x.chunks(kv_len).zip(y.chunks_mut(kv_len)).enumerate() {
            let qi = self.offset + r % self.q_len;
            let p = if per_query {
                pad[r / self.rows_per_batch * self.q_len + r % self.q_len]
            } else {
                pad[r / self.rows_per_batch]
            } as usize;
            let end = kv_len.min(qi + 1);
            let visible = |j: usize| j >= p || j == qi;
            let m = (0..end)
                .filter(|&j| visible(j))
                .map(|j| xr[j].to_f32())
                .fold(f32::NEG_INFINITY, f32::max);
            let s: f32 = (0..end)
                .filter(|&j| visible(j))
                .map(|j| (xr[j].to_f32() - m).exp())
                .sum();
            for j in (0..end).filter(|&j| visible(j)) {
                yr[j] = T::from_f32((xr[j].to_f32() - m).exp() / s);
            }
        }
        Ok(y)
    }
}

/// Applies `$body` to the contiguous slices of CPU storages that share a float dtype (f32, bf16
/// or f16), wrapping the result in a storage of that dtype.
macro_rules! float_cpu {
    ($op:literal, $( ($s:expr, $l:expr) => $x:ident ),+ ; $body:expr) => {
        match ($($s,)+) {
            float_cpu!(@pat F32; $($x),+) => {
                $( let $x = contiguous($x, $l)?; )+
                CpuStorage::F32($body)
            }
            float_cpu!(@pat BF16; $($x),+) => {
                $( let $x = contiguous($x, $l)?; )+
                CpuStorage::BF16($body)
            }
            float_cpu!(@pat F16; $($x),+) => {
                $( let $x = contiguous($x, $l)?; )+
                CpuStorage::F16($body)
            }
            _ => candle_core::bail!(concat!($op, ": inputs must share one of f32, f16, bf16")),
        }
    };
    (@pat $v:ident; $($x:ident),+) => { ($(CpuStorage::$v($x),)+) };
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "fleet-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let kv_len = l1.dims()[l1.dims().len() - 1];
        let pad = match s2 {
            CpuStorage::U32(p) => contiguous(p, l2)?,
            _ => candle_core::bail!("masked_softmax: pad must be u32"),
        };
        let out = float_cpu!("masked_softmax", (s1, l1) => x; self.cpu(x, pad, kv_len)?);
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::masked_softmax(self, s1, l1, s2, l2)
    }

    /// `dx = y * (g - sum(g * y))` per row; masked keys have `y = 0`, so `dx = 0` there.
    fn bwd(
        &self,
        scores: &Tensor,
        _pad: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        bwd_timed(grad.device(), "bwd.masked_softmax", || {
            Ok((
                Some(masked_softmax_backward(res, grad)?.to_dtype(scores.dtype())?),
                None,
            ))
        })
    }
}

/// The gradient of the scores of a [`masked_softmax`] from its output `y` and the output's
/// gradient `g`: `y * (g - sum(g * y))` over each row (masked keys have `y = 0`, so gradient 0).
/// One kernel on CUDA (in `y`'s dtype), the composed f32 math on the CPU (in f32).
pub(crate) fn masked_softmax_backward(y: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
    if g.device().is_cuda() {
        let (y, g) = (y.detach().contiguous()?, g.detach().contiguous()?);
        return y.apply_op2_no_bwd(&g, &MaskedSoftmaxBwd);
    }
    let y = y.to_dtype(DType::F32)?;
    let g = g.to_dtype(DType::F32)?;
    let dot = (&g * &y)?.sum_keepdim(D::Minus1)?;
    y * g.broadcast_sub(&dot)?
}

/// The fused backward as a forward-only op on CUDA tensors (the CPU keeps the composed backward).
struct MaskedSoftmaxBwd;

cuda_only_op!(
    CustomOp2 for MaskedSoftmaxBwd,
    "fleet-masked-softmax-bwd",
    |_op, s1, l1, s2, l2| cuda::masked_softmax_bwd(s1, l1, s2, l2)
);

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout, Shape};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;
    use super::MaskedSoftmax;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/masked_softmax.ptx"));
    const MODULE: &str = "fleet_masked_softmax";

    pub(super) fn masked_softmax(
        op: &MaskedSoftmax,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(
            op: &MaskedSoftmax,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            let x = input::<T>(s1, l1)?;
            let pad = input::<u32>(s2, l2)?;
            let el = l1.shape().elem_count();
            let kv_len = l1.dims()[l1.dims().len() - 1];
            let n_rows = el / kv_len;
            let func = dev.get_or_load_custom_func(
                &format!("masked_softmax_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: every element is written by the kernel.
            let y: CudaSlice<T> = unsafe { dev.alloc::<T>(el)? };
            const ROWS_PER_BLOCK: u32 = 4;
            let cfg = LaunchConfig {
                grid_dim: ((n_rows as u32).div_ceil(ROWS_PER_BLOCK), 1, 1),
                block_dim: (32, ROWS_PER_BLOCK, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&y);
            b.arg(&pad);
            let per_query = op.per_query(n_rows, l2.shape().elem_count())?;
            let args = [
                n_rows as i32,
                op.rows_per_batch as i32,
                op.q_len as i32,
                kv_len as i32,
                op.offset as i32,
                per_query as i32,
            ];
            for a in &args {
                b.arg(a);
            }
            // SAFETY: the kernel reads n_rows * kv_len inputs and writes as many outputs.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev))
        }
        let out = match s1.dtype() {
            candle_core::DType::F32 => run::<f32>(op, s1, l1, s2, l2)?,
            candle_core::DType::F16 => run::<f16>(op, s1, l1, s2, l2)?,
            candle_core::DType::BF16 => run::<bf16>(op, s1, l1, s2, l2)?,
            other => candle_core::bail!("masked_softmax: unsupported dtype {other:?}"),
        };
        Ok((out, l1.shape().clone()))
    }

    /// Backward of `masked_softmax` from its output `y` and the output's gradient `g` (same
    /// shape, same dtype): `dx`, same shape.
    pub(super) fn masked_softmax_bwd(
        ys: &CudaStorage,
        yl: &Layout,
        gs: &CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(
            ys: &CudaStorage,
            yl: &Layout,
            gs: &CudaStorage,
            gl: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = ys.device().clone();
            let y = input::<T>(ys, yl)?;
            let g = input::<T>(gs, gl)?;
            let el = yl.shape().elem_count();
            let kv_len = yl.dims()[yl.dims().len() - 1];
            let n_rows = el / kv_len;
            let func = dev.get_or_load_custom_func(
                &format!("masked_softmax_bwd_{}", suffix(ys.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: every element is written by the kernel.
            let dx: CudaSlice<T> = unsafe { dev.alloc::<T>(el)? };
            const ROWS_PER_BLOCK: u32 = 4;
            let cfg = LaunchConfig {
                grid_dim: ((n_rows as u32).div_ceil(ROWS_PER_BLOCK), 1, 1),
                block_dim: (32, ROWS_PER_BLOCK, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&y);
            b.arg(&g);
            b.arg(&dx);
            let (rows, kv) = (n_rows as i32, kv_len as i32);
            b.arg(&rows);
            b.arg(&kv);
            // SAFETY: one warp per row of kv_len values.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(dx, dev))
        }
        same_shapes("masked_softmax backward", yl, gl, ys.dtype(), gs.dtype())?;
        let out = match ys.dtype() {
            candle_core::DType::F32 => run::<f32>(ys, yl, gs, gl)?,
            candle_core::DType::F16 => run::<f16>(ys, yl, gs, gl)?,
            candle_core::DType::BF16 => run::<bf16>(ys, yl, gs, gl)?,
            other => candle_core::bail!("masked_softmax backward: unsupported dtype {other:?}"),
        };
        Ok((out, yl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The fused softmax equals mask-add + softmax done the plain way.
    #[test]
    fn masked_softmax_matches_reference() {
        let dev = Device::Cpu;
        let (b, rows, q_len, offset) = (2usize, 3usize, 4usize, 2usize);
        let kv_len = offset + q_len;
        let scores = Tensor::randn(0f32, 2.0, (b, rows, q_len, kv_len), &dev).unwrap();
        let pads = [0u32, 3];
        let pad = Tensor::new(&pads, &dev).unwrap();
        let got: Vec<f32> = masked_softmax(&scores, &pad, rows * q_len, q_len, offset)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let s: Vec<f32> = scores.flatten_all().unwrap().to_vec1().unwrap();
        for (r, row) in s.chunks(kv_len).enumerate() {
            let (batch, qi) = (r / (rows * q_len), offset + r % q_len);
            let vis: Vec<bool> = (0..kv_len)
                .map(|j| j <= qi && (j >= pads[batch] as usize || j == qi))
                .collect();
            let m = row
                .iter()
                .zip(&vis)
                .filter(|(_, v)| **v)
                .map(|(x, _)| *x)
                .fold(f32::MIN, f32::max);
            let z: f32 = row
                .iter()
                .zip(&vis)
                .filter(|(_, v)| **v)
                .map(|(x, _)| (x - m).exp())
                .sum();
            for j in 0..kv_len {
                let want = if vis[j] { (row[j] - m).exp() / z } else { 0.0 };
                assert!((got[r * kv_len + j] - want).abs() < 1e-6, "row {r} key {j}");
            }
        }
    }
}
