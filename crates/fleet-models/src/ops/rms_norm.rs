//! RMSNorm with transformers' roundings, and the residual add fused with the RMSNorm after it; the backward of both (one kernel for the rows, deterministic partial sums for the weight).

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, D};

use super::*;
use crate::error::Result;

/// `rms_norm(x) * weight` over the last dimension with transformers' roundings (`Qwen2RMSNorm`):
/// statistics in f32, the normalised value rounded to `x`'s dtype, then multiplied by `weight`
/// in that dtype.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    let op: Arc<Box<dyn CustomOp2 + Send + Sync>> = Arc::new(Box::new(RmsNorm { eps }));
    Ok(contig(x)?.apply_op2_arc(&contig(weight)?, op)?)
}

/// `(x + h, rms_norm(x + h) * weight)`: the residual stream after an add, and its normalised
/// form, with transformers' roundings. `x` and `h` have the same shape, `weight` is the last
/// dimension.
pub fn add_rms_norm(x: &Tensor, h: &Tensor, weight: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let op: Arc<Box<dyn CustomOp3 + Send + Sync>> = Arc::new(Box::new(AddRmsNorm { eps }));
    let both = contig(x)?.apply_op3_arc(&contig(h)?, &contig(weight)?, op)?;
    Ok((both.get(0)?, both.get(1)?))
}

/// `(s, rms_norm(s) * weight)` of the residual stream `s = x + pending`: [`add_rms_norm`], or
/// with nothing pending `s = x` and [`rms_norm`].
pub fn residual_rms_norm(
    x: &Tensor,
    pending: Option<&Tensor>,
    weight: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    match pending {
        Some(p) => add_rms_norm(x, p, weight, eps),
        None => Ok((x.clone(), rms_norm(x, weight, eps)?)),
    }
}

/// The gradient of `y = rms_norm(s) * w` (transformers' arithmetic) for rows over the last
/// dimension: `(ds, dw)` in f32, from `s` and the output gradient `g` in f32. With
/// `r = rsqrt(mean(s²) + eps)` and `n = s * r`: `dn = g * w`,
/// `ds = r * (dn - n * mean(dn * n))`, and `dw = sum over rows of g * n`, with `n` rounded to
/// `dtype` as the forward multiplies it.
pub(super) fn rms_norm_bwd(
    s: &Tensor,
    w: &Tensor,
    g: &Tensor,
    eps: f32,
    dtype: DType,
) -> candle_core::Result<(Tensor, Tensor)> {
    let n = s.dim(D::Minus1)?;
    let r = (s.sqr()?.mean_keepdim(D::Minus1)? + f64::from(eps))?
        .sqrt()?
        .recip()?;
    let normed = s.broadcast_mul(&r)?;
    let rounded = normed.to_dtype(dtype)?.to_dtype(DType::F32)?;
    let dw = (g * &rounded)?.reshape(((), n))?.sum(0)?;
    let dn = g.broadcast_mul(&w.to_dtype(DType::F32)?)?;
    let proj = (&dn * &normed)?.mean_keepdim(D::Minus1)?;
    let ds = (dn - normed.broadcast_mul(&proj)?)?.broadcast_mul(&r)?;
    Ok((ds, dw))
}

struct RmsNorm {
    eps: f32,
}

/// Whether the backward's rows kernel on CUDA takes its one-pass vector variant (each input read
/// once into registers, as the forward's `_vec` kernels) for rows of whole 16-byte vectors:
/// on by default (GPU-tested against the scalar kernel and measured on an H200, 2026-11-28:
/// −2% of a 1.5B update), `FLEET_NORM_BWD_VEC=0` for the scalar kernel, or as
/// [`set_norm_backward_vector_kernel`] sets it. Its sums run in another order than the scalar
/// kernel's, so the gradients may differ in the last bits.
static VEC_BWD: EnvSwitch = EnvSwitch::new("FLEET_NORM_BWD_VEC", true);

/// Test switch for the backward's vector rows kernel: `Some(on)` forces it, `None` leaves it
/// to `FLEET_NORM_BWD_VEC`.
pub fn set_norm_backward_vector_kernel(on: Option<bool>) {
    VEC_BWD.force(on);
}

