//! Per-step training metrics: one JSON line per optimizer step, with TRL's names where they
//! exist, written through [`fleet_runs::JsonlLog`]; and the training plots.
//!
//! # Record
//!
//! [`StepMetrics`] serialises to one flat JSON object. A key that TRL 1.16.0's `GRPOTrainer`
//! (with transformers 5.17.0's `Trainer`) also logs has TRL's definition, checked against
//! `trl/trainer/grpo_trainer.py` (cited `grpo:L…`) and `transformers/trainer.py` (`hf:L…`);
//! where fleet differs on purpose the value has its own key. TRL's keys:
//!
//! | key | definition |
//! |---|---|
//! | `step` | optimizer steps done, this one included (HF `global_step`) |
//! | `epoch` | HF's `state.epoch` (hf:L1881): `epochs done + micro-steps of this epoch / micro-steps per epoch`, an epoch being `floor(prompts / prompts per generation batch)` generation batches ([`trainer_epoch`]) |
//! | `loss` | TRL's `grpo` loss (grpo:L3154; hf:L2175-2180): per micro-batch `Σ_i L_i / rows`, **empty rows in the denominator**, then the mean over the step's micro-batches (and ranks) |
//! | `reward` | `nanmean` over the generation batch (all ranks) of the per-completion `nansum_k w_k·r_k` over the functions that scored it; a completion no function scored is left out (grpo:L2826-2828) |
//! | `reward_std` | `nanstd` (Bessel) of the same (grpo:L2829); `null` with fewer than 2 |
//! | `rewards/<fn>/mean`, `/std` | `nanmean` / `nanstd` of one function's scores over the completions it scored (grpo:L2820-2825) |
//! | `frac_reward_zero_std` | fraction of groups whose `nanstd` of the same totals `isclose` 0 (`scale_rewards = "batch"`: the batch's, so 0 or 1); a group with fewer than 2 scored completions has a NaN std and does not count (grpo:L2765-2788, L2830) |
//! | `clip_ratio/low_mean`, `/high_mean`, `/region_mean` | per micro-batch over all ranks, tokens (`token`, `sequence_token`) or all rows (`sequence`, empty rows included), then the mean over the micro-batches ([`crate::loss`] module docs; grpo:L3259-3279) |
//! | `kl` | per micro-batch the token-masked mean of k3, then the mean over micro-batches; only with `beta > 0` (grpo:L3267-3268). TRL's value with `use_bias_correction_kl = False`: TRL 1.16.0 defaults to `True` (grpo:L3104-3105), which weighs each k3 by the importance ratio in the loss and in `kl`; fleet has no such option (equal on-policy, where the ratio is 1) |
//! | `entropy` | the same for the policy's entropy at the sampling temperature (grpo:L3270) |
//! | `completions/mean_length`, `/min_length`, `/max_length` | over every completion of the generation batch (masked ones too), EOS included (grpo:L2294-2298) |
//! | `completions/clipped_ratio` | fraction without EOS within `max_completion_length`, masked or not (grpo:L2300-2304) |
//! | `completions/mean_terminated_length`, `/min…`, `/max…` | over the completions that ended with EOS; **0 when none did** (grpo:L2305-2310; a terminated completion has at least its EOS, so 0 is unambiguous, and `clipped_ratio` is then 1) |
//! | `grad_norm` | the global 2-norm of the accumulated gradient before clipping (hf:L1862-1865) |
//! | `learning_rate` | the rate this optimizer step used (hf:L1871-1872: read after the optimizer step, before the scheduler steps) |
//! | `num_tokens` | prompt + completion tokens of all generation batches so far, masked completions included (grpo:L2290-2293) |
//! | `step_time` | seconds of the step's micro-steps: generation and scoring when they happened in it, forward and backward, the gradient all-reduce (grpo:L1510-1518); **not** the gradient clipping and optimizer update that follow them (hf:L1862-1877) |
//!
//! fleet's own keys:
//!
//! | key | definition |
//! |---|---|
//! | `loss_nonempty_mean` | the loss fleet optimises: per configured micro-batch `Σ_i L_i / non-empty rows` (verl's seq-mean-token-mean), averaged over them. Equals `loss` unless `mask_truncated_completions` masked whole rows; kept apart because TRL divides by all rows ([`crate::loss`]) |
//! | `reward_fully_scored`, `reward_fully_scored_std` | mean and std of the totals of the completions that *every* function scored: the rewards the advantages use. TRL's `reward` also counts a completion that only some functions scored, the others as 0; fleet does not train on such a completion ([`crate::rewards`]) |
//! | `generation_batch` | which generation batch the step trained on: **1** for the run's first, counting on across resumes |
//! | `ratio_mean` | the mean importance ratio (1 on-policy) over the step: non-empty sequences at the sequence levels, masked tokens at `token` |
//! | `num_sequences` | non-empty rows trained on in the step, over all micro-batches (`num_iterations` passes count each time) |
//! | `tokens_per_second` | completion tokens trained on in the step / its wall time |
//! | `generation_seconds`, `scoring_seconds`, `update_seconds` | the step's phases ([`StepTimings`]), adding up to its wall time; `update_seconds` includes the gradient clipping and AdamW update that `step_time` leaves out, which took `generation_seconds + scoring_seconds + update_seconds − step_time` |
//! | `peak_memory_bytes` | peak memory per device so far |
//! | `failed_rewards` | completions of the generation batch without a total reward (some function gave `None` or failed) |
//! | `groups_too_small` | groups with fewer than 2 fully scored completions (their advantages are 0) |
//! | `unparsed_answers` | completions of the generation batch whose answer a function could not read (scored 0), summed over the functions |
//!
//! # One line per optimizer step; per-generation-batch values repeat
//!
//! Every optimizer step gets a line (TRL writes one per `logging_steps`; with
//! `logging_steps = 1` the same steps). A generation batch feeds
//! `steps_per_generation × num_iterations / gradient_accumulation_steps` optimizer steps. The
//! values that describe the generation batch — `reward`, `reward_std`, `rewards/*`,
//! `frac_reward_zero_std`, `reward_fully_scored*`, `completions/*`, `num_tokens`,
//! `failed_rewards`, `groups_too_small`, `unparsed_answers` — are **repeated on each of its
//! steps** (same `generation_batch`); TRL logs them only on the step whose first micro-step
//! generated the batch (its `_metrics` lists get one value per generation, grpo:L1537-1546).
//! So a mean over the lines weighs every batch equally (as TRL's does), but a *sum* over lines
//! counts a batch once per step: to total `unparsed_answers` or `failed_rewards`, take one line
//! per `generation_batch`. The other keys describe the step itself.
//!
//! A NaN or infinite float is written as `null` (JSON has no NaN) and read back as NaN.
//!
//! # Evaluations
//!
//! With `eval_strategy = "steps"` an evaluation writes a line of its own ([`EvalMetrics`]),
//! with `step` and `epoch` and HF's `eval_*` keys (TRL logs its evaluation's means with the
//! `eval_` prefix): `eval_reward`, `eval_reward_std`, `eval_rewards/<fn>/mean|std|failed`
//! (the training keys' definitions, over the evaluation's completions), `eval_pass@1` (the mean
//! over prompts of the fraction of its k completions whose total reward reaches
//! `eval_pass_threshold`; a failed reward does not pass), `eval_pass@<k>` for k > 1 (the
//! fraction of prompts with at least one passing completion: the unbiased estimator of Chen et
//! al. 2021 with n = k), `eval_completions/mean_length`, `eval_failed_rewards`, `eval_prompts`,
//! `eval_runtime` and `eval_samples_per_second` (HF's, samples being prompts).
//!
//! # Resume
//!
//! A run resumed from a checkpoint appends the steps after it again; [`latest_per_step`] keeps
//! the last record of each step, which is what the plots use.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fleet_plot::{write_chart, LineChart, LineStyle, Marker, MarkerShape, RGBColor, Series};
use fleet_runs::{JsonlContents, JsonlLog};

