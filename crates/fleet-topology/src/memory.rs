//! The memory model: how many bytes a model's weights, KV cache and working buffers take.
//!
//! The shape ([`ModelShape`]) is read from a checkpoint's `config.json` through fleet-config's
//! schema ([`RawConfig`], the one fleet-models reads too), so this crate needs no model code.
//! Estimates count parameters the way the Qwen2/2.5, Qwen3 and Qwen3-VL (dense and MoE)
//! modules of transformers lay them out:
//!
//! * **embedding**: `vocab_size * hidden_size` (plus the vision tower, which runs before the
//!   first decoder layer and is placed with the embedding);
//! * **each decoder layer**: q/k/v/o projections (with the q/k/v biases of Qwen2, or the
//!   per-head q/k RMSNorms of Qwen3), two RMSNorms, and the MLP: `3 * hidden * intermediate`
//!   for a dense SwiGLU, or for a mixture of experts the router (`hidden * num_experts`) plus
//!   `num_experts * 3 * hidden * moe_intermediate` (every expert is resident; only
//!   `num_experts_per_tok` of them run per token, which matters for the workspace only);
//! * **head**: the final RMSNorm and `lm_head` (`vocab_size * hidden_size`). Tied weights are
//!   counted once when the head shares the embedding's device; a tied head on another device
//!   needs a copy of the matrix there. A sequence-classification model (a reward model,
//!   `*ForSequenceClassification`) has a `score` head of `hidden_size * num_labels` instead,
//!   never tied ([`ModelShape::classification_head`]).
//!
//! Every parameter is stored in the plan's [`DType`]; the small norms are counted in it too.

use std::path::Path;
use std::str::FromStr;

use fleet_config::RawConfig;
use serde::{Deserialize, Serialize};

use crate::{CheckpointParams, TopologyError};

/// Bytes in one MiB.
pub const MIB: u64 = 1024 * 1024;
/// Bytes in one GiB.
pub const GIB: u64 = 1024 * MIB;

/// Memory a CUDA context, cuBLAS handles and the allocator's slack take on each GPU before any
/// tensor is made: 500 MiB. Measured contexts on Ampere and Hopper with cuBLAS loaded take
/// 300–500 MiB; the upper end is used so plans err on the safe side. Not charged on the CPU.
pub const CONTEXT_OVERHEAD_BYTES: u64 = 500 * MIB;

/// Element type of the weights and the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// bfloat16, 2 bytes.
    Bf16,
    /// float16, 2 bytes.
    F16,
    /// float32, 4 bytes.
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> u64 {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
        })
    }
}

impl FromStr for DType {
    type Err = TopologyError;

    /// Parses `bf16`/`bfloat16`, `f16`/`fp16`/`float16`/`half`, `f32`/`fp32`/`float32`/`float`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "f32" | "fp32" | "float32" | "float" => Ok(DType::F32),
            _ => Err(TopologyError::BadDType {
                value: s.to_string(),
            }),
        }
    }
}

/// The mixture-of-experts part of a decoder layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MoeShape {
    /// Experts per layer (all resident in memory).
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub num_experts_per_tok: usize,
    /// Intermediate size of one expert's SwiGLU.
    pub moe_intermediate_size: usize,
}

/// The shape of a vision tower (Qwen2.5-VL / Qwen3-VL style ViT with a patch merger).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VisionShape {
    /// Transformer blocks.
    pub depth: usize,
    /// Width of the ViT.
    pub hidden_size: usize,
    /// MLP width of the ViT.
    pub intermediate_size: usize,
    /// Width the merger projects to (the decoder's hidden size).
    pub out_hidden_size: usize,
    /// Square patch side in pixels.
    pub patch_size: usize,
    /// Frames per temporal patch.
    pub temporal_patch_size: usize,
    /// Input channels.
    pub in_channels: usize,
    /// Side of the square of patches merged into one token.
    pub spatial_merge_size: usize,
    /// Learned position embeddings (0 when the tower uses rotary positions only).
    pub num_position_embeddings: usize,
    /// Extra "deepstack" mergers (Qwen3-VL), each the size of the main merger.
    pub deepstack_mergers: usize,
}