/// `1 / sqrt(mean(x²) + eps)` of one row, summed in order in f32: the statistic of every
/// RMSNorm twin (plain, after the residual add, and Qwen3's per-head norm of q and k).
pub(super) fn inv_rms(row: impl ExactSizeIterator<Item = f32>, eps: f32) -> f32 {
    let n = row.len();
    let ss: f32 = row.fold(0f32, |acc, v| acc + v * v);
    1.0 / (ss / n as f32 + eps).sqrt()
}

/// One row of RMSNorm as transformers rounds it: `y = T(T(x * inv_rms) * w)`.
fn rms_norm_row<T: Float>(x: &[T], w: &[T], eps: f32, y: &mut [T]) {
    let inv = inv_rms(x.iter().map(|v| v.to_f32()), eps);
    for ((y, v), wc) in y.iter_mut().zip(x).zip(w) {
        let normed = T::round(v.to_f32() * inv);
        *y = T::from_f32(normed * wc.to_f32());
    }
}

fn rms_norm_cpu<T: Float>(x: &[T], w: &[T], eps: f32) -> Vec<T> {
    let n = w.len();
    let mut out = vec![T::from_f32(0.0); x.len()];
    for (xr, yr) in x.chunks(n).zip(out.chunks_mut(n)) {
        rms_norm_row(xr, w, eps, yr);
    }
    out
}

fn check_norm_shapes(op: &str, x: &Layout, w: &Layout) -> candle_core::Result<()> {
    if x.dims().is_empty() || w.dims() != [x.dims()[x.dims().len() - 1]] {
        candle_core::bail!(
            "{op}: weight {:?} must be the last dimension of {:?}",
            w.dims(),
            x.dims()
        );
    }
    Ok(())
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fleet-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        check_norm_shapes("rms_norm", l1, l2)?;
        let out = float_cpu!("rms_norm", (s1, l1) => x, (s2, l2) => w;
            rms_norm_cpu(x, w, self.eps));
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
        check_norm_shapes("rms_norm", l1, l2)?;
        cuda::rms_norm(self.eps, s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        bwd_timed(grad.device(), "bwd.rms_norm", || {
            if x.device().is_cuda() {
                let xs = x.detach().contiguous()?;
                let g = grad.detach().to_dtype(x.dtype())?.contiguous()?;
                let w_ = w.detach().to_dtype(x.dtype())?.contiguous()?;
                let out = xs.apply_op3_no_bwd(&w_, &g, &RmsNormBwd { eps: self.eps })?;
                let (dx, dw) = split_norm_bwd(&out, x)?;
                return Ok((
                    wanted(x, || dx.to_dtype(x.dtype()))?,
                    wanted(w, || dw.to_dtype(w.dtype()))?,
                ));
            }
            let (dx, dw) = rms_norm_bwd(
                &x.to_dtype(DType::F32)?,
                w,
                &grad.to_dtype(DType::F32)?,
                self.eps,
                x.dtype(),
            )?;
            Ok((
                wanted(x, || dx.to_dtype(x.dtype()))?,
                wanted(w, || dw.to_dtype(w.dtype()))?,
            ))
        })
    }
}

struct AddRmsNorm {
    eps: f32,
}

