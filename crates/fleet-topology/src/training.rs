//! The training memory model: what one GSPO step holds on each device, per model role. The
//! reasoning behind every term is on [`TrainingWorkload`].

use serde::{Deserialize, Serialize};

use crate::memory::{DType, DevicePart, ModelShape, Workload};
use crate::TopologyError;

/// Bytes per parameter of the f32 master weights (the trainable parameters).
pub const MASTER_WEIGHT_BYTES: u64 = 4;
/// Bytes per parameter of the f32 gradients.
pub const GRADIENT_BYTES: u64 = 4;
/// Bytes per parameter of AdamW's two f32 moments.
pub const ADAM_MOMENT_BYTES: u64 = 8;
/// Compute-dtype copies of one block's parameters a forward builds (the cast, and the
/// concatenated q/k/v and gate/up).
pub const BLOCK_WEIGHT_COPIES: u64 = 2;
/// `[B, L, hidden]` tensors stored per layer with gradient checkpointing (the block's input,
/// the residual stream as one tensor).
pub const CHECKPOINT_STORED_TENSORS: u64 = 1;
/// Compute-dtype tensors of one log-softmax chunk with a gradient: the logits and their
/// gradient (on a GPU the log-probs and entropies come from one fused pass per row, the
/// gradient from another: no f32 `[rows, vocab]` intermediates; the CPU composes the gradient
/// in f32, which this does not count).
pub const LOGIT_CHUNK_TENSORS: u64 = 2;
/// Compute-dtype tensors of one log-softmax chunk without a gradient: the logits.
pub const FROZEN_LOGIT_CHUNK_TENSORS: u64 = 1;
/// f32 temporaries of the composed AdamW update, per element of the slice being updated (the
/// parameter, the two moments, the denominator, the update and the new parameter; measured: a
/// 0.5B run on the CPU held 0.33 GB of them).
pub const COMPOSED_UPDATE_TENSORS: u64 = 5;
/// Elements per slice of the composed AdamW update (fleet-gspo updates large parameters slice
/// by slice, in place).
pub const COMPOSED_UPDATE_SLICE_ELEMENTS: u64 = 16 << 20;
/// f32 `[B, completion]` tensors on the policy's head device: new, old and reference
/// log-probs, and the completion mask.
pub const LOGPROB_TENSORS: u64 = 4;

/// Coefficients of one decoder block's activation estimate (see the module docs):
/// `B·L·d·(hidden·h + intermediate·i + qkv·(H + 2K)·D) + B·H·L²·d·scores`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BlockCoefficients {
    /// Tensors of width `hidden_size` per token.
    pub hidden: f64,
    /// Tensors of the MLP's width per token.
    pub intermediate: f64,
    /// Tensors of width `(heads + 2 kv_heads) * head_dim` per token.
    pub qkv: f64,
    /// Tensors of `heads x L x L` per sequence (attention scores, probabilities, gradient).
    pub scores: f64,
}

/// What one block's forward keeps for the backward: 8 hidden-wide, 4 MLP-wide, 2 q/k/v-wide
/// tensors, scores and probabilities.
pub const C_FORWARD: BlockCoefficients = BlockCoefficients {
    hidden: 8.0,
    intermediate: 4.0,
    qkv: 2.0,
    scores: 2.0,
};

/// The peak of one block's forward with its graph plus its backward (c_h = 12, c_i = 6,
/// c_q = 4, c_s = 3: scores, probabilities and their gradient).
pub const C_PEAK: BlockCoefficients = BlockCoefficients {
    hidden: 12.0,
    intermediate: 6.0,
    qkv: 4.0,
    scores: 3.0,
};

/// The two coefficient sets of the activation model, in one place so that measured peaks can
/// replace them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ActivationCoefficients {
    /// One block's forward as the graph keeps it ([`C_FORWARD`]).
    pub forward: BlockCoefficients,
    /// One block's forward and backward at their peak ([`C_PEAK`]).
    pub peak: BlockCoefficients,
}

impl Default for ActivationCoefficients {
    fn default() -> Self {
        ActivationCoefficients {
            forward: C_FORWARD,
            peak: C_PEAK,
        }
    }
}

