//! The real-model commands: `ingest` and `query` (the retrieval index), `run` (one strategy)
//! and `compare` (every strategy of the config, optionally over several c_r points), all on a
//! fleet-models checkpoint placed by `--gpu-mode`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use fleet_argo::dataset::{DatasetSource, Difficulty};
use fleet_argo::experiment::{build_jobs, render_real_table, RealRunSummary, RetrievalConfig};
use fleet_argo::index::{Chunking, VectorIndex};
use fleet_argo::llm::{FleetLlm, Llm};
use fleet_argo::prompts::Prompts;
use fleet_argo::runner::{run_jobs, summarize, RecordsFile, Retriever};
use fleet_argo::summary::{commit_id, write_json_atomic};
use fleet_argo::StrategyKind;
use fleet_models::embedder::{EmbedderOptions, SentenceEmbedder};
use fleet_models::placement::{PlacementRequest, Replicas};
use fleet_models::{parse_dtype, LoadOptions};
use indicatif::{ProgressBar, ProgressStyle};

/// The sentence embedder and where it runs.
#[derive(Args, Debug, Clone)]
pub struct EmbedderArgs {
    /// Sentence-transformers checkpoint (local dir or hub id).
    #[arg(long, default_value = "sentence-transformers/all-MiniLM-L6-v2")]
    pub embedder: String,
    /// Device of the embedder and the similarity search: cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub embed_device: String,
}