fn add_rms_norm_cpu<T: Float>(x: &[T], h: &[T], w: &[T], eps: f32) -> Vec<T> {
    let n = w.len();
    let mut out = vec![T::from_f32(0.0); 2 * x.len()];
    let (sums, normed) = out.split_at_mut(x.len());
    for (s, (a, b)) in sums.iter_mut().zip(x.iter().zip(h)) {
        *s = T::from_f32(a.to_f32() + b.to_f32());
    }
    for (sr, yr) in sums.chunks(n).zip(normed.chunks_mut(n)) {
        rms_norm_row(sr, w, eps, yr);
    }
    out
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "fleet-add-rms-norm"
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
        if l1.shape() != l2.shape() || l3.dims() != [l1.dims()[l1.dims().len() - 1]] {
            candle_core::bail!(
                "add_rms_norm: shapes {:?} {:?} {:?}",
                l1.dims(),
                l2.dims(),
                l3.dims()
            );
        }
        let out = float_cpu!("add_rms_norm", (s1, l1) => x, (s2, l2) => h, (s3, l3) => w;
            add_rms_norm_cpu(x, h, w, self.eps));
        let mut dims = vec![2];
        dims.extend_from_slice(l1.dims());
        Ok((out, Shape::from(dims)))
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
        cuda::add_rms_norm(self.eps, s1, l1, s2, l2, s3, l3)
    }

    /// The output is `[2, ...]` = `(s = x + h, y = rms_norm(s) * w)`: `ds = g_s` plus the
    /// RMSNorm backward of `g_y`; `dx = dh = ds`; `dw` as in [`rms_norm_bwd`].
    fn bwd(
        &self,
        x: &Tensor,
        h: &Tensor,
        w: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        bwd_timed(grad.device(), "bwd.add_rms_norm", || {
            if x.device().is_cuda() {
                let s = res.detach().get(0)?.contiguous()?;
                let g = grad.detach().to_dtype(x.dtype())?.contiguous()?;
                let w_ = w.detach().to_dtype(x.dtype())?.contiguous()?;
                let out = s.apply_op3_no_bwd(&w_, &g, &AddRmsNormBwd { eps: self.eps })?;
                let (ds, dw) = split_norm_bwd(&out, &s)?;
                let ds = ds.to_dtype(x.dtype())?;
                return Ok((
                    wanted(x, || Ok(ds.clone()))?,
                    wanted(h, || Ok(ds.clone()))?,
                    wanted(w, || dw.to_dtype(w.dtype()))?,
                ));
            }
            let s = res.get(0)?.to_dtype(DType::F32)?;
            let grad = grad.to_dtype(DType::F32)?;
            let (g_s, g_y) = (grad.get(0)?, grad.get(1)?);
            let (ds, dw) = rms_norm_bwd(&s, w, &g_y, self.eps, x.dtype())?;
            let ds = (ds + g_s)?.to_dtype(x.dtype())?;
            Ok((
                wanted(x, || Ok(ds.clone()))?,
                wanted(h, || Ok(ds.clone()))?,
                wanted(w, || dw.to_dtype(w.dtype()))?,
            ))
        })
    }
}

/// The fused backwards as forward-only ops on CUDA tensors (the CPU keeps the composed backward).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct RmsNormBwd {
    eps: f32,
}
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct AddRmsNormBwd {
    eps: f32,
}

cuda_only_op!(
    CustomOp3 for RmsNormBwd,
    "fleet-rms-norm-bwd",
    |op, s1, l1, s2, l2, s3, l3| cuda::rms_norm_bwd(op.eps, s1, l1, s2, l2, s3, l3, None)
);

// Inputs: `s`, `w`, and the stacked `[2, ..]` gradient (residual output, normed output).
cuda_only_op!(
    CustomOp3 for AddRmsNormBwd,
    "fleet-add-rms-norm-bwd",
    |op, s1, l1, s2, l2, s3, l3| {
        // The stacked gradient: [2, ...] -> its two halves as layouts over one storage.
        let half = l1.shape().elem_count();
        let (Some((start, _)), true) = (l3.contiguous_offsets(), l3.dims()[0] == 2) else {
            candle_core::bail!("add_rms_norm backward: the gradient must be a contiguous [2, ..]")
        };
        let gs = Layout::contiguous_with_offset(l1.shape().clone(), start);
        let gy = Layout::contiguous_with_offset(l1.shape().clone(), start + half);
        cuda::rms_norm_bwd(op.eps, s1, l1, s2, l2, s3, &gy, Some((s3, &gs)))
    }
);

/// `(ds, dw)` from the fused kernel's `[rows + 1, n]` f32 output.
fn split_norm_bwd(out: &Tensor, like: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let rows = out.dim(0)? - 1;
    Ok((
        out.narrow(0, 0, rows)?.reshape(like.shape())?,
        out.get(rows)?,
    ))
}

