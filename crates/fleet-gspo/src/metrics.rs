//! Per-step training metrics: one JSON line per optimizer step, with TRL's names where they
//! exist (fact sheet B5), written through [`fleet_dist::JsonlLog`]; and the training plots.
//!
//! # Record
//!
//! [`StepMetrics`] serialises to one flat JSON object. TRL's keys: `step`, `epoch`, `loss`,
//! `reward`, `reward_std`, `rewards/<fn>/mean`, `rewards/<fn>/std`, `frac_reward_zero_std`,
//! `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`, `kl` (only with
//! `beta > 0`), `entropy`, `completions/mean_length`, `completions/min_length`,
//! `completions/max_length`, `completions/clipped_ratio`,
//! `completions/mean_terminated_length` (and min/max), `grad_norm`, `learning_rate`,
//! `num_tokens` (prompt + completion tokens seen so far, TRL's cumulative count), `step_time`.
//! fleet's own: `generation_batch`, `ratio_mean`, `tokens_per_second`, `generation_seconds`,
//! `scoring_seconds`, `update_seconds`, `peak_memory_bytes` (per device), `failed_rewards`,
//! `groups_too_small`, `unparsed_answers`, `num_sequences`.
//!
//! Differences from TRL's log, by design:
//! - every optimizer step gets a line (TRL averages over `logging_steps`);
//! - the reward and completion fields describe the generation batch the step trained on, so the
//!   `steps_per_generation × num_iterations / gradient_accumulation_steps` steps that share one
//!   batch repeat them; `generation_batch` says which batch it was (TRL logs them once per
//!   generation);
//! - `learning_rate` is the rate the step used (HF logs the scheduler's next rate);
//! - a NaN or infinite float is written as `null` (JSON has no NaN) and read back as NaN.
//!
//! # Resume
//!
//! A run resumed from a checkpoint appends the steps after it again; [`latest_per_step`] keeps
//! the last record of each step, which is what the plots use.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fleet_argo::plot::{write_chart, LineChart, Series};
use fleet_dist::{JsonlContents, JsonlLog};
use plotters::style::RGBColor;
use serde::{Deserialize, Serialize};

use crate::advantage::GroupAdvantages;
use crate::loss::LossMetrics;
use crate::rewards::BatchRewards;

/// Errors of the metrics file and plots.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The metrics file could not be opened or appended to.
    #[error(transparent)]
    Dist(#[from] fleet_dist::DistError),
    /// A plot could not be drawn or written.
    #[error(transparent)]
    Plot(#[from] fleet_argo::summary::OutputError),
    /// The plot directory could not be created.
    #[error("cannot create plot directory {}: {source}", path.display())]
    Io {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// No record to plot.
    #[error("no metrics to plot: the run has not finished an optimizer step yet")]
    NoData,
}

/// Writes NaN and infinities as `null` and reads `null` back as NaN.
mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

/// Completion lengths of a generation batch (TRL's `completions/*`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CompletionStats {
    /// Mean completion length in tokens.
    #[serde(rename = "completions/mean_length")]
    pub mean_length: f64,
    /// Shortest.
    #[serde(rename = "completions/min_length")]
    pub min_length: f64,
    /// Longest.
    #[serde(rename = "completions/max_length")]
    pub max_length: f64,
    /// Fraction truncated (no EOS within `max_completion_length`), whether or not they are
    /// masked.
    #[serde(rename = "completions/clipped_ratio")]
    pub clipped_ratio: f64,
    /// Mean length of the completions that ended with EOS; `None` if none did.
    #[serde(rename = "completions/mean_terminated_length")]
    pub mean_terminated_length: Option<f64>,
    /// Shortest terminated completion.
    #[serde(rename = "completions/min_terminated_length")]
    pub min_terminated_length: Option<f64>,
    /// Longest terminated completion.
    #[serde(rename = "completions/max_terminated_length")]
    pub max_terminated_length: Option<f64>,
}

impl CompletionStats {
    /// Statistics of `lengths` (tokens, EOS included) with `truncated[i]` true for a
    /// completion that hit the length limit. `None` for an empty batch or mismatched lengths.
    pub fn from_lengths(lengths: &[usize], truncated: &[bool]) -> Option<CompletionStats> {
        if lengths.is_empty() || lengths.len() != truncated.len() {
            return None;
        }
        let stats = |v: &[f64]| -> Option<(f64, f64, f64)> {
            if v.is_empty() {
                return None;
            }
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            let min = v.iter().copied().fold(f64::INFINITY, f64::min);
            let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            Some((mean, min, max))
        };
        let all: Vec<f64> = lengths.iter().map(|&l| l as f64).collect();
        let done: Vec<f64> = lengths
            .iter()
            .zip(truncated)
            .filter(|(_, &t)| !t)
            .map(|(&l, _)| l as f64)
            .collect();
        let (mean_length, min_length, max_length) = stats(&all)?;
        let term = stats(&done);
        Some(CompletionStats {
            mean_length,
            min_length,
            max_length,
            clipped_ratio: truncated.iter().filter(|&&t| t).count() as f64 / lengths.len() as f64,
            mean_terminated_length: term.map(|t| t.0),
            min_terminated_length: term.map(|t| t.1),
            max_terminated_length: term.map(|t| t.2),
        })
    }
}

/// Wall-clock seconds of one optimizer step's phases.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTimings {
    /// Sampling completions (0 for a step that reused a buffered generation batch).
    pub generation_seconds: f64,
    /// Reward functions, advantages, old / reference log-probs.
    pub scoring_seconds: f64,
    /// Forward, backward and optimizer step.
    pub update_seconds: f64,
}

