//! Fused attention on CUDA: `softmax(q kᵀ · scale) v` in one kernel whose scores never reach
//! memory (the online softmax of FlashAttention-2, `attention.cu`), with the decoder's
//! mask (causal, left padding) and grouped-query heads.
//!
//! The unfused path writes a `[heads, q_len, kv_len]` score buffer, reads it back for the
//! softmax, writes the probabilities and reads them again: for a 1024x1024 image's 4,096 vision
//! patches that is 512 MiB per block and image, and the time goes to memory traffic rather than
//! arithmetic. [`flash_attention`] runs where [`supported`] says so (CUDA, bf16/f16, head
//! dimension a multiple of 8 up to 128); [`reference()`] is the same function in plain tensor ops,
//! which the GPU tests compare it with.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use crate::error::{ModelError, Result};

/// Largest head dimension the kernel takes.
pub const MAX_HEAD_DIM: usize = 128;

/// Whether the training passes (tracked or not) run the flash kernel with its backward
/// ([`flash_backward`]) instead of the unfused path: on by default, `FLEET_TRAIN_FLASH=0`
/// turns it off. Its first version made a 1.5B GSPO micro-step no faster on one H200 (the
/// backward copied the gradients of the transposes around the kernel); entering through
/// [`attend_token_major`], which records no transposes, it took the update 3.5% faster in
/// the same H200 call (docs/benchmarks.md). Either way the old log-probs and the update take
/// the same path; off a GPU the unfused path runs.
pub fn flash_in_training() -> bool {
    TRAIN_FLASH.on()
}

static TRAIN_FLASH: crate::ops::EnvSwitch = crate::ops::EnvSwitch::new("FLEET_TRAIN_FLASH", true);

/// The mask of one attention call.
#[derive(Debug, Clone, Default)]
pub struct Mask {
    /// Query `i` sits at absolute position `i + kv_len - q_len` and sees keys up to it.
    pub causal: bool,
    /// Left padding per batch row (u32 `[batch]` on the inputs' device): key `j` is hidden when
    /// `j < key_start[b]`, except from the query at position `j` itself (so that padding rows
    /// stay finite), as the decoder's `masked_softmax`. Or one start per query (u32 `[batch,
    /// q_len]`, nondecreasing along each row): key `j` is hidden from query `i` when
    /// `j < key_start[b, i]` — sequences packed into one row, each seeing only its own keys.
    pub key_start: Option<Tensor>,
}

/// Whether [`flash_attention`] runs for a query tensor like `q` `[b, q_len, heads, head_dim]`.
/// `FLEET_FLASH_ATTENTION=0` turns the kernel off (for measurements against the unfused path).
pub fn supported(q: &Tensor) -> bool {
    let d = q.dims().last().copied().unwrap_or(0);
    q.device().is_cuda() && fused_prefill(q.dtype(), d) && gpu_is_sm80(q.device())
}

/// Whether prefills of a model with heads of `head_dim` in `dtype` on a CUDA GPU go through the
/// fused kernel, so that a memory plan need not count score buffers (`Workload::
/// max_attention_bytes = Some(0)`). Decided before any device is opened, from the build: the
/// kernels exist when built for sm_80 or later (`CUDA_COMPUTE_CAP`); [`supported`] also checks
/// the GPU at run time.
pub fn fused_prefill(dtype: DType, head_dim: usize) -> bool {
    built_for_sm80()
        && matches!(dtype, DType::BF16 | DType::F16)
        && head_dim.is_multiple_of(8)
        && head_dim <= MAX_HEAD_DIM
        && std::env::var("FLEET_FLASH_ATTENTION").map_or(true, |v| v != "0")
}

/// Whether the CUDA kernels were built for compute capability 8.0 or later.
fn built_for_sm80() -> bool {
    option_env!("FLEET_CUDA_COMPUTE_CAP")
        .and_then(|c| c.parse::<u32>().ok())
        .is_some_and(|c| c >= 80)
}

/// Whether this GPU has compute capability 8.0 or later (the kernels' mma.sync, ldmatrix and
/// cp.async); an older GPU runs attention unfused, logged once.
fn gpu_is_sm80(device: &candle_core::Device) -> bool {
    static WARNED: std::sync::Once = std::sync::Once::new();
    match compute_capability_major(device) {
        Some(m) if m >= 8 => true,
        other => {
            if device.is_cuda() {
                WARNED.call_once(|| {
                    tracing::warn!(
                        "fused attention needs compute capability 8.0 (this GPU: {other:?}); \
                         attention runs unfused"
                    )
                });
            }
            false
        }
    }
}

/// The major compute capability of the process's first CUDA device asked about (read once:
/// the attention kernels are built for one architecture), `None` off CUDA or when the driver
/// does not say.
fn compute_capability_major(device: &candle_core::Device) -> Option<i32> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
        static MAJOR: std::sync::OnceLock<Option<i32>> = std::sync::OnceLock::new();
        match device {
            candle_core::Device::Cuda(dev) => *MAJOR.get_or_init(|| {
                dev.cuda_stream()
                    .context()
                    .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                    .ok()
            }),
            _ => None,
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}

/// The one attention dispatch of the text decoder and the vision tower:
/// `softmax(q kᵀ · scale + mask) v` for head-major `q` `[b, heads, q_len, d]` and `k`, `v`
/// `[b, kv_heads, kv_len, d]` (the decoder's own layout: no view between its q/k/v kernel and
/// the GEMMs, so a tracked pass records no extra graph nodes), giving `[b, heads, q_len, d]`.
///
/// [`flash_attention`] when the caller allows it (`fused`) and [`supported`] says it runs;
/// otherwise the unfused path: the query heads that share a KV head stacked along the rows
/// (`[b, kv_heads, n_rep * q, d]`, so each grouped KV head is read once for its group, with no
/// copy of K/V), the scores scaled unless `scale` is 1 (the decoder folds it into its queries),
/// and the decoder's [`crate::ops::masked_softmax`] (f32 statistics, one rounding to the model
/// dtype). With `max_scores_bytes`, queries go in chunks whose score buffer (all batch rows')
/// stays within it (a 1024x1024 image's 4,096 vision patches would need 512 MiB per block
/// otherwise).
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: &Mask,
    fused: bool,
    max_scores_bytes: Option<usize>,
) -> Result<Tensor> {
    let token_major = |t: &Tensor| t.transpose(1, 2);
    if fused && supported(&token_major(q)?) {
        let out = flash_attention(
            &token_major(q)?,
            &token_major(k)?,
            &token_major(v)?,
            scale as f32,
            mask,
        )?;
        return Ok(out.transpose(1, 2)?);
    }
    let (b, h, q_len, d) = q.dims4()?;
    let (_, kvh, kv_len, _) = k.dims4()?;
    if kvh == 0 || h % kvh != 0 || kv_len < q_len {
        return Err(ModelError::BadInput(format!(
            "attention: q {:?}, k {:?} do not fit together",
            q.dims(),
            k.dims()
        )));
    }
    let n_rep = h / kvh;
    // The decoder's k and v (possibly a view of the KV cache's rows) are read in place.
    let (k, v) = (rows_packed(k)?, rows_packed(v)?);
    let kt = k.t()?;
    let pad = match &mask.key_start {
        Some(p) => p.clone(),
        None => Tensor::zeros(b, DType::U32, q.device())?,
    };
    let rows = match max_scores_bytes {
        Some(bytes) => {
            (bytes / (b * h * kv_len * q.dtype().size_in_bytes()).max(1)).clamp(1, q_len)
        }
        None => q_len,
    };
    let mut outs = Vec::new();
    let mut from = 0;
    while from < q_len {
        let m = rows.min(q_len - from);
        let qs = if m == q_len {
            q.clone()
        } else {
            q.narrow(2, from, m)?.contiguous()?
        };
        let qs = qs.reshape((b, kvh, n_rep * m, d))?;
        let scores = qs.matmul(&kt)?; // [b, kvh, n_rep * m, kv_len]
        let scores = if scale == 1.0 {
            scores
        } else {
            (scores * scale)?
        };
        // Query i of this chunk sits at position offset + i; without the causal cut every key
        // is at or before it.
        let offset = if mask.causal {
            kv_len - q_len + from
        } else {
            kv_len
        };
        // Per-query starts ([b, q_len]) are cut to this chunk's queries.
        let pad_chunk = if pad.rank() == 2 && m != q_len {
            pad.narrow(1, from, m)?.contiguous()?
        } else {
            pad.clone()
        };
        let probs = crate::ops::masked_softmax(&scores, &pad_chunk, kvh * n_rep * m, m, offset)?;
        outs.push(probs.matmul(&v)?.reshape((b, h, m, d))?);
        from += m;
    }
    Ok(if outs.len() == 1 {
        outs.pop().expect("one chunk")
    } else {
        Tensor::cat(&outs, 2)?
    })
}

