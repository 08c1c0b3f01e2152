//! The Qwen3-VL vision encoder (transformers' `Qwen3VLVisionModel`).
//!
//! Patches (`[n, 3 * 2 * 16 * 16]` from [`crate::vision::preprocess()`], in 2x2 merge-block
//! order) go through a linear patch embedding (the Conv3d as one GEMM), a learned position
//! table interpolated bilinearly to each image's grid, `depth` pre-norm blocks with 2-D rotary
//! attention inside each image, and the merger (LayerNorm, 2x2 shuffle, fc, exact GELU, fc).
//! Blocks named by `deepstack_visual_indexes` also feed their own mergers (LayerNorm after the
//! shuffle), whose outputs the text decoder adds after its first layers.
//!
//! Facts and line references: `docs/reference/qwen3-vl-verified.md` section 1.

use candle_core::{DType, Device, Tensor};
use candle_nn::Linear;

use crate::error::{ModelError, Result};
use crate::weights::{Init, Loader, Weights, INIT_STD};
use crate::{attention, ops, profile};

pub use fleet_config::VisionConfig;

/// A linear layer with bias (every linear layer of the vision tower has one).
fn load_linear(ld: &Loader<'_>, name: &str, in_dim: usize, out_dim: usize) -> Result<Linear> {
    let (w, b) = ld.linear(name, in_dim, out_dim, true)?;
    Ok(Linear::new(w, b))
}

/// LayerNorm with bias, eps 1e-6 (statistics in f32; [`ops::LayerNorm`]).
const LN_EPS: f32 = 1e-6;

/// `{name}.weight` and `{name}.bias`, `[dim]` each.
fn load_layer_norm(ld: &Loader<'_>, name: &str, dim: usize) -> Result<ops::LayerNorm> {
    ops::LayerNorm::new(
        &ld.tensor(&format!("{name}.weight"), &[dim], Init::Ones)?,
        &ld.tensor(&format!("{name}.bias"), &[dim], Init::Zeros)?,
        LN_EPS,
    )
}

/// The activation of the block MLPs.
#[derive(Clone, Copy)]
enum Act {
    GeluTanh,
    GeluErf,
}

impl Act {
    fn forward(self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Act::GeluTanh => x.gelu()?,
            Act::GeluErf => x.gelu_erf()?,
        })
    }
}

struct Block {
    norm1: ops::LayerNorm,
    norm2: ops::LayerNorm,
    qkv: Linear,
    proj: Linear,
    fc1: Linear,
    fc2: Linear,
}

/// LayerNorm -> 2x2 shuffle -> fc -> exact GELU -> fc. `post_shuffle` puts the LayerNorm
/// after the shuffle (the deepstack mergers).
struct Merger {
    norm: ops::LayerNorm,
    fc1: Linear,
    fc2: Linear,
    post_shuffle: bool,
    unit: usize,
}

impl Merger {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n, h) = x.dims2()?;
        let wide = h * self.unit;
        let x = if self.post_shuffle {
            self.norm.forward(&x.reshape((n / self.unit, wide))?)?
        } else {
            self.norm.forward(x)?.reshape((n / self.unit, wide))?
        };
        let x = ops::linear_bias_epilogue(&self.fc1, &x)?.gelu_erf()?;
        ops::linear_bias_epilogue(&self.fc2, &x)
    }
}

/// What the encoder returns for a set of images.
pub struct VisionOutput {
    /// The merged tokens of all images in order, `[n_tokens, out_hidden_size]`.
    pub features: Tensor,
    /// One `[n_tokens, out_hidden_size]` tensor per deepstack merger.
    pub deepstack: Vec<Tensor>,
}

