//! LoRA adapters as PEFT writes and reads them (`adapter_config.json`,
//! `adapter_model.safetensors`): the config, the tensor names, and the delta
//! `W' = W + scaling · B·A` that [`crate::qwen::train::TrainableQwen::with_lora`] trains.
//!
//! A target module `m` (PEFT's `target_modules`: the last part of a linear layer's name, such
//! as `q_proj` or `down_proj`) of layer `i` gets `A` `[r, in]` and `B` `[out, r]`, saved as
//! `base_model.model.<module path>.lora_A.weight` and `.lora_B.weight`; `scaling` is
//! `lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`). New adapters start as PEFT's:
//! `A` Kaiming-uniform with `a = sqrt(5)` (uniform in `±1/sqrt(in)`), `B` zero, so the model
//! starts as the base. Training runs PEFT's unmerged forward, `x·Wᵀ + scaling·(dropout(x)·Aᵀ)·Bᵀ`
//! (no product of the frozen weight's size is made or differentiated); the rollouts' copy and
//! the merged export read `W + scaling·B·A`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// The prefix PEFT puts before a module's path in the adapter file.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// The linear layers of a Qwen decoder block that adapters can target.
pub const TARGETABLE: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// PEFT's `LoraConfig` as `adapter_config.json` holds it (the fields fleet reads; others are
/// kept when written back).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// The rank.
    pub r: usize,
    /// The scale's numerator (PEFT default 8).
    #[serde(default = "default_alpha")]
    pub lora_alpha: f64,
    /// Dropout on the adapter's input (PEFT default 0).
    #[serde(default)]
    pub lora_dropout: f64,
    /// The modules adapted: names from [`TARGETABLE`], or `"all-linear"`.
    pub target_modules: TargetModules,
    /// `lora_alpha / sqrt(r)` instead of `lora_alpha / r`.
    #[serde(default)]
    pub use_rslora: bool,
    /// Only `"none"` (no bias trained).
    #[serde(default = "default_bias")]
    pub bias: String,
    /// Weights stored transposed (GPT-2's Conv1D); refused.
    #[serde(default)]
    pub fan_in_fan_out: bool,
    /// DoRA; refused.
    #[serde(default)]
    pub use_dora: bool,
    /// Extra modules trained in full; refused.
    #[serde(default)]
    pub modules_to_save: Option<Vec<String>>,
    /// A subset of layers; refused.
    #[serde(default)]
    pub layers_to_transform: Option<serde_json::Value>,
    /// Per-module ranks; refused unless empty.
    #[serde(default)]
    pub rank_pattern: Option<serde_json::Map<String, serde_json::Value>>,
    /// Per-module alphas; refused unless empty.
    #[serde(default)]
    pub alpha_pattern: Option<serde_json::Map<String, serde_json::Value>>,
    /// `LORA`.
    #[serde(default = "default_peft_type")]
    pub peft_type: String,
    /// `CAUSAL_LM`.
    #[serde(default = "default_task_type")]
    pub task_type: Option<String>,
    /// The base model (written for PEFT's loader; a directory or hub id).
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    /// Whether the adapters are loaded for inference (PEFT writes `true`).
    #[serde(default)]
    pub inference_mode: bool,
}

/// `target_modules` as PEFT takes it: a list of names, or one string (`"all-linear"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    /// Module names.
    List(Vec<String>),
    /// One name, or `all-linear`.
    One(String),
}

fn default_alpha() -> f64 {
    8.0
}
fn default_bias() -> String {
    "none".into()
}
fn default_peft_type() -> String {
    "LORA".into()
}
fn default_task_type() -> Option<String> {
    Some("CAUSAL_LM".into())
}

