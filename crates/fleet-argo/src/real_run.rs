//! A real run, assembled: the experiment config, a dataset sample, the retrieval index and an
//! LLM on its placement in; records, `summary.json` and (over several c_r points) the real
//! graphs out. `argo-exp run` and `argo-exp compare` are this with their flags.
//!
//! Order of work, so that mistakes cost nothing: the config and prompts are checked, the
//! dataset loaded and sampled, the index and its embedder opened, the checkpoint found and its
//! identity computed, and the output directory taken (its lock, its manifest: a resume with
//! other settings is refused); only then is the LLM loaded on its placement. Records are
//! appended as jobs finish; the summary and graphs are written by [`RealRun::write`].
//!
//! ```ignore
//! let run = real_run::run(&RealRunConfig { model, dataset, index, out, .. })?;
//! print!("{}", run.table());
//! let written = run.write()?; // summary.json, the graphs with several c_r points
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use fleet_models::embedder::{EmbedderOptions, SentenceEmbedder};
use fleet_models::{CheckpointIdentity, LoadOptions, ModelSource};
use fleet_runs::{RunDir, RunDirOptions, RunDirState, StepContext, StepError};
use fleet_serve::{PlacementRequest, Replicas, Text};
use indicatif::{ProgressBar, ProgressStyle};

use crate::dataset::{Dataset, DatasetSource, Difficulty, Question};
use crate::experiment::{
    build_jobs, real_run_manifest, render_real_table, BatchingSummary, RealRunInputs,
    RealRunSummary, RetrievalConfig,
};
use crate::index::VectorIndex;
use crate::llm::{cache_manifest, FleetLlm, Llm};
use crate::prompts::Prompts;
use crate::runner::{run_jobs, summarize, RecordsFile, Retriever, RunEvent};
use crate::summary::{commit_id, write_json_atomic};
use crate::{ExperimentConfig, Mode, StrategyKind};

/// The embedder a new index gets when none is given.
pub const DEFAULT_EMBEDDER: &str = "sentence-transformers/all-MiniLM-L6-v2";

/// The files a real run owns in its output directory (removed by `overwrite`). The LLM cache
/// is not among them: it carries its own manifest and is kept when the model is the same.
pub const REAL_RUN_FILES: &[&str] = &[
    "records.jsonl",
    "summary.json",
    "real_graph1a_accuracy_vs_c_r.png",
    "real_graph1a_accuracy_vs_c_r.svg",
    "real_graph1b_retrievals_vs_c_r.png",
    "real_graph1b_retrievals_vs_c_r.svg",
    "real_graph1c_accuracy_vs_cost.png",
    "real_graph1c_accuracy_vs_cost.svg",
];

/// The LLM cache's file in the output directory.
pub const LLM_CACHE_FILE: &str = "llm_cache.jsonl";

/// Errors of a real run: each keeps its cause chain, and a step's context names what was
/// being done with which input (`fleet_runs::StepError`).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct RealRunError(#[from] pub StepError);

fleet_runs::step_error_from!(
    RealRunError;
    fleet_models::ModelError,
    fleet_topology::TopologyError,
    fleet_runs::RunsError,
    fleet_plot::PlotError,
    serde_json::Error,
    crate::SweepError,
    crate::ParamError,
    crate::prompts::PromptError,
    crate::dataset::DatasetError,
    crate::index::IndexError,
    crate::llm::LlmError,
    crate::experiment::ExperimentError,
    crate::runner::RunError,
    crate::summary::OutputError,
);

fn invalid(message: String) -> RealRunError {
    StepError::Invalid(message).into()
}

/// The sentence embedder and where it runs.
#[derive(Clone, Debug)]
pub struct EmbedderChoice {
    /// A sentence-transformers checkpoint (local dir or hub id); `None`: the one the index
    /// records, else [`DEFAULT_EMBEDDER`].
    pub model: Option<String>,
    /// Device of the embedder and the similarity search: cpu or cuda:N.
    pub device: String,
}

impl EmbedderChoice {
    /// Loads the embedder chosen, else the one `index` records, else [`DEFAULT_EMBEDDER`].
    pub fn load(
        &self,
        index: Option<&VectorIndex>,
    ) -> Result<(SentenceEmbedder, Device), RealRunError> {
        let location: fleet_models::DeviceLocation = self.device.parse()?;
        let device = fleet_models::open_device(location)?;
        let opts = EmbedderOptions {
            device: device.clone(),
            ..EmbedderOptions::default()
        };
        let (spec, from) = match (&self.model, index) {
            (Some(e), _) => (e.clone(), "--embedder"),
            (None, Some(i)) => (i.meta().embedder.model.clone(), "the index's record"),
            (None, None) => (DEFAULT_EMBEDDER.to_string(), "the default"),
        };
        let embedder = SentenceEmbedder::load(&spec, &opts)
            .context(|| format!("loading the embedder {spec} (from {from})"))?;
        Ok((embedder, device))
    }
}