/// The vision tower of a Qwen3-VL checkpoint.
pub struct VisionEncoder {
    cfg: VisionConfig,
    dtype: DType,
    device: Device,
    /// The Conv3d patch embedding as a `[hidden, patch_dim]` matrix with bias.
    patch_embed: Linear,
    /// `[num_position_embeddings, hidden]`.
    pos_table: Tensor,
    blocks: Vec<Block>,
    merger: Merger,
    /// `(block index, merger)` in `deepstack_visual_indexes` order.
    deepstack: Vec<(usize, Merger)>,
    act: Act,
    /// The rotary frequencies of one axis, `head_dim / 4` of them.
    inv_freq: Vec<f32>,
    /// Largest attention-score buffer ([`SCORES_BYTES`]; smaller in tests).
    scores_bytes: usize,
}

impl VisionEncoder {
    /// Reads `model.visual.*` onto `device`.
    pub fn new(
        cfg: &VisionConfig,
        weights: &Weights,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let ld = Loader {
            weights,
            dtype,
            device,
        };
        let (h, p) = (cfg.hidden_size, "model.visual");
        let conv = ld.tensor(
            &format!("{p}.patch_embed.proj.weight"),
            &[
                h,
                cfg.in_channels,
                cfg.temporal_patch_size,
                cfg.patch_size,
                cfg.patch_size,
            ],
            Init::Normal(INIT_STD),
        )?;
        // A kernel as large as its stride over a patch is a linear map of the patch's values in
        // (channel, frame, row, column) order: the preprocessing's order.
        let patch_embed = Linear::new(
            conv.reshape((h, cfg.patch_dim()))?,
            Some(ld.tensor(&format!("{p}.patch_embed.proj.bias"), &[h], Init::Zeros)?),
        );
        let pos_table = ld.tensor(
            &format!("{p}.pos_embed.weight"),
            &[cfg.num_position_embeddings, h],
            Init::Normal(INIT_STD),
        )?;
        let mut blocks = Vec::with_capacity(cfg.depth);
        for i in 0..cfg.depth {
            let b = format!("{p}.blocks.{i}");
            blocks.push(Block {
                norm1: load_layer_norm(&ld, &format!("{b}.norm1"), h)?,
                norm2: load_layer_norm(&ld, &format!("{b}.norm2"), h)?,
                qkv: load_linear(&ld, &format!("{b}.attn.qkv"), h, 3 * h)?,
                proj: load_linear(&ld, &format!("{b}.attn.proj"), h, h)?,
                fc1: load_linear(
                    &ld,
                    &format!("{b}.mlp.linear_fc1"),
                    h,
                    cfg.intermediate_size,
                )?,
                fc2: load_linear(
                    &ld,
                    &format!("{b}.mlp.linear_fc2"),
                    cfg.intermediate_size,
                    h,
                )?,
            });
        }
        let unit = cfg.spatial_merge_size * cfg.spatial_merge_size;
        let wide = h * unit;
        let merger = |name: &str, post_shuffle: bool| -> Result<Merger> {
            Ok(Merger {
                norm: load_layer_norm(
                    &ld,
                    &format!("{name}.norm"),
                    if post_shuffle { wide } else { h },
                )?,
                fc1: load_linear(&ld, &format!("{name}.linear_fc1"), wide, wide)?,
                fc2: load_linear(
                    &ld,
                    &format!("{name}.linear_fc2"),
                    wide,
                    cfg.out_hidden_size,
                )?,
                post_shuffle,
                unit,
            })
        };
        let main = merger(&format!("{p}.merger"), false)?;
        let mut deepstack = Vec::new();
        for (k, &i) in cfg.deepstack_visual_indexes.iter().enumerate() {
            deepstack.push((i, merger(&format!("{p}.deepstack_merger_list.{k}"), true)?));
        }
        // Each of the two axes rotates half of a head.
        let inv_freq = crate::rope::inv_freq(cfg.rope_theta(), cfg.head_dim() / 2);
        Ok(VisionEncoder {
            cfg: cfg.clone(),
            dtype,
            device: device.clone(),
            patch_embed,
            pos_table,
            blocks,
            merger: main,
            deepstack,
            act: if cfg.hidden_act == "gelu" {
                Act::GeluErf
            } else {
                Act::GeluTanh
            },
            inv_freq,
            scores_bytes: SCORES_BYTES,
        })
    }

