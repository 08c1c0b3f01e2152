//! The differentiable path: the decoder of [`super`] trained, not copied.
//!
//! Trainable weights are f32 [`Var`]s under their checkpoint names (the layout transformers
//! saves). Every pass builds the blocks from them exactly as the inference model is built
//! (`DecoderLayer::load`: q/k/v and gate/up concatenated, the attention scale folded
//! into the queries, cast to the compute dtype), so training, the log-prob passes of GSPO and
//! the rollouts ([`TrainableQwen::inference_model`]) share one definition and the same fused
//! kernels, whose backward lives with them in [`crate::ops`].
//!
//! Memory, for long completions and large vocabularies:
//! - gradient checkpointing (on by default): the forward keeps only each block's input (the
//!   residual stream, one tensor); the
//!   backward recomputes one block at a time with its graph, pushes the gradient of the
//!   block's output through it, and frees it;
//! - the log-softmax over the vocabulary runs over chunks of `head_chunk_rows` token rows, so
//!   the `[tokens, vocab]` logits never exist at once: the loss sees only per-token log-probs,
//!   its gradient with respect to them is pushed back chunk by chunk.
//!
//! A batch ([`TokenBatch`]) is laid out as TRL lays it out: prompts left-padded to a common
//! length, completions right-padded — or packed ([`TokenBatch::packed`]): each prompt and its
//! completion back to back in rows no longer than the padded ones, positions restarting at
//! each sequence and attention kept inside it (per-query key starts), so no padding is
//! computed. Log-probs come back as `[rows, completion_len]` (one row per sequence) either way;
//! the caller masks what lies after a completion's end (those values differ between layouts).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Embedding, Linear, Module};
use fleet_topology::{DeviceLocation, DeviceMap};

use super::{
    load_embedding, load_head, load_rope, run_layers, DecoderLayer, LayerHooks, LayerInputs, Plain,
    Positions, QwenModel, RmsNorm, RopeTables, Stream,
};
use crate::config::QwenConfig;
use crate::device::Devices;
use crate::error::{ModelError, Result};
use crate::profile;
use crate::weights::{Loader, Weights};

/// Sequences to score: prompts left-padded to `prompt_len`, completions right-padded after
/// them, every row `prompt_len + completion_len` ids long; or packed (`packing`).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenBatch {
    /// The rows (packed: the bins, each holding whole sequences, then padding).
    pub ids: Vec<Vec<u32>>,
    /// Left padding of each row (its prompt starts there); empty when packed.
    pub pad: Vec<usize>,
    /// Columns before the completions; 0 when packed.
    pub prompt_len: usize,
    /// Where each sequence lies when the rows are packed bins ([`TokenBatch::packed`]).
    pub packing: Option<Packing>,
}

/// Sequences packed into bins ([`TokenBatch::packed`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Packing {
    /// The sequences, in the order of the prompts given.
    pub sequences: Vec<PackedSequence>,
    /// The longest completion: the width of the per-token results.
    pub completion_len: usize,
    /// The id the results' columns past a completion's end are scored against.
    pub pad_id: u32,
}

/// One sequence of a packed batch: its prompt then its completion, from `start` in bin `bin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedSequence {
    /// The bin (row of [`TokenBatch::ids`]).
    pub bin: usize,
    /// Its first column.
    pub start: usize,
    /// Prompt tokens.
    pub prompt: usize,
    /// Completion tokens.
    pub completion: usize,
}

impl TokenBatch {
    /// Lays out `prompts[i] + completions[i]` per row; padding uses `pad_id` (any valid id:
    /// left padding is masked, right padding comes after what is scored).
    pub fn new(prompts: &[Vec<u32>], completions: &[Vec<u32>], pad_id: u32) -> Result<Self> {
        if prompts.is_empty() || prompts.len() != completions.len() {
            return Err(ModelError::BadInput(format!(
                "a token batch needs as many prompts as completions, at least one ({} and {})",
                prompts.len(),
                completions.len()
            )));
        }
        if let Some(i) = prompts.iter().position(|p| p.is_empty()) {
            return Err(ModelError::BadInput(format!(
                "prompt {i} of the batch is empty: every completion needs a prompt token before it"
            )));
        }
        let prompt_len = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let completion_len = completions.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut ids = Vec::with_capacity(prompts.len());
        let mut pad = Vec::with_capacity(prompts.len());
        for (p, c) in prompts.iter().zip(completions) {
            let left = prompt_len - p.len();
            let mut row = vec![pad_id; left];
            row.extend_from_slice(p);
            row.extend_from_slice(c);
            row.resize(prompt_len + completion_len, pad_id);
            ids.push(row);
            pad.push(left);
        }
        Ok(TokenBatch {
            ids,
            pad,
            prompt_len,
            packing: None,
        })
    }

    /// Packs `prompts[i] + completions[i]` back to back into bins, first fit in the order given,
    /// each bin at most twice as long as [`TokenBatch::new`]'s rows (the longest prompt plus
    /// the longest completion); bins are right-padded with `pad_id` to the fullest one. The
    /// same results as [`TokenBatch::new`] for every completion token, without computing the
    /// padding (TRL's `padding_free`). Why twice: the projections' work follows the tokens,
    /// the backward's recomputed attention scores (`[len, len]` a bin and head) the bins' length;
    /// with a fraction `f` of the padded layout's tokens real, bins of twice the row length
    /// cost `f` of its projection work and at most `2f` of its attention work and score memory,
    /// where bins of the row length would hold two sequences only when both are short.
    pub fn packed(prompts: &[Vec<u32>], completions: &[Vec<u32>], pad_id: u32) -> Result<Self> {
        let padded = Self::new(prompts, completions, pad_id)?;
        let capacity = 2 * padded.ids[0].len();
        let mut fill: Vec<usize> = Vec::new();
        let mut sequences = Vec::with_capacity(prompts.len());
        for (p, c) in prompts.iter().zip(completions) {
            let n = p.len() + c.len();
            let bin = match fill.iter().position(|&f| f + n <= capacity) {
                Some(b) => b,
                None => {
                    fill.push(0);
                    fill.len() - 1
                }
            };
            sequences.push(PackedSequence {
                bin,
                start: fill[bin],
                prompt: p.len(),
                completion: c.len(),
            });
            fill[bin] += n;
        }
        let len = fill.iter().copied().max().unwrap_or(1);
        let mut ids = vec![Vec::with_capacity(len); fill.len()];
        for (seq, (p, c)) in sequences.iter().zip(prompts.iter().zip(completions)) {
            ids[seq.bin].extend_from_slice(p);
            ids[seq.bin].extend_from_slice(c);
        }
        for row in &mut ids {
            row.resize(len, pad_id);
        }
        Ok(TokenBatch {
            ids,
            pad: Vec::new(),
            prompt_len: 0,
            packing: Some(Packing {
                sequences,
                completion_len: padded.completion_len(),
                pad_id,
            }),
        })
    }

    /// Sequences (the rows of the per-token results).
    pub fn rows(&self) -> usize {
        match &self.packing {
            Some(p) => p.sequences.len(),
            None => self.ids.len(),
        }
    }

    /// Columns of the completion part (of the per-token results).
    pub fn completion_len(&self) -> usize {
        match &self.packing {
            Some(p) => p.completion_len,
            None => self.ids[0].len() - self.prompt_len,
        }
    }

    /// Each token's position and first visible key when packed: positions restart at each
    /// sequence, whose tokens see only its own keys; a bin's padding tokens see only
    /// themselves. Row-major over the bins, `ids.len() * ids[0].len()` each.
    fn packed_positions(&self, packing: &Packing) -> (Vec<u32>, Vec<u32>) {
        let len = self.ids[0].len();
        let mut positions = vec![0u32; self.ids.len() * len];
        let mut starts: Vec<u32> = (0..self.ids.len()).flat_map(|_| 0..len as u32).collect();
        for s in &packing.sequences {
            for i in 0..s.prompt + s.completion {
                positions[s.bin * len + s.start + i] = i as u32;
                starts[s.bin * len + s.start + i] = s.start as u32;
            }
        }
        (positions, starts)
    }

    /// For each sequence and completion column, the flat index (over the bins' tokens) of
    /// the position that predicts it — past the completion's end, its last scored position
    /// again — and the token it predicts (`pad_id` past the end); with whether the column is
    /// inside the completion.
    fn packed_scored(&self, packing: &Packing) -> (Vec<u32>, Vec<u32>, Vec<bool>) {
        let (len, c) = (self.ids[0].len(), packing.completion_len);
        let n = packing.sequences.len() * c;
        let (mut at, mut targets, mut inside) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for s in &packing.sequences {
            let first = s.start + s.prompt - 1;
            let last = first + s.completion.max(1) - 1;
            for col in 0..c {
                at.push((s.bin * len + (first + col).min(last)) as u32);
                let within = col < s.completion;
                targets.push(if within {
                    self.ids[s.bin][first + 1 + col]
                } else {
                    packing.pad_id
                });
                inside.push(within);
            }
        }
        (at, targets, inside)
    }

