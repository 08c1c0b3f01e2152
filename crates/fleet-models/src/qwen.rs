//! The Qwen2 / Qwen2.5 / Qwen3 dense decoder, built block by block on the devices of a
//! [`DeviceMap`].
//!
//! Why not candle-transformers' `qwen2`: its layers are private (no per-layer placement), it
//! builds RoPE tables in the model dtype (positions above 256 lose precision in bf16), and it
//! has no left-padded batching. This decoder follows transformers' `modeling_qwen2.py` /
//! `modeling_qwen3.py` operation by operation.
//!
//! Batches are left-padded: row `r` starts with `pad[r]` padding tokens that no real token
//! attends to, and its positions count from its first real token.

use candle_core::{DType, Device, IndexOp, Module, Shape, Tensor};
use candle_nn::{Embedding, Linear};
use fleet_topology::{DeviceLocation, DeviceMap};

use crate::config::{QwenArch, QwenConfig};
use crate::device::Devices;
use crate::error::{ModelError, Result};
use crate::kv_cache::{KvCache, LayerCache};
use crate::weights::{non_finite, Init, Loader, Unread, Weights};
use crate::{attention, ops, profile};

mod moe;
mod paged;
pub use paged::DecodeGraph;
pub(crate) use paged::{paged_block_size, paged_prefill_layout, PrefillLayout};
pub mod train;

use moe::SparseMoe;

/// RMSNorm with transformers' arithmetic (f32 statistics, scale in the model dtype).
#[derive(Debug, Clone)]
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// `(x + h, norm(x + h))` in one kernel.
    fn add_forward(&self, x: &Tensor, h: &Tensor) -> Result<(Tensor, Tensor)> {
        ops::add_rms_norm(x, h, &self.weight, self.eps)
    }

    /// `(s, norm(s))` of the residual stream `s = x + pending` (`x` when nothing is pending).
    fn stream_forward(&self, x: &Tensor, pending: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        ops::residual_rms_norm(x, pending, &self.weight, self.eps)
    }

    /// `(s, proj(norm(s)))` with `proj`'s LoRA adapters, and `swiglu` after it for the MLP's
    /// gate/up projection: how a decoder layer opens its attention and its MLP. Without
    /// adapters this is [`ops::norm_linear`], one kernel on a decode step.
    fn projection(
        &self,
        x: &Tensor,
        pending: Option<&Tensor>,
        proj: &Linear,
        lora: &Adapters,
        swiglu: bool,
    ) -> Result<(Tensor, Tensor)> {
        if lora.0.is_empty() {
            return ops::norm_linear(x, pending, (&self.weight, self.eps), proj, swiglu);
        }
        let (s, h) = self.stream_forward(x, pending)?;
        let y = lora.apply(&h, ops::linear(proj, &h)?)?;
        Ok((s, if swiglu { ops::swiglu(&y)? } else { y }))
    }
}

/// From how many queries (a prefill) attention on a GPU runs through the fused kernel; decode
/// steps keep the unfused path, which reads each grouped key/value head once for all the query
/// heads that share it.
const FLASH_MIN_QUERIES: usize = 16;

impl RmsNorm {
    /// `{name}.weight` `[dim]`.
    fn load(ld: &Loader<'_>, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: ld.tensor(&format!("{name}.weight"), &[dim], Init::Ones)?,
            eps: eps as f32,
        })
    }
}

/// Concatenates projections that read the same input into one matrix, so one GEMM does the
/// work of several (q/k/v; gate/up); `first_scale` multiplies the first projection, weight and
/// bias (the attention scale folded into q), as part of the same kernel ([`ops::concat_rows`]).
fn fused(parts: Vec<(Tensor, Option<Tensor>)>, first_scale: Option<f64>) -> Result<Linear> {
    let weights: Vec<&Tensor> = parts.iter().map(|(w, _)| w).collect();
    let weight = ops::concat_rows(&weights, first_scale)?;
    let bias = if parts.iter().all(|(_, b)| b.is_some()) {
        let biases: Vec<&Tensor> = parts.iter().filter_map(|(_, b)| b.as_ref()).collect();
        Some(ops::concat_rows(&biases, first_scale)?)
    } else {
        None
    };
    Ok(Linear::new(weight, bias))
}

/// A LoRA adapter beside a frozen projection, PEFT's unmerged forward: the projection's output
/// columns `cols` gain `scale · (dropout(x) · Aᵀ) · Bᵀ`, computed in the adapter's dtype and
/// added in the output's (PEFT casts the input to the adapter's dtype and the sum back).
/// Training builds its blocks with these ([`crate::qwen::train`]); inference merges them.
struct Adapter {
    /// `A`, `[r, in]`.
    a: Tensor,
    /// `B`, `[cols.len(), r]`.
    b: Tensor,
    /// `lora_alpha / r` (or rsLoRA's), times what the layer folds into this projection.
    scale: f64,
    /// The output columns it adds to (a part of a fused projection).
    cols: std::ops::Range<usize>,
    /// `(p, key)`: dropout on the adapter's input with probability `p`, its mask drawn from
    /// `key` ([`crate::ops::dropout_mask`]: the same mask whenever the block is rebuilt with
    /// the same key, as the backward's recompute is).
    dropout: Option<(f64, u64)>,
}

/// The adapters of one (possibly fused) projection, in column order; none for a plain layer.
#[derive(Default)]
struct Adapters(Vec<Adapter>);

impl Adapters {
    /// `y` (the projection of `x`) with every adapter's term added. Two GEMMs past the
    /// adapters' own `A`: their low-rank activations side by side (`[rows, Σ r]`, each scaled)
    /// times every `B` in one `[width, Σ r]` matrix, zero where an adapter does not reach — one
    /// product adds every term at its columns, with no full-width zeros or concatenation of
    /// the terms (per-adapter terms and their concatenation made LoRA's scoring pass 2.4x
    /// full fine-tuning's on an H100).
    fn apply(&self, x: &Tensor, y: Tensor) -> Result<Tensor> {
        if self.0.is_empty() {
            return Ok(y);
        }
        let width = y.dim(candle_core::D::Minus1)?;
        // The input as rows, in the adapters' dtype (one for a model's adapters), once.
        let dtype = self.0[0].a.dtype();
        let rows = x.elem_count() / x.dim(candle_core::D::Minus1)?;
        let flat = x.to_dtype(dtype)?.reshape((rows, ()))?;
        let mut low = Vec::with_capacity(self.0.len());
        let mut b_cols = Vec::with_capacity(self.0.len());
        for ad in &self.0 {
            let xin = match ad.dropout {
                Some((p, key)) => {
                    (&flat * ops::dropout_mask(flat.shape(), p, key, dtype, x.device())?)?
                }
                None => flat.clone(),
            };
            low.push(xin.matmul(&ad.a.t()?)?.affine(ad.scale, 0.0)?);
            b_cols.push(ad.b.pad_with_zeros(0, ad.cols.start, width - ad.cols.end)?);
        }
        // (`cat` of one tensor returns it as it is.)
        let (low, b) = (Tensor::cat(&low, 1)?, Tensor::cat(&b_cols, 1)?);
        let mut dims = y.dims()[..y.rank() - 1].to_vec();
        dims.push(width);
        let delta = low.matmul(&b.t()?)?.reshape(dims)?.to_dtype(y.dtype())?;
        Ok((y + delta)?)
    }
}

