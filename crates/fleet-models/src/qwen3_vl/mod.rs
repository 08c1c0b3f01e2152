//! Qwen3-VL (dense and MoE): the vision encoder ([`vision`]) in front of the Qwen3 decoder of
//! [`crate::qwen`], which it shares with the text models.
//!
//! What the multimodal model adds to the decoder, each a small hook rather than a second copy:
//! - the embeddings of `<|image_pad|>` tokens are replaced by the encoder's merged tokens;
//! - positions are three per token (temporal, height, width; [`rope_index`]) and RoPE
//!   interleaves their frequencies (`mrope_section`); after the prompt every axis carries the
//!   same position, shifted by the row's `rope_delta`, which is plain RoPE;
//! - the deepstack features are added at the image tokens after the first decoder layers;
//! - MoE layers (`Qwen3-VL-30B-A3B`) are the decoder's sparse MLP kind.
//!
//! The image processor is [`crate::vision`]. Facts: `docs/reference/qwen3-vl-verified.md`.

mod checkpoint;
pub mod vision;

use candle_core::{DType, Tensor};
use fleet_topology::DeviceMap;

use crate::device::Devices;
use crate::error::{ModelError, Result};
use crate::generation::{
    GenerationOutput, GenerationRequest, Generator, PagedOptions, PagedStats, StreamEvent,
};
use crate::kv_blocks::SequenceBlocks;
use crate::kv_cache::KvCache;
use crate::qwen::{Deepstack, Positions, QwenModel};
use crate::tokenizer::TextTokenizer;
use crate::vision::PreprocessedImages;
use crate::weights::Weights;

pub use checkpoint::{PromptLength, VisionLanguageModel, VlProcessor};
pub use fleet_config::Qwen3VlConfig;
pub use vision::{VisionConfig, VisionEncoder, VisionOutput};

/// One prompt for the model: token ids with each image's `<|image_pad|>` already expanded to
/// its token count, the preprocessed images in the order they appear, and its M-RoPE
/// positions when they were counted where the prompt was built.
#[derive(Debug, Clone)]
pub struct VlPrompt {
    /// Token ids.
    pub ids: Vec<u32>,
    /// The images (`None` for a text-only prompt).
    pub images: Option<PreprocessedImages>,
    /// The prompt's positions ([`rope_index`] of `ids` and the images' grids), as
    /// [`VlProcessor`] counts them while building it (once: the prefill uses these); `None`
    /// for a prompt assembled by hand, whose positions the prefill counts.
    pub positions: Option<MropePositions>,
}

impl VlPrompt {
    fn grids(&self) -> &[[usize; 3]] {
        self.images
            .as_ref()
            .map_or(&[][..], |i| i.image_grid_thw.as_slice())
    }
}

/// What [`Qwen3VlModel::prompt_inputs`] builds for the decoder.
struct PromptInputs {
    /// `[b, len, hidden]` embeddings, image features in place.
    x: Tensor,
    /// Row-major `[b, len]` temporal, height and width positions.
    axes: [Vec<u32>; 3],
    /// Each row's `rope_delta`.
    deltas: Vec<i64>,
    /// Deepstack features, one tensor per layer they are added after.
    stack: Vec<Tensor>,
    /// The deepstack gather map over the `[b * len]` flattened places ([`feature_rows`]), when
    /// there are images.
    rows: Option<Tensor>,
    /// The image tokens' flattened places, in order, on the host.
    image_slots: Vec<u32>,
}

/// The map that puts feature row `k` at flattened place `slots[k]` of `places` places, for an
/// `index_select` from a table whose row 0 is zeros and row `k + 1` is feature `k`: entry `r`
/// is 0 where no feature goes. A gather of every row runs at the bandwidth, where candle's
/// `index_add` of the features (one launch per deepstack layer) took ~3.6 ms each at 8B
/// (ncu, 2026-11-28); zeros plus a feature is the feature, so the sums are the same bits.
fn feature_rows(slots: &[u32], places: usize) -> Vec<u32> {
    let mut rows = vec![0u32; places];
    for (k, &s) in slots.iter().enumerate() {
        rows[s as usize] = k as u32 + 1;
    }
    rows
}