/// What a training step processes: the micro-batch of the forward/backward, the rollout batch
/// and the settings that change memory. Names follow TRL's `GRPOConfig`.
///
/// [`TrainingWorkload::policy_cost`] and [`TrainingWorkload::frozen_cost`] give the bytes of
/// one role on one device ([`RoleCost`]); the terms and the reasoning behind them follow.
///
/// Three models take part in a GSPO step (see [`crate::plan_training`] for where they go):
///
/// * the **policy**, trained: its parameters, gradients and optimizer state live for the whole
///   run, and each step first generates rollouts with it, then runs forward and backward over
///   micro-batches of those rollouts;
/// * the **reference** (only when the KL coefficient `beta > 0`), frozen: the policy's
///   checkpoint at the start, giving reference log-probs for the KL term;
/// * the **reward model** (only when one is configured), frozen: a sequence classifier
///   ([`ModelShape::classification_head`]) scoring each completion.
///
/// # The policy (trainer as it is being written)
///
/// Parameter-proportional terms, per parameter the device holds ([`ModelShape::part_params`]):
///
/// | term | bytes/param | why |
/// |---|---|---|
/// | weights | 4 ([`MASTER_WEIGHT_BYTES`]) | f32 master weights, the trainable `Var`s |
/// | gradients | 4 ([`GRADIENT_BYTES`]) | f32, accumulated over micro-batches |
/// | optimizer | 8 ([`ADAM_MOMENT_BYTES`]) | AdamW's first and second moments in f32 |
/// | inference copy | 2 (compute dtype) | the whole policy built in bf16 for rollouts (rollout phase only) |
///
/// 12 B/param of training state for the whole run (weights and moments); 4 B/param of
/// gradients in the training phase only (from an optimizer step's first backward to the
/// update, in one buffer per device, freed after it); plus 2 B/param for the inference copy
/// while a rollout runs (it is built before each rollout and dropped after it). With masters in the compute dtype (`master_dtype`, TRL's arithmetic) each term scales with
/// that dtype's width, and the inference copy is only the concatenated q/k/v and gate/up of
/// each block (the rollouts read the other weights in place). ZeRO stage 1 over `N`
/// processes (`optimizer_shards`) keeps a 1/N share of the moments, and of the wider masters:
/// the other parameters are held in the compute dtype (4 → 4/N + 2·(N−1)/N B/param with f32
/// masters). With LoRA (`trainable_fraction`) gradients, moments and masters are the
/// adapters' and the frozen base is held in the compute dtype; the inference copy is every
/// linear layer, merged with its adapter (an upper bound when fewer modules are adapted).
///
/// Transient terms come in two phases that do not overlap, because the rollout buffers are
/// dropped before the first micro-batch's forward (fleet-models' KV cache lives per generate
/// call):
///
/// * **rollout**: the inference copy, the KV cache of the generation batch (`num_generations x prompts_per_step`
///   sequences of `max_prompt_length + max_completion_length` tokens, the formula of
///   [`ModelShape::kv_bytes_per_token_per_layer`]), plus the workspace of prefilling the
///   prompts ([`ModelShape::workspace_bytes`]);
/// * **training**: the gradients, plus the activations of one micro-batch of `B` sequences of
///   `L = prompt + completion` tokens ([`ActivationBytes`], described below) and on a GPU the
///   allocator's slack over them ([`ALLOCATOR_SLACK_PERCENT`]); or, if larger than the
///   activations, the optimizer update's temporaries after the backward
///   ([`RoleCost::optimizer_update`]: none where the fused GPU kernel updates f32 or bf16
///   parameters in place, else `COMPOSED_UPDATE_TENSORS` f32 tensors of one slice of the
///   largest parameter, at most `COMPOSED_UPDATE_SLICE_ELEMENTS`).
///
/// A device's peak is the persistent terms plus the larger phase ([`RoleCost::peak`]).
///
/// # Activations of a micro-batch
///
/// With `d` the compute dtype's bytes, `h` hidden, `i` the MLP width of the active path (the
/// dense `intermediate_size`, or `num_experts_per_tok * moe_intermediate_size`), `H` heads,
/// `K` kv heads, `D` head_dim, the activation model of one decoder block is
///
/// ```text
/// block(c) = B·L·d·(c.hidden·h + c.intermediate·i + c.qkv·(H + 2K)·D) + B·H·L²·d·c.scores
/// ```
///
/// with two sets of coefficients ([`ActivationCoefficients`]): `forward` (what the autograd
/// graph keeps of one block's forward: candle keeps every intermediate tensor that an op of
/// the graph references until the graph is dropped) and `peak` (the forward plus the gradients
/// alive at once in the block's backward). Counting a Qwen block's forward: the block input,
/// the first RMSNorm's output, the attention output, its transposed copy, o_proj's output, the
/// residual sum, the second RMSNorm's output and down_proj's output make 8 tensors of width `h`;
/// fused gate/up (2i), SiLU and the product (2i) make 4 of width `i`; fused q/k/v and the
/// rotated copies make 2 of width `(H + 2K)·D`; scores and probabilities make 2 of `H·L` per
/// token. Hence `forward = (8, 4, 2, 2)`; the backward adds about half again (the gradient of
/// each live tensor, freed as the backward moves up the block), hence `peak = (12, 6, 4, 3)`.
/// These are the constants [`C_FORWARD`] and [`C_PEAK`], to be checked against peaks measured
/// on the GPU (a caller may pass others in [`TrainingWorkload::coefficients`]).
///
/// * **With gradient checkpointing** (per layer): each layer on the device stores
///   [`CHECKPOINT_STORED_TENSORS`] = 1 tensor `[B, L, h]` in the compute dtype (the block input,
///   the residual stream); the backward recomputes one block at a time with its graph:
///   `block(peak)` on top.
/// * **Without**: every layer's forward is kept, `layers x block(forward)`, plus the gradients
///   of the one block being differentiated, `block(peak) - block(forward)`.
/// * **Block weights in the compute dtype**: each forward builds a block's weights from the f32
///   masters, cast and with q/k/v and gate/up concatenated: [`BLOCK_WEIGHT_COPIES`] = 2 copies of
///   one block's parameters. With checkpointing one block's copies are alive at a time; without,
///   the graph references every block's copies until the backward ends, so every layer's are
///   counted.
/// * **Head** (head device): the log-softmax over the vocabulary in chunks of `head_chunk_rows`
///   rows (at most `B x completion` rows exist): `rows x vocab x d x` [`LOGIT_CHUNK_TENSORS`]
///   (the logits and their gradient in the compute dtype), the final hidden states of the
///   micro-batch and their gradient, `2 x B x L x h x 4 B` (counted at f32 width, on the safe
///   side), and the lm_head's compute-dtype copy `vocab x h x d` (built per pass) when the
///   masters are not in the compute dtype or a tied embedding lives on another device.
/// * **Log-probs** (head device): [`LOGPROB_TENSORS`] = 4 tensors `[B, completion]` in f32 (the
///   policy's, the old policy's, the reference's, and the completion mask).
///
/// The inference copy (the rollouts' model in the compute dtype) is built before each
/// rollout and dropped after it: it belongs to the rollout phase, not to what persists.
///
/// # Frozen models
///
/// Weights in the compute dtype (no gradients, no optimizer, no inference copy), plus one
/// forward over a micro-batch without a graph: the inference workspace of
/// [`ModelShape::workspace_bytes`] for `B` sequences of `L` tokens (hidden states and the
/// largest of attention and MLP), and on the head device the reference's log-softmax chunk
/// without a gradient (`rows x vocab x d x` [`FROZEN_LOGIT_CHUNK_TENSORS`]) and its
/// log-probs `[B, completion]` in f32, or the reward model's scores `B x L x num_labels` in f32.
/// They are counted in the training phase (the reference runs per micro-batch next to the
/// policy's step; the reward model runs between rollout and training, counted there too, on the
/// safe side).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TrainingWorkload {
    /// Dtype of the forward/backward, of the inference copy, KV cache and frozen models.
    pub compute_dtype: DType,
    /// `B`: sequences per micro-batch (`per_device_train_batch_size`).
    pub per_device_train_batch_size: usize,
    /// Longest prompt in tokens (`max_prompt_length`; the caller's bound when unset).
    pub max_prompt_length: usize,
    /// Longest completion in tokens (`max_completion_length`).
    pub max_completion_length: usize,
    /// Completions per prompt (`num_generations`).
    pub num_generations: usize,
    /// Prompts generated for at once; the generation batch is `num_generations` times this.
    pub prompts_per_step: usize,
    /// Per-layer gradient checkpointing (recompute each block in the backward).
    pub gradient_checkpointing: bool,
    /// Rows (tokens) per chunk of the log-softmax over the vocabulary.
    pub head_chunk_rows: usize,
    /// A cap on the attention scores of one rollout prefill (as [`Workload::max_attention_bytes`]);
    /// `None`: the generation batch is prefilled at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attention_bytes: Option<u64>,
    /// The activation model's coefficients.
    #[serde(default)]
    pub coefficients: ActivationCoefficients,
    /// The dtype of the master weights, their gradients and AdamW's moments: f32 (the
    /// constants above) or, as TRL trains a bf16-loaded model, the compute dtype (half of
    /// each, and the rollouts read the weights without a copy of most of them).
    #[serde(default = "f32_master")]
    pub master_dtype: DType,
    /// Processes AdamW's moments are split over (ZeRO stage 1: each keeps its share); 1: every
    /// process keeps them whole.
    #[serde(default = "one_shard")]
    pub optimizer_shards: usize,
    /// The share of the parameters trained (gradients and moments held): 1 for the whole
    /// model, an adapter's share with LoRA (whose base is frozen).
    #[serde(default = "whole_model")]
    pub trainable_fraction: f64,
}

