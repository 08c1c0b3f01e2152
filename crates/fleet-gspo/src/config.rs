//! The training configuration, [`GspoConfig`]: TRL's `GRPOConfig` names, the GSPO paper's
//! setting as TRL documents it for defaults, range checks and the batch arithmetic.
//!
//! # Defaults
//!
//! TRL's documented GSPO setting (`docs/source/paper_index.md`): `importance_sampling_level =
//! "sequence"`, `loss_type = "grpo"`, `beta = 0.0`, `epsilon = 3e-4`, `epsilon_high = 4e-4`,
//! `gradient_accumulation_steps = 1`, `steps_per_generation = 4` (the rollout batch is split
//! into 4 mini-batches, one optimizer step each). The rest are TRL's `GRPOConfig` defaults
//! except `max_completion_length` (256 here, 512 in TRL) and where noted on the field.
//!
//! Two places where a TOML file cannot say what TRL's Python can:
//! - `epsilon_high` is a number, never "same as epsilon" (TRL's `None`): setting `epsilon`
//!   alone keeps `epsilon_high = 4e-4`. Set both.
//! - `max_prompt_length` unset means prompts are never truncated (TRL truncates to 512 from the
//!   left by default): a prompt that does not fit is the trainer's error to report.
//!
//! # Overrides
//!
//! [`GspoConfig::apply_override`] sets one field from a string, as the CLI's `--set key=value`
//! and its dedicated flags do. Keys are the TRL names of this struct's fields, plus the seed's
//! aliases `BATCH_SIZE` (`per_device_train_batch_size`), `GROUP_SIZE` (`num_generations`) and
//! `GSPO_EPOCHS` (`num_iterations`), in either case.
//!
//! # On- and off-policy
//!
//! TRL computes old log-probs after generation only when
//! `gradient_accumulation_steps % (steps_per_generation × num_iterations) != 0`; otherwise the
//! loss uses the current log-probs, detached, as the old ones: the ratio is exactly 1 and nothing
//! clips ([`GspoConfig::is_on_policy`], [`GspoConfig::policy_explanation`]).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::rewards::RewardSpec;

/// Errors of loading, overriding and validating a [`GspoConfig`]. Each names the field or key
/// at fault and what to change.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {}: {source}; check the path", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The TOML does not parse or names an unknown field / reward function.
    #[error("config {origin} is not a valid GSPO config: {message}")]
    Toml {
        /// The file, or `<string>`.
        origin: String,
        /// The parser's message (it names the line and the field).
        message: String,
    },
    /// A field outside its range.
    #[error("{field} = {value} is out of range: expected {expected}")]
    OutOfRange {
        /// The field (TRL name).
        field: &'static str,
        /// The value given.
        value: String,
        /// The allowed range, in words.
        expected: String,
    },
    /// The generation batch is not a whole number of groups.
    #[error(
        "generation batch per process = per_device_train_batch_size ({per_device_train_batch_size}) \
         x steps_per_generation ({steps_per_generation}) = {generation_batch} is not a multiple of \
         num_generations ({num_generations}), so a prompt's group would be split: {fix}"
    )]
    BatchNotMultipleOfGroup {
        /// `per_device_train_batch_size`.
        per_device_train_batch_size: usize,
        /// `steps_per_generation`.
        steps_per_generation: usize,
        /// Their product.
        generation_batch: usize,
        /// `num_generations`.
        num_generations: usize,
        /// Values that would work.
        fix: String,
    },
    /// Both warm-up fields are set.
    #[error(
        "warmup_steps = {warmup_steps} and warmup_ratio = {warmup_ratio} are both set: set one \
         of them (the other to 0)"
    )]
    WarmupConflict {
        /// `warmup_steps`.
        warmup_steps: u64,
        /// `warmup_ratio`.
        warmup_ratio: f64,
    },
    /// No reward function is declared.
    #[error(
        "no reward function: add at least one [[reward_funcs]] table, e.g. \
         [[reward_funcs]] name = \"gsm8k_exact\" weight = 1.0 (known: {known})"
    )]
    NoRewardFuncs {
        /// The known names.
        known: String,
    },
    /// A reward function's own settings are wrong.
    #[error("reward_funcs[{index}] ({name}): {message}")]
    RewardFunc {
        /// Position in `reward_funcs`.
        index: usize,
        /// Its name.
        name: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// Two reward functions with the same name (their metrics would collide).
    #[error(
        "reward_funcs[{first}] and reward_funcs[{second}] are both `{name}`: each function may \
         appear once (its metrics are rewards/{name}/mean|std)"
    )]
    DuplicateRewardFunc {
        /// The name.
        name: String,
        /// First position.
        first: usize,
        /// Second position.
        second: usize,
    },
    /// An override key that names no field.
    #[error("unknown config key `{key}`: expected one of {known}")]
    UnknownKey {
        /// The key as given.
        key: String,
        /// The accepted keys.
        known: String,
    },
    /// An override value that does not parse as the field's type.
    #[error("config key `{key}`: cannot read `{value}` as {expected}")]
    BadValue {
        /// The key as given.
        key: String,
        /// The value as given.
        value: String,
        /// The type or values expected.
        expected: String,
    },
    /// An override without `=`.
    #[error("override `{text}` is not key=value: write e.g. --set learning_rate=1e-6")]
    NotAnAssignment {
        /// The text as given.
        text: String,
    },
    /// A key that cannot be set from a string.
    #[error("config key `{key}` cannot be overridden from the command line: {hint}")]
    NotOverridable {
        /// The key.
        key: String,
        /// What to do instead.
        hint: &'static str,
    },
}

/// Which importance ratio the loss uses (TRL `importance_sampling_level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceSamplingLevel {
    /// GSPO: one ratio per sequence, the geometric mean of the token ratios.
    Sequence,
    /// GSPO-token (TRL's experimental trainer, verl's form): per-token ratios whose value is the
    /// sequence ratio, `exp(logp − sg[logp] + sg[log s_i])`.
    SequenceToken,
    /// GRPO: one ratio per token.
    Token,
}

/// The loss aggregation (TRL `loss_type`). Only `grpo` (per-sequence mean over tokens, then the
/// mean over sequences), which GSPO needs, is implemented.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    /// Per-sequence masked mean over tokens, then the mean over sequences.
    Grpo,
}

/// How advantages are scaled (TRL `scale_rewards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRewards {
    /// Divide by the group's std (+1e-4).
    Group,
    /// Divide by the whole batch's std (+1e-4); the mean stays per group.
    Batch,
    /// No division (Dr. GRPO): `r − group mean`.
    None,
}

/// The dtype the trained weights, their gradients and AdamW's moments are held in (TRL's
/// `model_init_kwargs["torch_dtype"]`: the dtype the policy is loaded in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TorchDtype {
    /// f32 master weights, gradients and moments (16 bytes per parameter); the passes compute
    /// in the compute dtype (`--dtype`). Updates far below bf16's resolution still count.
    #[serde(rename = "float32")]
    Float32,
    /// bf16 weights, gradients and moments, as TRL trains a model loaded in bf16 (8 bytes per
    /// parameter); an update smaller than a weight's bf16 resolution rounds away.
    #[serde(rename = "bfloat16")]
    Bfloat16,
}

/// Where metrics go besides `metrics.jsonl` (HF `report_to`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportTo {
    /// Nowhere else.
    None,
    /// TensorBoard event files in `<output_dir>/runs/` ([`crate::tensorboard`]).
    Tensorboard,
}

/// When to evaluate or save (HF's `IntervalStrategy`: `eval_strategy`, `save_strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IntervalStrategy {
    /// Never.
    No,
    /// Every `eval_steps` / `save_steps` optimizer steps (at the end of the generation batch
    /// in which a multiple falls).
    Steps,
}