struct Attention {
    /// The q, k and v projections as one matrix, without bias.
    qkv: Linear,
    /// LoRA adapters of q_proj, k_proj, v_proj (training only).
    qkv_lora: Adapters,
    /// LoRA adapters of o_proj (training only).
    o_lora: Adapters,
    /// Their bias (zeros when the checkpoint has none), added by the kernel that splits them.
    qkv_bias: Tensor,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

struct Mlp {
    gate_up: Linear,
    down: Linear,
    /// LoRA adapters of gate_proj, up_proj (training only).
    gate_up_lora: Adapters,
    /// LoRA adapters of down_proj (training only).
    down_lora: Adapters,
}

/// The feed-forward part of a layer: a dense SwiGLU MLP or a sparse mixture of experts.
enum Ffn {
    Dense(Mlp),
    Moe(SparseMoe),
}

struct DecoderLayer {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    mlp: Ffn,
    location: DeviceLocation,
}

/// cos/sin tables for every position up to `max_position_embeddings`, computed in f32 as
/// transformers does and then cast to the model dtype (transformers casts before applying),
/// in the one layout every RoPE op reads: `[cos | sin]` per position, `[n, head_dim]`.
#[derive(Clone)]
struct RopeTables {
    cs: Tensor,
    /// The `head_dim / 2` frequencies, for positions computed per call (M-RoPE).
    inv_freq: Vec<f32>,
    dtype: DType,
}

/// The RoPE rows of one forward call on one device: `[q_len, ..]` when all rows share
/// positions, `[b, q_len, ..]` otherwise.
struct RopeRows {
    cs: Tensor,
}

impl RopeTables {
    fn new(cfg: &QwenConfig, dtype: DType, dev: &Device) -> Result<Self> {
        let half = cfg.head_dim() / 2;
        let inv_freq = crate::rope::inv_freq(cfg.rope_theta(), cfg.head_dim());
        let n = cfg.max_position_embeddings;
        let (cos, sin) = crate::rope::angle_tables(n, &inv_freq);
        let cos = Tensor::from_vec(cos, (n, half), dev)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (n, half), dev)?.to_dtype(dtype)?;
        let cs = Tensor::cat(&[&cos, &sin], 1)?;
        Ok(RopeTables {
            cs,
            inv_freq,
            dtype,
        })
    }

    /// The rows of row-major `[batch, len]` positions already on the device (u32): a gather
    /// with no host data, as a captured decode step needs.
    fn rows_at(&self, positions: &Tensor, batch: usize, len: usize) -> Result<RopeRows> {
        let w = self.cs.dim(1)?;
        Ok(RopeRows {
            cs: self
                .cs
                .index_select(positions, 0)?
                .reshape((batch, len, w))?,
        })
    }

    /// The rows for the positions of one forward call.
    fn select(&self, positions: &Positions, dev: &Device) -> Result<RopeRows> {
        match positions {
            Positions::Mrope {
                axes,
                section,
                batch,
                len,
            } => {
                // transformers' interleaved M-RoPE: frequency slot j follows the height
                // position when j % 3 == 1 and j < 3 * section[1], the width position when
                // j % 3 == 2 and j < 3 * section[2], the temporal position otherwise. The
                // tables hold exactly those cos/sin values (f32 angles, cast to the model
                // dtype): gather each axis' rows and keep, per slot, the axis it follows
                // (multiplying by 1 and adding 0 is exact).
                let half = self.inv_freq.len();
                let mut masks = [
                    vec![0f32; 2 * half],
                    vec![0f32; 2 * half],
                    vec![0f32; 2 * half],
                ];
                let axis_of = |j: usize| {
                    if j % 3 == 1 && j < 3 * section[1] {
                        1
                    } else if j % 3 == 2 && j < 3 * section[2] {
                        2
                    } else {
                        0
                    }
                };
                // The mask covers the cos half and the sin half of each row alike.
                for (axis, mask) in masks.iter_mut().enumerate() {
                    for (j, m) in mask.iter_mut().enumerate() {
                        if axis_of(j % half) == axis {
                            *m = 1.0;
                        }
                    }
                }
                let n = batch * len;
                let pick = |table: &Tensor| -> Result<Tensor> {
                    let mut sum: Option<Tensor> = None;
                    for (pos, mask) in axes.iter().zip(&masks) {
                        let idx = Tensor::from_slice(&pos[..n], n, dev)?;
                        let mask =
                            Tensor::from_slice(mask, (1, 2 * half), dev)?.to_dtype(self.dtype)?;
                        let part = table.index_select(&idx, 0)?.broadcast_mul(&mask)?;
                        sum = Some(match sum {
                            None => part,
                            Some(s) => (s + part)?,
                        });
                    }
                    Ok(sum.expect("three axes").reshape((*batch, *len, 2 * half))?)
                };
                Ok(RopeRows {
                    cs: pick(&self.cs)?,
                })
            }
            Positions::Shared { start, len } => Ok(RopeRows {
                cs: self.cs.narrow(0, *start, *len)?,
            }),
            Positions::PerRow { ids, batch, len } => {
                let idx = Tensor::from_slice(ids, ids.len(), dev)?;
                self.rows_at(&idx, *batch, *len)
            }
        }
    }
}

/// RoPE positions of the tokens in one forward call.
pub(crate) enum Positions {
    /// Every row has the same positions `start..start+len` (no padding).
    Shared { start: usize, len: usize },
    /// Row-major `[batch, len]` positions.
    PerRow {
        ids: Vec<u32>,
        batch: usize,
        len: usize,
    },
    /// Multimodal RoPE: row-major `[batch, len]` temporal, height and width positions, and the
    /// config's `mrope_section`.
    Mrope {
        axes: [Vec<u32>; 3],
        section: [usize; 3],
        batch: usize,
        len: usize,
    },
}

impl Positions {
    /// The largest position of row `r` in this call.
    fn last_of_row(&self, r: usize) -> usize {
        match self {
            Positions::Shared { start, len } => start + len - 1,
            Positions::PerRow { ids, len, .. } => ids[r * len..(r + 1) * len]
                .iter()
                .copied()
                .max()
                .unwrap_or(0) as usize,
            Positions::Mrope { axes, len, .. } => axes
                .iter()
                .flat_map(|a| a[r * len..(r + 1) * len].iter().copied())
                .max()
                .unwrap_or(0) as usize,
        }
    }
}

/// Vision features added to the hidden states of image tokens after the first decoder layers
/// (Qwen3-VL's deepstack): `features[l]` `[n, hidden]` after layer `l`; `rows` (u32,
/// `[batch * len]`) says for each flattened token place which feature row goes there: 0 for
/// none, `k + 1` for row `k`.
pub(crate) struct Deepstack<'a> {
    pub(crate) rows: &'a Tensor,
    pub(crate) features: &'a [Tensor],
}

/// Adds Qwen3-VL's deepstack features after the first layers (none for a text model).
struct DeepstackHooks<'a> {
    deepstack: Option<&'a Deepstack<'a>>,
}

impl LayerHooks for DeepstackHooks<'_> {
    fn after(&mut self, i: usize, stream: &mut Stream) -> Result<()> {
        let Some(ds) = self.deepstack.filter(|ds| i < ds.features.len()) else {
            return Ok(());
        };
        // transformers adds the features to the layer's full output at the image tokens:
        // materialise x + mlp first so the roundings match.
        let (b, q_len, hidden) = stream.x.dims3()?;
        let dev = stream.x.device().clone();
        let h = stream.hidden()?;
        let feats = crate::device::transfer(&ds.features[i], &dev)?.to_dtype(h.dtype())?;
        let rows = crate::device::transfer(ds.rows, &dev)?;
        // The features at their places and zeros elsewhere, as one gather from a table whose
        // first row is zeros (candle's index_add into zeros was ~3.6 ms a layer at 8B).
        let table = Tensor::cat(&[Tensor::zeros((1, hidden), h.dtype(), &dev)?, feats], 0)?;
        let add = table.index_select(&rows, 0)?.reshape((b, q_len, hidden))?;
        *stream = Stream::new((h + add)?);
        Ok(())
    }
}

