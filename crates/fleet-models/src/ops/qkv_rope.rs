//! The attention input of the decoder: the fused q/k/v projection split into head-major q, k, v with the bias added and RoPE applied (Qwen2: `qkv_rope`), and with the per-head RMSNorm of q and k before RoPE (Qwen3: `qk_norm_rope`); the backward of both.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor, D};
use half::{bf16, f16};

use super::rms_norm::{inv_rms, rms_norm_bwd};
use super::*;
use crate::error::Result;

/// Splits `qkv` (`[b, t, (h + 2 kvh) * d]`, the projection before its `bias`) into `q`
/// `[b, h, t, d]`, `k` and `v` `[b, kvh, t, d]`, all contiguous, adding the bias and applying
/// RoPE to q and k. `cs` holds cos then sin per position: `[t, d]`, or `[b, t, d]` per row, in
/// qkv's dtype or in f32 (transformers' vision RoPE: f32 tables, the rotation in f32 rounded
/// once). Gradients flow to `qkv` and `bias`, not to the tables.
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
        cache: None,
    }));
    let flat = contig(qkv)?.apply_op3_arc(&contig(bias)?, &contig(cs)?, op)?;
    split_heads(&flat, (b, t), heads, head_dim)
}

/// Qwen3's attention input: splits `qkv` (`[b, t, (h + 2 kvh) * d]`, before its `bias`) into
/// head-major `q` `[b, h, t, d]`, `k` and `v` `[b, kvh, t, d]`, normalising each q head with
/// `q_weight` and each k head with `k_weight` (RMSNorm over `d`, transformers' roundings), then
/// applying RoPE to q and k in the model dtype as transformers' `apply_rotary_pos_emb` does
/// (`q * cos + rotate_half(q) * sin`, each product and the sum rounded). `cs` holds cos then
/// sin per position, as for [`qkv_rope`]: `[t, d]`, or `[b, t, d]` per row, in the model dtype.
///
/// Gradients flow to `qkv`, `bias`, `q_weight` and `k_weight`, not to the tables. (A tracked
/// bias is added before the kernel, with the same rounding; otherwise the kernel adds it.)
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    qkv: &Tensor,
    bias: &Tensor,
    cs: &Tensor,
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
        cs: contig(cs)?,
        bias,
        cache: None,
    }));
    let flat = qkv.apply_op3_arc(&contig(q_weight)?, &contig(k_weight)?, op)?;
    split_heads(&flat, (b, t), heads, head_dim)
}

/// The paged KV caches a call's keys and values go into ([`qkv_rope_paged`],
/// [`qk_norm_rope_paged`]): `k_cache` and `v_cache` `[num_blocks, kv_heads, block_size,
/// head_dim]`, contiguous, in the projection's dtype, and `slots` (u32 `[b * t]`) the slot of
/// each token `bi * t + ti`, as [`paged_kv_write`] takes them (`u32::MAX`: a padding token, not
/// written).
#[derive(Clone, Debug)]
pub struct PagedKvWrite {
    /// The keys' cache.
    pub k_cache: Tensor,
    /// The values' cache.
    pub v_cache: Tensor,
    /// One slot per token.
    pub slots: Tensor,
}

impl PagedKvWrite {
    /// Writes head-major `k`, `v` (`[b, kv_heads, t, d]`) at the slots: the two
    /// [`paged_kv_write`]s the fused kernels replace.
    fn write(&self, k: &Tensor, v: &Tensor) -> Result<()> {
        let tokens = |t: &Tensor| -> Result<Tensor> {
            let (b, kvh, n, d) = t.dims4()?;
            Ok(t.transpose(1, 2)?.contiguous()?.reshape((b * n, kvh, d))?)
        };
        paged_kv_write(&self.k_cache, &tokens(k)?, &self.slots)?;
        paged_kv_write(&self.v_cache, &tokens(v)?, &self.slots)
    }

    /// Whether one kernel may write the caches: on CUDA, nothing tracked (the fused op has no
    /// backward), the caches of the projection's dtype, and `FLEET_FUSED_KV_WRITE` not `0`
    /// (which keeps the three launches, for comparison).
    fn fused(&self, qkv: &Tensor, tracked: bool) -> bool {
        static ON: super::EnvSwitch = super::EnvSwitch::new("FLEET_FUSED_KV_WRITE", true);
        let on = ON.on();
        on && qkv.device().is_cuda()
            && !tracked
            && self.k_cache.dtype() == qkv.dtype()
            && self.v_cache.dtype() == qkv.dtype()
    }

    /// `(block_size, num_slots)` after checking the caches against `(b, t, kv_heads, d)`.
    #[cfg(feature = "cuda")]
    fn dims(
        &self,
        (b, t): (usize, usize),
        kvh: usize,
        d: usize,
    ) -> candle_core::Result<(usize, usize)> {
        let (kd, vd) = (self.k_cache.dims(), self.v_cache.dims());
        if kd.len() != 4 || kd != vd || kd[1] != kvh || kd[3] != d {
            candle_core::bail!(
                "paged q/k/v write: caches {kd:?} / {vd:?} must both be [num_blocks, {kvh}, \
                 block_size, {d}]"
            );
        }
        if self.slots.dims() != [b * t] || self.slots.dtype() != DType::U32 {
            candle_core::bail!(
                "paged q/k/v write: slots {:?} {:?}, expected u32 [{}]",
                self.slots.dims(),
                self.slots.dtype(),
                b * t
            );
        }
        Ok((kd[2], kd[0] * kd[2]))
    }
}

/// [`qkv_rope`] with this call's keys and values written into the paged caches at `kv.slots`
/// instead of returned: on CUDA (nothing tracked) one kernel instead of three launches (a decode
/// step's K/V writes were two launches a layer); elsewhere [`qkv_rope`] then [`paged_kv_write`]
/// twice, which the kernel equals bit for bit. Returns `q`, `[b, h, t, d]`.
pub fn qkv_rope_paged(
    qkv: &Tensor,
    bias: &Tensor,
    cs: &Tensor,
    heads: (usize, usize),
    head_dim: usize,
    kv: &PagedKvWrite,
) -> Result<Tensor> {
    let tracked = qkv.track_op() || bias.track_op();
    if !kv.fused(qkv, tracked) {
        let (q, k, v) = qkv_rope(qkv, bias, cs, heads, head_dim)?;
        kv.write(&k, &v)?;
        return Ok(q);
    }
    let (b, t, _) = qkv.dims3()?;
    let (h, kvh) = heads;
    let op = QkvRope {
        h,
        kvh,
        d: head_dim,
        cache: Some(kv.clone()),
    };
    let q = contig(qkv)?.apply_op3_no_bwd(&contig(bias)?, &contig(cs)?, &op)?;
    Ok(q.reshape((b, h, t, head_dim))?)
}

