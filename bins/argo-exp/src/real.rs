//! The real-model commands: `ingest` and `query` (the retrieval index), `run` (one strategy)
//! and `compare` (every strategy of the config, optionally over several c_r points), all on a
//! fleet-models checkpoint placed by `--gpu-mode`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use fleet_argo::experiment::RetrievalConfig;
use fleet_argo::index::{Chunking, VectorIndex};
use fleet_argo::real_run::{self, EmbedderChoice, RealRunConfig};
use fleet_argo::StrategyKind;
use fleet_cli::{out, outln};
use fleet_models::embedder::SentenceEmbedder;
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

impl EmbedderArgs {
    /// Loads `--embedder`, else the embedder `index` records, else the default.
    fn load(&self, index: Option<&VectorIndex>) -> Result<(SentenceEmbedder, candle_core::Device)> {
        Ok(self.choice().load(index)?)
    }

    /// The flags as the library's embedder choice.
    fn choice(&self) -> EmbedderChoice {
        EmbedderChoice {
            model: self.embedder.clone(),
            device: self.embed_device.clone(),
        }
    }
}

/// `argo-exp ingest`.
#[derive(Args, Debug)]
pub struct IngestArgs {
    /// Directory of .txt, .md, .rst and .pdf documents (searched recursively).
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
    /// The LLM's placement and dtype: --device or --gpu-mode, --gpu-ids, --max-memory;
    /// --dtype.
    #[command(flatten)]
    pub placement: fleet_cli::PlacementArgs,
    /// Calls decoding together on a replica (at least 1): continuous batching's decode slots
    /// (the KV cache admits as many as it holds), or the prompts of one lock-step batch.
    /// Default: 384 with `--batching continuous` (the fastest measured on an H200), 64 with
    /// `static`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_batch: Option<u64>,
    /// GiB the attention scores of one prefill batch may take (long prompts then go in
    /// smaller batches).
    #[arg(long, default_value_t = 16.0)]
    pub attention_budget_gib: f64,
    /// Questions (jobs) advancing together (at least 1); enough to keep --max-batch calls in
    /// flight when many are answered from the LLM cache.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_in_flight: u64,
    /// How the LLM's calls share the decode batch: `continuous` (each question asks its next
    /// call as soon as its last one returns; up to --max-batch decode at once on a paged KV
    /// cache that reuses the prompt blocks of earlier calls) or `static` (lock-step rounds:
    /// every question in flight takes one step, in batches of --max-batch). The records are
    /// the same. Continuous needs every replica in this process.
    #[arg(long, value_enum, default_value = "continuous")]
    pub batching: fleet_cli::Batching,
    /// With `--batching continuous`: GiB of each replica's paged KV cache, allocated when the
    /// run starts (fewer when --max-batch calls of the model's whole context need less).
    /// Default: on GPUs, what the placement's budgets (--max-memory; each GPU less 10%) leave
    /// beside the weights and a prompt pass, as vLLM sizes its cache; 2 on the CPU.
    #[arg(long)]
    pub kv_cache_gib: Option<f64>,
    /// With `--batching continuous`: decode steps queued before their tokens are read back
    /// (vLLM's name). The records are the same for any value; a finished call's next one
    /// joins up to that many steps later.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub num_scheduler_steps: u64,
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

/// `argo-exp run` / `compare`: the flags as a [`RealRunConfig`], the run, and what it prints.
pub fn run_real(args: &RealArgs, plan: Plan) -> Result<()> {
    let run = real_run::run(&real_config(args, plan)?)?;
    out!("{}", run.table())?;
    let written = run.write()?;
    for plot in &written.plots {
        outln!("[real] wrote {}", plot.display())?;
    }
    let (progress, stats) = (&run.summary.progress, &run.summary.llm);
    outln!(
        "[real] {} jobs ({} resumed) in {:.1} s, {} polls of the LLM; LLM: {} calls, {} cache hits, {} prompt ({} reused from earlier calls' KV) + {} new tokens; wrote {}",
        progress.jobs,
        progress.resumed,
        run.summary.wall_s,
        progress.rounds,
        stats.calls,
        stats.cache_hits,
        stats.prompt_tokens,
        stats.cached_prompt_tokens,
        stats.new_tokens,
        written.summary.display()
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

/// The flags of a real run as the library's config.
fn real_config(args: &RealArgs, plan: Plan) -> Result<RealRunConfig> {
    let (gpu_mode, gpu_ids) = args.placement.plan_mode_and_gpus()?;
    Ok(RealRunConfig {
        model: args.model.clone(),
        revision: args.revision.clone(),
        dtype: args.placement.dtype.clone(),
        gpu_mode,
        gpu_ids,
        max_memory: args.placement.gpus.max_memory.clone(),
        max_batch: args.max_batch.unwrap_or(match args.batching {
            fleet_cli::Batching::Continuous => 384,
            fleet_cli::Batching::Static => 64,
        }) as usize,
        attention_budget_gib: args.attention_budget_gib,
        max_in_flight: args.max_in_flight as usize,
        continuous_batching: args.batching == fleet_cli::Batching::Continuous,
        kv_cache_gib: args.kv_cache_gib,
        num_scheduler_steps: args.num_scheduler_steps as usize,
        index: args.index.clone(),
        embedder: args.embedder.choice(),
        retrieval: RetrievalConfig {
            top_k: args.top_k as usize,
            threshold: args.threshold,
            progress: args.progress,
        },
        dataset: args.dataset.clone(),
        difficulty: args.difficulty.clone(),
        n_questions: args.n_questions,
        mode: args.mode.map(Into::into),
        seed: args.seed,
        step_cap: args.step_cap,
        config: args.config.clone(),
        prompts: args.prompts.clone(),
        strategies: plan.strategies,
        sweep: plan.sweep,
        out: args.out.clone(),
        overwrite: args.overwrite,
    })
}