    fn validate(&self, cfg: &QwenConfig) -> Result<()> {
        if let Some(p) = &self.packing {
            return self.validate_packed(p, cfg);
        }
        let len = self.ids.first().map(Vec::len).unwrap_or(0);
        if self.ids.is_empty()
            || self.pad.len() != self.ids.len()
            || self.prompt_len == 0
            || len <= self.prompt_len
            || self.ids.iter().any(|r| r.len() != len)
            || self.pad.iter().any(|&p| p >= self.prompt_len)
        {
            return Err(ModelError::BadInput(
                "a token batch needs rows of one length, a prompt of at least one token per row \
                 and at least one completion column (build it with TokenBatch::new)"
                    .into(),
            ));
        }
        let longest = self.pad.iter().map(|&p| len - p).max().unwrap_or(len);
        if longest > cfg.max_position_embeddings {
            return Err(ModelError::BadInput(format!(
                "a row of {longest} tokens (prompt + completion) exceeds max_position_embeddings = {}; \
                 lower max_prompt_length or max_completion_length",
                cfg.max_position_embeddings
            )));
        }
        self.validate_ids(cfg)
    }

    fn validate_packed(&self, p: &Packing, cfg: &QwenConfig) -> Result<()> {
        let len = self.ids.first().map(Vec::len).unwrap_or(0);
        let fits = |s: &PackedSequence| {
            s.prompt > 0 && s.bin < self.ids.len() && s.start + s.prompt + s.completion <= len
        };
        if self.ids.is_empty()
            || p.sequences.is_empty()
            || p.completion_len == 0
            || self.ids.iter().any(|r| r.len() != len)
            || !p.sequences.iter().all(fits)
        {
            return Err(ModelError::BadInput(
                "a packed token batch needs bins of one length holding each sequence whole, \
                 with a prompt of at least one token (build it with TokenBatch::packed)"
                    .into(),
            ));
        }
        let longest = p.sequences.iter().map(|s| s.prompt + s.completion).max();
        if let Some(longest) = longest.filter(|&l| l > cfg.max_position_embeddings) {
            return Err(ModelError::BadInput(format!(
                "a sequence of {longest} tokens (prompt + completion) exceeds max_position_embeddings = {}; \
                 lower max_prompt_length or max_completion_length",
                cfg.max_position_embeddings
            )));
        }
        self.validate_ids(cfg)
    }

    fn validate_ids(&self, cfg: &QwenConfig) -> Result<()> {
        let vocab = cfg.vocab_size as u32;
        if let Some(&bad) = self.ids.iter().flatten().find(|&&t| t >= vocab) {
            return Err(ModelError::BadInput(format!(
                "token id {bad} is outside the vocabulary (vocab_size = {vocab}); the ids come from another tokenizer"
            )));
        }
        Ok(())
    }
}

/// Per-token results of a pass, `[rows, completion_len]` f32 on the head's device.
#[derive(Debug, Clone)]
pub struct TokenLogprobs {
    /// log pi(token | prefix) of each completion token, from logits divided by the temperature.
    pub logp: Tensor,
    /// Entropy of the (temperature-scaled) next-token distribution at each completion position.
    pub entropy: Tensor,
}

/// Which part of the model a parameter belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Embed,
    Layer(usize),
    Head,
}

/// One trainable tensor.
struct Param {
    name: String,
    var: Var,
    part: Part,
    /// The master dtype: what the gradient sums and the optimizer's update are in. The `Var`
    /// holds it, except a parameter another rank owns under sharded masters
    /// ([`TrainableQwen::shard_masters`]), which is held in the compute dtype.
    master: DType,
}

/// Gradients of the parameters summed over the micro-batches of one optimizer step, in
/// [`TrainableQwen::params`] order, in the master dtype on each parameter's device (`None`: no
/// gradient reached it).
///
/// The sums live in one buffer per device, allocated (zeroed) when the step's first gradient
/// arrives, and every gradient is added into them in place. Sums allocated one by one between
/// the transient activations of the backward left the GPU allocator's pool fragmented when
/// the activations were freed: at the Qwen2.5-1.5B shape it held 1.9 GiB beyond the live
/// buffers at the peak of a step.
#[derive(Debug, Default)]
pub struct ParamGrads {
    /// The sums, `None` until a gradient reaches the parameter.
    sums: Vec<Option<Tensor>>,
    /// Each parameter's place in its device's buffer (empty until the first gradient).
    slots: Vec<Option<Tensor>>,
}

impl ParamGrads {
    /// No gradient yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Gradients given whole (a data-parallel all-reduce's results, tests); later gradients
    /// are added to them in place.
    pub fn from_vec(sums: Vec<Option<Tensor>>) -> Self {
        Self {
            sums,
            slots: Vec::new(),
        }
    }

    /// Parameters covered (0 before the first gradient).
    pub fn len(&self) -> usize {
        self.sums.len()
    }

    /// Whether no parameter is covered yet.
    pub fn is_empty(&self) -> bool {
        self.sums.is_empty()
    }

    /// The gradient of parameter `i`.
    pub fn get(&self, i: usize) -> Option<&Tensor> {
        self.sums.get(i).and_then(Option::as_ref)
    }

    /// The gradients in parameter order.
    pub fn iter(&self) -> impl Iterator<Item = Option<&Tensor>> {
        self.sums.iter().map(Option::as_ref)
    }

    /// The gradients, for the optimizer (views into the buffers: they are freed with the last).
    pub fn into_vec(self) -> Vec<Option<Tensor>> {
        self.sums
    }

    /// Adds `g` (any dtype; converted to the parameter's) to parameter `i`'s sum, in place,
    /// at most `slice_elements` elements at a time along the first dimension.
    fn add(&mut self, params: &[Param], i: usize, g: &Tensor, slice_elements: usize) -> Result<()> {
        let (acc, first) = self.slot(params, i)?;
        let g = g.to_dtype(acc.dtype())?;
        if first {
            let (acc, g) = (as_rows(&acc)?, as_rows(&g)?);
            return Ok(acc.slice_set(&g.contiguous()?, 0, 0)?);
        }
        add_in_place(&acc, &g, slice_elements)
    }

    /// Parameter `i`'s sum, allocating the buffers on the first call of a step; `true` when
    /// no gradient has reached it yet (its slot holds zeros).
    fn slot(&mut self, params: &[Param], i: usize) -> Result<(Tensor, bool)> {
        if self.sums.is_empty() {
            self.sums.resize(params.len(), None);
        }
        if let Some(t) = &self.sums[i] {
            return Ok((t.clone(), false));
        }
        if self.slots.is_empty() {
            self.slots = self.allocate(params)?;
        }
        let t = self.slots[i].clone().ok_or_else(|| {
            ModelError::BadInput(format!("gradient {i} has no slot in the step's buffers"))
        })?;
        self.sums[i] = Some(t.clone());
        Ok((t, true))
    }

    /// One zeroed buffer per device for the parameters without a sum yet, cut into views.
    fn allocate(&self, params: &[Param]) -> Result<Vec<Option<Tensor>>> {
        let mut slots = vec![None; params.len()];
        let missing: Vec<usize> = (0..params.len())
            .filter(|&i| self.sums[i].is_none())
            .collect();
        // One buffer per device *object*, never per candle `location()`: two logical devices
        // of one GPU share a location (its ordinal), and candle lets an op mix their tensors
        // without an error (its check compares locations), running it on the first operand's
        // stream — a device's gradients in a buffer of another raced with its backward.
        let keys: Vec<SameDevice> = missing
            .iter()
            .map(|&i| SameDevice(params[i].var.device().clone(), params[i].master))
            .collect();
        for group in groups(&keys) {
            let (dev, dtype) = (params[missing[group[0]]].var.device(), keys[group[0]].1);
            let total: usize = group
                .iter()
                .map(|&g| params[missing[g]].var.elem_count())
                .sum();
            let buffer = Tensor::zeros(total, dtype, dev)?;
            let mut at = 0;
            for g in group {
                let p = &params[missing[g]];
                let n = p.var.elem_count();
                slots[missing[g]] = Some(buffer.narrow(0, at, n)?.reshape(p.var.shape())?);
                at += n;
            }
        }
        Ok(slots)
    }
}

/// A device and a dtype, equal when the device is the same device (`Device::same_device`: the
/// same stream), not merely the same GPU.
struct SameDevice(Device, DType);

impl PartialEq for SameDevice {
    fn eq(&self, other: &Self) -> bool {
        self.0.same_device(&other.0) && self.1 == other.1
    }
}