/// The M-RoPE positions of one prompt ([`rope_index`]): three per token, and the shift of the
/// positions of the tokens generated after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MropePositions {
    /// Temporal, height and width positions, one per token each.
    pub axes: [Vec<u32>; 3],
    /// `rope_delta`: (largest position + 1) - tokens.
    pub rope_delta: i64,
}

impl MropePositions {
    /// The positions of `ids` whose images have `grids` (`[t, h, w]` in patches, in order),
    /// with the vision merge size and the image and video token ids of `cfg`.
    pub fn count(ids: &[u32], grids: &[[usize; 3]], cfg: &Qwen3VlConfig) -> Result<Self> {
        let (axes, rope_delta) = rope_index(
            ids,
            grids,
            cfg.vision.spatial_merge_size,
            cfg.image_token_id,
            cfg.video_token_id,
        )?;
        Ok(MropePositions { axes, rope_delta })
    }

    /// Positions the prompt takes: its largest position + 1.
    pub fn span(&self) -> usize {
        (self.axes[0].len() as i64 + self.rope_delta).max(0) as usize
    }
}

/// M-RoPE positions of one prompt (transformers' `get_rope_index` for still images): text
/// tokens count up on all three axes; an image's tokens, row-major over its merged grid, get
/// `(base, base + row, base + col)` with `base` the next text position; the text after it
/// resumes at `base + max(t, rows, cols)`. Returns the three axes and `rope_delta` = (largest
/// position + 1) - tokens, which shifts the positions of generated tokens.
pub fn rope_index(
    ids: &[u32],
    grids: &[[usize; 3]],
    merge: usize,
    image_token: u32,
    video_token: u32,
) -> Result<([Vec<u32>; 3], i64)> {
    let mut axes: [Vec<u32>; 3] = Default::default();
    for a in axes.iter_mut() {
        a.reserve(ids.len());
    }
    let mut next: u32 = 0;
    let mut image = 0;
    let mut i = 0;
    while i < ids.len() {
        if ids[i] == video_token {
            return Err(ModelError::BadInput(format!(
                "token {i} is <|video_pad|> ({video_token}): video input is not implemented"
            )));
        }
        if ids[i] != image_token {
            for a in axes.iter_mut() {
                a.push(next);
            }
            next += 1;
            i += 1;
            continue;
        }
        let g = grids.get(image).ok_or_else(|| {
            ModelError::BadInput(format!(
                "the prompt has more image runs of <|image_pad|> than the {} images given",
                grids.len()
            ))
        })?;
        let (t, rows, cols) = (g[0], g[1] / merge, g[2] / merge);
        let count = t * rows * cols;
        let run = ids[i..].iter().take_while(|&&t| t == image_token).count();
        if run < count {
            return Err(ModelError::BadInput(format!(
                "image {image} (grid {g:?}) needs {count} <|image_pad|> tokens but the prompt \
                 has {run} at token {i}: expand each image's pad token to its count (rows/2 x \
                 cols/2 of its patch grid)"
            )));
        }
        for tt in 0..t {
            for r in 0..rows {
                for c in 0..cols {
                    axes[0].push(next + tt as u32);
                    axes[1].push(next + r as u32);
                    axes[2].push(next + c as u32);
                }
            }
        }
        next += t.max(rows).max(cols) as u32;
        i += count;
        image += 1;
    }
    if image != grids.len() {
        return Err(ModelError::BadInput(format!(
            "{} images were given but the prompt holds pad tokens for {image}",
            grids.len()
        )));
    }
    Ok((axes, next as i64 - ids.len() as i64))
}

/// A Qwen3-VL model: the vision encoder on the embedding's device and the decoder on the
/// devices of its [`DeviceMap`].
pub struct Qwen3VlModel {
    cfg: Qwen3VlConfig,
    vision: VisionEncoder,
    text: QwenModel,
    /// The pixel values' uploads to the encoder's device.
    uploads: crate::upload::Uploads,
}

impl Qwen3VlModel {
    /// Builds the model from `weights`: the encoder on the device of the embedding, each
    /// decoder block where `map` puts it. Tensors the config does not account for are refused.
    pub fn new(
        cfg: &Qwen3VlConfig,
        weights: &Weights,
        dtype: DType,
        map: &DeviceMap,
    ) -> Result<Self> {
        map.validate(cfg.text.num_hidden_layers)?;
        let devices = Devices::open(map, dtype)?;
        let vision = VisionEncoder::new(&cfg.vision, weights, dtype, devices.get(map.embed))?;
        let text = QwenModel::on_devices(&cfg.text, weights, dtype, map, devices)?;
        Ok(Qwen3VlModel {
            cfg: cfg.clone(),
            vision,
            text,
            uploads: crate::upload::Uploads::new(),
        })
    }