/// One optimizer step's line in `metrics.jsonl` (keys in the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimizer steps done, this one included (1-based).
    pub step: u64,
    /// Fractional epoch over the prompt dataset.
    pub epoch: f64,
    /// Mean policy loss over the step's micro-batches.
    #[serde(with = "nan_as_null")]
    pub loss: f64,
    /// Mean total reward of the generation batch (valid rewards only).
    pub reward: Option<f64>,
    /// Std of the total reward over the whole generation batch.
    pub reward_std: Option<f64>,
    /// Fraction of groups whose reward std is 0.
    pub frac_reward_zero_std: f64,
    /// Fraction of sequences (tokens at token level) clipped below.
    #[serde(rename = "clip_ratio/low_mean")]
    pub clip_ratio_low_mean: f64,
    /// Fraction clipped above.
    #[serde(rename = "clip_ratio/high_mean")]
    pub clip_ratio_high_mean: f64,
    /// Fraction clipped either way.
    #[serde(rename = "clip_ratio/region_mean")]
    pub clip_ratio_region_mean: f64,
    /// Token-masked mean of k3 (only with `beta > 0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl: Option<f64>,
    /// Token-masked mean entropy of the policy, if the trainer computed it.
    pub entropy: Option<f64>,
    /// Completion lengths of the generation batch.
    #[serde(flatten)]
    pub completions: CompletionStats,
    /// Global gradient norm before clipping.
    #[serde(with = "nan_as_null")]
    pub grad_norm: f64,
    /// The learning rate this step used.
    pub learning_rate: f64,
    /// Prompt + completion tokens seen so far (cumulative).
    pub num_tokens: u64,
    /// Seconds of this step, generation included when it happened in it.
    pub step_time: f64,
    /// Which generation batch the step trained on (0-based).
    pub generation_batch: u64,
    /// Mean importance ratio (1 on-policy).
    pub ratio_mean: Option<f64>,
    /// Tokens trained on in this step / `step_time`.
    pub tokens_per_second: f64,
    /// Phases of the step.
    #[serde(flatten)]
    pub timings: StepTimings,
    /// Peak memory per device (`cuda:0` → bytes); empty on CPU.
    pub peak_memory_bytes: BTreeMap<String, u64>,
    /// Completions of the generation batch without a reward.
    pub failed_rewards: u64,
    /// Groups with fewer than 2 valid rewards.
    pub groups_too_small: u64,
    /// Completions whose answer could not be read (scored 0).
    pub unparsed_answers: u64,
    /// Sequences in the loss (non-empty rows) over the step's micro-batches.
    pub num_sequences: u64,
    /// `rewards/<fn>/mean` and `rewards/<fn>/std`. Declared last: when reading, this map takes
    /// the keys no other field claimed.
    #[serde(flatten)]
    pub reward_funcs: BTreeMap<String, Option<f64>>,
}

