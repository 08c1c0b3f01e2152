//! config.json as it is written: every field fleet reads, each optional, nothing checked.
//!
//! This is the one schema of the file. The validated views ([`crate::QwenConfig`],
//! [`crate::VisionConfig`]) deserialize through it, and fleet-topology's memory model reads it
//! directly, with defaults of its own for what a planner may do without.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::error::{parse, read, Result};

/// The RoPE section of a transformers 5.x config (`rope_parameters`).
#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    /// Base frequency.
    pub rope_theta: Option<f64>,
    /// `default` is the only type fleet implements so far.
    pub rope_type: Option<String>,
    /// Qwen3-VL's multimodal RoPE: how many of the `head_dim / 2` frequencies follow the
    /// temporal, height and width positions (`[24, 20, 20]` in the released checkpoints).
    #[serde(default)]
    pub mrope_section: Option<Vec<usize>>,
}

/// The fields of a `config.json` that fleet reads, as transformers names them, each `None` when
/// the file does not have it (or has `null`).
///
/// A text model has its decoder fields at the top level; a vision-language model (Qwen3-VL)
/// nests them under [`RawConfig::text_config`] and its encoder's under
/// [`RawConfig::vision_config`]. Both the transformers 4.x layout (`rope_theta`, `rope_scaling`,
/// `torch_dtype`, `num_experts`) and the 5.x layout (`rope_parameters`, `dtype`,
/// `num_local_experts`) deserialize.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RawConfig {
    /// e.g. `["Qwen2ForCausalLM"]`; `Qwen2ForSequenceClassification` for a reward model.
    pub architectures: Option<Vec<String>>,
    /// Labels of a sequence classifier (transformers' `id2label`; its size is `num_labels`).
    pub id2label: Option<BTreeMap<String, String>>,
    /// Labels of a sequence classifier when `id2label` is absent.
    pub num_labels: Option<usize>,
    /// `qwen2`, `qwen3`, `qwen3_vl`, `qwen3_vl_moe`, `qwen3_vl_text`, ...
    pub model_type: Option<String>,
    /// Rows of the embedding and lm_head.
    pub vocab_size: Option<usize>,
    /// Width of the residual stream.
    pub hidden_size: Option<usize>,
    /// Width of the dense MLP.
    pub intermediate_size: Option<usize>,
    /// Decoder layers.
    pub num_hidden_layers: Option<usize>,
    /// Query heads.
    pub num_attention_heads: Option<usize>,
    /// Key/value heads (grouped-query attention); transformers' default is
    /// `num_attention_heads`.
    pub num_key_value_heads: Option<usize>,
    /// Per-head width (Qwen3 sets it; Qwen2 derives it from `hidden_size / num_attention_heads`).
    pub head_dim: Option<usize>,
    /// Longest sequence the positions cover.
    pub max_position_embeddings: Option<usize>,
    /// RoPE base (4.x layout).
    pub rope_theta: Option<f64>,
    /// RoPE scaling (4.x layout); Qwen3-VL keeps its `mrope_section` here.
    pub rope_scaling: Option<serde_json::Value>,
    /// RoPE section (5.x layout).
    pub rope_parameters: Option<RopeParameters>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: Option<f64>,
    /// lm_head shares the embedding matrix. A multimodal config may say it at the top level
    /// and in `text_config`: see [`RawConfig::tie_word_embeddings`].
    pub tie_word_embeddings: Option<bool>,
    /// MLP activation.
    pub hidden_act: Option<String>,
    /// Qwen3's bias flag on q/k/v/o.
    pub attention_bias: Option<bool>,
    /// Sliding-window attention.
    pub use_sliding_window: Option<bool>,
    /// The dtype the weights were saved in (4.x name).
    pub torch_dtype: Option<String>,
    /// The dtype the weights were saved in (5.x name).
    pub dtype: Option<String>,
    /// Default EOS id(s): a number or a list.
    pub eos_token_id: Option<serde_json::Value>,
    /// Experts per MoE layer (Qwen3-VL-30B-A3B: 128). transformers 5's `save_pretrained`
    /// writes it as `num_local_experts`.
    #[serde(alias = "num_local_experts")]
    pub num_experts: Option<usize>,
    /// Experts each token is routed to (top-k).
    pub num_experts_per_tok: Option<usize>,
    /// Width of one expert's MLP.
    pub moe_intermediate_size: Option<usize>,
    /// Every `decoder_sparse_step`-th layer is MoE (transformers' default 1: all of them).
    pub decoder_sparse_step: Option<usize>,
    /// Layers that keep a dense MLP in a MoE model.
    pub mlp_only_layers: Option<Vec<usize>>,
    /// The decoder of a vision-language model.
    pub text_config: Option<Box<RawConfig>>,
    /// The vision encoder of a vision-language model.
    pub vision_config: Option<RawVisionConfig>,
    /// `<|image_pad|>` of a vision-language model.
    pub image_token_id: Option<u32>,
    /// `<|video_pad|>`.
    pub video_token_id: Option<u32>,
    /// `<|vision_start|>`.
    pub vision_start_token_id: Option<u32>,
    /// `<|vision_end|>`.
    pub vision_end_token_id: Option<u32>,
}