impl VisionShape {
    /// Parameters of the tower: patch embedding, blocks (fused qkv with bias, proj, two-layer
    /// MLP with biases, two LayerNorms), the merger and deepstack mergers (LayerNorm,
    /// `merged x merged` and `merged x out` linears with biases) and position embeddings.
    pub fn params(&self) -> u64 {
        let h = self.hidden_size as u64;
        let i = self.intermediate_size as u64;
        let patch =
            (self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size)
                as u64
                * h
                + h;
        let block = (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h) + 4 * h;
        let merged = h * (self.spatial_merge_size * self.spatial_merge_size) as u64;
        let out = self.out_hidden_size as u64;
        let merger = 2 * merged + (merged * merged + merged) + (merged * out + out);
        patch
            + self.depth as u64 * block
            + (1 + self.deepstack_mergers as u64) * merger
            + self.num_position_embeddings as u64 * h
    }
}

/// What the memory model needs to know about a decoder model, read from its `config.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelShape {
    /// `model_type` of the config (`qwen2`, `qwen3`, `qwen3_vl_moe`, ...).
    pub model_type: String,
    /// Decoder layers.
    pub num_layers: usize,
    /// Hidden size of the decoder.
    pub hidden_size: usize,
    /// Dense MLP width (unused by MoE layers).
    pub intermediate_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding and lm_head).
    pub vocab_size: usize,
    /// Whether lm_head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v (Qwen2/2.5).
    pub qkv_bias: bool,
    /// Per-head RMSNorm on q and k (Qwen3 family).
    pub qk_norm: bool,
    /// Mixture-of-experts MLP, when the model has one.
    pub moe: Option<MoeShape>,
    /// Vision tower, when the model has one.
    pub vision: Option<VisionShape>,
    /// Exact parameter counts from the checkpoint's safetensors headers, when they were read
    /// ([`ModelShape::with_checkpoint`]); the counts above are then replaced by them.
    pub checkpoint: Option<CheckpointParams>,
    /// `Some(num_labels)` for a sequence-classification model (a reward model): the head is a
    /// `score` matrix of `hidden_size * num_labels` (no bias, never tied to the embedding)
    /// instead of the lm_head, and its outputs are `num_labels` per position instead of the
    /// vocabulary. Read from config.json (`architectures` naming `*ForSequenceClassification`,
    /// `num_labels` from `id2label`) or set with [`ModelShape::with_classification_head`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub classification_head: Option<usize>,
}

impl ModelShape {
    /// Reads a model's shape from its `config.json`.
    pub fn from_config_file(path: impl AsRef<Path>) -> Result<Self, TopologyError> {
        let path = path.as_ref();
        Self::from_raw(&RawConfig::from_file(path)?, &path.display().to_string())
    }

    /// Reads a model's shape from the text of a `config.json`; `source` names it in errors.
    ///
    /// Decoder fields are taken from `text_config` when present, else from the top level.
    /// `head_dim` defaults to `hidden_size / num_attention_heads`, `num_key_value_heads` to
    /// `num_attention_heads`, `tie_word_embeddings` to false. A `vision_config` is read with
    /// Qwen3-VL's defaults (27 blocks of width 1152, MLP 4304, patch 16, merge 2, 2304 learned
    /// positions and 3 deepstack mergers for `qwen3_vl*` model types, none otherwise) for any
    /// field it lacks. A config with `num_experts` (or `num_local_experts`, as transformers 5
    /// saves it) is taken to have a mixture of experts in every layer (true of Qwen3-MoE and
    /// Qwen3-VL-MoE checkpoints; `decoder_sparse_step` and `mlp_only_layers` are not read). A
    /// config whose `architectures` name a `*ForSequenceClassification` class is a classifier
    /// ([`ModelShape::classification_head`]) with as many labels as `id2label` has entries
    /// (else `num_labels`, else transformers' default of 2).
    pub fn from_config_str(text: &str, source: &str) -> Result<Self, TopologyError> {
        Self::from_raw(&RawConfig::from_json(text, Path::new(source))?, source)
    }

