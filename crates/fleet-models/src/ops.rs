//! Fused operations of the decoder: one kernel where candle would launch several.
//!
//! - [`masked_softmax`]: causal + left-padding mask and softmax over attention scores, with
//!   f32 statistics, reading and writing the model dtype (replaces cast, mask add, softmax,
//!   cast, and the mask tensor itself).
//! - [`swiglu`]: `silu(gate) * up` on the fused gate/up projection (replaces two strided
//!   element-wise kernels).
//! - [`rms_norm`]: RMSNorm with transformers' roundings.
//! - [`add_rms_norm`]: a residual add and the RMSNorm after it in one pass.
//! - [`qkv_rope`]: the fused q/k/v projection split into head-major q, k, v with RoPE applied
//!   to q and k (replaces a transpose copy, per-part copies and the RoPE kernels).
//! - [`qk_norm_rope`]: the same for Qwen3, with the per-head RMSNorm of q and k before RoPE.
//! - [`sample_gumbel`]: one sampled token per row of logits, on the device (the Gumbel-max
//!   trick with a counter-based hash: seeded per row, no random state, one id back per row).
//!
//! The CUDA kernels are in `kernels/ops.cu`; the CPU versions here compute the same thing in the
//! same order, so the CPU parity tests check the logic the GPU runs.
//!
//! Every op has a backward (candle's `bwd`), so the decoder that serves inference is also the
//! one that trains. A result is tracked only when an input is (a `Var` or computed from one):
//! at inference nothing is recorded and nothing is kept. The backward is computed in f32 with
//! candle tensor ops and cast to the input's dtype; it differentiates the exact math (the
//! forward's intermediate roundings to the model dtype are not differentiated, as in torch's
//! autograd of transformers, except where a rounded value is itself a factor of the gradient:
//! the normalised value in the weight gradient of an RMSNorm). tests/ops_grad.rs checks each
//! backward against finite differences and against candle's autograd of the composed math.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, WithDType, D};
use half::{bf16, f16};

use crate::error::Result;

/// `t` itself when contiguous, else a contiguous copy (the kernels read rows in place).
fn contig(t: &Tensor) -> candle_core::Result<Tensor> {
    if t.is_contiguous() {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// Softmax of `scores` (`[..., kv_len]`, contiguous) over keys a query may see. Row `r` of the
/// flattened scores is query `offset + r % q_len` of batch row `r / rows_per_batch`; `pad`
/// (u32, one entry per batch row, on the scores' device) counts the row's left-padding keys.
/// Masked keys get probability 0 (and gradient 0).
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

/// Runs a custom op's backward; when profiling, adds its synchronized time to `stage`.
fn bwd_timed<T>(
    dev: &candle_core::Device,
    stage: &'static str,
    f: impl FnOnce() -> candle_core::Result<T>,
) -> candle_core::Result<T> {
    if !crate::profile::enabled() {
        return f();
    }
    dev.synchronize()?;
    let t = std::time::Instant::now();
    let out = f()?;
    dev.synchronize()?;
    crate::profile::record(stage, t.elapsed().as_secs_f64());
    Ok(out)
}

/// `t[r0..r0 + n] = f(t[r0..r0 + n], r0, n)` in place for slices of about `slice_elements`
/// elements along the first dimension (a scalar as `[1]`), so that an elementwise update of a
/// large tensor needs no second tensor of its size. `t` must be contiguous and own its storage
/// alone for the caller (gradient sums, optimizer state).
pub fn update_rows_in_place(
    t: &Tensor,
    slice_elements: usize,
    f: impl Fn(&Tensor, usize, usize) -> candle_core::Result<Tensor>,
) -> candle_core::Result<()> {
    let t = if t.rank() == 0 {
        t.reshape(1)?
    } else {
        t.clone()
    };
    let rows = t.dim(0)?;
    let per_row = (t.elem_count() / rows.max(1)).max(1);
    let step = (slice_elements / per_row).max(1);
    for start in (0..rows).step_by(step) {
        let n = step.min(rows - start);
        let out = f(&t.narrow(0, start, n)?, start, n)?.contiguous()?;
        t.slice_set(&out, 0, start)?;
    }
    Ok(())
}

/// Keeps `dev`'s stream busy for about `ns` nanoseconds (a one-thread kernel spinning on the
/// GPU's global timer; `kernels/ops.cu`'s `spin_ns`), without blocking the host. Tests use it to
/// make one device's work late, so that a race between devices is deterministic. Nothing on the
/// CPU.
pub fn gpu_delay(dev: &candle_core::Device, ns: u64) -> candle_core::Result<()> {
    match dev {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(cuda) => cuda::spin_ns(cuda, ns),
        _ => {
            let _ = ns;
            Ok(())
        }
    }
}

/// `sum(x * x)` as a 0-d f32 tensor, summed over the last dimension first: candle reduces a
/// whole tensor in one thread block, which is slow for large ones, while a reduction over the
/// last dimension runs one block per row. A large `x` is squared in slices of its first
/// dimension (16M elements each), so the squares never need a second tensor of its size (the
/// gradient norm of a 0.5-1 GB embedding gradient).
pub fn sum_squares(x: &Tensor) -> candle_core::Result<Tensor> {
    const SLICE_ELEMENTS: usize = 16 << 20;
    let n = x.elem_count();
    if x.rank() < 2 || n <= SLICE_ELEMENTS {
        return row_sums_first(&x.to_dtype(DType::F32)?.sqr()?);
    }
    let rows = x.dim(0)?;
    let step = (SLICE_ELEMENTS / (n / rows).max(1)).max(1);
    let mut total: Option<Tensor> = None;
    for start in (0..rows).step_by(step) {
        let len = step.min(rows - start);
        let part = row_sums_first(&x.narrow(0, start, len)?.to_dtype(DType::F32)?.sqr()?)?;
        total = Some(match total {
            Some(t) => (t + part)?,
            None => part,
        });
    }
    total.ok_or_else(|| candle_core::Error::Msg("sum_squares of an empty tensor".into()))
}

/// `x.sum_all()` computed over the last dimension first (see [`sum_squares`]); keeps the graph.
pub fn sum_all_fast(x: &Tensor) -> candle_core::Result<Tensor> {
    row_sums_first(x)
}

fn row_sums_first(x: &Tensor) -> candle_core::Result<Tensor> {
    let n = x.elem_count();
    if x.rank() < 2 || n < (1 << 16) {
        return x.sum_all();
    }
    let last = x.dim(D::Minus1)?;
    // Rows of a useful width: the tensor's own last dimension when it is wide enough, else
    // the whole tensor cut into rows of 1024 when it divides.
    let rows = if last >= 256 {
        x.reshape(((), last))?
    } else if n.is_multiple_of(1024) {
        x.flatten_all()?.reshape(((), 1024))?
    } else {
        return x.sum_all();
    };
    rows.sum(1)?.sum_all()
}

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

/// `silu(x[.., :n]) * x[.., n:]` for `x` of last dimension `2n`.
pub fn swiglu(x: &Tensor) -> Result<Tensor> {
    let op: Arc<Box<dyn candle_core::CustomOp1 + Send + Sync>> = Arc::new(Box::new(SwiGlu));
    Ok(contig(x)?.apply_op1_arc(op)?)
}

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

/// Splits `qkv` (`[b, t, (h + 2 kvh) * d]`, the projection before its `bias`) into `q`
/// `[b, h, t, d]`, `k` and `v` `[b, kvh, t, d]`, all contiguous, adding the bias and applying
/// RoPE to q and k. `cs` holds cos then sin per position: `[t, d]`, or `[b, t, d]` per row.
/// Gradients flow to `qkv` and `bias`, not to the tables.
pub fn qkv_rope(
    qkv: &Tensor,
    bias: &Tensor,
    cs: &Tensor,
    heads: (usize, usize),
    head_dim: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, _) = qkv.dims3()?;
    let (h, kvh) = heads;
    let op: Arc<Box<dyn CustomOp3 + Send + Sync>> = Arc::new(Box::new(QkvRope {
        h,
        kvh,
        d: head_dim,
    }));
    let flat = contig(qkv)?.apply_op3_arc(&contig(bias)?, &contig(cs)?, op)?;
    split_heads(&flat, (b, t), heads, head_dim)
}

/// Qwen3's attention input: splits `qkv` (`[b, t, (h + 2 kvh) * d]`, before its `bias`) into
/// head-major `q` `[b, h, t, d]`, `k` and `v` `[b, kvh, t, d]`, normalising each q head with
/// `q_weight` and each k head with `k_weight` (RMSNorm over `d`, transformers' roundings), then
/// applying RoPE to q and k in the model dtype as transformers' `apply_rotary_pos_emb` does
/// (`q * cos + rotate_half(q) * sin`, each product and the sum rounded). `cos` and `sin` are
/// `[t, d / 2]`, or `[b, t, d / 2]` per row, in the model dtype.
///
/// Gradients flow to `qkv`, `bias`, `q_weight` and `k_weight`, not to the tables. (A tracked
/// bias is added before the kernel, with the same rounding; otherwise the kernel adds it.)
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    qkv: &Tensor,
    bias: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    q_weight: &Tensor,
    k_weight: &Tensor,
    eps: f32,
    heads: (usize, usize),
    head_dim: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, _) = qkv.dims3()?;
    let (h, kvh) = heads;
    // The custom op's three inputs are the differentiable ones; the tables (and an untracked
    // bias) ride in the op itself.
    let (qkv, bias) = if bias.track_op() {
        (contig(&qkv.broadcast_add(bias)?)?, None)
    } else {
        (contig(qkv)?, Some(contig(bias)?))
    };
    let op: Arc<Box<dyn CustomOp3 + Send + Sync>> = Arc::new(Box::new(QkNormRope {
        h,
        kvh,
        d: head_dim,
        eps,
        cos: contig(cos)?,
        sin: contig(sin)?,
        bias,
    }));
    let flat = qkv.apply_op3_arc(&contig(q_weight)?, &contig(k_weight)?, op)?;
    split_heads(&flat, (b, t), heads, head_dim)
}