/// What the trainer hands to [`StepMetrics::from_parts`] after an optimizer step.
#[derive(Debug, Clone, Copy)]
pub struct StepParts<'a> {
    /// Optimizer steps done, this one included.
    pub step: u64,
    /// Fractional epoch.
    pub epoch: f64,
    /// Mean loss over the step's micro-batches.
    pub loss: f64,
    /// Advantages of the generation batch.
    pub advantages: &'a GroupAdvantages,
    /// Rewards of the generation batch.
    pub rewards: &'a BatchRewards,
    /// Loss metrics merged over the step's micro-batches.
    pub loss_metrics: &'a LossMetrics,
    /// Completion lengths of the generation batch.
    pub completions: CompletionStats,
    /// Mean entropy, if computed.
    pub entropy: Option<f64>,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub learning_rate: f64,
    /// Cumulative prompt + completion tokens.
    pub num_tokens: u64,
    /// Tokens trained on in this step.
    pub step_tokens: u64,
    /// Seconds of the step.
    pub step_time: f64,
    /// Which generation batch.
    pub generation_batch: u64,
    /// Phases of the step.
    pub timings: StepTimings,
    /// Peak memory per device.
    pub peak_memory_bytes: &'a BTreeMap<String, u64>,
}

impl StepMetrics {
    /// Assembles a record from the step's pieces.
    pub fn from_parts(p: &StepParts<'_>) -> StepMetrics {
        let lm = p.loss_metrics;
        StepMetrics {
            step: p.step,
            epoch: p.epoch,
            loss: p.loss,
            reward: p.advantages.reward_mean,
            reward_std: p.advantages.reward_std,
            reward_funcs: p.rewards.metrics(),
            frac_reward_zero_std: p.advantages.frac_reward_zero_std,
            clip_ratio_low_mean: lm.low_mean(),
            clip_ratio_high_mean: lm.high_mean(),
            clip_ratio_region_mean: lm.region_mean(),
            kl: lm.kl_mean(),
            entropy: p.entropy,
            completions: p.completions,
            grad_norm: p.grad_norm,
            learning_rate: p.learning_rate,
            num_tokens: p.num_tokens,
            step_time: p.step_time,
            generation_batch: p.generation_batch,
            ratio_mean: lm.mean_ratio(),
            tokens_per_second: if p.step_time > 0.0 {
                p.step_tokens as f64 / p.step_time
            } else {
                0.0
            },
            timings: p.timings,
            peak_memory_bytes: p.peak_memory_bytes.clone(),
            failed_rewards: p.advantages.failed_rewards as u64,
            groups_too_small: p.advantages.groups_too_small as u64,
            unparsed_answers: p.rewards.unparsed(),
            num_sequences: lm.num_sequences,
        }
    }
}

/// The append-only metrics file of a run.
#[derive(Debug)]
pub struct MetricsLog {
    log: JsonlLog,
}

impl MetricsLog {
    /// The file name in a run directory.
    pub const FILE: &'static str = "metrics.jsonl";

    /// Opens (or creates) `path` and returns the records already there; a line torn by a kill
    /// is repaired first (see [`fleet_dist::JsonlLog::open`]; `contents.problems(path)` says
    /// what was wrong, for the log).
    pub fn open(path: &Path) -> Result<(MetricsLog, JsonlContents<StepMetrics>), MetricsError> {
        let (log, contents) = JsonlLog::open::<StepMetrics>(path)?;
        Ok((MetricsLog { log }, contents))
    }