    /// The device the encoder runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dtype the encoder computes in (pixel values are cast to it first).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Encodes images: `pixel_values` `[n_patches, patch_dim]` (f32, or already cast to the
    /// encoder's dtype; any device) and each image's `[t, h, w]` patch grid, in order.
    pub fn forward(&self, pixel_values: &Tensor, grids: &[[usize; 3]]) -> Result<VisionOutput> {
        let cfg = &self.cfg;
        let (n, dim) = pixel_values.dims2()?;
        let m = cfg.spatial_merge_size;
        let expected: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
        if dim != cfg.patch_dim() || n != expected {
            return Err(ModelError::BadInput(format!(
                "pixel_values is [{n}, {dim}] but the grids {grids:?} and vision_config need \
                 [{expected}, {}]: preprocess the images with this checkpoint's \
                 preprocessor_config.json",
                cfg.patch_dim()
            )));
        }
        if let Some(g) = grids
            .iter()
            .find(|g| g[1] % m != 0 || g[2] % m != 0 || g[0] == 0)
        {
            return Err(ModelError::BadInput(format!(
                "image grid {g:?} is not a whole number of {m}x{m} merge blocks"
            )));
        }
        let dev = &self.device;
        let x = pixel_values.to_device(dev)?.to_dtype(self.dtype)?;
        let x = profile::time(dev, "vision.patch_embed", || {
            let pos = self.position_embeddings(grids)?;
            Ok((ops::linear_bias_epilogue(&self.patch_embed, &x)? + pos)?)
        })?;
        let rope = self.rotary(grids)?;
        let mut x = x;
        // The last block's MLP output, not yet added to `x`: the next block's first norm adds
        // it in the same pass.
        let mut pending: Option<Tensor> = None;
        let mut deepstack = Vec::with_capacity(self.deepstack.len());
        for (i, block) in self.blocks.iter().enumerate() {
            let (after_attn, mlp) = self.block(block, &x, pending.as_ref(), grids, &rope)?;
            x = after_attn;
            pending = Some(mlp);
            let mut mergers = self.deepstack.iter().filter(|(at, _)| *at == i).peekable();
            if mergers.peek().is_some() {
                if let Some(mlp) = pending.take() {
                    x = (x + mlp)?;
                }
                for (_, merger) in mergers {
                    deepstack.push(profile::time(dev, "vision.merger", || merger.forward(&x))?);
                }
            }
        }
        if let Some(mlp) = pending {
            x = (x + mlp)?;
        }
        let features = profile::time(dev, "vision.merger", || self.merger.forward(&x))?;
        Ok(VisionOutput {
            features,
            deepstack,
        })
    }

