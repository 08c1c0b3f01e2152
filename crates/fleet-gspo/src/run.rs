//! Setting a run up: the checkpoint found and placed, the output directory taken and checked,
//! a resume picked up where it stopped.
//!
//! The output directory is a [`fleet_dist::RunDir`]: one run at a time, and a manifest of what
//! determines the training (the base model by content, the dataset, the reward functions,
//! every setting of the algorithm and the optimizer). A run into a directory that holds
//! checkpoints must say `--resume` (continue) or `--overwrite` (start over); a resume with a
//! manifest that differs is refused with the fields that differ, the checkpoints untouched.
//! `max_steps` and `num_train_epochs` may change on a resume (to train longer), as may where
//! and how often checkpoints and logs are written.

use std::path::{Path, PathBuf};

use candle_core::DType;
use fleet_dist::{Manifest, RunDir, RunDirOptions, RunDirState};
use fleet_models::qwen::train::TrainableQwen;
use fleet_models::{CheckpointFiles, HubOptions, ModelSource, QwenConfig, TextModel, Weights};
use fleet_topology::{
    plan_training, MaxMemory, ModelShape, Topology, TrainingPlan, TrainingPreset, TrainingRequest,
    TrainingWorkload,
};

use crate::checkpoint::{self, TrainerState};
use crate::config::GspoConfig;
use crate::dataset::{load_prompts, PromptSampler};
use crate::metrics::MetricsLog;
use crate::optim::{AdamW, AdamWConfig, LrSchedule, OptimizerState};
use crate::rewards::WeightedSum;
use crate::trainer::Trainer;
use crate::TrainError;

/// How to start a run, besides the [`GspoConfig`].
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The base model: a local checkpoint directory or a hub id.
    pub model: String,
    /// Hub revision of the base model.
    pub revision: Option<String>,
    /// The prompt dataset (JSONL).
    pub dataset: PathBuf,
    /// Compute dtype (bf16 on GPUs, f32 on the CPU).
    pub dtype: DType,
    /// Where the models go (`1gpu`, `2gpu`, `3gpu`, `auto`).
    pub preset: TrainingPreset,
    /// Only these GPUs (positions in the preset count within them).
    pub gpu_ids: Option<Vec<usize>>,
    /// Per-device budgets.
    pub max_memory: MaxMemory,
    /// Recompute each block in the backward (less memory, about a third more compute).
    pub gradient_checkpointing: bool,
    /// Continue from the newest checkpoint in the output directory.
    pub resume: bool,
    /// Remove what an earlier run left in the output directory and start over.
    pub overwrite: bool,
    /// Plan only: say what fits where, load nothing.
    pub plan_only: bool,
}

/// What [`prepare`] found, for the binary to print.
pub struct Prepared {
    /// The trainer, ready to run (`None` with `plan_only`).
    pub trainer: Option<Trainer>,
    /// Where the models go.
    pub plan: TrainingPlan,
    /// How the output directory was found.
    pub state: RunDirState,
    /// The dataset's load report.
    pub dataset_report: String,
    /// The checkpoint resumed from, if any.
    pub resumed_from: Option<PathBuf>,
    /// The output directory, held for the whole run (one writer).
    pub run_dir: Option<RunDir>,
}