/// Where a paged call's keys and values go: straight into the layer's cache at its slots.
fn kv_write(paged: &PagedInputs, cache: &LayerCache) -> Result<ops::PagedKvWrite> {
    let (kc, vc) = cache.paged()?;
    Ok(ops::PagedKvWrite {
        k_cache: kc.clone(),
        v_cache: vc.clone(),
        slots: paged.slots.clone(),
    })
}

impl Attention {
    /// Attention from the fused q/k/v projection `qkv` (`[b, q_len, (heads + 2 kv_heads) d]`,
    /// no bias yet), through the output projection.
    fn forward(
        &self,
        qkv: &Tensor,
        inputs: &DeviceInputs,
        cache: &mut LayerCache,
    ) -> Result<Tensor> {
        let (rope, pad) = (&inputs.rope, &inputs.pad);
        let q_len = qkv.dim(1)?;
        let dev = qkv.device();
        let kv = self.paged_write(inputs, cache)?;
        let (q, kv_out) =
            profile::time(dev, "attn.rope", || self.heads(qkv, &rope.cs, kv.as_ref()))?;
        if let Some(paged) = &inputs.paged {
            return self.paged_output(&q, paged, pad, cache);
        }
        let (k, v) = kv_out.expect("without a paged write, heads returns k and v");
        let (k, v) = profile::time(dev, "attn.cache", || cache.append(&k, &v))?;

        // Prefills of many queries on a GPU: the fused kernel (no score buffer). The training
        // module's passes (a passthrough cache), with or without gradients, take the kernel and
        // its backward while `attention::flash_in_training` (the default), else all of them
        // keep the unfused path: GSPO's old log-probs (no gradient) must equal the first
        // update's (tracked) to the bit, or the ratio is not 1. Decode steps keep the unfused path,
        // which reads each grouped key/value head once for all the query heads that share
        // it. The 1/sqrt(d) scale is already folded into the queries (see
        // `DecoderLayer::load`).
        let fused = q_len >= FLASH_MIN_QUERIES
            && (attention::flash_in_training()
                || !(cache.is_passthrough() || q.track_op() || k.track_op() || v.track_op()));
        let out = profile::time(dev, "attn.core", || {
            causal_attention(&q, &k, &v, pad, fused, cache.is_passthrough())
        })?;
        profile::time(dev, "attn.o_proj", || {
            self.o_lora.apply(&out, ops::linear(&self.o_proj, &out)?)
        })
    }
}

/// Causal attention of head-major `q` (`[b, heads, q_len, d]`, the 1/sqrt(d) scale folded in)
/// over `k`, `v` whose rows are left-padded by `pad` (u32 `[b]`), the queries at the end of
/// the keys; the heads merged back: `[b, q_len, heads * d]`. An inference prefill of rows
/// none of which is padded (`pad.padded` false) hands the kernel no key start, so that
/// FlashAttention-3 (feature `fa3`), which has no left padding, can take it. `fused`: the flash kernel;
/// `training`: a pass of the training module, which (while `attention::flash_in_training`,
/// the only way it gets `fused`) takes the kernel through [`attention::attend_token_major`], so that no
/// transposes are recorded; inference keeps the token-major views the GPU tests cover.
fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pad: &RowPadding,
    fused: bool,
    training: bool,
) -> Result<Tensor> {
    let (b, h, q_len, d) = q.dims4()?;
    let mask = attention::Mask {
        causal: true,
        // Kept for the unfused path (its softmax reads the counts either way) and for training,
        // whose passes keep fleet's kernel.
        key_start: (pad.padded || !fused || training).then(|| pad.counts.clone()),
    };
    let out = if fused && training {
        attention::attend_token_major(q, k, v, 1.0, &mask, fused)?
    } else {
        attention::attend(q, k, v, 1.0, &mask, fused, None)?.transpose(1, 2)?
    };
    Ok(out.reshape((b, q_len, h * d))?)
}

impl Attention {
    /// The paged inputs of a call whose attention starts from the normalised hidden state
    /// ([`Attention::forward_decode`]): a decode step on a paged cache of Qwen2's attention (no
    /// q/k norms) without adapters, whose projection, bias, RoPE and K/V write
    /// [`ops::linear_qkv_rope_paged`] makes one kernel; `None` for every other call.
    fn projects_decode<'a>(&self, inputs: &'a DeviceInputs) -> Option<&'a PagedInputs> {
        let paged = inputs.paged.as_ref()?;
        let decode = matches!(paged.read, PagedRead::Decode { .. });
        (decode && self.q_norm.is_none() && self.qkv_lora.0.is_empty()).then_some(paged)
    }

    /// A decode step's attention from the normalised hidden state `h` (`[b, 1, hidden]`;
    /// `paged` as [`Attention::projects_decode`] gave it): the q/k/v projection, its bias,
    /// RoPE and the K/V write as [`ops::linear_qkv_rope_paged`], then the paged attention and
    /// the output projection.
    fn forward_decode(
        &self,
        h: &Tensor,
        paged: &PagedInputs,
        inputs: &DeviceInputs,
        cache: &mut LayerCache,
    ) -> Result<Tensor> {
        let kv = kv_write(paged, cache)?;
        let heads = (self.num_heads, self.num_kv_heads);
        let q = profile::time(h.device(), "attn.qkv_proj+rope", || {
            let (bias, cs) = (&self.qkv_bias, &inputs.rope.cs);
            ops::linear_qkv_rope_paged(h, &self.qkv, bias, cs, heads, self.head_dim, &kv)
        })?;
        self.paged_output(&q, paged, &inputs.pad, cache)
    }

    /// On a paged cache, where this call's keys and values go: straight into it at its slots.
    fn paged_write(
        &self,
        inputs: &DeviceInputs,
        cache: &LayerCache,
    ) -> Result<Option<ops::PagedKvWrite>> {
        inputs
            .paged
            .as_ref()
            .map(|paged| kv_write(paged, cache))
            .transpose()
    }

    /// The paged attention of `q` (its keys and values already in the cache), through the
    /// output projection.
    fn paged_output(
        &self,
        q: &Tensor,
        paged: &PagedInputs,
        pad: &RowPadding,
        cache: &LayerCache,
    ) -> Result<Tensor> {
        let out = self.paged_attention(q, paged, pad, cache)?;
        profile::time(q.device(), "attn.o_proj", || {
            self.o_lora.apply(&out, ops::linear(&self.o_proj, &out)?)
        })
    }

    /// The attention input from the fused projection, in one kernel: the bias, the split into
    /// head-major q `[b, heads, t, d]`, k and v `[b, kv_heads, t, d]`, Qwen3's per-head norms,
    /// RoPE on q and k. With `kv`, the keys and values go into the paged cache instead and
    /// `None` comes back for them.
    fn heads(
        &self,
        qkv: &Tensor,
        cs: &Tensor,
        kv: Option<&ops::PagedKvWrite>,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let bias = &self.qkv_bias;
        Ok(match (self.q_norm.as_ref().zip(self.k_norm.as_ref()), kv) {
            (Some((qn, kn)), Some(kv)) => {
                let (qw, kw) = (&qn.weight, &kn.weight);
                let q = ops::qk_norm_rope_paged(qkv, bias, cs, qw, kw, qn.eps, (h, kvh), d, kv)?;
                (q, None)
            }
            (Some((qn, kn)), None) => {
                let (qw, kw) = (&qn.weight, &kn.weight);
                let (q, k, v) = ops::qk_norm_rope(qkv, bias, cs, qw, kw, qn.eps, (h, kvh), d)?;
                (q, Some((k, v)))
            }
            (None, Some(kv)) => (ops::qkv_rope_paged(qkv, bias, cs, (h, kvh), d, kv)?, None),
            (None, None) => {
                let (q, k, v) = ops::qkv_rope(qkv, bias, cs, (h, kvh), d)?;
                (q, Some((k, v)))
            }
        })
    }

    /// Attention of head-major `q` (`[b, heads, q_len, d]`, RoPE applied) over a paged cache
    /// that already holds this call's keys and values: a decode step attends with the paged
    /// kernel (each row over its own length), a prefill of one row over its blocks gathered in
    /// order. Returns `[b, q_len, heads * d]`.
    fn paged_attention(
        &self,
        q: &Tensor,
        paged: &PagedInputs,
        pad: &RowPadding,
        cache: &LayerCache,
    ) -> Result<Tensor> {
        let (b, h, q_len, d) = q.dims4()?;
        let dev = q.device();
        let (kc, vc) = cache.paged()?;
        profile::time(dev, "attn.core", || match &paged.read {
            PagedRead::Decode {
                block_tables,
                seq_lens,
            } => {
                // The 1/sqrt(d) scale is folded into the queries (see `DecoderLayer::load`).
                // Shapes the kernel does not take (the test checkpoints' head_dim 16) read the
                // tables back and attend from plain ops.
                let attend = if ops::paged_decode_supported(d, h / kc.dim(1)?, kc.dim(2)?) {
                    ops::paged_decode_attention
                } else {
                    ops::paged_decode_attention_reference
                };
                let out = attend(&q.squeeze(2)?, kc, vc, block_tables, seq_lens, 1.0)?;
                Ok(out.reshape((b, 1, h * d))?)
            }
            PagedRead::Prefill {
                gather,
                rows,
                max_len,
            } => {
                // Every row's keys (or values) in order, left-padded to the longest: one
                // gather of cache rows (the mask's key start, `pad`, hides the padding).
                let gather = |c: &Tensor| -> Result<Tensor> {
                    let (blocks, kvh, bs, d) = c.dims4()?;
                    Ok(c.reshape((blocks * kvh * bs, d))?
                        .index_select(gather, 0)?
                        .reshape((*rows, kvh, *max_len, d))?)
                };
                let fused = q_len >= FLASH_MIN_QUERIES;
                causal_attention(q, &gather(kc)?, &gather(vc)?, pad, fused, false)
            }
        })
    }
}