    /// The shape of the config.json read as `raw` (fleet-config's schema); `source` names it in
    /// errors. The rules are [`ModelShape::from_config_str`]'s.
    pub fn from_raw(raw: &RawConfig, source: &str) -> Result<Self, TopologyError> {
        let empty = RawConfig::default();
        let text_cfg = raw.text_config.as_deref().unwrap_or(&empty);
        let missing = |field: &str| TopologyError::ModelConfig {
            file: source.to_string(),
            field: field.to_string(),
            message: "missing or zero; the planner needs it to size the model".into(),
        };
        macro_rules! pick {
            ($f:ident) => {
                text_cfg.$f.or(raw.$f)
            };
        }
        macro_rules! need {
            ($f:ident) => {
                pick!($f)
                    .filter(|&v| v > 0)
                    .ok_or_else(|| missing(stringify!($f)))?
            };
        }
        let model_type = raw
            .model_type
            .clone()
            .or_else(|| text_cfg.model_type.clone())
            .unwrap_or_default();
        let num_layers = need!(num_hidden_layers);
        let hidden_size = need!(hidden_size);
        let num_heads = need!(num_attention_heads);
        let vocab_size = need!(vocab_size);
        let num_kv_heads = pick!(num_key_value_heads).unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(TopologyError::ModelConfig {
                file: source.to_string(),
                field: "num_key_value_heads".into(),
                message: format!(
                    "{num_kv_heads} does not divide num_attention_heads = {num_heads}"
                ),
            });
        }
        let head_dim = pick!(head_dim)
            .filter(|&v| v > 0)
            .unwrap_or(hidden_size / num_heads);
        if head_dim == 0 {
            return Err(missing("head_dim"));
        }
        let moe = match pick!(num_experts).filter(|&n| n > 0) {
            Some(num_experts) => Some(MoeShape {
                num_experts,
                num_experts_per_tok: need!(num_experts_per_tok),
                moe_intermediate_size: need!(moe_intermediate_size),
            }),
            None => None,
        };
        let intermediate_size = match moe {
            Some(_) => pick!(intermediate_size).unwrap_or(0),
            None => need!(intermediate_size),
        };
        let tie_word_embeddings = raw.tie_word_embeddings().unwrap_or(false);
        let is_qwen2 = model_type.starts_with("qwen2");
        // Learned position embeddings and deepstack mergers are Qwen3-VL's; older towers
        // (Qwen2-VL, Qwen2.5-VL) have neither unless the config says so.
        let qwen3_vl = model_type.starts_with("qwen3_vl");
        let vision = raw.vision_config.as_ref().map(|v| VisionShape {
            depth: v.depth.unwrap_or(27),
            hidden_size: v.hidden_size.unwrap_or(1152),
            intermediate_size: v.intermediate_size.unwrap_or(4304),
            out_hidden_size: v.out_hidden_size.unwrap_or(hidden_size),
            patch_size: v.patch_size.unwrap_or(16),
            temporal_patch_size: v.temporal_patch_size.unwrap_or(2),
            in_channels: v.in_channels.unwrap_or(3),
            spatial_merge_size: v.spatial_merge_size.unwrap_or(2),
            num_position_embeddings: v.num_position_embeddings.unwrap_or(if qwen3_vl {
                2304
            } else {
                0
            }),
            deepstack_mergers: v
                .deepstack_visual_indexes
                .as_ref()
                .map_or(if qwen3_vl { 3 } else { 0 }, |d| d.len()),
        });
        let classification_head = raw.classifier_labels();
        if classification_head == Some(0) {
            return Err(TopologyError::ModelConfig {
                file: source.to_string(),
                field: "id2label".into(),
                message: "a sequence-classification model needs at least one label".into(),
            });
        }
        Ok(ModelShape {
            model_type,
            num_layers,
            hidden_size,
            intermediate_size,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            tie_word_embeddings,
            qkv_bias: is_qwen2,
            qk_norm: !is_qwen2,
            moe,
            vision,
            checkpoint: None,
            classification_head,
        })
    }

    /// The same decoder with a sequence-classification head of `num_labels` outputs (a reward
    /// model built on this shape) instead of the lm_head. `num_labels = 0` is refused.
    pub fn with_classification_head(mut self, num_labels: usize) -> Result<Self, TopologyError> {
        if num_labels == 0 {
            return Err(TopologyError::ModelConfig {
                file: "(classification head)".into(),
                field: "num_labels".into(),
                message: "a classification head needs at least one label (a reward model has 1)"
                    .into(),
            });
        }
        self.classification_head = Some(num_labels);
        Ok(self)
    }

    /// Whether the head shares the embedding's matrix: a tied lm_head (a classification head
    /// is never tied).
    pub fn head_shares_embedding(&self) -> bool {
        self.tie_word_embeddings && self.classification_head.is_none()
    }

    /// Outputs of the head per position: the vocabulary, or the labels of a classifier.
    pub fn head_outputs(&self) -> usize {
        self.classification_head.unwrap_or(self.vocab_size)
    }

    /// Takes the parameter counts from the checkpoint's safetensors headers instead of the
    /// formulas. Every decoder layer is charged the largest layer's count (Qwen layers are
    /// uniform; the largest keeps plans safe where they are not). Errors when the files hold a
    /// different number of decoder layers than config.json says.
    pub fn with_checkpoint(mut self, params: CheckpointParams) -> Result<Self, TopologyError> {
        if params.layers.len() != self.num_layers {
            return Err(TopologyError::Checkpoint {
                file: params
                    .files
                    .first()
                    .map(|f| f.display().to_string())
                    .unwrap_or_default(),
                message: format!(
                    "the safetensors files hold {} decoder layers but config.json says \
                     num_hidden_layers = {}: the checkpoint and its config do not belong together",
                    params.layers.len(),
                    self.num_layers
                ),
            });
        }
        self.checkpoint = Some(params);
        Ok(self)
    }

    /// Parameters of the token embedding (and, from a checkpoint, of tensors no other part
    /// claims).
    pub fn embed_params(&self) -> u64 {
        match &self.checkpoint {
            Some(c) => c.embed + c.other,
            None => self.vocab_size as u64 * self.hidden_size as u64,
        }
    }

    /// Parameters of the vision tower (0 for a text-only model).
    pub fn vision_params(&self) -> u64 {
        match &self.checkpoint {
            Some(c) => c.vision,
            None => self.vision.as_ref().map_or(0, VisionShape::params),
        }
    }

    /// Parameters of the final norm.
    pub fn final_norm_params(&self) -> u64 {
        match &self.checkpoint {
            Some(c) => c.final_norm,
            None => self.hidden_size as u64,
        }
    }

    /// Parameters of one decoder layer (the largest one, from a checkpoint).
    pub fn layer_params(&self) -> u64 {
        if let Some(c) = &self.checkpoint {
            return c.layers.iter().copied().max().unwrap_or(0);
        }
        let h = self.hidden_size as u64;
        let q = (self.num_heads * self.head_dim) as u64;
        let kv = (self.num_kv_heads * self.head_dim) as u64;
        let mut attn = h * q + 2 * h * kv + q * h;
        if self.qkv_bias {
            attn += q + 2 * kv;
        }
        if self.qk_norm {
            attn += 2 * self.head_dim as u64;
        }
        let mlp = match &self.moe {
            Some(m) => {
                h * m.num_experts as u64
                    + m.num_experts as u64 * 3 * h * m.moe_intermediate_size as u64
            }
            None => 3 * h * self.intermediate_size as u64,
        };
        attn + mlp + 2 * h
    }

    /// Parameters of the lm_head matrix (counted even when tied; see [`ModelShape::total_params`]),
    /// or of the `score` matrix of a classifier.
    pub fn lm_head_params(&self) -> u64 {
        if let Some(labels) = self.classification_head {
            return match &self.checkpoint {
                Some(c) if c.score > 0 => c.score,
                _ => labels as u64 * self.hidden_size as u64,
            };
        }
        match &self.checkpoint {
            Some(c) if c.lm_head > 0 => c.lm_head,
            _ => self.vocab_size as u64 * self.hidden_size as u64,
        }
    }

    /// All parameters, tied weights counted once.
    pub fn total_params(&self) -> u64 {
        self.embed_params()
            + self.vision_params()
            + self.num_layers as u64 * self.layer_params()
            + self.final_norm_params()
            + if self.head_shares_embedding() {
                0
            } else {
                self.lm_head_params()
            }
    }

    /// Bytes of the whole model on one device in `dtype`.
    pub fn total_weight_bytes(&self, dtype: DType) -> u64 {
        self.total_params() * dtype.size_in_bytes()
    }

    /// KV-cache bytes one token takes in one layer: `2 * kv_heads * head_dim * dtype bytes`.
    pub fn kv_bytes_per_token_per_layer(&self, dtype: DType) -> u64 {
        2 * (self.num_kv_heads * self.head_dim) as u64 * dtype.size_in_bytes()
    }

    /// Bytes of the parts that sit on one device of a placement.
    ///
    /// `part.layers` decoder layers, the embedding (and vision tower) when `part.embed` is set,
    /// the final norm and lm_head when `part.head` is set. A tied lm_head shares the
    /// embedding's matrix when both are on this device, and needs its own copy otherwise.
    pub fn device_cost(&self, part: DevicePart, dtype: DType, workload: &Workload) -> DeviceCost {
        let b = dtype.size_in_bytes();
        let params = self.part_params(part);
        let kv_cache = match workload.kv_pool_bytes {
            // The pool holds the same blocks in every layer: a device's share is its layers'.
            Some(pool) if self.num_layers > 0 => {
                (u128::from(pool) * part.layers as u128 / self.num_layers as u128) as u64
            }
            _ => part.layers as u64 * self.kv_bytes_per_token_per_layer(dtype) * workload.tokens(),
        };
        let workspace = self.workspace_bytes(part, dtype, workload);
        DeviceCost {
            weights: params * b,
            kv_cache,
            workspace,
            overhead: if part.gpu { CONTEXT_OVERHEAD_BYTES } else { 0 },
        }
    }

    /// Parameters of the parts one device holds: `part.layers` decoder layers, the embedding
    /// (and vision tower) when `part.embed` is set, the final norm and the head when
    /// `part.head` is set; a tied lm_head is counted once when it shares the embedding's
    /// device and in full (a copy) on another device.
    pub fn part_params(&self, part: DevicePart) -> u64 {
        let mut params = part.layers as u64 * self.layer_params();
        if part.embed {
            params += self.embed_params() + self.vision_params();
        }
        if part.head {
            params += self.final_norm_params();
            let shared = self.head_shares_embedding() && part.embed;
            if !shared {
                params += self.lm_head_params();
            }
        }
        params
    }

    /// Transient buffers of one forward pass over `workload` on a device holding `part`: the
    /// activations of the largest step alive at once.
    ///
    /// * hidden states: 4 tensors of `batch * seq * hidden` (residual, pending add, normed
    ///   input, block output);
    /// * attention (prefill, no flash attention): q/k/v `batch * seq * (heads + 2 kv) *
    ///   head_dim`, scores `batch * heads * seq * seq` in f32 and the probabilities in `dtype`
    ///   (at most [`Workload::max_attention_bytes`] when the caller caps it);
    /// * MLP: the fused gate/up output and the SwiGLU product, `3 * batch * seq * intermediate`
    ///   (for MoE: `num_experts_per_tok * moe_intermediate` per token, plus f32 router logits);
    /// * head device: logits `batch * positions * vocab` in f32 (`positions` = 1 or `seq`, see
    ///   [`Workload::full_logits`]; `num_labels` instead of `vocab` for a classifier).
    ///
    /// The largest of attention, MLP and logits is taken, plus the hidden states.
    pub fn workspace_bytes(&self, part: DevicePart, dtype: DType, w: &Workload) -> u64 {
        let b = dtype.size_in_bytes();
        let bs = (w.batch * w.seq_len) as u64;
        let s = w.seq_len as u64;
        let hidden = 4 * bs * self.hidden_size as u64 * b;
        let mut peak = 0u64;
        if part.layers > 0 {
            let heads = self.num_heads as u64;
            let qkv = bs * ((self.num_heads + 2 * self.num_kv_heads) * self.head_dim) as u64 * b;
            let scores = w.batch as u64 * heads * s * s * (4 + b);
            let scores = w.max_attention_bytes.map_or(scores, |cap| scores.min(cap));
            let mlp = match &self.moe {
                Some(m) => {
                    3 * bs * (m.num_experts_per_tok * m.moe_intermediate_size) as u64 * b
                        + bs * m.num_experts as u64 * 4
                }
                None => 3 * bs * self.intermediate_size as u64 * b,
            };
            peak = peak.max(qkv + scores).max(mlp);
        }
        if part.head {
            let positions = if w.full_logits { w.seq_len } else { 1 } as u64;
            peak = peak.max(w.batch as u64 * positions * self.head_outputs() as u64 * 4);
        }
        hidden + peak
    }
}

