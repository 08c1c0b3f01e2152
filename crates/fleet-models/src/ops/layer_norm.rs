//! LayerNorm with a bias as torch computes it for the model dtype, and the residual add fused
//! with the LayerNorm after it (the vision tower's blocks); inference only.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

use super::*;
use crate::error::{ModelError, Result};

/// A LayerNorm over the last dimension with weight and bias (`torch.nn.LayerNorm`): mean and
/// variance of each row in f32 (the variance about the mean), then
/// `(x - mean) * rsqrt(var + eps) * weight + bias` in f32, rounded once to the model dtype.
/// One kernel reads the row once (candle's reads it twice and subtracts `mean²` from `E[x²]`),
/// and [`LayerNorm::forward_add`] folds the residual add before it into the same pass.
/// No backward: the vision tower it serves is not trained.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    /// The weight then the bias, `[2, dim]`: the kernel's one parameter operand.
    weight_bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    /// From the `[dim]` weight and bias (same dtype and device as the inputs to come).
    pub fn new(weight: &Tensor, bias: &Tensor, eps: f32) -> Result<Self> {
        if weight.rank() != 1 || weight.dims() != bias.dims() {
            return Err(ModelError::BadInput(format!(
                "LayerNorm: weight {:?} and bias {:?} must be one [dim] vector each",
                weight.dims(),
                bias.dims()
            )));
        }
        Ok(Self {
            weight_bias: Tensor::stack(&[weight, bias], 0)?.contiguous()?,
            eps,
        })
    }

    /// The normalised rows of `x` (`[.., dim]`).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let op: Arc<Box<dyn CustomOp2 + Send + Sync>> =
            Arc::new(Box::new(LayerNormOp { eps: self.eps }));
        Ok(contig(x)?.apply_op2_arc(&self.weight_bias, op)?)
    }

    /// `(s, layer_norm(s))` with `s = x + h` rounded to the model dtype: the residual stream
    /// after an add and its normalised form, in one pass.
    pub fn forward_add(&self, x: &Tensor, h: &Tensor) -> Result<(Tensor, Tensor)> {
        let op: Arc<Box<dyn CustomOp3 + Send + Sync>> =
            Arc::new(Box::new(AddLayerNormOp { eps: self.eps }));
        let both = contig(x)?.apply_op3_arc(&contig(h)?, &self.weight_bias, op)?;
        Ok((both.get(0)?, both.get(1)?))
    }
}

struct LayerNormOp {
    eps: f32,
}

struct AddLayerNormOp {
    eps: f32,
}

/// One row as the kernels compute it (sums in order here, in a block reduction there).
fn layer_norm_row<T: Float>(s: &[T], wb: &[T], eps: f32, y: &mut [T]) {
    let n = s.len();
    let mean = s.iter().fold(0f32, |acc, v| acc + v.to_f32()) / n as f32;
    let var = s.iter().fold(0f32, |acc, v| {
        let d = v.to_f32() - mean;
        acc + d * d
    }) / n as f32;
    let rstd = 1.0 / (var + eps).sqrt();
    let (w, b) = wb.split_at(n);
    for (((y, v), wc), bc) in y.iter_mut().zip(s).zip(w).zip(b) {
        *y = T::from_f32((v.to_f32() - mean) * rstd * wc.to_f32() + bc.to_f32());
    }
}

fn layer_norm_cpu<T: Float>(x: &[T], wb: &[T], eps: f32) -> Vec<T> {
    let n = wb.len() / 2;
    let mut out = vec![T::from_f32(0.0); x.len()];
    for (xr, yr) in x.chunks(n).zip(out.chunks_mut(n)) {
        layer_norm_row(xr, wb, eps, yr);
    }
    out
}

fn add_layer_norm_cpu<T: Float>(x: &[T], h: &[T], wb: &[T], eps: f32) -> Vec<T> {
    let n = wb.len() / 2;
    let mut out = vec![T::from_f32(0.0); 2 * x.len()];
    let (sums, normed) = out.split_at_mut(x.len());
    for (s, (a, b)) in sums.iter_mut().zip(x.iter().zip(h)) {
        *s = T::from_f32(a.to_f32() + b.to_f32());
    }
    for (sr, yr) in sums.chunks(n).zip(normed.chunks_mut(n)) {
        layer_norm_row(sr, wb, eps, yr);
    }
    out
}