#[cfg(feature = "cuda")]
pub(super) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Shape};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/rms_norm.ptx"));
    const MODULE: &str = "fleet_rms_norm";

    pub(super) fn rms_norm(
        eps: f32,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(
            eps: f32,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            let (x, w) = (input::<T>(s1, l1)?, input::<T>(s2, l2)?);
            let n = l2.dims()[0];
            let el = l1.shape().elem_count();
            let n_rows = el / n;
            let (name, threads) = norm_launch_shape::<T>("rms_norm", n, &[l1, l2], 4);
            let func = dev.get_or_load_custom_func(
                &format!("{name}_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: every row is written by its block.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(el)? };
            let cfg = LaunchConfig {
                grid_dim: (n_rows as u32, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&w);
            b.arg(&out);
            let (rows, cols) = (n_rows as i32, n as i32);
            b.arg(&rows);
            b.arg(&cols);
            b.arg(&eps);
            // SAFETY: one block per row of n elements.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        let out = match (s1.dtype(), s2.dtype()) {
            (DType::F32, DType::F32) => run::<f32>(eps, s1, l1, s2, l2)?,
            (DType::F16, DType::F16) => run::<f16>(eps, s1, l1, s2, l2)?,
            (DType::BF16, DType::BF16) => run::<bf16>(eps, s1, l1, s2, l2)?,
            other => candle_core::bail!("rms_norm: unsupported dtypes {other:?}"),
        };
        Ok((out, l1.shape().clone()))
    }

    pub(super) fn add_rms_norm(
        eps: f32,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(
            eps: f32,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            let (x, h, w) = (
                input::<T>(s1, l1)?,
                input::<T>(s2, l2)?,
                input::<T>(s3, l3)?,
            );
            let n = l3.dims()[0];
            let el = l1.shape().elem_count();
            let n_rows = el / n;
            let (name, threads) = norm_launch_shape::<T>("add_rms_norm", n, &[l1, l2, l3], 4);
            let func = dev.get_or_load_custom_func(
                &format!("{name}_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: the kernel writes both halves, 2 * el elements.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(2 * el)? };
            let cfg = LaunchConfig {
                grid_dim: (n_rows as u32, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&h);
            b.arg(&w);
            b.arg(&out);
            let (rows, cols) = (n_rows as i32, n as i32);
            b.arg(&rows);
            b.arg(&cols);
            b.arg(&eps);
            // SAFETY: one block per row of n elements.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        if l1.shape() != l2.shape() || l3.dims() != [l1.dims()[l1.dims().len() - 1]] {
            candle_core::bail!(
                "add_rms_norm: shapes {:?} {:?} {:?}",
                l1.dims(),
                l2.dims(),
                l3.dims()
            );
        }
        let out = match s1.dtype() {
            candle_core::DType::F32 => run::<f32>(eps, s1, l1, s2, l2, s3, l3)?,
            candle_core::DType::F16 => run::<f16>(eps, s1, l1, s2, l2, s3, l3)?,
            candle_core::DType::BF16 => run::<bf16>(eps, s1, l1, s2, l2, s3, l3)?,
            other => candle_core::bail!("add_rms_norm: unsupported dtype {other:?}"),
        };
        let mut dims = vec![2];
        dims.extend_from_slice(l1.dims());
        Ok((out, Shape::from(dims)))
    }

    /// `out[at + c] = Σ_p partial[p * n + c]` over `parts` rows of partial sums, added in order
    /// (deterministic): the column sums of the norms' weight gradients and of qkv_rope's bias
    /// gradient.
    pub(in crate::ops) fn sum_partials(
        dev: &candle_core::CudaDevice,
        partial: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        at: usize,
        parts: usize,
        n: usize,
    ) -> candle_core::Result<()> {
        let func = dev.get_or_load_custom_func("sum_partials", MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut sums = out.slice_mut(at..at + n);
        let (parts, n) = (parts as i32, n as i32);
        let mut b = func.builder();
        b.arg(partial);
        b.arg(&mut sums);
        b.arg(&parts);
        b.arg(&n);
        // SAFETY: one thread per column reads `parts` partials and writes one of n sums.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// Backward of RMSNorm over the last dimension (see `rms_norm_bwd`) from the normalised
    /// input `s` (`[rows, n]`), the weight, the output's gradient `gy` and, for add_rms_norm,
    /// the residual output's gradient `gs` (`g2`, same shape as `s`; `None` for plain
    /// RMSNorm). Returns f32 `[rows + 1, n]`: `ds` in the first `rows`, `dw` in the last.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm_bwd(
        eps: f32,
        ss: &CudaStorage,
        sl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
        gys: &CudaStorage,
        gyl: &Layout,
        g2: Option<(&CudaStorage, &Layout)>,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + DeviceRepr>(
            eps: f32,
            ss: &CudaStorage,
            sl: &Layout,
            ws: &CudaStorage,
            wl: &Layout,
            gys: &CudaStorage,
            gyl: &Layout,
            g2: Option<(&CudaStorage, &Layout)>,
        ) -> candle_core::Result<CudaStorage> {
            let dev = ss.device().clone();
            let s = input::<T>(ss, sl)?;
            let w = input::<T>(ws, wl)?;
            let gy = input::<T>(gys, gyl)?;
            let n = wl.shape().elem_count();
            let n_rows = sl.shape().elem_count() / n;
            let sfx = suffix(ss.dtype())?;
            // SAFETY: rows kernel writes every ds value and every inv; the partials kernel
            // writes every partial; sum_partials writes every dw value.
            let mut out: CudaSlice<f32> = unsafe { dev.alloc::<f32>((n_rows + 1) * n)? };
            let inv: CudaSlice<f32> = unsafe { dev.alloc::<f32>(n_rows.max(1))? };
            const PARTS: u32 = 64;
            let partial: CudaSlice<f32> = unsafe { dev.alloc::<f32>(PARTS as usize * n)? };
            let (rows_i, n_i, has_gs) = (n_rows as i32, n as i32, g2.is_some() as i32);

            let g2_layout = g2.map_or(gyl, |(_, l)| l);
            let (name, threads) = if super::VEC_BWD.on() {
                norm_launch_shape::<T>("rms_norm_bwd_rows", n, &[sl, wl, gyl, g2_layout], 2)
            } else {
                let threads = (n.div_ceil(32) * 32).clamp(32, 1024) as u32;
                ("rms_norm_bwd_rows".to_string(), threads)
            };
            let func = dev.get_or_load_custom_func(&format!("{name}_{sfx}"), MODULE, PTX)?;
            let g2_view = match g2 {
                Some((st, l)) => input::<T>(st, l)?,
                None => input::<T>(gys, gyl)?,
            };
            let cfg = LaunchConfig {
                grid_dim: (n_rows as u32, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&s);
            b.arg(&w);
            b.arg(&g2_view);
            b.arg(&gy);
            b.arg(&out);
            b.arg(&inv);
            b.arg(&rows_i);
            b.arg(&n_i);
            b.arg(&eps);
            b.arg(&has_gs);
            // SAFETY: one block per row of n values; ds lands in out's first n_rows rows.
            unsafe { b.launch(cfg) }.w()?;

            let func =
                dev.get_or_load_custom_func(&format!("rms_norm_dw_partial_{sfx}"), MODULE, PTX)?;
            let cfg = LaunchConfig {
                grid_dim: ((n as u32).div_ceil(256), PARTS, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&s);
            b.arg(&gy);
            b.arg(&inv);
            b.arg(&partial);
            b.arg(&rows_i);
            b.arg(&n_i);
            // SAFETY: one thread per (column, part).
            unsafe { b.launch(cfg) }.w()?;

            sum_partials(&dev, &partial, &mut out, n_rows * n, PARTS as usize, n)?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        let n = wl.shape().elem_count();
        let sd = sl.dims();
        if sd.is_empty() || sd[sd.len() - 1] != n || gyl.dims() != sd {
            candle_core::bail!(
                "rms_norm backward: s {sd:?}, weight {:?}, grad {:?} do not match",
                wl.dims(),
                gyl.dims()
            );
        }
        if let Some((_, l)) = g2 {
            if l.dims() != sd {
                candle_core::bail!(
                    "rms_norm backward: residual grad {:?} is not {sd:?}",
                    l.dims()
                );
            }
        }
        let rows = sl.shape().elem_count() / n;
        let out = match ss.dtype() {
            candle_core::DType::F32 => run::<f32>(eps, ss, sl, ws, wl, gys, gyl, g2)?,
            candle_core::DType::F16 => run::<f16>(eps, ss, sl, ws, wl, gys, gyl, g2)?,
            candle_core::DType::BF16 => run::<bf16>(eps, ss, sl, ws, wl, gys, gyl, g2)?,
            other => candle_core::bail!("rms_norm backward: unsupported dtype {other:?}"),
        };
        Ok((out, Shape::from((rows + 1, n))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn add_rms_norm_matches_reference() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (2, 3, 8), &dev).unwrap();
        let h = Tensor::randn(0f32, 1.0, (2, 3, 8), &dev).unwrap();
        let w = Tensor::randn(1f32, 0.2, 8, &dev).unwrap();
        let (sum, normed) = add_rms_norm(&x, &h, &w, 1e-6).unwrap();
        let want_sum = (&x + &h).unwrap();
        let want = candle_nn::ops::rms_norm(&want_sum, &w, 1e-6).unwrap();
        let d1 = (sum - want_sum)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let d2 = (normed - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d1 < 1e-6 && d2 < 1e-5, "{d1} {d2}");
    }
}