impl LoraConfig {
    /// A config for `r`, `lora_alpha` and `target_modules`, PEFT's defaults elsewhere.
    pub fn new(r: usize, lora_alpha: f64, target_modules: &[&str]) -> Self {
        LoraConfig {
            r,
            lora_alpha,
            lora_dropout: 0.0,
            target_modules: TargetModules::List(
                target_modules.iter().map(|s| s.to_string()).collect(),
            ),
            use_rslora: false,
            bias: default_bias(),
            fan_in_fan_out: false,
            use_dora: false,
            modules_to_save: None,
            layers_to_transform: None,
            rank_pattern: None,
            alpha_pattern: None,
            peft_type: default_peft_type(),
            task_type: default_task_type(),
            base_model_name_or_path: None,
            inference_mode: true,
        }
    }

    /// Reads `dir/adapter_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join(CONFIG_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            ModelError::BadInput(format!(
                "{}: {e}; a PEFT adapter directory holds adapter_config.json and \
                 adapter_model.safetensors",
                path.display()
            ))
        })?;
        let c: LoraConfig = serde_json::from_str(&text)
            .map_err(|e| ModelError::BadInput(format!("{}: {e}", path.display())))?;
        c.validate()
            .map_err(|e| ModelError::BadInput(format!("{}: {e}", path.display())))?;
        Ok(c)
    }

    /// The delta's scale.
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.lora_alpha / (self.r as f64).sqrt()
        } else {
            self.lora_alpha / self.r as f64
        }
    }

    /// The module names adapted.
    pub fn modules(&self) -> Vec<String> {
        match &self.target_modules {
            TargetModules::One(s) if s == "all-linear" => {
                TARGETABLE.iter().map(|s| s.to_string()).collect()
            }
            TargetModules::One(s) => vec![s.clone()],
            TargetModules::List(v) => v.clone(),
        }
    }

    /// Checks what fleet can train; the message names the field and the fix.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.peft_type != "LORA" {
            return Err(format!(
                "peft_type = {:?}: only LORA adapters",
                self.peft_type
            ));
        }
        if self.r == 0 {
            return Err("r = 0: the rank must be at least 1".into());
        }
        if !self.lora_alpha.is_finite() {
            return Err(format!("lora_alpha = {}: a finite number", self.lora_alpha));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(format!(
                "lora_dropout = {}: a probability, 0 <= lora_dropout < 1",
                self.lora_dropout
            ));
        }
        if self.bias != "none" {
            return Err(format!("bias = {:?}: only \"none\"", self.bias));
        }
        if self.fan_in_fan_out || self.use_dora {
            return Err("fan_in_fan_out and use_dora are not supported: set them false".into());
        }
        if self.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err("modules_to_save is not supported: leave it unset".into());
        }
        if [&self.rank_pattern, &self.alpha_pattern]
            .iter()
            .any(|p| p.as_ref().is_some_and(|m| !m.is_empty()))
        {
            return Err(
                "rank_pattern and alpha_pattern are not supported: leave them empty".into(),
            );
        }
        if self
            .layers_to_transform
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return Err("layers_to_transform is not supported: adapt every layer".into());
        }
        let modules = self.modules();
        if modules.is_empty() {
            return Err(format!(
                "target_modules names no module: give some of {}",
                TARGETABLE.join(", ")
            ));
        }
        for m in &modules {
            if !TARGETABLE.contains(&m.as_str()) {
                return Err(format!(
                    "target_modules names {m:?}, not a linear layer of a Qwen block: the \
                     model's are {} (or \"all-linear\")",
                    TARGETABLE.join(", ")
                ));
            }
        }
        Ok(())
    }
}

