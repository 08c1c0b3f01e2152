//! The text decoder of a `config.json`: Qwen2 / Qwen2.5 / Qwen3 dense checkpoints as the hub
//! ships them, and the `text_config` of Qwen3-VL (dense and MoE).
//!
//! Both the transformers 4.x layout (`rope_theta`, `rope_scaling`, `torch_dtype`) and the 5.x
//! layout (`rope_parameters`, `dtype`) deserialize.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use crate::error::{
    bad_fields, model_type, parse_value, read, required, ConfigError, MissingField, Result,
};
use crate::raw::{classifier_labels, RawConfig, RopeParameters};

/// Which member of the Qwen family a checkpoint is. They share one decoder; the differences are
/// flags on [`QwenConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QwenArch {
    /// `qwen2` (Qwen2, Qwen2.5): bias on q/k/v projections, no q/k norm.
    Qwen2,
    /// `qwen3`: RMSNorm on q and k per head, `attention_bias` flag, explicit `head_dim`.
    Qwen3,
}

/// The fields of `config.json` that the decoder needs, as named by transformers.
///
/// It deserializes through [`RawConfig`]: a required field that is missing is serde's
/// `missing field` error, absent optional ones take transformers' defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "RawConfig")]
pub struct QwenConfig {
    /// e.g. `["Qwen2ForCausalLM"]`; `Qwen2ForSequenceClassification` for a reward model.
    pub architectures: Vec<String>,
    /// Labels of a sequence classifier (transformers' `id2label`; its size is `num_labels`).
    pub id2label: Option<BTreeMap<String, String>>,
    /// Labels of a sequence classifier when `id2label` is absent.
    pub num_labels: Option<usize>,
    /// `qwen2` or `qwen3`.
    pub model_type: String,
    /// Rows of the embedding and lm_head.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention). Defaults to `num_attention_heads`.
    pub num_key_value_heads: Option<usize>,
    /// Per-head width (Qwen3 sets it; Qwen2 derives it).
    pub head_dim: Option<usize>,
    /// Longest sequence the positions cover.
    pub max_position_embeddings: usize,
    /// RoPE base (transformers 4.x layout).
    pub rope_theta: Option<f64>,
    /// RoPE scaling (4.x layout); only `null` is implemented.
    pub rope_scaling: Option<serde_json::Value>,
    /// RoPE section (5.x layout).
    pub rope_parameters: Option<RopeParameters>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// lm_head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// MLP activation; fleet implements `silu` (the default).
    pub hidden_act: String,
    /// Qwen3's bias flag on q/k/v/o; Qwen2 always has q/k/v bias.
    pub attention_bias: Option<bool>,
    /// Sliding-window attention; fleet refuses configs that turn it on.
    pub use_sliding_window: bool,
    /// The dtype the weights were saved in (4.x name).
    pub torch_dtype: Option<String>,
    /// The dtype the weights were saved in (5.x name).
    pub dtype: Option<String>,
    /// Default EOS id(s); generation_config.json takes precedence.
    pub eos_token_id: Option<serde_json::Value>,
    /// Experts per MoE layer (Qwen3-VL-30B-A3B: 128). transformers 5 saves it as
    /// `num_local_experts`.
    pub num_experts: Option<usize>,
    /// Experts each token is routed to (top-k).
    pub num_experts_per_tok: Option<usize>,
    /// Width of one expert's MLP.
    pub moe_intermediate_size: Option<usize>,
    /// Every `decoder_sparse_step`-th layer is MoE (transformers' default 1: all of them).
    pub decoder_sparse_step: Option<usize>,
    /// Layers that keep a dense MLP of `intermediate_size` in a MoE model.
    pub mlp_only_layers: Vec<usize>,
    /// Where the decoder's tensors sit in the checkpoint: `model.` for the text models,
    /// `model.language_model.` inside Qwen3-VL (set by the loader, not read from the file).
    pub weight_prefix: Option<String>,
}

impl TryFrom<RawConfig> for QwenConfig {
    type Error = MissingField;

