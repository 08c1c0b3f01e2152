//! The default command: score a benchmark with a Qwen3-VL judge.
//!
//! The flags become fleet-judge's job ([`fleet_judge::job`]): the prompt set and the benchmark
//! are checked here (bad items listed and skipped), the sampling flags checked, then
//! `job::run` checks the checkpoint, opens the output directory, plans this shard's calls,
//! loads the judge's replicas only when something is left to judge, and writes the report,
//! which is printed here.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use fleet_cli::outln;
use fleet_judge::benchmark::Loaded;
use fleet_judge::job::{
    self, BenchmarkFormat, BenchmarkLayout, JobConfig, JudgeBatching, JudgePlacement,
    SamplingChoice, Scored, SKIPPED_FILE, SKIPPED_SHOWN,
};
use fleet_judge::prompts::{ImageRole, PromptSet};
use fleet_judge::records::RunInfo;
use fleet_judge::report::Report;
use fleet_models::vision::ResizeBackend;
use fleet_models::DType;

/// A benchmark's layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// The original scorer's data JSON (Thomas-uestc/image_edit_benchmark): one JSON list of
    /// items with the source inline as base64; the edits in --edited-dir, named by pair id.
    ScorerJson,
    /// GEdit-Bench's layout: --benchmark is a fullset directory
    /// (`<task>/<en|cn>/<key>.png` beside `<key>_SRCIMG.png`), --gedit-rows the dataset's rows.
    Gedit,
    /// A plain JSONL: one object per line with id, category, instruction, source, edited (image
    /// paths relative to the file's directory).
    Jsonl,
}

impl Format {
    fn name(self) -> &'static str {
        BenchmarkFormat::from(self).name()
    }
}

impl From<Format> for BenchmarkFormat {
    fn from(f: Format) -> Self {
        match f {
            Format::ScorerJson => BenchmarkFormat::ScorerJson,
            Format::Gedit => BenchmarkFormat::Gedit,
            Format::Jsonl => BenchmarkFormat::Jsonl,
        }
    }
}

/// An image the judge is shown (`--images`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ImageArg {
    /// The image before the edit.
    Source,
    /// The edited image.
    Edited,
}