/// The learning-rate schedule (HF `lr_scheduler_type`); each has the linear warm-up of
/// `warmup_steps` / `warmup_ratio`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedulerType {
    /// Constant after warm-up (HF `constant_with_warmup`; with no warm-up, HF `constant`).
    #[serde(alias = "constant_with_warmup")]
    Constant,
    /// Linear decay to 0 at the last step (HF `linear`).
    Linear,
    /// Half a cosine from the peak to 0 (HF `cosine`).
    Cosine,
}

macro_rules! enum_names {
    ($ty:ty, $what:literal, { $($name:literal => $variant:path),+ $(,)? }) => {
        impl $ty {
            /// The accepted names.
            pub const NAMES: &'static [&'static str] = &[$($name),+];

            /// The TOML name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($variant => $name,)+
                }
            }
        }

        impl FromStr for $ty {
            type Err = String;

            fn from_str(s: &str) -> Result<Self, String> {
                match s.trim() {
                    $($name => Ok($variant),)+
                    _ => Err(format!("{} (one of {})", $what, Self::NAMES.join(", "))),
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

enum_names!(ImportanceSamplingLevel, "an importance sampling level", {
    "sequence" => ImportanceSamplingLevel::Sequence,
    "sequence_token" => ImportanceSamplingLevel::SequenceToken,
    "token" => ImportanceSamplingLevel::Token,
});
enum_names!(LossType, "a loss type", { "grpo" => LossType::Grpo });
enum_names!(TorchDtype, "a master dtype", {
    "float32" => TorchDtype::Float32,
    "bfloat16" => TorchDtype::Bfloat16,
});
enum_names!(ScaleRewards, "a reward scaling", {
    "group" => ScaleRewards::Group,
    "batch" => ScaleRewards::Batch,
    "none" => ScaleRewards::None,
});
enum_names!(ReportTo, "a report destination", {
    "none" => ReportTo::None,
    "tensorboard" => ReportTo::Tensorboard,
});
enum_names!(IntervalStrategy, "a strategy", {
    "no" => IntervalStrategy::No,
    "steps" => IntervalStrategy::Steps,
});
enum_names!(LrSchedulerType, "a scheduler type", {
    "constant" => LrSchedulerType::Constant,
    "linear" => LrSchedulerType::Linear,
    "cosine" => LrSchedulerType::Cosine,
});

/// The GSPO training configuration. Field names are TRL's `GRPOConfig` (and HF
/// `TrainingArguments`) names; see the module docs for the defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GspoConfig {
    /// The policy checkpoint (a local directory or `hub-id@revision`); read by the binary.
    pub model_name_or_path: Option<String>,
    /// The prompt dataset (a JSONL file, see [`crate::dataset`]); read by the binary.
    pub dataset_name: Option<PathBuf>,
    /// Peak learning rate (AdamW). Default 1e-6.
    pub learning_rate: f64,
    /// G: completions sampled per prompt. Default 8; at least 2.
    pub num_generations: usize,
    /// Completions per micro-batch (one forward/backward) on each process. Default 8.
    pub per_device_train_batch_size: usize,
    /// Micro-batches each generation batch is split into. Default 4 (GSPO paper).
    pub steps_per_generation: usize,
    /// Passes over each generation batch (TRL's μ; the seed's GSPO_EPOCHS). Default 1.
    pub num_iterations: usize,
    /// Micro-batches per optimizer step. Default 1.
    pub gradient_accumulation_steps: usize,
    /// transformers' name: fit the micro-batch to memory. Before loading, the training memory
    /// model's plan is made for `per_device_train_batch_size`, then for its divisors from the
    /// largest down (those the ranks can share), until one fits; `steps_per_generation` and
    /// `gradient_accumulation_steps` are multiplied by the same factor and the loss stays
    /// normalised over the configured micro-batch, so that the rollouts and every optimizer
    /// step are the configured ones (up to the order of float sums). Default false: a plan
    /// that does not fit is an error.
    pub auto_find_batch_size: bool,
    /// Lower clip range: the ratio is clipped below at 1 − epsilon. Default 3e-4.
    pub epsilon: f64,
    /// Upper clip range: the ratio is clipped above at 1 + epsilon_high. Default 4e-4.
    pub epsilon_high: f64,
    /// KL coefficient (k3 estimator against the reference model). Default 0: no reference
    /// model is needed. The k3 term is TRL's with `use_bias_correction_kl = False` (TRL
    /// 1.16.0's default `True` weighs it by the importance ratio; the same on-policy).
    pub beta: f64,
    /// `sequence` (GSPO, default), `sequence_token` (GSPO-token) or `token` (GRPO).
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// `grpo` (the only aggregation implemented).
    pub loss_type: LossType,
    /// `group` (default), `batch` or `none`.
    pub scale_rewards: ScaleRewards,
    /// `float32` (default: f32 master weights and moments) or `bfloat16` (TRL's arithmetic
    /// and memory with a bf16-loaded model).
    pub torch_dtype: TorchDtype,
    /// Exclude truncated completions (no EOS within `max_completion_length`) from the loss.
    /// Default false.
    pub mask_truncated_completions: bool,
    /// Score and train on packed sequences (TRL's name in its SFT and DPO configs): each
    /// micro-batch's prompts and completions back to back in bins, every completion cut to its
    /// own scored length, so padding costs nothing; the same log-probs and gradients as the
    /// padded layout (`TokenBatch::packed`). Default false.
    pub padding_free: bool,
    /// Longest prompt in tokens; unset: no limit (see the module docs).
    pub max_prompt_length: Option<usize>,
    /// Longest completion in tokens. Default 256.
    pub max_completion_length: usize,
    /// Sampling temperature; log-probs are computed from logits / temperature. Default 1.0.
    pub temperature: f64,
    /// Nucleus sampling mass. Default 1.0 (off).
    pub top_p: f64,
    /// Top-k sampling; 0 = off (TRL/transformers). Default 0.
    pub top_k: usize,
    /// vLLM's name: completions decoded at once on each process (the rollout engine's decode
    /// slots). A finished completion's slot goes at once to the next waiting one, so a
    /// generation batch larger than the slots streams through them; nothing of the next
    /// generation batch starts before the update. Unset (default): all of the process's
    /// completions at once.
    pub max_num_seqs: Option<usize>,
    /// vLLM's name: decode steps the rollout engine queues before reading their tokens back
    /// (each step's tokens fed to the next on the device; finished completions' slots refilled
    /// every this many steps). The same completions for any value. Default 8: one read every 8
    /// steps took the rollouts of a 0.5B generation batch (64 x 256 tokens) from 0.534 to 0.500 s
    /// on an H200, 1.5B from 0.781 to 0.759 (docs/benchmarks.md); a finished completion's slot
    /// waits at most 7 steps for its refill.
    pub num_scheduler_steps: usize,
    /// Gradient clipping by global L2 norm; 0 = no clipping. Default 1.0.
    pub max_grad_norm: f64,
    /// AdamW decoupled weight decay. Default 0.0.
    pub weight_decay: f64,
    /// AdamW beta1. Default 0.9.
    pub adam_beta1: f64,
    /// AdamW beta2. Default 0.999.
    pub adam_beta2: f64,
    /// AdamW epsilon. Default 1e-8.
    pub adam_epsilon: f64,
    /// `constant`, `linear` (HF default) or `cosine`.
    pub lr_scheduler_type: LrSchedulerType,
    /// Warm-up as a fraction of all optimizer steps (rounded up). Default 0.
    pub warmup_ratio: f64,
    /// Warm-up in optimizer steps. Default 0. Set this or `warmup_ratio`, not both.
    pub warmup_steps: u64,
    /// Total optimizer steps; unset: from `num_train_epochs`.
    pub max_steps: Option<u64>,
    /// Passes over the prompt dataset when `max_steps` is unset. Default 1.0.
    pub num_train_epochs: f64,
    /// Seed of sampling and data order. Default 42 (HF).
    pub seed: u64,
    /// Shuffle the prompts each epoch. Default true (TRL).
    pub shuffle_dataset: bool,
    /// Print a progress line every this many optimizer steps (the metrics file gets every
    /// step). Default 1.
    pub logging_steps: u64,
    /// Save a checkpoint every this many optimizer steps. Default 500 (HF). Checkpoints are
    /// written between generation batches (a resume never replays half of one), after the
    /// batch in which a multiple of save_steps falls: at TRL's steps when save_steps is a
    /// multiple of the optimizer steps per generation batch, else up to one batch later.
    pub save_steps: u64,
    /// When to write checkpoints (HF `save_strategy`): `steps` (default: every `save_steps`,
    /// and after the last step) or `no` (none at all: nothing to resume from or load; for
    /// speed runs and sweeps that only read metrics.jsonl).
    pub save_strategy: IntervalStrategy,
    /// Keep at most this many checkpoints (oldest removed); unset: keep all.
    pub save_total_limit: Option<usize>,
    /// Run directory: metrics, checkpoints, plots. Default `trainer_output` (HF).
    pub output_dir: PathBuf,
    /// The reward functions and their weights (TRL `reward_funcs` + `reward_weights`).
    pub reward_funcs: Vec<RewardSpec>,
    /// Train LoRA adapters instead of the whole model (TRL's `ModelConfig.use_peft`): the base
    /// is frozen (no gradients, no optimizer state; the reference model is the base with the
    /// adapters off), checkpoints hold PEFT's adapter files, and the merged model is written to
    /// `<output_dir>/merged` at the end. Default false.
    pub use_peft: bool,
    /// The adapters' rank (TRL's `lora_r`). Default 16.
    pub lora_r: usize,
    /// The adapters' alpha (TRL's `lora_alpha`). Default 32.
    pub lora_alpha: f64,
    /// Dropout on the adapters' input (TRL's `lora_dropout`; TRL's default is 0.05) in the
    /// training passes, with a mask per optimizer step and micro-batch (a resume draws the
    /// same); the log-prob passes and the rollouts run without (PEFT's eval mode). Default 0.
    pub lora_dropout: f64,
    /// The modules adapted (TRL's `lora_target_modules`): some of q_proj, k_proj, v_proj,
    /// o_proj, gate_proj, up_proj, down_proj, or `all-linear`. Default q_proj and v_proj
    /// (PEFT's default for Qwen2).
    pub lora_target_modules: Vec<String>,
    /// `lora_alpha / sqrt(r)` as the scale (TRL's `use_rslora`). Default false.
    pub use_rslora: bool,
    /// ZeRO stage (DeepSpeed's and accelerate's name): 0, every process keeps the whole
    /// optimizer state; 1, each data-parallel process keeps and updates the AdamW moments of
    /// its share of the parameters, and the updated parameters are gathered after each step.
    /// The same weights either way. Default 0.
    pub zero_stage: u8,
    /// Also write the metrics as TensorBoard event files (`tensorboard`, in
    /// `<output_dir>/runs/`) or not (`none`, the default).
    pub report_to: ReportTo,
    /// Write each logged generation batch's completions (prompt, completion, each reward, the
    /// advantage) to `completions.jsonl` and the latest as a table to `completions.md` (TRL).
    /// A generation batch is logged at its first step that is a multiple of `logging_steps`.
    /// Default false.
    pub log_completions: bool,
    /// Rows of a logged batch written (TRL); unset: every completion.
    pub num_completions_to_print: Option<usize>,
    /// When to evaluate (HF `eval_strategy`): `no` (default) or `steps`.
    pub eval_strategy: IntervalStrategy,
    /// Evaluate every this many optimizer steps; unset: `logging_steps` (HF).
    pub eval_steps: Option<u64>,
    /// The evaluation prompts: a JSONL file in the training file's format (TRL takes an
    /// `eval_dataset`; the CLI's `--eval-dataset`).
    pub eval_dataset: Option<PathBuf>,
    /// Hold out this fraction of the training file's prompts for evaluation instead (a seeded
    /// choice, never trained on); 0: none. Default 0.
    pub eval_holdout: f64,
    /// Completions per evaluation batch on each process (HF). Default 8; a multiple of
    /// `num_generations_eval`.
    pub per_device_eval_batch_size: usize,
    /// Completions per evaluation prompt, k of pass@k (TRL); unset: `num_generations`.
    pub num_generations_eval: Option<usize>,
    /// Evaluation completions sampled with the training's temperature, top-k and top-p (true,
    /// as TRL does), or greedy (false; needs `num_generations_eval = 1`). Default true.
    pub eval_do_sample: bool,
    /// A completion passes (pass@1, pass@k) when its total reward is at least this. Default
    /// 1.0 (a correct answer of `gsm8k_exact` or `multiple_choice`).
    pub eval_pass_threshold: f64,
    /// The evaluation metric that picks the best checkpoint (HF; `eval_` is prefixed when
    /// missing, e.g. `reward` or `pass@1`). Unset: `eval_reward` when
    /// `load_best_model_at_end`, else no best checkpoint is tracked.
    pub metric_for_best_model: Option<String>,
    /// Whether a larger `metric_for_best_model` is better (HF); unset: true unless the
    /// metric's name ends in `loss`.
    pub greater_is_better: Option<bool>,
    /// At the end, the best checkpoint's model files are copied into `output_dir` (what HF's
    /// Trainer holds after loading the best model); the best checkpoint is never removed by
    /// `save_total_limit`. Needs `eval_strategy = "steps"` and `save_steps` a multiple of
    /// `eval_steps` (HF's rule). Default false.
    pub load_best_model_at_end: bool,
}

impl Default for GspoConfig {
    fn default() -> Self {
        GspoConfig {
            model_name_or_path: None,
            dataset_name: None,
            learning_rate: 1e-6,
            num_generations: 8,
            per_device_train_batch_size: 8,
            steps_per_generation: 4,
            num_iterations: 1,
            gradient_accumulation_steps: 1,
            auto_find_batch_size: false,
            epsilon: 3e-4,
            epsilon_high: 4e-4,
            beta: 0.0,
            importance_sampling_level: ImportanceSamplingLevel::Sequence,
            loss_type: LossType::Grpo,
            scale_rewards: ScaleRewards::Group,
            torch_dtype: TorchDtype::Float32,
            mask_truncated_completions: false,
            padding_free: false,
            max_prompt_length: None,
            max_completion_length: 256,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_num_seqs: None,
            num_scheduler_steps: 8,
            max_grad_norm: 1.0,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            lr_scheduler_type: LrSchedulerType::Linear,
            warmup_ratio: 0.0,
            warmup_steps: 0,
            max_steps: None,
            num_train_epochs: 1.0,
            seed: 42,
            shuffle_dataset: true,
            logging_steps: 1,
            save_steps: 500,
            save_strategy: IntervalStrategy::Steps,
            save_total_limit: None,
            output_dir: PathBuf::from("trainer_output"),
            reward_funcs: Vec::new(),
            use_peft: false,
            lora_r: 16,
            lora_alpha: 32.0,
            lora_dropout: 0.0,
            lora_target_modules: vec!["q_proj".into(), "v_proj".into()],
            use_rslora: false,
            zero_stage: 0,
            report_to: ReportTo::None,
            log_completions: false,
            num_completions_to_print: None,
            eval_strategy: IntervalStrategy::No,
            eval_steps: None,
            eval_dataset: None,
            eval_holdout: 0.0,
            per_device_eval_batch_size: 8,
            num_generations_eval: None,
            eval_do_sample: true,
            eval_pass_threshold: 1.0,
            metric_for_best_model: None,
            greater_is_better: None,
            load_best_model_at_end: false,
        }
    }
}

/// The keys `--set KEY=VALUE` (and [`GspoConfig::apply_override`]) take, in the order they
/// are listed in errors and in `gspo-train --help`.
pub const KEYS: &[&str] = &[
    "model_name_or_path",
    "dataset_name",
    "learning_rate",
    "num_generations",
    "per_device_train_batch_size",
    "steps_per_generation",
    "num_iterations",
    "gradient_accumulation_steps",
    "auto_find_batch_size",
    "epsilon",
    "epsilon_high",
    "beta",
    "importance_sampling_level",
    "loss_type",
    "scale_rewards",
    "torch_dtype",
    "mask_truncated_completions",
    "padding_free",
    "max_prompt_length",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "max_num_seqs",
    "num_scheduler_steps",
    "max_grad_norm",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "lr_scheduler_type",
    "warmup_ratio",
    "warmup_steps",
    "max_steps",
    "num_train_epochs",
    "seed",
    "shuffle_dataset",
    "logging_steps",
    "save_steps",
    "save_strategy",
    "save_total_limit",
    "output_dir",
    "use_peft",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "use_rslora",
    "zero_stage",
    "report_to",
    "log_completions",
    "num_completions_to_print",
    "eval_strategy",
    "eval_steps",
    "eval_dataset",
    "eval_holdout",
    "per_device_eval_batch_size",
    "num_generations_eval",
    "eval_do_sample",
    "eval_pass_threshold",
    "metric_for_best_model",
    "greater_is_better",
    "load_best_model_at_end",
    "BATCH_SIZE",
    "GROUP_SIZE",
    "GSPO_EPOCHS",
];

fn bad(key: &str, value: &str, expected: impl Into<String>) -> ConfigError {
    ConfigError::BadValue {
        key: key.to_string(),
        value: value.to_string(),
        expected: expected.into(),
    }
}

fn parse_f64(key: &str, value: &str) -> Result<f64, ConfigError> {
    value
        .trim()
        .parse::<f64>()
        .map_err(|_| bad(key, value, "a number (e.g. 1e-6, 0.5)"))
}

fn parse_usize(key: &str, value: &str) -> Result<usize, ConfigError> {
    value
        .trim()
        .parse::<usize>()
        .map_err(|_| bad(key, value, "a non-negative integer"))
}

fn parse_u64(key: &str, value: &str) -> Result<u64, ConfigError> {
    value
        .trim()
        .parse::<u64>()
        .map_err(|_| bad(key, value, "a non-negative integer"))
}

fn parse_bool(key: &str, value: &str) -> Result<bool, ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(bad(key, value, "true or false")),
    }
}