/// Switch of [`linear_qkv_rope_paged`]'s one kernel (`FLEET_QKV_GEMV_ROPE=0`: the GEMV, then
/// [`qkv_rope_paged`]'s kernel; the same bits either way).
static QKV_GEMV_ROPE: EnvSwitch = EnvSwitch::new("FLEET_QKV_GEMV_ROPE", true);

/// [`qkv_rope_paged`] of `linear(proj, h)`: `proj` the fused q/k/v projection without a bias
/// of its own (`bias` is the one [`qkv_rope`] adds), `h` `[b, t, k]` the normalised hidden
/// state. On a decode step whose product [`linear`] sends to the GEMV (up to
/// [`GEMV_MAX_ROWS`] rows on CUDA) and whose keys and values [`qkv_rope_paged`] writes in its
/// kernel, this is one kernel (`gemv_qkv_rope`): the warp of a rotated pair `(i, i + d/2)` of a
/// head sums both rows of `proj` as the GEMV sums each, rounds them as the GEMV's output is
/// rounded, then computes [`qkv_rope_paged`]'s epilogue (the bias, RoPE, the K/V write), so
/// `q` and the caches get the two kernels' bits (its GPU test) with one launch and one
/// `[b, (h + 2 kvh) d]` round trip fewer a layer. Otherwise, and with `FLEET_QKV_GEMV_ROPE=0`,
/// those two ops. Returns `q`, `[b, h, t, d]`.
#[allow(clippy::too_many_arguments)]
pub fn linear_qkv_rope_paged(
    h: &Tensor,
    proj: &candle_nn::Linear,
    bias: &Tensor,
    cs: &Tensor,
    heads: (usize, usize),
    head_dim: usize,
    kv: &PagedKvWrite,
) -> Result<Tensor> {
    let w = proj.weight();
    let (b, t, _) = h.dims3()?;
    let tracked = [h, w, bias].iter().any(|x| x.track_op());
    let takes = QKV_GEMV_ROPE.on()
        && t == 1
        && proj.bias().is_none()
        && super::linear::gemv_takes(h, w, b)
        && kv.fused(h, tracked)
        && bias.dtype() == h.dtype()
        && cs.dtype() == h.dtype();
    if !takes {
        return qkv_rope_paged(&linear(proj, h)?, bias, cs, heads, head_dim, kv);
    }
    let op = QkvRopeGemv {
        rope: QkvRope {
            h: heads.0,
            kvh: heads.1,
            d: head_dim,
            cache: Some(kv.clone()),
        },
        w: contig(w)?,
    };
    let q = contig(h)?.apply_op3_no_bwd(&contig(bias)?, &contig(cs)?, &op)?;
    Ok(q.reshape((b, heads.0, t, head_dim))?)
}