fn whole_model() -> f64 {
    1.0
}

fn f32_master() -> DType {
    DType::F32
}

fn one_shard() -> usize {
    1
}

impl Default for TrainingWorkload {
    /// bf16; 8 sequences per micro-batch (TRL's default); prompts of 512 tokens, completions
    /// of 256 (fleet-gspo's default); 8 generations for each of 4 prompts (a generation batch
    /// of 32 = 8 x 4 micro-batches, the GSPO setting); gradient checkpointing on; log-softmax
    /// in chunks of 512 rows.
    fn default() -> Self {
        TrainingWorkload {
            compute_dtype: DType::Bf16,
            per_device_train_batch_size: 8,
            max_prompt_length: 512,
            max_completion_length: 256,
            num_generations: 8,
            prompts_per_step: 4,
            gradient_checkpointing: true,
            head_chunk_rows: 512,
            master_dtype: DType::F32,
            max_attention_bytes: None,
            coefficients: ActivationCoefficients::default(),
            optimizer_shards: 1,
            trainable_fraction: 1.0,
        }
    }
}

/// Activation bytes of one micro-batch on one device (see the module docs for each term).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ActivationBytes {
    /// Kept across the whole forward: the per-layer checkpoints (2 `[B, L, h]` per layer), or
    /// every layer's forward without checkpointing. 0 for frozen models.
    pub stored: u64,
    /// The one block alive in the backward: its recomputed forward and backward
    /// (checkpointing), or the backward's gradients (without). For a frozen model, the forward
    /// workspace.
    pub block_peak: u64,
    /// Compute-dtype copies of the block weights (one block's, or every layer's without
    /// checkpointing). 0 for frozen models (their weights are in the compute dtype already).
    pub block_weights: u64,
    /// The head: the log-softmax chunk, the final hidden states and the lm_head's
    /// compute-dtype copy (policy), the chunk without gradient (reference) or the scores
    /// (reward model).
    pub head: u64,
    /// Per-token log-prob tensors `[B, completion]` in f32.
    pub logprobs: u64,
}