impl Mlp {
    /// The down projection of the SwiGLU activations.
    fn down(&self, act: &Tensor) -> Result<Tensor> {
        profile::time(act.device(), "mlp.down", || {
            self.down_lora.apply(act, ops::linear(&self.down, act)?)
        })
    }
}

impl DecoderLayer {
    fn load(cfg: &QwenConfig, ld: &Loader<'_>, i: usize, location: DeviceLocation) -> Result<Self> {
        let p = format!("{}layers.{i}", cfg.prefix());
        let (hs, hd) = (cfg.hidden_size, cfg.head_dim());
        let (h, kvh) = (cfg.num_attention_heads, cfg.num_kv_heads());
        let q = ld.linear(&format!("{p}.self_attn.q_proj"), hs, h * hd, cfg.qkv_bias())?;
        // The attention scale 1/sqrt(head_dim) is folded into the queries once here, instead
        // of scaling every score: into q_proj for Qwen2, into q_norm for Qwen3 (whose RMSNorm
        // would undo a scale applied before it). RoPE is linear, so the order does not matter.
        let scale = 1.0 / (hd as f64).sqrt();
        let k = ld.linear(
            &format!("{p}.self_attn.k_proj"),
            hs,
            kvh * hd,
            cfg.qkv_bias(),
        )?;
        let v = ld.linear(
            &format!("{p}.self_attn.v_proj"),
            hs,
            kvh * hd,
            cfg.qkv_bias(),
        )?;
        let (ow, ob) = ld.linear(&format!("{p}.self_attn.o_proj"), h * hd, hs, cfg.o_bias())?;
        let (q_scale, q_norm, k_norm) = if cfg.arch() == QwenArch::Qwen3 {
            let mut qn = RmsNorm::load(ld, &format!("{p}.self_attn.q_norm"), hd, cfg.rms_norm_eps)?;
            qn.weight = ops::scaled(&qn.weight, scale)?;
            (
                None,
                Some(qn),
                Some(RmsNorm::load(
                    ld,
                    &format!("{p}.self_attn.k_norm"),
                    hd,
                    cfg.rms_norm_eps,
                )?),
            )
        } else {
            (Some(scale), None, None)
        };
        let mlp = if cfg.layer_is_moe(i) {
            Ffn::Moe(SparseMoe::load(
                ld,
                &format!("{p}.mlp"),
                hs,
                cfg.num_experts.unwrap_or(0),
                cfg.moe_intermediate_size.unwrap_or(0),
                cfg.num_experts_per_tok.unwrap_or(0),
            )?)
        } else {
            let im = cfg.intermediate_size;
            let gate = ld.linear(&format!("{p}.mlp.gate_proj"), hs, im, false)?;
            let up = ld.linear(&format!("{p}.mlp.up_proj"), hs, im, false)?;
            let (dw, _) = ld.linear(&format!("{p}.mlp.down_proj"), im, hs, false)?;
            Ffn::Dense(Mlp {
                gate_up: fused(vec![gate, up], None)?,
                down: Linear::new(dw, None),
                gate_up_lora: Adapters::default(),
                down_lora: Adapters::default(),
            })
        };
        let qkv = fused(vec![q, k, v], q_scale)?;
        Ok(DecoderLayer {
            input_norm: RmsNorm::load(ld, &format!("{p}.input_layernorm"), hs, cfg.rms_norm_eps)?,
            attn: Attention {
                qkv: Linear::new(qkv.weight().clone(), None),
                qkv_bias: match qkv.bias() {
                    Some(b) => b.clone(),
                    None => Tensor::zeros(
                        qkv.weight().dim(0)?,
                        qkv.weight().dtype(),
                        qkv.weight().device(),
                    )?,
                },
                o_proj: Linear::new(ow, ob),
                qkv_lora: Adapters::default(),
                o_lora: Adapters::default(),
                q_norm,
                k_norm,
                num_heads: h,
                num_kv_heads: kvh,
                head_dim: hd,
            },
            post_attn_norm: RmsNorm::load(
                ld,
                &format!("{p}.post_attention_layernorm"),
                hs,
                cfg.rms_norm_eps,
            )?,
            mlp,
            location,
        })
    }

    /// Puts a LoRA adapter (`a` `[r, in]`, `b` `[out, r]`, `scale`) beside `module` (PEFT's
    /// name: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), on its columns
    /// of the fused projection. Qwen2 folds the attention scale into q_proj, so a q adapter
    /// takes it too (as merging the adapter before the fold would).
    pub(crate) fn attach_adapter(
        &mut self,
        module: &str,
        a: Tensor,
        b: Tensor,
        scale: f64,
        dropout: Option<(f64, u64)>,
    ) -> Result<()> {
        let at = &mut self.attn;
        let (q, kv) = (at.num_heads * at.head_dim, at.num_kv_heads * at.head_dim);
        let folded = if at.q_norm.is_none() {
            1.0 / (at.head_dim as f64).sqrt()
        } else {
            1.0
        };
        let (list, cols, scale) = match (module, &mut self.mlp) {
            ("q_proj", _) => (&mut at.qkv_lora, 0..q, scale * folded),
            ("k_proj", _) => (&mut at.qkv_lora, q..q + kv, scale),
            ("v_proj", _) => (&mut at.qkv_lora, q + kv..q + 2 * kv, scale),
            ("o_proj", _) => (&mut at.o_lora, 0..at.o_proj.weight().dim(0)?, scale),
            ("gate_proj" | "up_proj", Ffn::Dense(m)) => {
                let im = m.gate_up.weight().dim(0)? / 2;
                let cols = if module == "gate_proj" {
                    0..im
                } else {
                    im..2 * im
                };
                (&mut m.gate_up_lora, cols, scale)
            }
            ("down_proj", Ffn::Dense(m)) => (&mut m.down_lora, 0..m.down.weight().dim(0)?, scale),
            _ => {
                return Err(ModelError::BadInput(format!(
                    "no LoRA adapter can sit on `{module}` of this layer (a mixture of experts \
                     takes none; the dense modules are q_proj, k_proj, v_proj, o_proj, \
                     gate_proj, up_proj, down_proj)"
                )))
            }
        };
        if b.dim(0)? != cols.len() || a.dim(0)? != b.dim(1)? {
            return Err(ModelError::BadInput(format!(
                "adapter of {module}: A {:?} and B {:?} for {} output columns",
                a.dims(),
                b.dims(),
                cols.len()
            )));
        }
        list.0.push(Adapter {
            a,
            b,
            scale,
            cols,
            dropout,
        });
        list.0.sort_by_key(|ad| ad.cols.start);
        Ok(())
    }