/// The indices of `keys` grouped by equal key, groups in order of first appearance.
fn groups<K: PartialEq>(keys: &[K]) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        match out.iter_mut().find(|g| keys[g[0]] == *k) {
            Some(g) => g.push(i),
            None => out.push(vec![i]),
        }
    }
    out
}

/// A Qwen2/2.5/3 decoder with master weights (f32, or bf16 as TRL trains a bf16 model) that
/// can be trained.
pub struct TrainableQwen {
    cfg: QwenConfig,
    map: DeviceMap,
    devices: Devices,
    dtype: DType,
    params: Vec<Param>,
    by_name: HashMap<String, usize>,
    rope: Vec<(DeviceLocation, RopeTables)>,
    /// Recompute each block in the backward instead of keeping its activations (transformers'
    /// `gradient_checkpointing`). On by default.
    pub gradient_checkpointing: bool,
    /// Token rows whose vocabulary projection is computed at once.
    pub head_chunk_rows: usize,
    /// Gradients larger than this many elements are summed into their accumulator in place,
    /// this many at a time (64 MiB of f32 by default): the same numbers, without a second
    /// tensor of the parameter's size. Tests make it small.
    pub gradient_slice_elements: usize,
    /// With LoRA ([`TrainableQwen::with_lora`]): the base weights, not trained, by checkpoint
    /// name; empty otherwise.
    frozen: HashMap<String, Tensor>,
    /// With LoRA: the adapters' config and targets.
    lora: Option<LoraState>,
    /// With LoRA and `lora_dropout > 0`: the key of the dropout masks of the training pass
    /// under way ([`TrainableQwen::set_dropout_key`]); none: no dropout (log-prob passes).
    dropout_key: std::cell::Cell<Option<u64>>,
}

/// A model's LoRA adapters: the config, the scale, and per adapted weight its name and the
/// indices of its `A` and `B` among the parameters.
struct LoraState {
    config: crate::lora::LoraConfig,
    scaling: f64,
    targets: Vec<LoraTarget>,
}

struct LoraTarget {
    layer: usize,
    /// The adapted weight's checkpoint name.
    weight: String,
    a: usize,
    b: usize,
}

impl TrainableQwen {
    /// A checkpoint directory or hub id (`owner/name`, `opts.revision`) as a trainable model, in
    /// one call: f32 master weights on `opts.device_map` (the CPU when `None`), passes in
    /// `opts.dtype`. [`TrainableQwen::new`] takes the pieces instead.
    ///
    /// ```no_run
    /// use fleet_models::qwen::train::TrainableQwen;
    /// use fleet_models::LoadOptions;
    /// let model = TrainableQwen::load("Qwen/Qwen2.5-0.5B-Instruct", &LoadOptions::default())?;
    /// # Ok::<(), fleet_models::ModelError>(())
    /// ```
    pub fn load(spec: &str, opts: &crate::LoadOptions) -> Result<Self> {
        let c = crate::Checkpoint::open_text(spec, opts)?;
        Self::new(&c.config, &c.weights, opts.dtype, &c.map)
    }