    /// The learned position table bilinearly interpolated (align-corners) to each grid, in
    /// merge-block order: per patch four taps and weights, products and sum in f32, cast to
    /// the model dtype (transformers 5's `fast_pos_embed_interpolate`).
    fn position_embeddings(&self, grids: &[[usize; 3]]) -> Result<Tensor> {
        let side = self.cfg.grid_per_side();
        let m = self.cfg.spatial_merge_size;
        let n: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
        let mut idx: [Vec<u32>; 4] = Default::default();
        let mut wts: [Vec<f32>; 4] = Default::default();
        // Per axis: source coordinate idx * (S - 1) / (n - 1), taps floor and floor + 1
        // (clamped), weights from the unclamped taps.
        let taps = |i: usize, len: usize| -> ([usize; 2], [f32; 2]) {
            let scale = (side - 1) as f32 / (len.max(2) - 1) as f32;
            let src = if len == 1 { 0.0 } else { i as f32 * scale };
            let f = src.floor();
            let w0 = (1.0 - (src - f).abs()).max(0.0);
            let w1 = (1.0 - (src - (f + 1.0)).abs()).max(0.0);
            let f = f as usize;
            ([f.min(side - 1), (f + 1).min(side - 1)], [w0, w1])
        };
        for (row, col, [_, h, w]) in merge_block_order(grids, m) {
            let (rt, rw) = taps(row, h);
            let (ct, cw) = taps(col, w);
            let mut k = 0;
            for a in 0..2 {
                for b in 0..2 {
                    idx[k].push((rt[a] * side + ct[b]) as u32);
                    wts[k].push(rw[a] * cw[b]);
                    k += 1;
                }
            }
        }
        let dev = &self.device;
        let table = self.pos_table.to_dtype(DType::F32)?;
        let mut sum: Option<Tensor> = None;
        for k in 0..4 {
            let rows = table.index_select(&Tensor::from_slice(&idx[k], n, dev)?, 0)?;
            let w = Tensor::from_slice(&wts[k], (n, 1), dev)?;
            let term = rows.broadcast_mul(&w)?;
            sum = Some(match sum {
                None => term,
                Some(s) => (s + term)?,
            });
        }
        Ok(sum.expect("four taps").to_dtype(self.dtype)?)
    }

    /// The RoPE tables of every patch, cos then sin (`[n, head_dim]`, f32, as transformers
    /// computes them): the first half of each's angles follow the patch's row, the second its
    /// column (the rotate-half kernel repeats them for the second half of the head); and the
    /// zero bias that the split + RoPE kernel adds (the projection's bias is added by the
    /// linear layer, rounded, as transformers adds it). A table of `index * inv_freq` for every
    /// row/column index in use is made once on the host and gathered on the device.
    fn rotary(&self, grids: &[[usize; 3]]) -> Result<VisionRope> {
        let m = self.cfg.spatial_merge_size;
        let n: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
        let side = grids.iter().map(|g| g[1].max(g[2])).max().unwrap_or(0);
        let q = self.inv_freq.len();
        let (cos_t, sin_t) = crate::rope::angle_tables(side, &self.inv_freq);
        let (mut rows, mut cols) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (row, col, _) in merge_block_order(grids, m) {
            rows.push(row as u32);
            cols.push(col as u32);
        }
        let dev = &self.device;
        let rows = Tensor::from_vec(rows, n, dev)?;
        let cols = Tensor::from_vec(cols, n, dev)?;
        let gather = |table: Vec<f32>| -> Result<[Tensor; 2]> {
            let table = Tensor::from_vec(table, (side, q), dev)?;
            Ok([table.index_select(&rows, 0)?, table.index_select(&cols, 0)?])
        };
        let ([cr, cc], [sr, sc]) = (gather(cos_t)?, gather(sin_t)?);
        let width = 3 * self.cfg.num_heads * self.cfg.head_dim();
        Ok(VisionRope {
            cs: Tensor::cat(&[cr, cc, sr, sc], 1)?,
            zero_bias: Tensor::zeros(width, self.dtype, dev)?,
        })
    }

    /// One block on `x + pending` (the previous block's MLP output, when not yet added):
    /// returns the residual stream after the attention and the MLP's output, which the caller
    /// (or the next block's first norm) adds. Each residual add runs in the norm after it.
    fn block(
        &self,
        block: &Block,
        x: &Tensor,
        pending: Option<&Tensor>,
        grids: &[[usize; 3]],
        rope: &VisionRope,
    ) -> Result<(Tensor, Tensor)> {
        let dev = x.device();
        let (x, h) = profile::time(dev, "vision.norm", || match pending {
            Some(mlp) => block.norm1.forward_add(x, mlp),
            None => Ok((x.clone(), block.norm1.forward(x)?)),
        })?;
        let attn = self.attention(block, &h, grids, rope)?;
        let attn = profile::time(dev, "vision.proj", || {
            ops::linear_bias_epilogue(&block.proj, &attn)
        })?;
        let (x, h) = block.norm2.forward_add(&x, &attn)?;
        let mlp = profile::time(dev, "vision.mlp", || {
            let act = match self.act {
                // The tanh GELU rides in the first projection's epilogue.
                Act::GeluTanh => ops::linear_gelu_tanh(&block.fc1, &h)?,
                Act::GeluErf => self
                    .act
                    .forward(&ops::linear_bias_epilogue(&block.fc1, &h)?)?,
            };
            ops::linear_bias_epilogue(&block.fc2, &act)
        })?;
        Ok((x, mlp))
    }