    /// The residual stream arrives as `x + pending` (the previous layer's MLP output is added
    /// here, fused with this layer's first norm) and leaves the same way: the return value is
    /// `(x, mlp_out)` with the hidden state `x + mlp_out`.
    fn forward(
        &self,
        x: &Tensor,
        pending: Option<&Tensor>,
        inputs: &DeviceInputs,
        cache: &mut LayerCache,
    ) -> Result<(Tensor, Tensor)> {
        let dev = x.device();
        let at = &self.attn;
        let (x, attn) = if let Some(paged) = at.projects_decode(inputs) {
            let (x, h) = profile::time(dev, "norm", || self.input_norm.stream_forward(x, pending))?;
            (x, at.forward_decode(&h, paged, inputs, cache)?)
        } else {
            let (x, qkv) = profile::time(dev, "norm+attn.qkv_proj", || {
                self.input_norm
                    .projection(x, pending, &at.qkv, &at.qkv_lora, false)
            })?;
            (x, at.forward(&qkv, inputs, cache)?)
        };
        let norm = &self.post_attn_norm;
        match &self.mlp {
            Ffn::Dense(m) => {
                let (x, act) = profile::time(dev, "norm+mlp.gate_up_act", || {
                    norm.projection(&x, Some(&attn), &m.gate_up, &m.gate_up_lora, true)
                })?;
                Ok((x, m.down(&act)?))
            }
            Ffn::Moe(m) => {
                let (x, h) = profile::time(dev, "norm", || norm.add_forward(&x, &attn))?;
                Ok((x, profile::time(dev, "moe", || m.forward(&h))?))
            }
        }
    }
}

/// The residual stream as the decoder carries it between layers: a layer's output `x` and
/// its MLP output `pending`, not yet added (the next layer adds it, fused with its first
/// norm). The hidden state is `x + pending`.
struct Stream {
    x: Tensor,
    pending: Option<Tensor>,
}

impl Stream {
    /// The stream entering the first layer: the embeddings, nothing pending.
    fn new(x: Tensor) -> Self {
        Stream { x, pending: None }
    }

    /// Both parts on `dev` (through [`crate::device::transfer`], never a bare copy).
    fn moved_to(self, dev: &Device) -> Result<Self> {
        if self.x.device().same_device(dev)
            && self
                .pending
                .as_ref()
                .is_none_or(|p| p.device().same_device(dev))
        {
            return Ok(self);
        }
        Ok(Stream {
            x: crate::device::transfer(&self.x, dev)?,
            pending: self
                .pending
                .map(|p| crate::device::transfer(&p, dev))
                .transpose()?,
        })
    }

    /// Both parts through `f` (a slice, a reshape).
    fn map(self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Stream {
            x: f(&self.x)?,
            pending: self.pending.as_ref().map(f).transpose()?,
        })
    }

    /// The hidden state `x + pending` as one tensor, rounded as the next layer rounds it.
    fn hidden(&self) -> Result<Tensor> {
        Ok(match &self.pending {
            Some(p) => (&self.x + p)?,
            None => self.x.clone(),
        })
    }
}

/// What every layer of one call reads beside the stream on one device: the RoPE rows of the
/// call's positions, the rows' left-padding counts and, for a call on a paged cache, where its
/// keys and values go and what it attends to.
pub(crate) struct DeviceInputs {
    rope: RopeRows,
    pad: RowPadding,
    paged: Option<PagedInputs>,
}

/// The rows' left-padding counts on the device, and whether any is above zero (known on the
/// host when the counts are uploaded).
pub(crate) struct RowPadding {
    /// u32 `[b]`; or `[b, len]`, each token's first visible key, for packed sequences
    /// ([`LayerInputs::packed`]).
    counts: Tensor,
    /// Some count is above zero (true where the host does not know, as in a captured step).
    padded: bool,
}

/// A paged call's slots and reads, on one device.
pub(crate) struct PagedInputs {
    /// `[tokens]` u32: the slot of each of the call's tokens, row-major.
    slots: Tensor,
    read: PagedRead,
}

/// What a paged call's queries attend to.
enum PagedRead {
    /// One query per row over the row's blocks: block tables `[b, max_blocks]` and lengths
    /// `[b]`, u32.
    Decode {
        block_tables: Tensor,
        seq_lens: Tensor,
    },
    /// Each row's queries over its tokens, left-padded to the longest, `max_len`: `gather`
    /// (`[rows * kv_heads * max_len]` u32) indexes the cache viewed as
    /// `[blocks * kv_heads * block_size, head_dim]`.
    Prefill {
        gather: Tensor,
        rows: usize,
        max_len: usize,
    },
}

/// A paged call as the host builds it (see [`PagedInputs`]).
pub(crate) struct PagedCall {
    /// The slot of each token of the call, row-major.
    pub(crate) slots: Vec<u32>,
    pub(crate) read: PagedCallRead,
    /// Check the logits for NaN/inf here (a host read); a decode step inside a burst leaves
    /// it to the burst's last step, whose logits a bad value reaches through the cache.
    pub(crate) check_logits: bool,
}

/// [`PagedRead`] on the host.
pub(crate) enum PagedCallRead {
    Decode {
        /// Row-major `[b, max_blocks]`.
        block_tables: Vec<u32>,
        max_blocks: usize,
        seq_lens: Vec<u32>,
    },
    /// The cache rows of each row's keys and values, left-padded (see [`PagedRead::Prefill`]).
    Prefill {
        gather: Vec<u32>,
        rows: usize,
        max_len: usize,
    },
}

impl PagedCall {
    fn upload(&self, dev: &Device) -> Result<PagedInputs> {
        let slots = Tensor::from_slice(&self.slots, self.slots.len(), dev)?;
        let read = match &self.read {
            PagedCallRead::Decode {
                block_tables,
                max_blocks,
                seq_lens,
            } => PagedRead::Decode {
                block_tables: Tensor::from_slice(block_tables, (seq_lens.len(), *max_blocks), dev)?,
                seq_lens: Tensor::from_slice(seq_lens, seq_lens.len(), dev)?,
            },
            PagedCallRead::Prefill {
                gather,
                rows,
                max_len,
            } => PagedRead::Prefill {
                gather: Tensor::from_slice(gather, gather.len(), dev)?,
                rows: *rows,
                max_len: *max_len,
            },
        };
        Ok(PagedInputs { slots, read })
    }
}

/// [`DeviceInputs`] for every device that holds layers, made once per call.
pub(crate) struct LayerInputs(Vec<(DeviceLocation, DeviceInputs)>);

impl LayerInputs {
    fn new(
        rope: &[(DeviceLocation, RopeTables)],
        devices: &Devices,
        positions: &Positions,
        pad: &[usize],
        paged: Option<&PagedCall>,
    ) -> Result<Self> {
        let pad: Vec<u32> = pad.iter().map(|&p| p as u32).collect();
        let padded = pad.iter().any(|&p| p > 0);
        let counts = (pad.as_slice(), Shape::from(pad.len()), padded);
        Self::upload(rope, devices, positions, counts, paged)
    }