/// Everything a real run needs: what the flags of `argo-exp run` / `compare` say.
#[derive(Clone, Debug)]
pub struct RealRunConfig {
    /// The LLM: a local checkpoint dir or a hub id.
    pub model: String,
    /// Hub revision of the LLM.
    pub revision: Option<String>,
    /// bf16, f16 or f32; `None`: bf16 when there are GPUs, f32 on the CPU (said on stderr).
    pub dtype: Option<String>,
    /// The placement mode (auto, single, data-parallel, layer-sharded, `hybrid[:N]`).
    pub gpu_mode: String,
    /// Only these GPUs.
    pub gpu_ids: Option<Vec<usize>>,
    /// Per-device budgets in accelerate's style.
    pub max_memory: Option<String>,
    /// Prompts per replica batch.
    pub max_batch: usize,
    /// GiB the attention scores of one prefill batch may take.
    pub attention_budget_gib: f64,
    /// Questions (jobs) advancing together.
    pub max_in_flight: usize,
    /// Continuous batching (else lock-step rounds).
    pub continuous_batching: bool,
    /// Its paged KV cache per replica, in GiB; `None`: on GPUs what the placement leaves
    /// beside the model (`Plan::kv_pool_room`), 2 on the CPU.
    pub kv_cache_gib: Option<f64>,
    /// Its decode steps queued before a read of their tokens (vLLM's `num_scheduler_steps`).
    pub num_scheduler_steps: usize,
    /// The retrieval index.
    pub index: PathBuf,
    /// The embedder.
    pub embedder: EmbedderChoice,
    /// Chunks per retrieval, the similarity threshold and the progress rule.
    pub retrieval: RetrievalConfig,
    /// ORAN-Bench-13K directory, or a generic multiple-choice .jsonl file.
    pub dataset: PathBuf,
    /// ORAN-Bench's difficulty (default hard); an error with a .jsonl dataset.
    pub difficulty: Option<String>,
    /// Questions to sample (default: the mode's size); more than the dataset has is an error.
    pub n_questions: Option<usize>,
    /// The mode's sizes.
    pub mode: Option<Mode>,
    /// Sampling and strategy seed.
    pub seed: Option<u64>,
    /// Most Retrieve/Reason steps per question.
    pub step_cap: Option<u32>,
    /// Experiment TOML (default: the built-in config).
    pub config: Option<PathBuf>,
    /// Prompt TOML (default: the built-in prompts).
    pub prompts: Option<PathBuf>,
    /// The strategies; `None`: the config's list.
    pub strategies: Option<Vec<StrategyKind>>,
    /// The sweep's c_r points instead of the config's single c_r.
    pub sweep: bool,
    /// The results directory.
    pub out: PathBuf,
    /// Start over when the output directory's manifest differs.
    pub overwrite: bool,
}

/// A finished real run: its summary (not yet written: [`RealRun::write`]).
pub struct RealRun {
    /// The summary, as `summary.json` will have it.
    pub summary: RealRunSummary,
    /// The c_r points run.
    pub c_r_points: usize,
    difficulty: Option<Difficulty>,
    out: PathBuf,
    run_dir: RunDir,
}

/// The files [`RealRun::write`] wrote.
#[derive(Debug)]
pub struct Written {
    /// `summary.json`.
    pub summary: PathBuf,
    /// The real graphs (several c_r points only).
    pub plots: Vec<PathBuf>,
}

