//! Setting a run up: the checkpoint found and placed, the output directory taken and checked,
//! a resume picked up where it stopped.
//!
//! The output directory is a [`fleet_runs::RunDir`]: one run at a time, and a manifest of what
//! determines the training (the base model by content, the dataset, the reward functions,
//! every setting of the algorithm and the optimizer). A run into a directory that holds
//! checkpoints must say `--resume` (continue) or `--overwrite` (start over); a resume with a
//! manifest that differs is refused with the fields that differ, the checkpoints untouched.
//! `max_steps` and `num_train_epochs` may change on a resume (to train longer), as may where
//! and how often checkpoints and logs are written.
//!
//! Data-parallel ([`DistOptions`]): the ranks meet after the manifest is known (a rank with
//! another config, model, dataset or commit is refused by name) and before anything is loaded;
//! rank 0 alone holds the output directory and decides whether to resume; every rank then
//! loads the same weights (a resumed checkpoint must be readable by every rank: one machine,
//! or a shared filesystem) and rank 0's weights are broadcast. A checkpoint holds no trace of
//! the world size: a run resumes on any number of GPUs.

use std::path::{Path, PathBuf};

use candle_core::DType;
use fleet_dist::{Collective, TcpCollective};
use fleet_models::qwen::train::TrainableQwen;
use fleet_models::{
    CheckpointFiles, HubOptions, ModelError, ModelSource, QwenConfig, TextModel, Weights,
};
use fleet_runs::{Manifest, RunDir, RunDirOptions, RunDirState};
use fleet_topology::{
    plan_training, MaxMemory, ModelShape, Topology, TrainingPlan, TrainingPreset, TrainingRequest,
    TrainingWorkload,
};

use crate::checkpoint::{self, TrainerState};
use crate::config::GspoConfig;
use crate::dataset::{load_prompts_with, PromptSampler};
use crate::dist::{BatchLayout, BatchScaling, DataParallel};
use crate::metrics::MetricsLog;
use crate::optim::{AdamW, AdamWConfig, LrSchedule, OptimizerState};
use crate::rewards::{RewardSpec, WeightedSum};
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
    /// Continue from this checkpoint of the output directory (TRL's `resume_from_checkpoint`
    /// with a path) instead of the newest; implies `resume`.
    pub resume_from_checkpoint: Option<PathBuf>,
    /// Remove what an earlier run left in the output directory and start over.
    pub overwrite: bool,
    /// Plan only: say what fits where, load nothing.
    pub plan_only: bool,
    /// Plan for the GPUs of this topology file (`configs/topologies/`) instead of this
    /// machine's: for sizing a run on a machine one does not have. Only with `plan_only`.
    pub topology: Option<PathBuf>,
    /// This process as one rank of a data-parallel run (`None`: the only process).
    pub dist: Option<DistOptions>,
}

impl RunOptions {
    /// Whether the run continues from a checkpoint (`resume` or `resume_from_checkpoint`).
    pub fn resumes(&self) -> bool {
        self.resume || self.resume_from_checkpoint.is_some()
    }
}