/// `x`'s last dimension is `dim` and `wb` is `[2, dim]`.
fn check_shapes(op: &str, x: &Layout, wb: &Layout) -> candle_core::Result<()> {
    let d = x.dims();
    if d.is_empty() || wb.dims() != [2, d[d.len() - 1]] {
        candle_core::bail!(
            "{op}: weight and bias {:?} must be [2, last dimension of {d:?}]",
            wb.dims()
        );
    }
    Ok(())
}

impl CustomOp2 for LayerNormOp {
    fn name(&self) -> &'static str {
        "fleet-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        check_shapes("layer_norm", l1, l2)?;
        let out = float_cpu!("layer_norm", (s1, l1) => x, (s2, l2) => wb;
            layer_norm_cpu(x, wb, self.eps));
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
        check_shapes("layer_norm", l1, l2)?;
        let out = cuda::launch(self.eps, s1, l1, None, s2, l2)?;
        Ok((out, l1.shape().clone()))
    }
}

impl CustomOp3 for AddLayerNormOp {
    fn name(&self) -> &'static str {
        "fleet-add-layer-norm"
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
        check_add_shapes(l1, l2, l3)?;
        let out = float_cpu!("add_layer_norm", (s1, l1) => x, (s2, l2) => h, (s3, l3) => wb;
            add_layer_norm_cpu(x, h, wb, self.eps));
        Ok((out, stacked(l1)))
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
        check_add_shapes(l1, l2, l3)?;
        let out = cuda::launch(self.eps, s1, l1, Some((s2, l2)), s3, l3)?;
        Ok((out, stacked(l1)))
    }
}

fn check_add_shapes(x: &Layout, h: &Layout, wb: &Layout) -> candle_core::Result<()> {
    if x.shape() != h.shape() {
        candle_core::bail!(
            "add_layer_norm: x {:?} and h {:?} differ",
            x.dims(),
            h.dims()
        );
    }
    check_shapes("add_layer_norm", x, wb)
}