/// Runs the real experiment as `config` says (see the module docs).
pub fn run(config: &RealRunConfig) -> Result<RealRun, RealRunError> {
    let (cfg, c_r_values) = experiment_config(config)?;
    let prompts = match &config.prompts {
        Some(p) => Prompts::from_file(p)?,
        None => Prompts::default_prompts()?,
    };
    let data = load_questions(config, &cfg)?;
    let index = VectorIndex::open(&config.index)?;
    let (embedder, device) = config.embedder.load(Some(&index))?;
    index.check_embedder(embedder.id())?;
    let r = &config.retrieval;
    let retriever = Retriever::new(&embedder, &index, device, r.top_k, r.threshold, r.progress);
    // The output directory: taken (one writer) and checked against what made its records
    // before the model is loaded, so a refused resume costs no loading time.
    let checkpoint = Checkpoint::find(config)?;
    let manifest = real_run_manifest(&RealRunInputs {
        model: &checkpoint.identity,
        dtype: checkpoint.dtype,
        embedder: embedder.id(),
        index_digest: &index.content_digest()?,
        dataset: &data.dataset,
        difficulty: data.difficulty,
        config: &cfg,
        retrieval: &config.retrieval,
        prompts: &prompts,
    })
    .note("model", &checkpoint.model_id)
    .note("index", config.index.display().to_string())
    .note("dataset", config.dataset.display().to_string());
    let run_dir = open_run_dir(config, &manifest)?;
    let (llm, placement, kv_cache_bytes) = load_llm(config, &checkpoint, &run_dir)?;
    let jobs = build_jobs(&data.questions, &cfg, &cfg.strategies.list, &c_r_values)?;
    let keys: Vec<String> = jobs.iter().map(|j| j.key()).collect();
    let mut records = RecordsFile::open(&run_dir.join("records.jsonl"))?;
    if let Some(problems) = &records.problems {
        eprintln!("{problems}");
    }
    let started = Instant::now();
    let progress = with_progress_bar(jobs.len(), |on_event| {
        run_jobs(
            jobs,
            &llm,
            &retriever,
            &prompts,
            &mut records,
            config.max_in_flight,
            on_event,
        )
    })?;
    let wall_s = started.elapsed().as_secs_f64();
    let done: Vec<_> = keys.iter().filter_map(|k| records.get(k)).collect();
    let summary = RealRunSummary {
        world: "real",
        model: format!("{} ({})", checkpoint.model_id, checkpoint.dtype),
        embedder: serde_json::to_value(embedder.id())?,
        index: config.index.display().to_string(),
        dataset: serde_json::json!({
            "source": config.dataset.display().to_string(),
            "difficulty": data.difficulty,
            "n_questions": data.questions.len(),
            "seed": cfg.sweep.seed,
            "loaded": data.dataset.questions.len(),
        }),
        n_questions: data.questions.len(),
        results: summarize(&done),
        llm: llm.stats(),
        wall_s,
        resumed_jobs: progress.resumed,
        progress,
        config: cfg,
        retrieval: config.retrieval,
        placement,
        batching: BatchingSummary {
            mode: if config.continuous_batching {
                "continuous"
            } else {
                "static"
            },
            max_batch: config.max_batch,
            max_in_flight: config.max_in_flight,
            kv_cache_bytes,
            num_scheduler_steps: config
                .continuous_batching
                .then_some(config.num_scheduler_steps),
        },
        commit: commit_id(),
    };
    Ok(RealRun {
        summary,
        c_r_points: c_r_values.len(),
        difficulty: data.difficulty,
        out: config.out.clone(),
        run_dir,
    })
}

impl RealRun {
    /// The results table.
    pub fn table(&self) -> String {
        render_real_table(&self.summary.results)
    }

    /// Writes `summary.json` and, over several c_r points, the real graphs.
    pub fn write(&self) -> Result<Written, RealRunError> {
        let summary = &self.summary;
        let path = self.run_dir.join("summary.json");
        write_json_atomic(&path, summary)?;
        let mut plots = Vec::new();
        if self.c_r_points > 1 {
            let subtitle = format!(
                "{} | {} {} questions, seed {}",
                summary.model,
                summary.n_questions,
                self.difficulty
                    .map_or_else(|| "jsonl".to_string(), |d| d.to_string()),
                summary.config.sweep.seed
            );
            plots = crate::plot::plot_real_sweep(&self.out, &summary.results, &subtitle)?;
        }
        Ok(Written {
            summary: path,
            plots,
        })
    }
}

/// The experiment config (the file or the default, the overrides applied, validated) and its
/// c_r points.
fn experiment_config(config: &RealRunConfig) -> Result<(ExperimentConfig, Vec<f64>), RealRunError> {
    let mut cfg = match &config.config {
        Some(p) => ExperimentConfig::from_file(p)?,
        None => ExperimentConfig::default(),
    };
    if let Some(mode) = config.mode {
        cfg.apply_mode(mode);
    }
    if let Some(seed) = config.seed {
        cfg.sweep.seed = seed;
    }
    if let Some(cap) = config.step_cap {
        cfg.episode.step_cap = cap;
    }
    if let Some(list) = &config.strategies {
        cfg.strategies.list = list.clone();
    }
    if let Some(n) = config.n_questions {
        cfg.sweep.n_questions = n as u64;
    }
    cfg.validate()?;
    let c_r_values = if config.sweep {
        cfg.sweep.c_r_values()
    } else {
        vec![cfg.mdp.c_r]
    };
    Ok((cfg, c_r_values))
}