    /// [`LayerInputs::new`] for sequences packed into `b` rows of `len` tokens: each token's
    /// position in its sequence and its first visible key (`starts`, row-major), which the
    /// attention takes as per-query key starts.
    fn packed(
        rope: &[(DeviceLocation, RopeTables)],
        devices: &Devices,
        (positions, starts): (Vec<u32>, &[u32]),
        (b, len): (usize, usize),
    ) -> Result<Self> {
        let positions = Positions::PerRow {
            ids: positions,
            batch: b,
            len,
        };
        let counts = (starts, Shape::from((b, len)), true);
        Self::upload(rope, devices, &positions, counts, None)
    }

    /// Every layer-holding device's RoPE rows, [`RowPadding`] (`counts` of `shape`, and
    /// whether any row is padded) and paged inputs.
    fn upload(
        rope: &[(DeviceLocation, RopeTables)],
        devices: &Devices,
        positions: &Positions,
        (counts, shape, padded): (&[u32], Shape, bool),
        paged: Option<&PagedCall>,
    ) -> Result<Self> {
        let mut out = Vec::with_capacity(rope.len());
        for (loc, tables) in rope {
            let dev = devices.get(*loc);
            out.push((
                *loc,
                DeviceInputs {
                    rope: tables.select(positions, dev)?,
                    pad: RowPadding {
                        counts: Tensor::from_slice(counts, shape.clone(), dev)?,
                        padded,
                    },
                    paged: paged.map(|p| p.upload(dev)).transpose()?,
                },
            ));
        }
        Ok(LayerInputs(out))
    }

    fn on(&self, loc: DeviceLocation) -> &DeviceInputs {
        self.0
            .iter()
            .find(|(l, _)| *l == loc)
            .map(|(_, inputs)| inputs)
            .expect("layer inputs are made for every device that holds layers")
    }
}

/// What a caller of [`run_layers`] does between layers.
trait LayerHooks {
    /// Before layer `i` runs, its input already on the layer's device.
    fn before(&mut self, _i: usize, _stream: &Stream) -> Result<()> {
        Ok(())
    }

    /// After layer `i` ran (Qwen3-VL adds its deepstack features here).
    fn after(&mut self, _i: usize, _stream: &mut Stream) -> Result<()> {
        Ok(())
    }
}

/// No hooks.
struct Plain;

impl LayerHooks for Plain {}

/// The one loop over decoder layers, for inference, the training forward, the backward's
/// recompute and the VL text model: layers `range` (each from `layer`: held by the inference
/// model, built from the master weights by the trainer) on their devices, the stream moved
/// between devices through `transfer`. With a `cache`, keys and values are appended to it
/// (the caller advances it); without, every layer attends within the call (a passthrough).
fn run_layers<L: std::borrow::Borrow<DecoderLayer>>(
    range: std::ops::Range<usize>,
    mut layer: impl FnMut(usize) -> Result<L>,
    devices: &Devices,
    inputs: &LayerInputs,
    mut cache: Option<&mut KvCache>,
    hooks: &mut dyn LayerHooks,
    mut stream: Stream,
) -> Result<Stream> {
    for i in range {
        let layer = layer(i)?;
        let layer = layer.borrow();
        stream = stream.moved_to(devices.get(layer.location))?;
        hooks.before(i, &stream)?;
        let layer_inputs = inputs.on(layer.location);
        let mut passthrough;
        let layer_cache = match cache.as_deref_mut() {
            Some(c) => c.layer_mut(i),
            None => {
                passthrough = LayerCache::passthrough();
                &mut passthrough
            }
        };
        let (x, mlp) = layer.forward(
            &stream.x,
            stream.pending.as_ref(),
            layer_inputs,
            layer_cache,
        )?;
        stream = Stream {
            x,
            pending: Some(mlp),
        };
        hooks.after(i, &mut stream)?;
    }
    Ok(stream)
}

/// The token embedding, `{prefix}embed_tokens.weight`.
fn load_embedding(cfg: &QwenConfig, ld: &Loader<'_>) -> Result<Embedding> {
    let (hs, vocab) = (cfg.hidden_size, cfg.vocab_size);
    let (w, _) = ld.linear(&format!("{}embed_tokens", cfg.prefix()), hs, vocab, false)?;
    Ok(Embedding::new(w, hs))
}

/// The final norm and the output projection on the head's device: the lm_head, the
/// embedding matrix when tied (`tied` gives it, asked only then; transformers ignores a saved
/// lm_head.weight in that case; copied to the head's device when that differs from the
/// embedding's), or a reward model's `score` head (a sequence classifier, without bias).
fn load_head(
    cfg: &QwenConfig,
    head: &Loader<'_>,
    tied: impl FnOnce() -> Result<Tensor>,
) -> Result<(RmsNorm, Linear)> {
    let (hs, vocab) = (cfg.hidden_size, cfg.vocab_size);
    let norm = RmsNorm::load(head, &format!("{}norm", cfg.prefix()), hs, cfg.rms_norm_eps)?;
    let w = if let Some(labels) = cfg.classifier_labels() {
        head.linear("score", hs, labels, false)?.0
    } else if cfg.tie_word_embeddings {
        crate::device::transfer(&tied()?, head.device)?
    } else {
        head.linear("lm_head", hs, vocab, false)?.0
    };
    Ok((norm, Linear::new(w, None)))
}

/// One set of RoPE tables per device that holds layers.
fn load_rope(
    cfg: &QwenConfig,
    dtype: DType,
    map: &DeviceMap,
    devices: &Devices,
) -> Result<Vec<(DeviceLocation, RopeTables)>> {
    let mut rope: Vec<(DeviceLocation, RopeTables)> = Vec::new();
    for loc in map.layers.iter() {
        if !rope.iter().any(|(l, _)| l == loc) {
            rope.push((*loc, RopeTables::new(cfg, dtype, devices.get(*loc))?));
        }
    }
    Ok(rope)
}

/// A Qwen-family causal language model whose blocks live on the devices of a [`DeviceMap`].
pub struct QwenModel {
    cfg: QwenConfig,
    dtype: DType,
    map: DeviceMap,
    devices: Devices,
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    /// One set of RoPE tables per device that holds layers.
    rope: Vec<(DeviceLocation, RopeTables)>,
}

impl QwenModel {
    /// Builds the model from `weights`, each block on the device `map` names.
    pub fn new(cfg: &QwenConfig, weights: &Weights, dtype: DType, map: &DeviceMap) -> Result<Self> {
        map.validate(cfg.num_hidden_layers)?;
        let devices = Devices::open(map, dtype)?;
        Self::on_devices(cfg, weights, dtype, map, devices)
    }