    /// Full (non-causal) attention within each image (each frame of `t` is its own segment).
    fn attention(
        &self,
        block: &Block,
        x: &Tensor,
        grids: &[[usize; 3]],
        rope: &VisionRope,
    ) -> Result<Tensor> {
        let (n, hidden) = x.dims2()?;
        let heads = self.cfg.num_heads;
        let hd = self.cfg.head_dim();
        let dev = x.device();
        let qkv = profile::time(dev, "vision.qkv", || {
            ops::linear_bias_epilogue(&block.qkv, x)
        })?;
        // The split into head-major q, k, v `[1, heads, n, hd]` with RoPE on q and k in one
        // kernel: in f32 from the rounded projection, rounded once, as transformers'
        // apply_rotary_pos_emb_vision (f32 tables; the bias is zero here, added above).
        let (q, k, v) = profile::time(dev, "vision.rope", || {
            ops::qkv_rope(
                &qkv.reshape((1, n, 3 * heads * hd))?,
                &rope.zero_bias,
                &rope.cs,
                (heads, heads),
                hd,
            )
        })?;
        let scale = (hd as f64).powf(-0.5);
        // Each image (each frame of `t`) is its own segment. Segments of one length (a batch of
        // images of one size, the common case) go as one call: `[segments, heads, len, hd]`
        // views of q, k and v (no copy), the kernel's batch over them, its token-major output
        // already the patches' order. Otherwise one call a segment, `[1, heads, len, hd]` views.
        // Either way the fused kernel where it runs, else queries in chunks within
        // `scores_bytes`.
        let lens: Vec<usize> = grids
            .iter()
            .flat_map(|&[t, gh, gw]| std::iter::repeat_n(gh * gw, t))
            .collect();
        if lens.len() > 1 && lens.iter().all(|&l| l == lens[0]) {
            let (segments, len) = (lens.len(), lens[0]);
            return profile::time(dev, "vision.core", || {
                let per_segment = |z: &Tensor| -> Result<Tensor> {
                    Ok(z.squeeze(0)?
                        .reshape((heads, segments, len, hd))?
                        .transpose(0, 1)?)
                };
                let o = attention::attend(
                    &per_segment(&q)?,
                    &per_segment(&k)?,
                    &per_segment(&v)?,
                    scale,
                    &attention::Mask::default(),
                    true,
                    Some(self.scores_bytes),
                )?;
                Ok(o.transpose(1, 2)?.reshape((n, hidden))?)
            });
        }
        let out = profile::time(dev, "vision.core", || {
            let mut outs = Vec::new();
            let mut start = 0;
            for &[t, gh, gw] in grids {
                let len = gh * gw;
                for _ in 0..t {
                    let seg = |z: &Tensor| z.narrow(2, start, len);
                    let o = attention::attend(
                        &seg(&q)?,
                        &seg(&k)?,
                        &seg(&v)?,
                        scale,
                        &attention::Mask::default(),
                        true,
                        Some(self.scores_bytes),
                    )?;
                    outs.push(o.squeeze(0)?.transpose(0, 1)?);
                    start += len;
                }
            }
            let out = if outs.len() == 1 {
                outs.pop().expect("one segment")
            } else {
                Tensor::cat(&outs, 0)?
            };
            Ok(out.reshape((n, hidden))?)
        })?;
        Ok(out)
    }
}