/// Flags of the default command.
#[derive(Args, Debug, Clone)]
pub struct ScoreArgs {
    /// Score a small generated benchmark with the tiny judge bundled in this program (random
    /// weights: its scores are meaningless; it shows the pipeline, with no downloads).
    #[arg(long)]
    pub demo: bool,
    /// The benchmark: a scorer JSON file, a GEdit-Bench fullset directory or a JSONL file.
    #[arg(long, value_name = "FILE_OR_DIR")]
    pub benchmark: Option<PathBuf>,
    /// The benchmark's layout.
    #[arg(long, value_enum)]
    pub format: Option<Format>,
    /// scorer-json: the directory of the edited images (`<dir>/<subset>/<pair id>.png` as the
    /// original pipeline saves them, or `<dir>/<pair id>.png`). gedit: where the edits are when
    /// not beside the sources.
    #[arg(long, value_name = "DIR")]
    pub edited_dir: Option<PathBuf>,
    /// gedit: the instructions, as a JSON Lines export of the stepfun-ai/GEdit-Bench dataset's
    /// rows (task_type, key, instruction, instruction_language).
    #[arg(long, value_name = "FILE")]
    pub gedit_rows: Option<PathBuf>,
    /// gedit: the instructions' language, en or cn (the layout's folder names).
    #[arg(long, default_value = "en")]
    pub language: String,
    /// The prompt set: configs/judge/original-rubrics.toml (the original scorer's rubrics,
    /// `Score: X`) or configs/judge/viescore.toml (VIEScore as GEdit-Bench runs it), or your own.
    #[arg(long, value_name = "TOML")]
    pub prompts: Option<PathBuf>,
    /// Show the judge these images, in this order, in every call (default: as the prompt set
    /// says; original-rubrics.toml shows only the edit, as the original scorer did).
    #[arg(long, value_enum, value_delimiter = ',', value_name = "source,edited")]
    pub images: Option<Vec<ImageArg>>,
    /// The judge: a Qwen3-VL checkpoint directory or hub id (Qwen/Qwen3-VL-8B-Instruct,
    /// Qwen/Qwen3-VL-30B-A3B-Instruct).
    #[arg(long)]
    pub model: Option<String>,
    /// Hub revision (branch, tag or commit) of --model; records are keyed by the commit it
    /// resolves to.
    #[arg(long)]
    pub revision: Option<String>,
    /// Prepare images as this transformers image-processor backend does: torchvision
    /// (transformers' default whenever torchvision is installed) or pillow (`backend="pil"`,
    /// transformers without torchvision); they differ by one level in a few pixels. Part of
    /// every record's key.
    #[arg(long, default_value = "torchvision", value_name = "torchvision|pillow")]
    pub image_backend: ResizeBackend,
    /// The output directory: records.jsonl (append-only, resumable), scores.jsonl, run.json,
    /// report.json, report.md, chart.png/.svg, skipped.json. One run at a time.
    #[arg(
        long = "output-dir",
        visible_alias = "output",
        alias = "out",
        value_name = "DIR"
    )]
    pub output: Option<PathBuf>,
    /// Requests per judge call (one left-padded batch on one replica; replicas take batches
    /// from a shared queue). Default on GPUs: the largest of 32, 16, 8, 4, 2, 1 that the memory
    /// plan fits without fewer replicas than batch 1 would get; 8 on the CPU.
    #[arg(long, visible_alias = "per-device-eval-batch-size",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: Option<u64>,
    /// How a judge call's requests decode: `continuous` (default) streams them through
    /// --max-num-seqs decode slots per replica on a paged KV cache, a finished reply's slot
    /// going at once to the next request (whose vision tower and prefill run between the
    /// others' decode steps); `static` decodes each call as one left-padded batch. The replies
    /// are the same. (On one H100 the 8B judge at batch 16 gave 4.02 samples/s continuous
    /// against 3.42 static.)
    #[arg(long, value_enum, default_value = "continuous")]
    pub batching: fleet_cli::Batching,
    /// vLLM's name: with `--batching continuous`, the replies decoded at once per judge
    /// replica (default: the batch size); with --batch-size above it no call waits for its
    /// longest reply.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_num_seqs: Option<u64>,
    /// The most tokens per reply (default: the prompt set's max_new_tokens, else 128).
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    /// Sample replies instead of greedy decoding (the seed is recorded in every record).
    #[arg(long)]
    pub do_sample: bool,
    /// Sampling temperature (with --do-sample or --retry-seed; default: the checkpoint's
    /// generation_config.json, else 1.0).
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Nucleus sampling (default: generation_config.json's, else off; 1.0 is off).
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Top-k sampling (default: generation_config.json's, else 50; 0 is off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// The sampling seed with --do-sample (default 0).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Judge a reply that does not parse once more, sampled with this fixed seed (and
    /// --temperature/--top-p/--top-k); recorded as a retry, with the first reply.
    #[arg(long)]
    pub retry_seed: Option<u64>,
    /// The judges' placement and dtype: --device or --gpu-mode, --gpu-ids, --max-memory;
    /// --dtype.
    #[command(flatten)]
    pub placement: fleet_cli::PlacementArgs,
    /// Run N judge replicas on the CPU instead of planning on GPUs (tests the replica
    /// processes on a machine without GPUs, with FLEET_REPLICA_PROCESSES=1).
    #[arg(long, hide = true)]
    pub cpu_replicas: Option<usize>,
    /// Split the benchmark into this many shards (machines or jobs); see `edit-score merge`.
    /// SLURM's and torchrun's variables are read when not given.
    #[arg(long)]
    pub num_shards: Option<usize>,
    /// This job's shard, 0-based.
    #[arg(long)]
    pub shard_index: Option<usize>,
    /// Remove an earlier run's files in --output-dir (another model, prompt set or decoding)
    /// and start over; without it such a resume is refused.
    #[arg(long)]
    pub overwrite: bool,
    /// Judge again the calls an earlier run recorded as failed (the judge failed on them; the
    /// report counts them). Without it a rerun leaves them as recorded.
    #[arg(long)]
    pub retry_failed: bool,
    /// No progress bars.
    #[arg(long)]
    pub no_progress: bool,
}

/// What to score, resolved from the flags (or made by the demo).
pub struct Job {
    /// The benchmark's items, validated.
    pub loaded: Loaded,
    /// Where it came from (kept in the manifest for reference).
    pub benchmark: String,
    /// Its layout.
    pub format: Format,
    /// The prompt set (any --images override applied).
    pub prompts: PromptSet,
    /// The judge checkpoint.
    pub model: String,
    /// Resize each edit to its source's size first (GEdit-Bench's scorer does).
    pub resize_edited_to_source: bool,
    /// The output directory.
    pub output: PathBuf,
}

/// `edit-score [flags]`.
pub fn run(args: &ScoreArgs) -> Result<()> {
    if args.demo {
        return crate::demo::run(args);
    }
    let job = job_from_flags(args)?;
    execute(args, job).map(|_| ())
}

fn require<'a, T>(value: &'a Option<T>, flag: &str, what: &str) -> Result<&'a T> {
    value
        .as_ref()
        .with_context(|| format!("give {flag} ({what}), or --demo to see a generated example"))
}