/// The flat output of the q/k/v kernels as head-major `q`, `k`, `v` (views, no copies).
fn split_heads(
    flat: &Tensor,
    (b, t): (usize, usize),
    (h, kvh): (usize, usize),
    d: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (qn, kvn) = (b * h * t * d, b * kvh * t * d);
    Ok((
        flat.narrow(0, 0, qn)?.reshape((b, h, t, d))?,
        flat.narrow(0, qn, kvn)?.reshape((b, kvh, t, d))?,
        flat.narrow(0, qn + kvn, kvn)?.reshape((b, kvh, t, d))?,
    ))
}

/// Conversions between the model dtypes and f32, for the CPU kernels.
trait Float: Copy + Send + Sync + WithDType {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// `x` rounded to this type and back: the value the model dtype holds.
    fn round(x: f32) -> f32 {
        Self::from_f32(x).to_f32()
    }
}

impl Float for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Float for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Float for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

struct MaskedSoftmax {
    rows_per_batch: usize,
    q_len: usize,
    offset: usize,
}

impl MaskedSoftmax {
    fn cpu<T: Float>(&self, x: &[T], pad: &[u32], kv_len: usize) -> Vec<T> {
        let mut y = vec![T::from_f32(0.0); x.len()];
        for (r, (xr, yr)) in x.chunks(kv_len).zip(y.chunks_mut(kv_len)).enumerate() {
            let qi = self.offset + r % self.q_len;
            let p = pad[r / self.rows_per_batch] as usize;
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
        y
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

fn contiguous<'a, T>(data: &'a [T], layout: &Layout) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("fused op input must be contiguous"),
    }
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
        let out = float_cpu!("masked_softmax", (s1, l1) => x; self.cpu(x, pad, kv_len));
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
            if grad.device().is_cuda() {
                let (y, g) = (res.detach().contiguous()?, grad.detach().contiguous()?);
                let dx = y.apply_op2_no_bwd(&g, &MaskedSoftmaxBwd)?;
                return Ok((Some(dx.to_dtype(scores.dtype())?), None));
            }
            let y = res.to_dtype(DType::F32)?;
            let g = grad.to_dtype(DType::F32)?;
            let dot = (&g * &y)?.sum_keepdim(D::Minus1)?;
            let dx = (y * g.broadcast_sub(&dot)?)?;
            Ok((Some(dx.to_dtype(scores.dtype())?), None))
        })
    }
}

struct SwiGlu;

fn swiglu_cpu<T: Float>(x: &[T], n_cols: usize) -> Vec<T> {
    let mut y = Vec::with_capacity(x.len() / 2);
    for row in x.chunks(2 * n_cols) {
        let (gate, up) = row.split_at(n_cols);
        for (g, u) in gate.iter().zip(up) {
            let g = g.to_f32();
            // Rounded after the silu, as transformers computes act_fn(gate) * up.
            let act = T::from_f32(g / (1.0 + (-g).exp())).to_f32();
            y.push(T::from_f32(act * u.to_f32()));
        }
    }
    y
}