/// Writes an adapter as PEFT does into `dir` (created if needed): `adapter_config.json`
/// (`config` naming `base` as `base_model_name_or_path`, for inference) and
/// `adapter_model.safetensors` (`tensors`, PEFT's names), each through a temporary file renamed
/// into place. The one writer of adapter files: `TrainableQwen::save_adapter` and gspo-train's
/// checkpoints.
pub fn write_adapter(
    dir: &Path,
    config: &LoraConfig,
    base: &str,
    tensors: &std::collections::HashMap<String, candle_core::Tensor>,
) -> Result<()> {
    let io = |e: std::io::Error| ModelError::BadInput(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut config = config.clone();
    config.base_model_name_or_path = Some(base.to_string());
    config.inference_mode = true;
    // As PEFT writes them: its loader reads the patterns as dicts (`null` fails) and the saved
    // targets are the modules `all-linear` matched.
    config.rank_pattern.get_or_insert_with(Default::default);
    config.alpha_pattern.get_or_insert_with(Default::default);
    let mut modules = config.modules();
    modules.sort();
    config.target_modules = TargetModules::List(modules);
    let json = serde_json::to_string_pretty(&config)
        .map_err(|e| ModelError::BadInput(format!("adapter_config.json: {e}")))?;
    let tmp = dir.join(".adapter_config.json.tmp");
    std::fs::write(&tmp, json + "\n").map_err(io)?;
    std::fs::rename(&tmp, dir.join(CONFIG_FILE)).map_err(io)?;
    let tmp = dir.join(".adapter_model.safetensors.tmp");
    candle_core::safetensors::save(tensors, &tmp)?;
    std::fs::rename(&tmp, dir.join(WEIGHTS_FILE)).map_err(io)?;
    Ok(())
}

/// PEFT's adapter config file.
pub const CONFIG_FILE: &str = "adapter_config.json";

/// PEFT's adapter weights file.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// The saved names of a module's adapter (`module`: the weight's path without `.weight`).
pub fn adapter_names(module: &str) -> (String, String) {
    (
        format!("{PEFT_PREFIX}{module}.lora_A.weight"),
        format!("{PEFT_PREFIX}{module}.lora_B.weight"),
    )
}

/// Which target module a weight name is: `model.layers.<i>.<self_attn|mlp>.<m>.weight` with
/// `m` among `modules`; returns the layer and the module path (without `.weight`).
pub fn target_of(name: &str, modules: &[String]) -> Option<(usize, String)> {
    let path = name.strip_suffix(".weight")?;
    let last = path.rsplit('.').next()?;
    if !modules.iter().any(|m| m == last) {
        return None;
    }
    let rest = path.split(".layers.").nth(1)?;
    let layer = rest.split('.').next()?.parse().ok()?;
    Some((layer, path.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_configs_read_and_bad_ones_say_what_to_change() {
        let text = r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
            "target_modules": ["q_proj", "v_proj"], "bias": "none", "task_type": "CAUSAL_LM",
            "fan_in_fan_out": false, "inference_mode": true, "revision": null}"#;
        let c: LoraConfig = serde_json::from_str(text).unwrap();
        c.validate().unwrap();
        assert_eq!(c.scaling(), 2.0);
        assert_eq!(c.modules(), vec!["q_proj", "v_proj"]);
        let mut all = c.clone();
        all.target_modules = TargetModules::One("all-linear".into());
        assert_eq!(all.modules().len(), 7);
        let mut bad = c.clone();
        bad.target_modules = TargetModules::List(vec!["qkv".into()]);
        let e = bad.validate().unwrap_err();
        assert!(e.contains("\"qkv\"") && e.contains("q_proj, k_proj"), "{e}");
        let mut drop = c;
        drop.lora_dropout = 0.05;
        drop.validate().unwrap();
        drop.lora_dropout = 1.0;
        assert!(drop
            .validate()
            .unwrap_err()
            .contains("0 <= lora_dropout < 1"));
    }

    #[test]
    fn targets_are_found_by_module_name() {
        let m = vec!["q_proj".to_string(), "down_proj".to_string()];
        assert_eq!(
            target_of("model.layers.3.self_attn.q_proj.weight", &m),
            Some((3, "model.layers.3.self_attn.q_proj".into()))
        );
        assert_eq!(target_of("model.layers.3.self_attn.q_proj.bias", &m), None);
        assert_eq!(target_of("model.layers.0.mlp.up_proj.weight", &m), None);
        assert_eq!(
            adapter_names("model.layers.0.mlp.down_proj").0,
            "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
        );
    }
}