/// Which parts of the model one device of a placement holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePart {
    /// Decoder layers on the device.
    pub layers: usize,
    /// The device holds the embedding (and vision tower).
    pub embed: bool,
    /// The device holds the final norm and lm_head.
    pub head: bool,
    /// The device is a GPU (charged [`CONTEXT_OVERHEAD_BYTES`]).
    pub gpu: bool,
}

/// Bytes one device of a placement needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DeviceCost {
    /// Weights.
    pub weights: u64,
    /// KV cache for the workload's tokens.
    pub kv_cache: u64,
    /// Transient buffers of a forward pass.
    pub workspace: u64,
    /// CUDA context and allocator overhead.
    pub overhead: u64,
}

impl DeviceCost {
    /// Everything together.
    pub fn total(&self) -> u64 {
        self.weights + self.kv_cache + self.workspace + self.overhead
    }
}

/// The batch a plan is sized for: KV cache for `batch * seq_len` tokens (or a paged pool of
/// [`Workload::kv_pool_bytes`]), workspace for a prefill of `batch` sequences of `seq_len`
/// tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    /// Sequences processed together.
    pub batch: usize,
    /// Tokens per sequence (prompt plus generated).
    pub seq_len: usize,
    /// Logits for every position (log-probs, training) instead of the last one only
    /// (generation).
    pub full_logits: bool,
    /// A cap on the attention scores of one prefill, in bytes, when the caller splits its
    /// prefills into batches that stay under it (as fleet-argo's LLM does); `None`: the whole
    /// batch is prefilled at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attention_bytes: Option<u64>,
    /// A paged KV pool of this many bytes over the whole model (each device holds its layers'
    /// share) instead of `batch * seq_len` tokens: continuous batching, whose pool is sized by
    /// the user and whose prompt passes are bounded by their own token budget, not by `batch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_pool_bytes: Option<u64>,
}

impl Default for Workload {
    /// One sequence of 2048 tokens, logits of the last position only.
    fn default() -> Self {
        Workload {
            batch: 1,
            seq_len: 2048,
            full_logits: false,
            max_attention_bytes: None,
            kv_pool_bytes: None,
        }
    }
}

impl Workload {
    /// Tokens the KV cache holds.
    pub fn tokens(&self) -> u64 {
        (self.batch * self.seq_len) as u64
    }

    /// Checks that batch and sequence length are positive.
    pub fn validate(&self) -> Result<(), TopologyError> {
        if self.batch == 0 {
            return Err(TopologyError::BadWorkload {
                field: "batch",
                value: 0,
            });
        }
        if self.seq_len == 0 {
            return Err(TopologyError::BadWorkload {
                field: "seq_len",
                value: 0,
            });
        }
        Ok(())
    }
}

/// A byte count in the most readable binary unit, e.g. `14.2 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes >= GIB {
        format!("{:.2} GiB", b / GIB as f64)
    } else if bytes >= MIB {
        format!("{:.1} MiB", b / MIB as f64)
    } else {
        format!("{bytes} B")
    }
}
