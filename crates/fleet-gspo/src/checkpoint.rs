//! Checkpoints: the policy in Hugging Face layout (loadable by transformers and by fleet), the
//! optimizer's moments and the trainer's state, written whole or not at all.
//!
//! Layout of `output_dir`:
//!
//! ```text
//! checkpoint-<step>/          one per save, the last `save_total_limit` kept
//!   config.json               the base checkpoint's, torch_dtype float32
//!   model.safetensors         the f32 master weights, checkpoint names
//!   tokenizer.json, tokenizer_config.json, generation_config.json   copied from the base
//!   optimizer.safetensors     AdamW moments and per-parameter steps
//!   trainer_state.json        step, data cursor, generation batch, tokens, base model
//! latest                      the name of the newest complete checkpoint
//! ```
//!
//! With LoRA (`use_peft`) a checkpoint holds PEFT's adapter files instead of `config.json` and
//! `model.safetensors`: `adapter_config.json` (naming the base model) and
//! `adapter_model.safetensors` (the adapters, PEFT's names), which
//! `PeftModel.from_pretrained(base, checkpoint)` loads.
//!
//! A checkpoint is assembled in a hidden temporary directory and renamed into place, then
//! `latest` is replaced atomically: a kill at any moment leaves the previous checkpoint and
//! pointer intact. Weights are saved in f32 so that a resume continues bit for bit.

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use fleet_models::{CheckpointFiles, CheckpointIdentity};
use serde::{Deserialize, Serialize};

use crate::dataset::DataCursor;
use crate::optim::OptimizerState;

/// Errors of saving and loading checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("checkpoint {path}: {message}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// `latest` names no checkpoint, or there is none to resume.
    #[error("nothing to resume in {dir}: {message}")]
    NothingToResume {
        /// The output directory.
        dir: PathBuf,
        /// Why.
        message: String,
    },
    /// A checkpoint's files are cut short or unreadable (a kill or a full disk while it was
    /// written by a fleet without atomic checkpoints, or damage since).
    #[error("checkpoint file {path} is damaged: {message}")]
    Damaged {
        /// The damaged file or checkpoint.
        path: PathBuf,
        /// What is wrong, and which checkpoint to resume from instead.
        message: String,
    },
    /// The checkpoint was trained from another base model.
    #[error("checkpoint {path} was trained from another model ({message}); resume with the model it was trained from, or train into another output_dir")]
    OtherModel {
        /// The checkpoint.
        path: PathBuf,
        /// Which digests differ.
        message: String,
    },
    /// The checkpoint's rollouts were drawn by another version of the sampler, whose top-k /
    /// top-p draws differ for the same seed.
    #[error("checkpoint {path} sampled its rollouts with sampler v{found} and this fleet samples top-k / top-p rows with v{current}, which draws other tokens for the same seed: resume with the fleet that wrote it, or train into another output_dir")]
    OtherSampler {
        /// The checkpoint.
        path: PathBuf,
        /// Its sampler version.
        found: u32,
        /// This fleet's ([`fleet_models::ops::SAMPLER_VERSION`]).
        current: u32,
    },
    /// The optimizer state could not be saved or loaded.
    #[error(transparent)]
    Optim(#[from] crate::optim::OptimError),
    /// A file of the output directory could not be written.
    #[error(transparent)]
    Runs(#[from] fleet_runs::RunsError),
}

/// Where a run stands: what a resume needs besides weights and optimizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps done.
    pub step: u64,
    /// Generation batches drawn.
    pub generation_batch: u64,
    /// Where the prompt sampler continues.
    pub cursor: DataCursor,
    /// Prompt + completion tokens seen so far (TRL's `num_tokens`).
    pub num_tokens: u64,
    /// The model training started from (weights, config and tokenizer by content).
    pub base_model: CheckpointIdentity,
    /// The base model as given (path or hub id), for messages.
    pub base_model_id: String,
    /// The commit of fleet that wrote the checkpoint (embedded when it was built).
    pub commit: String,
    /// The version of fleet that wrote the checkpoint (absent in older checkpoints).
    #[serde(default)]
    pub fleet_version: String,
    /// The sampler version that drew the rollouts ([`fleet_models::ops::SAMPLER_VERSION`]; 1
    /// in older checkpoints).
    #[serde(default = "first_sampler_version")]
    pub sampler_version: u32,
    /// The best value of `metric_for_best_model` so far (HF's `best_metric`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_metric: Option<f64>,
    /// The checkpoint that holds it, a name in the output directory (HF's
    /// `best_model_checkpoint`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_model_checkpoint: Option<String>,
    /// The step of the best evaluation (HF's `best_global_step`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_global_step: Option<u64>,
}

