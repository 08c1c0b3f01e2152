//! `generation_config.json`: the EOS ids and sampling defaults a checkpoint ships with.

use std::path::Path;

use serde::Deserialize;

use crate::error::{parse, read, Result};

/// `generation_config.json`: the EOS ids and sampling defaults the checkpoint ships with.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct GenerationConfig {
    /// Stop ids (number or list).
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    /// Padding id.
    #[serde(default)]
    pub pad_token_id: Option<serde_json::Value>,
    /// Default temperature.
    pub temperature: Option<f64>,
    /// Default top-p.
    pub top_p: Option<f64>,
    /// Default top-k.
    pub top_k: Option<usize>,
    /// Whether the checkpoint samples by default.
    pub do_sample: Option<bool>,
}

impl GenerationConfig {
    /// Reads `generation_config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        parse(&read(path)?, path)
    }

    /// The EOS ids.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        json_ids(self.eos_token_id.as_ref())
    }

    /// The first pad id, if any.
    pub fn pad_token_id(&self) -> Option<u32> {
        json_ids(self.pad_token_id.as_ref()).first().copied()
    }
}

/// Reads a token-id field that may be a number, a list of numbers or null.
pub(crate) fn json_ids(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}