    /// The required fields are taken in the order serde would report them missing.
    fn try_from(raw: RawConfig) -> Result<Self, MissingField> {
        Ok(QwenConfig {
            architectures: raw.architectures.unwrap_or_default(),
            id2label: raw.id2label,
            num_labels: raw.num_labels,
            model_type: required(raw.model_type, "model_type")?,
            vocab_size: required(raw.vocab_size, "vocab_size")?,
            hidden_size: required(raw.hidden_size, "hidden_size")?,
            intermediate_size: required(raw.intermediate_size, "intermediate_size")?,
            num_hidden_layers: required(raw.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads: required(raw.num_attention_heads, "num_attention_heads")?,
            num_key_value_heads: raw.num_key_value_heads,
            head_dim: raw.head_dim,
            max_position_embeddings: required(
                raw.max_position_embeddings,
                "max_position_embeddings",
            )?,
            rope_theta: raw.rope_theta,
            rope_scaling: raw.rope_scaling,
            rope_parameters: raw.rope_parameters,
            rms_norm_eps: required(raw.rms_norm_eps, "rms_norm_eps")?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            hidden_act: raw.hidden_act.unwrap_or_else(|| "silu".to_string()),
            attention_bias: raw.attention_bias,
            use_sliding_window: raw.use_sliding_window.unwrap_or(false),
            torch_dtype: raw.torch_dtype,
            dtype: raw.dtype,
            eos_token_id: raw.eos_token_id,
            num_experts: raw.num_experts,
            num_experts_per_tok: raw.num_experts_per_tok,
            moe_intermediate_size: raw.moe_intermediate_size,
            decoder_sparse_step: raw.decoder_sparse_step,
            mlp_only_layers: raw.mlp_only_layers.unwrap_or_default(),
            weight_prefix: None,
        })
    }
}

impl QwenConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json(&read(path)?, path)
    }

    /// Parses and validates the text of a `config.json`; `path` names it in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let raw = parse_value(text, path)?;
        model_type(
            &raw,
            &["qwen2", "qwen3"],
            "model_type qwen2 (Qwen2, Qwen2.5) and qwen3 (Qwen3 dense)",
            path,
        )?;
        let cfg: QwenConfig = serde_json::from_value(raw).map_err(|e| bad_fields(path, "", e))?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Parses the `text_config` of a Qwen3-VL `config.json` (dense `qwen3_vl_text` or MoE
    /// `qwen3_vl_moe_text`). Its RoPE must name `mrope_section` (in `rope_scaling`, the 4.x
    /// layout, or `rope_parameters`, the 5.x layout): without it the decoder would silently run
    /// 1-D RoPE over image positions, so its absence is an error.
    pub fn from_vl_text(raw: serde_json::Value, path: &Path) -> Result<Self> {
        let model_type = raw
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("<missing>")
            .to_string();
        if !matches!(model_type.as_str(), "qwen3_vl_text" | "qwen3_vl_moe_text") {
            return Err(ConfigError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                arch: format!("text_config.model_type={model_type}"),
                supported: "text_config.model_type qwen3_vl_text (Qwen3-VL dense) and \
                            qwen3_vl_moe_text (Qwen3-VL MoE)"
                    .into(),
            });
        }
        let mut cfg: QwenConfig =
            serde_json::from_value(raw).map_err(|e| bad_fields(path, "text_config: ", e))?;
        cfg.weight_prefix = Some("model.language_model.".into());
        let section = cfg.mrope_section().ok_or_else(|| {
            ConfigError::bad(
                path,
                "text_config.rope_scaling.mrope_section",
                "<missing>".into(),
                "Qwen3-VL needs its multimodal RoPE sections (the released checkpoints have \
                 [24, 20, 20] in text_config.rope_scaling, or rope_parameters in transformers \
                 5 files); without them image positions would be wrong: use the config.json \
                 published with the checkpoint",
            )
        })?;
        cfg.validate(path)?;
        let half = cfg.head_dim() / 2;
        if section.len() != 3 || section.iter().sum::<usize>() != half {
            return Err(ConfigError::bad(
                path,
                "text_config.mrope_section",
                format!("{section:?}"),
                format!(
                    "must be three numbers (temporal, height, width) summing to head_dim / 2 = {half}"
                ),
            ));
        }
        // The interleaving puts height and width on every third slot below 3 * section.
        if 3 * section[1] > half || 3 * section[2] > half {
            return Err(ConfigError::bad(
                path,
                "text_config.mrope_section",
                format!("{section:?}"),
                format!(
                    "the interleaved layout needs 3 x height and 3 x width sections within \
                     head_dim / 2 = {half}"
                ),
            ));
        }
        if cfg.is_moe() {
            let bad = |field: &str, hint: &str| {
                ConfigError::bad(
                    path,
                    format!("text_config.{field}"),
                    "<missing or 0>".into(),
                    hint,
                )
            };
            if cfg.num_experts_per_tok.unwrap_or(0) == 0 {
                return Err(bad(
                    "num_experts_per_tok",
                    "a MoE model routes each token to at least one expert",
                ));
            }
            if cfg.num_experts_per_tok.unwrap_or(0) > cfg.num_experts.unwrap_or(0) {
                return Err(ConfigError::bad(
                    path,
                    "text_config.num_experts_per_tok",
                    format!("{:?}", cfg.num_experts_per_tok),
                    format!("cannot exceed num_experts = {:?}", cfg.num_experts),
                ));
            }
            if cfg.moe_intermediate_size.unwrap_or(0) == 0 {
                return Err(bad(
                    "moe_intermediate_size",
                    "the width of one expert's MLP",
                ));
            }
            if cfg.decoder_sparse_step == Some(0) {
                return Err(bad("decoder_sparse_step", "must be at least 1"));
            }
        }
        Ok(cfg)
    }

    /// The multimodal RoPE sections (temporal, height, width), from `rope_scaling` (4.x) or
    /// `rope_parameters` (5.x); `None` for 1-D RoPE.
    pub fn mrope_section(&self) -> Option<Vec<usize>> {
        let from_scaling = self
            .rope_scaling
            .as_ref()
            .and_then(|s| s.get("mrope_section"))
            .and_then(|v| serde_json::from_value::<Vec<usize>>(v.clone()).ok());
        from_scaling.or_else(|| {
            self.rope_parameters
                .as_ref()
                .and_then(|r| r.mrope_section.clone())
        })
    }

    /// Whether any layer is a mixture of experts.
    pub fn is_moe(&self) -> bool {
        self.num_experts.unwrap_or(0) > 0
    }

    /// Whether decoder layer `i` has a sparse MoE block (transformers' rule: not in
    /// `mlp_only_layers`, experts configured, and `(i + 1) % decoder_sparse_step == 0`).
    pub fn layer_is_moe(&self, i: usize) -> bool {
        self.is_moe()
            && !self.mlp_only_layers.contains(&i)
            && (i + 1).is_multiple_of(self.decoder_sparse_step.unwrap_or(1).max(1))
    }

    /// The tensor-name prefix of the decoder (`model.` unless set by a multimodal loader).
    pub fn prefix(&self) -> &str {
        self.weight_prefix.as_deref().unwrap_or("model.")
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad =
            |field: &str, value: String, hint: &str| ConfigError::bad(path, field, value, hint);
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(bad(field, "0".into(), "must be positive"));
            }
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(bad(
                "hidden_size",
                self.hidden_size.to_string(),
                "must be a multiple of num_attention_heads when head_dim is not given",
            ));
        }
        let kv = self.num_kv_heads();
        if kv == 0 || !self.num_attention_heads.is_multiple_of(kv) {
            return Err(bad(
                "num_key_value_heads",
                kv.to_string(),
                "must divide num_attention_heads",
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(bad(
                "head_dim",
                self.head_dim().to_string(),
                "RoPE needs an even head_dim",
            ));
        }
        if self.hidden_act != "silu" {
            return Err(bad(
                "hidden_act",
                self.hidden_act.clone(),
                "fleet implements `silu`",
            ));
        }
        if self.use_sliding_window {
            return Err(bad(
                "use_sliding_window",
                "true".into(),
                "sliding-window attention is not implemented; Qwen2.5 and Qwen3 ship it off",
            ));
        }
        if let Some(s) = &self.rope_scaling {
            // Qwen3-VL's 4.x layout keeps its multimodal sections here with rope_type default.
            let mrope_only = s.get("mrope_section").is_some()
                && s.get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(|t| t.as_str())
                    .is_none_or(|t| t == "default");
            if !s.is_null() && !mrope_only {
                return Err(bad(
                    "rope_scaling",
                    s.to_string(),
                    "only unscaled RoPE (null) is implemented; remove it to run at the native context",
                ));
            }
        }
        if let Some(t) = self
            .rope_parameters
            .as_ref()
            .and_then(|r| r.rope_type.as_deref())
        {
            if t != "default" {
                return Err(bad(
                    "rope_parameters.rope_type",
                    t.to_string(),
                    "only `default` RoPE is implemented",
                ));
            }
        }
        if self.rope_theta() <= 0.0 {
            return Err(bad(
                "rope_theta",
                self.rope_theta().to_string(),
                "must be positive",
            ));
        }
        Ok(())
    }

    /// Outputs of the sequence-classification head when the checkpoint is a
    /// `*ForSequenceClassification` (a reward model); `None` for a causal LM. See
    /// [`classifier_labels`](crate::classifier_labels).
    pub fn classifier_labels(&self) -> Option<usize> {
        classifier_labels(&self.architectures, self.id2label.as_ref(), self.num_labels)
    }

    /// Qwen2 or Qwen3 (Qwen3-VL's text decoder is a Qwen3).
    pub fn arch(&self) -> QwenArch {
        if self.model_type == "qwen3" || self.model_type.starts_with("qwen3_vl") {
            QwenArch::Qwen3
        } else {
            QwenArch::Qwen2
        }
    }

    /// Key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// RoPE base from whichever layout the file uses (transformers' default 10000 otherwise).
    pub fn rope_theta(&self) -> f64 {
        self.rope_theta
            .or_else(|| self.rope_parameters.as_ref().and_then(|r| r.rope_theta))
            .unwrap_or(10_000.0)
    }

    /// Whether q/k/v projections carry a bias.
    pub fn qkv_bias(&self) -> bool {
        match self.arch() {
            QwenArch::Qwen2 => true,
            QwenArch::Qwen3 => self.attention_bias.unwrap_or(false),
        }
    }

    /// Whether the output projection carries a bias.
    pub fn o_bias(&self) -> bool {
        match self.arch() {
            QwenArch::Qwen2 => false,
            QwenArch::Qwen3 => self.attention_bias.unwrap_or(false),
        }
    }

    /// Number of parameters, counting a tied matrix once.
    pub fn num_parameters(&self) -> u64 {
        let h = self.hidden_size as u64;
        let hd = self.head_dim() as u64;
        let q = self.num_attention_heads as u64 * hd;
        let kv = self.num_kv_heads() as u64 * hd;
        let i = self.intermediate_size as u64;
        let mut attn = h * q + 2 * h * kv + q * h;
        if self.qkv_bias() {
            attn += q + 2 * kv;
        }
        if self.o_bias() {
            attn += h;
        }
        if self.arch() == QwenArch::Qwen3 {
            attn += 2 * hd;
        }
        let embed = self.vocab_size as u64 * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        let layers: u64 = (0..self.num_hidden_layers)
            .map(|l| {
                let mlp = if self.layer_is_moe(l) {
                    let e = self.num_experts.unwrap_or(0) as u64;
                    let mi = self.moe_intermediate_size.unwrap_or(0) as u64;
                    e * 3 * h * mi + e * h
                } else {
                    3 * h * i
                };
                attn + mlp + 2 * h
            })
            .sum();
        embed + head + h + layers
    }

    /// EOS ids named by config.json (a number or a list).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        crate::generation::json_ids(self.eos_token_id.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN25_05B: &str = r#"{
      "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
      "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
      "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
      "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
      "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
      "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
      "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false,
      "vocab_size": 151936}"#;

    #[test]
    fn parses_qwen25_config() {
        let c = QwenConfig::from_json(QWEN25_05B, Path::new("config.json")).unwrap();
        assert_eq!(c.arch(), QwenArch::Qwen2);
        assert_eq!(c.head_dim(), 64);
        assert_eq!(c.num_kv_heads(), 2);
        assert!(c.tie_word_embeddings && c.qkv_bias() && !c.o_bias());
        assert_eq!(c.rope_theta(), 1e6);
        assert_eq!(c.eos_token_ids(), vec![151645]);
        // Qwen2.5-0.5B has 494M parameters.
        let p = c.num_parameters();
        assert!((490_000_000..500_000_000).contains(&p), "{p}");
    }

    #[test]
    fn parses_v5_rope_parameters() {
        let text = QWEN25_05B.replace(
            r#""rope_theta": 1000000.0,"#,
            r#""rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"},"#,
        );
        let c = QwenConfig::from_json(&text, Path::new("config.json")).unwrap();
        assert_eq!(c.rope_theta(), 5000.0);
    }

    #[test]
    fn errors_name_the_field() {
        let text = QWEN25_05B.replace(r#""num_key_value_heads": 2"#, r#""num_key_value_heads": 3"#);
        let e = QwenConfig::from_json(&text, Path::new("m/config.json"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("m/config.json") && e.contains("num_key_value_heads"),
            "{e}"
        );

        let text = QWEN25_05B.replace(r#""hidden_size": 896,"#, "");
        let e = QwenConfig::from_json(&text, Path::new("config.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_size"), "{e}");

        let text = QWEN25_05B.replace(r#""model_type": "qwen2""#, r#""model_type": "llama""#);
        let e = QwenConfig::from_json(&text, Path::new("config.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("llama") && e.contains("qwen2"), "{e}");

        let text = QWEN25_05B.replace(
            r#""use_sliding_window": false"#,
            r#""use_sliding_window": true"#,
        );
        let e = QwenConfig::from_json(&text, Path::new("config.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("use_sliding_window"), "{e}");

        let e = QwenConfig::from_json("{", Path::new("config.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not valid JSON"), "{e}");
    }
}