/// The sampler version of checkpoints written before versions were recorded.
fn first_sampler_version() -> u32 {
    1
}

/// Whether the rollouts after resuming from `state` draw as the ones before did: a run that
/// filters its samples (top-k or top-p: `filtered`) must resume under the sampler version that
/// drew its rollouts; greedy and plain temperature draws are the same in every version. Marks
/// the state with this fleet's version.
pub fn check_sampler(
    checkpoint: &Path,
    state: &mut TrainerState,
    filtered: bool,
) -> Result<(), CheckpointError> {
    let current = fleet_models::ops::SAMPLER_VERSION;
    if filtered && state.sampler_version != current {
        return Err(CheckpointError::OtherSampler {
            path: checkpoint.to_path_buf(),
            found: state.sampler_version,
            current,
        });
    }
    state.sampler_version = current;
    Ok(())
}

/// The file `latest` in an output directory.
pub const LATEST: &str = "latest";

/// The file `best` in an output directory: the name of the checkpoint with the best
/// `metric_for_best_model` (HF's `best_model_checkpoint`).
pub const BEST: &str = "best";
/// Prefix of checkpoint directories.
pub const PREFIX: &str = "checkpoint-";

fn io(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// What to write into a checkpoint.
pub struct CheckpointContents<'a> {
    /// The master weights by checkpoint name.
    pub weights: Vec<(String, Tensor)>,
    /// The optimizer's state.
    pub optimizer: &'a OptimizerState,
    /// The trainer's state.
    pub state: &'a TrainerState,
    /// The base checkpoint's files (config and tokenizer are copied from it).
    pub base: &'a CheckpointFiles,
    /// With LoRA: the adapters' PEFT config; `weights` are then the adapters.
    pub adapter: Option<&'a fleet_models::lora::LoraConfig>,
}

/// The weights file of a checkpoint: PEFT's adapter file with LoRA, else the model's.
pub fn weights_file(checkpoint: &Path) -> PathBuf {
    let adapter = checkpoint.join(ADAPTER_WEIGHTS);
    if adapter.exists() {
        adapter
    } else {
        checkpoint.join("model.safetensors")
    }
}

/// PEFT's adapter weights file.
pub const ADAPTER_WEIGHTS: &str = fleet_models::lora::WEIGHTS_FILE;

/// Writes `checkpoint-<step>` into `output_dir`, points `latest` at it (and `best` when
/// `state.best_model_checkpoint` names it), and removes the oldest checkpoints beyond `keep`
/// (None: keep all) but the best one, as HF's Trainer keeps it. Returns the checkpoint's path.
pub fn save(
    output_dir: &Path,
    contents: &CheckpointContents<'_>,
    keep: Option<usize>,
) -> Result<PathBuf, CheckpointError> {
    let name = format!("{PREFIX}{}", contents.state.step);
    // A checkpoint of this step from a run that was killed after writing it is replaced.
    let target = install_dir(output_dir, &name, |dir| write_into(dir, contents))?;
    fleet_runs::write_atomic(&output_dir.join(LATEST), format!("{name}\n").as_bytes())?;
    let best = contents.state.best_model_checkpoint.as_deref();
    if best == Some(name.as_str()) {
        fleet_runs::write_atomic(&output_dir.join(BEST), format!("{name}\n").as_bytes())?;
    }
    if let Some(keep) = keep {
        prune(output_dir, keep.max(1), best)?;
    }
    Ok(target)
}