use serde::{Deserialize, Deserializer, Serialize};

use crate::advantage::{nan_mean_std, GroupAdvantages};
use crate::config::ScaleRewards;
use crate::loss::StepLossMetrics;
use crate::rewards::BatchRewards;

/// Errors of the metrics file and plots.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The metrics file could not be opened or appended to.
    #[error(transparent)]
    Runs(#[from] fleet_runs::RunsError),
    /// A plot could not be drawn or written.
    #[error(transparent)]
    Plot(#[from] fleet_plot::PlotError),
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

/// Reads `null` (how files written before TRL's 0 said "no terminated completion") as 0.
fn null_as_zero<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(0.0))
}

/// Completion lengths of a generation batch (TRL's `completions/*`, grpo:L2294-2310).
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
    /// Mean length of the completions that ended with EOS; 0 if none did (TRL's value).
    #[serde(
        rename = "completions/mean_terminated_length",
        deserialize_with = "null_as_zero"
    )]
    pub mean_terminated_length: f64,
    /// Shortest terminated completion; 0 if none.
    #[serde(
        rename = "completions/min_terminated_length",
        deserialize_with = "null_as_zero"
    )]
    pub min_terminated_length: f64,
    /// Longest terminated completion; 0 if none.
    #[serde(
        rename = "completions/max_terminated_length",
        deserialize_with = "null_as_zero"
    )]
    pub max_terminated_length: f64,
}

impl CompletionStats {
    /// Statistics of `lengths` (tokens, EOS included) with `truncated[i]` true for a
    /// completion that hit the length limit. `None` for an empty batch or mismatched lengths.
    /// The terminated statistics are 0 when every completion was truncated, as in TRL.
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
        // TRL: `term_completion_lengths = torch.zeros(1)` when none terminated.
        let term = stats(&done).unwrap_or((0.0, 0.0, 0.0));
        Some(CompletionStats {
            mean_length,
            min_length,
            max_length,
            clipped_ratio: truncated.iter().filter(|&&t| t).count() as f64 / lengths.len() as f64,
            mean_terminated_length: term.0,
            min_terminated_length: term.1,
            max_terminated_length: term.2,
        })
    }
}

/// The reward statistics TRL logs for a generation batch (grpo:L2759-2830), from each
/// function's scores: TRL sums the functions that scored a completion (`nansum`), so they can
/// differ from fleet's totals, which need every function ([`crate::rewards`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrlRewardStats {
    /// `reward`: `nanmean` of the per-completion totals; `None` if no completion was scored.
    pub reward: Option<f64>,
    /// `reward_std`: `nanstd` (Bessel's correction) of the same; `None` with fewer than 2.
    pub reward_std: Option<f64>,
    /// `frac_reward_zero_std`.
    pub frac_reward_zero_std: f64,
}

/// `torch.isclose(std, 0)` with the default tolerances: `|std| <= 1e-8`; NaN (no std) is not.
fn is_zero_std(std: Option<f64>) -> bool {
    std.is_some_and(|s| s.abs() <= 1e-8)
}

/// TRL's per-completion total: `Σ_k w_k·r_k` over the functions that scored it (`nansum`),
/// `None` when none did (grpo:L2759, L2826-2827).
pub fn trl_reward_totals(rewards: &BatchRewards) -> Vec<Option<f64>> {
    let n = rewards.totals.len();
    (0..n)
        .map(|i| {
            let scored: Vec<f64> = rewards
                .per_func
                .iter()
                .filter_map(|f| f.values.get(i).copied().flatten().map(|v| f.weight * v))
                .collect();
            (!scored.is_empty()).then(|| scored.iter().sum())
        })
        .collect()
}