impl candle_core::CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "fleet-swiglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = l.dims();
        let n = dims[dims.len() - 1];
        if !n.is_multiple_of(2) {
            candle_core::bail!("swiglu: last dimension {n} is odd");
        }
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("non-empty") = n / 2;
        let out = float_cpu!("swiglu", (s, l) => x; swiglu_cpu(x, n / 2));
        Ok((out, Shape::from(out_dims)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::swiglu(s, l)
    }

    /// With `x = [gate | up]`: `d gate = g * up * silu'(gate)`, `d up = g * silu(gate)`, where
    /// `silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z)))`.
    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        bwd_timed(grad.device(), "bwd.swiglu", || {
            if x.device().is_cuda() {
                let g = grad.detach().to_dtype(x.dtype())?.contiguous()?;
                let dx = x.detach().contiguous()?.apply_op2_no_bwd(&g, &SwiGluBwd)?;
                return Ok(Some(dx));
            }
            let xf = x.to_dtype(DType::F32)?;
            let n = xf.dim(D::Minus1)? / 2;
            let gate = xf.narrow(D::Minus1, 0, n)?;
            let up = xf.narrow(D::Minus1, n, n)?;
            let g = grad.to_dtype(DType::F32)?;
            let sig = candle_nn::ops::sigmoid(&gate.contiguous()?)?;
            let silu = (&gate * &sig)?;
            // silu'(z) = sig + silu * (1 - sig)
            let dsilu = (&sig + (&silu * sig.affine(-1.0, 1.0)?)?)?;
            let d_gate = ((&g * up)? * dsilu)?;
            let d_up = (g * silu)?;
            Ok(Some(
                Tensor::cat(&[d_gate, d_up], D::Minus1)?.to_dtype(x.dtype())?,
            ))
        })
    }
}

/// The fused backward kernels, as forward-only ops on CUDA tensors (the CPU keeps the composed
/// backward, which the finite-difference tests check; `ops_grad` compares the two on a GPU).
struct SwiGluBwd;
struct MaskedSoftmaxBwd;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct RmsNormBwd {
    eps: f32,
}
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct AddRmsNormBwd {
    eps: f32,
}

/// A forward-only custom op that runs on CUDA alone: the CPU refuses it (the CPU keeps the
/// composed backward). `$op` names the op's `self` in the CUDA body.
macro_rules! cuda_only_op {
    (CustomOp2 for $ty:ty, $name:literal,
     |$op:ident, $s1:ident, $l1:ident, $s2:ident, $l2:ident| $body:expr) => {
        impl candle_core::CustomOp2 for $ty {
            fn name(&self) -> &'static str {
                $name
            }
            fn cpu_fwd(
                &self,
                _: &CpuStorage,
                _: &Layout,
                _: &CpuStorage,
                _: &Layout,
            ) -> candle_core::Result<(CpuStorage, Shape)> {
                candle_core::bail!(concat!($name, " runs on CUDA only"))
            }
            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                $s1: &candle_core::CudaStorage,
                $l1: &Layout,
                $s2: &candle_core::CudaStorage,
                $l2: &Layout,
            ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
                let $op = self;
                $body
            }
        }
    };
    (CustomOp3 for $ty:ty, $name:literal,
     |$op:ident, $s1:ident, $l1:ident, $s2:ident, $l2:ident, $s3:ident, $l3:ident| $body:expr) => {
        impl candle_core::CustomOp3 for $ty {
            fn name(&self) -> &'static str {
                $name
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
                candle_core::bail!(concat!($name, " runs on CUDA only"))
            }
            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                $s1: &candle_core::CudaStorage,
                $l1: &Layout,
                $s2: &candle_core::CudaStorage,
                $l2: &Layout,
                $s3: &candle_core::CudaStorage,
                $l3: &Layout,
            ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
                let $op = self;
                $body
            }
        }
    };
}

pub(crate) use cuda_only_op;

cuda_only_op!(CustomOp2 for SwiGluBwd, "fleet-swiglu-bwd", |_op, s1, l1, s2, l2| {
    cuda::swiglu_bwd(s1, l1, s2, l2)
});

cuda_only_op!(
    CustomOp2 for MaskedSoftmaxBwd,
    "fleet-masked-softmax-bwd",
    |_op, s1, l1, s2, l2| cuda::masked_softmax_bwd(s1, l1, s2, l2)
);

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

/// The gradient for `arg` when it is tracked (a `Var` or computed from one); none otherwise,
/// as a constant input (a zero bias, a frozen weight) needs none.
fn wanted(
    arg: &Tensor,
    grad: impl FnOnce() -> candle_core::Result<Tensor>,
) -> candle_core::Result<Option<Tensor>> {
    if arg.track_op() {
        grad().map(Some)
    } else {
        Ok(None)
    }
}