    /// The config.
    pub fn config(&self) -> &Qwen3VlConfig {
        &self.cfg
    }

    /// The text decoder.
    pub fn text(&self) -> &QwenModel {
        &self.text
    }

    /// The vision encoder.
    pub fn vision(&self) -> &VisionEncoder {
        &self.vision
    }

    /// Encodes preprocessed images (merged tokens and deepstack features).
    pub fn encode_images(&self, images: &PreprocessedImages) -> Result<VisionOutput> {
        let pv = images.pixel_values_tensor(self.vision.device())?;
        self.vision.forward(&pv, &images.image_grid_thw)
    }

    /// M-RoPE positions and `rope_delta` of one prompt ([`rope_index`]), counted now.
    pub fn rope_index(&self, prompt: &VlPrompt) -> Result<([Vec<u32>; 3], i64)> {
        let p = MropePositions::count(&prompt.ids, prompt.grids(), &self.cfg)?;
        Ok((p.axes, p.rope_delta))
    }

    /// Runs the left-padded prompts (`ids[r]` is `prompts[r].ids` after `pad[r]` pad tokens)
    /// into `cache`. Returns f32 logits (`[b, len, vocab]`, or the last position only) and each
    /// row's `rope_delta` for the decode steps.
    pub fn prefill(
        &self,
        prompts: &[&VlPrompt],
        ids: &[Vec<u32>],
        pad: &[usize],
        cache: &mut KvCache,
        last_only: bool,
    ) -> Result<(Tensor, Vec<i64>)> {
        if !cache.is_empty() {
            return Err(ModelError::BadInput(
                "a multimodal prompt must be the first call on its cache".into(),
            ));
        }
        let inputs = self.prompt_inputs(prompts, ids, pad)?;
        let (b, len) = (prompts.len(), ids[0].len());
        let deepstack = inputs.rows.as_ref().map(|rows| Deepstack {
            rows,
            features: &inputs.stack,
        });
        let logits = self.text.forward_embeds(
            inputs.x,
            pad,
            self.mrope(inputs.axes, b, len),
            cache,
            last_only,
            deepstack.as_ref(),
            None,
        )?;
        Ok((logits, inputs.deltas))
    }

