//! The real-model commands: `ingest` and `query` (the retrieval index), `run` (one strategy)
//! and `compare` (every strategy of the config, optionally over several c_r points), all on a
//! fleet-models checkpoint placed by `--gpu-mode`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use fleet_argo::dataset::{DatasetSource, Difficulty};
use fleet_argo::experiment::{
    build_jobs, real_run_manifest, render_real_table, RealRunInputs, RealRunSummary,
    RetrievalConfig,
};
use fleet_argo::index::{Chunking, VectorIndex};
use fleet_argo::llm::{cache_manifest, FleetLlm, Llm};
use fleet_argo::prompts::Prompts;
use fleet_argo::runner::{run_jobs, summarize, RecordsFile, Retriever, RunEvent};
use fleet_argo::summary::{commit_id, write_json_atomic};
use fleet_argo::StrategyKind;
use fleet_cli::{out, outln};
use fleet_models::embedder::{EmbedderOptions, SentenceEmbedder};
use fleet_models::{LoadOptions, ModelSource};
use fleet_runs::{RunDir, RunDirOptions, RunDirState};
use fleet_serve::{Replicas, Text};
use indicatif::{ProgressBar, ProgressStyle};

/// The sentence embedder and where it runs.
#[derive(Args, Debug, Clone)]
pub struct EmbedderArgs {
    /// Sentence-transformers checkpoint (local dir or hub id). Default: the one recorded in
    /// the index (an index is searched with the embedder that built it); for a new index
    /// sentence-transformers/all-MiniLM-L6-v2.
    #[arg(long)]
    pub embedder: Option<String>,
    /// Device of the embedder and the similarity search: cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub embed_device: String,
}

/// The embedder a new index gets when --embedder is not given.
const DEFAULT_EMBEDDER: &str = "sentence-transformers/all-MiniLM-L6-v2";

impl EmbedderArgs {
    /// Loads `--embedder`, else the embedder `index` records, else [`DEFAULT_EMBEDDER`].
    fn load(&self, index: Option<&VectorIndex>) -> Result<(SentenceEmbedder, candle_core::Device)> {
        let location: fleet_models::DeviceLocation = self.embed_device.parse()?;
        let device = fleet_models::open_device(location)?;
        let opts = EmbedderOptions {
            device: device.clone(),
            ..EmbedderOptions::default()
        };
        let (spec, from) = match (&self.embedder, index) {
            (Some(e), _) => (e.clone(), "--embedder"),
            (None, Some(i)) => (i.meta().embedder.model.clone(), "the index's record"),
            (None, None) => (DEFAULT_EMBEDDER.to_string(), "the default"),
        };
        let embedder = SentenceEmbedder::load(&spec, &opts)
            .with_context(|| format!("loading the embedder {spec} (from {from})"))?;
        Ok((embedder, device))
    }
}

/// `argo-exp ingest`.
#[derive(Args, Debug)]
pub struct IngestArgs {
    /// Directory of .txt, .md and .pdf documents (searched recursively).
    #[arg(long)]
    pub docs: PathBuf,
    /// The index directory (created when missing; new and changed files are added).
    #[arg(long, default_value = "results/argo/index")]
    pub index: PathBuf,
    /// Start a new index instead of adding to the existing one.
    #[arg(long)]
    pub rebuild: bool,
    /// Words per chunk (default: the index's, or 160 for a new index). An existing index
    /// keeps its chunking: another value needs --rebuild.
    #[arg(long)]
    pub chunk_words: Option<usize>,
    /// Words shared by consecutive chunks (default: the index's, or 32 for a new index).
    #[arg(long)]
    pub chunk_overlap: Option<usize>,
    #[command(flatten)]
    pub embedder: EmbedderArgs,
}