/// TRL's `reward`, `reward_std` and `frac_reward_zero_std` of a generation batch of groups of
/// `num_generations` consecutive completions, with `scale_rewards` as configured.
pub fn trl_reward_stats(
    rewards: &BatchRewards,
    num_generations: usize,
    scale_rewards: ScaleRewards,
) -> TrlRewardStats {
    let totals = trl_reward_totals(rewards);
    let (reward, reward_std) = nan_mean_std(&totals);
    let g = num_generations.max(1);
    let groups = totals.len().div_ceil(g);
    let frac_reward_zero_std = match scale_rewards {
        // One batch std for every completion: all of them zero-std, or none.
        ScaleRewards::Batch => {
            if is_zero_std(reward_std) {
                1.0
            } else {
                0.0
            }
        }
        ScaleRewards::Group | ScaleRewards::None => {
            let zero = totals
                .chunks(g)
                .filter(|group| is_zero_std(nan_mean_std(group).1))
                .count();
            zero as f64 / groups.max(1) as f64
        }
    };
    TrlRewardStats {
        reward,
        reward_std,
        frac_reward_zero_std,
    }
}

/// HF `Trainer`'s `state.epoch` after optimizer step `step_in_batch` (1-based) of the
/// generation batch just drawn (hf:L1881: `epoch + (step + 1) / steps_in_epoch`, counted in
/// micro-steps; TRL's `RepeatSampler` makes an epoch `floor(prompts / prompts per generation
/// batch)` generation batches of `steps_per_batch` optimizer steps each). `cursor_epoch` is the
/// 0-based epoch the batch came from and `batches_in_epoch` how many batches of that epoch have
/// been drawn, this one included. `None` when the layout has no whole batch per epoch.
pub fn trainer_epoch(
    cursor_epoch: u64,
    batches_in_epoch: u64,
    step_in_batch: u64,
    steps_per_batch: u64,
    batches_per_epoch: u64,
) -> Option<f64> {
    if steps_per_batch == 0 || batches_per_epoch == 0 || batches_in_epoch == 0 {
        return None;
    }
    let done = (batches_in_epoch - 1) * steps_per_batch + step_in_batch;
    Some(cursor_epoch as f64 + done as f64 / (batches_per_epoch * steps_per_batch) as f64)
}

/// Wall-clock seconds of one optimizer step's phases.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTimings {
    /// Sampling completions (0 for a step that reused a buffered generation batch).
    pub generation_seconds: f64,
    /// Reward functions, advantages, old / reference log-probs, their GPU work waited for
    /// (as TRL's `_generate_and_score_completions` holds them; 0 likewise).
    pub scoring_seconds: f64,
    /// Forward and backward of the step's micro-batches, the ranks' gradient all-reduce,
    /// gradient clipping and the AdamW update.
    pub update_seconds: f64,
}

impl StepTimings {
    /// The step's wall time: generation, scoring, update.
    pub fn wall_seconds(&self) -> f64 {
        self.generation_seconds + self.scoring_seconds + self.update_seconds
    }

    /// TRL's `step_time`: the wall time less `optimizer_seconds` spent clipping the gradient
    /// and updating the weights (part of `update_seconds`).
    pub fn trl_step_time(&self, optimizer_seconds: f64) -> f64 {
        self.wall_seconds() - optimizer_seconds
    }
}

/// One optimizer step's line in `metrics.jsonl` (keys and definitions in the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimizer steps done, this one included (1-based).
    pub step: u64,
    /// HF's fractional epoch.
    pub epoch: f64,
    /// TRL's loss: per micro-batch `Σ_i L_i / rows`, mean over the step's micro-batches.
    #[serde(with = "nan_as_null")]
    pub loss: f64,
    /// The loss fleet optimises: `Σ_i L_i / non-empty rows` per configured micro-batch, mean
    /// over them. Files written before it have no such key (`None`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_nonempty_mean: Option<f64>,
    /// TRL's `reward` of the generation batch.
    pub reward: Option<f64>,
    /// TRL's `reward_std` of the generation batch.
    pub reward_std: Option<f64>,
    /// TRL's `frac_reward_zero_std` of the generation batch.
    pub frac_reward_zero_std: f64,
    /// Mean total reward of the completions every function scored (what the advantages use).
    #[serde(default)]
    pub reward_fully_scored: Option<f64>,
    /// Unbiased std of the same.
    #[serde(default)]
    pub reward_fully_scored_std: Option<f64>,
    /// TRL's `clip_ratio/low_mean`.
    #[serde(rename = "clip_ratio/low_mean")]
    pub clip_ratio_low_mean: f64,
    /// TRL's `clip_ratio/high_mean`.
    #[serde(rename = "clip_ratio/high_mean")]
    pub clip_ratio_high_mean: f64,
    /// TRL's `clip_ratio/region_mean`.
    #[serde(rename = "clip_ratio/region_mean")]
    pub clip_ratio_region_mean: f64,
    /// TRL's `kl` (only with `beta > 0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl: Option<f64>,
    /// TRL's `entropy`, if the trainer computed it.
    pub entropy: Option<f64>,
    /// Completion lengths of the generation batch.
    #[serde(flatten)]
    pub completions: CompletionStats,
    /// Global gradient norm before clipping.
    #[serde(with = "nan_as_null")]
    pub grad_norm: f64,
    /// The learning rate this step used.
    pub learning_rate: f64,
    /// Prompt + completion tokens of all generation batches so far (cumulative).
    pub num_tokens: u64,
    /// TRL's `step_time`: the step's seconds without clipping and the optimizer update (the
    /// wall time is `generation_seconds + scoring_seconds + update_seconds`).
    pub step_time: f64,
    /// Which generation batch the step trained on: 1 for the run's first, counting on across
    /// resumes.
    pub generation_batch: u64,
    /// Mean importance ratio (1 on-policy).
    pub ratio_mean: Option<f64>,
    /// Completion tokens trained on in this step / its wall time.
    pub tokens_per_second: f64,
    /// Phases of the step.
    #[serde(flatten)]
    pub timings: StepTimings,
    /// Peak memory per device (`cuda:0` → bytes); empty on CPU.
    pub peak_memory_bytes: BTreeMap<String, u64>,
    /// Completions of the generation batch without a total reward (repeated on each of its
    /// steps).
    pub failed_rewards: u64,
    /// Groups with fewer than 2 fully scored completions (repeated on each of its steps).
    pub groups_too_small: u64,
    /// Completions of the generation batch whose answer could not be read (scored 0), summed
    /// over the functions; per generation batch, repeated on each of its steps.
    pub unparsed_answers: u64,
    /// Non-empty rows trained on in this step, over its micro-batches.
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
    /// Fractional epoch ([`trainer_epoch`]).
    pub epoch: f64,
    /// Advantages of the generation batch.
    pub advantages: &'a GroupAdvantages,
    /// Rewards of the generation batch.
    pub rewards: &'a BatchRewards,
    /// Completions per prompt.
    pub num_generations: usize,
    /// How advantages are scaled (TRL's `frac_reward_zero_std` follows it).
    pub scale_rewards: ScaleRewards,
    /// The loss metrics of the step's micro-batches, merged over the ranks.
    pub loss_metrics: &'a StepLossMetrics,
    /// Completion lengths of the generation batch.
    pub completions: CompletionStats,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub learning_rate: f64,
    /// Cumulative prompt + completion tokens.
    pub num_tokens: u64,
    /// Completion tokens trained on in this step.
    pub step_tokens: u64,
    /// Which generation batch (1-based).
    pub generation_batch: u64,
    /// Phases of the step.
    pub timings: StepTimings,
    /// Seconds of gradient clipping and the AdamW update (part of `timings.update_seconds`;
    /// TRL's `step_time` leaves them out).
    pub optimizer_seconds: f64,
    /// Peak memory per device.
    pub peak_memory_bytes: &'a BTreeMap<String, u64>,
}