    /// [`QwenModel::new`] on devices already opened: tensors that live on them (a trainer's
    /// weights) are used where they are, never copied between two handles of one GPU.
    pub fn on_devices(
        cfg: &QwenConfig,
        weights: &Weights,
        dtype: DType,
        map: &DeviceMap,
        devices: Devices,
    ) -> Result<Self> {
        map.validate(cfg.num_hidden_layers)?;
        let loader = |loc: DeviceLocation| Loader {
            weights,
            dtype,
            device: devices.get(loc),
        };

        let embed = load_embedding(cfg, &loader(map.embed))?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, &loc) in map.layers.iter().enumerate() {
            layers.push(DecoderLayer::load(cfg, &loader(loc), i, loc)?);
        }
        let head = load_head(cfg, &loader(map.head), || Ok(embed.embeddings().clone()))?;
        let rope = load_rope(cfg, dtype, map, &devices)?;
        // Every block, whichever device it went to, was read above: a tensor still unread is
        // one the config does not account for (fewer layers, no bias, tied head...).
        weights.check_unread(
            |name| classify_unread(cfg, name),
            |names| unread_hint(cfg, names),
        )?;
        Self::from_parts(cfg, dtype, map, devices, embed, layers, head, rope)
    }

    /// A model of blocks built with this file's loaders elsewhere (a trainer's blocks of its
    /// current weights: [`crate::qwen::train::TrainableQwen::inference_model`]) and RoPE
    /// tables, for the same config, dtype and map.
    #[allow(clippy::too_many_arguments)]
    fn from_parts(
        cfg: &QwenConfig,
        dtype: DType,
        map: &DeviceMap,
        devices: Devices,
        embed: Embedding,
        layers: Vec<DecoderLayer>,
        (norm, lm_head): (RmsNorm, Linear),
        rope: Vec<(DeviceLocation, RopeTables)>,
    ) -> Result<Self> {
        map.validate(cfg.num_hidden_layers)?;
        Ok(QwenModel {
            cfg: cfg.clone(),
            dtype,
            map: map.clone(),
            devices,
            embed,
            layers,
            norm,
            lm_head,
            rope,
        })
    }

    /// The config the model was built from.
    pub fn config(&self) -> &QwenConfig {
        &self.cfg
    }

    /// The scores of a sequence classifier (a reward model, `Qwen2ForSequenceClassification`)
    /// for each sequence: the `score` head read at its last token, `[batch, num_labels]` f32.
    /// Sequences are left-padded into one batch, so each row's last column is its last token
    /// (transformers reads the last non-pad token; with right padding that is the same token).
    pub fn classify(&self, ids: &[Vec<u32>], pad_id: u32) -> Result<Tensor> {
        if self.cfg.classifier_labels().is_none() {
            return Err(ModelError::BadInput(
                "this checkpoint is a causal LM, not a sequence classifier: a reward model's \
                 config.json names a *ForSequenceClassification architecture"
                    .into(),
            ));
        }
        let len = ids.iter().map(Vec::len).max().unwrap_or(0);
        if len == 0 || ids.iter().any(Vec::is_empty) {
            return Err(ModelError::BadInput(
                "every sequence to classify needs at least one token".into(),
            ));
        }
        let pad: Vec<usize> = ids.iter().map(|r| len - r.len()).collect();
        let rows: Vec<Vec<u32>> = ids
            .iter()
            .map(|r| {
                let mut row = vec![pad_id; len - r.len()];
                row.extend_from_slice(r);
                row
            })
            .collect();
        let mut cache = self.new_cache(len)?;
        Ok(self.forward(&rows, &pad, &mut cache, true)?.squeeze(1)?)
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Where each block lives.
    pub fn device_map(&self) -> &DeviceMap {
        &self.map
    }

    /// The device of the token embedding (where input ids go).
    pub fn input_device(&self) -> &Device {
        self.devices.get(self.map.embed)
    }

    /// The device of the lm_head (where logits come out).
    pub fn output_device(&self) -> &Device {
        self.devices.get(self.map.head)
    }

    /// The opened devices.
    pub fn devices(&self) -> &Devices {
        &self.devices
    }

    /// An empty KV cache for up to `capacity` slots per row. A left-padded batch may need more
    /// slots than `max_position_embeddings` (the longest prompt plus the longest reply); what
    /// must fit the model is each row's own prompt + reply ([`QwenModel::check_length`]).
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        Ok(KvCache::new(self.layers.len(), capacity))
    }

    /// Errors when one sequence needing `positions` positions (prompt + new tokens: one per
    /// text token; an image takes fewer positions than tokens under M-RoPE) would pass the last
    /// position the model has (`max_position_embeddings`); `what` names the sequence.
    pub fn check_length(&self, positions: usize, what: &str) -> Result<()> {
        if positions > self.cfg.max_position_embeddings {
            return Err(ModelError::BadInput(format!(
                "{what}: {positions} positions (prompt + new tokens) exceed \
                 max_position_embeddings = {} of this model; shorten the prompt or lower \
                 max_new_tokens",
                self.cfg.max_position_embeddings
            )));
        }
        Ok(())
    }

    /// Runs `ids` (`[batch, q_len]`, row `r` left-padded by `pad[r]` tokens counted from the
    /// start of the cache) through the model, appending keys and values to `cache`.
    ///
    /// Returns f32 logits `[batch, q_len, vocab]`, or `[batch, 1, vocab]` for the last position
    /// only when `last_only` (generation needs no more, and the lm_head is the largest GEMM).
    pub fn forward(
        &self,
        ids: &[Vec<u32>],
        pad: &[usize],
        cache: &mut KvCache,
        last_only: bool,
    ) -> Result<Tensor> {
        self.forward_shifted(ids, pad, &[], cache, last_only)
    }

    /// [`QwenModel::forward`] with row `r`'s positions moved by `shift[r]` (empty: no shift):
    /// the decode steps after a multimodal prompt, whose images took fewer positions than
    /// tokens (Qwen3-VL's `rope_deltas`; every axis of its M-RoPE then carries the same
    /// position, which is plain RoPE).
    pub fn forward_shifted(
        &self,
        ids: &[Vec<u32>],
        pad: &[usize],
        shift: &[i64],
        cache: &mut KvCache,
        last_only: bool,
    ) -> Result<Tensor> {
        let b = ids.len();
        if b == 0 || pad.len() != b || !(shift.is_empty() || shift.len() == b) {
            return Err(ModelError::BadInput(
                "forward needs one pad count (and one shift, if any) per row and at least one row"
                    .into(),
            ));
        }
        let q_len = ids[0].len();
        if q_len == 0 || ids.iter().any(|r| r.len() != q_len) {
            return Err(ModelError::BadInput(
                "every row of a forward call must have the same, non-zero length".into(),
            ));
        }
        self.check_ids(ids)?;
        let offset = cache.len();
        let shift_of = |r: usize| shift.get(r).copied().unwrap_or(0);
        let positions = if pad.iter().all(|&p| p == 0) && (0..b).all(|r| shift_of(r) == 0) {
            Positions::Shared {
                start: offset,
                len: q_len,
            }
        } else {
            let mut ids = Vec::with_capacity(b * q_len);
            for (r, &p) in pad.iter().enumerate() {
                // Padding slots (before the row's first token) get position 0; they are masked.
                let first = offset as i64 - p as i64 + shift_of(r);
                for i in 0..q_len {
                    let real = offset + i >= p;
                    ids.push(if real {
                        (first + i as i64).max(0) as u32
                    } else {
                        0
                    });
                }
            }
            Positions::PerRow {
                ids,
                batch: b,
                len: q_len,
            }
        };
        let x = self.embed_ids(ids)?;
        self.forward_embeds(x, pad, positions, cache, last_only, None, None)
    }

    /// An error naming the first id outside the vocabulary.
    fn check_ids(&self, ids: &[Vec<u32>]) -> Result<()> {
        let vocab = self.cfg.vocab_size as u32;
        if let Some(&bad) = ids.iter().flatten().find(|&&t| t >= vocab) {
            return Err(ModelError::BadInput(format!(
                "token id {bad} is outside the vocabulary (vocab_size = {vocab}); the ids come from another tokenizer"
            )));
        }
        Ok(())
    }

    /// The layers over `x` (`[batch, q_len, hidden]`) with `inputs` made for this call, then the
    /// final norm and the head: f32 logits `[batch, q_len or 1, vocab]`. No checks and no host
    /// reads (a captured decode step runs exactly this); the cache is not advanced.
    fn decoder_and_head(
        &self,
        x: Tensor,
        inputs: &LayerInputs,
        cache: &mut KvCache,
        last_only: bool,
        deepstack: Option<&Deepstack<'_>>,
    ) -> Result<Tensor> {
        let q_len = x.dim(1)?;
        let mut hooks = DeepstackHooks { deepstack };
        let stream = run_layers(
            0..self.layers.len(),
            |i| Ok(&self.layers[i]),
            &self.devices,
            inputs,
            Some(cache),
            &mut hooks,
            Stream::new(x),
        )?;
        let head_dev = self.output_device();
        let mut stream = stream.moved_to(head_dev)?;
        if last_only {
            stream = stream.map(|t| Ok(t.i((.., q_len - 1..q_len, ..))?))?;
        }
        let Stream { x, pending } = stream;
        profile::time(head_dev, "head", || {
            let (_, x) = self.norm.stream_forward(&x, pending.as_ref())?;
            Ok(ops::linear(&self.lm_head, &x)?.to_dtype(DType::F32)?)
        })
    }

    /// The token embeddings of `ids` (`[batch, len]`, equal lengths), `[batch, len, hidden]` in
    /// the model dtype on the embedding's device.
    pub fn embed_ids(&self, ids: &[Vec<u32>]) -> Result<Tensor> {
        let b = ids.len();
        let len = ids.first().map(Vec::len).unwrap_or(0);
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        if flat.len() != b * len {
            return Err(ModelError::BadInput(
                "every row must have the same length".into(),
            ));
        }
        let input = Tensor::from_vec(flat, (b, len), self.input_device())?;
        Ok(self.embed.forward(&input)?)
    }

    /// The decoder on input embeddings `x` (`[batch, q_len, hidden]`) at `positions`, rows
    /// left-padded by `pad` slots of the cache; `deepstack` features are added after the first
    /// layers. On a paged cache, `paged` says where the keys and values go and what the
    /// queries attend to (the cache's own length is not used). See [`QwenModel::forward`] for
    /// the logits.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_embeds(
        &self,
        x: Tensor,
        pad: &[usize],
        positions: Positions,
        cache: &mut KvCache,
        last_only: bool,
        deepstack: Option<&Deepstack<'_>>,
        paged: Option<&PagedCall>,
    ) -> Result<Tensor> {
        let (b, q_len, _) = x.dims3()?;
        if pad.len() != b {
            return Err(ModelError::BadInput(
                "forward needs one pad count per row".into(),
            ));
        }
        if paged.is_some() != cache.is_paged() {
            return Err(ModelError::BadInput(
                "a paged call runs on a paged KV cache, any other call on a contiguous one".into(),
            ));
        }
        let offset = cache.len();
        if paged.is_none() && offset + q_len > cache.capacity() {
            return Err(ModelError::BadInput(format!(
                "the KV cache holds {} tokens per row; {} more do not fit",
                cache.capacity(),
                q_len
            )));
        }
        // The RoPE tables hold positions 0..max_position_embeddings.
        let max_pos = self.cfg.max_position_embeddings;
        for (r, &p) in pad.iter().enumerate() {
            let last = positions.last_of_row(r);
            if last >= max_pos {
                return Err(ModelError::BadInput(format!(
                    "row {r} needs {} positions ({offset} already in the cache + {q_len} in this \
                     call, less {p} of left padding), more than max_position_embeddings = \
                     {max_pos} of this model (config.json); a sequence holds at most {max_pos} \
                     tokens: shorten the input",
                    last + 1
                )));
            }
        }
        let inputs = LayerInputs::new(&self.rope, &self.devices, &positions, pad, paged)?;
        let logits = self.decoder_and_head(x, &inputs, cache, last_only, deepstack)?;
        if paged.is_none() {
            cache.advance(q_len);
        }
        if paged.is_some_and(|p| !p.check_logits) {
            return Ok(logits);
        }
        self.check_logits(&logits, |first| {
            let (_, len, vocab) = logits.dims3()?;
            let row = first / (len * vocab);
            let i = if last_only {
                q_len - 1
            } else {
                (first / vocab) % len
            };
            let position = (offset + i).saturating_sub(pad[row]);
            Ok(format!(
                "the logits of row {row} at position {position} (token {} of this call)",
                i + 1
            ))
        })?;
        Ok(logits)
    }

    /// NaN logits would print as null and sample garbage: an error for them, naming where
    /// (`what` describes the logit at the first bad flat index) and the likely cause.
    pub(crate) fn check_logits(
        &self,
        logits: &Tensor,
        what: impl FnOnce(usize) -> Result<String>,
    ) -> Result<()> {
        let Some(bad) = non_finite(logits)? else {
            return Ok(());
        };
        let hint = if self.dtype == DType::F16 {
            "the activations overflow f16 (Qwen models exceed its range of 65504 where bf16 \
             and f32 do not): load the model in bf16 or f32"
        } else {
            "the weights hold NaN/infinite values or values so large that the activations \
             overflow: check the checkpoint (a corrupt download or a diverged training run)"
        };
        Err(ModelError::NonFinite {
            what: what(bad.first)?,
            value: format!(
                "{} of {} values, the first {}",
                bad.count,
                logits.elem_count(),
                bad.value
            ),
            hint: hint.into(),
        })
    }

    /// Logits `[batch, len, vocab]` (f32) of equal-length sequences, with no cache kept.
    pub fn logits(&self, ids: &[Vec<u32>]) -> Result<Tensor> {
        let len = ids.first().map(|r| r.len()).unwrap_or(0);
        let mut cache = self.new_cache(len)?;
        self.forward(ids, &vec![0; ids.len()], &mut cache, false)
    }
}