fn write_into(dir: &Path, c: &CheckpointContents<'_>) -> Result<(), CheckpointError> {
    let tensors = c.weights.iter().cloned().collect();
    match c.adapter {
        // PEFT's layout: the adapter config names the base model.
        Some(adapter) => {
            fleet_models::lora::write_adapter(dir, adapter, &c.state.base_model_id, &tensors)
                .map_err(|e| io(dir, e))?;
            let path = dir.join(ADAPTER_WEIGHTS);
            fleet_runs::set_created_permissions(&path)?;
            sync_file(&path)?;
        }
        None => {
            write_model_config(dir, c.base)?;
            write_weights(&dir.join("model.safetensors"), tensors)?;
        }
    }
    copy_tokenizer(dir, c.base)?;
    c.optimizer.save(&dir.join("optimizer.safetensors"))?;
    fleet_runs::write_json_atomic(&dir.join("trainer_state.json"), c.state)?;
    Ok(())
}

/// Writes `output_dir/merged`: a LoRA-trained model with its adapters merged, in Hugging Face
/// layout (config.json, model.safetensors in f32, the tokenizer files), assembled in a
/// temporary directory and renamed into place (replacing an earlier one). Returns its path.
pub fn write_merged(
    output_dir: &Path,
    base: &CheckpointFiles,
    weights: &std::collections::HashMap<String, Tensor>,
) -> Result<PathBuf, CheckpointError> {
    install_dir(output_dir, "merged", |dir| {
        write_model_config(dir, base)?;
        copy_tokenizer(dir, base)?;
        let path = dir.join("model.safetensors");
        let f32s = weights
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.to_dtype(candle_core::DType::F32)?)))
            .collect::<candle_core::Result<_>>()
            .map_err(|e| io(&path, e))?;
        write_weights(&path, f32s)
    })
}

/// Assembles `output_dir/name` in a hidden temporary directory with `fill`, then renames it
/// into place (replacing one already there): a kill at any moment leaves the old one or the
/// new one whole. A failed `fill` leaves nothing behind.
fn install_dir(
    output_dir: &Path,
    name: &str,
    fill: impl FnOnce(&Path) -> Result<(), CheckpointError>,
) -> Result<PathBuf, CheckpointError> {
    let target = output_dir.join(name);
    let tmp = output_dir.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    if let Err(e) = fill(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if target.exists() {
        std::fs::remove_dir_all(&target).map_err(|e| io(&target, e))?;
    }
    std::fs::rename(&tmp, &target).map_err(|e| io(&target, e))?;
    sync_dir(output_dir);
    Ok(target)
}

/// Copies the base's tokenizer and generation files into `dir`.
fn copy_tokenizer(dir: &Path, base: &CheckpointFiles) -> Result<(), CheckpointError> {
    for file in [
        &base.tokenizer,
        &base.tokenizer_config,
        &base.generation_config,
    ]
    .into_iter()
    .flatten()
    {
        let name = file.file_name().unwrap_or_default();
        std::fs::copy(file, dir.join(name)).map_err(|e| io(file, e))?;
    }
    Ok(())
}

/// Writes `tensors` to `path` as safetensors, durably. Where they are: the writer brings one
/// tensor at a time to the host, so a checkpoint needs one tensor's worth of host memory, not
/// the model's. (candle's writer cannot return an error from that copy: a CUDA failure in the
/// middle of a save panics, leaving the temporary directory and the previous checkpoints as
/// they were.)
fn write_weights(
    path: &Path,
    tensors: std::collections::HashMap<String, Tensor>,
) -> Result<(), CheckpointError> {
    candle_core::safetensors::save(&tensors, path).map_err(|e| io(path, e))?;
    // safetensors writes through a private (0600) temporary file.
    fleet_runs::set_created_permissions(path)?;
    sync_file(path)
}

/// The base's config.json, saying what the weights are: f32 masters.
fn write_model_config(dir: &Path, base: &CheckpointFiles) -> Result<(), CheckpointError> {
    let config_text = std::fs::read_to_string(&base.config).map_err(|e| io(&base.config, e))?;
    let mut config: serde_json::Value =
        serde_json::from_str(&config_text).map_err(|e| io(&base.config, e))?;
    if let Some(obj) = config.as_object_mut() {
        for key in ["torch_dtype", "dtype"] {
            if obj.contains_key(key) {
                obj.insert(key.into(), "float32".into());
            }
        }
        if !obj.contains_key("torch_dtype") && !obj.contains_key("dtype") {
            obj.insert("torch_dtype".into(), "float32".into());
        }
    }
    fleet_runs::write_json_atomic(&dir.join("config.json"), &config)?;
    Ok(())
}

fn sync_file(path: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io(path, e))
}