impl StepMetrics {
    /// The metrics.jsonl fields that differ between two runs of the same training (clocks and
    /// memory): what a comparison of runs leaves out.
    pub const CLOCK_FIELDS: [&'static str; 6] = [
        "step_time",
        "tokens_per_second",
        "generation_seconds",
        "scoring_seconds",
        "update_seconds",
        "peak_memory_bytes",
    ];

    /// Assembles a record from the step's pieces.
    pub fn from_parts(p: &StepParts<'_>) -> StepMetrics {
        let lm = p.loss_metrics;
        let trl = trl_reward_stats(p.rewards, p.num_generations, p.scale_rewards);
        let wall = p.timings.wall_seconds();
        StepMetrics {
            step: p.step,
            epoch: p.epoch,
            loss: lm.loss(),
            loss_nonempty_mean: Some(lm.nonempty_loss()),
            reward: trl.reward,
            reward_std: trl.reward_std,
            frac_reward_zero_std: trl.frac_reward_zero_std,
            reward_fully_scored: p.advantages.reward_mean,
            reward_fully_scored_std: p.advantages.reward_std,
            reward_funcs: p.rewards.metrics(),
            clip_ratio_low_mean: lm.low_mean(),
            clip_ratio_high_mean: lm.high_mean(),
            clip_ratio_region_mean: lm.region_mean(),
            kl: lm.kl(),
            entropy: lm.entropy(),
            completions: p.completions,
            grad_norm: p.grad_norm,
            learning_rate: p.learning_rate,
            num_tokens: p.num_tokens,
            step_time: p.timings.trl_step_time(p.optimizer_seconds),
            generation_batch: p.generation_batch,
            ratio_mean: lm.ratio_mean(),
            tokens_per_second: if wall > 0.0 {
                p.step_tokens as f64 / wall
            } else {
                0.0
            },
            timings: p.timings,
            peak_memory_bytes: p.peak_memory_bytes.clone(),
            failed_rewards: p.advantages.failed_rewards as u64,
            groups_too_small: p.advantages.groups_too_small as u64,
            unparsed_answers: p.rewards.unparsed(),
            num_sequences: lm.total().num_sequences,
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
    /// is repaired first (see [`fleet_runs::JsonlLog::open`]; `contents.problems(path)` says
    /// what was wrong, for the log).
    pub fn open(path: &Path) -> Result<(MetricsLog, JsonlContents<MetricsLine>), MetricsError> {
        let (log, contents) = JsonlLog::open::<MetricsLine>(path)?;
        Ok((MetricsLog { log }, contents))
    }

    /// Appends one step's record (one write).
    pub fn append(&mut self, metrics: &StepMetrics) -> Result<(), MetricsError> {
        Ok(self.log.append(metrics)?)
    }

    /// Appends one evaluation's record (one write).
    pub fn append_eval(&mut self, metrics: &EvalMetrics) -> Result<(), MetricsError> {
        Ok(self.log.append(metrics)?)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        self.log.path()
    }
}

/// The file of logged completions in a run directory (`log_completions`).
pub const COMPLETIONS_FILE: &str = "completions.jsonl";

/// The table of the latest logged completions in a run directory (`log_completions`).
pub const COMPLETIONS_TABLE: &str = "completions.md";

/// One logged completion (`log_completions`): a line of [`COMPLETIONS_FILE`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRecord {
    /// The optimizer step it was logged at.
    pub step: u64,
    /// Its generation batch.
    pub generation_batch: u64,
    /// The dataset row's id.
    pub id: String,
    /// The prompt as shown to the model.
    pub prompt: String,
    /// The completion (special tokens skipped).
    pub completion: String,
    /// Each function's reward (`null`: not applicable or failed), by name.
    pub rewards: BTreeMap<String, Option<f64>>,
    /// The weighted sum (`null` when any function gave none).
    pub reward: Option<f64>,
    /// The completion's advantage.
    pub advantage: f32,
}

/// `records` as a Markdown table (prompt and completion cut to 300 characters, `|` and line
/// breaks escaped), headed by their step.
pub fn completions_table(records: &[CompletionRecord]) -> String {
    let cell = |s: &str| {
        let mut t: String = s.chars().take(300).collect();
        if s.chars().count() > 300 {
            t.push('…');
        }
        t.replace('|', "\\|").replace('\n', "<br>")
    };
    let names: Vec<&String> = records
        .first()
        .map_or(Vec::new(), |r| r.rewards.keys().collect());
    let num = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.4}"));
    let mut out = String::new();
    if let Some(r) = records.first() {
        out.push_str(&format!(
            "# Completions at step {} (generation batch {})\n\n",
            r.step, r.generation_batch
        ));
    }
    out.push_str("| id | prompt | completion |");
    for n in &names {
        out.push_str(&format!(" {n} |"));
    }
    out.push_str(" reward | advantage |\n|---|---|---|");
    for _ in &names {
        out.push_str("---:|");
    }
    out.push_str("---:|---:|\n");
    for r in records {
        out.push_str(&format!(
            "| {} | {} | {} |",
            cell(&r.id),
            cell(&r.prompt),
            cell(&r.completion)
        ));
        for n in &names {
            out.push_str(&format!(" {} |", num(r.rewards.get(*n).copied().flatten())));
        }
        out.push_str(&format!(" {} | {:.4} |\n", num(r.reward), r.advantage));
    }
    out
}

