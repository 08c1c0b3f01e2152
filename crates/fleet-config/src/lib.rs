//! The `config.json` and `generation_config.json` of Hugging Face Qwen checkpoints, read once:
//! the schema that fleet-topology (which sizes and places a model before anything loads) and
//! fleet-models (which builds it) share, so that both read the same fields with the same names,
//! aliases and layouts. No candle, no model code.
//!
//! - [`RawConfig`] (with [`RawVisionConfig`], [`RopeParameters`]): the file as it is written,
//!   every field optional. fleet-topology's `ModelShape` reads it with planner defaults of its
//!   own.
//! - [`QwenConfig`]: the text decoder (Qwen2, Qwen2.5, Qwen3, and the `text_config` of
//!   Qwen3-VL dense and MoE), validated, with the values derived from it ([`QwenConfig::head_dim`],
//!   [`QwenConfig::num_kv_heads`], [`QwenConfig::rope_theta`], [`QwenConfig::layer_is_moe`],
//!   [`QwenConfig::classifier_labels`], ...).
//! - [`Qwen3VlConfig`]: a Qwen3-VL config with its [`VisionConfig`] and special token ids.
//! - [`GenerationConfig`]: the EOS ids and sampling defaults of `generation_config.json`.
//!
//! Every error ([`ConfigError`]) names the file, the field, the value and the fix.
//!
//! ```
//! use std::path::Path;
//! let text = r#"{"model_type": "qwen2", "vocab_size": 100, "hidden_size": 64,
//!     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
//!     "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}"#;
//! let cfg = fleet_config::QwenConfig::from_json(text, Path::new("config.json")).unwrap();
//! assert_eq!((cfg.head_dim(), cfg.num_kv_heads(), cfg.rope_theta()), (16, 2, 10_000.0));
//! ```

mod error;
mod generation;
mod raw;
mod text;
mod vl;

pub use error::{ConfigError, MissingField, Result};
pub use generation::GenerationConfig;
pub use raw::{classifier_labels, RawConfig, RawVisionConfig, RopeParameters};
pub use text::{QwenArch, QwenConfig};
pub use vl::{Qwen3VlConfig, VisionConfig};