/// `t` (`[b, heads, n, d]`) as it is when each of its `[n, d]` matrices is stored row after row
/// and the matrices one stride apart over `(b, heads)` (a batched GEMM operand as it is, the KV
/// cache's rows included), else a contiguous copy.
fn rows_packed(t: &Tensor) -> Result<Tensor> {
    let (stride, dims) = (t.stride(), t.dims());
    let d = dims[3];
    let one_batch_stride = dims[0] == 1 || dims[1] == 1 || stride[0] == dims[1] * stride[1];
    Ok(if stride[3] == 1 && stride[2] == d && one_batch_stride {
        t.clone()
    } else {
        t.contiguous()?
    })
}

/// `softmax(q kᵀ · scale + mask) v` for `q` `[b, q_len, heads, d]` and `k`, `v`
/// `[b, kv_len, kv_heads, d]` (any strides; `heads` a multiple of `kv_heads`), giving
/// `[b, q_len, heads, d]`. Statistics in f32, the probabilities rounded to the model dtype
/// before they multiply `v` (as [`reference()`]). CUDA only: check [`supported`] first.
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    mask: &Mask,
) -> Result<Tensor> {
    #[cfg(feature = "fa3")]
    if fa3::takes(q, k, v, mask) {
        return fa3::attention(q, k, v, scale, mask.causal);
    }
    run_flash(q, k, v, scale, mask, false)
}

/// FlashAttention-3's forward (the vendored candle-flash-attn-v3, wgmma and TMA on sm_90) for
/// what fleet's build of it takes: bf16, head dim 128 — or 72 to 120 (the vision tower's 72),
/// zero-padded to 128 and the output cut back, which leaves every score and output unchanged —
/// no left padding, inputs that record no gradient (it has no backward). Off by default:
/// `FLEET_FA3=1` takes head dim 128 (the text prefill), `FLEET_FA3_PADDED=1` the padded head
/// dims too (the vision tower), [`set_fa3`] both. On an H200 its GPU test passes but it is no
/// faster yet where measured (the 7B prefill at 512 tokens the same; the judge with both 4–7%
/// slower, the copies around the padded vision heads costing what the kernel saves; the judge
/// with the text prefill alone not yet measured). Its sums run in another order than fleet's
/// kernel, so the outputs agree to the dtype's rounding, not bit for bit.
#[cfg(feature = "fa3")]
mod fa3 {
    use candle_core::{DType, Tensor};

    use super::Mask;
    use crate::error::Result;

    pub(super) static ON: crate::ops::EnvSwitch = crate::ops::EnvSwitch::new("FLEET_FA3", false);
    pub(super) static PADDED: crate::ops::EnvSwitch =
        crate::ops::EnvSwitch::new("FLEET_FA3_PADDED", false);

    /// Whether [`attention`] takes these token-major inputs.
    pub(super) fn takes(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask) -> bool {
        let d = q.dims().last().copied().unwrap_or(0);
        ON.on()
            && q.dtype() == DType::BF16
            && (d == 128 || PADDED.on() && (72..128).contains(&d) && d.is_multiple_of(8))
            && mask.key_start.is_none()
            && ![q, k, v].iter().any(|t| t.track_op())
            // The kernel is built for sm_90a only.
            && super::compute_capability_major(q.device()) == Some(9)
    }

    /// `softmax(q kᵀ · scale) v`, causal as the decoder's mask (the last query sees every key).
    pub(super) fn attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
        causal: bool,
    ) -> Result<Tensor> {
        let d = q.dims().last().copied().unwrap_or(0);
        // The kernel's head dim: zeros past `d` add nothing to q·k and give zero outputs there.
        // Padded from a contiguous copy: candle pads a strided view (the vision tower's q, k, v
        // are views of its fused projection) through a transposed concatenation whose last dim
        // is not contiguous, which the kernel refuses.
        let c = |t: &Tensor| -> Result<Tensor> {
            Ok(if d < 128 {
                t.contiguous()?
                    .pad_with_zeros(candle_core::D::Minus1, 0, 128 - d)?
            } else if t.stride().last() == Some(&1) {
                t.clone()
            } else {
                t.contiguous()?
            })
        };
        let out = candle_flash_attn_v3::flash_attn(&c(q)?, &c(k)?, &c(v)?, scale, causal, false)?;
        Ok(if d < 128 {
            out.narrow(candle_core::D::Minus1, 0, d)?.contiguous()?
        } else {
            out
        })
    }
}

/// Test switch for FlashAttention-3 in [`flash_attention`] (feature `fa3`): `Some(on)` forces
/// it for every head dim it takes (128, and 72 to 120 padded), `None` leaves it to `FLEET_FA3`
/// and `FLEET_FA3_PADDED`.
#[cfg(feature = "fa3")]
pub fn set_fa3(on: Option<bool>) {
    fa3::ON.force(on);
    fa3::PADDED.force(on);
}