impl EmbedderArgs {
    fn load(&self) -> Result<(SentenceEmbedder, candle_core::Device)> {
        let location: fleet_models::DeviceLocation = self.embed_device.parse()?;
        let device = fleet_models::open_device(location)?;
        let opts = EmbedderOptions {
            device: device.clone(),
            ..EmbedderOptions::default()
        };
        let embedder = SentenceEmbedder::load(&self.embedder, &opts)
            .with_context(|| format!("loading the embedder {}", self.embedder))?;
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
    /// Words per chunk.
    #[arg(long, default_value_t = Chunking::default().words)]
    pub chunk_words: usize,
    /// Words shared by consecutive chunks.
    #[arg(long, default_value_t = Chunking::default().overlap)]
    pub chunk_overlap: usize,
    #[command(flatten)]
    pub embedder: EmbedderArgs,
}

pub fn ingest(args: &IngestArgs) -> Result<()> {
    let (embedder, _) = args.embedder.load()?;
    let chunking = Chunking {
        words: args.chunk_words,
        overlap: args.chunk_overlap,
    };
    if chunking.words == 0 || chunking.overlap >= chunking.words {
        bail!("--chunk-words must be > 0 and --chunk-overlap smaller than it");
    }
    let mut index = if args.index.join("index.json").exists() && !args.rebuild {
        VectorIndex::open(&args.index)?
    } else {
        VectorIndex::create(&args.index, embedder.id(), embedder.dim(), chunking)
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
    println!(
        "index {}: {} added, {} replaced, {} unchanged, {} chunks added, {} chunks in all",
        args.index.display(),
        report.added.len(),
        report.replaced.len(),
        report.unchanged.len(),
        report.chunks_added,
        index.chunks().len()
    );
    for (file, why) in &report.skipped {
        println!("skipped {file}: {why}");
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
    /// Hits to show.
    #[arg(long, default_value_t = 5)]
    pub top_k: usize,
    #[command(flatten)]
    pub embedder: EmbedderArgs,
}

pub fn query(args: &QueryArgs) -> Result<()> {
    let (embedder, device) = args.embedder.load()?;
    let index = VectorIndex::open(&args.index)?;
    index.check_embedder(embedder.id())?;
    let v = embedder.embed_vecs(&[args.text.as_str()])?;
    for hit in &index.search(&v, args.top_k, &device)?[0] {
        let chunk = index.chunk(hit.id).context("hit outside the index")?;
        let text: String = chunk.text.chars().take(160).collect();
        println!("{:.4}  {}#{}  {}", hit.score, chunk.source, hit.id, text);
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
    /// bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// single, data-parallel, layer-sharded (sharded), hybrid[:N] or auto.
    #[arg(long, default_value = "auto")]
    pub gpu_mode: String,
    /// Only these GPUs.
    #[arg(long, value_delimiter = ',')]
    pub gpu_ids: Option<Vec<usize>>,
    /// Budgets in accelerate's style, e.g. `0=60GiB,1=0.9`.
    #[arg(long)]
    pub max_memory: Option<String>,
    /// Prompts per replica batch.
    #[arg(long, default_value_t = 64)]
    pub max_batch: usize,
    /// GiB the attention scores of one prefill batch may take (long prompts then go in
    /// smaller batches).
    #[arg(long, default_value_t = 16.0)]
    pub attention_budget_gib: f64,
    /// Questions (jobs) advancing together.
    #[arg(long, default_value_t = 256)]
    pub max_in_flight: usize,
    /// The retrieval index (`argo-exp ingest`).
    #[arg(long, default_value = "results/argo/index")]
    pub index: PathBuf,
    #[command(flatten)]
    pub embedder: EmbedderArgs,
    /// Chunks per retrieval.
    #[arg(long, default_value_t = RetrievalConfig::default().top_k)]
    pub top_k: usize,
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
    /// easy, medium, hard or mixed (ORAN-Bench only).
    #[arg(long, default_value = "hard")]
    pub difficulty: String,
    /// Questions to sample (default: --mode's size).
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
    /// Results directory: records.jsonl (resumable), summary.json, llm_cache.jsonl.
    #[arg(long, default_value = "results/argo/real")]
    pub out: PathBuf,
}

/// What to run: strategies and c_r points.
pub struct Plan {
    /// None: the config's list.
    pub strategies: Option<Vec<StrategyKind>>,
    /// None: the config's single c_r (`mdp.c_r`); Some: the sweep's points.
    pub sweep: bool,
}

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
    let n_questions = args.n_questions.unwrap_or(cfg.sweep.n_questions as usize);
    cfg.sweep.n_questions = n_questions as u64;
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
    let source = if args.dataset.extension().is_some_and(|e| e == "jsonl") {
        DatasetSource::Jsonl {
            path: args.dataset.clone(),
        }
    } else {
        let difficulty: Difficulty = args.difficulty.parse()?;
        DatasetSource::OranBench {
            dir: args.dataset.clone(),
            difficulty,
        }
    };
    let dataset = source.load()?;
    eprintln!("{}", dataset.report);
    let sample = dataset.sample(Some(n_questions), cfg.sweep.seed)?;
    let questions: Vec<Arc<fleet_argo::dataset::Question>> =
        sample.questions.iter().cloned().map(Arc::new).collect();

    // Retrieval.
    let (embedder, device) = args.embedder.load()?;
    let index = VectorIndex::open(&args.index)?;
    index.check_embedder(embedder.id())?;
    let retrieval = RetrievalConfig {
        top_k: args.top_k,
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

    // The LLM on its placement.
    let mode = match args.gpu_mode.as_str() {
        "sharded" => "layer-sharded",
        m => m,
    };
    let attention_budget = (args.attention_budget_gib * (1u64 << 30) as f64) as u64;
    let placement = PlacementRequest {
        mode: mode.parse()?,
        gpu_ids: args.gpu_ids.clone(),
        max_memory: match &args.max_memory {
            Some(m) => m.parse()?,
            None => fleet_models::placement::MaxMemory::new(),
        },
        workload: fleet_models::placement::default_workload(args.max_batch, attention_budget),
    };
    let opts = LoadOptions {
        dtype: parse_dtype(&args.dtype)?,
        revision: args.revision.clone(),
        ..LoadOptions::default()
    };
    let replicas = Replicas::load_planned(&args.model, &opts, &placement)?;
    let placement_text = format!("{} mode, {} replica(s)", mode, replicas.len());
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let model_id = match &args.revision {
        Some(r) => format!("{}@{r}", args.model),
        None => args.model.clone(),
    };
    let llm = FleetLlm::new(replicas, model_id.clone(), args.max_batch)
        .with_attention_budget(attention_budget)
        .with_cache_file(&args.out.join(cache_file_name(&model_id, &args.dtype)))?;

    // Jobs, resumable records.
    let strategies = plan
        .strategies
        .unwrap_or_else(|| cfg.strategies.list.clone());
    let jobs = build_jobs(&questions, &cfg, &strategies, &c_r_values)?;
    let keys: Vec<String> = jobs.iter().map(|j| j.key()).collect();
    let mut records = RecordsFile::open(&args.out.join("records.jsonl"))?;
    if records.bad_lines > 0 {
        eprintln!(
            "records.jsonl: {} unreadable line(s) (a run killed mid-write); those jobs run again",
            records.bad_lines
        );
    }
    let bar = ProgressBar::new(jobs.len() as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} jobs  {elapsed} (ETA {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = Instant::now();
    let progress = run_jobs(
        jobs,
        &llm,
        &retriever,
        &prompts,
        &mut records,
        args.max_in_flight,
        &mut |_| bar.inc(1),
    )?;
    bar.finish_and_clear();
    let wall_s = started.elapsed().as_secs_f64();

    let done: Vec<_> = keys.iter().filter_map(|k| records.get(k)).collect();
    let results = summarize(&done);
    print!("{}", render_real_table(&results));
    let summary = RealRunSummary {
        world: "real",
        model: format!("{model_id} ({})", args.dtype),
        embedder: serde_json::to_value(embedder.id())?,
        index: args.index.display().to_string(),
        dataset: serde_json::json!({
            "source": args.dataset.display().to_string(),
            "difficulty": args.difficulty,
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
    let path = args.out.join("summary.json");
    write_json_atomic(&path, &summary)?;
    if c_r_values.len() > 1 {
        let subtitle = format!(
            "{} | {} {} questions, seed {}",
            summary.model,
            questions.len(),
            args.difficulty,
            summary.config.sweep.seed
        );
        for plot in fleet_argo::plot::plot_real_sweep(&args.out, &summary.results, &subtitle)? {
            println!("[real] wrote {}", plot.display());
        }
    }
    let stats = llm.stats();
    println!(
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
    );
    println!(
        "[real] time: LLM {:.1} s (prompts and cache {:.1} s, generation {:.1} s), retrieval {:.1} s",
        progress.llm_ms as f64 / 1e3,
        stats.prepare_ms as f64 / 1e3,
        stats.generate_ms as f64 / 1e3,
        progress.retrieval_ms as f64 / 1e3,
    );
    Ok(())
}

/// One cache file per model and dtype: token ids mean nothing for another model.
fn cache_file_name(model_id: &str, dtype: &str) -> String {
    let safe: String = model_id
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("llm_cache.{safe}.{dtype}.jsonl")
}