/// The prompt set from --prompts, with --images applied.
pub fn prompt_set(path: &Path, images: &Option<Vec<ImageArg>>) -> Result<PromptSet> {
    let set = PromptSet::load(path)?;
    apply_images(set, images)
}

/// Applies `--images` to a prompt set.
pub fn apply_images(set: PromptSet, images: &Option<Vec<ImageArg>>) -> Result<PromptSet> {
    Ok(match images {
        None => set,
        Some(list) => {
            let roles: Vec<ImageRole> = list
                .iter()
                .map(|i| match i {
                    ImageArg::Source => ImageRole::Source,
                    ImageArg::Edited => ImageRole::Edited,
                })
                .collect();
            set.with_images(&roles).context("--images")?
        }
    })
}

fn job_from_flags(args: &ScoreArgs) -> Result<Job> {
    let benchmark = require(
        &args.benchmark,
        "--benchmark",
        "a scorer JSON, GEdit-Bench fullset directory or JSONL",
    )?;
    let format = *require(&args.format, "--format", "scorer-json, gedit or jsonl")?;
    let prompts_path = require(
        &args.prompts,
        "--prompts",
        "configs/judge/original-rubrics.toml or configs/judge/viescore.toml",
    )?;
    let model = require(
        &args.model,
        "--model",
        "a Qwen3-VL checkpoint, e.g. Qwen/Qwen3-VL-8B-Instruct",
    )?;
    let output = require(&args.output, "--output-dir", "the results directory")?;
    let prompts = prompt_set(prompts_path, &args.images)?;
    if format != Format::Gedit && args.gedit_rows.is_some() {
        bail!("--gedit-rows applies to --format gedit only");
    }
    let hint = "check --format: scorer-json takes the original scorer's JSON list, jsonl one \
                object per line, gedit a fullset directory with --gedit-rows";
    let layout = match format {
        Format::ScorerJson => BenchmarkLayout::ScorerJson {
            edited_dir: require(
                &args.edited_dir,
                "--edited-dir",
                "the directory of the edited images, named by pair id",
            )?,
        },
        Format::Gedit => BenchmarkLayout::Gedit {
            rows: require(
                &args.gedit_rows,
                "--gedit-rows",
                "a JSON Lines export of the GEdit-Bench dataset's rows: task_type, key, \
                 instruction, instruction_language",
            )?,
            language: &args.language,
            edited_dir: args.edited_dir.as_deref(),
        },
        Format::Jsonl => {
            if args.edited_dir.is_some() {
                bail!(
                    "--edited-dir does not apply to --format jsonl: each line names its edited \
                     image (relative to the file's directory)"
                );
            }
            BenchmarkLayout::Jsonl
        }
    };
    let loaded = job::load_benchmark(benchmark, layout, &prompts).with_context(|| {
        format!(
            "loading {} as --format {} ({hint})",
            benchmark.display(),
            format.name()
        )
    })?;
    Ok(Job {
        loaded,
        benchmark: benchmark.display().to_string(),
        format,
        prompts,
        model: model.clone(),
        resize_edited_to_source: format == Format::Gedit,
        output: output.clone(),
    })
}

/// `--batching` and `--max-num-seqs` as the job takes them.
fn batching(args: &ScoreArgs) -> Result<JudgeBatching> {
    let slots = args.max_num_seqs.map(|n| n as usize);
    match (args.batching, slots) {
        (fleet_cli::Batching::Continuous, slots) => Ok(JudgeBatching::Paged(slots)),
        (fleet_cli::Batching::Static, None) => Ok(JudgeBatching::LeftPadded),
        (fleet_cli::Batching::Static, Some(n)) => anyhow::bail!(
            "--max-num-seqs {n} sets the decode slots of continuous batching, but --batching \
             static decodes each call as one left-padded batch: drop one of the two"
        ),
    }
}

/// Whether this machine has a GPU this build can use.
fn gpus_visible() -> bool {
    fleet_topology::discover()
        .map(|d| d.iter().any(|d| d.location.cuda_ordinal().is_some()))
        .unwrap_or(false)
}