pub fn ingest(args: &IngestArgs) -> Result<()> {
    let existing = if args.index.join("index.json").exists() && !args.rebuild {
        Some(VectorIndex::open(&args.index)?)
    } else {
        None
    };
    let (embedder, _) = args.embedder.load(existing.as_ref())?;
    let base = existing
        .as_ref()
        .map_or_else(Chunking::default, |i| i.meta().chunking);
    let chunking = Chunking {
        words: args.chunk_words.unwrap_or(base.words),
        overlap: args.chunk_overlap.unwrap_or(base.overlap),
    };
    if chunking.words == 0 || chunking.overlap >= chunking.words {
        bail!(
            "--chunk-words {} --chunk-overlap {}: chunks need at least one word and an overlap smaller than the chunk",
            chunking.words,
            chunking.overlap
        );
    }
    let mut index = match existing {
        Some(index) => {
            index.check_chunking(chunking)?;
            index
        }
        None => VectorIndex::create(&args.index, embedder.id(), embedder.dim(), chunking),
    };
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("{spinner} {pos} files, {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    let mut chunks = 0;
    let report = index.ingest_dir(&args.docs, &embedder, &mut |file, n| {
        chunks += n;
        bar.inc(1);
        bar.set_message(format!("{chunks} chunks ({file})"));
    })?;
    bar.finish_and_clear();
    index.save()?;
    outln!(
        "index {}: {} added, {} replaced, {} unchanged, {} removed, {} chunks added, {} chunks in all",
        args.index.display(),
        report.added.len(),
        report.replaced.len(),
        report.unchanged.len(),
        report.removed.len(),
        report.chunks_added,
        index.chunks().len()
    )?;
    for file in &report.removed {
        outln!("removed {file}: no longer under {}", args.docs.display())?;
    }
    for (file, why) in &report.skipped {
        outln!("skipped {file}: {why}")?;
    }
    Ok(())
}

/// `argo-exp query`.
#[derive(Args, Debug)]
pub struct QueryArgs {
    /// The text to search for.
    pub text: String,
    #[arg(long, default_value = "results/argo/index")]
    pub index: PathBuf,
    /// Hits to show (at least 1).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub top_k: u64,
    #[command(flatten)]
    pub embedder: EmbedderArgs,
}

pub fn query(args: &QueryArgs) -> Result<()> {
    let index = VectorIndex::open(&args.index)?;
    let (embedder, device) = args.embedder.load(Some(&index))?;
    index.check_embedder(embedder.id())?;
    let v = embedder.embed_vecs(&[args.text.as_str()])?;
    for hit in &index.search(&v, args.top_k as usize, &device)?[0] {
        let chunk = index.chunk(hit.id).context("hit outside the index")?;
        let text: String = chunk.text.chars().take(160).collect();
        outln!("{:.4}  {}#{}  {}", hit.score, chunk.source, hit.id, text)?;
    }
    Ok(())
}

/// Flags of the real runs.
#[derive(Args, Debug)]
pub struct RealArgs {
    /// The LLM: a local checkpoint dir or a hub id.
    #[arg(long)]
    pub model: String,
    /// Hub revision of the LLM.
    #[arg(long)]
    pub revision: Option<String>,
    /// bf16, f16 or f32 (default: bf16 when the model goes on GPUs, f32 on the CPU, where
    /// bf16 is several times slower).
    #[arg(long)]
    pub dtype: Option<String>,
    /// The LLM's placement: --gpu-mode, --gpu-ids, --max-memory.
    #[command(flatten)]
    pub placement: fleet_cli::PlacementArgs,
    /// Prompts per replica batch (at least 1).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_batch: u64,
    /// GiB the attention scores of one prefill batch may take (long prompts then go in
    /// smaller batches).
    #[arg(long, default_value_t = 16.0)]
    pub attention_budget_gib: f64,
    /// Questions (jobs) advancing together (at least 1).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_in_flight: u64,
    /// The retrieval index (`argo-exp ingest`).
    #[arg(long, default_value = "results/argo/index")]
    pub index: PathBuf,
    #[command(flatten)]
    pub embedder: EmbedderArgs,
    /// Chunks per retrieval (at least 1).
    #[arg(long, default_value_t = RetrievalConfig::default().top_k as u64, value_parser = clap::value_parser!(u64).range(1..))]
    pub top_k: u64,
    /// Cosine similarity a new chunk needs to count as progress.
    #[arg(long, default_value_t = RetrievalConfig::default().threshold)]
    pub threshold: f32,
    /// What makes a Retrieve progress: similarity (new chunks above --threshold) or
    /// llm-judge (the LLM is also asked whether the new chunks help).
    #[arg(long, default_value = "similarity")]
    pub progress: fleet_argo::runner::ProgressRule,
    /// ORAN-Bench-13K directory, or a generic multiple-choice .jsonl file.
    #[arg(long, default_value = "../shared/data/oran-bench-13k")]
    pub dataset: PathBuf,
    /// easy, medium, hard or mixed (ORAN-Bench only; default hard). A .jsonl dataset has no
    /// difficulty levels: giving one is an error.
    #[arg(long)]
    pub difficulty: Option<String>,
    /// Questions to sample (default: --mode's size, or all the dataset has when it has fewer).
    /// More than the dataset has is an error.
    #[arg(long)]
    pub n_questions: Option<usize>,
    /// small (10 questions, 5 c_r points), medium (100, 10), full (1000, 10).
    #[arg(long, value_enum)]
    pub mode: Option<crate::ModeArg>,
    /// Sampling and strategy seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Most Retrieve/Reason steps per question (default: the config's).
    #[arg(long)]
    pub step_cap: Option<u32>,
    /// Experiment TOML (configs/argo.toml layout).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Prompt TOML (default: configs/argo_prompts.toml, built in).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Results directory: manifest.json (what made the records), records.jsonl (resumable),
    /// summary.json, llm_cache.jsonl (exact cache of the greedy LLM calls, with
    /// llm_cache.jsonl.manifest.json) and, with --sweep, the plots. One run at a time.
    #[arg(
        long = "output-dir",
        visible_alias = "out",
        alias = "output",
        default_value = "results/argo/real"
    )]
    pub out: PathBuf,
    /// Remove the records of another model or other settings in --output-dir and start over (a
    /// resume with a different manifest is refused without it).
    #[arg(long)]
    pub overwrite: bool,
}