/// `[2, ..x]`: the sums, then the normalised rows.
fn stacked(x: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(x.dims());
    Shape::from(dims)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/layer_norm.ptx"));
    const MODULE: &str = "fleet_layer_norm";

    /// `layer_norm` of `x` (`h` none) or `add_layer_norm` of `x + h`, `wb` the `[2, n]` weight
    /// and bias: `el` values, or `2 * el` (the sums, then the normalised rows).
    pub(super) fn launch(
        eps: f32,
        xs: &CudaStorage,
        xl: &Layout,
        h: Option<(&CudaStorage, &Layout)>,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            eps: f32,
            xs: &CudaStorage,
            xl: &Layout,
            h: Option<(&CudaStorage, &Layout)>,
            ws: &CudaStorage,
            wl: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = xs.device().clone();
            let n = wl.dims()[1];
            let el = xl.shape().elem_count();
            let n_rows = el / n;
            let (x, wb) = (input::<T>(xs, xl)?, input::<T>(ws, wl)?);
            let op = if h.is_some() {
                "add_layer_norm"
            } else {
                "layer_norm"
            };
            let mut layouts = vec![xl, wl];
            layouts.extend(h.map(|(_, l)| l));
            let (name, threads) = norm_launch_shape::<T>(op, n, &layouts, 4);
            let func = dev.get_or_load_custom_func(
                &format!("{name}_{}", suffix(xs.dtype())?),
                MODULE,
                PTX,
            )?;
            let total = if h.is_some() { 2 * el } else { el };
            // SAFETY: every row's block writes its values (and its sums with h).
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(total)? };
            let cfg = LaunchConfig {
                grid_dim: (n_rows as u32, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let hv = match h {
                Some((s, l)) => Some(input::<T>(s, l)?),
                None => None,
            };
            let mut b = func.builder();
            b.arg(&x);
            if let Some(hv) = &hv {
                b.arg(hv);
            }
            b.arg(&wb);
            b.arg(&out);
            let (rows, cols) = (n_rows as i32, n as i32);
            b.arg(&rows);
            b.arg(&cols);
            b.arg(&eps);
            // SAFETY: one block per row of n elements; wb holds 2n.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        if h.is_some_and(|(s, _)| s.dtype() != xs.dtype()) || ws.dtype() != xs.dtype() {
            candle_core::bail!("layer_norm: inputs must share one dtype");
        }
        match xs.dtype() {
            DType::F32 => run::<f32>(eps, xs, xl, h, ws, wl),
            DType::F16 => run::<f16>(eps, xs, xl, h, ws, wl),
            DType::BF16 => run::<bf16>(eps, xs, xl, h, ws, wl),
            other => candle_core::bail!("layer_norm: unsupported dtype {other:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    use super::super::max_abs_diff as max_diff;

    /// candle's LayerNorm (E[x²] - mean²) and the twin (variance about the mean) agree to f32
    /// rounding on rows whose mean is small against their spread.
    #[test]
    fn twin_matches_candle_layer_norm() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (3, 5, 24), &dev).unwrap();
        let w = Tensor::randn(1f32, 0.2, 24, &dev).unwrap();
        let b = Tensor::randn(0f32, 0.2, 24, &dev).unwrap();
        let ln = LayerNorm::new(&w, &b, 1e-6).unwrap();
        let want = candle_nn::ops::layer_norm(&x, &w, &b, 1e-6).unwrap();
        assert!(max_diff(&ln.forward(&x).unwrap(), &want) < 1e-5);
    }

    /// The fused add equals the add, rounded to the dtype, then the norm: bit for bit in bf16.
    #[test]
    fn add_then_norm_is_the_fused_add() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (4, 32), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let h = Tensor::randn(0f32, 1.0, (4, 32), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let w = Tensor::randn(1f32, 0.2, 32, &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let b = Tensor::randn(0f32, 0.2, 32, &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let ln = LayerNorm::new(&w, &b, 1e-6).unwrap();
        let (s, y) = ln.forward_add(&x, &h).unwrap();
        let want_s = (&x + &h).unwrap();
        assert_eq!(max_diff(&s, &want_s), 0.0);
        assert_eq!(max_diff(&y, &ln.forward(&want_s).unwrap()), 0.0);
    }

    /// A row with a large mean: the variance is taken about the mean, where E[x²] - mean²
    /// (candle's kernel) loses the spread of `1000 ± 1` to f32 cancellation.
    #[test]
    fn variance_is_taken_about_the_mean() {
        let dev = Device::Cpu;
        let row: Vec<f32> = (0..64)
            .map(|i| if i % 2 == 0 { 1001.0 } else { 999.0 })
            .collect();
        let x = Tensor::from_vec(row, (1, 64), &dev).unwrap();
        let w = Tensor::ones(64, DType::F32, &dev).unwrap();
        let b = Tensor::full(0.5f32, 64, &dev).unwrap();
        let y = LayerNorm::new(&w, &b, 1e-6).unwrap().forward(&x).unwrap();
        let unit = 1.0 / (1.0f32 + 1e-6).sqrt();
        let want: Vec<f32> = (0..64)
            .map(|i| if i % 2 == 0 { 0.5 + unit } else { 0.5 - unit })
            .collect();
        let want = Tensor::from_vec(want, (1, 64), &dev).unwrap();
        assert!(max_diff(&y, &want) < 1e-6, "{}", max_diff(&y, &want));
    }

    #[test]
    fn a_weight_that_is_not_the_last_dimension_is_refused() {
        let dev = Device::Cpu;
        let w = Tensor::ones(8, DType::F32, &dev).unwrap();
        let ln = LayerNorm::new(&w, &w, 1e-6).unwrap();
        let x = Tensor::ones((2, 6), DType::F32, &dev).unwrap();
        let err = ln.forward(&x).unwrap_err().to_string();
        assert!(err.contains("[2, last dimension"), "{err}");
    }
}