/// The dataset, its difficulty and the sampled questions.
struct Questions {
    dataset: Dataset,
    difficulty: Option<Difficulty>,
    questions: Vec<Arc<Question>>,
}

/// Loads the dataset (reported on stderr) and samples the config's number of questions.
fn load_questions(
    config: &RealRunConfig,
    cfg: &ExperimentConfig,
) -> Result<Questions, RealRunError> {
    let (source, difficulty) = dataset_source(config)?;
    let dataset = source.load()?;
    eprintln!("{}", dataset.report);
    let available = dataset.questions.len();
    let n_questions = cfg.sweep.n_questions as usize;
    if config.n_questions.is_some() && n_questions > available {
        return Err(invalid(format!(
            "--n-questions {n_questions}: {} has only {available} questions{}; ask for at most {available}",
            config.dataset.display(),
            difficulty.map(|d| format!(" at difficulty {d}")).unwrap_or_default()
        )));
    }
    let sample = dataset.sample(Some(n_questions), cfg.sweep.seed)?;
    eprintln!("{sample}");
    let questions = sample.questions.iter().cloned().map(Arc::new).collect();
    Ok(Questions {
        dataset,
        difficulty,
        questions,
    })
}

/// A .jsonl file (no difficulty levels) or an ORAN-Bench directory (default hard).
fn dataset_source(
    config: &RealRunConfig,
) -> Result<(DatasetSource, Option<Difficulty>), RealRunError> {
    if config.dataset.extension().is_some_and(|e| e == "jsonl") {
        if let Some(d) = &config.difficulty {
            return Err(invalid(format!(
                "--difficulty {d}: {} is a .jsonl dataset, which has no difficulty levels \
                 (they are ORAN-Bench-13K's files); leave out --difficulty, or give the \
                 ORAN-Bench directory",
                config.dataset.display()
            )));
        }
        let path = config.dataset.clone();
        return Ok((DatasetSource::Jsonl { path }, None));
    }
    let difficulty: Difficulty = config.difficulty.as_deref().unwrap_or("hard").parse()?;
    let dir = config.dataset.clone();
    Ok((
        DatasetSource::OranBench { dir, difficulty },
        Some(difficulty),
    ))
}

/// The LLM's checkpoint, found before anything is written: its load options, its identity
/// (the manifest's) and the names the outputs give it.
struct Checkpoint {
    opts: LoadOptions,
    identity: CheckpointIdentity,
    dtype: &'static str,
    model_id: String,
}

impl Checkpoint {
    fn find(config: &RealRunConfig) -> Result<Self, RealRunError> {
        let gpus = fleet_topology::discover()?
            .iter()
            .any(|d| d.location.cuda_ordinal().is_some());
        let opts = LoadOptions {
            dtype: fleet_models::dtype_or_default(config.dtype.as_deref(), gpus)?,
            revision: config.revision.clone(),
            ..LoadOptions::default()
        };
        let identity = ModelSource::parse(&config.model, config.revision.as_deref())?
            .resolve(&opts.hub)
            .context(|| format!("finding the checkpoint {}", config.model))?
            .identity()?;
        let model_id = match &config.revision {
            Some(r) => format!("{}@{r}", config.model),
            None => config.model.clone(),
        };
        Ok(Checkpoint {
            dtype: opts.dtype.as_str(),
            opts,
            identity,
            model_id,
        })
    }
}

/// Takes the output directory (resume, refuse or overwrite; an overwrite said on stderr).
fn open_run_dir(
    config: &RealRunConfig,
    manifest: &fleet_runs::Manifest,
) -> Result<RunDir, RealRunError> {
    let run_dir = RunDir::open(
        &config.out,
        manifest,
        &RunDirOptions::new(REAL_RUN_FILES, config.overwrite).with_dir_flag("--output-dir"),
    )?;
    if let RunDirState::Overwritten { removed, diffs } = &run_dir.state {
        let diffs = if diffs.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = diffs.iter().map(|d| d.to_string()).collect();
            format!(" ({})", list.join("; "))
        };
        eprintln!(
            "--overwrite: removed {} file(s) of an earlier run in {}{diffs}",
            removed.len(),
            config.out.display(),
        );
    }
    Ok(run_dir)
}