impl ActivationBytes {
    /// All terms together.
    pub fn total(&self) -> u64 {
        self.stored + self.block_peak + self.block_weights + self.head + self.logprobs
    }
}

/// A training process's CUDA context on a GPU: what the driver reports in use beyond the
/// allocator's pool (context, cuBLAS workspaces, the loaded kernels of the forward and the
/// backward), 0.68 GiB measured on an H200. Inference plans keep
/// [`crate::CONTEXT_OVERHEAD_BYTES`].
pub const TRAINING_CONTEXT_BYTES: u64 = 700 * crate::MIB;

/// What a GPU's stream-ordered allocator holds beyond the live buffers at the training phase's
/// peak, in percent of the activations: freed blocks it keeps but cannot hand to an
/// allocation of another size. Measured on an H200 with bf16 masters (1.5B shape: 0.91 GiB
/// over 2.30 GiB of transients with micro-batch 16, 0.41 over 1.24 with 8; with
/// [`TRAINING_CONTEXT_BYTES`] plans within 3.3% of six measured peaks, docs/benchmarks.md).
pub const ALLOCATOR_SLACK_PERCENT: u64 = 40;

/// Bytes one role (policy, reference or reward model) needs on one device during training.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RoleCost {
    /// Parameters: f32 masters for the policy, the compute dtype for a frozen model.
    pub weights: u64,
    /// f32 gradients (policy only).
    pub gradients: u64,
    /// AdamW moments (policy only).
    pub optimizer: u64,
    /// The compute-dtype copy of the policy used for rollouts (rollout phase: built before
    /// each rollout, dropped after it).
    pub inference_copy: u64,
    /// KV cache of the generation batch (policy, rollout phase).
    pub kv_cache: u64,
    /// Prefill workspace of the generation batch (policy, rollout phase).
    pub generation_workspace: u64,
    /// Activations of one micro-batch (training phase).
    pub activations: ActivationBytes,
    /// The composed optimizer update's temporaries (policy only; 0 where a fused kernel
    /// updates in place). After the backward, when the activations are gone.
    pub optimizer_update: u64,
    /// On a GPU, what the allocator holds beyond the live activations at the training
    /// phase's peak ([`ALLOCATOR_SLACK_PERCENT`] of them); 0 on the CPU.
    pub allocator_slack: u64,
}

impl RoleCost {
    /// What lives for the whole run: weights and optimizer state.
    pub fn persistent(&self) -> u64 {
        self.weights + self.optimizer
    }

    /// The rollout phase's transient bytes: the inference copy, KV cache and prefill
    /// workspace.
    pub fn rollout(&self) -> u64 {
        self.inference_copy + self.kv_cache + self.generation_workspace
    }

    /// The training phase's transient bytes: the gradients, and the activations of the
    /// forward and backward with the allocator's slack over them, or the optimizer update's
    /// temporaries after them, whichever is larger.
    pub fn training(&self) -> u64 {
        self.gradients + self.step_transients()
    }

    /// The training phase's bytes besides the gradients: the activations with the allocator's
    /// slack over them, or the optimizer update's temporaries, whichever is larger.
    pub fn step_transients(&self) -> u64 {
        (self.activations.total() + self.allocator_slack).max(self.optimizer_update)
    }

    /// The role's peak alone: persistent plus the larger phase.
    pub fn peak(&self) -> u64 {
        self.persistent() + self.rollout().max(self.training())
    }
}

impl TrainingWorkload {
    /// Tokens per sequence: prompt plus completion.
    pub fn seq_len(&self) -> usize {
        self.max_prompt_length + self.max_completion_length
    }

    /// Sequences generated together: `num_generations x prompts_per_step`.
    pub fn generation_batch(&self) -> usize {
        self.num_generations * self.prompts_per_step
    }

    /// Checks that every count is positive; the error names the field.
    pub fn validate(&self) -> Result<(), TopologyError> {
        for (field, value) in [
            (
                "per_device_train_batch_size",
                self.per_device_train_batch_size,
            ),
            ("max_prompt_length", self.max_prompt_length),
            ("max_completion_length", self.max_completion_length),
            ("num_generations", self.num_generations),
            ("prompts_per_step", self.prompts_per_step),
            ("head_chunk_rows", self.head_chunk_rows),
        ] {
            if value == 0 {
                return Err(TopologyError::BadWorkload { field, value });
            }
        }
        Ok(())
    }