    /// Appends one step's record (one write).
    pub fn append(&mut self, metrics: &StepMetrics) -> Result<(), MetricsError> {
        Ok(self.log.append(metrics)?)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        self.log.path()
    }
}

/// The last record of each step, in step order (a resumed run logs the steps after its
/// checkpoint again).
pub fn latest_per_step(records: &[StepMetrics]) -> Vec<StepMetrics> {
    let mut by_step: BTreeMap<u64, &StepMetrics> = BTreeMap::new();
    for r in records {
        by_step.insert(r.step, r);
    }
    by_step.into_values().cloned().collect()
}

/// Cuts `metrics.jsonl` back to its lines before the first step after `step` (the checkpoint a
/// run resumes from; the later steps are redone). The kept lines are copied byte for byte — never parsed and
/// written again, which could change a float's last digit — and the file is replaced
/// atomically. A torn last line (a kill mid-write) goes too; any other line that does not
/// read as a step's metrics is an error naming its line number.
pub fn truncate_after(path: &Path, step: u64) -> Result<(), MetricsError> {
    #[derive(serde::Deserialize)]
    struct StepOf {
        step: u64,
    }
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(MetricsError::from(fleet_dist::DistError::io(
                "read", path, e,
            )))
        }
    };
    let mut kept = 0;
    let mut start = 0;
    let mut number = 0;
    while start < bytes.len() {
        number += 1;
        let (line, next) = match bytes[start..].iter().position(|&b| b == b'\n') {
            Some(i) => (&bytes[start..start + i], start + i + 1),
            // No newline: the line a kill tore.
            None => break,
        };
        let of: StepOf = serde_json::from_slice(line).map_err(|e| {
            MetricsError::from(fleet_dist::DistError::Json {
                what: format!("{} line {number}", path.display()),
                source: e,
            })
        })?;
        if of.step > step {
            break;
        }
        kept = next;
        start = next;
    }
    if kept == bytes.len() {
        return Ok(());
    }
    fleet_dist::write_atomic(path, &bytes[..kept])?;
    Ok(())
}

/// Plot file stems.
pub mod stems {
    /// Reward (mean ± std) against step.
    pub const REWARD: &str = "reward";
    /// Loss against step.
    pub const LOSS: &str = "loss";
}

const BLUE: RGBColor = RGBColor(0x2E, 0x86, 0xAB);
const LIGHT_BLUE: RGBColor = RGBColor(0x8C, 0xC4, 0xDA);
const RED: RGBColor = RGBColor(0xC7, 0x3E, 0x1D);
const LIGHT_RED: RGBColor = RGBColor(0xE8, 0xA8, 0x98);

/// Trailing mean over `window` points (fewer at the start).
fn moving_average(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let mut sum = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, y))| {
            sum += y;
            if i >= window {
                sum -= points[i - window].1;
            }
            (x, sum / (i + 1).min(window) as f64)
        })
        .collect()
}