    /// `grads`' gradients by parameter name (the checkpoint's, as transformers names them), in
    /// [`TrainableQwen::params`] order; parameters without a gradient are left out.
    pub fn named_gradients<'a>(
        &'a self,
        grads: &'a ParamGrads,
    ) -> impl Iterator<Item = (&'a str, &'a Tensor)> + 'a {
        self.params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((p.name.as_str(), grads.get(i)?)))
    }

    /// Loads every tensor of the checkpoint as an f32 master weight on the device `map` gives
    /// its block; passes compute in `dtype` (bf16 on GPUs, f32 on the CPU).
    pub fn new(cfg: &QwenConfig, weights: &Weights, dtype: DType, map: &DeviceMap) -> Result<Self> {
        Self::with_master_dtype(cfg, weights, dtype, DType::F32, map)
    }

    /// As [`TrainableQwen::new`], with the master weights (and so the gradients) held in
    /// `master` instead of f32: bf16 is what TRL trains when the model is loaded in bf16 (half
    /// the memory of the weights, gradients and moments; updates smaller than bf16's
    /// resolution are lost).
    pub fn with_master_dtype(
        cfg: &QwenConfig,
        weights: &Weights,
        dtype: DType,
        master: DType,
        map: &DeviceMap,
    ) -> Result<Self> {
        if !matches!(master, DType::F32 | DType::BF16 | DType::F16) {
            return Err(ModelError::BadInput(format!(
                "master weights in {master:?}: expected f32, bf16 or f16"
            )));
        }
        map.validate(cfg.num_hidden_layers)?;
        let devices = Devices::open(map, dtype)?;
        let names = weights.names().ok_or_else(|| {
            ModelError::BadInput(
                "training needs a checkpoint's weights (random weights have no names to train); \
                 save the random model first (scripts/gpu/make_random_checkpoint.py)"
                    .into(),
            )
        })?;
        let mut params = Vec::with_capacity(names.len());
        for name in names {
            // With tied embeddings the lm_head is the embedding matrix: a saved copy is not
            // trained (transformers ignores it too).
            if cfg.tie_word_embeddings && name.starts_with("lm_head.") {
                tracing::warn!(
                    "`{name}` is not trained: tie_word_embeddings makes the lm_head the embedding"
                );
                continue;
            }
            let part = part_of(&name, cfg.num_hidden_layers).ok_or_else(|| {
                ModelError::BadInput(format!(
                    "checkpoint tensor `{name}` belongs to no part of a Qwen decoder; the checkpoint \
                     is not a Qwen2/Qwen3 causal LM"
                ))
            })?;
            let loc = match part {
                Part::Embed => map.embed,
                Part::Layer(i) => map.layers[i],
                Part::Head => map.head,
            };
            let t = weights.load_any(&name, master, devices.get(loc))?;
            params.push(Param {
                name,
                var: Var::from_tensor(&t)?,
                part,
                master,
            });
        }
        params.sort_by(|a, b| a.name.cmp(&b.name));
        let by_name = params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect();
        let rope = load_rope(cfg, dtype, map, &devices)?;
        let model = TrainableQwen {
            cfg: cfg.clone(),
            map: map.clone(),
            devices,
            dtype,
            params,
            by_name,
            rope,
            gradient_checkpointing: true,
            head_chunk_rows: default_head_chunk_rows(cfg.vocab_size),
            gradient_slice_elements: ACCUMULATE_SLICE_ELEMENTS,
            frozen: HashMap::new(),
            lora: None,
            dropout_key: std::cell::Cell::new(None),
        };
        model.check_blocks()?;
        Ok(model)
    }

    /// Builds every block once: names and shapes are checked against config.json now, not at
    /// the first step.
    fn check_blocks(&self) -> Result<()> {
        let w = self.weights(false);
        self.embedding(&w)?;
        for i in 0..self.cfg.num_hidden_layers {
            self.block(&w, i)?;
        }
        self.head(&w)?;
        Ok(())
    }

    /// This model with LoRA adapters (PEFT's, [`crate::lora`]) on `config`'s target modules:
    /// the base weights are frozen (kept once, no gradients, no optimizer state) and the
    /// adapters are the parameters, under PEFT's names. `adapters` (an
    /// `adapter_model.safetensors`' weights) gives their values; without it they start as
    /// PEFT's do (`A` Kaiming-uniform from `seed`, `B` zero), so the model is the base.
    pub fn with_lora(
        mut self,
        config: crate::lora::LoraConfig,
        adapters: Option<&Weights>,
        seed: u64,
    ) -> Result<Self> {
        config.validate().map_err(ModelError::BadInput)?;
        if self.lora.is_some() {
            return Err(ModelError::BadInput(
                "the model already carries LoRA adapters: merge them first".into(),
            ));
        }
        let modules = config.modules();
        let master = self.params.first().map(|p| p.master).unwrap_or(DType::F32);
        let base: Vec<Param> = std::mem::take(&mut self.params);
        let mut params = Vec::new();
        let mut targets = Vec::new();
        let mut rng = splitmix_uniform(seed);
        for p in &base {
            let Some((layer, module)) = crate::lora::target_of(&p.name, &modules) else {
                continue;
            };
            let (out, inp) = p.var.dims2()?;
            let (a_name, b_name) = crate::lora::adapter_names(&module);
            let dev = p.var.device();
            let (a, b) = match adapters {
                Some(w) => (
                    w.load_any(&a_name, master, dev)?,
                    w.load_any(&b_name, master, dev)?,
                ),
                None => {
                    // PEFT: kaiming_uniform_(a = sqrt(5)) on [r, in], bound 1/sqrt(in).
                    let bound = 1.0 / (inp as f64).sqrt();
                    let vals: Vec<f32> = (0..config.r * inp)
                        .map(|_| ((rng() * 2.0 - 1.0) * bound) as f32)
                        .collect();
                    (
                        Tensor::from_vec(vals, (config.r, inp), dev)?.to_dtype(master)?,
                        Tensor::zeros((out, config.r), master, dev)?,
                    )
                }
            };
            if a.dims() != [config.r, inp] || b.dims() != [out, config.r] {
                return Err(ModelError::BadInput(format!(
                    "adapter of {module}: A {:?} and B {:?}, expected [{}, {inp}] and [{out}, {}]                      (r = {})",
                    a.dims(),
                    b.dims(),
                    config.r,
                    config.r,
                    config.r
                )));
            }
            targets.push(LoraTarget {
                layer,
                weight: p.name.clone(),
                a: params.len(),
                b: params.len() + 1,
            });
            params.push(Param {
                name: a_name,
                var: Var::from_tensor(&a)?,
                part: p.part,
                master,
            });
            params.push(Param {
                name: b_name,
                var: Var::from_tensor(&b)?,
                part: p.part,
                master,
            });
        }
        if targets.is_empty() {
            let linear: Vec<&str> = base
                .iter()
                .filter(|p| p.name.contains(".layers.0.") && p.name.ends_with("proj.weight"))
                .map(|p| p.name.as_str())
                .collect();
            return Err(ModelError::BadInput(format!(
                "target_modules {:?} name no module of this model; its linear layers (layer 0): {}",
                modules,
                linear.join(", ")
            )));
        }
        // The frozen base in the compute dtype, as the blocks read it: f32 masters need no f32
        // copy of weights nothing updates (a bf16 checkpoint's values are the same either way).
        self.frozen = base
            .into_iter()
            .map(|p| Ok((p.name, p.var.as_detached_tensor().to_dtype(self.dtype)?)))
            .collect::<Result<_>>()?;
        self.by_name = params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect();
        self.params = params;
        self.lora = Some(LoraState {
            scaling: config.scaling(),
            config,
            targets,
        });
        self.check_blocks()?;
        Ok(self)
    }

    /// With LoRA, the base model alone (the adapters off), sharing the frozen weights (no
    /// copy): a reference model for a KL term, as PEFT's `disable_adapter()` gives TRL. It has
    /// no parameters to train.
    pub fn base_view(&self) -> Option<TrainableQwen> {
        self.lora.as_ref()?;
        Some(TrainableQwen {
            cfg: self.cfg.clone(),
            map: self.map.clone(),
            devices: self.devices.clone(),
            dtype: self.dtype,
            params: Vec::new(),
            by_name: HashMap::new(),
            rope: self.rope.clone(),
            gradient_checkpointing: self.gradient_checkpointing,
            head_chunk_rows: self.head_chunk_rows,
            gradient_slice_elements: self.gradient_slice_elements,
            frozen: self.frozen.clone(),
            lora: None,
            dropout_key: std::cell::Cell::new(None),
        })
    }

    /// With LoRA and `lora_dropout > 0`: the training passes that follow drop the adapters'
    /// inputs with masks drawn from `key` (one per optimizer step and micro-batch, so that a
    /// resumed run draws the same), until `None` (PEFT's eval mode: the log-prob passes, the
    /// rollouts). The backward's recompute of a block draws its forward's masks again.
    pub fn set_dropout_key(&self, key: Option<u64>) {
        self.dropout_key.set(key);
    }

    /// The number of trained elements (the adapters' with LoRA).
    pub fn trainable_elements(&self) -> usize {
        self.params.iter().map(|p| p.var.elem_count()).sum()
    }

    /// The adapters' config, with LoRA.
    pub fn lora_config(&self) -> Option<&crate::lora::LoraConfig> {
        self.lora.as_ref().map(|l| &l.config)
    }

    /// Writes the adapters as PEFT does (`adapter_config.json`, `adapter_model.safetensors`
    /// with PEFT's names, in the master dtype), each file through a temporary one renamed into
    /// place; `base` names the base model in the config (PEFT's `base_model_name_or_path`).
    pub fn save_adapter(&self, dir: &std::path::Path, base: &str) -> Result<()> {
        let l = self
            .lora
            .as_ref()
            .ok_or_else(|| ModelError::BadInput("the model has no LoRA adapters".into()))?;
        let tensors: HashMap<String, Tensor> = self
            .params
            .iter()
            .map(|p| (p.name.clone(), p.var.as_detached_tensor()))
            .collect();
        crate::lora::write_adapter(dir, &l.config, base, &tensors)
    }

    /// The weights the model computes with, detached, by checkpoint name, on the host: the
    /// master weights, or with LoRA the base with every adapter merged (`W + scaling·B·A`):
    /// what a merged export writes. Each merged weight leaves the device as soon as it is
    /// made, so the device never holds a second copy of the model.
    pub fn merged_weights(&self) -> Result<HashMap<String, Tensor>> {
        let Weights::Tensors(map) = self.weights(false) else {
            unreachable!("weights() holds tensors")
        };
        let mut out = HashMap::with_capacity(map.len());
        if let Some(l) = &self.lora {
            for t in &l.targets {
                let merged = self.merge(&map, t)?.to_device(&Device::Cpu)?;
                out.insert(t.weight.clone(), merged);
            }
        }
        // With LoRA the parameters are the adapters: merged above, not written themselves.
        let adapters: std::collections::HashSet<&str> = match &self.lora {
            Some(_) => self.params.iter().map(|p| p.name.as_str()).collect(),
            None => Default::default(),
        };
        for (name, t) in &map {
            if !out.contains_key(name) && !adapters.contains(name.as_str()) {
                out.insert(name.clone(), t.to_device(&Device::Cpu)?);
            }
        }
        Ok(out)
    }

    /// `target`'s weight with its adapter merged, from `map` (base weights and the adapters,
    /// tracked or detached as `map` holds them).
    fn merge(&self, map: &HashMap<String, Tensor>, t: &LoraTarget) -> Result<Tensor> {
        let l = self.lora.as_ref().expect("a LoRA target");
        let get = |name: &str| {
            map.get(name)
                .ok_or_else(|| ModelError::BadInput(format!("no tensor {name}")))
        };
        let a = get(&self.params[t.a].name)?;
        let b = get(&self.params[t.b].name)?;
        let w = get(&t.weight)?;
        // In the adapters' (master) dtype: the base is held in the compute dtype.
        let delta = (b.matmul(a)? * l.scaling)?;
        Ok((w.to_dtype(delta.dtype())? + delta)?)
    }

    /// The config.
    pub fn config(&self) -> &QwenConfig {
        &self.cfg
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device of the final norm and the output projection: where log-probs, masks and the
    /// loss live (with LoRA too, whose trained parameters may all sit elsewhere).
    pub fn head_device(&self) -> Device {
        self.devices.get(self.map.head).clone()
    }

    /// Where each block lives.
    pub fn device_map(&self) -> &DeviceMap {
        &self.map
    }

    /// The trainable parameters, by checkpoint name (sorted), each on its block's device.
    pub fn params(&self) -> Vec<(String, Var)> {
        self.params
            .iter()
            .map(|p| (p.name.clone(), p.var.clone()))
            .collect()
    }

    /// The parameter called `name`.
    pub fn param(&self, name: &str) -> Option<&Var> {
        self.by_name.get(name).map(|&i| &self.params[i].var)
    }

    /// ZeRO stage 1's sharded masters: each parameter `owned` does not mark is held in the
    /// compute dtype instead of its (wider) master dtype — the owner keeps the master, updates
    /// it and hands back its rounding — so a rank holds f32 masters for its share only. The
    /// forward reads a parameter in the compute dtype either way, and the gradient sums stay
    /// in the master dtype, so training is unchanged bit for bit. Returns how many parameters
    /// were narrowed: none when the masters are already in the compute dtype, and none with
    /// LoRA (the adapters compute in their master dtype, and are small).
    pub fn shard_masters(&mut self, owned: &[bool]) -> Result<usize> {
        if owned.len() != self.params.len() {
            return Err(ModelError::BadInput(format!(
                "{} ownership flags for {} parameters",
                owned.len(),
                self.params.len()
            )));
        }
        if self.lora.is_some() {
            return Ok(0);
        }
        let mut narrowed = 0;
        for (p, &mine) in self.params.iter_mut().zip(owned) {
            if !mine && p.var.dtype() != self.dtype {
                p.var = Var::from_tensor(&p.var.as_detached_tensor().to_dtype(self.dtype)?)?;
                narrowed += 1;
            }
        }
        Ok(narrowed)
    }

    /// Each parameter's master dtype (what its gradient and its checkpointed value are in),
    /// in [`TrainableQwen::params`] order.
    pub fn master_dtypes(&self) -> Vec<DType> {
        self.params.iter().map(|p| p.master).collect()
    }

    /// The master weights as tensors (detached, in the master dtype), for saving a checkpoint;
    /// after [`TrainableQwen::shard_masters`] the others' shares are in the compute dtype
    /// (gather the owners' masters instead).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|p| (p.name.clone(), p.var.as_detached_tensor()))
            .collect()
    }

    /// An inference model (KV cache, fused kernels, sampling) of the current weights in the
    /// compute dtype: what GSPO's rollouts run on. A copy in the compute dtype, made in one
    /// pass over the weights.
    pub fn inference_model(&self) -> Result<QwenModel> {
        // The training forward's own builders, on detached weights: one block at a time, so
        // that with LoRA only one block's merged weights exist beside the copy being built
        // (merging every adapter first held a second copy of the model's linear layers), and
        // the trainer's RoPE tables (not computed again on the host).
        let w = self.weights(false);
        let embed = self.embedding(&w)?;
        let layers = (0..self.cfg.num_hidden_layers)
            .map(|i| self.merged_block(&w, i))
            .collect::<Result<Vec<_>>>()?;
        let head = load_head(&self.cfg, &self.loader(&w, self.map.head), || {
            Ok(embed.embeddings().clone())
        })?;
        QwenModel::from_parts(
            &self.cfg,
            self.dtype,
            &self.map,
            self.devices.clone(),
            embed,
            layers,
            head,
            self.rope.clone(),
        )
    }

    /// The weights as the blocks read them: the master tensors, tracked (gradients reach the
    /// `Var`s) or detached (no graph is recorded).
    fn weights(&self, tracked: bool) -> Weights {
        // With LoRA: the frozen base under its names, and the adapters under theirs (merged
        // per block, in `block`).
        let mut map = self.frozen.clone();
        map.extend(self.params.iter().map(|p| {
            let t = if tracked {
                p.var.as_tensor().clone()
            } else {
                p.var.as_detached_tensor()
            };
            (p.name.clone(), t)
        }));
        Weights::Tensors(map)
    }

    fn loader<'a>(&'a self, w: &'a Weights, loc: DeviceLocation) -> Loader<'a> {
        Loader {
            weights: w,
            dtype: self.dtype,
            device: self.devices.get(loc),
        }
    }

    fn embedding(&self, w: &Weights) -> Result<Embedding> {
        load_embedding(&self.cfg, &self.loader(w, self.map.embed))
    }

    /// Block `i` of `w` as the training passes run it: with LoRA, the frozen base and each
    /// adapter beside its projection (PEFT's unmerged forward, dropout on the adapters' input
    /// while a key is set: [`TrainableQwen::set_dropout_key`]). No product of the frozen
    /// weight's size is made or differentiated.
    fn block(&self, w: &Weights, i: usize) -> Result<DecoderLayer> {
        let loc = self.map.layers[i];
        let mut layer = DecoderLayer::load(&self.cfg, &self.loader(w, loc), i, loc)?;
        if let (Some(l), Weights::Tensors(map)) = (&self.lora, w) {
            let get = |name: &str| {
                map.get(name)
                    .ok_or_else(|| ModelError::BadInput(format!("no tensor {name}")))
            };
            let p = l.config.lora_dropout;
            for (m, t) in l.targets.iter().enumerate().filter(|(_, t)| t.layer == i) {
                let path = t.weight.strip_suffix(".weight").unwrap_or(&t.weight);
                let module = path.rsplit('.').next().unwrap_or_default();
                let dropout = match self.dropout_key.get() {
                    Some(key) if p > 0.0 => Some((p, mix_key(key, m as u64))),
                    _ => None,
                };
                layer.attach_adapter(
                    module,
                    get(&self.params[t.a].name)?.clone(),
                    get(&self.params[t.b].name)?.clone(),
                    l.scaling,
                    dropout,
                )?;
            }
        }
        Ok(layer)
    }

    /// Block `i` of `w` with its adapters merged into the weights (`W + scaling·B·A`): the
    /// rollouts' inference copy, whose decode kernels read one matrix per projection.
    fn merged_block(&self, w: &Weights, i: usize) -> Result<DecoderLayer> {
        let loc = self.map.layers[i];
        if let (Some(l), Weights::Tensors(map)) = (&self.lora, w) {
            // The layer's weights with its adapters merged.
            let mut merged = HashMap::new();
            for t in l.targets.iter().filter(|t| t.layer == i) {
                merged.insert(t.weight.clone(), self.merge(map, t)?);
            }
            if !merged.is_empty() {
                let prefix = format!("{}layers.{i}.", self.cfg.prefix());
                for (k, v) in map {
                    if k.starts_with(&prefix) && !merged.contains_key(k) {
                        merged.insert(k.clone(), v.clone());
                    }
                }
                let layer = Weights::Tensors(merged);
                return DecoderLayer::load(&self.cfg, &self.loader(&layer, loc), i, loc);
            }
        }
        DecoderLayer::load(&self.cfg, &self.loader(w, loc), i, loc)
    }

    /// The final norm and the output projection (a tied lm_head read from the embedding).
    fn head(&self, w: &Weights) -> Result<(RmsNorm, Linear)> {
        load_head(&self.cfg, &self.loader(w, self.map.head), || {
            Ok(self.embedding(w)?.embeddings().clone())
        })
    }

    /// RoPE rows and padding counts of `batch`, per device that holds layers.
    fn inputs(&self, batch: &TokenBatch) -> Result<LayerInputs> {
        let (b, len) = (batch.ids.len(), batch.ids[0].len());
        if let Some(p) = &batch.packing {
            let (positions, starts) = batch.packed_positions(p);
            return LayerInputs::packed(&self.rope, &self.devices, (positions, &starts), (b, len));
        }
        let mut ids = Vec::with_capacity(b * len);
        for &p in &batch.pad {
            ids.extend((0..len).map(|i| i.saturating_sub(p) as u32));
        }
        let positions = Positions::PerRow { ids, batch: b, len };
        LayerInputs::new(&self.rope, &self.devices, &positions, &batch.pad, None)
    }

    /// Layers `range` of the master weights (`w`, tracked or detached) on `stream`, each block
    /// built when it runs and dropped after.
    fn run(
        &self,
        w: &Weights,
        range: std::ops::Range<usize>,
        inputs: &LayerInputs,
        hooks: &mut dyn LayerHooks,
        stream: Stream,
    ) -> Result<Stream> {
        run_layers(
            range,
            |i| self.block(w, i),
            &self.devices,
            inputs,
            None,
            hooks,
            stream,
        )
    }

    fn ids_tensor(&self, batch: &TokenBatch) -> Result<Tensor> {
        let flat: Vec<u32> = batch.ids.iter().flatten().copied().collect();
        Ok(Tensor::from_vec(
            flat,
            (batch.ids.len(), batch.ids[0].len()),
            self.devices.get(self.map.embed),
        )?)
    }

    /// The completion tokens each scored position predicts, `[rows * completion_len]` u32 on
    /// the head's device.
    fn targets(&self, batch: &TokenBatch) -> Result<Tensor> {
        if let Some(p) = &batch.packing {
            let t = batch.packed_scored(p).1;
            let n = t.len();
            return Ok(Tensor::from_vec(t, n, self.devices.get(self.map.head))?);
        }
        let t: Vec<u32> = batch
            .ids
            .iter()
            .flat_map(|r| r[batch.prompt_len..].iter().copied())
            .collect();
        Ok(Tensor::from_vec(
            t,
            batch.rows() * batch.completion_len(),
            self.devices.get(self.map.head),
        )?)
    }

    /// The segments of blocks the backward recomputes one at a time: every block with gradient
    /// checkpointing; without it, the runs of consecutive blocks on one device. A segment never
    /// spans two devices, so the graph never holds a copy between devices: candle's backward
    /// would copy the gradient back with a bare `to_device`, without [`crate::device::transfer`]'s
    /// waits (on logical devices the copy could read the gradient before it is computed, and on
    /// GPUs the source buffer could be reused before the copy). The gradient crosses devices
    /// between segments, through `transfer`.
    fn segments(&self) -> Vec<std::ops::Range<usize>> {
        let n = self.cfg.num_hidden_layers;
        let mut out: Vec<std::ops::Range<usize>> = Vec::new();
        for i in 0..n {
            match out.last_mut() {
                Some(r)
                    if !self.gradient_checkpointing
                        && self.map.layers[r.start] == self.map.layers[i] =>
                {
                    r.end = i + 1
                }
                _ => out.push(i..i + 1),
            }
        }
        out
    }

    /// Room for the input of every segment, `[rows, len, hidden]` each in the compute dtype on
    /// its first block's device: views into one buffer per device.
    fn segment_starts(
        &self,
        batch: &TokenBatch,
        segments: &[std::ops::Range<usize>],
    ) -> Result<Vec<Tensor>> {
        let (b, len, hs) = (batch.ids.len(), batch.ids[0].len(), self.cfg.hidden_size);
        let firsts: Vec<DeviceLocation> =
            segments.iter().map(|r| self.map.layers[r.start]).collect();
        let mut views: Vec<Option<Tensor>> = vec![None; firsts.len()];
        for here in groups(&firsts) {
            let loc = firsts[here[0]];
            let buffer =
                Tensor::zeros((here.len(), b, len, hs), self.dtype, self.devices.get(loc))?;
            for (n, k) in here.into_iter().enumerate() {
                views[k] = Some(buffer.get(n)?);
            }
        }
        Ok(views.into_iter().flatten().collect())
    }

    /// The hidden states (as `(x, pending)`) at the positions that predict the completion
    /// tokens, `[rows * completion_len, hidden]` each.
    fn scored_rows(&self, batch: &TokenBatch, stream: &Stream) -> Result<(Tensor, Tensor)> {
        let (b, c, h) = (batch.rows(), batch.completion_len(), self.cfg.hidden_size);
        let dev = self.devices.get(self.map.head);
        let at = match &batch.packing {
            Some(p) => {
                let at = batch.packed_scored(p).0;
                let n = at.len();
                Some(Tensor::from_vec(at, n, dev)?)
            }
            None => None,
        };
        let pick = |t: &Tensor| -> Result<Tensor> {
            let t = crate::device::transfer(t, dev)?;
            Ok(match &at {
                // Packed: the predicting positions gathered from the bins' flat tokens.
                Some(at) => t.reshape(((), h))?.index_select(at, 0)?,
                None => t
                    .narrow(1, batch.prompt_len - 1, c)?
                    .contiguous()?
                    .reshape((b * c, h))?,
            })
        };
        let pending = stream
            .pending
            .as_ref()
            .expect("a decoder has at least one layer");
        Ok((pick(&stream.x)?, pick(pending)?))
    }

    /// Log-probs and entropies of `targets` from hidden rows `x + p`, without gradients: the
    /// logits in the compute dtype, then one fused pass per row (`ops::logp_entropy`; f32
    /// `[rows, vocab]` intermediates were the largest transient of a training step).
    fn head_logprobs(
        &self,
        head: &(RmsNorm, Linear),
        x: &Tensor,
        p: &Tensor,
        targets: &Tensor,
        temperature: f64,
    ) -> Result<(Tensor, Tensor)> {
        let (norm, lm_head) = head;
        let h = norm.add_forward(x, p)?.1;
        let logits = lm_head.forward(&h)?;
        Ok(crate::ops::logp_entropy(&logits, targets, temperature)?)
    }

    /// Log-probs and entropies of `batch`'s completion tokens under the current weights, with
    /// no gradient (GSPO's old and reference log-probs).
    pub fn logprobs(&self, batch: &TokenBatch, temperature: f64) -> Result<TokenLogprobs> {
        batch.validate(&self.cfg)?;
        let w = self.weights(false);
        let inputs = self.inputs(batch)?;
        let x = self.embedding(&w)?.forward(&self.ids_tensor(batch)?)?;
        let n = self.cfg.num_hidden_layers;
        let stream = self.run(&w, 0..n, &inputs, &mut Plain, Stream::new(x))?;
        let (xs, ps) = self.scored_rows(batch, &stream)?;
        let head = self.head(&w)?;
        let targets = self.targets(batch)?;
        let flat = self.chunked(&xs, &ps, &targets, temperature, &head)?;
        let shape = (batch.rows(), batch.completion_len());
        Ok(TokenLogprobs {
            logp: flat.logp.reshape(shape)?,
            entropy: flat.entropy.reshape(shape)?,
        })
    }

    /// Runs the vocabulary projection over row chunks without gradients (flat results).
    fn chunked(
        &self,
        xs: &Tensor,
        ps: &Tensor,
        targets: &Tensor,
        temperature: f64,
        head: &(RmsNorm, Linear),
    ) -> Result<TokenLogprobs> {
        let n = xs.dim(0)?;
        let (mut logps, mut ents) = (Vec::new(), Vec::new());
        for (start, len) in chunks(n, self.head_chunk_rows) {
            let (l, e) = self.head_logprobs(
                head,
                &xs.narrow(0, start, len)?,
                &ps.narrow(0, start, len)?,
                &targets.narrow(0, start, len)?,
                temperature,
            )?;
            logps.push(l);
            ents.push(e);
        }
        Ok(TokenLogprobs {
            logp: Tensor::cat(&logps, 0)?,
            entropy: Tensor::cat(&ents, 0)?,
        })
    }

    /// One forward and backward pass over `batch`: the per-token log-probs go to `loss_of`,
    /// which returns a scalar loss (built from them with differentiable ops) and anything else
    /// the caller wants back; the gradient of that loss with respect to every parameter is
    /// added into `grads` (in [`TrainableQwen::params`] order; allocated on first use).
    ///
    /// The log-probs passed to `loss_of` are `[rows, completion_len]` f32, reshaped from the
    /// chunked head; they are the values [`TrainableQwen::logprobs`] gives for the same batch.
    pub fn forward_backward<T>(
        &self,
        batch: &TokenBatch,
        temperature: f64,
        loss_of: &mut dyn FnMut(&Tensor) -> Result<(Tensor, T)>,
        grads: &mut ParamGrads,
    ) -> Result<(TokenLogprobs, T)> {
        batch.validate(&self.cfg)?;
        let (b, c) = (batch.rows(), batch.completion_len());
        let inputs = self.inputs(batch)?;

        // 1. Forward without a graph, keeping what each segment of blocks starts from.
        let segments = self.segments();
        let starts = self.segment_starts(batch, &segments)?;
        let (xs, ps) = self.forward_keeping_starts(batch, &inputs, &segments, &starts)?;

        // 2. Log-probs without a graph, then the loss and its gradient with respect to them.
        let targets = self.targets(batch)?;
        let values = self.head_values(&xs, &ps, &targets, temperature)?;
        let logprobs = TokenLogprobs {
            logp: values.logp.reshape((b, c))?,
            entropy: values.entropy.reshape((b, c))?,
        };
        let logp_var = Var::from_tensor(&logprobs.logp)?;
        let (loss, out) = loss_of(logp_var.as_tensor())?;
        let Some(g_logp) = loss_gradient(&loss, &logp_var)? else {
            // The loss does not depend on the model (every advantage 0): no gradient.
            return Ok((logprobs, out));
        };

        // 3. The head, chunk by chunk; 4. the blocks, last segment first; 5. the embedding.
        let tracked = self.weights(true);
        let g = self.head_backward(
            batch,
            &tracked,
            (&xs, &ps),
            &targets,
            (&g_logp, temperature),
            grads,
        )?;
        let g = self.blocks_backward(&tracked, &inputs, (&segments, &starts), g, grads)?;
        self.embedding_backward(batch, &g, grads)?;
        Ok((logprobs, out))
    }

    /// Step 1 of [`TrainableQwen::forward_backward`]: the forward without a graph, each
    /// segment's input kept in `starts` — the residual stream `x + pending` the block computes
    /// first (rounded as it rounds it): half of keeping both parts. They are kept in one buffer
    /// per device, allocated before the forward: allocated one by one between the blocks'
    /// transients, they left the GPU allocator's pool fragmented. Returns the scored rows.
    fn forward_keeping_starts(
        &self,
        batch: &TokenBatch,
        inputs: &LayerInputs,
        segments: &[std::ops::Range<usize>],
        starts: &[Tensor],
    ) -> Result<(Tensor, Tensor)> {
        let detached = self.weights(false);
        let ids = self.ids_tensor(batch)?;
        let head_dev = self.devices.get(self.map.head).clone();
        profile::time(&head_dev, "train.1_forward_no_graph", || {
            let x = self.embedding(&detached)?.forward(&ids)?;
            let mut keep = KeepSegmentStarts { segments, starts };
            let n = self.cfg.num_hidden_layers;
            let stream = self.run(&detached, 0..n, inputs, &mut keep, Stream::new(x))?;
            self.scored_rows(batch, &stream)
        })
    }

    /// Step 2's log-probs and entropies, without a graph; the compute-dtype lm_head (a cast of
    /// f32 masters) is dropped before step 3 builds its own.
    fn head_values(
        &self,
        xs: &Tensor,
        ps: &Tensor,
        targets: &Tensor,
        temperature: f64,
    ) -> Result<TokenLogprobs> {
        let head_dev = self.devices.get(self.map.head).clone();
        let head_detached = self.head(&self.weights(false))?;
        profile::time(&head_dev, "train.2_head_values", || {
            self.chunked(xs, ps, targets, temperature, &head_detached)
        })
    }

    /// Step 3: the head, chunk by chunk: the gradient of the loss with respect to the hidden
    /// rows, back as `[rows, len, hidden]` (zero at the positions that score nothing), the
    /// head's parameter gradients added to `grads`. The log-softmax's gradient is written down
    /// directly (one fused kernel on a GPU): autograd through the [rows, vocab] logits made
    /// this the slowest part of a step. The vocabulary projection's two products follow by
    /// hand; autograd runs only through the final norm.
    fn head_backward(
        &self,
        batch: &TokenBatch,
        tracked: &Weights,
        (xs, ps): (&Tensor, &Tensor),
        targets: &Tensor,
        (g_logp, temperature): (&Tensor, f64),
        grads: &mut ParamGrads,
    ) -> Result<Tensor> {
        let (b, c) = (batch.rows(), batch.completion_len());
        let head_dev = self.devices.get(self.map.head).clone();
        let head_started = profile::enabled().then(|| {
            profile::begin();
            std::time::Instant::now()
        });
        let head = self.head(tracked)?;
        let embed_name = self.embed_name();
        let lm_name = if self.cfg.tie_word_embeddings {
            embed_name.as_str()
        } else {
            "lm_head.weight"
        };
        // Frozen (LoRA): only the gradient of the head's input is needed.
        let lm_idx = match self.by_name.get(lm_name) {
            Some(&i) => Some(i),
            None if self.frozen.contains_key(lm_name) => None,
            None => {
                return Err(ModelError::BadInput(format!(
                    "the trainable model has no {lm_name}"
                )))
            }
        };
        let lm_w = head.1.weight().detach();
        let (mut gx_rows, n) = (Vec::new(), xs.dim(0)?);
        for (start, len) in chunks(n, self.head_chunk_rows) {
            let xv = Var::from_tensor(&xs.narrow(0, start, len)?)?;
            let pv = Var::from_tensor(&ps.narrow(0, start, len)?)?;
            let (h, grad_logits) = profile::time(&head_dev, "head.forward", || {
                let h = head.0.add_forward(xv.as_tensor(), pv.as_tensor())?.1;
                let logits = h.detach().matmul(&lm_w.t()?)?;
                let gl = crate::ops::logp_grad(
                    &logits,
                    &targets.narrow(0, start, len)?,
                    &g_logp.narrow(0, start, len)?,
                    temperature,
                )?;
                Ok((h, gl))
            })?;
            let g = profile::time(&head_dev, "head.backward", || {
                let grad_h = grad_logits.matmul(&lm_w)?;
                if let Some(lm_idx) = lm_idx {
                    let lm = &self.params[lm_idx].var;
                    let slice_elements = self.gradient_slice_elements.max(1);
                    let h_values = h.detach();
                    // The projection's weight gradient `grad_logits^T h`, added to its sum by the
                    // GEMM where it can (a GPU, same device and dtype, bf16/f16 sums), else in
                    // vocabulary slices: a whole [vocab, hidden] product per chunk would be one
                    // more tensor of the embedding's size.
                    let (acc, _) = grads.slot(&self.params, lm_idx)?;
                    if crate::ops::add_matmul_tn_supported(&acc, &grad_logits, &h_values)
                        && acc.device().same_device(grad_logits.device())
                        && acc.dtype() == grad_logits.dtype()
                    {
                        // The GEMM adds the product to the sum itself (`beta = 1`).
                        crate::ops::add_matmul_tn_(&acc, &grad_logits, &h_values)?;
                    } else {
                        let slice = (slice_elements / acc.dim(1)?.max(1)).max(1);
                        for (v0, n) in chunks(acc.dim(0)?, slice) {
                            let gl = grad_logits.narrow(1, v0, n)?.contiguous()?;
                            let w = gl.t()?.matmul(&h_values)?.to_dtype(acc.dtype())?;
                            let w = crate::device::transfer(&w, lm.device())?;
                            let sum = (acc.narrow(0, v0, n)? + w)?;
                            acc.slice_set(&sum, 0, v0)?;
                        }
                    }
                }
                let surrogate = crate::ops::gradient_seed(&h, &grad_h.to_dtype(h.dtype())?)?;
                Ok(surrogate.backward()?)
            })?;
            profile::time(&head_dev, "head.collect", || {
                self.collect(&g, |p| p == Part::Head, grads)
            })?;
            // x and pending enter the head only through their sum: one gradient for both.
            gx_rows.push(match g.get(xv.as_tensor()) {
                Some(t) => t.detach(),
                None => xs.narrow(0, start, len)?.zeros_like()?,
            });
        }
        drop(head);
        if let Some(t) = head_started {
            head_dev.synchronize()?;
            profile::record("train.3_head_backward", t.elapsed().as_secs_f64());
        }
        // Back to `[rows, len, hidden]`, zero at the positions that score nothing.
        let hs = self.cfg.hidden_size;
        if let Some(p) = &batch.packing {
            return self.packed_head_gradient(batch, p, &Tensor::cat(&gx_rows, 0)?);
        }
        let scored = Tensor::cat(&gx_rows, 0)?.reshape((b, c, hs))?;
        let len = batch.ids[0].len();
        let before = batch.prompt_len - 1;
        let after = len - before - c;
        let mut parts = Vec::with_capacity(3);
        if before > 0 {
            parts.push(Tensor::zeros(
                (b, before, hs),
                scored.dtype(),
                scored.device(),
            )?);
        }
        parts.push(scored);
        if after > 0 {
            parts.push(Tensor::zeros(
                (b, after, hs),
                parts[0].dtype(),
                parts[0].device(),
            )?);
        }
        Ok(Tensor::cat(&parts, 1)?)
    }

    /// The head's gradient `[sequences * completion_len, hidden]` back on the packed bins'
    /// tokens, `[bins, len, hidden]`: each completion column's row added at the position that
    /// predicts it (each such position once), zero elsewhere. Columns past a completion's end
    /// carry nothing (their loss gradient is zero; they are left out rather than trusted).
    fn packed_head_gradient(
        &self,
        batch: &TokenBatch,
        packing: &Packing,
        g: &Tensor,
    ) -> Result<Tensor> {
        let (bins, len, hs) = (batch.ids.len(), batch.ids[0].len(), self.cfg.hidden_size);
        let (at, _, inside) = batch.packed_scored(packing);
        let (mut rows, mut to) = (Vec::new(), Vec::new());
        for (i, (&a, &within)) in at.iter().zip(&inside).enumerate() {
            if within {
                rows.push(i as u32);
                to.push(a);
            }
        }
        let dev = g.device();
        let n = rows.len();
        let picked = g.index_select(&Tensor::from_vec(rows, n, dev)?, 0)?;
        let out = Tensor::zeros((bins * len, hs), g.dtype(), dev)?.index_add(
            &Tensor::from_vec(to, n, dev)?,
            &picked,
            0,
        )?;
        Ok(out.reshape((bins, len, hs))?)
    }

    /// Step 4: the blocks, last segment first: each segment recomputed with its graph from its
    /// kept input, `g` pushed through it, its parameter gradients added to `grads`. Returns
    /// the gradient of the embeddings' output.
    fn blocks_backward(
        &self,
        tracked: &Weights,
        inputs: &LayerInputs,
        (segments, starts): (&[std::ops::Range<usize>], &[Tensor]),
        mut g: Tensor,
        grads: &mut ParamGrads,
    ) -> Result<Tensor> {
        for (s, x0) in starts.iter().enumerate().rev() {
            let (first, last) = (segments[s].start, segments[s].end);
            let xv = Var::from_tensor(x0)?;
            let seg_dev = self.devices.get(self.map.layers[first]).clone();
            let (x, pending) = profile::time(&seg_dev, "train.4a_blocks_recompute", || {
                let start = Stream::new(xv.as_tensor().clone());
                let s = self.run(tracked, first..last, inputs, &mut Plain, start)?;
                Ok((s.x, s.pending.expect("a segment has at least one block")))
            })?;
            let g_here = crate::device::transfer(&g, x.device())?.to_dtype(x.dtype())?;
            let gs = profile::time(&seg_dev, "train.4b_blocks_backward", || {
                let surrogate = (crate::ops::gradient_seed(&x, &g_here)?
                    + crate::ops::gradient_seed(&pending, &g_here)?)?;
                Ok(surrogate.backward()?)
            })?;
            profile::time(&seg_dev, "train.4c_collect_grads", || {
                self.collect(
                    &gs,
                    |p| matches!(p, Part::Layer(i) if (first..last).contains(&i)),
                    grads,
                )
            })?;
            g = match gs.get(xv.as_tensor()) {
                Some(t) => t.detach(),
                None => x0.zeros_like()?,
            };
        }

        Ok(g)
    }

    /// Step 5: the embedding: row `ids[j]` of its gradient gains row `j` of `g`. By hand, into
    /// the accumulator in place (autograd's index_add made two more tensors of the embedding's
    /// size, its zeros and its result): the rows of each distinct id are summed in f32 first,
    /// then added to the accumulator once.
    fn embedding_backward(
        &self,
        batch: &TokenBatch,
        g: &Tensor,
        grads: &mut ParamGrads,
    ) -> Result<()> {
        let embed_name = self.embed_name();
        let embed_idx = match self.by_name.get(&embed_name) {
            Some(&i) => i,
            // Frozen (LoRA): nothing to compute.
            None if self.frozen.contains_key(&embed_name) => return Ok(()),
            None => {
                return Err(ModelError::BadInput(format!(
                    "the trainable model has no {embed_name}"
                )))
            }
        };
        let embed = &self.params[embed_idx].var;
        let dev = embed.device();
        let ids: Vec<u32> = batch.ids.iter().flatten().copied().collect();
        let hs = self.cfg.hidden_size;
        let g = crate::device::transfer(g, dev)?.reshape((ids.len(), hs))?;
        let (acc, _) = grads.slot(&self.params, embed_idx)?;
        if crate::ops::embedding_grad_kernel() {
            return crate::ops::embedding_grad_add_(&acc, &g, &ids);
        }
        let (distinct, slots) = crate::ops::distinct_slots(&ids);
        let (n_ids, n_distinct) = (slots.len(), distinct.len());
        let g = g.to_dtype(DType::F32)?;
        let sums = Tensor::zeros((n_distinct, hs), DType::F32, dev)?.index_add(
            &Tensor::from_vec(slots, n_ids, dev)?,
            &g,
            0,
        )?;
        let rows = Tensor::from_vec(distinct, (n_distinct, 1), dev)?
            .broadcast_as((n_distinct, hs))?
            .contiguous()?;
        acc.scatter_add_set(&rows, &sums.to_dtype(acc.dtype())?.contiguous()?, 0)?;

        Ok(())
    }

    /// The embedding's parameter name (the config's weight prefix).
    fn embed_name(&self) -> String {
        format!("{}embed_tokens.weight", self.cfg.prefix())
    }

    /// Adds the gradients in `store` of the parameters of the parts `which` selects.
    fn collect(
        &self,
        store: &candle_core::backprop::GradStore,
        which: impl Fn(Part) -> bool,
        grads: &mut ParamGrads,
    ) -> Result<()> {
        for (i, p) in self.params.iter().enumerate() {
            if !which(p.part) {
                continue;
            }
            if let Some(g) = store.get(p.var.as_tensor()) {
                // Detached: a gradient computed from tracked tensors carries their graph.
                grads.add(
                    &self.params,
                    i,
                    &g.detach(),
                    self.gradient_slice_elements.max(1),
                )?;
            }
        }
        Ok(())
    }
}