/// A rank of a data-parallel run, before it has met the others.
#[derive(Debug, Clone)]
pub struct DistOptions {
    /// Where this rank stands (from the launcher's, torchrun's or SLURM's variables).
    pub world: fleet_dist::World,
    /// How the batch follows the number of ranks.
    pub scaling: BatchScaling,
    /// How long to wait for every rank to arrive.
    pub rendezvous_timeout: std::time::Duration,
    /// A rank silent for this long (dead or stalled) stops every rank with an error naming it.
    pub failure_timeout: std::time::Duration,
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
    /// The output directory, held for the whole run (one writer; rank 0 only).
    pub run_dir: Option<RunDir>,
    /// The batch arithmetic (world size, per-rank and global batches, steps per epoch).
    pub layout: BatchLayout,
    /// The distributed environment, in accelerate's words (data-parallel runs only).
    pub environment: Option<String>,
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
            "save_strategy",
            "save_total_limit",
            "logging_steps",
            "output_dir",
            "model_name_or_path",
            "dataset_name",
            // Sharding changes where the optimizer state lives, not the weights.
            "zero_stage",
            "report_to",
            "log_completions",
            "num_completions_to_print",
            // Evaluation settings change what is measured, not what is trained (the prompts
            // held out, `eval_holdout`, stay).
            "eval_strategy",
            "eval_steps",
            "eval_dataset",
            "per_device_eval_batch_size",
            "num_generations_eval",
            "eval_do_sample",
            "eval_pass_threshold",
            "metric_for_best_model",
            "greater_is_better",
            "load_best_model_at_end",
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
    if let (Some(path), false) = (&opts.topology, opts.plan_only) {
        return Err(TrainError::Setup(format!(
            "--topology {} describes GPUs to plan for, not the ones to train on: add --plan, or \
             leave --topology out to train on this machine's GPUs",
            path.display()
        )));
    }
    let hub = HubOptions::from_env();
    // A PEFT adapter directory is not a model: its base is.
    let adapter_config = Path::new(&opts.model).join(fleet_models::lora::CONFIG_FILE);
    if adapter_config.is_file() {
        let base = fleet_models::lora::LoraConfig::from_dir(
            adapter_config.parent().unwrap_or(Path::new(".")),
        )
        .ok()
        .and_then(|c| c.base_model_name_or_path)
        .unwrap_or_else(|| "its base model".into());
        return Err(TrainError::Setup(format!(
            "--model {} holds LoRA adapters (adapter_config.json), not a model: train from its \
             base ({base}) with --set use_peft=true, or from the merged model \
             (<output_dir>/merged of the run that trained them)",
            opts.model
        )));
    }
    let source = ModelSource::parse(&opts.model, opts.revision.as_deref())?;
    // A plan needs no weights: their headers when they are here, else config.json.
    let files = if opts.plan_only {
        source.resolve_for_plan(&hub)?
    } else {
        source.resolve(&hub)?
    };
    let qwen = QwenConfig::from_file(&files.config).map_err(ModelError::from)?;

    // The data and the rewards first: a bad dataset is found before anything is loaded.
    // Rows without `answer` are skipped only when a function reads it.
    let require_answer = config.reward_funcs.iter().any(RewardSpec::reads_answer);
    let mut data = load_prompts_with(&opts.dataset, require_answer)?;
    let eval_samples = eval_samples(config, &mut data, require_answer)?;
    let mut dataset_report = data.report.to_string();
    if !eval_samples.is_empty() {
        dataset_report.push_str(&format!(
            "\nevaluation: {} prompts ({})",
            eval_samples.len(),
            match &config.eval_dataset {
                Some(p) => p.display().to_string(),
                None => format!(
                    "eval_holdout = {} of the training file, not trained on",
                    config.eval_holdout
                ),
            }
        ));
    }
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
    let eval_prompts = eval_samples
        .iter()
        .map(|s| renderer.render(s))
        .collect::<Result<Vec<_>, _>>()?;
    let room = qwen.max_position_embeddings;
    let too_long: Vec<&str> = data
        .samples
        .iter()
        .chain(&eval_samples)
        .zip(prompts.iter().chain(&eval_prompts))
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
    let world_size = opts.dist.as_ref().map_or(1, |d| d.world.world_size);
    if config.zero_stage == 1 && world_size == 1 {
        return Err(TrainError::Setup(
            "zero_stage = 1 shards the optimizer state over data-parallel processes, and this \
             run has one: start several (--nproc-per-node N, torchrun or SLURM) or drop \
             zero_stage"
                .into(),
        ));
    }
    let scaling = opts
        .dist
        .as_ref()
        .map_or(BatchScaling::FixedGlobal, |d| d.scaling);
    // Placement, before loading: what fits where (with auto_find_batch_size, the micro-batch
    // that fits). The manifest keeps the configured batch: a resume on another machine may fit
    // another micro-batch of the same algorithm.
    let requested = config;
    let (fitted, plan, layout) = fit_micro_batch(
        config,
        opts,
        &files,
        longest_prompt,
        (world_size, scaling, data.len()),
    )?;
    let config = &fitted;
    if opts.plan_only {
        // Loads nothing: a reward model is only sized.
        return Ok(Prepared {
            trainer: None,
            plan,
            state: RunDirState::New,
            dataset_report,
            resumed_from: None,
            run_dir: None,
            layout,
            environment: None,
        });
    }
    // The reward functions, a reward model on the device the plan gave it; rows they cannot
    // score at all are reported before anything else is loaded.
    let rewards = WeightedSum::from_specs_on(
        &config.reward_funcs,
        counter,
        plan.reward.as_ref().map(|m| (m, opts.dtype)),
    )?;
    for (what, samples) in [("training", &data.samples), ("evaluation", &eval_samples)] {
        let problems = rewards.check_samples(samples);
        if let Some(p) = problems.first() {
            return Err(TrainError::Setup(format!(
                "{} of {} {what} samples cannot be scored by the reward functions (first: {}: \
                 {}); fix the dataset or choose other reward_funcs",
                problems.len(),
                samples.len(),
                p.id,
                p.error
            )));
        }
    }