/// The `vision_config` of a vision-language model's `config.json`, each field `None` when
/// absent.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RawVisionConfig {
    /// Number of blocks.
    pub depth: Option<usize>,
    /// Block width.
    pub hidden_size: Option<usize>,
    /// Block MLP activation.
    pub hidden_act: Option<String>,
    /// Block MLP width.
    pub intermediate_size: Option<usize>,
    /// Attention heads.
    pub num_heads: Option<usize>,
    /// Image channels.
    pub in_channels: Option<usize>,
    /// Patch side in pixels.
    pub patch_size: Option<usize>,
    /// Side of the square of patches merged into one token.
    pub spatial_merge_size: Option<usize>,
    /// Frames per patch.
    pub temporal_patch_size: Option<usize>,
    /// Width of the merged tokens (the decoder's hidden size).
    pub out_hidden_size: Option<usize>,
    /// Entries of the learned position table.
    pub num_position_embeddings: Option<usize>,
    /// Blocks whose outputs feed the deepstack mergers.
    pub deepstack_visual_indexes: Option<Vec<usize>>,
    /// Rotary parameters (transformers 5 files may carry `rope_theta` here).
    pub rope_parameters: Option<serde_json::Value>,
}

impl RawConfig {
    /// Reads `config.json` at `path` (no field is checked).
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json(&read(path)?, path)
    }

    /// Parses the text of a `config.json`; `path` names it in errors (serde's message, with
    /// the line and column).
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        parse(text, path)
    }

    /// Whether the lm_head shares the embedding matrix, as transformers reads it: the top
    /// level's flag, else `text_config`'s (a multimodal config may carry it in either).
    pub fn tie_word_embeddings(&self) -> Option<bool> {
        self.tie_word_embeddings.or_else(|| {
            self.text_config
                .as_ref()
                .and_then(|t| t.tie_word_embeddings)
        })
    }

    /// Outputs of the sequence-classification head: see [`classifier_labels`].
    pub fn classifier_labels(&self) -> Option<usize> {
        classifier_labels(
            self.architectures.as_deref().unwrap_or_default(),
            self.id2label.as_ref(),
            self.num_labels,
        )
    }
}

/// Outputs of the sequence-classification head when `architectures` names a
/// `*ForSequenceClassification` (a reward model: `score` `[num_labels, hidden]` read at the
/// last token): `id2label`'s size, else `num_labels`, else transformers' default of 2. `None`
/// for any other model.
pub fn classifier_labels(
    architectures: &[String],
    id2label: Option<&BTreeMap<String, String>>,
    num_labels: Option<usize>,
) -> Option<usize> {
    architectures
        .iter()
        .any(|a| a.ends_with("ForSequenceClassification"))
        .then(|| id2label.map(|m| m.len()).or(num_labels).unwrap_or(2))
}