/// Writes `records` as [`COMPLETIONS_TABLE`] in `dir` (atomically), or removes the table when
/// there are none.
pub fn write_completions_table(
    dir: &Path,
    records: &[CompletionRecord],
) -> Result<(), MetricsError> {
    let path = dir.join(COMPLETIONS_TABLE);
    if records.is_empty() {
        return match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(MetricsError::Io { path, source: e })
            }
            _ => Ok(()),
        };
    }
    Ok(fleet_runs::write_atomic(
        &path,
        completions_table(records).as_bytes(),
    )?)
}

/// Opens `dir`'s [`COMPLETIONS_FILE`] for appending after a run (re)starts at `step`: the lines
/// of later steps are cut (they are redone) and the table shows the last batch logged up to
/// `step`, so that both agree with the checkpoint.
pub fn open_completions(dir: &Path, step: u64) -> Result<JsonlLog, MetricsError> {
    let path = dir.join(COMPLETIONS_FILE);
    truncate_after(&path, step)?;
    let (log, contents) = JsonlLog::open::<CompletionRecord>(&path)?;
    let last = contents.records.iter().map(|r| r.step).max();
    let latest: Vec<CompletionRecord> = contents
        .records
        .into_iter()
        .filter(|r| Some(r.step) == last)
        .collect();
    write_completions_table(dir, &latest)?;
    Ok(log)
}

/// One evaluation's line of `metrics.jsonl` (module docs, "Evaluations").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalMetrics {
    /// Optimizer steps done when it ran.
    pub step: u64,
    /// HF's `state.epoch` then.
    pub epoch: f64,
    /// Seconds it took (HF's `eval_runtime`).
    pub eval_runtime: f64,
    /// Prompts per second (HF's `eval_samples_per_second`).
    pub eval_samples_per_second: f64,
    /// The `eval_*` metrics; `null` where undefined (no completion scored).
    #[serde(flatten)]
    pub values: BTreeMap<String, Option<f64>>,
}

impl EvalMetrics {
    /// The metrics of an evaluation whose completions (k per prompt, in prompt order) got
    /// `rewards` and have `lengths` tokens.
    pub fn from_parts(
        (step, epoch, seconds): (u64, f64, f64),
        rewards: &BatchRewards,
        lengths: &[usize],
        k: usize,
        pass_threshold: f64,
    ) -> EvalMetrics {
        let k = k.max(1);
        let prompts = rewards.totals.len() / k;
        let mut v: BTreeMap<String, Option<f64>> = BTreeMap::new();
        let (mean, std) = nan_mean_std(&rewards.totals);
        v.insert("eval_reward".into(), mean);
        v.insert("eval_reward_std".into(), std);
        for (key, value) in rewards.metrics() {
            v.insert(format!("eval_{key}"), value);
        }
        let passes: Vec<usize> = rewards
            .totals
            .chunks(k)
            .map(|g| {
                g.iter()
                    .filter(|t| t.is_some_and(|t| t >= pass_threshold))
                    .count()
            })
            .collect();
        let per_prompt = |f: &dyn Fn(usize) -> f64| {
            (prompts > 0).then(|| passes.iter().map(|&c| f(c)).sum::<f64>() / prompts as f64)
        };
        v.insert("eval_pass@1".into(), per_prompt(&|c| c as f64 / k as f64));
        if k > 1 {
            v.insert(
                format!("eval_pass@{k}"),
                per_prompt(&|c| if c > 0 { 1.0 } else { 0.0 }),
            );
        }
        let mean_length = (!lengths.is_empty())
            .then(|| lengths.iter().sum::<usize>() as f64 / lengths.len() as f64);
        v.insert("eval_completions/mean_length".into(), mean_length);
        v.insert(
            "eval_failed_rewards".into(),
            Some(rewards.totals.iter().filter(|t| t.is_none()).count() as f64),
        );
        v.insert("eval_prompts".into(), Some(prompts as f64));
        EvalMetrics {
            step,
            epoch,
            eval_runtime: seconds,
            eval_samples_per_second: if seconds > 0.0 {
                prompts as f64 / seconds
            } else {
                0.0
            },
            values: v,
        }
    }