    // The output directory: one writer, and the same run or none.
    let base = files.identity()?;
    let dataset_bytes = std::fs::read(&opts.dataset)
        .map_err(|e| TrainError::Setup(format!("reading {}: {e}", opts.dataset.display())))?;
    let manifest = run_manifest(
        requested,
        &base,
        &fleet_data::digest::bytes_digest(&dataset_bytes),
        opts.dtype,
    )
    .note("model", &opts.model)
    .note("dataset", opts.dataset.display().to_string());
    let out = &config.output_dir;

    // The ranks meet: same manifest and commit everywhere, or a refusal naming the rank.
    let policy_device = plan
        .policy
        .devices()
        .first()
        .cloned()
        .unwrap_or(fleet_topology::DeviceLocation::Cpu);
    let dp = match &opts.dist {
        Some(d) => Some(meet(
            d,
            &manifest,
            config.per_device_train_batch_size,
            &policy_device,
        )?),
        None => None,
    };
    let is_main = dp.as_ref().is_none_or(|dp| dp.world().is_main());
    if is_main && opts.resumes() && !out.is_dir() {
        return Err(TrainError::Setup(format!(
            "--resume: the output directory {} does not exist: check --output-dir (a resume \
             continues a run in the directory it wrote)",
            out.display()
        )));
    }
    let (run_dir, state, has_checkpoints) = if is_main {
        let (run_dir, has_checkpoints) = open_run_dir(out, &manifest, opts)?;
        (Some(run_dir.0), run_dir.1, has_checkpoints)
    } else {
        (None, RunDirState::New, false)
    };
    // Rank 0 says whether (and from where) the ranks resume.
    let resume_from: Option<PathBuf> = {
        let mine = if is_main && opts.resumes() {
            if !has_checkpoints {
                return Err(TrainError::Setup(format!(
                    "--resume: {} holds no checkpoint to resume from. Check the path; a run \
                     killed before its first checkpoint has none: start it again without \
                     --resume{}",
                    out.display(),
                    if out.join(MetricsLog::FILE).exists() {
                        " and with --overwrite (its metrics are removed)"
                    } else {
                        ""
                    }
                )));
            }
            Some(checkpoint::resume_point(
                out,
                opts.resume_from_checkpoint.as_deref(),
            )?)
        } else {
            None
        };
        match &dp {
            Some(dp) => {
                let bytes = dp.collective.broadcast_bytes(is_main.then(|| {
                    mine.as_ref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                        .into_bytes()
                }))?;
                let path = String::from_utf8_lossy(&bytes).into_owned();
                (!path.is_empty()).then(|| PathBuf::from(path))
            }
            None => mine,
        }
    };
    // The policy: from the newest checkpoint when resuming, else from the base model.
    let (weights_files, state_now, resumed_from) = match resume_from {
        Some(ckpt) => {
            let mut st = checkpoint::load_state(&ckpt, &base)?;
            let filtered = config.top_k > 0 || config.top_p < 1.0;
            checkpoint::check_sampler(&ckpt, &mut st, filtered)?;
            // With LoRA the base comes from the model and the adapters from the checkpoint.
            let weights = if config.use_peft {
                files.weights.clone()
            } else {
                vec![ckpt.join("model.safetensors")]
            };
            (weights, st, Some(ckpt))
        }
        None => {
            let st = TrainerState {
                step: 0,
                generation_batch: 0,
                cursor: Default::default(),
                num_tokens: 0,
                base_model: base.clone(),
                base_model_id: opts.model.clone(),
                commit: fleet_runs::commit_id(),
                fleet_version: fleet_runs::fleet_version(),
                sampler_version: fleet_models::ops::SAMPLER_VERSION,
                best_metric: None,
                best_model_checkpoint: None,
                best_global_step: None,
            };
            (files.weights.clone(), st, None)
        }
    };
    let rest = Loaded {
        qwen: &qwen,
        weights_files,
        state: state_now,
        resumed_from,
    };
    let eval = (config.eval_every().is_some() && !eval_samples.is_empty()).then_some(
        crate::trainer::EvalPrompts {
            samples: eval_samples,
            prompts: eval_prompts,
        },
    );
    finish(
        config,
        opts,
        files,
        source,
        (data, eval),
        prompts,
        rewards,
        plan,
        rest,
        dp,
        layout,
        run_dir,
        state,
        dataset_report,
    )
}