/// The LLM on its placement, with the run's cache file; the placement in words, and the
/// paged KV cache's bytes (continuous batching).
fn load_llm(
    config: &RealRunConfig,
    checkpoint: &Checkpoint,
    run_dir: &RunDir,
) -> Result<(FleetLlm, String, Option<u64>), RealRunError> {
    let attention_budget = (config.attention_budget_gib * (1u64 << 30) as f64) as u64;
    if let Some(gib) = config.kv_cache_gib {
        if !(gib.is_finite() && gib > 0.0) {
            return Err(invalid(format!(
                "--kv-cache-gib {gib}: must be a positive number of GiB"
            )));
        }
    }
    // Continuous batching's KV is one pool and its prompt passes have their own token budget:
    // the plan is sized for those, not for max_batch full-length sequences prefilled at once.
    let request = |workload| {
        PlacementRequest::from_flags(
            &config.gpu_mode,
            config.gpu_ids.clone(),
            config.max_memory.as_deref(),
            workload,
        )
    };
    let kv_pool_bytes = match (config.continuous_batching, config.kv_cache_gib) {
        (false, _) => None,
        (true, Some(gib)) => Some((gib * (1u64 << 30) as f64) as u64),
        (true, None) => Some(auto_kv_pool(
            config,
            checkpoint,
            attention_budget,
            &request,
        )?),
    };
    let workload = match kv_pool_bytes {
        Some(bytes) => fleet_serve::paged_workload(bytes, attention_budget),
        None => fleet_serve::default_workload(config.max_batch, attention_budget),
    };
    let placement = request(workload)?;
    let replicas = Replicas::<Text>::load_planned(&config.model, &checkpoint.opts, &placement)?;
    let placement_text = format!("{} mode, {} replica(s)", placement.mode, replicas.len());
    let mut llm = FleetLlm::new(replicas, checkpoint.model_id.clone(), config.max_batch)
        .with_attention_budget(attention_budget);
    if let Some(bytes) = kv_pool_bytes {
        llm = llm
            .with_continuous_batching(bytes)
            .with_scheduler_steps(config.num_scheduler_steps);
    }
    let llm = llm.with_cache_file(
        &run_dir.join(LLM_CACHE_FILE),
        &cache_manifest(&checkpoint.identity, checkpoint.dtype),
        config.overwrite,
    )?;
    Ok((llm, placement_text, kv_pool_bytes))
}

/// The paged KV pool when `--kv-cache-gib` is not given: on GPUs, all that the placement's
/// budgets (`--max-memory`; by default each GPU's memory less 10%) leave beside the weights
/// and one prompt pass's workspace, as vLLM's `gpu_memory_utilization` sizes its cache; on the
/// CPU, 2 GiB.
fn auto_kv_pool(
    config: &RealRunConfig,
    checkpoint: &Checkpoint,
    attention_budget: u64,
    request: &dyn Fn(fleet_serve::Workload) -> fleet_models::Result<PlacementRequest>,
) -> Result<u64, RealRunError> {
    let without_pool = request(fleet_serve::paged_workload(0, attention_budget))?;
    let Some(plan) =
        fleet_serve::plan_on_this_machine(&config.model, &checkpoint.opts, &without_pool)?
    else {
        return Ok(2 << 30);
    };
    let room = plan.kv_pool_room().unwrap_or(0);
    if room < 1 << 30 {
        return Err(invalid(format!(
            "the placement leaves {} for the paged KV cache beside the model: give \
             --kv-cache-gib, a larger --max-memory, or more GPUs (--gpu-mode)",
            fleet_topology::format_bytes(room)
        )));
    }
    eprintln!(
        "paged KV cache: {} (what the placement leaves; --kv-cache-gib sets it)",
        fleet_topology::format_bytes(room)
    );
    Ok(room)
}

/// Runs `work` with a progress bar over `jobs` jobs driven by its events (cleared when the
/// work succeeds, left as it is when it fails).
fn with_progress_bar<T, E>(
    jobs: usize,
    work: impl FnOnce(&mut dyn FnMut(RunEvent<'_>)) -> Result<T, E>,
) -> Result<T, E> {
    let bar = ProgressBar::new(jobs as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} jobs  {elapsed} (ETA {eta})  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let result = work(&mut |event| match event {
        RunEvent::Resumed(n) => bar.inc(n as u64),
        RunEvent::Finished(_) => bar.inc(1),
        RunEvent::Round {
            round,
            in_flight,
            waiting,
        } => {
            bar.set_message(format!(
                "round {round}: {in_flight} in flight, {waiting} waiting"
            ));
            bar.tick();
        }
    })?;
    bar.finish_and_clear();
    Ok(result)
}