    /// The prompts' tokens after the `seqs[r].cached` already in a paged cache, run into their
    /// slots of `cache` in one pass (the layout of [`QwenModel::prefill_paged_batch`]: each
    /// row the last `window` tokens of its left-padded prompt). Their images, which all lie
    /// after the cached tokens (only the tokens before a prompt's first image are shared), go
    /// through the vision tower together. Returns each row's last f32 logits `[rows, 1, vocab]`
    /// and each prompt's `rope_delta`.
    pub fn prefill_paged_batch(
        &self,
        prompts: &[&VlPrompt],
        seqs: &[&SequenceBlocks],
        cache: &mut KvCache,
    ) -> Result<(Tensor, Vec<i64>)> {
        if prompts.len() != seqs.len() {
            return Err(ModelError::BadInput(format!(
                "a paged prefill of {} prompts got {} sequences",
                prompts.len(),
                seqs.len()
            )));
        }
        for (p, seq) in prompts.iter().zip(seqs) {
            if seq.tokens != p.ids || seq.cached >= seq.len() {
                return Err(ModelError::BadInput(format!(
                    "a paged prefill of a prompt of {} tokens got a sequence of {} with {} \
                     cached",
                    p.ids.len(),
                    seq.len(),
                    seq.cached
                )));
            }
            if p.ids[..seq.cached].contains(&self.cfg.image_token_id) {
                return Err(ModelError::BadInput(
                    "a paged prompt's image tokens must lie after its cached prefix".into(),
                ));
            }
        }
        let bs = crate::qwen::paged_block_size(cache)?;
        let crate::qwen::PrefillLayout {
            window, pad, call, ..
        } = crate::qwen::paged_prefill_layout(seqs, bs, self.text.config().num_kv_heads());
        // The prompts left-padded to the longest, whose last `window` places are the call.
        let max_len = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        let ids: Vec<Vec<u32>> = prompts
            .iter()
            .zip(&pad)
            .map(|(p, &n)| {
                let mut row = vec![p.ids[0]; n];
                row.extend_from_slice(&p.ids);
                row
            })
            .collect();
        // `vl.inputs` holds the vision tower's stages; `vl.text` the decoder's layers.
        let dev = self.text.input_device();
        let inputs =
            crate::profile::time(dev, "vl.inputs", || self.prompt_inputs(prompts, &ids, &pad))?;
        let skip = max_len - window;
        let x = inputs.x.narrow(1, skip, window)?;
        let axes = inputs.axes.map(|a| {
            a.chunks(max_len)
                .flat_map(|row| row[skip..].iter().copied())
                .collect::<Vec<u32>>()
        });
        // The image tokens' places within the window (all inside it: they are uncached).
        let rows = match &inputs.rows {
            Some(full) => {
                let moved: Vec<u32> = inputs
                    .image_slots
                    .iter()
                    .map(|&p| {
                        let (r, j) = (p as usize / max_len, p as usize % max_len);
                        (r * window + j - skip) as u32
                    })
                    .collect();
                let places = prompts.len() * window;
                Some(Tensor::from_vec(
                    feature_rows(&moved, places),
                    places,
                    full.device(),
                )?)
            }
            None => None,
        };
        let deepstack = rows.as_ref().map(|rows| Deepstack {
            rows,
            features: &inputs.stack,
        });
        let logits = crate::profile::time(dev, "vl.text", || {
            self.text.forward_embeds(
                x,
                &pad,
                self.mrope(axes, seqs.len(), window),
                cache,
                true,
                deepstack.as_ref(),
                Some(&call),
            )
        })?;
        Ok((logits, inputs.deltas))
    }

    /// The M-RoPE positions of a `[b, len]` call.
    fn mrope(&self, axes: [Vec<u32>; 3], batch: usize, len: usize) -> Positions {
        let section = self.cfg.text.mrope_section().expect("validated at load");
        Positions::Mrope {
            axes,
            section: [section[0], section[1], section[2]],
            batch,
            len,
        }
    }