/// What to run: strategies and c_r points.
pub struct Plan {
    /// None: the config's list.
    pub strategies: Option<Vec<StrategyKind>>,
    /// None: the config's single c_r (`mdp.c_r`); Some: the sweep's points.
    pub sweep: bool,
}

/// The files a real run owns in its output directory (removed by --overwrite). The LLM cache
/// is not among them: it carries its own manifest and is kept when the model is the same.
const REAL_RUN_FILES: &[&str] = &[
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
const LLM_CACHE_FILE: &str = "llm_cache.jsonl";

pub fn run_real(args: &RealArgs, plan: Plan) -> Result<()> {
    let mut cfg = match &args.config {
        Some(p) => fleet_argo::ExperimentConfig::from_file(p)?,
        None => fleet_argo::ExperimentConfig::default(),
    };
    if let Some(mode) = args.mode {
        cfg.apply_mode(mode.into());
    }
    if let Some(seed) = args.seed {
        cfg.sweep.seed = seed;
    }
    if let Some(cap) = args.step_cap {
        cfg.episode.step_cap = cap;
    }
    if let Some(list) = &plan.strategies {
        cfg.strategies.list = list.clone();
    }
    if let Some(n) = args.n_questions {
        cfg.sweep.n_questions = n as u64;
    }
    cfg.validate()?;
    let c_r_values = if plan.sweep {
        cfg.sweep.c_r_values()
    } else {
        vec![cfg.mdp.c_r]
    };
    let prompts = match &args.prompts {
        Some(p) => Prompts::from_file(p)?,
        None => Prompts::default_prompts()?,
    };

    // Data.
    let (source, difficulty) = if args.dataset.extension().is_some_and(|e| e == "jsonl") {
        if let Some(d) = &args.difficulty {
            bail!(
                "--difficulty {d}: {} is a .jsonl dataset, which has no difficulty levels \
                 (they are ORAN-Bench-13K's files); leave out --difficulty, or give the \
                 ORAN-Bench directory",
                args.dataset.display()
            );
        }
        let path = args.dataset.clone();
        (DatasetSource::Jsonl { path }, None)
    } else {
        let difficulty: Difficulty = args.difficulty.as_deref().unwrap_or("hard").parse()?;
        let dir = args.dataset.clone();
        (
            DatasetSource::OranBench { dir, difficulty },
            Some(difficulty),
        )
    };
    let dataset = source.load()?;
    eprintln!("{}", dataset.report);
    let available = dataset.questions.len();
    let n_questions = cfg.sweep.n_questions as usize;
    if args.n_questions.is_some() && n_questions > available {
        bail!(
            "--n-questions {n_questions}: {} has only {available} questions{}; ask for at most {available}",
            args.dataset.display(),
            difficulty.map(|d| format!(" at difficulty {d}")).unwrap_or_default()
        );
    }
    let sample = dataset.sample(Some(n_questions), cfg.sweep.seed)?;
    eprintln!("{sample}");
    let questions: Vec<Arc<fleet_argo::dataset::Question>> =
        sample.questions.iter().cloned().map(Arc::new).collect();

    // Retrieval.
    let index = VectorIndex::open(&args.index)?;
    let (embedder, device) = args.embedder.load(Some(&index))?;
    index.check_embedder(embedder.id())?;
    let retrieval = RetrievalConfig {
        top_k: args.top_k as usize,
        threshold: args.threshold,
        progress: args.progress,
    };
    let retriever = Retriever::new(
        &embedder,
        &index,
        device,
        retrieval.top_k,
        retrieval.threshold,
        retrieval.progress,
    );

    // The output directory: taken (one writer) and checked against what made its records
    // before the model is loaded, so a refused resume costs no loading time.
    let gpus = fleet_topology::discover()?
        .iter()
        .any(|d| d.location.cuda_ordinal().is_some());
    let dtype = fleet_cli::dtype_or_default(args.dtype.as_deref(), gpus)?;
    let opts = LoadOptions {
        dtype,
        revision: args.revision.clone(),
        ..LoadOptions::default()
    };
    let dtype = dtype_name(opts.dtype);
    let checkpoint = ModelSource::parse(&args.model, args.revision.as_deref())?
        .resolve(&opts.hub)
        .with_context(|| format!("finding the checkpoint {}", args.model))?
        .identity()?;
    let model_id = match &args.revision {
        Some(r) => format!("{}@{r}", args.model),
        None => args.model.clone(),
    };
    let manifest = real_run_manifest(&RealRunInputs {
        model: &checkpoint,
        dtype,
        embedder: embedder.id(),
        index_digest: &index.content_digest()?,
        dataset: &dataset,
        difficulty,
        config: &cfg,
        retrieval: &retrieval,
        prompts: &prompts,
    })
    .note("model", &model_id)
    .note("index", args.index.display().to_string())
    .note("dataset", args.dataset.display().to_string());
    let run_dir = RunDir::open(
        &args.out,
        &manifest,
        &RunDirOptions::new(REAL_RUN_FILES, args.overwrite).with_dir_flag("--output-dir"),
    )?;
    if let RunDirState::Overwritten { removed, diffs } = &run_dir.state {
        eprintln!(
            "--overwrite: removed {} file(s) of an earlier run in {}{}",
            removed.len(),
            args.out.display(),
            if diffs.is_empty() {
                String::new()
            } else {
                format!(
                    " ({})",
                    diffs
                        .iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join("; ")
                )
            }
        );
    }

    // The LLM on its placement.
    let max_batch = args.max_batch as usize;
    let attention_budget = (args.attention_budget_gib * (1u64 << 30) as f64) as u64;
    let placement = args
        .placement
        .request(fleet_serve::default_workload(max_batch, attention_budget))?;
    let replicas = Replicas::<Text>::load_planned(&args.model, &opts, &placement)?;
    let placement_text = format!("{} mode, {} replica(s)", placement.mode, replicas.len());
    let llm = FleetLlm::new(replicas, model_id.clone(), max_batch)
        .with_attention_budget(attention_budget)
        .with_cache_file(
            &run_dir.join(LLM_CACHE_FILE),
            &cache_manifest(&checkpoint, dtype),
            args.overwrite,
        )?;

    // Jobs, resumable records.
    let strategies = cfg.strategies.list.clone();
    let jobs = build_jobs(&questions, &cfg, &strategies, &c_r_values)?;
    let keys: Vec<String> = jobs.iter().map(|j| j.key()).collect();
    let mut records = RecordsFile::open(&run_dir.join("records.jsonl"))?;
    if let Some(problems) = &records.problems {
        eprintln!("{problems}");
    }
    let bar = ProgressBar::new(jobs.len() as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} jobs  {elapsed} (ETA {eta})  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = Instant::now();
    let progress = run_jobs(
        jobs,
        &llm,
        &retriever,
        &prompts,
        &mut records,
        args.max_in_flight as usize,
        &mut |event| match event {
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
        },
    )?;
    bar.finish_and_clear();
    let wall_s = started.elapsed().as_secs_f64();

    let done: Vec<_> = keys.iter().filter_map(|k| records.get(k)).collect();
    let results = summarize(&done);
    out!("{}", render_real_table(&results))?;
    let summary = RealRunSummary {
        world: "real",
        model: format!("{model_id} ({dtype})"),
        embedder: serde_json::to_value(embedder.id())?,
        index: args.index.display().to_string(),
        dataset: serde_json::json!({
            "source": args.dataset.display().to_string(),
            "difficulty": difficulty,
            "n_questions": questions.len(),
            "seed": cfg.sweep.seed,
            "loaded": dataset.questions.len(),
        }),
        n_questions: questions.len(),
        results,
        llm: llm.stats(),
        wall_s,
        resumed_jobs: progress.resumed,
        progress: progress.clone(),
        config: cfg,
        retrieval,
        placement: placement_text,
        commit: commit_id(),
    };
    let path = run_dir.join("summary.json");
    write_json_atomic(&path, &summary)?;
    if c_r_values.len() > 1 {
        let subtitle = format!(
            "{} | {} {} questions, seed {}",
            summary.model,
            questions.len(),
            difficulty.map_or_else(|| "jsonl".to_string(), |d| d.to_string()),
            summary.config.sweep.seed
        );
        for plot in fleet_argo::plot::plot_real_sweep(&args.out, &summary.results, &subtitle)? {
            outln!("[real] wrote {}", plot.display())?;
        }
    }
    let stats = llm.stats();
    outln!(
        "[real] {} jobs ({} resumed) in {:.1} s, {} rounds; LLM: {} calls, {} cache hits, {} prompt + {} new tokens; wrote {}",
        progress.jobs,
        progress.resumed,
        wall_s,
        progress.rounds,
        stats.calls,
        stats.cache_hits,
        stats.prompt_tokens,
        stats.new_tokens,
        path.display()
    )?;
    outln!(
        "[real] time: LLM {:.1} s (prompts and cache {:.1} s, generation {:.1} s), retrieval {:.1} s",
        progress.llm_ms as f64 / 1e3,
        stats.prepare_ms as f64 / 1e3,
        stats.generate_ms as f64 / 1e3,
        progress.retrieval_ms as f64 / 1e3,
    )?;
    Ok(())
}

/// The dtype's name as the flags spell it.
fn dtype_name(dtype: candle_core::DType) -> &'static str {
    match dtype {
        candle_core::DType::BF16 => "bf16",
        candle_core::DType::F16 => "f16",
        candle_core::DType::F32 => "f32",
        _ => dtype.as_str(),
    }
}
