//! A Qwen3-VL `config.json` (dense `qwen3_vl`, MoE `qwen3_vl_moe`): the decoder's
//! `text_config` (a [`QwenConfig`]), the encoder's `vision_config` and the special token ids.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{
    bad_fields, model_type, parse_value, read, required, ConfigError, MissingField, Result,
};
use crate::raw::{RawConfig, RawVisionConfig};
use crate::QwenConfig;

/// `vision_config` of a Qwen3-VL `config.json`, as transformers names the fields.
///
/// It deserializes through [`RawVisionConfig`]: a required field that is missing is serde's
/// `missing field` error.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "RawVisionConfig")]
pub struct VisionConfig {
    /// Number of blocks (27 for 8B and 30B-A3B).
    pub depth: usize,
    /// Block width (1152).
    pub hidden_size: usize,
    /// Block MLP activation (`gelu_pytorch_tanh`, the default).
    pub hidden_act: String,
    /// Block MLP width (4304).
    pub intermediate_size: usize,
    /// Attention heads (16).
    pub num_heads: usize,
    /// Image channels (3, the default).
    pub in_channels: usize,
    /// Patch side in pixels (16).
    pub patch_size: usize,
    /// Side of the square of patches merged into one token (2).
    pub spatial_merge_size: usize,
    /// Frames per patch (2; a still image is repeated).
    pub temporal_patch_size: usize,
    /// Width of the merged tokens = the text decoder's hidden size.
    pub out_hidden_size: usize,
    /// Entries of the learned position table, a square grid (2304 = 48 x 48).
    pub num_position_embeddings: usize,
    /// Blocks whose outputs feed the deepstack mergers (`[8, 16, 24]`).
    pub deepstack_visual_indexes: Vec<usize>,
    /// Rotary base (transformers 5 files may carry it in `rope_parameters`; 10000 otherwise).
    pub rope_parameters: Option<Value>,
}

impl TryFrom<RawVisionConfig> for VisionConfig {
    type Error = MissingField;

    /// The required fields are taken in the order serde would report them missing.
    fn try_from(raw: RawVisionConfig) -> Result<Self, MissingField> {
        Ok(VisionConfig {
            depth: required(raw.depth, "depth")?,
            hidden_size: required(raw.hidden_size, "hidden_size")?,
            hidden_act: raw.hidden_act.unwrap_or_else(|| "gelu_pytorch_tanh".into()),
            intermediate_size: required(raw.intermediate_size, "intermediate_size")?,
            num_heads: required(raw.num_heads, "num_heads")?,
            in_channels: raw.in_channels.unwrap_or(3),
            patch_size: required(raw.patch_size, "patch_size")?,
            spatial_merge_size: required(raw.spatial_merge_size, "spatial_merge_size")?,
            temporal_patch_size: required(raw.temporal_patch_size, "temporal_patch_size")?,
            out_hidden_size: required(raw.out_hidden_size, "out_hidden_size")?,
            num_position_embeddings: required(
                raw.num_position_embeddings,
                "num_position_embeddings",
            )?,
            deepstack_visual_indexes: raw.deepstack_visual_indexes.unwrap_or_default(),
            rope_parameters: raw.rope_parameters,
        })
    }
}

impl VisionConfig {
    /// Values in one patch (`channels * frames * patch * patch`).
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Side of the square position table.
    pub fn grid_per_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt().round() as usize
    }

    /// Rotary base: `rope_parameters.rope_theta`, else 10000.
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.get("rope_theta"))
            .and_then(|t| t.as_f64())
            .unwrap_or(10_000.0)
    }

    /// Checks the shapes the encoder relies on; `path` names the file in errors.
    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, value: String, hint: &str| {
            ConfigError::bad(path, format!("vision_config.{field}"), value, hint)
        };
        for (field, v) in [
            ("depth", self.depth),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_heads", self.num_heads),
            ("patch_size", self.patch_size),
            ("spatial_merge_size", self.spatial_merge_size),
            ("temporal_patch_size", self.temporal_patch_size),
            ("out_hidden_size", self.out_hidden_size),
        ] {
            if v == 0 {
                return Err(bad(field, "0".into(), "must be positive"));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_heads) || !self.head_dim().is_multiple_of(4) {
            return Err(bad(
                "num_heads",
                self.num_heads.to_string(),
                "hidden_size / num_heads must be a multiple of 4 (2-D rotary halves)",
            ));
        }
        let side = self.grid_per_side();
        if side * side != self.num_position_embeddings || side == 0 {
            return Err(bad(
                "num_position_embeddings",
                self.num_position_embeddings.to_string(),
                "must be a square number (the position table is a square grid)",
            ));
        }
        if let Some(&i) = self
            .deepstack_visual_indexes
            .iter()
            .find(|&&i| i >= self.depth)
        {
            return Err(bad(
                "deepstack_visual_indexes",
                format!("{:?}", self.deepstack_visual_indexes),
                &format!("block {i} does not exist (depth = {})", self.depth),
            ));
        }
        if !matches!(
            self.hidden_act.as_str(),
            "gelu_pytorch_tanh" | "gelu" | "gelu_new"
        ) {
            return Err(bad(
                "hidden_act",
                self.hidden_act.clone(),
                "fleet implements gelu_pytorch_tanh and gelu",
            ));
        }
        Ok(())
    }
}