/// `key` mixed with `salt` (SplitMix64's finaliser): one dropout key per adapter of a pass.
fn mix_key(key: u64, salt: u64) -> u64 {
    crate::ops::splitmix(key ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Uniform numbers in [0, 1) from SplitMix64 seeded with `seed`: the adapters' starting `A`,
/// the same on every machine.
fn splitmix_uniform(seed: u64) -> impl FnMut() -> f64 {
    let mut state = seed;
    move || {
        let z = crate::ops::splitmix(state);
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Elements per slice when a large gradient is added to its accumulator in place: 64 MiB of
/// f32.
const ACCUMULATE_SLICE_ELEMENTS: usize = 16 << 20;

/// `acc += g` in place, about `slice_elements` elements at a time along the first dimension,
/// so that the sum needs no second tensor of the parameter's size (a tied embedding's gradient
/// is 0.5-1 GB in f32). In place is safe because a sum lives in this step's gradient buffers
/// alone.
/// The gradient of `loss` with respect to the log-probs `logp` (flattened), or `None` when the
/// loss does not depend on them; the loss's graph is freed before the head's backward.
fn loss_gradient(loss: &Tensor, logp: &Var) -> Result<Option<Tensor>> {
    let n = logp.elem_count();
    let loss_grads = loss.backward()?;
    Ok(match loss_grads.get(logp.as_tensor()) {
        Some(g) => Some(g.detach().reshape(n)?),
        None => None,
    })
}

/// The training forward's hook: keeps the input of each segment the backward recomputes
/// (the hidden state `x + pending`, one tensor, in its slot of [`TrainableQwen::segment_starts`]).
struct KeepSegmentStarts<'a> {
    segments: &'a [std::ops::Range<usize>],
    starts: &'a [Tensor],
}

impl LayerHooks for KeepSegmentStarts<'_> {
    fn before(&mut self, i: usize, stream: &Stream) -> Result<()> {
        if let Some(k) = self.segments.iter().position(|r| r.start == i) {
            self.starts[k].slice_set(&stream.hidden()?.contiguous()?, 0, 0)?;
        }
        Ok(())
    }
}

fn add_in_place(acc: &Tensor, g: &Tensor, slice_elements: usize) -> Result<()> {
    let g = as_rows(g)?;
    Ok(crate::ops::update_rows_in_place(
        acc,
        slice_elements,
        |s, start, n| s + g.narrow(0, start, n)?,
    )?)
}

/// `t` with a first dimension to slice along (a scalar as `[1]`; a view, no copy).
fn as_rows(t: &Tensor) -> Result<Tensor> {
    Ok(if t.rank() == 0 {
        t.reshape(1)?
    } else {
        t.clone()
    })
}

/// Rows per chunk of the vocabulary projection by default (`TrainableQwen::head_chunk_rows`):
/// 256 MiB of logits were they f32 (441 rows of a 152k vocabulary). Memory plans use it too.
pub fn default_head_chunk_rows(vocab: usize) -> usize {
    ((256usize << 20) / (vocab.max(1) * 4)).max(1)
}

/// `(start, len)` pieces of `0..n` of at most `size`.
fn chunks(n: usize, size: usize) -> impl Iterator<Item = (usize, usize)> {
    let size = size.max(1);
    (0..n).step_by(size).map(move |s| (s, size.min(n - s)))
}

/// The part of the decoder a checkpoint tensor belongs to.
fn part_of(name: &str, layers: usize) -> Option<Part> {
    if name.starts_with("model.embed_tokens.") {
        return Some(Part::Embed);
    }
    if name.starts_with("model.norm.") || name.starts_with("lm_head.") {
        return Some(Part::Head);
    }
    let rest = name.strip_prefix("model.layers.")?;
    let i: usize = rest.split('.').next()?.parse().ok()?;
    (i < layers).then_some(Part::Layer(i))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `TokenBatch::packed`: first fit into bins of at most twice the padded row, positions
    /// restarting at each sequence, each token's first key its sequence's start (a bin's
    /// padding sees only itself), and the scored positions and targets of each completion
    /// column (past a completion's end: its last scored position again, against the pad id).
    #[test]
    fn packing_lays_out_bins_positions_starts_and_scored_columns() {
        let prompts = vec![vec![1, 2, 3], vec![4], vec![5, 6], vec![7, 8, 9]];
        let completions = vec![vec![10, 11], vec![12, 13, 14, 15], vec![], vec![16]];
        let b = TokenBatch::packed(&prompts, &completions, 0).unwrap();
        // The padded row: 3 + 4 = 7 ids, so bins hold up to 14.
        let p = b.packing.as_ref().unwrap();
        let at: Vec<(usize, usize)> = p.sequences.iter().map(|s| (s.bin, s.start)).collect();
        assert_eq!(at, vec![(0, 0), (0, 5), (0, 10), (1, 0)]);
        assert_eq!(b.ids.len(), 2);
        assert_eq!(b.ids[0], vec![1, 2, 3, 10, 11, 4, 12, 13, 14, 15, 5, 6]);
        assert_eq!(b.ids[1], vec![7, 8, 9, 16, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!((b.rows(), b.completion_len()), (4, 4));

        let (positions, starts) = b.packed_positions(p);
        assert_eq!(&positions[..12], &[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]);
        assert_eq!(&starts[..12], &[0, 0, 0, 0, 0, 5, 5, 5, 5, 5, 10, 10]);
        assert_eq!(&positions[12..], &[0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&starts[12..], &[0, 0, 0, 0, 4, 5, 6, 7, 8, 9, 10, 11]);

        let (scored, targets, inside) = b.packed_scored(p);
        // Sequence 0 (bin 0 from 0, prompt 3, completion 2): positions 2, 3, then 3 again.
        assert_eq!(&scored[..4], &[2, 3, 3, 3]);
        assert_eq!(&targets[..4], &[10, 11, 0, 0]);
        assert_eq!(&inside[..4], &[true, true, false, false]);
        // Sequence 1 (from 5, prompt 1, completion 4): positions 5..9.
        assert_eq!(&scored[4..8], &[5, 6, 7, 8]);
        assert_eq!(&targets[4..8], &[12, 13, 14, 15]);
        // Sequence 2 (from 10, prompt 2, no completion): its last prompt position, nothing inside.
        assert_eq!(&scored[8..12], &[11, 11, 11, 11]);
        assert!(!inside[8..12].iter().any(|&x| x));
        // Sequence 3 (bin 1 from 0, prompt 3, completion 1): flat index 12 + 2.
        assert_eq!(&scored[12..], &[14, 14, 14, 14]);
        assert_eq!(&targets[12..], &[16, 0, 0, 0]);
    }
}