/// The evaluation prompts: `eval_dataset`'s, or `eval_holdout` of the training file's (a
/// seeded choice, taken out of `data`: never trained on); none without either. The held-out
/// prompts are chosen whether or not `eval_strategy` evaluates, so that the training set is the
/// same either way.
fn eval_samples(
    config: &GspoConfig,
    data: &mut crate::dataset::PromptDataset,
    require_answer: bool,
) -> Result<Vec<crate::dataset::Sample>, TrainError> {
    if let Some(path) = &config.eval_dataset {
        if config.eval_every().is_none() {
            return Ok(Vec::new());
        }
        return Ok(load_prompts_with(path, require_answer)?.samples);
    }
    if config.eval_holdout <= 0.0 {
        return Ok(Vec::new());
    }
    let n = data.samples.len();
    if n < 2 {
        return Err(TrainError::Setup(format!(
            "eval_holdout = {} needs at least 2 prompts in the training file ({n} loaded)",
            config.eval_holdout
        )));
    }
    // At least one prompt each side.
    let held = ((n as f64 * config.eval_holdout).ceil() as usize).clamp(1, n - 1);
    // A permutation of its own (an epoch no training order uses), its first `held` rows.
    let mut chosen = crate::dataset::epoch_order(n, config.seed, u64::MAX)[..held].to_vec();
    chosen.sort_unstable();
    let mut out = Vec::with_capacity(held);
    for &i in chosen.iter().rev() {
        out.push(data.samples.remove(i));
    }
    out.reverse();
    Ok(out)
}

/// What [`prepare`] hands on to [`finish`].
struct Loaded<'a> {
    qwen: &'a QwenConfig,
    weights_files: Vec<PathBuf>,
    state: TrainerState,
    resumed_from: Option<PathBuf>,
}

/// Takes the output directory (one writer, the same run or none). Returns it, how it was
/// found, and whether it holds checkpoints.
fn open_run_dir(
    out: &Path,
    manifest: &Manifest,
    opts: &RunOptions,
) -> Result<((RunDir, RunDirState), bool), TrainError> {
    let mut options = RunDirOptions::new(
        &owned_files(out)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        opts.overwrite,
    );
    options.dir_flag = "--output-dir".into();
    let run_dir = RunDir::open(out, manifest, &options)?;
    let has_checkpoints = !checkpoint::list(out).is_empty();
    let has_metrics = std::fs::metadata(out.join(MetricsLog::FILE)).is_ok_and(|m| m.len() > 0);
    // A fresh start would append its steps to the old run's metrics.
    if run_dir.state == RunDirState::Resumed && !opts.resumes() && (has_checkpoints || has_metrics)
    {
        let way_on = if has_checkpoints {
            "pass --resume to continue from the newest checkpoint, or "
        } else {
            "it was stopped before its first checkpoint, so there is nothing to resume: "
        };
        return Err(TrainError::Setup(format!(
            "{} holds a run of these settings ({}): {way_on}pass --overwrite to start over, \
             or choose another --output-dir",
            out.display(),
            if has_checkpoints {
                "checkpoints and metrics"
            } else {
                "metrics"
            }
        )));
    }
    let state = run_dir.state.clone();
    Ok(((run_dir, state), has_checkpoints))
}

/// Meets the other ranks: the rendezvous checks that every rank runs this manifest and
/// commit; the collectives are NCCL's on a GPU, TCP's on the CPU.
fn meet(
    d: &DistOptions,
    manifest: &Manifest,
    micro_batch: usize,
    device: &fleet_topology::DeviceLocation,
) -> Result<DataParallel, TrainError> {
    // The micro-batch too: ranks that fitted different ones would disagree on the number of
    // collective calls.
    join(
        d,
        format!(
            "{}:{}:micro-batch {micro_batch}",
            manifest.digest(),
            fleet_runs::commit_id()
        ),
        format!(
            "micro-batch {micro_batch}, commit {}, run manifest {}",
            fleet_runs::commit_id(),
            manifest.digest()
        ),
        device,
    )
}