/// Draws `reward.{png,svg}` (the mean reward of each generation batch, and its moving average
/// over a twentieth of the run) and `loss.{png,svg}` (per step, and its moving average) into
/// `dir`, from the last record of each step. `subtitle` names the model, dataset and settings.
/// Returns the files written.
pub fn plot_training(
    dir: &Path,
    records: &[StepMetrics],
    subtitle: &str,
) -> Result<Vec<PathBuf>, MetricsError> {
    let rows = latest_per_step(records);
    if rows.is_empty() {
        return Err(MetricsError::NoData);
    }
    std::fs::create_dir_all(dir).map_err(|source| MetricsError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let finite = |v: f64| v.is_finite().then_some(v);
    // The reward is one value per generation batch (its steps share the completions): one
    // point per batch, and a moving average that shows the trend through the sampling noise.
    let mut per_batch: Vec<(f64, f64)> = Vec::new();
    let mut last_batch = None;
    for r in &rows {
        if last_batch == Some(r.generation_batch) {
            continue;
        }
        last_batch = Some(r.generation_batch);
        if let Some(v) = r.reward.and_then(finite) {
            per_batch.push((r.step as f64, v));
        }
    }
    let loss_points: Vec<(f64, f64)> = rows
        .iter()
        .filter_map(|r| Some((r.step as f64, finite(r.loss)?)))
        .collect();
    let series = |label: String, color, emphasis, points| Series {
        label,
        color,
        emphasis,
        points,
        intervals: None,
    };
    let with_trend = |points: Vec<(f64, f64)>, name: &str, color, light| {
        let window = (points.len() / 20).max(1);
        let mut out = vec![series(name.to_string(), light, false, points.clone())];
        if window > 1 {
            out.push(series(
                format!("mean of {window}"),
                color,
                true,
                moving_average(&points, window),
            ));
        }
        out
    };
    let reward = LineChart {
        title: "GSPO training: reward".into(),
        subtitle: subtitle.to_string(),
        x_label: "optimizer step".into(),
        y_label: "reward (mean over the generation batch)".into(),
        series: with_trend(per_batch, "reward", BLUE, LIGHT_BLUE),
    };
    let loss = LineChart {
        title: "GSPO training: loss".into(),
        subtitle: subtitle.to_string(),
        x_label: "optimizer step".into(),
        y_label: "policy loss".into(),
        series: with_trend(loss_points, "loss", RED, LIGHT_RED),
    };
    let mut written = write_chart(dir, stems::REWARD, &reward, false)?;
    written.extend(write_chart(dir, stems::LOSS, &loss, false)?);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantage::group_advantages;
    use crate::config::ScaleRewards;
    use crate::rewards::FuncScores;

    fn record(step: u64, reward: f64, loss: f64) -> StepMetrics {
        let adv = group_advantages(
            &[Some(reward - 0.5), Some(reward + 0.5), None, Some(reward)],
            2,
            ScaleRewards::Group,
        )
        .unwrap();
        let rewards = BatchRewards {
            totals: vec![Some(reward - 0.5), Some(reward + 0.5), None, Some(reward)],
            per_func: vec![FuncScores {
                name: "gsm8k_exact".into(),
                weight: 1.0,
                values: vec![Some(0.0), Some(1.0), None, Some(1.0)],
                failed: 1,
                errors: vec![],
                unparsed: 2,
            }],
        };
        let lm = LossMetrics {
            clip_high: 1,
            clip_total: 4,
            ratio_sum: 4.0,
            num_rows: 4,
            num_sequences: 4,
            num_tokens: 40,
            ..LossMetrics::default()
        };
        let mem = BTreeMap::from([("cuda:0".to_string(), 1u64 << 30)]);
        StepMetrics::from_parts(&StepParts {
            step,
            epoch: step as f64 / 10.0,
            loss,
            advantages: &adv,
            rewards: &rewards,
            loss_metrics: &lm,
            completions: CompletionStats::from_lengths(
                &[10, 20, 30, 40],
                &[false, false, true, false],
            )
            .unwrap(),
            entropy: Some(0.7),
            grad_norm: 0.25,
            learning_rate: 1e-6,
            num_tokens: 1000 * step,
            step_tokens: 200,
            step_time: 2.0,
            generation_batch: (step - 1) / 4,
            timings: StepTimings {
                generation_seconds: 1.0,
                scoring_seconds: 0.25,
                update_seconds: 0.75,
            },
            peak_memory_bytes: &mem,
        })
    }

    #[test]
    fn a_record_uses_trls_keys() {
        let r = record(3, 0.5, -0.1);
        let v = serde_json::to_value(&r).unwrap();
        for key in [
            "step",
            "epoch",
            "loss",
            "reward",
            "reward_std",
            "rewards/gsm8k_exact/mean",
            "rewards/gsm8k_exact/std",
            "frac_reward_zero_std",
            "clip_ratio/low_mean",
            "clip_ratio/high_mean",
            "clip_ratio/region_mean",
            "entropy",
            "completions/mean_length",
            "completions/min_length",
            "completions/max_length",
            "completions/clipped_ratio",
            "completions/mean_terminated_length",
            "grad_norm",
            "learning_rate",
            "num_tokens",
            "step_time",
            "tokens_per_second",
            "generation_seconds",
            "scoring_seconds",
            "update_seconds",
            "peak_memory_bytes",
            "failed_rewards",
            "unparsed_answers",
        ] {
            assert!(v.get(key).is_some(), "missing {key} in {v}");
        }
        assert!(v.get("kl").is_none(), "kl only with beta > 0");
        assert_eq!(v["clip_ratio/high_mean"], 0.25);
        assert_eq!(v["completions/clipped_ratio"], 0.25);
        assert_eq!(v["completions/mean_terminated_length"], 70.0 / 3.0);
        assert_eq!(v["tokens_per_second"], 100.0);
        assert_eq!(v["failed_rewards"], 1);
        assert_eq!(v["groups_too_small"], 1);
        assert_eq!(v["unparsed_answers"], 2);
        assert_eq!(v["peak_memory_bytes"]["cuda:0"], 1u64 << 30);
        let back: StepMetrics = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn nan_is_written_as_null_and_read_back_as_nan() {
        let mut r = record(1, 0.5, f64::NAN);
        r.grad_norm = f64::INFINITY;
        let line = serde_json::to_string(&r).unwrap();
        assert!(
            line.contains("\"loss\":null") && line.contains("\"grad_norm\":null"),
            "{line}"
        );
        let back: StepMetrics = serde_json::from_str(&line).unwrap();
        assert!(back.loss.is_nan() && back.grad_norm.is_nan());
    }

    #[test]
    fn the_log_appends_survives_a_torn_line_and_keeps_the_last_record_per_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(MetricsLog::FILE);
        let (mut log, contents) = MetricsLog::open(&path).unwrap();
        assert!(contents.records.is_empty());
        for s in 1..=3 {
            log.append(&record(s, 0.1 * s as f64, 1.0 / s as f64))
                .unwrap();
        }
        drop(log);
        // A kill mid-write of step 4.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(b"{\"step\": 4, \"epo");
        std::fs::write(&path, bytes).unwrap();
        let (mut log, contents) = MetricsLog::open(&path).unwrap();
        assert_eq!(contents.records.len(), 3);
        assert!(contents.repair.is_some());
        // Resumed from the checkpoint at step 2: steps 3 and 4 are logged again.
        log.append(&record(3, 0.9, 0.5)).unwrap();
        log.append(&record(4, 1.0, 0.25)).unwrap();
        drop(log);
        let (_, contents) = MetricsLog::open(&path).unwrap();
        let latest = latest_per_step(&contents.records);
        assert_eq!(
            latest.iter().map(|r| r.step).collect::<Vec<_>>(),
            vec![1, 2, 3, 4]
        );
        assert_eq!(latest[2].reward, record(3, 0.9, 0.5).reward);

        let files = plot_training(
            &dir.path().join("plots"),
            &contents.records,
            "tiny test run",
        )
        .unwrap();
        assert_eq!(files.len(), 4);
        for f in &files {
            assert!(std::fs::metadata(f).unwrap().len() > 0, "{}", f.display());
        }
        assert!(files.iter().any(|f| f.ends_with("reward.png")));
        assert!(files.iter().any(|f| f.ends_with("loss.svg")));
        assert!(matches!(
            plot_training(dir.path(), &[], "x").unwrap_err(),
            MetricsError::NoData
        ));
    }

    #[test]
    fn completion_stats() {
        let s = CompletionStats::from_lengths(&[5, 7], &[true, true]).unwrap();
        assert_eq!(
            (s.mean_length, s.min_length, s.max_length, s.clipped_ratio),
            (6.0, 5.0, 7.0, 1.0)
        );
        assert_eq!(s.mean_terminated_length, None);
        assert!(CompletionStats::from_lengths(&[], &[]).is_none());
        assert!(CompletionStats::from_lengths(&[1], &[]).is_none());
    }
}