/// The files of a run in its output directory that `--overwrite` removes (checkpoints are
/// found by name).
fn owned_files(output_dir: &Path) -> Vec<String> {
    let mut files: Vec<String> = [
        "metrics.jsonl",
        checkpoint::LATEST,
        "reward.png",
        "reward.svg",
        "loss.png",
        "loss.svg",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    files.extend(
        checkpoint::list(output_dir)
            .into_iter()
            .filter_map(|(_, p)| p.file_name().map(|n| n.to_string_lossy().into_owned())),
    );
    files
}

/// The manifest of a run: what a resume must find unchanged.
pub fn run_manifest(
    config: &GspoConfig,
    base: &fleet_models::CheckpointIdentity,
    dataset_digest: &str,
    dtype: DType,
) -> Manifest {
    let mut settings = serde_json::to_value(config).unwrap_or_default();
    if let Some(obj) = settings.as_object_mut() {
        // Free to change between the parts of one run.
        for key in [
            "max_steps",
            "num_train_epochs",
            "save_steps",
            "save_total_limit",
            "logging_steps",
            "output_dir",
            "model_name_or_path",
            "dataset_name",
        ] {
            obj.remove(key);
        }
    }
    Manifest::new("gspo-train")
        .with("base_model", base)
        .with("dataset_digest", dataset_digest)
        .with("dtype", format!("{dtype:?}").to_lowercase())
        .with("config", settings)
}

/// Loads, places and checks everything a run needs (see the module docs).
pub fn prepare(config: &GspoConfig, opts: &RunOptions) -> Result<Prepared, TrainError> {
    config.validate()?;
    let hub = HubOptions::from_env();
    let source = ModelSource::parse(&opts.model, opts.revision.as_deref())?;
    let files = source.resolve(&hub)?;
    let qwen = QwenConfig::from_file(&files.config)?;

    // The data and the rewards first: a bad dataset is found before anything is loaded.
    let data = load_prompts(&opts.dataset)?;
    let dataset_report = data.report.to_string();
    // Length rewards counted in tokens use the policy's tokenizer.
    let counter: Option<crate::rewards::TokenCounter> = match &files.tokenizer {
        Some(path) => {
            let tokenizer = std::sync::Arc::new(fleet_models::TextTokenizer::from_file(path)?);
            Some(std::sync::Arc::new(move |text: &str| {
                tokenizer
                    .encode(text)
                    .map(|ids| ids.len())
                    .map_err(|e| e.to_string())
            }))
        }
        None => None,
    };
    // Every prompt rendered once: the longest sizes the plan, and a prompt that leaves no room
    // for the completion is refused now, not at its batch.
    let renderer = crate::prompt::PromptRenderer::new(&files, config.max_prompt_length)?;
    let prompts = data
        .samples
        .iter()
        .map(|s| renderer.render(s))
        .collect::<Result<Vec<_>, _>>()?;
    let room = qwen.max_position_embeddings;
    let too_long: Vec<&str> = data
        .samples
        .iter()
        .zip(&prompts)
        .filter(|(_, p)| p.ids.len() + config.max_completion_length > room)
        .map(|(s, _)| s.id.as_str())
        .collect();
    if let Some(first) = too_long.first() {
        return Err(TrainError::Setup(format!(
            "{} prompt(s) (first: {first}) plus max_completion_length = {} exceed the model's \
             max_position_embeddings = {room}: set max_prompt_length (prompts are cut from the \
             left), lower max_completion_length, or drop those prompts",
            too_long.len(),
            config.max_completion_length
        )));
    }
    let cut = prompts.iter().filter(|p| p.cut > 0).count();
    if cut > 0 {
        tracing::warn!(
            "{cut} prompt(s) are longer than max_prompt_length = {:?}: their beginning is cut",
            config.max_prompt_length
        );
    }
    let longest_prompt = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(1);

    // Placement, before loading: what fits where.
    let plan = plan(config, opts, &files, longest_prompt)?;
    if opts.plan_only {
        // Loads nothing: a reward model is only sized.
        return Ok(Prepared {
            trainer: None,
            plan,
            state: RunDirState::New,
            dataset_report,
            resumed_from: None,
            run_dir: None,
        });
    }
    // The reward functions, a reward model on the device the plan gave it; rows they cannot
    // score at all are reported before anything else is loaded.
    let rewards = WeightedSum::from_specs_on(
        &config.reward_funcs,
        counter,
        plan.reward.as_ref().map(|m| (m, opts.dtype)),
    )?;
    let problems = rewards.check_samples(&data.samples);
    if let Some(p) = problems.first() {
        return Err(TrainError::Setup(format!(
            "{} of {} samples cannot be scored by the reward functions (first: {}: {}); fix \
             the dataset or choose other reward_funcs",
            problems.len(),
            data.samples.len(),
            p.id,
            p.error
        )));
    }

    // The output directory: one writer, and the same run or none.
    let base = files.identity()?;
    let dataset_bytes = std::fs::read(&opts.dataset)
        .map_err(|e| TrainError::Setup(format!("reading {}: {e}", opts.dataset.display())))?;
    let manifest = run_manifest(
        config,
        &base,
        &fleet_dist::bytes_digest(&dataset_bytes),
        opts.dtype,
    )
    .note("model", &opts.model)
    .note("dataset", opts.dataset.display().to_string())
    .note("commit", fleet_dist::commit_id());
    let out = &config.output_dir;
    let mut options = RunDirOptions::new(
        &owned_files(out)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        opts.overwrite,
    );
    options.dir_flag = "--output-dir".into();
    let run_dir = RunDir::open(out, &manifest, &options)?;
    let has_checkpoints = !checkpoint::list(out).is_empty();
    if run_dir.state == RunDirState::Resumed && has_checkpoints && !opts.resume {
        return Err(TrainError::Setup(format!(
            "{} holds checkpoints of this run: pass --resume to continue from the newest, or \
             --overwrite to start over",
            out.display()
        )));
    }

    // The policy: from the newest checkpoint when resuming, else from the base model.
    let (weights_files, state, resumed_from) = if opts.resume && has_checkpoints {
        let ckpt = checkpoint::latest(out)?;
        let state = checkpoint::load_state(&ckpt, &base)?;
        (vec![ckpt.join("model.safetensors")], state, Some(ckpt))
    } else {
        if opts.resume {
            tracing::warn!(
                "--resume: {} has no checkpoint yet; starting from {}",
                out.display(),
                opts.model
            );
        }
        let state = TrainerState {
            step: 0,
            generation_batch: 0,
            cursor: Default::default(),
            num_tokens: 0,
            base_model: base.clone(),
            base_model_id: opts.model.clone(),
            commit: fleet_dist::commit_id(),
        };
        (files.weights.clone(), state, None)
    };
    let mut policy = TrainableQwen::new(
        &qwen,
        &Weights::from_safetensors(&weights_files)?,
        opts.dtype,
        &plan.policy,
    )?;
    policy.gradient_checkpointing = opts.gradient_checkpointing;
    let reference = match &plan.reference {
        Some(map) if config.beta > 0.0 => Some(TrainableQwen::new(
            &qwen,
            &Weights::from_safetensors(&files.weights)?,
            opts.dtype,
            map,
        )?),
        _ => None,
    };

    let mut optimizer = AdamW::new(policy.params(), AdamWConfig::from(config))?;
    if let Some(ckpt) = &resumed_from {
        let device = policy
            .param("model.norm.weight")
            .map(|v| v.device().clone())
            .unwrap_or(candle_core::Device::Cpu);
        let saved = OptimizerState::load(&ckpt.join("optimizer.safetensors"), &device)?;
        optimizer.load_state(&saved)?;
    }
    let sampler = PromptSampler::resume(
        data.len(),
        config.seed,
        config.shuffle_dataset,
        state.cursor,
    )?;
    let total_steps = config.total_optimizer_steps(data.len(), 1)?;
    let schedule = LrSchedule::from_config(config, total_steps)?;

    // Metrics: a resumed run drops the lines of steps after its checkpoint (they are redone).
    let metrics_path = out.join("metrics.jsonl");
    if resumed_from.is_some() {
        crate::metrics::truncate_after(&metrics_path, state.step)?;
    }
    let (metrics, _) = MetricsLog::open(&metrics_path)?;

    let text = TextModel::with_model(source, files.clone(), policy.inference_model()?)?;
    let trainer = Trainer {
        config: config.clone(),
        policy,
        text,
        base: files,
        reference,
        rewards,
        data,
        prompts,
        sampler,
        optimizer,
        schedule,
        total_steps,
        state,
        metrics,
        memory: fleet_topology::MemoryWatch::start(&plan.policy.devices()),
    };
    Ok(Prepared {
        state: run_dir.state.clone(),
        trainer: Some(trainer),
        plan,
        dataset_report,
        resumed_from,
        run_dir: Some(run_dir),
    })
}

/// Where the models go on this machine (or on the CPU when it has no GPU).
fn plan(
    config: &GspoConfig,
    opts: &RunOptions,
    files: &CheckpointFiles,
    longest_prompt: usize,
) -> Result<TrainingPlan, TrainError> {
    let mut topology = Topology::from_devices(&fleet_topology::discover()?);
    if let Some(ids) = &opts.gpu_ids {
        topology = topology.select(ids)?;
    }
    let mut shape = ModelShape::from_config_file(&files.config)?;
    if let Some(dir) = files.weights.first().and_then(|w| w.parent()) {
        shape = shape.with_checkpoint(fleet_topology::CheckpointParams::from_dir(dir)?)?;
    }
    let workload = TrainingWorkload {
        compute_dtype: plan_dtype(opts.dtype),
        per_device_train_batch_size: config.per_device_train_batch_size,
        max_prompt_length: longest_prompt,
        max_completion_length: config.max_completion_length,
        num_generations: config.num_generations,
        prompts_per_step: config.prompts_per_generation(),
        gradient_checkpointing: opts.gradient_checkpointing,
        ..TrainingWorkload::default()
    };
    // A reward model is sized from its config.json and headers.
    let reward_shape = config
        .reward_funcs
        .iter()
        .find_map(|f| match f {
            crate::rewards::RewardSpec::RewardModel {
                model, revision, ..
            } => Some((model, revision)),
            _ => None,
        })
        .map(|(model, revision)| -> Result<ModelShape, TrainError> {
            let files =
                ModelSource::parse(model, revision.as_deref())?.resolve(&HubOptions::from_env())?;
            let mut shape = ModelShape::from_config_file(&files.config)?;
            if let Some(dir) = files.weights.first().and_then(|w| w.parent()) {
                shape = shape.with_checkpoint(fleet_topology::CheckpointParams::from_dir(dir)?)?;
            }
            Ok(shape)
        })
        .transpose()?;
    Ok(plan_training(
        &shape,
        reward_shape.as_ref(),
        &topology,
        &TrainingRequest {
            preset: opts.preset,
            workload,
            max_memory: opts.max_memory.clone(),
            reference: config.beta > 0.0,
        },
    )?)
}

/// fleet-topology's name for a compute dtype.
fn plan_dtype(dtype: DType) -> fleet_topology::DType {
    match dtype {
        DType::F32 => fleet_topology::DType::F32,
        DType::F16 => fleet_topology::DType::F16,
        _ => fleet_topology::DType::Bf16,
    }
}