    /// One block's activation estimate for a micro-batch with coefficients `c`:
    /// `B·L·d·(c.hidden·h + c.intermediate·i + c.qkv·(H + 2K)·D) + B·H·L²·d·c.scores`.
    pub fn block_bytes(&self, shape: &ModelShape, c: &BlockCoefficients) -> u64 {
        let d = self.compute_dtype.size_in_bytes() as f64;
        let bl = (self.per_device_train_batch_size * self.seq_len()) as f64;
        let l = self.seq_len() as f64;
        let width = c.hidden * shape.hidden_size as f64
            + c.intermediate * mlp_width(shape) as f64
            + c.qkv * ((shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim) as f64;
        let scores =
            self.per_device_train_batch_size as f64 * shape.num_heads as f64 * l * l * d * c.scores;
        (bl * d * width + scores).ceil() as u64
    }

    /// The policy's bytes on a device holding `part` (see the module docs for every term).
    pub fn policy_cost(&self, shape: &ModelShape, part: DevicePart) -> RoleCost {
        let d = self.compute_dtype.size_in_bytes();
        let params = shape.part_params(part);
        // LoRA: gradients and moments for the adapters' share only.
        let trained = (params as f64 * self.trainable_fraction.clamp(0.0, 1.0)).ceil() as u64;
        let n = part.layers as u64;
        let rollout = self.rollout_workload();
        let kv_cache =
            n * shape.kv_bytes_per_token_per_layer(self.compute_dtype) * rollout.tokens();
        let generation_workspace =
            shape.workspace_bytes(part, self.compute_dtype, &rollout.prefill);

        let b = self.per_device_train_batch_size as u64;
        let l = self.seq_len() as u64;
        let h = shape.hidden_size as u64;
        let forward = self.block_bytes(shape, &self.coefficients.forward);
        let peak = self.block_bytes(shape, &self.coefficients.peak);
        let one_block_weights = BLOCK_WEIGHT_COPIES * shape.layer_params() * d;
        let mut act = ActivationBytes::default();
        if n > 0 {
            if self.gradient_checkpointing {
                act.stored = n * CHECKPOINT_STORED_TENSORS * b * l * h * d;
                act.block_peak = peak;
                act.block_weights = one_block_weights;
            } else {
                act.stored = n * forward;
                act.block_peak = peak.saturating_sub(forward);
                act.block_weights = n * one_block_weights;
            }
        }
        if part.head {
            // Cast from other-dtype masters, or a tied embedding moved to the head's device.
            let tied_elsewhere = shape.tie_word_embeddings && !part.embed;
            let head_copy = if self.master_dtype == self.compute_dtype && !tied_elsewhere {
                0
            } else {
                shape.head_outputs() as u64 * h * d
            };
            act.head =
                self.logit_chunk_rows() * shape.head_outputs() as u64 * d * LOGIT_CHUNK_TENSORS
                    + 2 * b * l * h * 4
                    + head_copy;
            act.logprobs = LOGPROB_TENSORS * self.logprob_elements() * 4;
        }
        // f32 masters: the constants; others scale with the master dtype's width.
        let m = self.master_dtype.size_in_bytes();
        let inference_copy = if self.trainable_fraction < 1.0 {
            // LoRA: every adapted linear layer is a merged copy (all of them with
            // `all-linear`, the bound taken here), the fused ones concatenated from it.
            let o_and_down = (shape.num_heads * shape.head_dim * shape.hidden_size
                + mlp_width(shape) * shape.hidden_size) as u64;
            n * (fused_params_per_layer(shape) + o_and_down) * d
        } else if self.master_dtype == self.compute_dtype {
            // Only the concatenated q/k/v and gate/up are new tensors, and a tied embedding
            // copied to the head's device when that is another one.
            let tied_head = if shape.tie_word_embeddings && part.head && !part.embed {
                (shape.vocab_size * shape.hidden_size) as u64
            } else {
                0
            };
            (n * fused_params_per_layer(shape) + tied_head) * d
        } else {
            params * d
        };
        // On a GPU an f32 or bf16 parameter is updated by one fused in-place kernel; otherwise
        // the composed update holds its f32 temporaries for one slice of the largest parameter.
        let fused_update = part.gpu && matches!(self.master_dtype, DType::F32 | DType::Bf16);
        let largest = if part.embed || part.head {
            (shape.vocab_size * shape.hidden_size) as u64
        } else if n > 0 {
            (shape.hidden_size * mlp_width(shape)) as u64
        } else {
            0
        };
        let optimizer_update = if fused_update {
            0
        } else {
            COMPOSED_UPDATE_TENSORS * largest.min(COMPOSED_UPDATE_SLICE_ELEMENTS) * 4
        };
        // The masters of the trained parameters; with LoRA the frozen base is held in the
        // compute dtype. ZeRO stage 1 over several processes keeps the wider masters of this
        // process's share only, the others' parameters in the compute dtype (not with LoRA:
        // the adapters stay whole).
        let shards = self.optimizer_shards.max(1) as u64;
        let masters = if shards > 1 && m != d && self.trainable_fraction >= 1.0 {
            let own = trained.div_ceil(shards);
            own * m + (trained - own) * d
        } else {
            trained * m
        };
        RoleCost {
            weights: params.saturating_sub(trained) * d + masters * MASTER_WEIGHT_BYTES / 4,
            gradients: trained * GRADIENT_BYTES * m / 4,
            // ZeRO stage 1: this process's share of the moments (whole parameters are
            // assigned, so a share is about a 1/shards of them).
            optimizer: (trained * ADAM_MOMENT_BYTES * m / 4)
                .div_ceil(self.optimizer_shards.max(1) as u64),
            inference_copy,
            kv_cache,
            generation_workspace,
            allocator_slack: slack(part, &act),
            activations: act,
            optimizer_update,
        }
    }

    /// A frozen model's bytes (reference or reward model) on a device holding `part`: weights
    /// in the compute dtype and one forward over a micro-batch without a graph. The head term
    /// is the log-softmax chunk and log-probs for a language model (the reference), the scores
    /// for a classifier (the reward model).
    pub fn frozen_cost(&self, shape: &ModelShape, part: DevicePart) -> RoleCost {
        let d = self.compute_dtype.size_in_bytes();
        let b = self.per_device_train_batch_size as u64;
        let l = self.seq_len() as u64;
        let forward = Workload {
            batch: self.per_device_train_batch_size,
            seq_len: self.seq_len(),
            full_logits: false,
            kv_pool_bytes: None,
            max_attention_bytes: None,
        };
        let body = DevicePart {
            head: false,
            ..part
        };
        let mut act = ActivationBytes {
            block_peak: shape.workspace_bytes(body, self.compute_dtype, &forward),
            ..ActivationBytes::default()
        };
        if part.head {
            match shape.classification_head {
                Some(labels) => act.head = b * l * labels as u64 * 4,
                None => {
                    act.head = self.logit_chunk_rows()
                        * shape.vocab_size as u64
                        * d
                        * FROZEN_LOGIT_CHUNK_TENSORS;
                    act.logprobs = self.logprob_elements() * 4;
                }
            }
        }
        RoleCost {
            weights: shape.part_params(part) * d,
            allocator_slack: slack(part, &act),
            activations: act,
            ..RoleCost::default()
        }
    }

    /// The generation batch as an inference workload: KV cache for `prompt + completion`
    /// tokens per sequence, prefill workspace for the prompts.
    fn rollout_workload(&self) -> RolloutWorkload {
        RolloutWorkload {
            sequences: self.generation_batch(),
            seq_len: self.seq_len(),
            prefill: Workload {
                batch: self.generation_batch(),
                seq_len: self.max_prompt_length,
                full_logits: false,
                kv_pool_bytes: None,
                max_attention_bytes: self.max_attention_bytes,
            },
        }
    }

    /// Rows of one log-softmax chunk: `head_chunk_rows`, or fewer when the micro-batch has
    /// fewer completion tokens.
    fn logit_chunk_rows(&self) -> u64 {
        (self.head_chunk_rows as u64).min(self.logprob_elements())
    }

    /// Elements of one `[B, completion]` tensor.
    fn logprob_elements(&self) -> u64 {
        (self.per_device_train_batch_size * self.max_completion_length) as u64
    }
}

/// The rollout's KV cache size and its prefill workload.
struct RolloutWorkload {
    sequences: usize,
    seq_len: usize,
    prefill: Workload,
}

impl RolloutWorkload {
    fn tokens(&self) -> u64 {
        (self.sequences * self.seq_len) as u64
    }
}

/// Width of the MLP path one token takes: the dense intermediate size, or the routed experts'.
/// Parameters of one block that the inference model concatenates into new tensors: q/k/v
/// (with their biases) and gate/up.
/// The allocator's slack over `act` on a GPU part ([`ALLOCATOR_SLACK_PERCENT`]).
fn slack(part: DevicePart, act: &ActivationBytes) -> u64 {
    if part.gpu {
        act.total() * ALLOCATOR_SLACK_PERCENT / 100
    } else {
        0
    }
}

fn fused_params_per_layer(shape: &ModelShape) -> u64 {
    let qkv = ((shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim) as u64;
    let bias = if shape.qkv_bias { qkv } else { 0 };
    shape.hidden_size as u64 * qkv + bias + 2 * (shape.hidden_size * mlp_width(shape)) as u64
}

fn mlp_width(shape: &ModelShape) -> usize {
    match &shape.moe {
        Some(m) => m.num_experts_per_tok * m.moe_intermediate_size,
        None => shape.intermediate_size,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads, 2 kv heads, intermediate 4864, tied.
    fn qwen05() -> ModelShape {
        ModelShape::from_config_str(
            r#"{"model_type":"qwen2","num_hidden_layers":24,"hidden_size":896,
            "num_attention_heads":14,"num_key_value_heads":2,"intermediate_size":4864,
            "vocab_size":151936,"tie_word_embeddings":true}"#,
            "qwen2.5-0.5b",
        )
        .unwrap()
    }

    /// Qwen2.5-7B: 28 layers, hidden 3584, 28 heads, 4 kv heads, intermediate 18944, untied.
    fn qwen7b() -> ModelShape {
        ModelShape::from_config_str(
            r#"{"model_type":"qwen2","num_hidden_layers":28,"hidden_size":3584,
            "num_attention_heads":28,"num_key_value_heads":4,"intermediate_size":18944,
            "vocab_size":152064,"tie_word_embeddings":false}"#,
            "qwen2.5-7b",
        )
        .unwrap()
    }

    fn whole(shape: &ModelShape) -> DevicePart {
        DevicePart {
            layers: shape.num_layers,
            embed: true,
            head: true,
            gpu: true,
        }
    }

    #[test]
    fn bf16_masters_halve_weights_gradients_and_moments() {
        let s = qwen05();
        let p = s.total_params();
        let w = TrainingWorkload {
            master_dtype: DType::Bf16,
            ..TrainingWorkload::default()
        };
        let c = w.policy_cost(&s, whole(&s));
        assert_eq!(c.weights + c.gradients + c.optimizer, 8 * p);
        // The rollouts read most weights in place; only the fused q/k/v and gate/up are new.
        assert!(c.inference_copy < 2 * p);
    }

    #[test]
    fn parameter_terms_are_16_bytes_plus_the_inference_copy() {
        let s = qwen05();
        let p = s.total_params();
        assert!((494_000_000..494_100_000).contains(&p), "{p}");
        let c = TrainingWorkload::default().policy_cost(&s, whole(&s));
        assert_eq!(c.weights + c.gradients + c.optimizer, 16 * p);
        assert_eq!(c.weights, 4 * p);
        assert_eq!(c.optimizer, 8 * p);
        assert_eq!(c.inference_copy, 2 * p);
        // The gradients belong to the training phase.
        assert_eq!(c.persistent(), 12 * p);
        assert!(c.training() >= 4 * p);
        // A layer range carries its own layers' share only.
        let part = DevicePart {
            layers: 10,
            embed: false,
            head: false,
            gpu: true,
        };
        let c = TrainingWorkload::default().policy_cost(&s, part);
        assert_eq!(c.persistent(), 12 * 10 * s.layer_params());
        assert_eq!(c.inference_copy, 2 * 10 * s.layer_params());
        assert_eq!((c.activations.head, c.activations.logprobs), (0, 0));
    }

    #[test]
    fn checkpointing_reduces_activations() {
        let s = qwen7b();
        let on = TrainingWorkload::default();
        let off = TrainingWorkload {
            gradient_checkpointing: false,
            ..on
        };
        let a = on.policy_cost(&s, whole(&s)).activations;
        let b = off.policy_cost(&s, whole(&s)).activations;
        assert!(a.stored < b.stored / 4, "{a:?} {b:?}");
        assert!(a.block_weights < b.block_weights);
        assert!(a.total() < b.total() / 3, "{a:?} {b:?}");
        // Without checkpointing, stored + block peak = layers x forward + (peak - forward).
        let fwd = on.block_bytes(&s, &C_FORWARD);
        let peak = on.block_bytes(&s, &C_PEAK);
        assert_eq!(b.stored + b.block_peak, 28 * fwd + peak - fwd);
        // With it: 1 tensor [B, L, h] per layer, then one block's recompute and backward.
        assert_eq!(a.stored, 28 * 8 * 768 * 3584 * 2);
        assert_eq!(a.block_peak, peak);
    }

    #[test]
    fn block_estimate_has_the_documented_form() {
        let s = qwen7b();
        let w = TrainingWorkload::default();
        let (b, l, d) = (8u64, 768u64, 2u64);
        let want =
            b * l * d * (12 * 3584 + 6 * 18944 + 4 * (28 + 8) * 128) + b * 28 * l * l * d * 3;
        assert_eq!(w.block_bytes(&s, &C_PEAK), want);
    }

    /// ZeRO stage 1: each of N processes plans a 1/N share of AdamW's moments and of the f32
    /// masters (the rest of the weights in bf16); gradients stay whole. With bf16 masters
    /// only the moments shrink.
    #[test]
    fn sharded_moments_and_masters_are_a_share_per_process() {
        let s = qwen05();
        let p = s.part_params(whole(&s));
        let one = TrainingWorkload::default().policy_cost(&s, whole(&s));
        let four = TrainingWorkload {
            optimizer_shards: 4,
            ..TrainingWorkload::default()
        }
        .policy_cost(&s, whole(&s));
        assert_eq!(four.optimizer, one.optimizer.div_ceil(4));
        assert_eq!(one.weights, p * 4);
        assert_eq!(four.weights, p.div_ceil(4) * 4 + (p - p.div_ceil(4)) * 2);
        assert_eq!(four.gradients, one.gradients);
        let bf16 = |shards| {
            TrainingWorkload {
                optimizer_shards: shards,
                master_dtype: DType::Bf16,
                ..TrainingWorkload::default()
            }
            .policy_cost(&s, whole(&s))
        };
        assert_eq!(bf16(4).weights, bf16(1).weights);
        assert_eq!(bf16(4).optimizer, bf16(1).optimizer.div_ceil(4));
    }

    #[test]
    fn doubling_the_micro_batch_doubles_the_activations() {
        let s = qwen05();
        for ckpt in [true, false] {
            let one = TrainingWorkload {
                gradient_checkpointing: ckpt,
                head_chunk_rows: 1 << 20,
                ..TrainingWorkload::default()
            };
            let two = TrainingWorkload {
                per_device_train_batch_size: 16,
                ..one
            };
            let a = one.policy_cost(&s, whole(&s)).activations;
            let b = two.policy_cost(&s, whole(&s)).activations;
            assert_eq!(b.stored, 2 * a.stored);
            assert_eq!(b.block_peak, 2 * a.block_peak);
            // The lm_head's compute-dtype copy does not depend on the batch.
            let copy = 151936 * 896 * 2;
            assert_eq!(b.head - copy, 2 * (a.head - copy));
            assert_eq!(b.logprobs, 2 * a.logprobs);
            // The weights built per forward do not depend on the batch.
            assert_eq!(b.block_weights, a.block_weights);
        }
        // A chunk of fewer rows than the micro-batch's completions caps the head term.
        let w = TrainingWorkload::default();
        let head = w.policy_cost(&s, whole(&s)).activations.head;
        assert_eq!(
            head,
            512 * 151936 * 2 * 2 + 2 * 8 * 768 * 896 * 4 + 151936 * 896 * 2,
            "512 rows x vocab x 2 B x 2 tensors + final hidden states + the lm_head's bf16 copy"
        );
        // Masters in the compute dtype: the lm_head is read as it is.
        let same = TrainingWorkload {
            master_dtype: DType::Bf16,
            ..w
        };
        let head_same = same.policy_cost(&s, whole(&s)).activations.head;
        assert_eq!(head - head_same, 151936 * 896 * 2);
        // ...unless the tied embedding lives on another device: then it is copied over.
        let last = DevicePart {
            layers: 12,
            embed: false,
            head: true,
            gpu: true,
        };
        let first = DevicePart {
            embed: true,
            head: false,
            ..last
        };
        let head_last = same.policy_cost(&s, last).activations.head;
        assert_eq!(head_last, head);
        assert_eq!(same.policy_cost(&s, first).activations.head, 0);
    }

    /// A 7B policy (Qwen2.5-7B, 7.62B parameters), bf16, micro-batch 8 x (512 + 256) tokens,
    /// checkpointing on, generation batch 32: 121.9 GB of weights, gradients and moments, of
    /// which the 30.5 GB of gradients exist only in the step; the rollout (15.2 GB inference
    /// copy, 1.4 GB of KV cache) or the step (the gradients and 6.0-7.0 GB of activations, 40%
    /// more for the GPU allocator's slack); 130-133 GB in all on one device.
    #[test]
    fn a_7b_step_is_in_a_sane_range() {
        let s = qwen7b();
        let c = TrainingWorkload::default().policy_cost(&s, whole(&s));
        let gb = |x: u64| x as f64 / 1e9;
        assert!((121.0..123.0).contains(&gb(c.weights + c.gradients + c.optimizer)));
        assert!((15.0..15.5).contains(&gb(c.inference_copy)));
        // 28 layers x 2 x 4 kv heads x 128 x 2 B x 32 x 768 tokens = 1.41 GB.
        assert_eq!(c.kv_cache, 28 * 2048 * 32 * 768);
        let act = gb(c.activations.total());
        assert!((6.0..7.0).contains(&act), "{act} GB: {:?}", c.activations);
        let peak = gb(c.peak());
        assert!((130.0..133.0).contains(&peak), "{peak} GB");
        // The step, with the gradients, is the larger phase here.
        assert!(c.training() > c.rollout());
    }

    #[test]
    fn frozen_models_cost_weights_and_a_forward() {
        let s = qwen05();
        let w = TrainingWorkload::default();
        let r = w.frozen_cost(&s, whole(&s));
        assert_eq!(r.weights, 2 * s.total_params());
        assert_eq!(r.gradients + r.optimizer + r.inference_copy + r.kv_cache, 0);
        assert_eq!(r.activations.stored, 0);
        assert_eq!(r.activations.head, 512 * 151936 * 2);
        assert_eq!(r.activations.logprobs, 8 * 256 * 4);
        // Far below the policy's training activations: no graph, no backward.
        let p = w.policy_cost(&s, whole(&s));
        assert!(r.activations.total() < p.activations.total());

        // A reward model: the score head replaces the lm_head (hidden x 1), untied.
        let rm = qwen05().with_classification_head(1).unwrap();
        assert_eq!(rm.lm_head_params(), 896);
        assert_eq!(
            rm.total_params(),
            s.total_params() + 896,
            "the tied lm_head is gone, a 896 x 1 score head comes"
        );
        let c = w.frozen_cost(&rm, whole(&rm));
        assert_eq!(c.activations.head, 8 * 768 * 4);
        assert_eq!(c.activations.logprobs, 0);
        assert!(qwen05().with_classification_head(0).is_err());
    }

    #[test]
    fn zero_counts_are_named() {
        let w = TrainingWorkload {
            max_completion_length: 0,
            ..TrainingWorkload::default()
        };
        let err = w.validate().unwrap_err().to_string();
        assert!(err.contains("max_completion_length = 0"), "{err}");
        assert!(TrainingWorkload::default().validate().is_ok());
    }
}