/// [`qk_norm_rope`] with the keys and values written into the paged caches, as
/// [`qkv_rope_paged`] does for [`qkv_rope`]. Returns `q`, `[b, h, t, d]`.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_paged(
    qkv: &Tensor,
    bias: &Tensor,
    cs: &Tensor,
    q_weight: &Tensor,
    k_weight: &Tensor,
    eps: f32,
    heads: (usize, usize),
    head_dim: usize,
    kv: &PagedKvWrite,
) -> Result<Tensor> {
    let tracked = [qkv, bias, q_weight, k_weight].iter().any(|t| t.track_op());
    if !kv.fused(qkv, tracked) {
        let (q, k, v) = qk_norm_rope(qkv, bias, cs, q_weight, k_weight, eps, heads, head_dim)?;
        kv.write(&k, &v)?;
        return Ok(q);
    }
    let (b, t, _) = qkv.dims3()?;
    let (h, kvh) = heads;
    let op = QkNormRope {
        h,
        kvh,
        d: head_dim,
        eps,
        cs: contig(cs)?,
        bias: Some(contig(bias)?),
        cache: Some(kv.clone()),
    };
    let q = contig(qkv)?.apply_op3_no_bwd(&contig(q_weight)?, &contig(k_weight)?, &op)?;
    Ok(q.reshape((b, h, t, head_dim))?)
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

/// RoPE's inverse on head-major `g` (`[b, heads, t, d]`, f32): rotation by the negative angle,
/// which is the transpose of the rotation, so the gradient of RoPE'd values with respect to
/// the values before it. `cs` holds cos then sin: `[t, d]` or `[b, t, d]`.
fn unrotate(g: &Tensor, cs: &Tensor) -> candle_core::Result<Tensor> {
    let half = cs.dim(D::Minus1)? / 2;
    let cos = cs.narrow(D::Minus1, 0, half)?;
    let sin = cs.narrow(D::Minus1, half, half)?;
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

/// Whether a cos|sin table of shape `dims` holds a row per token (`[b, t, d]`) rather than
/// one per position (`[t, d]`), after checking that it is one of the two; `op` names the
/// kernel in the error.
fn per_row_tables(
    op: &str,
    dims: &[usize],
    (b, t): (usize, usize),
    d: usize,
) -> candle_core::Result<bool> {
    let per_row = dims.len() == 3;
    let want: &[usize] = if per_row { &[b, t, d] } else { &[t, d] };
    if dims != want {
        candle_core::bail!("{op}: cos|sin table {dims:?}, expected {want:?}");
    }
    Ok(per_row)
}

struct QkvRope {
    h: usize,
    kvh: usize,
    d: usize,
    /// Where k and v go instead of the output (CUDA only): the output is then q alone.
    cache: Option<PagedKvWrite>,
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
        let per_row = per_row_tables("qkv_rope", l3.dims(), (b, t), self.d)?;
        Ok((b, t, per_row))
    }

    #[allow(clippy::too_many_arguments)]
    fn cpu<T: Float, C: Float>(
        &self,
        x: &[T],
        bias: &[T],
        cs: &[C],
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

/// [`linear_qkv_rope_paged`]'s kernel: inputs `h` `[b, 1, k]`, the bias, the tables; the
/// projection's weight `w` `[(h + 2 kvh) d, k]` held beside them, the caches in `rope`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct QkvRopeGemv {
    rope: QkvRope,
    w: Tensor,
}

impl CustomOp3 for QkvRopeGemv {
    fn name(&self) -> &'static str {
        "fleet-qkv-rope-gemv"
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
        candle_core::bail!(
            "qkv_rope_gemv: a CUDA kernel (linear_qkv_rope_paged takes the GEMV and qkv_rope_paged \
             elsewhere)"
        )
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
        cuda::qkv_rope_gemv(self, (s1, l1), (s2, l2), (s3, l3))
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
        if self.cache.is_some() {
            candle_core::bail!("qkv_rope: the paged write is a CUDA kernel (qkv_rope_paged)");
        }
        let (b, t, per_row) = self.dims(l1, l2, l3)?;
        let out = match (s1, s2, s3) {
            // f32 tables on half-precision inputs (the vision tower).
            (CpuStorage::BF16(x), CpuStorage::BF16(w), CpuStorage::F32(c)) => {
                let (x, w, c) = (contiguous(x, l1)?, contiguous(w, l2)?, contiguous(c, l3)?);
                CpuStorage::BF16(self.cpu(x, w, c, b, t, per_row))
            }
            (CpuStorage::F16(x), CpuStorage::F16(w), CpuStorage::F32(c)) => {
                let (x, w, c) = (contiguous(x, l1)?, contiguous(w, l2)?, contiguous(c, l3)?);
                CpuStorage::F16(self.cpu(x, w, c, b, t, per_row))
            }
            _ => float_cpu!("qkv_rope", (s1, l1) => x, (s2, l2) => w, (s3, l3) => c;
                self.cpu(x, w, c, b, t, per_row)),
        };
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
            if grad.device().is_cuda()
                && FUSED_BWD.on()
                && matches!(qkv.dtype(), DType::BF16 | DType::F16)
                && grad.dtype() == qkv.dtype()
            {
                // One kernel: the same values as below, in f32, and the bias sum by parts.
                let out = qkv_rope_backward(grad, cs, (b, t), (self.h, self.kvh), self.d)?;
                let all = out.narrow(0, 0, b * t)?.reshape((b, t, w))?;
                return Ok((
                    wanted(qkv, || all.to_dtype(qkv.dtype()))?,
                    wanted(bias, || out.get(b * t)?.to_dtype(bias.dtype()))?,
                    None,
                ));
            }
            let (gq, gk, gv) = split_grad(grad, (b, t), (self.h, self.kvh), self.d)?;
            let all = Tensor::cat(&[unrotate(&gq, cs)?, unrotate(&gk, cs)?, gv], 1)?
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
    cs: Tensor,
    bias: Option<Tensor>,
    /// As [`QkvRope`]'s.
    cache: Option<PagedKvWrite>,
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
        let per_row = per_row_tables("qk_norm_rope", self.cs.dims(), (b, t), d)?;
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
        cs: &[T],
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
                let row = &cs[(if per_row { tok } else { ti }) * d..][..d];
                let (cr, sr) = (&row[..half], &row[half..]);
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
                    let inv = inv_rms(s.iter().copied(), self.eps);
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
            &table(&self.cs)?,
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
        if self.cache.is_some() {
            candle_core::bail!(
                "qk_norm_rope: the paged write is a CUDA kernel (qk_norm_rope_paged)"
            );
        }
        let dims = self.dims(l1, l2, l3)?;
        let dtype = s1.dtype();
        let tables = [Some(&self.cs), self.bias.as_ref()];
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
                let g = unrotate(g, &self.cs)?.transpose(1, 2)?;
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

/// Whether qkv_rope's CUDA launches may take four (i, i + d/2) pairs a thread: with
/// `FLEET_QKV_ROPE_P4=1` only — off by default until its GPU test has run — or as
/// [`set_qkv_rope_pairs`] set it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
static FOUR_PAIRS: EnvSwitch = EnvSwitch::new("FLEET_QKV_ROPE_P4", false);

/// Test switch: how many (i, i + d/2) pairs a thread [`qkv_rope`]'s CUDA launches take — `Some(4)`
/// (packs, where the shapes allow), `Some(1)` (the kernel before them), `None` (the default:
/// one, or four with `FLEET_QKV_ROPE_P4=1`) — for comparing the two (the same bits).
pub fn set_qkv_rope_pairs(pairs: Option<usize>) {
    FOUR_PAIRS.force(pairs.map(|p| p == 4));
}

/// Whether [`qkv_rope`]'s backward on CUDA runs as one kernel (`qkv_rope_bwd`: the output
/// gradient read once, the gradient of qkv written once in f32, the bias gradient summed by
/// row slices) instead of the composed f32 ops (casts, candle's RoPE, concatenation, a
/// transpose copy, a sum): on by default (`FLEET_QKV_ROPE_BWD=0` turns it off), or as
/// [`set_qkv_rope_fused_backward`] sets it.
static FUSED_BWD: EnvSwitch = EnvSwitch::new("FLEET_QKV_ROPE_BWD", true);

/// Test switch for [`qkv_rope`]'s fused backward: `Some(on)` forces it, `None` leaves it to
/// `FLEET_QKV_ROPE_BWD`.
pub fn set_qkv_rope_fused_backward(on: Option<bool>) {
    FUSED_BWD.force(on);
}

/// Row slices of the fused backward's bias sum (its partial sums are added in this order).
const BWD_PARTS: usize = 64;

/// The fused backward of [`qkv_rope`] (no cache): from the flat output gradient `grad` (q, k,
/// v head-major, in the model dtype) and the tables `cs`, f32 `[b t + 1, (h + 2 kvh) d]`: the
/// gradient of qkv row by row (q and k un-rotated, v as it is), then the bias gradient (the
/// column sums, by 64 row slices added in order). The kernel on CUDA, the twin on
/// the CPU.
pub fn qkv_rope_backward(
    grad: &Tensor,
    cs: &Tensor,
    (b, t): (usize, usize),
    (h, kvh): (usize, usize),
    d: usize,
) -> candle_core::Result<Tensor> {
    let per_row = cs.rank() == 3;
    let cs = cs.detach().to_dtype(DType::F32)?.contiguous()?;
    let op = QkvRopeBwd {
        b,
        t,
        h,
        kvh,
        d,
        per_row,
    };
    grad.detach().contiguous()?.apply_op2_no_bwd(&cs, &op)
}

struct QkvRopeBwd {
    b: usize,
    t: usize,
    h: usize,
    kvh: usize,
    d: usize,
    per_row: bool,
}

impl QkvRopeBwd {
    fn check(&self, g: &Layout, cs: &Layout) -> candle_core::Result<()> {
        let (b, t, d) = (self.b, self.t, self.d);
        let n = b * t * (self.h + 2 * self.kvh) * d;
        let tables = if self.per_row { b * t * d } else { t * d };
        if d == 0 || !d.is_multiple_of(2) || g.shape().elem_count() != n {
            candle_core::bail!(
                "qkv_rope backward: gradient {:?} is not {n} values",
                g.dims()
            );
        }
        if cs.shape().elem_count() != tables {
            candle_core::bail!(
                "qkv_rope backward: tables {:?} are not {tables} values",
                cs.dims()
            );
        }
        Ok(())
    }

    /// The twin: the kernel's arithmetic in its order.
    fn cpu<T: Float>(&self, g: &[T], cs: &[f32]) -> Vec<f32> {
        let (b, t, h, kvh, d) = (self.b, self.t, self.h, self.kvh, self.d);
        let (w, rows, half) = ((h + 2 * kvh) * d, b * t, d / 2);
        let (qn, kvn) = (b * h * t * d, b * kvh * t * d);
        let mut out = vec![0f32; (rows + 1) * w];
        let mut partial = vec![0f32; BWD_PARTS * w];
        for part in 0..BWD_PARTS {
            for r in (part..rows).step_by(BWD_PARTS) {
                let (bb, tt) = (r / t, r % t);
                for c in 0..w {
                    let (hd, i) = (c / d, c % d);
                    let (base, rot) = if hd < h {
                        (((bb * h + hd) * t + tt) * d, true)
                    } else if hd < h + kvh {
                        (qn + ((bb * kvh + hd - h) * t + tt) * d, true)
                    } else {
                        (qn + kvn + ((bb * kvh + hd - h - kvh) * t + tt) * d, false)
                    };
                    let v = if rot {
                        let row = if self.per_row { r } else { tt } * d;
                        let j = i % half;
                        let (co, sp) = (cs[row + j], -cs[row + half + j]);
                        let (x1, x2) = (g[base + j].to_f32(), g[base + j + half].to_f32());
                        if i < half {
                            x1 * co - x2 * sp
                        } else {
                            x1 * sp + x2 * co
                        }
                    } else {
                        g[base + i].to_f32()
                    };
                    out[r * w + c] = v;
                    partial[part * w + c] += v;
                }
            }
        }
        for c in 0..w {
            out[rows * w + c] = (0..BWD_PARTS).fold(0f32, |acc, p| acc + partial[p * w + c]);
        }
        out
    }
}

impl candle_core::CustomOp2 for QkvRopeBwd {
    fn name(&self) -> &'static str {
        "fleet-qkv-rope-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.check(l1, l2)?;
        let CpuStorage::F32(cs) = s2 else {
            candle_core::bail!("qkv_rope backward: the tables must be f32")
        };
        let cs = contiguous(cs, l2)?;
        let out = match s1 {
            CpuStorage::BF16(g) => self.cpu(contiguous(g, l1)?, cs),
            CpuStorage::F16(g) => self.cpu(contiguous(g, l1)?, cs),
            CpuStorage::F32(g) => self.cpu(contiguous(g, l1)?, cs),
            _ => candle_core::bail!("qkv_rope backward: the gradient must be f32, f16 or bf16"),
        };
        let w = (self.h + 2 * self.kvh) * self.d;
        Ok((CpuStorage::F32(out), Shape::from((self.b * self.t + 1, w))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.check(l1, l2)?;
        let w = (self.h + 2 * self.kvh) * self.d;
        let out = cuda::qkv_rope_bwd(self, s1, l1, s2, l2)?;
        Ok((out, Shape::from((self.b * self.t + 1, w))))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use std::ops::Deref;

    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Shape};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;
    use super::{PagedKvWrite, QkNormRope};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/qkv_rope.ptx"));
    const MODULE: &str = "fleet_qkv_rope";

    /// The kernels' output length: q, k and v, or q alone when k and v go to a cache.
    fn out_len(
        cache: Option<&PagedKvWrite>,
        (b, t): (usize, usize),
        (h, kvh): (usize, usize),
        d: usize,
    ) -> usize {
        b * t * d * if cache.is_some() { h } else { h + 2 * kvh }
    }

    /// The caches' and the slots' device views.
    type CacheViews<'a, T> = (CudaView<'a, T>, CudaView<'a, T>, CudaView<'a, u32>);

    /// The storages (read guards) and layouts of a paged write's caches and slots.
    fn cache_guards(
        cache: Option<&PagedKvWrite>,
    ) -> Option<[(impl Deref<Target = candle_core::Storage> + '_, &Layout); 3]> {
        cache.map(|c| [&c.k_cache, &c.v_cache, &c.slots].map(|t| t.storage_and_layout()))
    }

    /// The device views of [`cache_guards`]' storages, each checked to be on `dev` and
    /// contiguous.
    fn cache_views<'a, T: CudaDType + DeviceRepr, G: Deref<Target = candle_core::Storage>>(
        guards: &'a Option<[(G, &Layout); 3]>,
        dev: &candle_core::CudaDevice,
    ) -> candle_core::Result<Option<CacheViews<'a, T>>> {
        let Some([(k, kl), (v, vl), (sl, sll)]) = guards else {
            return Ok(None);
        };
        let op = "paged q/k/v write";
        fn whole<'s>(
            s: &'s CudaStorage,
            l: &Layout,
            what: &str,
        ) -> candle_core::Result<(&'s CudaStorage, usize, usize)> {
            match l.contiguous_offsets() {
                Some((a, b)) => Ok((s, a, b)),
                None => candle_core::bail!("paged q/k/v write: the {what} must be contiguous"),
            }
        }
        let (ks, ka, kb) = whole(held(op, "k cache", k, dev)?, kl, "k cache")?;
        let (vs, va, vb) = whole(held(op, "v cache", v, dev)?, vl, "v cache")?;
        let (ss, sa, sb) = whole(held(op, "slots", sl, dev)?, sll, "slots")?;
        Ok(Some((
            ks.as_cuda_slice::<T>()?.slice(ka..kb),
            vs.as_cuda_slice::<T>()?.slice(va..vb),
            ss.as_cuda_slice::<u32>()?.slice(sa..sb),
        )))
    }

    /// The block size and the number of slots of a paged write (zeros without one), after
    /// checking its caches against `(b, t)`, `kvh` and `d`.
    fn cache_dims(
        cache: Option<&PagedKvWrite>,
        bt: (usize, usize),
        kvh: usize,
        d: usize,
    ) -> candle_core::Result<(i32, i64)> {
        Ok(match cache {
            Some(c) => {
                let (bs, n) = c.dims(bt, kvh, d)?;
                (bs as i32, n as i64)
            }
            None => (0, 0),
        })
    }

    /// Pushes the kernels' last five arguments: the caches, the slots, the block size and the
    /// number of slots, or null pointers and zeros without a cache. The caches are written in
    /// place, as paged_kv_write does, through the views' device pointers.
    fn push_cache<'b, T>(
        bld: &mut LaunchArgs<'b>,
        views: &'b Option<CacheViews<'b, T>>,
        dims: &'b (i32, i64),
    ) {
        const NULL: u64 = 0;
        match views {
            Some((k, v, slots)) => {
                bld.arg(k);
                bld.arg(v);
                bld.arg(slots);
            }
            None => {
                bld.arg(&NULL);
                bld.arg(&NULL);
                bld.arg(&NULL);
            }
        }
        bld.arg(&dims.0);
        bld.arg(&dims.1);
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
        fn run<T: CudaDType + DeviceRepr, C: CudaDType + DeviceRepr>(
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
                input::<C>(s3, l3)?,
            );
            let heads = op.h + 2 * op.kvh;
            let n = out_len(op.cache.as_ref(), (b, t), (op.h, op.kvh), op.d);
            // Tables in f32 on half-precision inputs: the `_csf32` kernels.
            let tables = if s3.dtype() != s1.dtype() {
                "_csf32"
            } else {
                ""
            };
            let cache_dims = cache_dims(op.cache.as_ref(), (b, t), op.kvh, op.d)?;
            let guards = cache_guards(op.cache.as_ref());
            let views = cache_views::<T, _>(&guards, &dev)?;
            // Four pairs a thread (`_p4`, packs of 4 elements) where d/2 and every row start
            // allow it.
            let mut starts = vec![l1.start_offset(), l2.start_offset(), l3.start_offset()];
            if let Some(g) = &guards {
                starts.extend([g[0].1.start_offset(), g[1].1.start_offset()]);
            }
            let pairs = if super::FOUR_PAIRS.on()
                && (op.d / 2).is_multiple_of(4)
                && starts.iter().all(|o| o.is_multiple_of(4))
            {
                4
            } else {
                1
            };
            let func = dev.get_or_load_custom_func(
                &format!(
                    "qkv_rope_{}{tables}{}",
                    suffix(s1.dtype())?,
                    if pairs == 4 { "_p4" } else { "" }
                ),
                MODULE,
                PTX,
            )?;
            // SAFETY: every (token, head) block writes its d outputs.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
            // Heads per block: up to 256 threads of d / 2 / pairs each.
            let per_head = (op.d / 2 / pairs).max(1);
            let hpb = (256 / per_head).clamp(1, heads);
            let cfg = LaunchConfig {
                grid_dim: ((b * t * heads.div_ceil(hpb)) as u32, 1, 1),
                block_dim: ((hpb * per_head) as u32, 1, 1),
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
            push_cache(&mut bld, &views, &cache_dims);
            let hpb = hpb as i32;
            bld.arg(&hpb);
            // SAFETY: grid covers b * t tokens, each in blocks of hpb heads of d/2/pairs threads
            // (pairs = 4 only where every row start is a multiple of 4); with a cache, k and v
            // rows go to checked slots of it (cache_views), q alone to `out`.
            unsafe { bld.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        let n = out_len(op.cache.as_ref(), (dims.0, dims.1), (op.h, op.kvh), op.d);
        use candle_core::DType as Dt;
        let out = match (s1.dtype(), s3.dtype()) {
            (Dt::F32, Dt::F32) => run::<f32, f32>(op, dims, s1, l1, s2, l2, s3, l3)?,
            (Dt::F16, Dt::F16) => run::<f16, f16>(op, dims, s1, l1, s2, l2, s3, l3)?,
            (Dt::BF16, Dt::BF16) => run::<bf16, bf16>(op, dims, s1, l1, s2, l2, s3, l3)?,
            (Dt::F16, Dt::F32) => run::<f16, f32>(op, dims, s1, l1, s2, l2, s3, l3)?,
            (Dt::BF16, Dt::F32) => run::<bf16, f32>(op, dims, s1, l1, s2, l2, s3, l3)?,
            (x, c) => candle_core::bail!("qkv_rope: inputs {x:?} with tables {c:?}"),
        };
        Ok((out, Shape::from(n)))
    }

    /// [`super::linear_qkv_rope_paged`]'s kernel: `h` `[b, 1, k]` (b up to the GEMV's rows),
    /// the bias `[n]`, the tables `[b, 1, d]` or `[1, d]` in h's dtype; q `[b * h * d]` out,
    /// k and v into the caches.
    pub(super) fn qkv_rope_gemv(
        op: &super::QkvRopeGemv,
        (s1, l1): (&CudaStorage, &Layout),
        (s2, l2): (&CudaStorage, &Layout),
        (s3, l3): (&CudaStorage, &Layout),
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(
            op: &super::QkvRopeGemv,
            (s1, l1): (&CudaStorage, &Layout),
            (s2, l2): (&CudaStorage, &Layout),
            (s3, l3): (&CudaStorage, &Layout),
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let dev = s1.device().clone();
            let rope = &op.rope;
            let (h, kvh, d) = (rope.h, rope.kvh, rope.d);
            let n = (h + 2 * kvh) * d;
            let (b, t, k) = l1.shape().dims3()?;
            let (w_guard, wl) = op.w.storage_and_layout();
            let per_row = super::per_row_tables("qkv_rope_gemv", l3.dims(), (b, 1), d)?;
            if t != 1
                || !(1..=crate::ops::GEMV_MAX_ROWS).contains(&b)
                || !k.is_multiple_of(8)
                || !d.is_multiple_of(2)
                || wl.dims() != [n, k]
                || l2.dims() != [n]
                || !(l1.start_offset().is_multiple_of(8) && wl.start_offset().is_multiple_of(8))
            {
                candle_core::bail!(
                    "qkv_rope_gemv: h {:?}, w {:?}, bias {:?} for {h} + 2 x {kvh} heads of {d}: \
                     h must be [1..=4, 1, k] (k a multiple of 8, rows on 16 bytes), w [{n}, k], \
                     the bias [{n}]",
                    l1.dims(),
                    wl.dims(),
                    l2.dims()
                );
            }
            let w_storage = held("qkv_rope_gemv", "projection weight", &w_guard, &dev)?;
            let w = input::<T>(w_storage, wl)?;
            let (x, bias, cs) = (
                input::<T>(s1, l1)?,
                input::<T>(s2, l2)?,
                input::<T>(s3, l3)?,
            );
            let cache_dims = cache_dims(rope.cache.as_ref(), (b, 1), kvh, d)?;
            let guards = cache_guards(rope.cache.as_ref());
            let views = cache_views::<T, _>(&guards, &dev)?;
            let func = dev.get_or_load_custom_func(
                &format!("gemv_qkv_rope_{}_m{b}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: the kernel writes q's every element (one warp a pair of every q head).
            let q: CudaSlice<T> = unsafe { dev.alloc::<T>(b * h * d)? };
            // Two warps a block (the kernel's launch bounds).
            let pairs = (h + 2 * kvh) * d / 2;
            let cfg = LaunchConfig {
                grid_dim: (pairs.div_ceil(2) as u32, 1, 1),
                block_dim: (64, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut bld = func.builder();
            bld.arg(&x);
            bld.arg(&w);
            bld.arg(&bias);
            bld.arg(&cs);
            let per_row = i32::from(per_row);
            bld.arg(&per_row);
            bld.arg(&q);
            let dims = [h as i32, kvh as i32, d as i32, k as i32];
            for a in &dims {
                bld.arg(a);
            }
            push_cache(&mut bld, &views, &cache_dims);
            // SAFETY: warp p < pairs reads rows (p / (d/2)) d + p % (d/2) and + d/2 of w (n rows
            // of k, checked) and the b rows of x, 16 bytes at a time (k a multiple of 8, rows
            // aligned: checked); it writes q's element pair of its head, or its k/v pair at
            // checked slots of the caches (cache_views, cache_dims).
            unsafe { bld.launch(cfg) }.w()?;
            Ok((CudaStorage::wrap_cuda_slice(q, dev), Shape::from(b * h * d)))
        }
        match s1.dtype() {
            DType::F16 => run::<f16>(op, (s1, l1), (s2, l2), (s3, l3)),
            DType::BF16 => run::<bf16>(op, (s1, l1), (s2, l2), (s3, l3)),
            other => candle_core::bail!("qkv_rope_gemv: {other:?} on CUDA (f16 or bf16)"),
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
            let (cs_g, cs_l) = op.cs.storage_and_layout();
            let cs = input::<T>(held("qk_norm_rope", "cs", &cs_g, &dev)?, cs_l)?;
            let bias_g = op.bias.as_ref().map(|b| b.storage_and_layout());
            let bias = match &bias_g {
                Some((g, l)) => Some(input::<T>(held("qk_norm_rope", "bias", g, &dev)?, l)?),
                None => None,
            };
            let heads = op.h + 2 * op.kvh;
            let n = out_len(op.cache.as_ref(), (b, t), (op.h, op.kvh), op.d);
            let func = dev.get_or_load_custom_func(
                &format!("qk_norm_rope_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            let cache_dims = cache_dims(op.cache.as_ref(), (b, t), op.kvh, op.d)?;
            let guards = cache_guards(op.cache.as_ref());
            let views = cache_views::<T, _>(&guards, &dev)?;
            // SAFETY: every (token, head) warp writes its d outputs.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
            // Four (token, head) warps a block; a block's warps past the last return at once.
            const WARPS: usize = 4;
            let cfg = LaunchConfig {
                grid_dim: ((b * t * heads).div_ceil(WARPS) as u32, 1, 1),
                block_dim: (32 * WARPS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut bld = func.builder();
            bld.arg(&x);
            // Without a bias the kernel reads none; any device pointer fills the slot.
            match &bias {
                Some(bias) => bld.arg(bias),
                None => bld.arg(&qw),
            };
            bld.arg(&cs);
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
            push_cache(&mut bld, &views, &cache_dims);
            // SAFETY: the grid's warps cover the b * t * heads (token, head) pairs, the ones past
            // them return before any access; with a cache, k and v
            // rows go to checked slots of it (cache_views), q alone to `out`.
            unsafe { bld.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        let dtype = s1.dtype();
        let tables = [Some(&op.cs), op.bias.as_ref()];
        if s2.dtype() != dtype
            || s3.dtype() != dtype
            || tables.iter().flatten().any(|t| t.dtype() != dtype)
        {
            candle_core::bail!("qk_norm_rope: inputs must share one of f32, f16, bf16");
        }
        let n = out_len(op.cache.as_ref(), (dims.0, dims.1), (op.h, op.kvh), op.d);
        let out = match dtype {
            DType::F32 => run::<f32>(op, dims, s1, l1, s2, l2, s3, l3)?,
            DType::F16 => run::<f16>(op, dims, s1, l1, s2, l2, s3, l3)?,
            DType::BF16 => run::<bf16>(op, dims, s1, l1, s2, l2, s3, l3)?,
            other => candle_core::bail!("qk_norm_rope: unsupported dtype {other:?}"),
        };
        Ok((out, Shape::from(n)))
    }

    /// The fused backward's two launches: `qkv_rope_bwd` (the gradient of qkv in f32 and the
    /// bias gradient's partial sums per row slice), then `sum_partials` into the last row.
    pub(super) fn qkv_rope_bwd(
        op: &super::QkvRopeBwd,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            op: &super::QkvRopeBwd,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            bf16_grad: i32,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            let w = (op.h + 2 * op.kvh) * op.d;
            let rows = op.b * op.t;
            let (grad, cs) = (input::<T>(s1, l1)?, input::<f32>(s2, l2)?);
            let parts = super::BWD_PARTS;
            // SAFETY: the kernel writes every out[r, c] for r < rows and every partial;
            // sum_partials writes the last row.
            let mut out: CudaSlice<f32> = unsafe { dev.alloc::<f32>((rows + 1) * w)? };
            let partial: CudaSlice<f32> = unsafe { dev.alloc::<f32>(parts * w)? };
            let func = dev.get_or_load_custom_func("qkv_rope_bwd", MODULE, PTX)?;
            let cfg = LaunchConfig {
                grid_dim: ((w as u32).div_ceil(256), parts as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&grad);
            b.arg(&cs);
            b.arg(&mut out);
            b.arg(&partial);
            let ints = [
                op.b as i32,
                op.t as i32,
                op.h as i32,
                op.kvh as i32,
                op.d as i32,
                op.per_row as i32,
                bf16_grad,
            ];
            for x in &ints {
                b.arg(x);
            }
            // SAFETY: one thread per column reads its rows of the gradient (checked to hold
            // b t (h + 2 kvh) d values) and of the tables, and writes its column of out and
            // of partial.
            unsafe { b.launch(cfg) }.w()?;
            super::super::rms_norm::cuda::sum_partials(
                &dev,
                &partial,
                &mut out,
                rows * w,
                parts,
                w,
            )?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        match s1.dtype() {
            DType::BF16 => run::<bf16>(op, s1, l1, s2, l2, 1),
            DType::F16 => run::<f16>(op, s1, l1, s2, l2, 0),
            other => candle_core::bail!("qkv_rope backward: {other:?} gradient on CUDA"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused backward's twin against the composed backward it replaces (split, un-rotate
    /// in f32, concatenate, transpose; the bias gradient a sum over tokens), with grouped
    /// heads, per-row tables (left padding) and a bf16 gradient.
    #[test]
    fn fused_backward_twin_is_the_composed_backward() {
        use candle_core::{DType, Device};
        let dev = Device::Cpu;
        let (b, t, h, kvh, d) = (2, 5, 4, 2, 8);
        let n = b * t * (h + 2 * kvh) * d;
        let w = (h + 2 * kvh) * d;
        let grad = Tensor::randn(0f32, 1.0, n, &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let angles = Tensor::randn(0f32, 1.0, (b, t, d / 2), &dev).unwrap();
        // cos then sin per position (`[b, t, d]`: per-row tables).
        let cs = Tensor::cat(&[angles.cos().unwrap(), angles.sin().unwrap()], 2).unwrap();
        let fused = qkv_rope_backward(&grad, &cs, (b, t), (h, kvh), d).unwrap();
        let (gq, gk, gv) = split_grad(&grad, (b, t), (h, kvh), d).unwrap();
        let all = Tensor::cat(
            &[unrotate(&gq, &cs).unwrap(), unrotate(&gk, &cs).unwrap(), gv],
            1,
        )
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((b * t, w))
        .unwrap();
        let bias = all.sum(0).unwrap();
        let diff = max_abs_diff;
        assert!(diff(&fused.narrow(0, 0, b * t).unwrap(), &all) < 1e-6);
        assert!(diff(&fused.get(b * t).unwrap(), &bias) < 1e-5);
    }
    use candle_core::Device;

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
        let diff = max_abs_diff;
        let (q, k, v) = qkv_rope(&raw, &bias, &cs, (h, kvh), d).unwrap();
        assert!(diff(&q, &want_q) < 1e-5 && diff(&k, &want_k) < 1e-5 && diff(&v, &want_v) < 1e-6);
        // Shared positions ([t, d] table): row 0 of the batch uses the same tables.
        let (q, _, _) = qkv_rope(&raw, &bias, &cs.get(0).unwrap(), (h, kvh), d).unwrap();
        assert!(diff(&q.get(0).unwrap(), &want_q.get(0).unwrap()) < 1e-5);
    }
}

#[cfg(all(test, feature = "cuda"))]
mod kernel_tests {
    use super::*;

    /// Four pairs a thread give the one-pair kernel's bits: the 7B's heads (d 128, tables in
    /// the model dtype) and the vision tower's (d 72, f32 tables), each dtype, per-row tables.
    #[test]
    fn four_pairs_a_thread_give_the_one_pair_bits() {
        let Some(gpu) = test_gpu("four_pairs_a_thread_give_the_one_pair_bits") else {
            return;
        };
        for (h, kvh, d, f32_tables) in [(28, 4, 128, false), (16, 16, 72, true)] {
            for dtype in [DType::BF16, DType::F16, DType::F32] {
                let (b, t) = (2, 37);
                let rnd = |shape: &[usize], seed: u64, dt: DType| -> Tensor {
                    test_tensor(shape, seed)
                        .to_dtype(dt)
                        .unwrap()
                        .to_device(&gpu)
                        .unwrap()
                };
                let qkv = rnd(&[b, t, (h + 2 * kvh) * d], 1, dtype);
                let bias = rnd(&[(h + 2 * kvh) * d], 2, dtype);
                let cs = rnd(&[b, t, d], 3, if f32_tables { DType::F32 } else { dtype });
                let run = || -> Vec<Vec<u32>> {
                    let (q, k, v) = qkv_rope(&qkv, &bias, &cs, (h, kvh), d).unwrap();
                    [q, k, v]
                        .iter()
                        .map(|x| {
                            let x = x.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                            let x: Vec<f32> = x.to_vec1().unwrap();
                            x.iter().map(|v| v.to_bits()).collect()
                        })
                        .collect()
                };
                set_qkv_rope_pairs(Some(4));
                let four = run();
                set_qkv_rope_pairs(Some(1));
                let one = run();
                set_qkv_rope_pairs(None);
                assert!(
                    four == one,
                    "d {d} {dtype:?}: four pairs a thread differ from one"
                );
            }
        }
    }

    /// The fused paged write on the GPU against the three kernels it replaces (q/k/v split,
    /// then two `paged_kv_write`s), bit for bit: q, and both caches, whose other slots keep
    /// their values; a `u32::MAX` slot (padding) writes nothing. Qwen2's and Qwen3's kernels,
    /// f32 and bf16, a decode step (t = 1) and a prefill (t = 3).
    #[test]
    fn paged_write_equals_the_split_and_the_two_cache_writes() {
        let Some(gpu) = test_gpu("paged_write_equals_the_split_and_the_two_cache_writes") else {
            return;
        };
        let (h, kvh, d, blocks, bs) = (4, 2, 64, 5, 16);
        for dtype in [DType::F32, DType::BF16] {
            for (b, t) in [(3, 1), (2, 3)] {
                let rnd = |shape: &[usize], seed: u64| -> Tensor {
                    let x = test_tensor(shape, seed).to_device(&gpu).unwrap();
                    x.to_dtype(dtype).unwrap()
                };
                let qkv = rnd(&[b, t, (h + 2 * kvh) * d], 1);
                let bias = rnd(&[(h + 2 * kvh) * d], 2);
                let cs = rnd(&[b, t, d], 3);
                let (qw, kw) = (rnd(&[d], 4), rnd(&[d], 5));
                // Slots scattered over the blocks; the last token is padding.
                let mut slots: Vec<u32> = (0..b * t).map(|i| (i * 7 + 3) as u32 % 80).collect();
                *slots.last_mut().unwrap() = u32::MAX;
                let cache = |seed| rnd(&[blocks, kvh, bs, d], seed);
                let target = |seed| PagedKvWrite {
                    k_cache: cache(seed),
                    v_cache: cache(seed + 1),
                    slots: Tensor::new(slots.as_slice(), &gpu).unwrap(),
                };
                let host = |x: &Tensor| -> Vec<f32> {
                    let x = x.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                    x.to_vec1::<f32>().unwrap()
                };
                for qwen3 in [false, true] {
                    let (fused, split) = (target(10), target(10));
                    let q_fused = if qwen3 {
                        qk_norm_rope_paged(&qkv, &bias, &cs, &qw, &kw, 1e-6, (h, kvh), d, &fused)
                    } else {
                        qkv_rope_paged(&qkv, &bias, &cs, (h, kvh), d, &fused)
                    }
                    .unwrap();
                    let (q, k, v) = if qwen3 {
                        qk_norm_rope(&qkv, &bias, &cs, &qw, &kw, 1e-6, (h, kvh), d)
                    } else {
                        qkv_rope(&qkv, &bias, &cs, (h, kvh), d)
                    }
                    .unwrap();
                    split.write(&k, &v).unwrap();
                    let what = format!("{dtype:?} b {b} t {t} qwen3 {qwen3}");
                    assert_eq!(q_fused.dims(), q.dims(), "{what}");
                    assert_eq!(host(&q_fused), host(&q), "q, {what}");
                    assert_eq!(
                        host(&fused.k_cache),
                        host(&split.k_cache),
                        "k cache, {what}"
                    );
                    assert_eq!(
                        host(&fused.v_cache),
                        host(&split.v_cache),
                        "v cache, {what}"
                    );
                    assert_ne!(
                        host(&fused.k_cache),
                        host(&cache(10)),
                        "nothing written, {what}"
                    );
                }
            }
        }
    }

    /// The q/k/v GEMV ending in qkv_rope's paged epilogue gives the GEMV's and the paged
    /// kernel's bits: q and both caches (the other slots kept, a `u32::MAX` slot writing
    /// nothing), 1 to 4 rows, bf16 and f16, per-row and shared tables, the 0.5B's, 1.5B's and
    /// 7B's heads; and [`linear_qkv_rope_paged`] takes it.
    #[test]
    fn qkv_gemv_rope_gives_the_two_kernels_bits() {
        let Some(gpu) = test_gpu("qkv_gemv_rope_gives_the_two_kernels_bits") else {
            return;
        };
        let (blocks, bs) = (6, 16);
        let host = |x: &Tensor| -> Vec<u32> {
            let x = x.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            x.to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        for (h, kvh, d, k) in [(14, 2, 64, 896), (12, 2, 128, 1536), (28, 4, 128, 3584)] {
            for dtype in [DType::BF16, DType::F16] {
                for (b, per_row) in [(1, true), (2, false), (3, true), (4, true)] {
                    let rnd = |shape: &[usize], seed: u64| -> Tensor {
                        let x = test_tensor(shape, seed).to_device(&gpu).unwrap();
                        x.to_dtype(dtype).unwrap()
                    };
                    let n = (h + 2 * kvh) * d;
                    let x = rnd(&[b, 1, k], 1);
                    let proj = candle_nn::Linear::new(rnd(&[n, k], 2), None);
                    let bias = rnd(&[n], 3);
                    let cs = if per_row {
                        rnd(&[b, 1, d], 4)
                    } else {
                        rnd(&[1, d], 4)
                    };
                    let mut slots: Vec<u32> = (0..b).map(|i| (i * 37 + 5) as u32 % 96).collect();
                    if b > 1 {
                        slots[1] = u32::MAX;
                    }
                    let target = || PagedKvWrite {
                        k_cache: rnd(&[blocks, kvh, bs, d], 10),
                        v_cache: rnd(&[blocks, kvh, bs, d], 11),
                        slots: Tensor::new(slots.as_slice(), &gpu).unwrap(),
                    };
                    let what =
                        format!("{dtype:?} h {h} kvh {kvh} d {d} k {k} b {b} per_row {per_row}");
                    let (fused, via, split) = (target(), target(), target());
                    let op = QkvRopeGemv {
                        rope: QkvRope {
                            h,
                            kvh,
                            d,
                            cache: Some(fused.clone()),
                        },
                        w: proj.weight().clone(),
                    };
                    let q_fused = x.apply_op3_no_bwd(&bias, &cs, &op).unwrap();
                    let q_via =
                        linear_qkv_rope_paged(&x, &proj, &bias, &cs, (h, kvh), d, &via).unwrap();
                    let qkv = super::super::gemv(&x.squeeze(1).unwrap(), proj.weight())
                        .unwrap()
                        .unsqueeze(1)
                        .unwrap();
                    let q = qkv_rope_paged(&qkv, &bias, &cs, (h, kvh), d, &split).unwrap();
                    assert_eq!(q_via.dims(), q.dims(), "{what}");
                    assert_eq!(host(&q_fused), host(&q), "q, {what}");
                    assert_eq!(
                        host(&q_via),
                        host(&q),
                        "q through linear_qkv_rope_paged, {what}"
                    );
                    for (name, a, b) in [
                        ("k", &fused.k_cache, &split.k_cache),
                        ("v", &fused.v_cache, &split.v_cache),
                        ("k via", &via.k_cache, &split.k_cache),
                        ("v via", &via.v_cache, &split.v_cache),
                    ] {
                        assert_eq!(host(a), host(b), "{name} cache, {what}");
                    }
                    assert_ne!(
                        host(&fused.v_cache),
                        host(&target().v_cache),
                        "nothing written, {what}"
                    );
                }
            }
        }
    }
}