    /// The decoder's inputs for left-padded prompts: the embeddings with each image's features
    /// in place of its tokens, the M-RoPE positions (pad slots 0), each row's `rope_delta`,
    /// and the deepstack features with the flattened places of the image tokens.
    fn prompt_inputs(
        &self,
        prompts: &[&VlPrompt],
        ids: &[Vec<u32>],
        pad: &[usize],
    ) -> Result<PromptInputs> {
        let b = prompts.len();
        if b == 0 || ids.len() != b || pad.len() != b {
            return Err(ModelError::BadInput(
                "prefill needs one padded row and one pad count per prompt".into(),
            ));
        }
        let len = ids[0].len();
        for (r, p) in prompts.iter().enumerate() {
            if ids[r].len() != len || ids[r][pad[r]..] != p.ids[..] {
                return Err(ModelError::BadInput(format!(
                    "row {r} is not its prompt's ids after {} pad tokens",
                    pad[r]
                )));
            }
        }
        let vocab = self.cfg.text.vocab_size as u32;
        if let Some(&bad) = ids.iter().flatten().find(|&&t| t >= vocab) {
            return Err(ModelError::BadInput(format!(
                "token id {bad} is outside the vocabulary (vocab_size = {vocab}); the ids come \
                 from another tokenizer"
            )));
        }
        // Positions: pad slots 0 (masked), each prompt's own from its first token.
        let mut axes: [Vec<u32>; 3] = Default::default();
        let mut deltas = Vec::with_capacity(b);
        for (r, p) in prompts.iter().enumerate() {
            // Counted where the prompt was built, or now for a prompt made by hand.
            let counted;
            let positions = match &p.positions {
                Some(positions) => positions,
                None => {
                    counted = MropePositions::count(&p.ids, p.grids(), &self.cfg)?;
                    &counted
                }
            };
            if positions.axes.iter().any(|a| a.len() != p.ids.len()) {
                return Err(ModelError::BadInput(format!(
                    "row {r}'s positions are for {} tokens but its prompt has {}",
                    positions.axes[0].len(),
                    p.ids.len()
                )));
            }
            for (a, row) in axes.iter_mut().zip(&positions.axes) {
                a.extend(std::iter::repeat_n(0, pad[r]));
                a.extend_from_slice(row);
            }
            deltas.push(positions.rope_delta);
        }

        let mut x = crate::profile::time(self.text.input_device(), "vl.embed", || {
            self.text.embed_ids(ids)
        })?;
        // The image tokens' flattened positions, in order: where the features go.
        let image_slots: Vec<u32> = ids
            .iter()
            .enumerate()
            .flat_map(|(r, row)| {
                row.iter()
                    .enumerate()
                    .skip(pad[r])
                    .filter(|(_, &t)| t == self.cfg.image_token_id)
                    .map(move |(j, _)| (r * len + j) as u32)
            })
            .collect();
        let mut stack = Vec::new();
        let mut rows = None;
        if !image_slots.is_empty() {
            let (pv, grids) = crate::profile::time(self.vision.device(), "vision.pixels", || {
                self.batch_images(prompts)
            })?;
            let out = self.vision.forward(&pv, &grids)?;
            let n = out.features.dim(0)?;
            if n != image_slots.len() {
                return Err(ModelError::BadInput(format!(
                    "the prompts hold {} <|image_pad|> tokens but their images give {n}",
                    image_slots.len()
                )));
            }
            let dev = x.device().clone();
            let hidden = x.dim(2)?;
            let places = b * len;
            let map = feature_rows(&image_slots, places);
            // The features in the image tokens' places, the embeddings elsewhere: one gather
            // from the embeddings followed by the features (transformers' masked_scatter, an
            // exact replacement).
            let src: Vec<u32> = map
                .iter()
                .enumerate()
                .map(|(r, &k)| {
                    if k == 0 {
                        r as u32
                    } else {
                        (places as u32) + k - 1
                    }
                })
                .collect();
            x = crate::profile::time(&dev, "vl.scatter", || {
                let src = Tensor::from_vec(src, places, &dev)?;
                let feats = crate::device::transfer(&out.features, &dev)?.to_dtype(x.dtype())?;
                let table = Tensor::cat(&[x.reshape((places, hidden))?, feats], 0)?;
                Ok(crate::ops::gather_rows(&table, &src)?.reshape((b, len, hidden))?)
            })?;
            stack = out.deepstack;
            rows = Some(Tensor::from_vec(map, places, &dev)?);
        }
        Ok(PromptInputs {
            x,
            axes,
            deltas,
            stack,
            rows,
            image_slots,
        })
    }

    /// All prompts' images as one `pixel_values` tensor on the encoder's device, already in
    /// its dtype, and their grids, in row order. The cast to bf16/f16 runs on the host, in
    /// parallel, as each row is copied into the one buffer: the same rounding as the cast on
    /// the device, half the bytes to upload, and no serial copy of the f32 values (at 1024 px a
    /// prompt pass of three judge prompts uploads ~150 MB of f32 pixels).
    fn batch_images(&self, prompts: &[&VlPrompt]) -> Result<(Tensor, Vec<[usize; 3]>)> {
        let dim = self.cfg.vision.patch_dim();
        let mut parts: Vec<&[f32]> = Vec::new();
        let mut grids = Vec::new();
        let mut rows = 0;
        for p in prompts {
            if let Some(img) = &p.images {
                if img.patch_dim != dim {
                    return Err(ModelError::BadInput(format!(
                        "images were preprocessed into {}-value patches but this checkpoint's \
                         encoder takes {dim}: use its preprocessor_config.json",
                        img.patch_dim
                    )));
                }
                parts.push(&img.pixel_values);
                grids.extend_from_slice(&img.image_grid_thw);
                rows += img.num_patches;
            }
        }
        let pixels = self.uploads.cast_concat(
            &parts,
            self.vision.dtype(),
            (rows, dim),
            self.vision.device(),
        )?;
        Ok((pixels, grids))
    }