/// `none` (any case) or empty → `None`; anything else through `parse`.
fn parse_opt<T>(
    key: &str,
    value: &str,
    parse: impl Fn(&str, &str) -> Result<T, ConfigError>,
) -> Result<Option<T>, ConfigError> {
    let v = value.trim();
    if v.is_empty() || v.eq_ignore_ascii_case("none") {
        Ok(None)
    } else {
        parse(key, v).map(Some).map_err(|e| match e {
            ConfigError::BadValue {
                key,
                value,
                expected,
            } => ConfigError::BadValue {
                key,
                value,
                expected: format!("{expected}, or none"),
            },
            other => other,
        })
    }
}

fn parse_enum<T: FromStr<Err = String>>(key: &str, value: &str) -> Result<T, ConfigError> {
    value
        .parse::<T>()
        .map_err(|expected| bad(key, value, expected))
}

fn check(
    ok: bool,
    field: &'static str,
    value: impl fmt::Display,
    expected: &str,
) -> Result<(), ConfigError> {
    if ok {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange {
            field,
            value: value.to_string(),
            expected: expected.to_string(),
        })
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl GspoConfig {
    /// Reads and validates a TOML file.
    pub fn from_toml_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml_str_named(&text, &path.display().to_string())
    }

    /// Parses and validates TOML text.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        Self::from_toml_str_named(text, "<string>")
    }

    fn from_toml_str_named(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let config: GspoConfig = toml::from_str(text).map_err(|e| ConfigError::Toml {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Parses without validating, for callers that apply overrides first and then call
    /// [`GspoConfig::validate`].
    pub fn parse_toml_unvalidated(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Toml {
            origin: origin.to_string(),
            message: e.to_string(),
        })
    }

    /// The config as TOML (for a run's manifest and for reproducing it).
    pub fn to_toml_string(&self) -> Result<String, ConfigError> {
        toml::to_string(self).map_err(|e| ConfigError::Toml {
            origin: "<serialize>".to_string(),
            message: e.to_string(),
        })
    }

    /// Sets one field from a string: `key` is a TRL field name or one of the aliases
    /// `BATCH_SIZE`, `GROUP_SIZE`, `GSPO_EPOCHS` (either case). Optional fields take `none`.
    /// `reward_funcs` cannot be set this way (edit the TOML). Call [`GspoConfig::validate`]
    /// after the last override.
    pub fn apply_override(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let k = key.trim();
        let canonical = match k.to_ascii_uppercase().as_str() {
            "BATCH_SIZE" => "per_device_train_batch_size",
            "GROUP_SIZE" => "num_generations",
            "GSPO_EPOCHS" => "num_iterations",
            _ => k,
        };
        match canonical {
            "model_name_or_path" => {
                self.model_name_or_path = parse_opt(key, value, |_, v| Ok(v.to_string()))?
            }
            "dataset_name" => {
                self.dataset_name = parse_opt(key, value, |_, v| Ok(PathBuf::from(v)))?
            }
            "learning_rate" => self.learning_rate = parse_f64(key, value)?,
            "num_generations" => self.num_generations = parse_usize(key, value)?,
            "per_device_train_batch_size" => {
                self.per_device_train_batch_size = parse_usize(key, value)?
            }
            "steps_per_generation" => self.steps_per_generation = parse_usize(key, value)?,
            "num_iterations" => self.num_iterations = parse_usize(key, value)?,
            "gradient_accumulation_steps" => {
                self.gradient_accumulation_steps = parse_usize(key, value)?
            }
            "epsilon" => self.epsilon = parse_f64(key, value)?,
            "epsilon_high" => self.epsilon_high = parse_f64(key, value)?,
            "beta" => self.beta = parse_f64(key, value)?,
            "importance_sampling_level" => self.importance_sampling_level = parse_enum(key, value)?,
            "loss_type" => self.loss_type = parse_enum(key, value)?,
            "scale_rewards" => {
                // TRL also accepts booleans: True → "group", False → "none".
                self.scale_rewards = match value.trim().to_ascii_lowercase().as_str() {
                    "true" => ScaleRewards::Group,
                    "false" => ScaleRewards::None,
                    _ => parse_enum(key, value)?,
                }
            }
            "torch_dtype" => {
                self.torch_dtype = match value.trim() {
                    "bf16" => TorchDtype::Bfloat16,
                    "f32" | "fp32" => TorchDtype::Float32,
                    _ => parse_enum(key, value)?,
                }
            }
            "mask_truncated_completions" => {
                self.mask_truncated_completions = parse_bool(key, value)?
            }
            "padding_free" => self.padding_free = parse_bool(key, value)?,
            "max_prompt_length" => self.max_prompt_length = parse_opt(key, value, parse_usize)?,
            "max_completion_length" => self.max_completion_length = parse_usize(key, value)?,
            "temperature" => self.temperature = parse_f64(key, value)?,
            "top_p" => self.top_p = parse_f64(key, value)?,
            "top_k" => self.top_k = parse_usize(key, value)?,
            "max_num_seqs" => self.max_num_seqs = parse_opt(key, value, parse_usize)?,
            "num_scheduler_steps" => self.num_scheduler_steps = parse_usize(key, value)?,
            "max_grad_norm" => self.max_grad_norm = parse_f64(key, value)?,
            "weight_decay" => self.weight_decay = parse_f64(key, value)?,
            "adam_beta1" => self.adam_beta1 = parse_f64(key, value)?,
            "adam_beta2" => self.adam_beta2 = parse_f64(key, value)?,
            "adam_epsilon" => self.adam_epsilon = parse_f64(key, value)?,
            "lr_scheduler_type" => {
                self.lr_scheduler_type = if value.trim() == "constant_with_warmup" {
                    LrSchedulerType::Constant
                } else {
                    parse_enum(key, value)?
                }
            }
            "warmup_ratio" => self.warmup_ratio = parse_f64(key, value)?,
            "warmup_steps" => self.warmup_steps = parse_u64(key, value)?,
            "max_steps" => self.max_steps = parse_opt(key, value, parse_u64)?,
            "num_train_epochs" => self.num_train_epochs = parse_f64(key, value)?,
            "seed" => self.seed = parse_u64(key, value)?,
            "shuffle_dataset" => self.shuffle_dataset = parse_bool(key, value)?,
            "auto_find_batch_size" => self.auto_find_batch_size = parse_bool(key, value)?,
            "logging_steps" => self.logging_steps = parse_u64(key, value)?,
            "save_steps" => self.save_steps = parse_u64(key, value)?,
            "save_strategy" => self.save_strategy = parse_enum(key, value)?,
            "save_total_limit" => self.save_total_limit = parse_opt(key, value, parse_usize)?,
            "output_dir" => {
                let v = value.trim();
                if v.is_empty() {
                    return Err(bad(key, value, "a directory path"));
                }
                self.output_dir = PathBuf::from(v)
            }
            "use_peft" => self.use_peft = parse_bool(key, value)?,
            "lora_r" => self.lora_r = parse_usize(key, value)?,
            "lora_alpha" => self.lora_alpha = parse_f64(key, value)?,
            "lora_dropout" => self.lora_dropout = parse_f64(key, value)?,
            "lora_target_modules" => {
                self.lora_target_modules = value
                    .split(',')
                    .map(|m| m.trim().to_string())
                    .filter(|m| !m.is_empty())
                    .collect()
            }
            "use_rslora" => self.use_rslora = parse_bool(key, value)?,
            "zero_stage" => {
                self.zero_stage = value
                    .trim()
                    .parse::<u8>()
                    .map_err(|_| bad(key, value, "0 or 1"))?
            }
            "report_to" => self.report_to = parse_enum(key, value)?,
            "log_completions" => self.log_completions = parse_bool(key, value)?,
            "num_completions_to_print" => {
                self.num_completions_to_print = parse_opt(key, value, parse_usize)?
            }
            "eval_strategy" => self.eval_strategy = parse_enum(key, value)?,
            "eval_steps" => self.eval_steps = parse_opt(key, value, parse_u64)?,
            "eval_dataset" => {
                self.eval_dataset = parse_opt(key, value, |_, v| Ok(PathBuf::from(v)))?
            }
            "eval_holdout" => self.eval_holdout = parse_f64(key, value)?,
            "per_device_eval_batch_size" => {
                self.per_device_eval_batch_size = parse_usize(key, value)?
            }
            "num_generations_eval" => {
                self.num_generations_eval = parse_opt(key, value, parse_usize)?
            }
            "eval_do_sample" => self.eval_do_sample = parse_bool(key, value)?,
            "eval_pass_threshold" => self.eval_pass_threshold = parse_f64(key, value)?,
            "metric_for_best_model" => {
                self.metric_for_best_model = parse_opt(key, value, |_, v| Ok(v.to_string()))?
            }
            "greater_is_better" => self.greater_is_better = parse_opt(key, value, parse_bool)?,
            "load_best_model_at_end" => self.load_best_model_at_end = parse_bool(key, value)?,
            "reward_funcs" | "reward_weights" => {
                return Err(ConfigError::NotOverridable {
                    key: key.to_string(),
                    hint: "declare reward functions and their weights as [[reward_funcs]] tables \
                           in the TOML file",
                })
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    key: key.to_string(),
                    known: KEYS.join(", "),
                })
            }
        }
        Ok(())
    }

    /// Applies `key=value` (the CLI's `--set`).
    pub fn apply_assignment(&mut self, text: &str) -> Result<(), ConfigError> {
        let (key, value) = text
            .split_once('=')
            .ok_or_else(|| ConfigError::NotAnAssignment {
                text: text.to_string(),
            })?;
        self.apply_override(key, value)
    }

    /// Checks every range and the batch arithmetic; the first problem is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let lr = self.learning_rate;
        check(
            lr.is_finite() && lr > 0.0,
            "learning_rate",
            lr,
            "a positive number such as 1e-6",
        )?;
        check(
            self.num_generations >= 2,
            "num_generations",
            self.num_generations,
            "at least 2 (group advantages need two completions per prompt)",
        )?;
        for (field, v) in [
            (
                "per_device_train_batch_size",
                self.per_device_train_batch_size,
            ),
            ("steps_per_generation", self.steps_per_generation),
            ("num_iterations", self.num_iterations),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
            ("max_completion_length", self.max_completion_length),
            ("num_scheduler_steps", self.num_scheduler_steps),
        ] {
            check(v >= 1, field, v, "at least 1")?;
        }
        if let Some(v) = self.max_prompt_length {
            check(
                v >= 1,
                "max_prompt_length",
                v,
                "at least 1, or none for no limit",
            )?;
        }
        if let Some(v) = self.max_num_seqs {
            check(
                v >= 1,
                "max_num_seqs",
                v,
                "at least 1, or none for all completions at once",
            )?;
        }
        let e = self.epsilon;
        check(
            e.is_finite() && e > 0.0 && e < 1.0,
            "epsilon",
            e,
            "0 < epsilon < 1 (GSPO: 3e-4)",
        )?;
        let eh = self.epsilon_high;
        check(
            eh.is_finite() && eh > 0.0,
            "epsilon_high",
            eh,
            "a positive number (GSPO: 4e-4)",
        )?;
        let b = self.beta;
        check(
            b.is_finite() && b >= 0.0,
            "beta",
            b,
            "0 or more (GSPO: 0, no KL term)",
        )?;
        let t = self.temperature;
        check(
            t.is_finite() && t > 0.0,
            "temperature",
            t,
            "a positive number (1.0: plain sampling)",
        )?;
        let p = self.top_p;
        check(
            p.is_finite() && p > 0.0 && p <= 1.0,
            "top_p",
            p,
            "0 < top_p <= 1 (1.0: off)",
        )?;
        let g = self.max_grad_norm;
        check(
            g.is_finite() && g >= 0.0,
            "max_grad_norm",
            g,
            "0 (no clipping) or a positive norm",
        )?;
        let wd = self.weight_decay;
        check(wd.is_finite() && wd >= 0.0, "weight_decay", wd, "0 or more")?;
        for (field, v) in [
            ("adam_beta1", self.adam_beta1),
            ("adam_beta2", self.adam_beta2),
        ] {
            check(
                v.is_finite() && (0.0..1.0).contains(&v),
                field,
                v,
                "0 <= beta < 1",
            )?;
        }
        let ae = self.adam_epsilon;
        check(
            ae.is_finite() && ae >= 0.0,
            "adam_epsilon",
            ae,
            "0 or more (default 1e-8)",
        )?;
        let wr = self.warmup_ratio;
        check(
            wr.is_finite() && (0.0..=1.0).contains(&wr),
            "warmup_ratio",
            wr,
            "0 <= warmup_ratio <= 1",
        )?;
        if self.warmup_steps > 0 && wr > 0.0 {
            return Err(ConfigError::WarmupConflict {
                warmup_steps: self.warmup_steps,
                warmup_ratio: wr,
            });
        }
        if let Some(m) = self.max_steps {
            check(
                m >= 1,
                "max_steps",
                m,
                "at least 1, or none to train for num_train_epochs",
            )?;
        }
        let ep = self.num_train_epochs;
        check(
            ep.is_finite() && ep > 0.0,
            "num_train_epochs",
            ep,
            "a positive number",
        )?;
        check(
            self.logging_steps >= 1,
            "logging_steps",
            self.logging_steps,
            "at least 1",
        )?;
        check(
            self.save_steps >= 1,
            "save_steps",
            self.save_steps,
            "at least 1",
        )?;
        if let Some(n) = self.save_total_limit {
            check(
                n >= 1,
                "save_total_limit",
                n,
                "at least 1, or none to keep every checkpoint",
            )?;
        }
        check(
            !self.output_dir.as_os_str().is_empty(),
            "output_dir",
            "\"\"",
            "a directory path",
        )?;
        check(
            self.zero_stage <= 1,
            "zero_stage",
            self.zero_stage,
            "0 (no sharding) or 1 (optimizer state sharded over data-parallel processes)",
        )?;
        if self.use_peft {
            self.lora_config()
                .validate()
                .map_err(|message| ConfigError::BadValue {
                    key: "use_peft".into(),
                    value: "true".into(),
                    expected: message,
                })?;
        }
        self.check_batch_arithmetic()?;
        self.check_eval()?;
        self.check_reward_funcs()
    }

    fn check_batch_arithmetic(&self) -> Result<(), ConfigError> {
        let b = self.per_device_train_batch_size;
        let s = self.steps_per_generation;
        let g = self.num_generations;
        let gen = b * s;
        if gen.is_multiple_of(g) {
            return Ok(());
        }
        // per_device_train_batch_size must be a multiple of g / gcd(g, s).
        let step = g / gcd(g, s);
        let lower = (b / step) * step;
        let upper = lower + step;
        let batch_fix = if lower >= 1 {
            format!("per_device_train_batch_size = {lower} or {upper}")
        } else {
            format!("per_device_train_batch_size = {upper}")
        };
        let divisors: Vec<String> = (2..=gen)
            .filter(|d| gen.is_multiple_of(*d))
            .map(|d| d.to_string())
            .collect();
        let group_fix = if divisors.is_empty() {
            String::new()
        } else {
            format!(
                ", or num_generations to a divisor of {gen} ({})",
                divisors.join(", ")
            )
        };
        let steps_step = g / gcd(g, b);
        Err(ConfigError::BatchNotMultipleOfGroup {
            per_device_train_batch_size: b,
            steps_per_generation: s,
            generation_batch: gen,
            num_generations: g,
            fix: format!(
                "set {batch_fix}, or steps_per_generation to a multiple of {steps_step}{group_fix}"
            ),
        })
    }

    /// The adapters' PEFT config (`use_peft`).
    pub fn lora_config(&self) -> fleet_models::lora::LoraConfig {
        let modules: Vec<&str> = self
            .lora_target_modules
            .iter()
            .map(String::as_str)
            .collect();
        let mut c = fleet_models::lora::LoraConfig::new(self.lora_r, self.lora_alpha, &modules);
        // PEFT takes "all-linear" as a string only (a one-element list would name a module);
        // a single module stays a list, since PEFT reads a string as a pattern of full names.
        if modules == ["all-linear"] {
            c.target_modules = fleet_models::lora::TargetModules::One("all-linear".into());
        }
        c.lora_dropout = self.lora_dropout;
        c.use_rslora = self.use_rslora;
        c
    }

    /// Completions per evaluation prompt.
    pub fn eval_generations(&self) -> usize {
        self.num_generations_eval.unwrap_or(self.num_generations)
    }

    /// Optimizer steps between evaluations; `None` when `eval_strategy = "no"`.
    pub fn eval_every(&self) -> Option<u64> {
        match self.eval_strategy {
            IntervalStrategy::No => None,
            IntervalStrategy::Steps => Some(self.eval_steps.unwrap_or(self.logging_steps)),
        }
    }

    /// The metric that picks the best checkpoint (`eval_`-prefixed) and whether larger is
    /// better; `None` when no best checkpoint is tracked.
    pub fn best_metric(&self) -> Option<(String, bool)> {
        let name = match (&self.metric_for_best_model, self.load_best_model_at_end) {
            (Some(m), _) => m.trim().to_string(),
            (None, true) => "eval_reward".to_string(),
            (None, false) => return None,
        };
        let name = if name.starts_with("eval_") {
            name
        } else {
            format!("eval_{name}")
        };
        let greater = self.greater_is_better.unwrap_or(!name.ends_with("loss"));
        Some((name, greater))
    }

    fn check_eval(&self) -> Result<(), ConfigError> {
        let h = self.eval_holdout;
        check(
            h.is_finite() && (0.0..1.0).contains(&h),
            "eval_holdout",
            h,
            "0 <= eval_holdout < 1 (the fraction of the training prompts held out; 0: none)",
        )?;
        if self.load_best_model_at_end && self.save_strategy == IntervalStrategy::No {
            return Err(ConfigError::BadValue {
                key: "load_best_model_at_end".into(),
                value: "true".into(),
                expected: "save_strategy = \"steps\" (the best model is a checkpoint)".into(),
            });
        }
        let Some(every) = self.eval_every() else {
            if self.load_best_model_at_end {
                return Err(ConfigError::BadValue {
                    key: "load_best_model_at_end".into(),
                    value: "true".into(),
                    expected: "eval_strategy = \"steps\" (no evaluation, no best model)".into(),
                });
            }
            // The evaluation's settings matter only when it runs.
            return Ok(());
        };
        check(
            self.per_device_eval_batch_size >= 1,
            "per_device_eval_batch_size",
            self.per_device_eval_batch_size,
            "at least 1",
        )?;
        let k = self.eval_generations();
        check(
            k >= 1,
            "num_generations_eval",
            k,
            "at least 1, or none for num_generations",
        )?;
        check(
            self.per_device_eval_batch_size.is_multiple_of(k),
            "per_device_eval_batch_size",
            self.per_device_eval_batch_size,
            &format!(
                "a multiple of num_generations_eval ({k}): a prompt's k completions are \
                 evaluated together"
            ),
        )?;
        check(
            self.eval_do_sample || k == 1,
            "num_generations_eval",
            k,
            "1 with eval_do_sample = false (greedy completions of a prompt are all the same)",
        )?;
        check(
            self.eval_pass_threshold.is_finite(),
            "eval_pass_threshold",
            self.eval_pass_threshold,
            "a finite reward",
        )?;
        {
            check(every >= 1, "eval_steps", every, "at least 1")?;
            if self.eval_dataset.is_none() && self.eval_holdout == 0.0 {
                return Err(ConfigError::BadValue {
                    key: "eval_strategy".into(),
                    value: "steps".into(),
                    expected: "evaluation prompts: eval_dataset = \"FILE.jsonl\" (--eval-dataset) \
                               or eval_holdout = 0.05 (a fraction of the training file)"
                        .into(),
                });
            }
            if self.load_best_model_at_end && !self.save_steps.is_multiple_of(every) {
                return Err(ConfigError::BadValue {
                    key: "load_best_model_at_end".into(),
                    value: "true".into(),
                    expected: format!(
                        "save_steps ({}) a multiple of eval_steps ({every}), so that an \
                         evaluated model is saved (HF's rule)",
                        self.save_steps
                    ),
                });
            }
        }
        Ok(())
    }

    fn check_reward_funcs(&self) -> Result<(), ConfigError> {
        if self.reward_funcs.is_empty() {
            return Err(ConfigError::NoRewardFuncs {
                known: RewardSpec::NAMES.join(", "),
            });
        }
        for (i, spec) in self.reward_funcs.iter().enumerate() {
            spec.validate().map_err(|message| ConfigError::RewardFunc {
                index: i,
                name: spec.name().to_string(),
                message,
            })?;
            // Functions named by their process (a command without `label`) are told apart
            // when they greet (WeightedSum refuses two of one name).
            let name = spec.config_name();
            if let Some(first) = self.reward_funcs[..i]
                .iter()
                .position(|other| name.is_some() && other.config_name() == name)
            {
                return Err(ConfigError::DuplicateRewardFunc {
                    name: spec.name().to_string(),
                    first,
                    second: i,
                });
            }
        }
        Ok(())
    }

    /// Completions generated per process per generation:
    /// `per_device_train_batch_size × steps_per_generation`.
    pub fn generation_batch_size(&self) -> usize {
        self.per_device_train_batch_size * self.steps_per_generation
    }

    /// Distinct prompts per process per generation: generation batch / G.
    pub fn prompts_per_generation(&self) -> usize {
        self.generation_batch_size() / self.num_generations
    }

    /// The same run with micro-batches `factor` times smaller: `per_device_train_batch_size`
    /// divided by `factor` (which must divide it), `steps_per_generation` and
    /// `gradient_accumulation_steps` multiplied by it. Rollouts, optimizer steps, the
    /// on-policy condition and the step count are unchanged.
    pub fn with_smaller_micro_batch(&self, factor: usize) -> GspoConfig {
        debug_assert!(factor > 0 && self.per_device_train_batch_size.is_multiple_of(factor));
        GspoConfig {
            per_device_train_batch_size: self.per_device_train_batch_size / factor,
            steps_per_generation: self.steps_per_generation * factor,
            gradient_accumulation_steps: self.gradient_accumulation_steps * factor,
            ..self.clone()
        }
    }

    /// Micro-steps each generation batch feeds: `steps_per_generation × num_iterations`.
    pub fn micro_steps_per_generation(&self) -> usize {
        self.steps_per_generation * self.num_iterations
    }

    /// TRL's exact condition (`grpo_trainer.py` L2561-2563): training is on-policy when
    /// `gradient_accumulation_steps % (steps_per_generation × num_iterations) == 0`. Then every
    /// generation batch is consumed within one optimizer step, old log-probs are not computed
    /// (the loss uses the current ones, detached), the ratio is exactly 1 and nothing clips.
    pub fn is_on_policy(&self) -> bool {
        let m = self.micro_steps_per_generation();
        m > 0 && self.gradient_accumulation_steps.is_multiple_of(m)
    }

    /// One line for the log saying whether training is on- or off-policy and why.
    pub fn policy_explanation(&self) -> String {
        let s = self.steps_per_generation;
        let n = self.num_iterations;
        let gas = self.gradient_accumulation_steps;
        const ON: &str = "on-policy: the GSPO ratio is exactly 1 and nothing clips; GSPO differs \
                          from plain policy gradient only off-policy";
        if self.is_on_policy() {
            if s == 1 && n == 1 {
                format!(
                    "steps_per_generation=1 and num_iterations=1: each batch is used once, {ON}"
                )
            } else {
                format!(
                    "gradient_accumulation_steps={gas} is a multiple of steps_per_generation x \
                     num_iterations = {s} x {n}: each generation batch is used within one \
                     optimizer step, {ON}"
                )
            }
        } else {
            let micro = s * n;
            let steps = micro as f64 / gas as f64;
            format!(
                "steps_per_generation={s}, num_iterations={n}, gradient_accumulation_steps={gas}: \
                 {steps} optimizer steps per generation batch, off-policy after the first: old \
                 log-probs are computed after generation, the GSPO ratio moves away from 1 and is \
                 clipped to [1 - {}, 1 + {}]",
                self.epsilon, self.epsilon_high
            )
        }
    }

    /// Optimizer steps the run makes: `max_steps` when set, else HF's
    /// `ceil(num_train_epochs × steps per epoch)`, where an epoch is
    /// `floor(num_prompts / (prompts_per_generation × world_size))` generation batches (TRL's
    /// `RepeatSampler` drops an incomplete last batch), each feeding
    /// `steps_per_generation × num_iterations` micro-steps, `gradient_accumulation_steps` per
    /// optimizer step (floored, at least 1).
    pub fn total_optimizer_steps(
        &self,
        num_prompts: usize,
        world_size: usize,
    ) -> Result<u64, ConfigError> {
        if let Some(m) = self.max_steps {
            return Ok(m);
        }
        check(
            world_size >= 1,
            "world_size",
            world_size,
            "at least 1 process",
        )?;
        let per_gen = self.prompts_per_generation() * world_size;
        let gens = num_prompts.checked_div(per_gen).unwrap_or(0);
        if gens == 0 {
            return Err(ConfigError::OutOfRange {
                field: "num_train_epochs",
                value: format!("{} with {num_prompts} prompts", self.num_train_epochs),
                expected: format!(
                    "a dataset of at least {per_gen} prompts (one generation batch: \
                     per_device_train_batch_size x steps_per_generation / num_generations x \
                     processes), or set max_steps"
                ),
            });
        }
        let micro = (gens * self.micro_steps_per_generation()) as u64;
        let per_epoch = (micro / self.gradient_accumulation_steps as u64).max(1);
        Ok((self.num_train_epochs * per_epoch as f64).ceil() as u64)
    }

    /// Warm-up steps for a run of `total_steps`: `warmup_steps`, or
    /// `ceil(total_steps × warmup_ratio)` (HF `get_warmup_steps`).
    pub fn warmup_steps_for(&self, total_steps: u64) -> u64 {
        if self.warmup_steps > 0 {
            self.warmup_steps
        } else {
            (total_steps as f64 * self.warmup_ratio).ceil() as u64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[[reward_funcs]]
name = "gsm8k_exact"
weight = 1.0
"#;

    fn valid() -> GspoConfig {
        GspoConfig::from_toml_str(MINIMAL).unwrap()
    }

    /// A smaller micro-batch keeps the rollouts, the optimizer batch, the on-policy condition
    /// and the optimizer steps per generation batch; and the config still validates.
    #[test]
    fn a_smaller_micro_batch_keeps_every_batch_the_algorithm_sees() {
        for (gas, iters) in [(1, 1), (4, 1), (2, 2)] {
            let mut c = valid();
            c.per_device_train_batch_size = 12;
            c.gradient_accumulation_steps = gas;
            c.num_iterations = iters;
            for factor in [2, 3, 4, 12] {
                let s = c.with_smaller_micro_batch(factor);
                s.validate().unwrap();
                assert_eq!(s.per_device_train_batch_size * factor, 12);
                assert_eq!(s.generation_batch_size(), c.generation_batch_size());
                assert_eq!(s.prompts_per_generation(), c.prompts_per_generation());
                assert_eq!(
                    s.per_device_train_batch_size * s.gradient_accumulation_steps,
                    c.per_device_train_batch_size * c.gradient_accumulation_steps
                );
                assert_eq!(s.is_on_policy(), c.is_on_policy());
                assert_eq!(
                    s.micro_steps_per_generation() / s.gradient_accumulation_steps,
                    c.micro_steps_per_generation() / c.gradient_accumulation_steps
                );
            }
        }
        let mut c = valid();
        c.apply_override("auto_find_batch_size", "true").unwrap();
        assert!(c.auto_find_batch_size);
        assert!(c.apply_override("auto_find_batch_size", "yes").is_err());
    }

    #[test]
    fn defaults_are_trls_documented_gspo_setting() {
        let c = valid();
        assert_eq!(
            c.importance_sampling_level,
            ImportanceSamplingLevel::Sequence
        );
        assert_eq!(c.loss_type, LossType::Grpo);
        assert_eq!(c.beta, 0.0);
        assert_eq!((c.epsilon, c.epsilon_high), (3e-4, 4e-4));
        assert_eq!(
            (c.steps_per_generation, c.gradient_accumulation_steps),
            (4, 1)
        );
        assert_eq!(c.num_generations, 8);
        assert_eq!(c.num_iterations, 1);
        assert_eq!(c.learning_rate, 1e-6);
        assert_eq!(c.max_completion_length, 256);
        assert_eq!(c.scale_rewards, ScaleRewards::Group);
        assert!(!c.is_on_policy(), "4 optimizer steps per generation batch");
        assert_eq!(c.generation_batch_size(), 32);
        assert_eq!(c.prompts_per_generation(), 4);
    }

    #[test]
    fn unknown_fields_and_reward_names_are_rejected() {
        let err = GspoConfig::from_toml_str("learning_rat = 1e-6\n").unwrap_err();
        assert!(err.to_string().contains("learning_rat"), "{err}");
        let err = GspoConfig::from_toml_str("[[reward_funcs]]\nname = \"gsm8k\"\n").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("gsm8k_exact") && msg.contains("multiple_choice"),
            "{msg}"
        );
        let err = GspoConfig::from_toml_str("").unwrap_err();
        assert!(matches!(err, ConfigError::NoRewardFuncs { .. }), "{err}");
    }

    #[test]
    fn toml_round_trips() {
        let mut c = valid();
        c.max_steps = Some(10);
        c.scale_rewards = ScaleRewards::None;
        c.reward_funcs.push(RewardSpec::Format {
            weight: 0.5,
            tags: vec![["<think>".into(), "</think>".into()]],
            final_line_prefix: None,
        });
        c.reward_funcs.push(RewardSpec::Length {
            weight: 1.0,
            max_length: 256,
            cache_length: 64,
            unit: crate::rewards::LengthUnit::Tokens,
        });
        let text = c.to_toml_string().unwrap();
        assert_eq!(GspoConfig::from_toml_str(&text).unwrap(), c);
    }

    #[test]
    fn batch_arithmetic_names_the_values_to_change() {
        let mut c = valid();
        c.per_device_train_batch_size = 6;
        c.num_generations = 16;
        let err = c.validate().unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("6") && msg.contains("24") && msg.contains("16"),
            "{msg}"
        );
        assert!(
            msg.contains("per_device_train_batch_size = 4 or 8"),
            "{msg}"
        );
        assert!(
            msg.contains("divisor of 24 (2, 3, 4, 6, 8, 12, 24)"),
            "{msg}"
        );
        c.per_device_train_batch_size = 8;
        c.validate().unwrap();
        let mut c = valid();
        c.num_generations = 1;
        assert!(matches!(
            c.validate().unwrap_err(),
            ConfigError::OutOfRange {
                field: "num_generations",
                ..
            }
        ));
    }

    #[test]
    fn ranges_are_checked() {
        for (key, value, field) in [
            ("learning_rate", "0", "learning_rate"),
            ("epsilon", "1.5", "epsilon"),
            ("epsilon_high", "-1", "epsilon_high"),
            ("beta", "-0.1", "beta"),
            ("temperature", "0", "temperature"),
            ("top_p", "0", "top_p"),
            ("adam_beta2", "1", "adam_beta2"),
            ("max_steps", "0", "max_steps"),
            ("num_train_epochs", "nan", "num_train_epochs"),
            (
                "gradient_accumulation_steps",
                "0",
                "gradient_accumulation_steps",
            ),
        ] {
            let mut c = valid();
            c.apply_override(key, value).unwrap();
            match c.validate().unwrap_err() {
                ConfigError::OutOfRange { field: f, .. } => assert_eq!(f, field),
                other => panic!("{key}: {other}"),
            }
        }
        let mut c = valid();
        c.warmup_steps = 5;
        c.warmup_ratio = 0.1;
        assert!(matches!(
            c.validate().unwrap_err(),
            ConfigError::WarmupConflict { .. }
        ));
    }

    #[test]
    fn overrides_accept_trl_names_and_the_seed_aliases() {
        let mut c = valid();
        c.apply_override("BATCH_SIZE", "16").unwrap();
        c.apply_override("group_size", "4").unwrap();
        c.apply_override("GSPO_EPOCHS", "2").unwrap();
        c.apply_assignment("learning_rate=2e-6").unwrap();
        c.apply_override("importance_sampling_level", "sequence_token")
            .unwrap();
        c.apply_override("scale_rewards", "false").unwrap();
        c.apply_override("max_steps", "none").unwrap();
        c.apply_override("max_prompt_length", "512").unwrap();
        c.apply_override("lr_scheduler_type", "constant_with_warmup")
            .unwrap();
        assert_eq!(c.per_device_train_batch_size, 16);
        assert_eq!(c.num_generations, 4);
        assert_eq!(c.num_iterations, 2);
        assert_eq!(c.learning_rate, 2e-6);
        assert_eq!(
            c.importance_sampling_level,
            ImportanceSamplingLevel::SequenceToken
        );
        assert_eq!(c.scale_rewards, ScaleRewards::None);
        assert_eq!(c.max_steps, None);
        assert_eq!(c.max_prompt_length, Some(512));
        assert_eq!(c.lr_scheduler_type, LrSchedulerType::Constant);
        c.validate().unwrap();
    }

    #[test]
    fn override_errors_name_the_key_and_type() {
        let mut c = valid();
        let err = c.apply_override("BATCH_SIZE", "eight").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("BATCH_SIZE") && msg.contains("eight") && msg.contains("integer"),
            "{msg}"
        );
        let err = c.apply_override("scale_rewards", "groups").unwrap_err();
        assert!(err.to_string().contains("group, batch, none"), "{err}");
        let err = c.apply_override("lr", "1").unwrap_err();
        assert!(matches!(err, ConfigError::UnknownKey { .. }));
        assert!(err.to_string().contains("learning_rate"));
        assert!(matches!(
            c.apply_assignment("learning_rate").unwrap_err(),
            ConfigError::NotAnAssignment { .. }
        ));
        assert!(matches!(
            c.apply_override("reward_funcs", "x").unwrap_err(),
            ConfigError::NotOverridable { .. }
        ));
        let err = c
            .apply_override("mask_truncated_completions", "yes")
            .unwrap_err();
        assert!(err.to_string().contains("true or false"));
    }

    #[test]
    fn on_policy_follows_trls_condition() {
        let mut c = valid();
        c.steps_per_generation = 1;
        c.per_device_train_batch_size = 8;
        assert!(c.is_on_policy());
        assert_eq!(
            c.policy_explanation(),
            "steps_per_generation=1 and num_iterations=1: each batch is used once, on-policy: \
             the GSPO ratio is exactly 1 and nothing clips; GSPO differs from plain policy \
             gradient only off-policy"
        );
        // steps_per_generation == gradient_accumulation_steps > 1 is still on-policy.
        c.steps_per_generation = 4;
        c.gradient_accumulation_steps = 4;
        assert!(c.is_on_policy());
        assert!(c.policy_explanation().contains("on-policy"));
        c.num_iterations = 2;
        assert!(!c.is_on_policy());
        let line = c.policy_explanation();
        assert!(
            line.contains("off-policy") && line.contains("2 optimizer steps"),
            "{line}"
        );
        c.gradient_accumulation_steps = 8;
        assert!(c.is_on_policy());
    }

    #[test]
    fn total_steps_follow_hf_and_trl() {
        let mut c = valid();
        // 4 prompts per generation batch, 4 micro-steps each, 1 per optimizer step.
        assert_eq!(c.total_optimizer_steps(10, 1).unwrap(), 8);
        assert_eq!(c.total_optimizer_steps(10, 2).unwrap(), 4);
        c.num_train_epochs = 1.5;
        assert_eq!(c.total_optimizer_steps(16, 1).unwrap(), 24);
        assert!(c.total_optimizer_steps(3, 1).is_err());
        c.max_steps = Some(7);
        assert_eq!(c.total_optimizer_steps(3, 1).unwrap(), 7);
        c.warmup_ratio = 0.1;
        assert_eq!(c.warmup_steps_for(25), 3);
        c.warmup_ratio = 0.0;
        c.warmup_steps = 4;
        assert_eq!(c.warmup_steps_for(25), 4);
    }
}