    /// The value of `key` (`eval_runtime` and `eval_samples_per_second` too); `None` when
    /// absent or undefined.
    pub fn get(&self, key: &str) -> Option<f64> {
        match key {
            "eval_runtime" => Some(self.eval_runtime),
            "eval_samples_per_second" => Some(self.eval_samples_per_second),
            _ => self.values.get(key).copied().flatten(),
        }
    }
}

/// One line of `metrics.jsonl`: an evaluation's, or an optimizer step's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MetricsLine {
    /// An evaluation (it has `eval_runtime`, which no step line has).
    Eval(EvalMetrics),
    /// An optimizer step.
    Step(Box<StepMetrics>),
}

/// The step records of `lines`, in file order.
pub fn step_records(lines: &[MetricsLine]) -> Vec<StepMetrics> {
    lines
        .iter()
        .filter_map(|l| match l {
            MetricsLine::Step(s) => Some((**s).clone()),
            MetricsLine::Eval(_) => None,
        })
        .collect()
}

/// The evaluation records of `lines`, the last of each step, in step order.
pub fn eval_records(lines: &[MetricsLine]) -> Vec<EvalMetrics> {
    let mut by_step: BTreeMap<u64, &EvalMetrics> = BTreeMap::new();
    for l in lines {
        if let MetricsLine::Eval(e) = l {
            by_step.insert(e.step, e);
        }
    }
    by_step.into_values().cloned().collect()
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
            return Err(MetricsError::from(fleet_runs::RunsError::io(
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
            MetricsError::from(fleet_runs::RunsError::Json {
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
    fleet_runs::write_atomic(path, &bytes[..kept])?;
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
const GREEN: RGBColor = RGBColor(0x3B, 0x8E, 0x3B);

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

/// The moving-average window of a curve of `points` points: a twentieth of it (1: no average).
pub fn trend_window(points: usize) -> usize {
    (points / 20).max(1)
}

/// The raw points of a curve, and (with [`trend_window`] > 1) their moving average, labelled
/// with its window in `unit`s (`"steps"`, `"generation batches"`).
fn with_trend(
    points: Vec<(f64, f64)>,
    name: &str,
    unit: &str,
    (color, light): (RGBColor, RGBColor),
) -> Vec<Series> {
    let window = trend_window(points.len());
    let mut out = vec![Series {
        label: name.to_string(),
        color: light,
        line: LineStyle::solid(1),
        marker: Some(Marker {
            shape: MarkerShape::Circle,
            size: 3,
            filled: true,
        }),
        points: points.clone(),
        intervals: None,
    }];
    if window > 1 {
        out.push(Series {
            label: format!("moving average over {window} {unit}"),
            color,
            line: LineStyle::solid(3),
            marker: None,
            points: moving_average(&points, window),
            intervals: None,
        });
    }
    out
}

/// Draws `reward.{png,svg}` (TRL's `reward` of each generation batch, at its first step, and
/// its moving average over a twentieth of the batches) and `loss.{png,svg}` (TRL's `loss` per
/// step, and its moving average) into `dir`, from the last record of each step; the legends
/// say the windows. `subtitle` names the model, dataset and settings. Returns the files
/// written.
pub fn plot_training(
    dir: &Path,
    lines: &[MetricsLine],
    subtitle: &str,
) -> Result<Vec<PathBuf>, MetricsError> {
    let rows = latest_per_step(&step_records(lines));
    let evals = eval_records(lines);
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
    let mut series = with_trend(
        per_batch,
        "reward of each generation batch",
        "generation batches",
        (BLUE, LIGHT_BLUE),
    );
    let eval_points: Vec<(f64, f64)> = evals
        .iter()
        .filter_map(|e| Some((e.step as f64, finite(e.get("eval_reward")?)?)))
        .collect();
    if !eval_points.is_empty() {
        series.push(Series {
            label: "evaluation reward (eval_reward)".into(),
            color: GREEN,
            line: LineStyle::solid(2),
            marker: Some(Marker {
                shape: MarkerShape::Circle,
                size: 4,
                filled: true,
            }),
            points: eval_points,
            intervals: None,
        });
    }
    let reward = LineChart {
        title: "GSPO training: reward".into(),
        subtitle: subtitle.to_string(),
        x_label: "optimizer step".into(),
        y_label: "reward (mean over the generation batch; evaluations)".into(),
        series,
        x_integer: true,
    };
    let loss = LineChart {
        title: "GSPO training: loss".into(),
        subtitle: subtitle.to_string(),
        x_label: "optimizer step".into(),
        y_label: "policy loss".into(),
        series: with_trend(loss_points, "loss of each step", "steps", (RED, LIGHT_RED)),
        x_integer: true,
    };
    let mut written = write_chart(dir, stems::REWARD, &reward, false)?;
    written.extend(write_chart(dir, stems::LOSS, &loss, false)?);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantage::group_advantages;
    use crate::loss::LossMetrics;
    use crate::rewards::FuncScores;

    /// A run resumed at step 4 keeps the completions logged up to it, and the table shows the
    /// last of them, not the batch of step 5 that is redone.
    #[test]
    fn resumed_completions_agree_with_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let rec = |step: u64, id: &str| CompletionRecord {
            step,
            generation_batch: step,
            id: id.into(),
            prompt: "1+2=".into(),
            completion: "3".into(),
            rewards: [("exact".to_string(), Some(1.0))].into_iter().collect(),
            reward: Some(1.0),
            advantage: 0.5,
        };
        let mut log = open_completions(dir.path(), 0).unwrap();
        for r in [rec(1, "a"), rec(1, "b"), rec(5, "c")] {
            log.append(&r).unwrap();
        }
        write_completions_table(dir.path(), &[rec(5, "c")]).unwrap();
        drop(log);
        let _log = open_completions(dir.path(), 4).unwrap();
        let lines = std::fs::read_to_string(dir.path().join(COMPLETIONS_FILE)).unwrap();
        assert_eq!(lines.lines().count(), 2);
        let table = std::fs::read_to_string(dir.path().join(COMPLETIONS_TABLE)).unwrap();
        assert!(table.starts_with("# Completions at step 1"), "{table}");
        assert!(
            table.contains("| b |") && !table.contains("| c |"),
            "{table}"
        );
        // Resumed before anything was logged: no table.
        let _log = open_completions(dir.path(), 0).unwrap();
        assert!(!dir.path().join(COMPLETIONS_TABLE).exists());
    }

    /// pass@1 and pass@k per prompt of k completions, failures never passing; the eval line
    /// reads back beside the step lines, is cut on resume like them, and is drawn.
    #[test]
    fn evaluations_are_lines_of_their_own() {
        // Two prompts of k = 3: rewards 1, 0, failed | 0, 0, 1.5; threshold 1.
        let totals = vec![Some(1.0), Some(0.0), None, Some(0.0), Some(0.0), Some(1.5)];
        let rewards = BatchRewards {
            totals: totals.clone(),
            per_func: vec![FuncScores {
                name: "exact".into(),
                weight: 1.0,
                values: totals,
                failed: 1,
                errors: vec![],
                unparsed: 0,
            }],
        };
        let e = EvalMetrics::from_parts((4, 0.5, 2.0), &rewards, &[3, 4, 5, 6, 7, 8], 3, 1.0);
        assert_eq!(e.get("eval_pass@1"), Some((1.0 / 3.0 + 1.0 / 3.0) / 2.0));
        assert_eq!(e.get("eval_pass@3"), Some(1.0));
        assert_eq!(e.get("eval_reward"), Some(0.5));
        assert_eq!(e.get("eval_rewards/exact/failed"), Some(1.0));
        assert_eq!(e.get("eval_failed_rewards"), Some(1.0));
        assert_eq!(e.get("eval_completions/mean_length"), Some(5.5));
        assert_eq!(e.get("eval_prompts"), Some(2.0));
        assert_eq!(e.eval_samples_per_second, 1.0);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let (mut log, _) = MetricsLog::open(&path).unwrap();
        for step in 1..=4 {
            log.append(&record(step, 0.5, 0.1)).unwrap();
        }
        log.append_eval(&e).unwrap();
        drop(log);
        let (_, contents) = MetricsLog::open(&path).unwrap();
        assert!(contents.bad_lines.is_empty());
        assert_eq!(step_records(&contents.records).len(), 4);
        assert_eq!(eval_records(&contents.records), vec![e.clone()]);
        plot_training(dir.path(), &contents.records, "eval run").unwrap();
        let svg = std::fs::read_to_string(dir.path().join("reward.svg")).unwrap();
        assert!(svg.contains("evaluation reward"), "no eval series");
        // A resume from step 3 drops the step-4 line and the evaluation after it.
        truncate_after(&path, 3).unwrap();
        let (_, contents) = MetricsLog::open(&path).unwrap();
        assert_eq!(contents.records.len(), 3);
        assert!(eval_records(&contents.records).is_empty());
    }

    fn record(step: u64, reward: f64, loss: f64) -> StepMetrics {
        let totals = vec![Some(reward - 0.5), Some(reward + 0.5), None, Some(reward)];
        let adv = group_advantages(&totals, 2, ScaleRewards::Group).unwrap();
        let rewards = BatchRewards {
            totals: totals.clone(),
            per_func: vec![FuncScores {
                name: "gsm8k_exact".into(),
                weight: 1.0,
                values: totals,
                failed: 1,
                errors: vec![],
                unparsed: 2,
            }],
        };
        let lm = StepLossMetrics {
            micro_batches: vec![LossMetrics {
                clip_high: 1,
                clip_total: 4,
                ratio_sum: 4.0,
                ratio_count: 4,
                entropy_sum: Some(28.0),
                loss_sum: 4.0 * loss,
                num_rows: 4,
                num_sequences: 4,
                num_tokens: 40,
                ..LossMetrics::default()
            }],
        };
        let mem = BTreeMap::from([("cuda:0".to_string(), 1u64 << 30)]);
        StepMetrics::from_parts(&StepParts {
            step,
            epoch: step as f64 / 10.0,
            advantages: &adv,
            rewards: &rewards,
            num_generations: 2,
            scale_rewards: ScaleRewards::Group,
            loss_metrics: &lm,
            completions: CompletionStats::from_lengths(
                &[10, 20, 30, 40],
                &[false, false, true, false],
            )
            .unwrap(),
            grad_norm: 0.25,
            learning_rate: 1e-6,
            num_tokens: 1000 * step,
            step_tokens: 200,
            generation_batch: (step - 1) / 4 + 1,
            timings: StepTimings {
                generation_seconds: 1.0,
                scoring_seconds: 0.25,
                update_seconds: 0.75,
            },
            optimizer_seconds: 0.5,
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
            "failed_rewards",
            "unparsed_answers",
        ]
        .into_iter()
        .chain(StepMetrics::CLOCK_FIELDS)
        {
            assert!(v.get(key).is_some(), "missing {key} in {v}");
        }
        assert!(v.get("kl").is_none(), "kl only with beta > 0");
        assert_eq!(v["clip_ratio/high_mean"], 0.25);
        assert_eq!(v["completions/clipped_ratio"], 0.25);
        assert_eq!(v["completions/mean_terminated_length"], 70.0 / 3.0);
        // 200 tokens over the wall time 1 + 0.25 + 0.75 s; TRL's step_time leaves out the
        // 0.5 s of clipping and AdamW.
        assert_eq!(v["tokens_per_second"], 100.0);
        assert_eq!(v["step_time"], 1.5);
        assert_eq!(v["entropy"], 0.7);
        assert_eq!(v["generation_batch"], 1);
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
        let latest = latest_per_step(&step_records(&contents.records));
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

    /// The `<text>` elements of an SVG plotters wrote: (x, text-anchor, dy, rotated, content).
    fn svg_texts(svg: &str) -> Vec<(i32, String, String, bool, String)> {
        let attr = |tag: &str, name: &str| -> Option<String> {
            let key = format!(" {name}=\"");
            let start = tag.find(&key)? + key.len();
            let len = tag[start..].find('"')?;
            Some(tag[start..start + len].to_string())
        };
        svg.match_indices("<text ")
            .map(|(i, _)| {
                let end = i + svg[i..].find('>').unwrap();
                let tag = &svg[i..=end];
                let rest = &svg[end + 1..];
                (
                    attr(tag, "x").unwrap().parse().unwrap(),
                    attr(tag, "text-anchor").unwrap(),
                    attr(tag, "dy").unwrap(),
                    attr(tag, "transform").is_some(),
                    rest[..rest.find("</text>").unwrap()].trim().to_string(),
                )
            })
            .collect()
    }

    /// The legend's text (the column right of x = 850), its wrapped lines joined by spaces.
    fn svg_legend(svg: &str) -> String {
        svg_texts(svg)
            .into_iter()
            .filter(|t| t.0 >= 850)
            .map(|t| t.4)
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The x axis' tick labels (centred under the axis, not rotated).
    fn svg_x_ticks(svg: &str) -> Vec<String> {
        svg_texts(svg)
            .into_iter()
            .filter(|t| t.1 == "middle" && t.2 == "0.76em" && !t.3)
            .map(|t| t.4)
            .collect()
    }

    #[test]
    fn training_plots_name_the_moving_average_window_and_label_steps_as_whole_numbers() {
        assert_eq!(
            (trend_window(10), trend_window(39), trend_window(40)),
            (1, 1, 2)
        );
        assert_eq!((trend_window(50), trend_window(200)), (2, 10));
        // 200 steps (50 generation batches of 4 steps), the loss either side of 0.
        let records: Vec<StepMetrics> = (1..=200)
            .map(|s| {
                let x = s as f64;
                record(s, 0.2 + 0.003 * x, 0.3 * (0.7 * x).sin())
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let lines = |r: &[StepMetrics]| -> Vec<MetricsLine> {
            r.iter()
                .map(|r| MetricsLine::Step(Box::new(r.clone())))
                .collect()
        };
        let files = plot_training(dir.path(), &lines(&records), "synthetic run").unwrap();
        assert_eq!(files.len(), 4);
        let loss = std::fs::read_to_string(dir.path().join("loss.svg")).unwrap();
        let reward = std::fs::read_to_string(dir.path().join("reward.svg")).unwrap();
        let legend = svg_legend(&loss);
        assert!(legend.contains("loss of each step"), "{legend}");
        assert!(legend.contains("moving average over 10 steps"), "{legend}");
        let legend = svg_legend(&reward);
        assert!(
            legend.contains("moving average over 2 generation batches"),
            "{legend}"
        );
        for svg in [&loss, &reward] {
            let ticks = svg_x_ticks(svg);
            assert!(ticks.len() >= 3, "{ticks:?}");
            assert!(ticks.contains(&"200".to_string()), "{ticks:?}");
            for t in &ticks {
                assert!(
                    !t.contains('.') && !t.starts_with("-0") && t.parse::<i64>().is_ok(),
                    "x tick {t:?}"
                );
            }
            // No tick label anywhere reads -0.
            for t in svg_texts(svg) {
                let text = t.4;
                assert!(
                    !(text.starts_with("-0") && text.parse::<f64>() == Ok(0.0)),
                    "{text:?}"
                );
            }
        }
        // 200 points are a line: no markers on them, and none in the legend.
        assert!(!loss.contains("<circle"), "markers on 200 points");

        // A short run has no moving average, and its points carry markers.
        let short: Vec<StepMetrics> = (1..=10).map(|s| record(s, 0.5, 0.1)).collect();
        let dir = tempfile::tempdir().unwrap();
        plot_training(dir.path(), &lines(&short), "short run").unwrap();
        for stem in [stems::LOSS, stems::REWARD] {
            let svg = std::fs::read_to_string(dir.path().join(format!("{stem}.svg"))).unwrap();
            let legend = svg_legend(&svg);
            assert!(!legend.contains("moving average"), "{stem}: {legend}");
            assert!(svg.contains("<circle"), "{stem}: no markers");
            for t in svg_x_ticks(&svg) {
                assert!(
                    t.parse::<i64>().is_ok() && t != "-0",
                    "{stem}: x tick {t:?}"
                );
            }
        }
    }

    #[test]
    fn completion_stats() {
        let s = CompletionStats::from_lengths(&[5, 7], &[true, true]).unwrap();
        assert_eq!(
            (s.mean_length, s.min_length, s.max_length, s.clipped_ratio),
            (6.0, 5.0, 7.0, 1.0)
        );
        // TRL: 0 when no completion terminated.
        assert_eq!(
            (
                s.mean_terminated_length,
                s.min_terminated_length,
                s.max_terminated_length
            ),
            (0.0, 0.0, 0.0)
        );
        assert!(CompletionStats::from_lengths(&[], &[]).is_none());
        assert!(CompletionStats::from_lengths(&[1], &[]).is_none());
    }
}