/// Meets the other ranks, which must all give the same `fingerprint` (`describe` says in
/// words what it stands for, for the error naming a rank that differs), and opens the
/// collectives: NCCL's when `device` is a GPU, TCP's on the CPU.
pub fn join(
    d: &DistOptions,
    fingerprint: String,
    describe: String,
    device: &fleet_topology::DeviceLocation,
) -> Result<DataParallel, TrainError> {
    let on_gpu = device.cuda_ordinal().is_some();
    let payload = if d.world.is_main() && on_gpu {
        Some(nccl_id()?)
    } else {
        None
    };
    let options = fleet_dist::RendezvousOptions {
        fingerprint,
        describe,
        timeout: d.rendezvous_timeout,
        failure_timeout: d.failure_timeout,
        ..fleet_dist::RendezvousOptions::default()
    };
    let group = fleet_dist::rendezvous(&d.world, &options, payload)?;
    let collective: Box<dyn Collective> = if on_gpu {
        gpu_collective(group, device)?
    } else {
        Box::new(TcpCollective::new(group))
    };
    Ok(DataParallel {
        collective,
        scaling: d.scaling,
    })
}

/// The GPUs this process may use: the visible ones, `gpu_ids` of them when given, and of those
/// a data-parallel rank's own slice ([`fleet_dist::rank_gpus`]).
fn rank_topology(
    gpu_ids: Option<&[usize]>,
    dist: Option<&DistOptions>,
) -> Result<Topology, TrainError> {
    let mut topology = Topology::from_devices(&fleet_topology::discover()?);
    if let Some(ids) = gpu_ids {
        topology = topology.select(ids)?;
    }
    if let Some(d) = dist {
        if let Some(mine) = fleet_dist::rank_gpus(&d.world, &topology.gpu_ids())? {
            topology = topology.select(&mine)?;
        }
    }
    Ok(topology)
}

/// `gspo-train --bench-all-reduce MAX`: the ranks meet (same MAX and commit on every rank),
/// open the collectives that training uses on their device (NCCL on a GPU, TCP on the CPU) and
/// time all-reduce in nccl-tests' terms for sizes from 4 KiB up to `max_bytes` (x4 steps), f32
/// then bf16. Returns the rows (the same on every rank) and the backend's name.
pub fn all_reduce_bench(
    d: &DistOptions,
    gpu_ids: Option<&[usize]>,
    max_bytes: usize,
) -> Result<(Vec<fleet_dist::AllReducePerf>, &'static str), TrainError> {
    let location = rank_topology(gpu_ids, Some(d))?
        .gpu_ids()
        .first()
        .map_or(fleet_topology::DeviceLocation::Cpu, |&g| {
            fleet_topology::DeviceLocation::Cuda(g)
        });
    let device = fleet_models::open_device(location)?;
    let dp = join(
        d,
        format!("all-reduce bench {max_bytes}:{}", fleet_runs::commit_id()),
        format!(
            "commit {}, --bench-all-reduce of {max_bytes} bytes",
            fleet_runs::commit_id()
        ),
        &location,
    )?;
    let mut sizes = Vec::new();
    let mut size = 4096usize.min(max_bytes);
    while size <= max_bytes {
        sizes.push(size);
        size *= 4;
    }
    let mut rows = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        rows.extend(fleet_dist::bench_all_reduce(
            dp.collective.as_ref(),
            &device,
            dtype,
            &sizes,
            5,
            20,
        )?);
    }
    let backend = dp.collective.backend();
    dp.finish()?;
    Ok((rows, backend))
}

#[cfg(feature = "nccl")]
fn nccl_id() -> Result<Vec<u8>, TrainError> {
    Ok(fleet_dist::nccl::new_id()?)
}

#[cfg(not(feature = "nccl"))]
fn nccl_id() -> Result<Vec<u8>, TrainError> {
    Err(TrainError::Setup(
        "data-parallel training on GPUs needs NCCL: this gspo-train was built without the \
         `nccl` feature (scripts/cuda/build.sh -p gspo-train builds it)"
            .into(),
    ))
}

#[cfg(feature = "nccl")]
fn gpu_collective(
    group: fleet_dist::Group,
    device: &fleet_topology::DeviceLocation,
) -> Result<Box<dyn Collective>, TrainError> {
    // The models' own device (one stream per GPU in a process): the collectives are ordered
    // after the work that wrote the gradients.
    let dev = fleet_models::open_device(*device)?;
    Ok(Box::new(fleet_dist::nccl::NcclCollective::new(
        group, &dev,
    )?))
}