/// The vision tower's RoPE inputs for one forward ([`VisionEncoder::rotary`]).
struct VisionRope {
    /// `[n, head_dim]` f32: cos then sin of every patch.
    cs: Tensor,
    /// `[3 * heads * head_dim]` zeros in the model dtype.
    zero_bias: Tensor,
}

/// Every patch's (row, column) and its image's grid, in the order the patches come: per image
/// and frame, `m x m` merge blocks row-major, and inside a block row-major.
fn merge_block_order(
    grids: &[[usize; 3]],
    m: usize,
) -> impl Iterator<Item = (usize, usize, [usize; 3])> + '_ {
    grids.iter().flat_map(move |&g| {
        let [t, h, w] = g;
        (0..t).flat_map(move |_| {
            (0..h / m).flat_map(move |br| {
                (0..w / m).flat_map(move |bc| {
                    (0..m * m).map(move |i| (br * m + i / m, bc * m + i % m, g))
                })
            })
        })
    })
}

/// Largest attention-score buffer of one step of the vision attention.
const SCORES_BYTES: usize = 64 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    /// A two-block tower of random weights (`seed`), in f32 on the CPU.
    fn tiny_encoder(seed: u64) -> (VisionConfig, VisionEncoder) {
        let cfg: VisionConfig = serde_json::from_value(serde_json::json!({
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
            "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "out_hidden_size": 48, "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0]
        }))
        .unwrap();
        let weights = Weights::Random { seed };
        let enc = VisionEncoder::new(&cfg, &weights, DType::F32, &Device::Cpu).unwrap();
        (cfg, enc)
    }

    /// Queries in chunks (down to one row at a time) give the attention of the whole image.
    #[test]
    fn chunked_attention_equals_whole() {
        let (cfg, mut enc) = tiny_encoder(3);
        let dev = Device::Cpu;
        let grids = [[1, 4, 6], [1, 2, 2]];
        let n = 24 + 4;
        let pv = Tensor::randn(0f32, 1.0, (n, cfg.patch_dim()), &dev).unwrap();
        let whole = enc.forward(&pv, &grids).unwrap();
        enc.scores_bytes = 1;
        let chunked = enc.forward(&pv, &grids).unwrap();
        let diff = crate::ops::max_abs_diff;
        assert!(diff(&whole.features, &chunked.features) < 1e-5);
        assert!(diff(&whole.deepstack[0], &chunked.deepstack[0]) < 1e-5);
    }

    /// Images of one size attend in one batched call: the same features and deepstack
    /// features as each image encoded alone (one call a segment), whole and in query chunks.
    #[test]
    fn images_of_one_size_batched_equal_each_alone() {
        let (cfg, mut enc) = tiny_encoder(5);
        let dev = Device::Cpu;
        let grid = [1, 4, 4];
        let pv = Tensor::randn(0f32, 1.0, (3 * 16, cfg.patch_dim()), &dev).unwrap();
        for bytes in [SCORES_BYTES, 1] {
            enc.scores_bytes = bytes;
            let batched = enc.forward(&pv, &[grid; 3]).unwrap();
            let alone: Vec<VisionOutput> = (0..3)
                .map(|i| {
                    enc.forward(&pv.narrow(0, 16 * i, 16).unwrap(), &[grid])
                        .unwrap()
                })
                .collect();
            let cat = |f: &dyn Fn(&VisionOutput) -> Tensor| {
                Tensor::cat(&alone.iter().map(f).collect::<Vec<_>>(), 0).unwrap()
            };
            let diff = crate::ops::max_abs_diff;
            let features = cat(&|o| o.features.clone());
            let deepstack = cat(&|o| o.deepstack[0].clone());
            assert!(diff(&batched.features, &features) < 1e-5, "bytes {bytes}");
            assert!(
                diff(&batched.deepstack[0], &deepstack) < 1e-5,
                "bytes {bytes}"
            );
        }
    }
}
