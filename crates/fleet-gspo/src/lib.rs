//! GSPO reinforcement-learning fine-tuning of Qwen LLMs (arXiv 2507.18071), with TRL's
//! GRPOTrainer (`importance_sampling_level="sequence"`, `loss_type="grpo"`) and verl's `gspo`
//! policy loss as the reference behaviour.
//!
//! This crate holds the pieces a training loop calls; the differentiable model path lives in
//! fleet-models.
//!
//! # Module map
//!
//! - [`config`]: [`GspoConfig`] (TOML with TRL's names and the GSPO defaults, `--set`
//!   overrides with the seed's aliases, range and batch checks, TRL's on-policy condition).
//! - [`dataset`]: prompt datasets from JSONL (text or chat prompts, GSM8K and multiple-choice
//!   rows; skipped lines counted by reason), the per-epoch order and the [`DataCursor`] a
//!   checkpoint saves.
//! - [`rewards`]: the [`RewardFunction`] trait, `gsm8k_exact`, `multiple_choice`, `format`,
//!   `length`, and [`WeightedSum`] (failed rewards are `None`, never a default).
//! - [`advantage`]: group advantages with `scale_rewards` group / batch / none, failed rewards
//!   left out of the statistics.
//! - [`loss`]: the GSPO (and GSPO-token, GRPO token-level) policy loss with the k3 KL term and
//!   TRL's clip metrics.
//! - [`optim`]: AdamW as torch computes it, gradient clipping, HF learning-rate schedules,
//!   optimizer state for checkpoints.
//! - [`metrics`]: one JSONL line per optimizer step with TRL's metric names; reward and loss
//!   plots.
//!
//! # One step, as the loop strings it together
//!
//! 1. [`PromptSampler::next_batch`] gives `prompts_per_generation` prompts; each is sampled G
//!    times.
//! 2. [`WeightedSum::score_batch`] scores the completions; [`group_advantages`] turns the
//!    totals into advantages.
//! 3. Off-policy ([`GspoConfig::is_on_policy`] false), old log-probs are computed once, without
//!    gradients, for the micro-batches after the first optimizer step (the ones before it take
//!    the update's own, detached, as TRL does on-policy); on-policy the loss gets `None`.
//! 4. Per micro-batch: [`policy_loss`] → `backward` → [`AdamW::gradients`], accumulated; after
//!    `gradient_accumulation_steps` micro-batches: [`clip_grad_norm`], [`AdamW::step`] at
//!    [`LrSchedule::lr`], and one [`StepMetrics`] line.

#![warn(missing_docs)]

pub mod advantage;
pub mod checkpoint;
pub mod config;
pub mod dataset;
pub mod dist;
pub mod external;
pub mod loss;
pub mod metrics;
pub mod optim;
pub mod prompt;
pub mod reward_model;
pub mod rewards;
pub mod run;
pub mod tensorboard;
pub mod trainer;

pub use advantage::{group_advantages, AdvantageError, GroupAdvantages};
pub use config::{
    ConfigError, GspoConfig, ImportanceSamplingLevel, IntervalStrategy, LossType, LrSchedulerType,
    ReportTo, ScaleRewards, TorchDtype,
};
pub use dataset::{
    load_prompts, load_prompts_with, DataCursor, DatasetError, Prompt, PromptBatch, PromptDataset,
    PromptSampler, Sample,
};
pub use dist::{AllReduceGrads, BatchLayout, BatchScaling, DataParallel};
pub use loss::{
    completion_mask, policy_loss, CompletionMask, LossConfig, LossError, LossInputs, LossMetrics,
    PolicyLoss,
};
pub use metrics::{
    completions_table, eval_records, plot_training, step_records, CompletionRecord,
    CompletionStats, EvalMetrics, MetricsError, MetricsLine, MetricsLog, StepMetrics, StepParts,
    StepTimings, COMPLETIONS_FILE, COMPLETIONS_TABLE,
};
pub use optim::{
    clip_grad_norm, grad_norm, AdamW, AdamWConfig, Gradients, LrSchedule, OptimError,
    OptimizerState,
};
pub use rewards::{BatchRewards, RewardError, RewardFunction, RewardSpec, WeightedSum};
pub use run::{prepare, DistOptions, Prepared, RunOptions};
pub use trainer::{EvalPrompts, Trainer};

/// Errors of a training run: each names the file, field or value at fault and what to do.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The dataset.
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// A reward function.
    #[error(transparent)]
    Reward(#[from] RewardError),
    /// Group advantages.
    #[error(transparent)]
    Advantage(#[from] AdvantageError),
    /// The loss.
    #[error(transparent)]
    Loss(#[from] LossError),
    /// The optimizer.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// The metrics file or plots.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// A checkpoint.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// The model (loading, generation, the differentiable path).
    #[error(transparent)]
    Model(#[from] fleet_models::ModelError),
    /// Placement and memory planning.
    #[error(transparent)]
    Topology(#[from] fleet_topology::TopologyError),
    /// The output directory.
    #[error(transparent)]
    Output(#[from] fleet_runs::RunsError),
    /// The ranks: rendezvous, heartbeats, collectives.
    #[error(transparent)]
    Dist(#[from] fleet_dist::DistError),
    /// A tensor operation.
    #[error("tensor error: {0}")]
    Tensor(#[from] candle_core::Error),
    /// An optimizer step's gradients hold NaN or infinite values (the step is not taken).
    #[error(
        "step {step}: the gradient norm is {norm} (loss {loss}); first parameters with a NaN or \
         infinite gradient: {params}. A NaN loss points at the rewards, advantages or \
         log-probabilities of the batch; a finite loss at the backward pass of these layers \
         (and their device, with a sharded policy)"
    )]
    NonFiniteGradients {
        /// The optimizer step (1-based) that was not taken.
        step: u64,
        /// The step's loss.
        loss: f64,
        /// The global gradient norm.
        norm: f64,
        /// Names of the first parameters at fault, comma-separated.
        params: String,
    },
    /// beta > 0 without a reference model (a bug of the set-up).
    #[error("beta > 0 needs the reference model, which was not loaded")]
    NoReference,
    /// Anything else about setting the run up, with what to do.
    #[error("{0}")]
    Setup(String),
}