#[cfg(not(feature = "nccl"))]
fn gpu_collective(
    _group: fleet_dist::Group,
    _device: &fleet_topology::DeviceLocation,
) -> Result<Box<dyn Collective>, TrainError> {
    nccl_id().map(|_| unreachable!("nccl_id fails without the nccl feature"))
}

/// Loads the models and the optimizer and assembles the trainer.
#[allow(clippy::too_many_arguments)]
fn finish(
    config: &GspoConfig,
    opts: &RunOptions,
    files: CheckpointFiles,
    source: ModelSource,
    (data, eval): (
        crate::dataset::PromptDataset,
        Option<crate::trainer::EvalPrompts>,
    ),
    prompts: Vec<crate::prompt::RenderedPrompt>,
    rewards: WeightedSum,
    plan: TrainingPlan,
    loaded: Loaded<'_>,
    dp: Option<DataParallel>,
    layout: BatchLayout,
    run_dir: Option<RunDir>,
    dir_state: RunDirState,
    dataset_report: String,
) -> Result<Prepared, TrainError> {
    let Loaded {
        qwen,
        weights_files,
        state,
        resumed_from,
    } = loaded;
    let out = &config.output_dir;
    let mut policy = TrainableQwen::with_master_dtype(
        qwen,
        &Weights::from_safetensors(&weights_files)?,
        opts.dtype,
        master_dtype(config),
        &plan.policy,
    )?;
    if config.use_peft {
        let adapters = match &resumed_from {
            Some(ckpt) => Some(Weights::from_safetensors(&[
                crate::checkpoint::weights_file(ckpt),
            ])?),
            None => None,
        };
        policy = policy.with_lora(config.lora_config(), adapters.as_ref(), config.seed)?;
    }
    policy.gradient_checkpointing = opts.gradient_checkpointing;
    // Every rank starts from rank 0's weights.
    let environment = match &dp {
        Some(dp) => {
            let vars: Vec<candle_core::Var> = policy.params().into_iter().map(|(_, v)| v).collect();
            dp.collective.broadcast_vars(&vars)?;
            let device = plan
                .policy
                .devices()
                .first()
                .map(|d| d.to_string())
                .unwrap_or_else(|| "cpu".into());
            Some(fleet_dist::describe_environment(
                dp.world(),
                dp.collective.backend(),
                &device,
            ))
        }
        None => None,
    };
    let reference = match &plan.reference {
        // With LoRA, the base with the adapters off: the same tensors, no second copy.
        Some(_) if config.beta > 0.0 && config.use_peft => policy.base_view(),
        // Frozen: held in the compute dtype (no master copy is needed).
        Some(map) if config.beta > 0.0 => Some(TrainableQwen::with_master_dtype(
            qwen,
            &Weights::from_safetensors(&files.weights)?,
            opts.dtype,
            opts.dtype,
            map,
        )?),
        _ => None,
    };

    let mut optimizer = AdamW::new(policy.params(), AdamWConfig::from(config))?;
    if let Some(ckpt) = &resumed_from {
        let device = policy.head_device();
        let saved = OptimizerState::load(&ckpt.join("optimizer.safetensors"), &device)?;
        optimizer.load_state(&saved)?;
    }
    if let (Some(dp), 1) = (&dp, config.zero_stage) {
        // ZeRO stage 1: this rank keeps its share of the moments (a resumed state is loaded
        // whole, then cut: a checkpoint resumes on any number of ranks).
        let sizes: Vec<usize> = optimizer
            .params()
            .iter()
            .map(|(_, v)| v.elem_count())
            .collect();
        let world = dp.world();
        let owners = crate::dist::zero_partition(&sizes, world.world_size);
        let owned: Vec<bool> = owners.iter().map(|&o| o == world.rank).collect();
        optimizer.shard(&owned)?;
        // ... and the f32 masters of that share only: the others' parameters are held in the
        // compute dtype, each refreshed from its owner after every step.
        let narrowed = policy.shard_masters(&owned)?;
        if narrowed > 0 {
            optimizer.rebind(policy.params())?;
        }
        tracing::info!(
            "zero_stage = 1: rank {} keeps the moments of {} of {} parameters{}",
            world.rank,
            owned.iter().filter(|&&o| o).count(),
            owned.len(),
            if narrowed > 0 {
                ", and their masters (the others' in the compute dtype)"
            } else {
                ""
            }
        );
    }
    let sampler = PromptSampler::resume(
        data.len(),
        config.seed,
        config.shuffle_dataset,
        state.cursor,
    )?;
    let total_steps = config.total_optimizer_steps(data.len(), layout.batch_scale(config))?;
    let schedule = LrSchedule::from_config(config, total_steps)?;

    // Metrics: a resumed run drops the lines of steps after its checkpoint (they are redone).
    let metrics = if run_dir.is_some() {
        let metrics_path = out.join("metrics.jsonl");
        if resumed_from.is_some() {
            crate::metrics::truncate_after(&metrics_path, state.step)?;
        }
        Some(MetricsLog::open(&metrics_path)?.0)
    } else {
        None
    };
    let completions = match (&metrics, config.log_completions) {
        (Some(_), true) => Some(crate::metrics::open_completions(out, state.step)?),
        _ => None,
    };
    let tensorboard = match (&metrics, config.report_to) {
        (Some(_), crate::config::ReportTo::Tensorboard) => {
            let dir = out.join("runs");
            let tb_err = |e: std::io::Error| {
                TrainError::Setup(format!("TensorBoard event files in {}: {e}", dir.display()))
            };
            // Events of steps after the checkpoint are redone: the old files lose them.
            crate::tensorboard::truncate_after(&dir, state.step).map_err(tb_err)?;
            Some(crate::tensorboard::EventWriter::create(&dir).map_err(tb_err)?)
        }
        _ => None,
    };

    let text = crate::trainer::RolloutText::from_text_model(TextModel::with_model(
        source,
        files.clone(),
        policy.inference_model()?,
    )?);
    let trainer = Trainer {
        config: config.clone(),
        policy,
        text,
        base: files,
        reference,
        rewards,
        data,
        prompts,
        eval,
        sampler,
        optimizer,
        schedule,
        total_steps,
        state,
        metrics,
        tensorboard,
        completions,
        // Every device of the placement: a reference and reward model on a device of their own
        // (the seed's 3gpu) have their peak recorded too.
        memory: fleet_topology::MemoryWatch::start(
            &[
                Some(&plan.policy),
                plan.reference.as_ref(),
                plan.reward.as_ref(),
            ]
            .into_iter()
            .flatten()
            .flat_map(|m| m.devices())
            .collect::<Vec<_>>(),
        ),
        dp,
        layout: layout.clone(),
    };
    Ok(Prepared {
        state: dir_state,
        trainer: Some(trainer),
        plan,
        dataset_report,
        resumed_from,
        run_dir,
        layout,
        environment,
    })
}