/// A Qwen3-VL `config.json`: the text decoder's and the vision encoder's configs and the
/// special token ids.
#[derive(Debug, Clone)]
pub struct Qwen3VlConfig {
    /// `qwen3_vl` or `qwen3_vl_moe`.
    pub model_type: String,
    /// The decoder (`text_config`), with its tensors under `model.language_model.`.
    pub text: QwenConfig,
    /// The encoder (`vision_config`).
    pub vision: VisionConfig,
    /// `<|image_pad|>` (151655 in the released checkpoints).
    pub image_token_id: u32,
    /// `<|video_pad|>` (151656); video input is not implemented and is refused.
    pub video_token_id: u32,
    /// `<|vision_start|>` (151652).
    pub vision_start_token_id: u32,
    /// `<|vision_end|>` (151653).
    pub vision_end_token_id: u32,
}

impl Qwen3VlConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json(&read(path)?, path)
    }

    /// Parses the text of a Qwen3-VL `config.json`; `path` names it in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let raw = parse_value(text, path)?;
        let model_type = model_type(
            &raw,
            &["qwen3_vl", "qwen3_vl_moe"],
            "model_type qwen3_vl (Qwen3-VL dense) and qwen3_vl_moe (Qwen3-VL-30B-A3B and other \
             MoE sizes): the judge needs a Qwen3-VL checkpoint",
            path,
        )?;
        let section = |name: &str| -> Result<Value> {
            raw.get(name).cloned().ok_or_else(|| {
                ConfigError::bad(
                    path,
                    name,
                    "<missing>".into(),
                    "a Qwen3-VL config.json has text_config and vision_config sections",
                )
            })
        };
        let mut text_cfg = QwenConfig::from_vl_text(section("text_config")?, path)?;
        let vision: VisionConfig =
            serde_json::from_value(section("vision_config")?).map_err(|e| {
                ConfigError::BadJson {
                    path: path.to_path_buf(),
                    message: format!("vision_config: {e}"),
                }
            })?;
        vision.validate(path)?;
        if vision.out_hidden_size != text_cfg.hidden_size {
            return Err(ConfigError::bad(
                path,
                "vision_config.out_hidden_size",
                vision.out_hidden_size.to_string(),
                format!(
                    "must equal text_config.hidden_size = {}",
                    text_cfg.hidden_size
                ),
            ));
        }
        // The top level's own fields (the sections above were read whole already).
        let top: RawConfig = serde_json::from_value(raw).map_err(|e| bad_fields(path, "", e))?;
        // transformers reads the tie flag at the top level of a multimodal config.
        text_cfg.tie_word_embeddings = top.tie_word_embeddings().unwrap_or(false);
        // Special ids at the top level, else in text_config, else the released checkpoints'.
        let text_section = top.text_config.as_deref();
        let id = |get: fn(&RawConfig) -> Option<u32>, default: u32| {
            get(&top)
                .or_else(|| text_section.and_then(get))
                .unwrap_or(default)
        };
        Ok(Qwen3VlConfig {
            model_type,
            text: text_cfg,
            vision,
            image_token_id: id(|c| c.image_token_id, 151_655),
            video_token_id: id(|c| c.video_token_id, 151_656),
            vision_start_token_id: id(|c| c.vision_start_token_id, 151_652),
            vision_end_token_id: id(|c| c.vision_end_token_id, 151_653),
        })
    }

    /// Whether the decoder has MoE layers.
    pub fn is_moe(&self) -> bool {
        self.text.is_moe()
    }
}