/// Scores `job` with the flags' settings (see the module docs); returns the run's summary.
pub fn execute(args: &ScoreArgs, job: Job) -> Result<RunInfo> {
    print_loaded(&job);
    let sampling = sampling_choice(args)?;
    let output = job.output.clone();
    let config = JobConfig {
        benchmark: job.benchmark,
        format: job.format.into(),
        prompts: job.prompts,
        model: job.model,
        revision: args.revision.clone(),
        dtype: dtype(args)?,
        image_backend: args.image_backend,
        resize_edited_to_source: job.resize_edited_to_source,
        output: job.output,
        batch_size: args.batch_size.map(|b| b as usize),
        batching: batching(args)?,
        max_new_tokens: args.max_new_tokens,
        sampling,
        placement: match args.cpu_replicas {
            Some(n) => JudgePlacement::Cpu(n),
            None => {
                let (gpu_mode, gpu_ids) = args.placement.plan_mode_and_gpus()?;
                JudgePlacement::Planned {
                    gpu_mode,
                    gpu_ids,
                    max_memory: args.placement.gpus.max_memory.clone(),
                }
            }
        },
        num_shards: args.num_shards,
        shard_index: args.shard_index,
        overwrite: args.overwrite,
        retry_failed: args.retry_failed,
        progress: !args.no_progress,
    };
    let Scored {
        info,
        report,
        written,
    } = job::run(job.loaded, &config)?;
    print_summary(&info, &report, &output, &written)?;
    if !info.failed.is_empty() {
        bail!(
            "the judge failed on {} call(s) in this run: each is recorded as failed with its \
             errors (above, and in {dir}/records.jsonl and {dir}/run.json) and counted in the \
             report; a rerun leaves them as they are: add --retry-failed to judge them again",
            info.failed.len(),
            dir = output.display()
        );
    }
    Ok(info)
}

/// The benchmark's summary and its first skipped items, on stderr.
fn print_loaded(job: &Job) {
    let loaded = &job.loaded;
    eprintln!(
        "benchmark {} ({}): {loaded}",
        job.benchmark,
        job.format.name()
    );
    for s in loaded.skipped.iter().take(SKIPPED_SHOWN) {
        eprintln!("  skipped {}: {}", s.id, s.reason);
    }
    if loaded.skipped.len() > SKIPPED_SHOWN {
        eprintln!(
            "  and {} more (all in {}/{SKIPPED_FILE})",
            loaded.skipped.len() - SKIPPED_SHOWN,
            job.output.display()
        );
    }
}

/// The sampling flags, checked: the sampling settings apply only when sampling.
fn sampling_choice(args: &ScoreArgs) -> Result<SamplingChoice> {
    let sampled_flags = args.temperature.is_some() || args.top_p.is_some() || args.top_k.is_some();
    if sampled_flags && !args.do_sample && args.retry_seed.is_none() {
        bail!(
            "--temperature/--top-p/--top-k apply to sampling: add --do-sample (sampled replies) \
             or --retry-seed S (a sampled retry of replies that do not parse); decoding is \
             greedy otherwise"
        );
    }
    if args.seed.is_some() && !args.do_sample {
        bail!("--seed applies with --do-sample; decoding is greedy otherwise (a retry has --retry-seed)");
    }
    Ok(SamplingChoice {
        do_sample: args.do_sample,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        retry_seed: args.retry_seed,
    })
}

/// `--dtype`, or its default: bf16 when the judges are planned on visible GPUs, else f32.
fn dtype(args: &ScoreArgs) -> Result<DType> {
    args.placement
        .dtype_or_default(args.cpu_replicas.is_none() && gpus_visible())
}

fn print_summary(info: &RunInfo, report: &Report, out: &Path, written: &[PathBuf]) -> Result<()> {
    for w in &info.workers {
        if let Some(why) = &w.stopped {
            eprintln!(
                "{} stopped after {} batch(es): {why}; the others took its batches",
                w.name, w.batches_done
            );
        } else if w.batches_failed > 0 {
            eprintln!("{} failed {} batch(es)", w.name, w.batches_failed);
        }
    }
    for f in &info.failed {
        eprintln!(
            "the judge failed on {} ({}): {}",
            f.id,
            f.call,
            f.errors.join(" | ")
        );
    }
    outln!(
        "{} call(s): {} judged now, {} resumed, {} recorded; {} reply(ies) did not parse (counted, \
         never scored){}; {} item(s) skipped at load; {:.1}s",
        info.calls_total,
        info.calls_judged,
        info.calls_resumed,
        info.calls_recorded,
        info.parse_failed_now,
        if info.retried_now > 0 {
            format!(", {} retried", info.retried_now)
        } else {
            String::new()
        },
        info.skipped.values().sum::<usize>(),
        info.elapsed_s
    )?;
    crate::results::print_report(report)?;
    outln!("results in {}:", out.display())?;
    for p in written {
        outln!("  {}", p.display())?;
    }
    Ok(())
}
