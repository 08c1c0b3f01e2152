//! Exact parameter counts from a checkpoint's safetensors headers.
//!
//! A safetensors file starts with an 8-byte little-endian header length and a JSON header that
//! names every tensor with its dtype and shape, so the parameters of each part of the model can
//! be counted without reading (or downloading) a byte of the weights themselves. Counts are in
//! elements: the plan's dtype decides the bytes, whatever dtype the files are stored in.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::TopologyError;

/// Largest header accepted (the format's own limit is 100 MB).
const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// Parameters of each part of a model, counted from its safetensors headers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CheckpointParams {
    /// The token embedding (`*embed_tokens*`).
    pub embed: u64,
    /// The vision tower and its mergers (`*visual*`), placed with the embedding.
    pub vision: u64,
    /// Each decoder layer (`*layers.N.*`), by index.
    pub layers: Vec<u64>,
    /// The final norm (`model.norm.*`, `*language_model.norm.*`).
    pub final_norm: u64,
    /// `lm_head.*`; 0 when the head is tied to the embedding.
    pub lm_head: u64,
    /// `score.*`: the classification head of a `*ForSequenceClassification` checkpoint (a
    /// reward model); 0 for a language model.
    pub score: u64,
    /// Tensors none of the above names match, placed with the embedding.
    pub other: u64,
    /// The files read.
    pub files: Vec<PathBuf>,
}

#[derive(Deserialize)]
struct TensorEntry {
    shape: Vec<u64>,
}

impl CheckpointParams {
    /// Counts the parameters of every `*.safetensors` file in `dir` (sharded checkpoints
    /// included). Errors when the directory has none, or a header is cut short or not JSON.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, TopologyError> {
        let dir = dir.as_ref();
        let io = |file: &Path, e: std::io::Error| TopologyError::Io {
            file: file.display().to_string(),
            message: e.to_string(),
        };
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(TopologyError::Checkpoint {
                file: dir.display().to_string(),
                message: "no *.safetensors file here; plan from config.json alone, or point \
                          --model at the checkpoint directory"
                    .into(),
            });
        }
        let mut out = CheckpointParams::default();
        for file in &files {
            for (name, elements) in read_header(file)? {
                out.add(&name, elements);
            }
        }
        out.files = files;
        Ok(out)
    }

    fn add(&mut self, name: &str, elements: u64) {
        if let Some(layer) = layer_index(name) {
            if self.layers.len() <= layer {
                self.layers.resize(layer + 1, 0);
            }
            self.layers[layer] += elements;
        } else if name.contains("embed_tokens") {
            self.embed += elements;
        } else if name.contains("visual") {
            self.vision += elements;
        } else if name.starts_with("lm_head") {
            self.lm_head += elements;
        } else if name.starts_with("score.") {
            self.score += elements;
        } else if name.ends_with("norm.weight") || name.ends_with("norm.bias") {
            self.final_norm += elements;
        } else {
            self.other += elements;
        }
    }

    /// All parameters.
    pub fn total(&self) -> u64 {
        self.embed
            + self.vision
            + self.layers.iter().sum::<u64>()
            + self.final_norm
            + self.lm_head
            + self.score
            + self.other
    }
}

/// The decoder-layer index in a name such as `model.layers.12.mlp.up_proj.weight` or
/// `model.language_model.layers.3.self_attn.q_proj.weight`; vision blocks are not layers.
fn layer_index(name: &str) -> Option<usize> {
    if name.contains("visual") {
        return None;
    }
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    rest.split('.').next()?.parse().ok()
}

/// Tensor names and element counts in one file's header.
fn read_header(file: &Path) -> Result<Vec<(String, u64)>, TopologyError> {
    let bad = |message: String| TopologyError::Checkpoint {
        file: file.display().to_string(),
        message,
    };
    let mut f = std::fs::File::open(file).map_err(|e| TopologyError::Io {
        file: file.display().to_string(),
        message: e.to_string(),
    })?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| bad("shorter than the 8-byte header length: the file is cut short".into()))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER_BYTES {
        return Err(bad(format!(
            "header length {len} bytes is not plausible: not a safetensors file"
        )));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header).map_err(|_| {
        bad(format!(
            "header of {len} bytes is cut short: download it again"
        ))
    })?;
    let entries: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let mut out = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if name == "__metadata__" {
            continue;
        }
        let entry: TensorEntry = serde_json::from_value(value)
            .map_err(|e| bad(format!("tensor `{name}` in the header: {e}")))?;
        out.push((name, entry.shape.iter().product()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_sorted_into_parts() {
        let mut p = CheckpointParams::default();
        for (name, n) in [
            ("model.embed_tokens.weight", 100),
            ("model.layers.0.self_attn.q_proj.weight", 10),
            ("model.layers.1.mlp.up_proj.weight", 12),
            ("model.language_model.layers.1.input_layernorm.weight", 1),
            ("model.visual.blocks.0.attn.qkv.weight", 7),
            ("model.norm.weight", 4),
            ("lm_head.weight", 100),
            ("model.rotary_emb.inv_freq", 3),
            ("score.weight", 2),
        ] {
            p.add(name, n);
        }
        assert_eq!(p.embed, 100);
        assert_eq!(p.layers, vec![10, 13]);
        assert_eq!(p.vision, 7);
        assert_eq!(p.final_norm, 4);
        assert_eq!(p.lm_head, 100);
        assert_eq!(p.other, 3);
        assert_eq!(p.score, 2);
        assert_eq!(p.total(), 239);
    }
}