/// The kernel on token-major `q`, `k`, `v` (`head_major` false) or on head-major ones (read
/// through their strides), after checking that they fit; the output is token-major.
fn run_flash(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    mask: &Mask,
    head_major: bool,
) -> Result<Tensor> {
    let op = FlashAttention {
        scale,
        causal: mask.causal,
        key_start: mask.key_start.clone(),
        head_major,
    };
    let (b, _, h, d) = op.token_major(q.shape())?;
    let (kb, kv_len, kvh, kd) = op.token_major(k.shape())?;
    if op.token_major(v.shape())? != (kb, kv_len, kvh, kd)
        || kb != b
        || kd != d
        || kvh == 0
        || h % kvh != 0
    {
        return Err(ModelError::BadInput(format!(
            "flash_attention: q {:?}, k {:?}, v {:?} do not fit together",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let op: Arc<Box<dyn CustomOp3 + Send + Sync>> = Arc::new(Box::new(op));
    let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
    Ok(q.apply_op3_arc(&k, &v, op)?)
}

/// [`attend`] giving the output token-major, `[b, q_len, heads, d]`, for head-major inputs as
/// [`attend`] takes them. The kernel (where it runs and `fused` allows it) reads them through
/// their strides and writes this layout itself, so a tracked pass records no transposes, whose
/// gradients the patched backward would store as copies; the training passes take it while
/// [`flash_in_training`] (the default). Unfused: [`attend`]'s output transposed.
pub fn attend_token_major(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: &Mask,
    fused: bool,
) -> Result<Tensor> {
    if fused && supported(&q.transpose(1, 2)?) {
        return run_flash(q, k, v, scale as f32, mask, true);
    }
    Ok(attend(q, k, v, scale, mask, false, None)?.transpose(1, 2)?)
}

/// `t` as it is when its head dimension is contiguous and every stride and its offset are
/// multiples of 8 elements (the kernel reads 16-byte vectors), else a contiguous copy.
fn aligned(t: &Tensor) -> candle_core::Result<Tensor> {
    let l = t.layout();
    let stride = l.stride();
    let ok = stride[3] == 1
        && l.start_offset().is_multiple_of(8)
        && stride[..3]
            .iter()
            .zip(t.dims())
            .all(|(s, &n)| n == 1 || s.is_multiple_of(8));
    if ok {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// [`flash_attention`] in plain tensor ops (scores materialised, mask as a tensor, softmax in
/// f32, probabilities rounded to the model dtype), on any device.
pub fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32, mask: &Mask) -> Result<Tensor> {
    let (b, q_len, h, _) = q.dims4()?;
    let kv_len = k.dim(1)?;
    let dtype = q.dtype();
    let rep = |t: &Tensor| -> Result<Tensor> {
        // [b, kv_len, kvh, d] -> [b, h, kv_len, d], each kv head repeated for its query heads.
        let t = t.transpose(1, 2)?;
        let (b, kvh, n, d) = t.dims4()?;
        Ok(t.unsqueeze(2)?
            .expand((b, kvh, h / kvh, n, d))?
            .reshape((b, h, n, d))?)
    };
    let qt = q.transpose(1, 2)?.to_dtype(DType::F32)?.contiguous()?;
    let kt = rep(k)?.to_dtype(DType::F32)?.contiguous()?;
    let scores = (qt.matmul(&kt.t()?)? * scale as f64)?; // [b, h, q_len, kv_len]
                                                         // One start per query, the per-row form repeated along the row.
    let starts: Vec<u32> = match &mask.key_start {
        Some(t) if t.rank() == 2 => t.flatten_all()?.to_vec1()?,
        Some(t) => t
            .to_vec1::<u32>()?
            .into_iter()
            .flat_map(|s| std::iter::repeat_n(s, q_len))
            .collect(),
        None => vec![0; b * q_len],
    };
    let shift = kv_len - q_len;
    let mut bias = Vec::with_capacity(b * q_len * kv_len);
    for row in starts.chunks(q_len) {
        for (i, &start) in row.iter().enumerate() {
            let pos = i + shift;
            for j in 0..kv_len {
                let visible = (!mask.causal || j <= pos) && (j >= start as usize || j == pos);
                bias.push(if visible { 0f32 } else { f32::NEG_INFINITY });
            }
        }
    }
    let bias = Tensor::from_vec(bias, (b, 1, q_len, kv_len), q.device())?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&bias)?)?;
    // A row that sees no key (possible only without the self exception) has NaN: make it 0.
    let probs = probs
        .ne(&probs)?
        .where_cond(&probs.zeros_like()?, &probs)?
        .to_dtype(dtype)?;
    let out = probs.matmul(&rep(v)?.contiguous()?)?; // [b, h, q_len, d]
    Ok(out.transpose(1, 2)?.contiguous()?)
}

struct FlashAttention {
    scale: f32,
    causal: bool,
    key_start: Option<Tensor>,
    /// The inputs are head-major (`[b, heads, len, d]`, read through their strides) instead of
    /// token-major; the output is token-major either way.
    head_major: bool,
}

impl FlashAttention {
    /// `(b, len, heads, d)` of an input shape: token-major, or head-major for this op.
    fn token_major(&self, shape: &Shape) -> candle_core::Result<(usize, usize, usize, usize)> {
        let (b, x, y, d) = shape.dims4()?;
        Ok(if self.head_major {
            (b, y, x, d)
        } else {
            (b, x, y, d)
        })
    }
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "fleet-flash-attention"
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
        candle_core::bail!("fleet-flash-attention runs on CUDA only")
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
        cuda::flash_attention(self, s1, l1, s2, l2, s3, l3)
    }

    /// [`flash_backward`]: the training passes run the kernel's forward (no score buffer, no
    /// transposes) and this backward.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mask = Mask {
            causal: self.causal,
            key_start: self.key_start.clone(),
        };
        let err = |e: ModelError| candle_core::Error::Msg(e.to_string());
        let t = |x: &Tensor| x.transpose(1, 2);
        // The output (and so its gradient) is token-major either way; the inputs are
        // head-major views if so marked.
        let (tq, tk, tv) = if self.head_major {
            (t(q)?, t(k)?, t(v)?)
        } else {
            (q.clone(), k.clone(), v.clone())
        };
        let fused = flash_backward_fused(&tq, &tk, &tv, out, grad, self.scale, &mask);
        let (dq, dk, dv) = match fused.map_err(err)? {
            Some(grads) => grads,
            None => flash_backward(&tq, &tk, &tv, grad, self.scale, &mask).map_err(err)?,
        };
        // Token-major gradients, handed back as views in the inputs' layout: no copies.
        let (dq, dk, dv) = if self.head_major {
            (t(&dq)?, t(&dk)?, t(&dv)?)
        } else {
            (dq, dk, dv)
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// The gradients of `softmax(q kᵀ · scale + mask) v` ([`flash_attention`]'s function) for
/// token-major `q` `[b, q_len, heads, d]`, `k`, `v` `[b, kv_len, kv_heads, d]` and the output's
/// gradient `g` (`q`'s shape): the probabilities recomputed as the unfused path computes them
/// (the query heads of a KV head stacked along the rows, [`crate::ops::masked_softmax`]), then
/// the products that candle's autograd of that path makes — `dv = pᵀ g`, `dp = g vᵀ`,
/// `ds = softmax'(p, dp) · scale`, `dq = ds k`, `dk = dsᵀ q` — in the inputs' dtype.
/// Returns token-major `(dq, dk, dv)`. Any device (tests run it on the CPU in f32).
pub fn flash_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    scale: f32,
    mask: &Mask,
) -> Result<(Tensor, Tensor, Tensor)> {
    // A contiguous token-major input (the output's gradient) is copied by one vectorized
    // kernel; the head-major views the decoder passes are contiguous once transposed back.
    let head_major = |t: &Tensor| -> Result<Tensor> {
        let t = t.detach();
        if t.is_contiguous() {
            return crate::ops::transpose12(&t);
        }
        Ok(t.transpose(1, 2)?.contiguous()?)
    };
    let (qh, kh, vh, gh) = (
        head_major(q)?,
        head_major(k)?,
        head_major(v)?,
        head_major(g)?,
    );
    let (b, h, q_len, d) = qh.dims4()?;
    let (_, kvh, kv_len, _) = kh.dims4()?;
    if kvh == 0 || h % kvh != 0 || kv_len < q_len || gh.dims() != qh.dims() {
        return Err(ModelError::BadInput(format!(
            "flash_backward: q {:?}, k {:?}, grad {:?} do not fit together",
            q.dims(),
            k.dims(),
            g.dims()
        )));
    }
    let rows = h / kvh * q_len;
    let qs = qh.reshape((b, kvh, rows, d))?;
    let gs = gh.reshape((b, kvh, rows, d))?;
    let scores = qs.matmul(&kh.t()?)?; // [b, kvh, rows, kv_len]
    let scores = if scale == 1.0 {
        scores
    } else {
        (scores * f64::from(scale))?
    };
    let pad = match &mask.key_start {
        Some(p) => p.clone(),
        None => Tensor::zeros(b, DType::U32, q.device())?,
    };
    let offset = if mask.causal { kv_len - q_len } else { kv_len };
    let p = crate::ops::masked_softmax(&scores, &pad, kvh * rows, q_len, offset)?;
    let dv = p.t()?.matmul(&gs)?; // [b, kvh, kv_len, d]
    let dp = gs.matmul(&vh.t()?)?;
    let ds = crate::ops::masked_softmax_backward(&p, &dp)?.to_dtype(p.dtype())?;
    let ds = if scale == 1.0 {
        ds
    } else {
        (ds * f64::from(scale))?
    };
    let dq = ds.matmul(&kh)?.reshape((b, h, q_len, d))?;
    let dk = ds.t()?.matmul(&qs)?;
    Ok((
        dq.transpose(1, 2)?,
        dk.transpose(1, 2)?,
        dv.transpose(1, 2)?,
    ))
}

/// Whether [`flash_backward_fused`] runs: on by default, `FLEET_FLASH_BWD=0` for the composed
/// [`flash_backward`]. On an H200 (2026-11-28f) GSPO's update step took 0.0894 / 0.0880 s
/// against the composed one's 0.0927 / 0.0925 (Qwen2.5-0.5B) and 0.1923 / 0.1946 against
/// 0.1911 / 0.1918 (1.5B), with 160 / 96 MiB less at its peak: the probabilities and their
/// gradient are never written.
static FLASH_BWD: crate::ops::EnvSwitch = crate::ops::EnvSwitch::new("FLEET_FLASH_BWD", true);

/// [`flash_backward`] as two fused kernels, the probabilities never written to memory
/// (FlashAttention-2's backward in its deterministic form: one kernel for `dq` and each
/// query's log-sum-exp, one for `dk` and `dv` summed over the query heads of a KV head in
/// registers, no atomics), for the same token-major inputs plus the forward's output `out`
/// (for `D = rowsum(g ∘ out)`). `None` where it does not run: off a GPU, with
/// `FLEET_FLASH_BWD=0`, or for other dtypes (bf16, f16) and head dims (64, 128). Its sums
/// run in the tensor cores' order and it rounds the probabilities and `dS` to the dtype once
/// each, so it agrees with [`flash_backward`] to the dtype's rounding, not bit for bit.
pub fn flash_backward_fused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    g: &Tensor,
    scale: f32,
    mask: &Mask,
) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    let d = q.dims().last().copied().unwrap_or(0);
    if !FLASH_BWD.on()
        || !supported(q)
        || !matches!(d, 64 | 128)
        || !matches!(q.dtype(), DType::BF16 | DType::F16)
    {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
        let (out, g) = (aligned(&out.detach())?, aligned(&g.detach())?);
        Ok(Some(cuda::flash_backward(
            [&q, &k, &v, &g, &out],
            scale,
            mask,
        )?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (k, v, out, g, scale, mask);
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Shape, Storage, Tensor};
    use half::{bf16, f16};

    use super::FlashAttention;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
    const MODULE: &str = "fleet_attention";
    /// Queries per thread block: 4 warps of 16 rows, or of 32 with two row tiles a warp.
    const BLOCK_M: usize = 64;

    /// Whether a head dimension padded to `padded` takes two row tiles a warp (up to 80)
    /// unless `FLEET_FLASH_R2=0` (one, for comparison).
    fn two_row_tiles(padded: usize) -> bool {
        static ON: crate::ops::EnvSwitch = crate::ops::EnvSwitch::new("FLEET_FLASH_R2", true);
        padded <= 80 && ON.on()
    }

    /// A mask's key starts as the kernels read them, and whether there is one per query: u32
    /// `[b]` (one per row) or `[b, q_len]`, contiguous, on the GPU; `None` without them.
    /// `storage` is the tensor's `storage_and_layout`, held by the caller for the view's life;
    /// `op` names the kernel in errors.
    fn key_start_view<'a, G: std::ops::Deref<Target = Storage>>(
        t: Option<&Tensor>,
        storage: &'a Option<(G, &Layout)>,
        (b, q_len): (usize, usize),
        op: &str,
    ) -> candle_core::Result<(Option<CudaView<'a, u32>>, bool)> {
        let (Some(t), Some((st, l))) = (t, storage) else {
            return Ok((None, false));
        };
        let Storage::Cuda(cs) = &**st else {
            candle_core::bail!("{op}: key_start is not on the GPU")
        };
        let per_query = t.rank() == 2;
        let want: &[usize] = if per_query { &[b, q_len] } else { &[b] };
        if t.dtype() != DType::U32 || t.dims() != want || !t.is_contiguous() {
            candle_core::bail!("{op}: key_start must be u32 [{b}] or [{b}, {q_len}]");
        }
        let view = cs.as_cuda_slice::<u32>()?.slice(l.start_offset()..);
        Ok((Some(view), per_query))
    }

    /// Element strides over (batch, position, head) of a `[b, len, heads, d]` layout, or of a
    /// `[b, heads, len, d]` one for the op's head-major inputs.
    fn strides(op: &FlashAttention, l: &Layout) -> [i64; 3] {
        let s = l.stride();
        if op.head_major {
            [s[0] as i64, s[2] as i64, s[1] as i64]
        } else {
            [s[0] as i64, s[1] as i64, s[2] as i64]
        }
    }

    pub(super) fn flash_attention(
        op: &FlashAttention,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(
            op: &FlashAttention,
            (s1, l1): (&CudaStorage, &Layout),
            (s2, l2): (&CudaStorage, &Layout),
            (s3, l3): (&CudaStorage, &Layout),
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            let (b, q_len, h, d) = op.token_major(l1.shape())?;
            let (_, kv_len, kvh, _) = op.token_major(l2.shape())?;
            let q = s1.as_cuda_slice::<T>()?.slice(l1.start_offset()..);
            let k = s2.as_cuda_slice::<T>()?.slice(l2.start_offset()..);
            let v = s3.as_cuda_slice::<T>()?.slice(l3.start_offset()..);
            let padded = match d {
                0..=64 => 64,
                65..=80 => 80,
                _ => 128,
            };
            let dtype = match s1.dtype() {
                DType::BF16 => "bf16",
                _ => "f16",
            };
            let r2 = two_row_tiles(padded);
            let tail = if padded > 80 || r2 { "" } else { "_r1" };
            let name = format!("flash_mma_{dtype}_d{padded}{tail}");
            let block_m = if r2 { 2 * BLOCK_M } else { BLOCK_M };
            let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            let n = b * q_len * h * d;
            // SAFETY: the kernel writes every element of every query row.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n)? };
            let key_start_storage = op.key_start.as_ref().map(|t| t.storage_and_layout());
            let (key_start, per_query) = key_start_view(
                op.key_start.as_ref(),
                &key_start_storage,
                (b, q_len),
                "flash_attention",
            )?;
            let cfg = LaunchConfig {
                grid_dim: (q_len.div_ceil(block_m) as u32, h as u32, b as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut builder = func.builder();
            builder.arg(&q);
            builder.arg(&k);
            builder.arg(&v);
            builder.arg(&out);
            let null = 0u64;
            match &key_start {
                Some(ks) => builder.arg(ks),
                None => builder.arg(&null),
            };
            let dims = [h as i32, kvh as i32, q_len as i32, kv_len as i32, d as i32];
            for x in &dims {
                builder.arg(x);
            }
            let [qs, ks, vs] = [strides(op, l1), strides(op, l2), strides(op, l3)];
            for s in qs.iter().chain(&ks).chain(&vs) {
                builder.arg(s);
            }
            builder.arg(&op.scale);
            let causal = op.causal as i32;
            builder.arg(&causal);
            let per_query = per_query as i32;
            builder.arg(&per_query);
            // SAFETY: the kernel reads the q/k/v rows its strides describe (checked by the
            // layouts candle gives) and writes the [b, q_len, h, d] output.
            unsafe { builder.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        let out = match s1.dtype() {
            DType::BF16 => run::<bf16>(op, (s1, l1), (s2, l2), (s3, l3))?,
            DType::F16 => run::<f16>(op, (s1, l1), (s2, l2), (s3, l3))?,
            other => candle_core::bail!("flash_attention runs in bf16 or f16, not {other:?}"),
        };
        let (b, q_len, h, d) = op.token_major(l1.shape())?;
        Ok((out, Shape::from((b, q_len, h, d))))
    }

    /// [`super::flash_backward_fused`]'s kernels for token-major `q`, `k`, `v`, the output's
    /// gradient `g` and the forward's output `out`, each with its head dimension contiguous and
    /// strides multiples of 8 (`aligned`): `flash_bwd_rowdot` (D = rowsum(g ∘ out)), then
    /// `flash_bwd_dq` (dq and each query's log-sum-exp), then `flash_bwd_dkv`. Returns
    /// contiguous token-major `(dq, dk, dv)`.
    pub(super) fn flash_backward(
        inputs: [&Tensor; 5],
        scale: f32,
        mask: &super::Mask,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        fn run<T: CudaDType + DeviceRepr>(
            [q, k, v, g, out]: [&Tensor; 5],
            scale: f32,
            mask: &super::Mask,
        ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
            let (b, q_len, h, d) = q.dims4()?;
            let (_, kv_len, kvh, _) = k.dims4()?;
            let fits = k.dim(0)? == b && k.dim(3)? == d && kvh > 0 && h % kvh == 0;
            if !fits || v.dims() != k.dims() || g.dims() != q.dims() || out.dims() != q.dims() {
                candle_core::bail!(
                    "flash_backward: q {:?}, k {:?}, v {:?}, grad {:?}, out {:?} do not fit",
                    q.dims(),
                    k.dims(),
                    v.dims(),
                    g.dims(),
                    out.dims()
                );
            }
            let storages = [q, k, v, g, out].map(|t| t.storage_and_layout());
            let cuda = |i: usize| -> candle_core::Result<&CudaStorage> {
                match &*storages[i].0 {
                    Storage::Cuda(c) => Ok(c),
                    _ => candle_core::bail!("flash_backward: an input is not on the GPU"),
                }
            };
            let view = |i: usize| -> candle_core::Result<_> {
                Ok(cuda(i)?
                    .as_cuda_slice::<T>()?
                    .slice(storages[i].1.start_offset()..))
            };
            let (qv, kv, vv, gv, ov) = (view(0)?, view(1)?, view(2)?, view(3)?, view(4)?);
            let dev = cuda(0)?.device().clone();
            let key_start_storage = mask.key_start.as_ref().map(|t| t.storage_and_layout());
            let (key_start, per_query) = key_start_view(
                mask.key_start.as_ref(),
                &key_start_storage,
                (b, q_len),
                "flash_backward",
            )?;
            let dtype = if q.dtype() == DType::BF16 {
                "bf16"
            } else {
                "f16"
            };
            let padded = if d <= 64 { 64 } else { 128 };
            // SAFETY: flash_bwd_dq writes every element of dq and each query's lse,
            // flash_bwd_dkv every element of dk and dv.
            let dq: CudaSlice<T> = unsafe { dev.alloc::<T>(b * q_len * h * d)? };
            let lse: CudaSlice<f32> = unsafe { dev.alloc::<f32>(b * h * q_len)? };
            let dk: CudaSlice<T> = unsafe { dev.alloc::<T>(b * kv_len * kvh * d)? };
            let dv: CudaSlice<T> = unsafe { dev.alloc::<T>(b * kv_len * kvh * d)? };
            let stride = |i: usize| -> Vec<i64> {
                storages[i].1.stride()[..3]
                    .iter()
                    .map(|&s| s as i64)
                    .collect()
            };
            // D = rowsum(g ∘ out), one warp a (batch, query, head) row.
            // SAFETY: flash_bwd_rowdot writes every one of the b * q_len * h rows.
            let dvec: CudaSlice<f32> = unsafe { dev.alloc::<f32>(b * q_len * h)? };
            let rows = b * q_len * h;
            let func =
                dev.get_or_load_custom_func(&format!("flash_bwd_rowdot_{dtype}"), MODULE, PTX)?;
            let mut builder = func.builder();
            builder.arg(&gv);
            builder.arg(&ov);
            builder.arg(&dvec);
            let row_dims = [b as i32, h as i32, q_len as i32, d as i32];
            for x in &row_dims {
                builder.arg(x);
            }
            let (gs, os) = (stride(3), stride(4));
            for s in gs.iter().chain(&os) {
                builder.arg(s);
            }
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(8) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: warp r reads row r of g and out through their strides (head dims of
            // at most 128 contiguous, 16-byte aligned) and writes dvec[r].
            unsafe { builder.launch(cfg) }.w()?;
            let dims = [h as i32, kvh as i32, q_len as i32, kv_len as i32, d as i32];
            let strides: Vec<i64> = (0..4).flat_map(stride).collect();
            let (causal, per_query) = (mask.causal as i32, per_query as i32);
            let null = 0u64;
            for pass in ["dq", "dkv"] {
                let func = dev.get_or_load_custom_func(
                    &format!("flash_bwd_{pass}_{dtype}_d{padded}"),
                    MODULE,
                    PTX,
                )?;
                let mut builder = func.builder();
                builder.arg(&qv);
                builder.arg(&kv);
                builder.arg(&vv);
                builder.arg(&gv);
                builder.arg(&dvec);
                let grid = if pass == "dq" {
                    match &key_start {
                        Some(ks) => builder.arg(ks),
                        None => builder.arg(&null),
                    };
                    builder.arg(&dq);
                    builder.arg(&lse);
                    (q_len.div_ceil(BLOCK_M) as u32, h as u32, b as u32)
                } else {
                    builder.arg(&lse);
                    match &key_start {
                        Some(ks) => builder.arg(ks),
                        None => builder.arg(&null),
                    };
                    builder.arg(&dk);
                    builder.arg(&dv);
                    (kv_len.div_ceil(BLOCK_M) as u32, kvh as u32, b as u32)
                };
                for x in &dims {
                    builder.arg(x);
                }
                for s in &strides {
                    builder.arg(s);
                }
                builder.arg(&scale);
                builder.arg(&causal);
                builder.arg(&per_query);
                let cfg = LaunchConfig {
                    grid_dim: grid,
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: the kernels read the rows of q, k, v and g their strides describe
                // (head dims contiguous, 16-byte aligned: `aligned`), D and the lse of
                // [b, q_len, h] queries, key_start as checked, and write the outputs above.
                unsafe { builder.launch(cfg) }.w()?;
            }
            drop(storages);
            let wrap = |s: CudaSlice<T>, shape: (usize, usize, usize, usize)| {
                Tensor::from_storage(
                    Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
                    shape,
                    candle_core::op::BackpropOp::none(),
                    false,
                )
            };
            Ok((
                wrap(dq, (b, q_len, h, d)),
                wrap(dk, (b, kv_len, kvh, d)),
                wrap(dv, (b, kv_len, kvh, d)),
            ))
        }
        match inputs[0].dtype() {
            DType::BF16 => run::<bf16>(inputs, scale, mask),
            DType::F16 => run::<f16>(inputs, scale, mask),
            other => candle_core::bail!("flash_backward runs in bf16 or f16, not {other:?}"),
        }
    }
}

/// The reference the GPU kernel is checked against, checked itself on the CPU against attention
/// written out element by element: the mask (causal offset, left padding, a padding query's self
/// key), grouped heads and the scale.
#[cfg(test)]
mod reference_tests {
    use super::*;
    use candle_core::Device;

    /// `out[b, i, h, :]` by loops over f32 values.
    fn by_hand(
        (q, k, v): (&[f32], &[f32], &[f32]),
        (b, lq, lk, h, kvh, d): (usize, usize, usize, usize, usize, usize),
        scale: f32,
        causal: bool,
        starts: &[u32],
    ) -> Vec<f32> {
        let mut out = vec![0f32; b * lq * h * d];
        for bi in 0..b {
            for i in 0..lq {
                let pos = i + lk - lq;
                for hi in 0..h {
                    let g = hi / (h / kvh);
                    let qrow = &q[((bi * lq + i) * h + hi) * d..][..d];
                    let visible: Vec<usize> = (0..lk)
                        .filter(|&j| {
                            (!causal || j <= pos) && (j >= starts[bi] as usize || j == pos)
                        })
                        .collect();
                    let scores: Vec<f32> = visible
                        .iter()
                        .map(|&j| {
                            let krow = &k[((bi * lk + j) * kvh + g) * d..][..d];
                            qrow.iter().zip(krow).map(|(a, c)| a * c).sum::<f32>() * scale
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f32 = e.iter().sum();
                    let o = &mut out[((bi * lq + i) * h + hi) * d..][..d];
                    for (&j, w) in visible.iter().zip(&e) {
                        let vrow = &v[((bi * lk + j) * kvh + g) * d..][..d];
                        for (x, y) in o.iter_mut().zip(vrow) {
                            *x += w / sum * y;
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn reference_is_attention_with_the_decoders_mask() {
        let dev = Device::Cpu;
        for (b, lq, lk, h, kvh, d, causal, starts) in [
            (2, 7, 7, 4, 2, 8, true, vec![0u32, 3]),
            (3, 2, 9, 2, 1, 8, true, vec![4, 0, 8]),
            (1, 5, 6, 2, 2, 16, false, vec![0]),
        ] {
            let r = |n: usize, seed: u64| -> Vec<f32> {
                (0..n)
                    .map(|i| ((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0 - 1.0)
                    .collect()
            };
            let (qv, kv, vv) = (
                r(b * lq * h * d, 1),
                r(b * lk * kvh * d, 2),
                r(b * lk * kvh * d, 3),
            );
            let q = Tensor::from_vec(qv.clone(), (b, lq, h, d), &dev).unwrap();
            let k = Tensor::from_vec(kv.clone(), (b, lk, kvh, d), &dev).unwrap();
            let v = Tensor::from_vec(vv.clone(), (b, lk, kvh, d), &dev).unwrap();
            let mask = Mask {
                causal,
                key_start: Some(Tensor::new(starts.as_slice(), &dev).unwrap()),
            };
            let got: Vec<f32> = reference(&q, &k, &v, 0.3, &mask)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let dims = (b, lq, lk, h, kvh, d);
            let want = by_hand((&qv, &kv, &vv), dims, 0.3, causal, &starts);
            let diff = got
                .iter()
                .zip(&want)
                .map(|(a, c)| (a - c).abs())
                .fold(0f32, f32::max);
            assert!(
                diff < 1e-5,
                "reference differs from attention by hand by {diff}"
            );
        }
    }

    /// The flash kernel's backward (probabilities recomputed, the products by hand) is the
    /// gradient candle's autograd takes through the unfused path: grouped heads, a causal mask
    /// over a longer key range, a left-padded row, a scale.
    #[test]
    fn flash_backward_is_the_gradient_of_the_unfused_path() {
        use candle_core::Var;
        let dev = Device::Cpu;
        let (b, lq, lk, h, kvh, d) = (2, 5, 7, 4, 2, 8);
        let q = Var::randn(0f32, 1.0, (b, lq, h, d), &dev).unwrap();
        let k = Var::randn(0f32, 1.0, (b, lk, kvh, d), &dev).unwrap();
        let v = Var::randn(0f32, 1.0, (b, lk, kvh, d), &dev).unwrap();
        let g = Tensor::randn(0f32, 1.0, (b, lq, h, d), &dev).unwrap();
        // A left-padded row; then per-query starts (two sequences packed into each row).
        let per_query = Tensor::new(&[[0u32, 0, 0, 3, 3], [0, 0, 2, 2, 2]], &dev).unwrap();
        for key_start in [Tensor::new(&[0u32, 3], &dev).unwrap(), per_query] {
            let mask = Mask {
                causal: true,
                key_start: Some(key_start),
            };
            backward_matches_autograd((&q, &k, &v), &g, &mask);
        }
    }

    fn backward_matches_autograd(
        (q, k, v): (&candle_core::Var, &candle_core::Var, &candle_core::Var),
        g: &Tensor,
        mask: &Mask,
    ) {
        let head_major = |t: &candle_core::Var| t.as_tensor().transpose(1, 2).unwrap();
        let out = attend(
            &head_major(q),
            &head_major(k),
            &head_major(v),
            0.3,
            mask,
            false,
            None,
        )
        .unwrap()
        .transpose(1, 2)
        .unwrap();
        let grads = (out * g).unwrap().sum_all().unwrap().backward().unwrap();
        let (dq, dk, dv) = flash_backward(q, k, v, g, 0.3, mask).unwrap();
        for (what, got, var) in [("q", dq, q), ("k", dk, k), ("v", dv, v)] {
            let want = grads.get(var.as_tensor()).unwrap();
            assert_eq!(got.dims(), want.dims(), "d{what}");
            let diff = crate::ops::max_abs_diff(&got, want);
            assert!(diff < 1e-5, "d{what} differs from autograd by {diff}");
        }
    }

    /// Per-query starts pack sequences into one row: each sequence's outputs are what it gives
    /// alone, through [`reference`] and through the unfused path of [`attend`] (whole and in
    /// query chunks), with grouped heads — to f32 rounding (1e-5: the inputs are drawn anew
    /// each run, and the sums run in other orders; a wrong mask moves outputs by tenths).
    #[test]
    fn per_query_starts_attend_each_packed_sequence_alone() {
        let dev = Device::Cpu;
        let (h, kvh, d) = (4, 2, 8);
        // Row 0: sequences of 3, 5 and 4 tokens; row 1: 7 and 5.
        let rows: [&[usize]; 2] = [&[3, 5, 4], &[7, 5]];
        let len = 12;
        let q = Tensor::randn(0f32, 1.0, (2, len, h, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (2, len, kvh, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (2, len, kvh, d), &dev).unwrap();
        let mut starts = Vec::new();
        for lens in rows {
            let mut at = 0;
            for &n in lens {
                starts.extend(std::iter::repeat_n(at as u32, n));
                at += n;
            }
        }
        let mask = Mask {
            causal: true,
            key_start: Some(Tensor::from_vec(starts, (2, len), &dev).unwrap()),
        };
        let packed = reference(&q, &k, &v, 0.3, &mask).unwrap();
        let head_major = |t: &Tensor| t.transpose(1, 2).unwrap();
        for bytes in [None, Some(3 * h * len * 4)] {
            let unfused = attend(
                &head_major(&q),
                &head_major(&k),
                &head_major(&v),
                0.3,
                &mask,
                false,
                bytes,
            )
            .unwrap()
            .transpose(1, 2)
            .unwrap();
            let diff = crate::ops::max_abs_diff(&unfused, &packed);
            assert!(diff < 1e-5, "unfused ({bytes:?}) differs by {diff}");
        }
        let causal = Mask {
            causal: true,
            key_start: None,
        };
        for (row, lens) in rows.iter().enumerate() {
            let mut at = 0;
            for &n in *lens {
                let cut = |t: &Tensor| t.narrow(0, row, 1).unwrap().narrow(1, at, n).unwrap();
                let alone = reference(&cut(&q), &cut(&k), &cut(&v), 0.3, &causal).unwrap();
                let diff = crate::ops::max_abs_diff(&cut(&packed), &alone);
                assert!(diff < 1e-5, "row {row}, tokens {at}..{}: {diff}", at + n);
                at += n;
            }
        }
    }

    /// Off the GPU the kernel is not offered, and asking for it anyway is an error naming the
    /// way out.
    #[test]
    fn the_kernel_is_gpu_only() {
        let q = Tensor::zeros((1, 4, 2, 8), DType::F32, &Device::Cpu).unwrap();
        assert!(!supported(&q));
        let err = flash_attention(&q, &q, &q, 1.0, &Mask::default()).unwrap_err();
        assert!(err.to_string().contains("CUDA only"), "{err}");
    }
}

/// On a GPU (`cargo test --features cuda -p fleet-models flash`): the kernel against
/// [`reference`].
#[cfg(all(test, feature = "cuda"))]
mod kernel_tests {
    use super::*;

    use crate::ops::max_abs_diff;

    /// Throughput of the kernel and of candle's GEMMs at the vision tower's shapes (1024x1024
    /// images: 4,096 patches, 16 heads of 72; hidden 1152, MLP 4304), printed for the record.
    #[test]
    fn rates_at_vision_shapes() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        let dt = DType::BF16;
        let time = |f: &dyn Fn()| {
            f();
            dev.synchronize().unwrap();
            let t = std::time::Instant::now();
            for _ in 0..10 {
                f();
            }
            dev.synchronize().unwrap();
            t.elapsed().as_secs_f64() / 10.0
        };
        let r = |s: &[usize]| {
            Tensor::randn(0f32, 1.0, s, &dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap()
        };
        let (n, heads, d) = (4096, 16, 72);
        let (q, k, v) = (
            r(&[1, n, heads, d]),
            r(&[1, n, heads, d]),
            r(&[1, n, heads, d]),
        );
        let s = time(&|| {
            flash_attention(&q, &k, &v, 0.1, &Mask::default()).unwrap();
        });
        let flops = 4.0 * (n * n * heads * d) as f64;
        println!(
            "flash attention 4096x4096x16x72: {:.3} ms, {:.0} TFLOP/s",
            s * 1e3,
            flops / s / 1e12
        );
        let (q, k, v) = (
            r(&[2, 2048, 32, 128]),
            r(&[2, 2048, 8, 128]),
            r(&[2, 2048, 8, 128]),
        );
        let mask = Mask {
            causal: true,
            key_start: None,
        };
        let s = time(&|| {
            flash_attention(&q, &k, &v, 1.0, &mask).unwrap();
        });
        let flops = 4.0 * 2.0 * 2048.0 * 2048.0 * 32.0 * 128.0 / 2.0;
        println!(
            "flash attention causal 2x2048x32x128 (GQA 8): {:.3} ms, {:.0} TFLOP/s",
            s * 1e3,
            flops / s / 1e12
        );
        for (m, kk, nn) in [
            (65536, 1152, 4304),
            (65536, 4304, 1152),
            (65536, 1152, 3456),
            (16384, 4096, 12288),
        ] {
            let x = r(&[m, kk]);
            let w = r(&[nn, kk]);
            let bias = r(&[nn]);
            let lin = candle_nn::Linear::new(w.clone(), Some(bias));
            let s_mm = time(&|| {
                x.matmul(&w.t().unwrap()).unwrap();
            });
            let s_lin = time(&|| {
                candle_core::Module::forward(&lin, &x).unwrap();
            });
            let flops = 2.0 * (m * kk * nn) as f64;
            println!(
                "gemm [{m},{kk}]x[{kk},{nn}]: matmul {:.3} ms ({:.0} TFLOP/s), Linear with bias {:.3} ms ({:.0} TFLOP/s)",
                s_mm * 1e3, flops / s_mm / 1e12, s_lin * 1e3, flops / s_lin / 1e12
            );
        }
    }

    /// The fused backward (`FLEET_FLASH_BWD`) against the composed one, both in the dtype on
    /// the GPU, each measured against the composed one in f32 on the same inputs (the truth up
    /// to f32 rounding): the fused gradients may be off by at most twice the composed path's
    /// own error plus 1% of the largest gradient (both round the probabilities and dS to the
    /// dtype, in other orders). Cases: causal grouped heads with left padding, keys beyond the
    /// queries (a continuation), head dims 64 and 128, lengths off the 64-row tiles, strided
    /// inputs (v a view of a fused buffer), and per-query key starts (packed sequences).
    #[test]
    fn fused_backward_matches_the_composed_one() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        let cpu = candle_core::Device::Cpu;
        let packed = |lens: &[&[usize]]| {
            let mut starts = Vec::new();
            for row in lens {
                let mut at = 0;
                for &n in row.iter() {
                    starts.extend(std::iter::repeat_n(at as u32, n));
                    at += n;
                }
            }
            starts
        };
        #[allow(clippy::type_complexity)]
        let cases: Vec<(
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            bool,
            Option<Tensor>,
        )> = vec![
            // (b, q_len, kv_len, h, kvh, d, causal, key_start)
            (
                2,
                77,
                77,
                8,
                2,
                128,
                true,
                Some(Tensor::new(&[0u32, 13], &dev).unwrap()),
            ),
            (1, 300, 300, 4, 2, 64, true, None),
            (
                3,
                5,
                133,
                4,
                1,
                128,
                true,
                Some(Tensor::new(&[40u32, 0, 7], &dev).unwrap()),
            ),
            (1, 150, 150, 2, 2, 64, false, None),
            (
                2,
                200,
                200,
                4,
                2,
                128,
                true,
                Some(
                    Tensor::from_vec(packed(&[&[70, 130], &[150, 49, 1]]), (2, 200), &dev).unwrap(),
                ),
            ),
        ];
        // On for this test, off again however it ends.
        struct On;
        impl Drop for On {
            fn drop(&mut self) {
                FLASH_BWD.force(None);
            }
        }
        FLASH_BWD.force(Some(true));
        let _on = On;
        for (b, q_len, kv_len, h, kvh, d, causal, key_start) in cases {
            for dtype in [DType::BF16, DType::F16] {
                let r =
                    |s: (usize, usize, usize, usize)| Tensor::randn(0f32, 1.0, s, &dev).unwrap();
                let (q32, k32, g32) = (
                    r((b, q_len, h, d)),
                    r((b, kv_len, kvh, d)),
                    r((b, q_len, h, d)),
                );
                let kvv32 = r((b, kv_len, 3 * kvh, d));
                let mask = Mask {
                    causal,
                    key_start: key_start.clone(),
                };
                let scale = (d as f32).powf(-0.5);
                let low = |t: &Tensor| t.to_dtype(dtype).unwrap();
                // v as a strided view: the third of a fused [b, kv_len, 3, kvh, d] buffer.
                let v = low(&kvv32).narrow(2, 2 * kvh, kvh).unwrap();
                let (q, k, g) = (low(&q32), low(&k32), low(&g32));
                let out = flash_attention(&q, &k, &v, scale, &mask).unwrap();
                let fused = flash_backward_fused(&q, &k, &v, &out, &g, scale, &mask)
                    .unwrap()
                    .expect("the fused backward runs for these inputs");
                let composed = flash_backward(&q, &k, &v, &g, scale, &mask).unwrap();
                // The truth: the composed path in f32 on the CPU, from the same rounded inputs.
                let host = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_device(&cpu).unwrap();
                let cpu_mask = Mask {
                    causal,
                    key_start: key_start.as_ref().map(host_u32),
                };
                let truth =
                    flash_backward(&host(&q), &host(&k), &host(&v), &host(&g), scale, &cpu_mask)
                        .unwrap();
                let name = ["dq", "dk", "dv"];
                let f = [&fused.0, &fused.1, &fused.2];
                let c = [&composed.0, &composed.1, &composed.2];
                let t = [&truth.0, &truth.1, &truth.2];
                for i in 0..3 {
                    let (f, c) = (host(f[i]), host(c[i]));
                    let nan: u32 = f
                        .ne(&f)
                        .unwrap()
                        .to_dtype(DType::U32)
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar()
                        .unwrap();
                    assert_eq!(nan, 0, "{}: the fused backward gave {nan} NaN", name[i]);
                    let (ef, ec) = (max_abs_diff(&f, t[i]), max_abs_diff(&c, t[i]));
                    let top = crate::ops::max_abs(t[i]);
                    println!(
                        "b={b} q={q_len} kv={kv_len} h={h}/{kvh} d={d} causal={causal} \
                         {dtype:?} {}: max |fused - f32| = {ef}, max |composed - f32| = {ec} \
                         (max |f32| = {top})",
                        name[i]
                    );
                    assert!(
                        ef <= 2.0 * ec + 0.01 * top,
                        "{}: the fused backward is off by {ef} (composed: {ec}, max {top})",
                        name[i]
                    );
                }
            }
        }
    }

    fn host_u32(t: &Tensor) -> Tensor {
        t.to_device(&candle_core::Device::Cpu).unwrap()
    }

    /// The kernel against [`reference`] on the GPU: vision-like (head dim 72, no mask, strided
    /// v), decoder prefill (causal, left padding, grouped heads), decode-like (kv longer than q),
    /// odd lengths that leave partial tiles.
    #[test]
    fn flash_matches_reference() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        #[allow(clippy::type_complexity)]
        let cases: &[(
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            bool,
            Option<Vec<u32>>,
        )] = &[
            // (b, q_len, kv_len, h, kvh, d, causal, key_start)
            (1, 300, 300, 4, 4, 72, false, None),
            (1, 4096, 4096, 2, 2, 72, false, None),
            (2, 77, 77, 8, 2, 128, true, Some(vec![0, 13])),
            (1, 300, 300, 4, 2, 128, true, None),
            (2, 200, 200, 2, 2, 80, true, Some(vec![0, 70])),
            (3, 5, 133, 4, 1, 128, true, Some(vec![40, 0, 7])),
            (2, 64, 64, 4, 4, 64, true, None),
            (1, 33, 97, 2, 1, 16, false, None),
        ];
        for (b, q_len, kv_len, h, kvh, d, causal, starts) in cases.iter().cloned() {
            for dtype in [DType::BF16, DType::F16] {
                let r = |s: (usize, usize, usize, usize)| {
                    Tensor::randn(0f32, 1.0, s, &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                let q = r((b, q_len, h, d));
                let k = r((b, kv_len, kvh, d));
                // v as a strided view: the third of a fused [b, kv_len, 3, kvh, d] buffer.
                let kvv = r((b, kv_len, 3 * kvh, d));
                let v = kvv.narrow(2, 2 * kvh, kvh).unwrap();
                let mask = Mask {
                    causal,
                    key_start: starts
                        .as_ref()
                        .map(|s| Tensor::new(s.as_slice(), &dev).unwrap()),
                };
                let scale = (d as f32).powf(-0.5);
                let want = reference(&q, &k, &v, scale, &mask).unwrap();
                let got = flash_attention(&q, &k, &v, scale, &mask).unwrap();
                let diff = max_abs_diff(&want, &got);
                println!(
                    "b={b} q={q_len} kv={kv_len} h={h}/{kvh} d={d} causal={causal} {dtype:?}: \
                     max |flash - reference| = {diff}"
                );
                assert!(diff < 2e-2, "flash attention differs by {diff}");
            }
        }
        // Per-query starts: sequences packed into rows (lengths crossing the 64-query blocks
        // and 64-key tiles), grouped heads, causal.
        let (b, len, h, kvh) = (2, 300, 8, 2);
        let mut starts = Vec::new();
        for lens in [[70usize, 130, 100], [150, 149, 1]] {
            let mut at = 0;
            for n in lens {
                starts.extend(std::iter::repeat_n(at as u32, n));
                at += n;
            }
        }
        let key_start = Tensor::from_vec(starts, (b, len), &dev).unwrap();
        for (d, dtype) in [(128, DType::BF16), (64, DType::F16)] {
            let r = |s: (usize, usize, usize, usize)| {
                Tensor::randn(0f32, 1.0, s, &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            let (q, k, v) = (r((b, len, h, d)), r((b, len, kvh, d)), r((b, len, kvh, d)));
            let mask = Mask {
                causal: true,
                key_start: Some(key_start.clone()),
            };
            let scale = (d as f32).powf(-0.5);
            let want = reference(&q, &k, &v, scale, &mask).unwrap();
            let got = flash_attention(&q, &k, &v, scale, &mask).unwrap();
            let diff = max_abs_diff(&want, &got);
            println!("packed rows d={d} {dtype:?}: max |flash - reference| = {diff}");
            assert!(
                diff < 2e-2,
                "flash attention (per-query starts) differs by {diff}"
            );
        }
    }
}