/// Makes a rename durable (best effort: not every filesystem allows syncing a directory).
fn sync_dir(dir: &Path) {
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

/// Checkpoint steps in `output_dir`, ascending (complete checkpoints only: the temporary
/// directories start with a dot).
pub fn list(output_dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(output_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix(PREFIX)?.parse().ok()?;
            e.path().is_dir().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// Removes the oldest checkpoints beyond `keep`, never the newest nor `best` (as HF's Trainer:
/// with a limit of 1 and a best checkpoint that is not the newest, both stay).
fn prune(output_dir: &Path, keep: usize, best: Option<&str>) -> Result<(), CheckpointError> {
    let is_best = |path: &Path| best.is_some_and(|b| path.file_name() == Some(b.as_ref()));
    let mut all = list(output_dir);
    all.pop(); // the newest
    let mut excess = (all.len() + 1).saturating_sub(keep);
    for (_, path) in all {
        if excess == 0 {
            break;
        }
        if is_best(&path) {
            continue;
        }
        std::fs::remove_dir_all(&path).map_err(|e| io(&path, e))?;
        excess -= 1;
    }
    Ok(())
}

/// The checkpoint `latest` points at.
pub fn latest(output_dir: &Path) -> Result<PathBuf, CheckpointError> {
    let pointer = output_dir.join(LATEST);
    let name = std::fs::read_to_string(&pointer).map_err(|e| CheckpointError::NothingToResume {
        dir: output_dir.to_path_buf(),
        message: format!(
            "no `{LATEST}` file ({e}): no checkpoint was completed there. Check the path; a \
             run killed before its first checkpoint has none: start it again without --resume \
             (with --overwrite to remove its metrics)"
        ),
    })?;
    let path = output_dir.join(name.trim());
    if !path.join("trainer_state.json").exists() {
        return Err(CheckpointError::NothingToResume {
            dir: output_dir.to_path_buf(),
            message: format!(
                "`{LATEST}` names {}, which is not a complete checkpoint",
                path.display()
            ),
        });
    }
    Ok(path)
}

/// Checks that a checkpoint is whole: its trainer state reads, and its weights and optimizer
/// state hold every byte their headers promise. Returns the trainer state.
pub fn verify(checkpoint: &Path) -> Result<TrainerState, CheckpointError> {
    for path in [
        weights_file(checkpoint),
        checkpoint.join("optimizer.safetensors"),
    ] {
        fleet_models::weights::check_shard(&path).map_err(|e| CheckpointError::Damaged {
            path: path.clone(),
            message: e.to_string(),
        })?;
    }
    let path = checkpoint.join("trainer_state.json");
    let text = std::fs::read_to_string(&path).map_err(|e| CheckpointError::Damaged {
        path: path.clone(),
        message: e.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|e| CheckpointError::Damaged {
        path,
        message: e.to_string(),
    })
}

/// The checkpoint a resume continues from: `chosen` (a `checkpoint-<step>` directory of
/// `output_dir`, TRL's `resume_from_checkpoint`) or else the newest, checked whole
/// ([`verify`]). A damaged one is refused with the newest intact earlier checkpoint and the
/// command that resumes from it. Checkpoints after the chosen one are removed and `latest`
/// points at it: the run redoes those steps, and every file agrees with the checkpoint.
pub fn resume_point(output_dir: &Path, chosen: Option<&Path>) -> Result<PathBuf, CheckpointError> {
    let path = match chosen {
        None => latest(output_dir)?,
        Some(p) => {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            let step = name
                .as_deref()
                .and_then(|n| n.strip_prefix(PREFIX))
                .and_then(|s| s.parse::<u64>().ok());
            match step.and_then(|s| list(output_dir).into_iter().find(|(k, _)| *k == s)) {
                Some((_, path)) => path,
                None => {
                    return Err(CheckpointError::NothingToResume {
                        dir: output_dir.to_path_buf(),
                        message: format!(
                            "{} is not a checkpoint of this output directory; its checkpoints: \
                             {}",
                            p.display(),
                            describe(output_dir)
                        ),
                    })
                }
            }
        }
    };
    let resumed = verify(&path);
    if let Err(e) = &resumed {
        let step = step_of(&path).unwrap_or(u64::MAX);
        let intact = list(output_dir)
            .into_iter()
            .rev()
            .filter(|(k, _)| *k < step)
            .find(|(_, p)| verify(p).is_ok())
            .map(|(_, p)| p);
        let way_out = match intact {
            Some(p) => format!(
                "the newest intact checkpoint before it is {0}: resume from it with \
                 --resume-from-checkpoint {0} (the steps after it are trained again)",
                p.display()
            ),
            None => "no earlier checkpoint is intact: start over with --overwrite".to_string(),
        };
        return Err(CheckpointError::Damaged {
            path,
            message: format!("{e}; {way_out}"),
        });
    }
    // Later checkpoints (and `latest`, if it names one) belong to steps that are redone.
    let step = step_of(&path).unwrap_or(0);
    for (_, later) in list(output_dir).into_iter().filter(|(k, _)| *k > step) {
        tracing::warn!(
            "resuming from {}: removing the later {}",
            path.display(),
            later.display()
        );
        std::fs::remove_dir_all(&later).map_err(|e| io(&later, e))?;
    }
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    fleet_runs::write_atomic(&output_dir.join(LATEST), format!("{name}\n").as_bytes())?;
    // `best` as the resumed state has it (it may have named a checkpoint just removed).
    let best = resumed?
        .best_model_checkpoint
        .filter(|b| output_dir.join(b).is_dir());
    match best {
        Some(b) => fleet_runs::write_atomic(&output_dir.join(BEST), format!("{b}\n").as_bytes())?,
        None => {
            let _ = std::fs::remove_file(output_dir.join(BEST));
        }
    }
    Ok(path)
}

fn step_of(checkpoint: &Path) -> Option<u64> {
    checkpoint
        .file_name()?
        .to_str()?
        .strip_prefix(PREFIX)?
        .parse()
        .ok()
}

fn describe(output_dir: &Path) -> String {
    let names: Vec<String> = list(output_dir)
        .iter()
        .map(|(_, p)| p.display().to_string())
        .collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// Reads a checkpoint's trainer state and checks that it was trained from `base`.
pub fn load_state(
    checkpoint: &Path,
    base: &CheckpointIdentity,
) -> Result<TrainerState, CheckpointError> {
    let path = checkpoint.join("trainer_state.json");
    let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|e| io(&path, e))?;
    let mut diffs = Vec::new();
    if state.base_model.weights_digest != base.weights_digest {
        diffs.push(format!(
            "weights {} vs {}",
            state.base_model.weights_digest, base.weights_digest
        ));
    }
    if state.base_model.config_digest != base.config_digest {
        diffs.push("config.json differs".to_string());
    }
    if state.base_model.tokenizer_digest != base.tokenizer_digest {
        diffs.push("tokenizer differs".to_string());
    }
    if !diffs.is_empty() {
        return Err(CheckpointError::OtherModel {
            path: checkpoint.to_path_buf(),
            message: format!(
                "it started from {}: {}",
                state.base_model_id,
                diffs.join(", ")
            ),
        });
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint's state as an older fleet wrote it (no sampler version).
    fn old_state() -> TrainerState {
        let json = serde_json::json!({
            "step": 4, "generation_batch": 1,
            "cursor": DataCursor::default(), "num_tokens": 100,
            "base_model": {"weights_digest": "w", "config_digest": "c", "tokenizer_digest": "t"},
            "base_model_id": "m", "commit": "abc"
        });
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_filtered_run_resumes_only_under_the_sampler_that_drew_it() {
        let path = Path::new("out/checkpoint-4");
        let mut state = old_state();
        assert_eq!(state.sampler_version, 1);
        let err = check_sampler(path, &mut state, true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("sampler v1") && err.contains("checkpoint-4"),
            "{err}"
        );
        // Plain temperature and greedy draws are the same in every version.
        check_sampler(path, &mut state, false).unwrap();
        assert_eq!(state.sampler_version, fleet_models::ops::SAMPLER_VERSION);
        check_sampler(path, &mut state, true).unwrap();
    }
}