    /// f32 logits `[len, vocab]` of every position of one prompt (no cache kept).
    pub fn logits(&self, prompt: &VlPrompt) -> Result<Tensor> {
        let mut cache = self.text.new_cache(prompt.ids.len())?;
        let (logits, _) = self.prefill(
            &[prompt],
            std::slice::from_ref(&prompt.ids),
            &[0],
            &mut cache,
            false,
        )?;
        Ok(logits.squeeze(0)?)
    }

    /// Generates continuations of `prompts` as one left-padded batch; `requests[r]` says how
    /// (its `prompt_ids` must be `prompts[r].ids`).
    pub fn generate(
        &self,
        tokenizer: Option<&TextTokenizer>,
        eos_ids: Vec<u32>,
        pad_id: u32,
        prompts: &[VlPrompt],
        requests: &[GenerationRequest],
        on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
    ) -> Result<Vec<GenerationOutput>> {
        check_requests(prompts, requests)?;
        let generator = Generator::new(&self.text, tokenizer, eos_ids, pad_id);
        let refs: Vec<&VlPrompt> = prompts.iter().collect();
        generator.generate_with(requests, on_token, &mut |ids, pad, cache| {
            self.prefill(&refs, ids, pad, cache, true)
        })
    }

    /// [`Qwen3VlModel::generate`] with continuous batching on a paged KV cache
    /// ([`Generator::generate_paged`]): up to `options.max_batch` replies decode together, a
    /// finished one's place goes at once to the next prompt, whose prefill (vision tower
    /// included) runs between two decode steps of the others. Only the tokens before a
    /// prompt's first image share blocks (every image's tokens carry the same id), so a
    /// common instruction there is computed once. Same tokens as the left-padded batch.
    #[allow(clippy::too_many_arguments)]
    pub fn generate_paged(
        &self,
        tokenizer: Option<&TextTokenizer>,
        eos_ids: Vec<u32>,
        pad_id: u32,
        prompts: &[VlPrompt],
        requests: &[GenerationRequest],
        options: &PagedOptions,
        on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
    ) -> Result<(Vec<GenerationOutput>, PagedStats)> {
        check_requests(prompts, requests)?;
        let generator = Generator::new(&self.text, tokenizer, eos_ids, pad_id);
        let mut session = generator.paged_session(options)?;
        let shareable: Vec<usize> = prompts
            .iter()
            .map(|p| {
                p.ids
                    .iter()
                    .position(|&t| t == self.cfg.image_token_id)
                    .unwrap_or(usize::MAX)
            })
            .collect();
        generator.generate_in_with(
            &mut session,
            requests,
            &shareable,
            on_token,
            &mut |rows, cache| {
                let batch: Vec<&VlPrompt> = rows.iter().map(|&(i, _)| &prompts[i]).collect();
                let seqs: Vec<&SequenceBlocks> = rows.iter().map(|&(_, s)| s).collect();
                self.prefill_paged_batch(&batch, &seqs, cache)
            },
        )
    }
}

/// One request per prompt, each holding its prompt's ids.
fn check_requests(prompts: &[VlPrompt], requests: &[GenerationRequest]) -> Result<()> {
    if prompts.len() != requests.len() {
        return Err(ModelError::BadInput(format!(
            "{} prompts but {} requests",
            prompts.len(),
            requests.len()
        )));
    }
    if let Some(r) = (0..prompts.len()).find(|&r| prompts[r].ids != requests[r].prompt_ids) {
        return Err(ModelError::BadInput(format!(
            "request {r}'s prompt_ids are not its prompt's ids"
        )));
    }
    Ok(())
}

/// Replaces each image's single `<|image_pad|>` in `ids` (as the chat template renders it) by
/// `counts[k]` copies, as transformers' processor expands the prompt.
pub fn expand_image_pads(ids: &[u32], image_token: u32, counts: &[usize]) -> Result<Vec<u32>> {
    let found = ids.iter().filter(|&&t| t == image_token).count();
    if found != counts.len() {
        return Err(ModelError::BadInput(format!(
            "the prompt has {found} <|image_pad|> tokens for {} images: put one image part in \
             the messages per image",
            counts.len()
        )));
    }
    let mut out = Vec::with_capacity(ids.len() + counts.iter().sum::<usize>());
    let mut k = 0;
    for &t in ids {
        if t == image_token {
            out.extend(std::iter::repeat_n(image_token, counts[k]));
            k += 1;
        } else {
            out.push(t);
        }
    }
    Ok(out)
}