/// The plan, the config it is for and its batch layout: `config` itself, or with
/// `auto_find_batch_size` the largest micro-batch, among the configured one's divisors, that
/// the ranks can share and whose plan fits, with steps_per_generation and
/// gradient_accumulation_steps grown to match ([`GspoConfig::with_smaller_micro_batch`]; the
/// layout's `micro_split` keeps the loss normalised over the configured micro-batch). Each
/// rank is planned for the rows it trains on.
fn fit_micro_batch(
    config: &GspoConfig,
    opts: &RunOptions,
    files: &CheckpointFiles,
    longest_prompt: usize,
    (world_size, scaling, num_prompts): (usize, BatchScaling, usize),
) -> Result<(GspoConfig, TrainingPlan, BatchLayout), TrainError> {
    let b = config.per_device_train_batch_size;
    let factors: Vec<usize> = if config.auto_find_batch_size {
        (1..=b).filter(|f| b.is_multiple_of(*f)).collect()
    } else {
        vec![1]
    };
    let mut last_error = None;
    for factor in factors {
        let candidate = config.with_smaller_micro_batch(factor);
        let mut layout = match BatchLayout::new(&candidate, world_size, scaling, num_prompts) {
            Ok(layout) => layout,
            // A micro-batch the ranks cannot share: the next smaller one.
            Err(e) if factor > 1 => {
                last_error = Some(e);
                continue;
            }
            Err(e) => return Err(e),
        };
        match plan(
            &candidate,
            opts,
            files,
            longest_prompt,
            layout.per_rank_micro_batch,
        ) {
            Ok(p) => {
                if factor > 1 {
                    tracing::warn!(
                        "auto_find_batch_size: per_device_train_batch_size {} -> {} (fits), \
                         steps_per_generation {} -> {}, gradient_accumulation_steps {} -> {}: \
                         the same rollouts and optimizer steps in smaller micro-batches",
                        b,
                        candidate.per_device_train_batch_size,
                        config.steps_per_generation,
                        candidate.steps_per_generation,
                        config.gradient_accumulation_steps,
                        candidate.gradient_accumulation_steps
                    );
                }
                layout.micro_split = factor;
                return Ok((candidate, p, layout));
            }
            Err(e @ TrainError::Topology(fleet_topology::TopologyError::DoesNotFit { .. }))
                if config.auto_find_batch_size =>
            {
                last_error = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    let e = last_error.map_or_else(String::new, |e| e.to_string());
    Err(TrainError::Setup(format!(
        "{e}\nauto_find_batch_size: no divisor of per_device_train_batch_size = {b} that the \
         {world_size} process(es) can share fits: the rollouts or the model itself need more \
         memory than the budget"
    )))
}

/// Where the models go on this machine (or on the CPU when it has no GPU), or on the GPUs of
/// `opts.topology`.
fn plan(
    config: &GspoConfig,
    opts: &RunOptions,
    files: &CheckpointFiles,
    longest_prompt: usize,
    micro_rows: usize,
) -> Result<TrainingPlan, TrainError> {
    let topology = match &opts.topology {
        Some(path) => {
            let topology = Topology::from_file(path)?;
            match &opts.gpu_ids {
                Some(ids) => topology.select(ids)?,
                None => topology,
            }
        }
        None => rank_topology(opts.gpu_ids.as_deref(), opts.dist.as_ref())?,
    };
    let mut shape = ModelShape::from_config_file(&files.config)?;
    if let Some(dir) = files.weights.first().and_then(|w| w.parent()) {
        shape = shape.with_checkpoint(fleet_topology::CheckpointParams::from_dir(dir)?)?;
    }
    let workload = TrainingWorkload {
        compute_dtype: plan_dtype(opts.dtype),
        per_device_train_batch_size: micro_rows,
        max_prompt_length: longest_prompt,
        max_completion_length: config.max_completion_length,
        num_generations: config.num_generations,
        prompts_per_step: config.prompts_per_generation(),
        gradient_checkpointing: opts.gradient_checkpointing,
        master_dtype: plan_dtype(master_dtype(config)),
        head_chunk_rows: fleet_models::qwen::train::default_head_chunk_rows(shape.vocab_size),
        optimizer_shards: match config.zero_stage {
            1 => opts.dist.as_ref().map_or(1, |d| d.world.world_size),
            _ => 1,
        },
        trainable_fraction: if config.use_peft {
            lora_elements(config, &shape) as f64 / shape.total_params().max(1) as f64
        } else {
            1.0
        },
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
            let source = ModelSource::parse(model, revision.as_deref())?;
            let hub = HubOptions::from_env();
            let files = if opts.plan_only {
                source.resolve_for_plan(&hub)?
            } else {
                source.resolve(&hub)?
            };
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

/// The elements LoRA trains (`use_peft`): `r · (in + out)` per adapted linear layer, from the
/// planner's model shape.
fn lora_elements(config: &GspoConfig, shape: &ModelShape) -> u64 {
    let h = shape.hidden_size as u64;
    let q = (shape.num_heads * shape.head_dim) as u64;
    let kv = (shape.num_kv_heads * shape.head_dim) as u64;
    let i = shape.intermediate_size as u64;
    let per_layer: u64 = config
        .lora_config()
        .modules()
        .iter()
        .map(|m| match m.as_str() {
            "q_proj" => h + q,
            "k_proj" | "v_proj" => h + kv,
            "o_proj" => q + h,
            "gate_proj" | "up_proj" | "down_proj" => h + i,
            _ => 0,
        })
        .sum();
    config.lora_r as u64 * per_layer * shape.num_layers as u64
}

/// The dtype of the policy's master weights: f32, or with `torch_dtype = "bfloat16"` bf16
/// (the compute dtype too on GPUs; on the CPU the passes still compute in f32).
pub fn master_dtype(config: &GspoConfig) -> DType {
    match config.torch_dtype {
        crate::config::TorchDtype::Float32 => DType::F32,
        crate::config::TorchDtype::Bfloat16 => DType::BF16,
    }
}

/// fleet-topology's name for a compute dtype.
fn plan_dtype(dtype: DType) -> fleet_topology::DType {
    match dtype {
        DType::F32 => fleet_topology::DType::F32,
        DType::F16 => fleet_topology::DType::F16,
        _ => fleet_topology::DType::Bf16,
    }
}