/// The gradient of `y = rms_norm(s) * w` (transformers' arithmetic) for rows over the last
/// dimension: `(ds, dw)` in f32, from `s` and the output gradient `g` in f32. With
/// `r = rsqrt(mean(s²) + eps)` and `n = s * r`: `dn = g * w`,
/// `ds = r * (dn - n * mean(dn * n))`, and `dw = sum over rows of g * n`, with `n` rounded to
/// `dtype` as the forward multiplies it.
fn rms_norm_bwd(
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

fn rms_norm_cpu<T: Float>(x: &[T], w: &[T], eps: f32) -> Vec<T> {
    let n = w.len();
    let mut out = vec![T::from_f32(0.0); x.len()];
    for (xr, yr) in x.chunks(n).zip(out.chunks_mut(n)) {
        let mut ss = 0f32;
        for v in xr {
            ss += v.to_f32() * v.to_f32();
        }
        let inv = 1.0 / (ss / n as f32 + eps).sqrt();
        for ((y, v), wc) in yr.iter_mut().zip(xr).zip(w) {
            let normed = T::round(v.to_f32() * inv);
            *y = T::from_f32(normed * wc.to_f32());
        }
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
    let rows = x.len() / n;
    let mut out = vec![T::from_f32(0.0); 2 * x.len()];
    let (sums, normed) = out.split_at_mut(x.len());
    for r in 0..rows {
        let span = r * n..(r + 1) * n;
        let mut ss = 0f32;
        for ((s, a), b) in sums[span.clone()]
            .iter_mut()
            .zip(&x[span.clone()])
            .zip(&h[span.clone()])
        {
            *s = T::from_f32(a.to_f32() + b.to_f32());
            ss += s.to_f32() * s.to_f32();
        }
        let inv = 1.0 / (ss / n as f32 + eps).sqrt();
        for ((y, s), wc) in normed[span.clone()].iter_mut().zip(&sums[span]).zip(w) {
            let v = T::from_f32(s.to_f32() * inv).to_f32();
            *y = T::from_f32(v * wc.to_f32());
        }
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

/// RoPE's inverse on head-major `g` (`[b, heads, t, d]`, f32): rotation by the negative angle,
/// which is the transpose of the rotation, so the gradient of RoPE'd values with respect to
/// the values before it. `cos` and `sin` are f32 `[t, d / 2]` or `[b, t, d / 2]`.
fn unrotate(g: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::rotary_emb::rope(
        &g.to_dtype(DType::F32)?.contiguous()?,
        &cos.to_dtype(DType::F32)?.contiguous()?,
        &sin.to_dtype(DType::F32)?.neg()?.contiguous()?,
    )
}

/// The flat gradient of a q/k/v kernel's output as head-major f32 `(gq, gk, gv)`.
fn split_grad(
    grad: &Tensor,
    (b, t): (usize, usize),
    (h, kvh): (usize, usize),
    d: usize,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let grad = grad.to_dtype(DType::F32)?;
    let (qn, kvn) = (b * h * t * d, b * kvh * t * d);
    Ok((
        grad.narrow(0, 0, qn)?.reshape((b, h, t, d))?,
        grad.narrow(0, qn, kvn)?.reshape((b, kvh, t, d))?,
        grad.narrow(0, qn + kvn, kvn)?.reshape((b, kvh, t, d))?,
    ))
}

struct QkvRope {
    h: usize,
    kvh: usize,
    d: usize,
}

impl QkvRope {
    /// `(b, t, per_row)` from the layouts of qkv, bias and cs, after checking them.
    fn dims(
        &self,
        l1: &Layout,
        l2: &Layout,
        l3: &Layout,
    ) -> candle_core::Result<(usize, usize, bool)> {
        let (b, t, w) = l1.shape().dims3()?;
        if w != (self.h + 2 * self.kvh) * self.d || l2.dims() != [w] {
            candle_core::bail!(
                "qkv_rope: qkv {:?} / bias {:?} do not match (h + 2 kvh) * d",
                l1.dims(),
                l2.dims()
            );
        }
        let per_row = l3.dims().len() == 3;
        let want: Vec<usize> = if per_row {
            vec![b, t, self.d]
        } else {
            vec![t, self.d]
        };
        if l3.dims() != want.as_slice() {
            candle_core::bail!("qkv_rope: cos|sin table {:?}, expected {want:?}", l3.dims());
        }
        Ok((b, t, per_row))
    }

    #[allow(clippy::too_many_arguments)]
    fn cpu<T: Float>(
        &self,
        x: &[T],
        bias: &[T],
        cs: &[T],
        b: usize,
        t: usize,
        per_row: bool,
    ) -> Vec<T> {
        let (h, kvh, d) = (self.h, self.kvh, self.d);
        let (heads, half) = (h + 2 * kvh, d / 2);
        let (q_size, kv_size) = (b * h * t * d, b * kvh * t * d);
        let mut out = vec![T::from_f32(0.0); q_size + 2 * kv_size];
        for bi in 0..b {
            for ti in 0..t {
                let tok = bi * t + ti;
                let row = &cs[(if per_row { tok } else { ti }) * d..][..d];
                for hh in 0..heads {
                    let src = &x[(tok * heads + hh) * d..(tok * heads + hh + 1) * d];
                    let at = |i: usize| src[i].to_f32() + bias[hh * d + i].to_f32();
                    let base = if hh < h {
                        ((bi * h + hh) * t + ti) * d
                    } else if hh < h + kvh {
                        q_size + ((bi * kvh + hh - h) * t + ti) * d
                    } else {
                        q_size + kv_size + ((bi * kvh + hh - h - kvh) * t + ti) * d
                    };
                    let dst = &mut out[base..base + d];
                    if hh >= h + kvh {
                        for (i, y) in dst.iter_mut().enumerate() {
                            *y = T::from_f32(at(i));
                        }
                        continue;
                    }
                    for i in 0..half {
                        let (c, s) = (row[i].to_f32(), row[half + i].to_f32());
                        let (x0, x1) = (at(i), at(i + half));
                        dst[i] = T::from_f32(x0 * c - x1 * s);
                        dst[i + half] = T::from_f32(x1 * c + x0 * s);
                    }
                }
            }
        }
        out
    }
}

impl CustomOp3 for QkvRope {
    fn name(&self) -> &'static str {
        "fleet-qkv-rope"
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
        let (b, t, per_row) = self.dims(l1, l2, l3)?;
        let out = float_cpu!("qkv_rope", (s1, l1) => x, (s2, l2) => w, (s3, l3) => c;
            self.cpu(x, w, c, b, t, per_row));
        let n = b * t * (self.h + 2 * self.kvh) * self.d;
        Ok((out, Shape::from(n)))
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
        let dims = self.dims(l1, l2, l3)?;
        cuda::qkv_rope(self, dims, s1, l1, s2, l2, s3, l3)
    }

    /// The output gradient split into q, k, v parts; q and k un-rotated (RoPE by the negative
    /// angle); the three put back token-major as `[b, t, (h + 2 kvh) d]`: the gradient of qkv.
    /// The bias gradient is its sum over `b` and `t`; the tables get none.
    fn bwd(
        &self,
        qkv: &Tensor,
        bias: &Tensor,
        cs: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        bwd_timed(grad.device(), "bwd.qkv_rope", || {
            let (b, t, w) = qkv.dims3()?;
            let half = self.d / 2;
            let (gq, gk, gv) = split_grad(grad, (b, t), (self.h, self.kvh), self.d)?;
            let cos = cs.narrow(D::Minus1, 0, half)?;
            let sin = cs.narrow(D::Minus1, half, half)?;
            let all = Tensor::cat(
                &[unrotate(&gq, &cos, &sin)?, unrotate(&gk, &cos, &sin)?, gv],
                1,
            )?
            .transpose(1, 2)?
            .reshape((b, t, w))?;
            Ok((
                wanted(qkv, || all.to_dtype(qkv.dtype()))?,
                wanted(bias, || all.sum((0, 1))?.to_dtype(bias.dtype()))?,
                None,
            ))
        })
    }
}

/// Qwen3's q/k/v split with per-head RMSNorm and RoPE; the op's inputs are qkv, the q_norm and
/// the k_norm weights. The RoPE tables and an untracked bias are held here.
struct QkNormRope {
    h: usize,
    kvh: usize,
    d: usize,
    eps: f32,
    cos: Tensor,
    sin: Tensor,
    bias: Option<Tensor>,
}

impl QkNormRope {
    /// `(b, t, per_row)` after checking the shapes of qkv, the weights, the tables and the bias.
    fn dims(
        &self,
        l1: &Layout,
        l2: &Layout,
        l3: &Layout,
    ) -> candle_core::Result<(usize, usize, bool)> {
        let (b, t, w) = l1.shape().dims3()?;
        let d = self.d;
        if d == 0 || !d.is_multiple_of(2) || w != (self.h + 2 * self.kvh) * d {
            candle_core::bail!(
                "qk_norm_rope: qkv {:?} does not match (h + 2 kvh) * d with h = {}, kvh = {}, \
                 even d = {d}",
                l1.dims(),
                self.h,
                self.kvh
            );
        }
        if l2.dims() != [d] || l3.dims() != [d] {
            candle_core::bail!(
                "qk_norm_rope: q_norm {:?} / k_norm {:?} weights must be [{d}]",
                l2.dims(),
                l3.dims()
            );
        }
        if let Some(bias) = &self.bias {
            if bias.dims() != [w] {
                candle_core::bail!("qk_norm_rope: bias {:?}, expected [{w}]", bias.dims());
            }
        }
        let per_row = self.cos.rank() == 3;
        let want: Vec<usize> = if per_row {
            vec![b, t, d / 2]
        } else {
            vec![t, d / 2]
        };
        if self.cos.dims() != want.as_slice() || self.sin.dims() != want.as_slice() {
            candle_core::bail!(
                "qk_norm_rope: cos {:?} / sin {:?}, expected {want:?}",
                self.cos.dims(),
                self.sin.dims()
            );
        }
        Ok((b, t, per_row))
    }

    /// The CPU twin of the kernel, per (token, head): `s = T(x + bias)`; v heads are `s`; q/k
    /// heads are `n = T(s * rsqrt(mean(s²) + eps))`, `y = T(n * w)`, then
    /// `T(T(y0 c) - T(y1 s))`, `T(T(y1 c) + T(y0 s))` on the two halves.
    #[allow(clippy::too_many_arguments)]
    fn cpu<T: Float>(
        &self,
        x: &[T],
        bias: Option<&[T]>,
        cos: &[T],
        sin: &[T],
        qw: &[T],
        kw: &[T],
        (b, t, per_row): (usize, usize, bool),
    ) -> Vec<T> {
        let (h, kvh, d) = (self.h, self.kvh, self.d);
        let (heads, half) = (h + 2 * kvh, d / 2);
        let (q_size, kv_size) = (b * h * t * d, b * kvh * t * d);
        let mut out = vec![T::from_f32(0.0); q_size + 2 * kv_size];
        let mut s = vec![0f32; d];
        for bi in 0..b {
            for ti in 0..t {
                let tok = bi * t + ti;
                let cs_row = (if per_row { tok } else { ti }) * half;
                let (cr, sr) = (&cos[cs_row..cs_row + half], &sin[cs_row..cs_row + half]);
                for hh in 0..heads {
                    let src = &x[(tok * heads + hh) * d..(tok * heads + hh + 1) * d];
                    for (i, si) in s.iter_mut().enumerate() {
                        *si = match bias {
                            Some(bias) => T::round(src[i].to_f32() + bias[hh * d + i].to_f32()),
                            None => src[i].to_f32(),
                        };
                    }
                    let base = if hh < h {
                        ((bi * h + hh) * t + ti) * d
                    } else if hh < h + kvh {
                        q_size + ((bi * kvh + hh - h) * t + ti) * d
                    } else {
                        q_size + kv_size + ((bi * kvh + hh - h - kvh) * t + ti) * d
                    };
                    let dst = &mut out[base..base + d];
                    if hh >= h + kvh {
                        for (y, si) in dst.iter_mut().zip(&s) {
                            *y = T::from_f32(*si);
                        }
                        continue;
                    }
                    let mut ss = 0f32;
                    for si in &s {
                        ss += si * si;
                    }
                    let inv = 1.0 / (ss / d as f32 + self.eps).sqrt();
                    let w = if hh < h { qw } else { kw };
                    let y = |i: usize| T::round(T::round(s[i] * inv) * w[i].to_f32());
                    for i in 0..half {
                        let (c, sn) = (cr[i].to_f32(), sr[i].to_f32());
                        let (y0, y1) = (y(i), y(i + half));
                        dst[i] = T::from_f32(T::round(y0 * c) - T::round(y1 * sn));
                        dst[i + half] = T::from_f32(T::round(y1 * c) + T::round(y0 * sn));
                    }
                }
            }
        }
        out
    }

    fn cpu_run<T: Float>(
        &self,
        (s1, l1): (&CpuStorage, &Layout),
        (s2, l2): (&CpuStorage, &Layout),
        (s3, l3): (&CpuStorage, &Layout),
        dims: (usize, usize, bool),
    ) -> candle_core::Result<CpuStorage> {
        let slice = |s: &CpuStorage, l: &Layout| -> candle_core::Result<Vec<T>> {
            Ok(contiguous(T::cpu_storage_as_slice(s)?, l)?.to_vec())
        };
        let table = |t: &Tensor| -> candle_core::Result<Vec<T>> {
            let (st, l) = t.storage_and_layout();
            match &*st {
                candle_core::Storage::Cpu(s) => slice(s, l),
                _ => candle_core::bail!("qk_norm_rope: the tables and bias must be on the CPU too"),
            }
        };
        let bias = self.bias.as_ref().map(table).transpose()?;
        let out = self.cpu(
            contiguous(T::cpu_storage_as_slice(s1)?, l1)?,
            bias.as_deref(),
            &table(&self.cos)?,
            &table(&self.sin)?,
            contiguous(T::cpu_storage_as_slice(s2)?, l2)?,
            contiguous(T::cpu_storage_as_slice(s3)?, l3)?,
            dims,
        );
        Ok(T::to_cpu_storage_owned(out))
    }
}

impl CustomOp3 for QkNormRope {
    fn name(&self) -> &'static str {
        "fleet-qk-norm-rope"
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
        let dims = self.dims(l1, l2, l3)?;
        let dtype = s1.dtype();
        let tables = [Some(&self.cos), Some(&self.sin), self.bias.as_ref()];
        if s2.dtype() != dtype
            || s3.dtype() != dtype
            || tables.iter().flatten().any(|t| t.dtype() != dtype)
        {
            candle_core::bail!("qk_norm_rope: inputs must share one of f32, f16, bf16");
        }
        let args = ((s1, l1), (s2, l2), (s3, l3));
        let out = match dtype {
            DType::F32 => self.cpu_run::<f32>(args.0, args.1, args.2, dims)?,
            DType::BF16 => self.cpu_run::<bf16>(args.0, args.1, args.2, dims)?,
            DType::F16 => self.cpu_run::<f16>(args.0, args.1, args.2, dims)?,
            other => candle_core::bail!("qk_norm_rope: unsupported dtype {other:?}"),
        };
        let n = dims.0 * dims.1 * (self.h + 2 * self.kvh) * self.d;
        Ok((out, Shape::from(n)))
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
        let dims = self.dims(l1, l2, l3)?;
        cuda::qk_norm_rope(self, dims, s1, l1, s2, l2, s3, l3)
    }

    /// Un-rotates the q and k gradients (RoPE by the negative angle), pushes them through the
    /// per-head RMSNorm ([`rms_norm_bwd`], recomputing `s = x + bias` with the forward's
    /// rounding), and puts q, k and v back token-major: the gradient of qkv; the weight
    /// gradients sum over every head of their kind.
    fn bwd(
        &self,
        qkv: &Tensor,
        q_weight: &Tensor,
        k_weight: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        bwd_timed(grad.device(), "bwd.qk_norm_rope", || {
            let (h, kvh, d) = (self.h, self.kvh, self.d);
            let (b, t, w) = qkv.dims3()?;
            let dtype = qkv.dtype();
            let s = match &self.bias {
                Some(bias) => qkv
                    .to_dtype(DType::F32)?
                    .broadcast_add(&bias.to_dtype(DType::F32)?)?
                    .to_dtype(dtype)?
                    .to_dtype(DType::F32)?,
                None => qkv.to_dtype(DType::F32)?,
            }
            .reshape((b, t, h + 2 * kvh, d))?;
            let (gq, gk, gv) = split_grad(grad, (b, t), (h, kvh), d)?;
            let norm_bwd = |g: &Tensor, start: usize, n: usize, weight: &Tensor| {
                let g = unrotate(g, &self.cos, &self.sin)?.transpose(1, 2)?;
                rms_norm_bwd(&s.narrow(2, start, n)?, weight, &g, self.eps, dtype)
            };
            let (dq, dqw) = norm_bwd(&gq, 0, h, q_weight)?;
            let (dk, dkw) = norm_bwd(&gk, h, kvh, k_weight)?;
            let dx = Tensor::cat(&[dq, dk, gv.transpose(1, 2)?], 2)?.reshape((b, t, w))?;
            Ok((
                wanted(qkv, || dx.to_dtype(dtype))?,
                wanted(q_weight, || dqw.to_dtype(q_weight.dtype()))?,
                wanted(k_weight, || dkw.to_dtype(k_weight.dtype()))?,
            ))
        })
    }
}

/// Samples one token per row of `logits` (`[rows, vocab]`, f32, contiguous) from
/// `softmax(logits * inv_temperature)` by the Gumbel-max trick: the argmax of
/// `logits * inv_temperature + g`, with `g = -ln(-ln(u))` and `u` a hash of (the row's seed,
/// its counter, the token) — so a row's draw depends on its seed and step only, not on the
/// batch, the device or any generator state. `params` is `[rows, 4]` u32 on the logits'
/// device: seed (low, high), counter, and `inv_temperature` as f32 bits. Returns `[rows]` u32.
///
/// Only the ids leave the device: sampling a batch costs what greedy decoding costs.
pub fn sample_gumbel(logits: &Tensor, params: &Tensor) -> Result<Tensor> {
    Ok(contig(logits)?.apply_op2_no_bwd(&contig(params)?, &SampleGumbel)?)
}

/// The `params` row of [`sample_gumbel`] for one request.
pub fn gumbel_params(seed: u64, counter: u32, temperature: f64) -> [u32; 4] {
    [
        seed as u32,
        (seed >> 32) as u32,
        counter,
        ((1.0 / temperature) as f32).to_bits(),
    ]
}

/// The uniform in (0, 1) of token `v` for a row with `seed` at step `counter` (SplitMix64's
/// finaliser over the three, 24 bits kept). The CUDA kernel computes the same.
fn gumbel_uniform(seed: u64, counter: u32, v: u32) -> f32 {
    let mut x = seed
        ^ (counter as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (v as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    ((x >> 40) as f32 + 0.5) * (1.0 / 16_777_216.0)
}

struct SampleGumbel;

impl CustomOp2 for SampleGumbel {
    fn name(&self) -> &'static str {
        "fleet-sample-gumbel"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, vocab) = l1.shape().dims2()?;
        let logits = match s1 {
            CpuStorage::F32(v) => contiguous(v, l1)?,
            _ => candle_core::bail!("sample_gumbel: logits must be f32"),
        };
        let params = match s2 {
            CpuStorage::U32(v) => contiguous(v, l2)?,
            _ => candle_core::bail!("sample_gumbel: params must be u32"),
        };
        if params.len() != rows * 4 {
            candle_core::bail!("sample_gumbel: params must be [rows, 4]");
        }
        let mut out = Vec::with_capacity(rows);
        for r in 0..rows {
            let p = &params[4 * r..4 * r + 4];
            let seed = p[0] as u64 | (p[1] as u64) << 32;
            let inv_t = f32::from_bits(p[3]);
            let row = &logits[r * vocab..(r + 1) * vocab];
            let mut best = (f32::NEG_INFINITY, 0u32);
            for (v, &l) in row.iter().enumerate() {
                let u = gumbel_uniform(seed, p[2], v as u32);
                let score = l * inv_t - (-u.ln()).ln();
                if score > best.0 {
                    best = (score, v as u32);
                }
            }
            out.push(best.1);
        }
        Ok((CpuStorage::U32(out), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::sample_gumbel(s1, l1, s2, l2)
    }
}

/// The element type's kernel-name suffix.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn suffix(dtype: DType) -> candle_core::Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        other => candle_core::bail!("fused ops run in f32, f16 or bf16, not {other:?}"),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Shape};
    use half::{bf16, f16};

    use super::{suffix, MaskedSoftmax, QkNormRope};

    pub(super) fn sample_gumbel(
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s1.device().clone();
        let (rows, vocab) = l1.shape().dims2()?;
        let logits = input::<f32>(s1, l1)?;
        let params = input::<u32>(s2, l2)?;
        let func = dev.get_or_load_custom_func("sample_gumbel", MODULE, PTX)?;
        // SAFETY: the kernel writes one id per row.
        let out: CudaSlice<u32> = unsafe { dev.alloc::<u32>(rows)? };
        let cfg = row_blocks(rows);
        let mut b = func.builder();
        b.arg(&logits);
        b.arg(&params);
        b.arg(&out);
        let vocab = vocab as i32;
        b.arg(&vocab);
        // SAFETY: one block per row reads its vocab logits and params, writes one id.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows)))
    }

    pub(super) fn spin_ns(dev: &candle_core::CudaDevice, ns: u64) -> candle_core::Result<()> {
        let func = dev.get_or_load_custom_func("spin_ns", MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&ns);
        // SAFETY: the kernel reads no memory; it only spins.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }

    /// One block of 1024 threads per row: the kernels that reduce over a row of logits.
    fn row_blocks(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/ops.ptx"));
    const MODULE: &str = "fleet_ops";

    fn input<'a, T: CudaDType + DeviceRepr>(
        s: &'a CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
        match l.contiguous_offsets() {
            Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
            None => candle_core::bail!("fused op input must be contiguous"),
        }
    }

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
            let args = [
                n_rows as i32,
                op.rows_per_batch as i32,
                op.q_len as i32,
                kv_len as i32,
                op.offset as i32,
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
            let func = dev.get_or_load_custom_func(
                &format!("add_rms_norm_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: the kernel writes both halves, 2 * el elements.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(2 * el)? };
            let cfg = LaunchConfig {
                grid_dim: (n_rows as u32, 1, 1),
                block_dim: (1024.min(n.next_multiple_of(32)) as u32, 1, 1),
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn qkv_rope(
        op: &super::QkvRope,
        dims: (usize, usize, bool),
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + DeviceRepr>(
            op: &super::QkvRope,
            (b, t, per_row): (usize, usize, bool),
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            let (x, bias, cs) = (
                input::<T>(s1, l1)?,
                input::<T>(s2, l2)?,
                input::<T>(s3, l3)?,
            );
            let heads = op.h + 2 * op.kvh;
            let n = b * t * heads * op.d;
            let func = dev.get_or_load_custom_func(
                &format!("qkv_rope_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: every (token, head) block writes its d outputs.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
            let cfg = LaunchConfig {
                grid_dim: ((b * t * heads) as u32, 1, 1),
                block_dim: ((op.d / 2) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut bld = func.builder();
            bld.arg(&x);
            bld.arg(&bias);
            bld.arg(&cs);
            bld.arg(&out);
            let args = [
                b as i32,
                t as i32,
                op.h as i32,
                op.kvh as i32,
                op.d as i32,
                i32::from(per_row),
            ];
            for a in &args {
                bld.arg(a);
            }
            // SAFETY: grid covers b * t * heads blocks of d/2 threads.
            unsafe { bld.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        let n = dims.0 * dims.1 * (op.h + 2 * op.kvh) * op.d;
        let out = match s1.dtype() {
            candle_core::DType::F32 => run::<f32>(op, dims, s1, l1, s2, l2, s3, l3)?,
            candle_core::DType::F16 => run::<f16>(op, dims, s1, l1, s2, l2, s3, l3)?,
            candle_core::DType::BF16 => run::<bf16>(op, dims, s1, l1, s2, l2, s3, l3)?,
            other => candle_core::bail!("qkv_rope: unsupported dtype {other:?}"),
        };
        Ok((out, Shape::from(n)))
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

    fn same_shapes(
        op: &str,
        a: &Layout,
        b: &Layout,
        da: candle_core::DType,
        db: candle_core::DType,
    ) -> candle_core::Result<()> {
        if a.dims() != b.dims() || da != db {
            candle_core::bail!(
                "{op}: {:?} {da:?} and {:?} {db:?} must have the same shape and dtype",
                a.dims(),
                b.dims()
            );
        }
        Ok(())
    }

    /// Backward of `swiglu` from its input `x` (`[.., 2n]`) and the output's gradient `g`
    /// (`[.., n]`): `dx`, shaped like `x`.
    pub(super) fn swiglu_bwd(
        xs: &CudaStorage,
        xl: &Layout,
        gs: &CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(
            xs: &CudaStorage,
            xl: &Layout,
            gs: &CudaStorage,
            gl: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = xs.device().clone();
            let x = input::<T>(xs, xl)?;
            let g = input::<T>(gs, gl)?;
            let n2 = xl.dims()[xl.dims().len() - 1];
            let n_rows = xl.shape().elem_count() / n2;
            let n_cols = n2 / 2;
            let el = n_rows * n_cols;
            let func = dev.get_or_load_custom_func(
                &format!("swiglu_bwd_{}", suffix(xs.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: the kernel writes both halves of every row.
            let dx: CudaSlice<T> = unsafe { dev.alloc::<T>(2 * el)? };
            let threads = 256u32;
            let blocks = (el as u32).div_ceil(threads).clamp(1, 65_535);
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&g);
            b.arg(&dx);
            let (rows, cols) = (n_rows as i32, n_cols as i32);
            b.arg(&rows);
            b.arg(&cols);
            // SAFETY: the grid-stride loop covers n_rows * n_cols (gate, up) pairs.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(dx, dev))
        }
        let (xd, gd) = (xl.dims(), gl.dims());
        let n2 = xd[xd.len() - 1];
        if xd.len() != gd.len()
            || xd[..xd.len() - 1] != gd[..gd.len() - 1]
            || 2 * gd[gd.len() - 1] != n2
            || xs.dtype() != gs.dtype()
        {
            candle_core::bail!("swiglu backward: x {xd:?} and grad {gd:?} do not match");
        }
        let out = match xs.dtype() {
            candle_core::DType::F32 => run::<f32>(xs, xl, gs, gl)?,
            candle_core::DType::F16 => run::<f16>(xs, xl, gs, gl)?,
            candle_core::DType::BF16 => run::<bf16>(xs, xl, gs, gl)?,
            other => candle_core::bail!("swiglu backward: unsupported dtype {other:?}"),
        };
        Ok((out, xl.shape().clone()))
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

            let func =
                dev.get_or_load_custom_func(&format!("rms_norm_bwd_rows_{sfx}"), MODULE, PTX)?;
            let g2_view = match g2 {
                Some((st, l)) => input::<T>(st, l)?,
                None => input::<T>(gys, gyl)?,
            };
            let threads = (n.div_ceil(32) * 32).clamp(32, 1024) as u32;
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

            let func = dev.get_or_load_custom_func("sum_partials", MODULE, PTX)?;
            let cfg = LaunchConfig {
                grid_dim: ((n as u32).div_ceil(256), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            {
                // Scoped: the view borrows `out` until the launch is queued.
                let mut dw = out.slice_mut(n_rows * n..(n_rows + 1) * n);
                let parts = PARTS as i32;
                let mut b = func.builder();
                b.arg(&partial);
                b.arg(&mut dw);
                b.arg(&parts);
                b.arg(&n_i);
                // SAFETY: one thread per column writes dw's n values.
                unsafe { b.launch(cfg) }.w()?;
            }
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
        let threads = 256u32;
        let blocks = (n as u64).div_ceil(threads as u64).clamp(1, 65_535) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
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

    pub(super) fn swiglu(s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(
            s: &CudaStorage,
            l: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s.device().clone();
            let x = input::<T>(s, l)?;
            let n2 = l.dims()[l.dims().len() - 1];
            let n_rows = l.shape().elem_count() / n2;
            let n_cols = n2 / 2;
            let el = n_rows * n_cols;
            let func = dev.get_or_load_custom_func(
                &format!("swiglu_{}", suffix(s.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: every element is written by the kernel.
            let y: CudaSlice<T> = unsafe { dev.alloc::<T>(el)? };
            let threads = 256u32;
            let blocks = (el as u32).div_ceil(threads).clamp(1, 65_535);
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&y);
            let (rows, cols) = (n_rows as i32, n_cols as i32);
            b.arg(&rows);
            b.arg(&cols);
            // SAFETY: the grid-stride loop covers n_rows * n_cols outputs.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev))
        }
        let dims = l.dims();
        let n = dims[dims.len() - 1];
        if !n.is_multiple_of(2) {
            candle_core::bail!("swiglu: last dimension {n} is odd");
        }
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("non-empty") = n / 2;
        let out = match s.dtype() {
            candle_core::DType::F32 => run::<f32>(s, l)?,
            candle_core::DType::F16 => run::<f16>(s, l)?,
            candle_core::DType::BF16 => run::<bf16>(s, l)?,
            other => candle_core::bail!("swiglu: unsupported dtype {other:?}"),
        };
        Ok((out, Shape::from(out_dims)))
    }

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
            let func = dev.get_or_load_custom_func(
                &format!("rms_norm_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: every row is written by its block.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(el)? };
            let cfg = LaunchConfig {
                grid_dim: (n_rows as u32, 1, 1),
                block_dim: (1024.min(n.next_multiple_of(32)) as u32, 1, 1),
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

    /// The CUDA storage and layout of a tensor the op holds (tables, bias), on `dev`.
    fn held<'a>(
        what: &str,
        guard: &'a candle_core::Storage,
        dev: &candle_core::CudaDevice,
    ) -> candle_core::Result<&'a CudaStorage> {
        use candle_core::backend::BackendDevice;
        match guard {
            candle_core::Storage::Cuda(s) if s.device().same_device(dev) => Ok(s),
            _ => candle_core::bail!("qk_norm_rope: {what} must be on the device of qkv"),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn qk_norm_rope(
        op: &QkNormRope,
        dims: (usize, usize, bool),
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + DeviceRepr>(
            op: &QkNormRope,
            (b, t, per_row): (usize, usize, bool),
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            let (x, qw, kw) = (
                input::<T>(s1, l1)?,
                input::<T>(s2, l2)?,
                input::<T>(s3, l3)?,
            );
            let (cos_g, cos_l) = op.cos.storage_and_layout();
            let (sin_g, sin_l) = op.sin.storage_and_layout();
            let cos = input::<T>(held("cos", &cos_g, &dev)?, cos_l)?;
            let sin = input::<T>(held("sin", &sin_g, &dev)?, sin_l)?;
            let bias_g = op.bias.as_ref().map(|b| b.storage_and_layout());
            let bias = match &bias_g {
                Some((g, l)) => Some(input::<T>(held("bias", g, &dev)?, l)?),
                None => None,
            };
            let heads = op.h + 2 * op.kvh;
            let n = b * t * heads * op.d;
            let func = dev.get_or_load_custom_func(
                &format!("qk_norm_rope_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: every (token, head) block writes its d outputs.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
            let cfg = LaunchConfig {
                grid_dim: ((b * t * heads) as u32, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut bld = func.builder();
            bld.arg(&x);
            // Without a bias the kernel reads none; any device pointer fills the slot.
            match &bias {
                Some(bias) => bld.arg(bias),
                None => bld.arg(&qw),
            };
            bld.arg(&cos);
            bld.arg(&sin);
            bld.arg(&qw);
            bld.arg(&kw);
            bld.arg(&out);
            let args = [
                b as i32,
                t as i32,
                op.h as i32,
                op.kvh as i32,
                op.d as i32,
                i32::from(per_row),
                i32::from(bias.is_some()),
            ];
            for a in &args {
                bld.arg(a);
            }
            bld.arg(&op.eps);
            // SAFETY: grid covers b * t * heads blocks of one warp each.
            unsafe { bld.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        let dtype = s1.dtype();
        let tables = [Some(&op.cos), Some(&op.sin), op.bias.as_ref()];
        if s2.dtype() != dtype
            || s3.dtype() != dtype
            || tables.iter().flatten().any(|t| t.dtype() != dtype)
        {
            candle_core::bail!("qk_norm_rope: inputs must share one of f32, f16, bf16");
        }
        let n = dims.0 * dims.1 * (op.h + 2 * op.kvh) * op.d;
        let out = match dtype {
            DType::F32 => run::<f32>(op, dims, s1, l1, s2, l2, s3, l3)?,
            DType::F16 => run::<f16>(op, dims, s1, l1, s2, l2, s3, l3)?,
            DType::BF16 => run::<bf16>(op, dims, s1, l1, s2, l2, s3, l3)?,
            other => candle_core::bail!("qk_norm_rope: unsupported dtype {other:?}"),
        };
        Ok((out, Shape::from(n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A tensor past the slice size is squared in slices: the sum matches f64 arithmetic, in
    /// f32 and bf16, and a small one takes the whole-tensor path to the same value.
    #[test]
    fn sum_squares_in_slices_matches_the_exact_sum() {
        let (rows, cols) = (4099usize, 4097usize); // 16.8M elements: two slices, one short
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| ((i.wrapping_mul(2654435761) % 2001) as f32 - 1000.0) / 1000.0)
            .collect();
        let x = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
        // Each case's sum of squares in f64 against sum_squares.
        let check = |t: &Tensor| {
            let values = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            let exact: f64 = values
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|&x| f64::from(x) * f64::from(x))
                .sum();
            let got = f64::from(sum_squares(t).unwrap().to_scalar::<f32>().unwrap());
            assert!((got - exact).abs() / exact < 1e-5, "{got} vs {exact}");
        };
        check(&x);
        check(&x.to_dtype(DType::BF16).unwrap());
        check(&x.narrow(0, 0, 3).unwrap());
    }

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

    #[test]
    fn qkv_rope_matches_bias_transpose_and_candle_rope() {
        let dev = Device::Cpu;
        let (b, t, h, kvh, d) = (2, 5, 4, 2, 8);
        let raw = Tensor::randn(0f32, 1.0, (b, t, (h + 2 * kvh) * d), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1.0, (h + 2 * kvh) * d, &dev).unwrap();
        let cos = Tensor::randn(0f32, 1.0, (b, t, d / 2), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (b, t, d / 2), &dev).unwrap();
        let cs = Tensor::cat(&[&cos, &sin], 2).unwrap();
        let qkv = raw.broadcast_add(&bias).unwrap();
        let heads = qkv
            .reshape((b, t, h + 2 * kvh, d))
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        let part = |s, n| heads.narrow(1, s, n).unwrap().contiguous().unwrap();
        let want_q = candle_nn::rotary_emb::rope(&part(0, h), &cos, &sin).unwrap();
        let want_k = candle_nn::rotary_emb::rope(&part(h, kvh), &cos, &sin).unwrap();
        let want_v = part(h + kvh, kvh);
        let diff = |a: &Tensor, b: &Tensor| {
            (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        let (q, k, v) = qkv_rope(&raw, &bias, &cs, (h, kvh), d).unwrap();
        assert!(diff(&q, &want_q) < 1e-5 && diff(&k, &want_k) < 1e-5 && diff(&v, &want_v) < 1e-6);
        // Shared positions ([t, d] table): row 0 of the batch uses the same tables.
        let (q, _, _) = qkv_rope(&raw, &bias, &cs.get(0).unwrap(), (h, kvh), d).unwrap();
        assert!(diff(&q.get(0).unwrap(), &want_q.get(0).unwrap()) < 1e-5);
    }

    #[test]
    fn swiglu_matches_reference() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (3, 2, 10), &dev).unwrap();
        let got = swiglu(&x).unwrap();
        assert_eq!(got.dims(), &[3, 2, 5]);
        let gate = x.narrow(2, 0, 5).unwrap();
        let up = x.narrow(2, 5, 5).unwrap();
        let want = (candle_nn::ops::silu(&gate).unwrap() * up).unwrap();
        let d = (got - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-6, "{d}");
    }
}

/// On a GPU (`cargo test --features cuda -p fleet-models kernel_tests`).
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