/// What to make of a checkpoint tensor the model did not read, as transformers' loading does.
fn classify_unread(cfg: &QwenConfig, name: &str) -> Unread {
    if name.contains("rotary_emb.inv_freq") {
        // Saved by old transformers versions; transformers drops them (its RoPE buffers are
        // recomputed from config.json), and so does fleet.
        Unread::Warn("RoPE frequencies are computed from config.json's rope_theta, not read")
    } else if name == "lm_head.weight" && cfg.tie_word_embeddings {
        Unread::Warn(
            "config.json has tie_word_embeddings = true, so the lm_head is the embedding matrix \
             and a saved lm_head is ignored, as transformers ignores it; if the checkpoint's \
             head differs from its embedding, set tie_word_embeddings to false",
        )
    } else {
        Unread::Refuse
    }
}

/// The likely cause of unread tensors, from the names (which config.json field to fix).
fn unread_hint(cfg: &QwenConfig, names: &[String]) -> String {
    let layers = format!("{}layers.", cfg.prefix());
    let layer_of = |n: &str| -> Option<usize> {
        n.strip_prefix(layers.as_str())?
            .split('.')
            .next()?
            .parse()
            .ok()
    };
    if let Some(last) = names.iter().filter_map(|n| layer_of(n)).max() {
        if last >= cfg.num_hidden_layers {
            return format!(
                "the checkpoint holds {} layers (up to {layers}{last}) but config.json has \
                 num_hidden_layers = {}: config.json does not match the weights; use the \
                 config.json saved with them",
                last + 1,
                cfg.num_hidden_layers
            );
        }
    }
    if names.iter().any(|n| n.contains("_norm.")) && cfg.arch() == QwenArch::Qwen2 {
        return "the checkpoint has per-head q_norm/k_norm (a Qwen3 model) but config.json's \
                model_type is qwen2: config.json does not match the weights"
            .into();
    }
    if names.iter().any(|n| n.ends_with(".bias")) {
        return "the checkpoint has biases that config.json does not declare (attention_bias, or \
                model_type qwen2 vs qwen3): config.json does not match the weights"
            .into();
    }
    "config.json does not match the weights (num_hidden_layers, tie_word_embeddings, \
     attention_bias, model_type), or the checkpoint is not a Qwen2/Qwen3 causal LM: use the \
     config.json saved with these weights"
        .into()
}
