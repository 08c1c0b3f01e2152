//! The default command: score a benchmark with a Qwen3-VL judge.
//!
//! Order of work, so that mistakes cost nothing: the prompt set and the benchmark are checked
//! (bad items listed and skipped), the checkpoint is checked to be Qwen3-VL, the output
//! directory is opened (its lock, its manifest: a resume with other settings is refused) and
//! this shard's calls are planned; only then, and only when something is left to judge, are the
//! judge's replicas loaded (one per GPU or GPU group, by the planner; replicas after the first
//! in child processes of this program). Records are appended as calls finish; the report is
//! written at the end.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use fleet_cli::outln;
use fleet_dist::ShardSpec;
use fleet_judge::benchmark::{load_gedit, load_jsonl, load_scorer_json, Loaded};
use fleet_judge::judge::{Decoding, Sampling};
use fleet_judge::prompts::{ImageRole, PromptSet, DEFAULT_TEMPLATE};
use fleet_judge::qwen::{judge_model_id, load_judges, load_judges_on, skip_too_long, Qwen3VlJudge};
use fleet_judge::records::RunInfo;
use fleet_judge::report::Report;
use fleet_judge::run::{RunOptions, ScoringSpec, Session, SessionOptions};
use fleet_models::qwen3_vl::VlProcessor;
use fleet_models::vision::ResizeBackend;
use fleet_models::{
    DType, DeviceLocation, DeviceMap, GenerationConfig, LoadOptions, ModelSource, Qwen3VlConfig,
};
use fleet_runs::RunDirState;
use fleet_serve::{plan_on_this_machine, Workload};
use serde_json::json;

/// Skipped items printed before "and N more" (all of them go to `skipped.json`).
const SKIPPED_SHOWN: usize = 50;

/// The file in the output directory that lists the benchmark's skipped items.
pub const SKIPPED_FILE: &str = "skipped.json";

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
        match self {
            Format::ScorerJson => "scorer-json",
            Format::Gedit => "gedit",
            Format::Jsonl => "jsonl",
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
    /// Compute dtype: bf16, f16 or f32 (default: bf16 with GPUs, f32 on the CPU).
    #[arg(long)]
    pub dtype: Option<String>,
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
    /// The judges' placement: --gpu-mode, --gpu-ids, --max-memory.
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

/// The categories a scorer JSON may have: every category the prompt set has a template for
/// in every call; `None` when every call has a default template.
fn known_categories(prompts: &PromptSet) -> Option<Vec<String>> {
    if prompts
        .calls
        .iter()
        .all(|c| c.templates.contains_key(DEFAULT_TEMPLATE))
    {
        return None;
    }
    let mut names: Vec<String> = prompts.categories.keys().cloned().collect();
    if let Some(first) = prompts.calls.first() {
        names.extend(first.templates.keys().cloned());
    }
    names.sort();
    names.dedup();
    Some(
        names
            .into_iter()
            .filter(|n| {
                prompts
                    .calls
                    .iter()
                    .all(|c| prompts.template_name(c, n).is_some())
            })
            .collect(),
    )
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
    let loaded = match format {
        Format::ScorerJson => {
            let edited = require(
                &args.edited_dir,
                "--edited-dir",
                "the directory of the edited images, named by pair id",
            )?;
            let cats = known_categories(&prompts);
            let refs: Option<Vec<&str>> = cats
                .as_ref()
                .map(|c| c.iter().map(String::as_str).collect());
            load_scorer_json(benchmark, edited, refs.as_deref())
        }
        Format::Gedit => {
            let rows = require(
                &args.gedit_rows,
                "--gedit-rows",
                "a JSON Lines export of the GEdit-Bench dataset's rows: task_type, key, \
                 instruction, instruction_language",
            )?;
            load_gedit(benchmark, &args.language, args.edited_dir.as_deref(), rows)
        }
        Format::Jsonl => {
            if args.edited_dir.is_some() {
                bail!(
                    "--edited-dir does not apply to --format jsonl: each line names its edited \
                     image (relative to the file's directory)"
                );
            }
            let base = benchmark.parent().unwrap_or(Path::new("."));
            load_jsonl(benchmark, base)
        }
    }
    .with_context(|| {
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

/// Whether this machine has a GPU this build can use.
fn gpus_visible() -> bool {
    fleet_topology::discover()
        .map(|d| d.iter().any(|d| d.location.cuda_ordinal().is_some()))
        .unwrap_or(false)
}

/// Sampling settings from the flags, the checkpoint's generation_config.json, then
/// transformers' defaults; `seed` given. Returns the setting and where each value came from.
fn sampling(args: &ScoreArgs, gen: &GenerationConfig, seed: u64) -> (Sampling, String) {
    let mut from = Vec::new();
    let mut pick_f = |name: &str, flag: Option<f64>, cfg: Option<f64>, default: f64| {
        let (v, src) = match (flag, cfg) {
            (Some(v), _) => (v, "flag"),
            (None, Some(v)) => (v, "generation_config.json"),
            (None, None) => (default, "transformers' default"),
        };
        from.push(format!("{name}={v} ({src})"));
        v
    };
    let temperature = pick_f("temperature", args.temperature, gen.temperature, 1.0);
    let top_p = pick_f("top_p", args.top_p, gen.top_p, 1.0);
    let top_k = match (args.top_k, gen.top_k) {
        (Some(k), _) => {
            from.push(format!("top_k={k} (flag)"));
            k
        }
        (None, Some(k)) => {
            from.push(format!("top_k={k} (generation_config.json)"));
            k
        }
        (None, None) => {
            from.push("top_k=50 (transformers' default)".into());
            50
        }
    };
    from.push(format!("seed={seed}"));
    (
        Sampling {
            temperature,
            // transformers: top_p 1.0 and top_k 0 turn the filters off.
            top_p: (top_p < 1.0).then_some(top_p),
            top_k: (top_k > 0).then_some(top_k),
            seed,
        },
        from.join(", "),
    )
}

/// Scores `job` (see the module docs); returns the run's summary.
pub fn execute(args: &ScoreArgs, job: Job) -> Result<RunInfo> {
    let Job {
        mut loaded,
        benchmark,
        format,
        prompts,
        model,
        resize_edited_to_source,
        output,
    } = job;
    eprintln!("benchmark {benchmark} ({}): {loaded}", format.name());
    for s in loaded.skipped.iter().take(SKIPPED_SHOWN) {
        eprintln!("  skipped {}: {}", s.id, s.reason);
    }
    if loaded.skipped.len() > SKIPPED_SHOWN {
        eprintln!(
            "  and {} more (all in {}/{SKIPPED_FILE})",
            loaded.skipped.len() - SKIPPED_SHOWN,
            output.display()
        );
    }

    // The checkpoint: Qwen3-VL, its identity, its generation defaults.
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
    let dtype = match &args.dtype {
        Some(d) => fleet_models::parse_dtype(d)?,
        None if args.cpu_replicas.is_none() && gpus_visible() => DType::BF16,
        None => DType::F32,
    };
    let opts = LoadOptions {
        dtype,
        revision: args.revision.clone(),
        image_backend: args.image_backend,
        ..LoadOptions::default()
    };
    let files = ModelSource::parse(&model, opts.revision.as_deref())
        .and_then(|s| s.resolve(&opts.hub))
        .with_context(|| format!("finding the judge checkpoint --model {model}"))?;
    let judge_cfg = Qwen3VlConfig::from_file(&files.config)
        .with_context(|| format!("--model {model} cannot be the judge"))?;
    let generation = match &files.generation_config {
        Some(p) => GenerationConfig::from_file(p)?,
        None => GenerationConfig::default(),
    };
    eprintln!("judge {model}: computing its identity (the records' key) ...");
    let model_id = judge_model_id(&model, &opts)?;

    // Decoding.
    let max_new_tokens = args
        .max_new_tokens
        .or(prompts.max_new_tokens)
        .unwrap_or(128);

    // Every call's length, by the checkpoint's processor (no weights): an item too long for
    // the judge is skipped now rather than failing at judge time.
    let processor = VlProcessor::with_config(&files, judge_cfg.clone())
        .with_context(|| format!("--model {model}: its processor files"))?
        .with_image_backend(args.image_backend);
    let too_long = skip_too_long(
        &mut loaded,
        &prompts,
        &processor,
        max_new_tokens,
        resize_edited_to_source,
    )?;
    if too_long > 0 {
        eprintln!(
            "{too_long} item(s) too long for the judge (max_position_embeddings {}), skipped:",
            processor.max_positions()
        );
        for s in loaded
            .skipped
            .iter()
            .rev()
            .take(too_long.min(SKIPPED_SHOWN))
        {
            eprintln!("  skipped {}: {}", s.id, s.reason);
        }
        if loaded.items.is_empty() {
            bail!(
                "no item of {benchmark} fits the judge: every one is too long (above); \
                 shorten the instructions, shrink the images or lower --max-new-tokens"
            );
        }
    }
    drop(processor);
    let mut notes = Vec::new();
    let decoding = if args.do_sample {
        let (s, from) = sampling(args, &generation, args.seed.unwrap_or(0));
        notes.push(format!("sampled: {from}"));
        Decoding {
            max_new_tokens,
            sampling: Some(s),
        }
    } else {
        Decoding::greedy(max_new_tokens)
    };
    let retry = args.retry_seed.map(|seed| {
        let (s, from) = sampling(args, &generation, seed);
        notes.push(format!("retry of unparsed replies: {from}"));
        s
    });

    let spec = ScoringSpec {
        prompts,
        model_id: model_id.clone(),
        decoding,
        retry,
        resize_edited_to_source,
        image_backend: args.image_backend,
    };
    let mut about = BTreeMap::new();
    about.insert("benchmark".to_string(), json!(benchmark));
    about.insert("format".to_string(), json!(format.name()));
    about.insert("model".to_string(), json!(model));
    about.insert("revision".to_string(), json!(args.revision));
    about.insert("commit".to_string(), json!(fleet_runs::commit_id()));
    about.insert(
        "fleet_version".to_string(),
        json!(fleet_runs::fleet_version()),
    );
    let session = Session::open(
        &output,
        spec,
        &SessionOptions {
            overwrite: args.overwrite,
            about,
        },
    )
    .with_context(|| format!("opening the output directory {}", output.display()))?;
    match session.state() {
        RunDirState::New => {}
        RunDirState::Resumed => eprintln!(
            "resuming {}: {} record(s) there",
            output.display(),
            session.store().len()
        ),
        RunDirState::Overwritten { removed, .. } => eprintln!(
            "--overwrite: removed {} file(s) of an earlier run in {}",
            removed.len(),
            output.display()
        ),
    }
    let skipped: Vec<_> = loaded
        .skipped
        .iter()
        .map(|s| json!({"id": s.id, "kind": s.kind.to_string(), "reason": s.reason}))
        .collect();
    fleet_runs::write_json_atomic(&output.join(SKIPPED_FILE), &skipped)?;

    let shard = ShardSpec::from_process_env(args.num_shards, args.shard_index)?;
    let plan = session.plan(&loaded, shard)?;
    let pending = plan.pending(session.store(), args.retry_failed).len();
    let set = &session.spec().prompts;
    let shows: Vec<String> = set
        .calls
        .iter()
        .map(|c| {
            let imgs: Vec<&str> = c
                .images
                .iter()
                .map(|i| match i {
                    ImageRole::Source => "source",
                    ImageRole::Edited => "edited",
                })
                .collect();
            format!("{} sees {}", c.name, imgs.join(" + "))
        })
        .collect();
    eprintln!(
        "prompt set {} v{} ({}; {}), judge {model_id}, {}{}",
        set.name,
        set.version,
        set.scheme,
        shows.join(", "),
        session.spec().decoding.describe(),
        if notes.is_empty() {
            String::new()
        } else {
            format!("; {}", notes.join("; "))
        }
    );
    eprintln!(
        "{shard}: items {}..{} of {}, {} call(s): {} recorded, {pending} to judge",
        plan.range.start,
        plan.range.end,
        loaded.items.len(),
        plan.tasks.len(),
        plan.tasks.len() - pending,
    );

    // The judges, only when there is something to judge.
    let mut batch_size = args.batch_size.map_or(CPU_BATCH, |b| b as usize);
    let judges: Vec<Qwen3VlJudge> = if pending == 0 {
        Vec::new()
    } else {
        let started = Instant::now();
        let judges = match args.cpu_replicas {
            Some(n) => {
                let layers = judge_cfg.text.num_hidden_layers;
                let maps = vec![DeviceMap::single(DeviceLocation::Cpu, layers); n.max(1)];
                load_judges_on(&model, &opts, &maps, &model_id)?
            }
            None => {
                let mut placement = args.placement.request(Workload {
                    batch: batch_size,
                    // Two images of ~1000 tokens each, a rubric prompt and the reply.
                    seq_len: 4096,
                    full_logits: false,
                    // GPU prefills in bf16/f16 go through fused attention: no score buffers.
                    max_attention_bytes: fleet_models::attention::fused_prefill(
                        dtype,
                        judge_cfg.text.head_dim(),
                    )
                    .then_some(0),
                })?;
                if args.batch_size.is_none() {
                    batch_size = auto_batch_size(|b| {
                        let mut r = placement.clone();
                        r.workload.batch = b;
                        Ok(plan_on_this_machine(&model, &opts, &r)?
                            .map(|p| (p.replicas.len(), p.group_size())))
                    })?;
                    placement.workload.batch = batch_size;
                    eprintln!(
                        "batch size {batch_size} (the largest up to {} that the memory plan fits; \
                         --batch-size to choose)",
                        AUTO_BATCHES[0]
                    );
                }
                load_judges(&model, &opts, &placement, &model_id)?
            }
        };
        let names: Vec<String> = judges.iter().map(|j| j.name()).collect();
        eprintln!(
            "judge loaded in {:.1}s: {} replica(s): {}",
            started.elapsed().as_secs_f64(),
            judges.len(),
            names.join(", ")
        );
        judges
    };
    let worker_names = (!judges.is_empty()).then(|| {
        judges
            .iter()
            .enumerate()
            .map(|(i, j)| format!("judge {i} [{}]", j.name()))
            .collect()
    });
    let info = session.run(
        judges,
        &plan,
        &RunOptions {
            batch_size,
            progress: !args.no_progress,
            worker_names,
            stop_failed_judge: None,
            retry_failed: args.retry_failed,
        },
    )?;
    drop(session);

    let report = Report::from_dir(&output, &fleet_runs::commit_id())?;
    let written = report.write(&output)?;
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

/// `--batch-size` on the CPU when not given.
const CPU_BATCH: usize = 8;

/// The batch sizes `--batch-size` chooses from on GPUs, largest first (on an H200, batches of
/// 16-32 judged ~1.75x faster than 8: docs/benchmarks.md).
const AUTO_BATCHES: [usize; 6] = [32, 16, 8, 4, 2, 1];

/// The largest of [`AUTO_BATCHES`] whose plan (`plan_for(batch)`: replicas and GPUs per
/// replica, `None` without GPUs) keeps batch 1's replicas: a larger batch must not cost a
/// replica nor spread one over more GPUs. [`CPU_BATCH`] without GPUs.
fn auto_batch_size(
    plan_for: impl Fn(usize) -> fleet_models::Result<Option<(usize, usize)>>,
) -> Result<usize> {
    let Some(one) = plan_for(1)? else {
        return Ok(CPU_BATCH);
    };
    for b in AUTO_BATCHES {
        // A batch the plan refuses (does not fit) is passed over like one that costs replicas.
        if matches!(plan_for(b), Ok(Some(p)) if p == one) {
            return Ok(b);
        }
    }
    Ok(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_batch_takes_the_largest_batch_that_keeps_the_replicas() {
        // Two replicas of one GPU each up to batch 16; at 32 the planner would shard.
        let plan = |b: usize| Ok(Some(if b <= 16 { (2, 1) } else { (1, 2) }));
        assert_eq!(auto_batch_size(plan).unwrap(), 16);
        // Everything fits: the largest.
        assert_eq!(auto_batch_size(|_| Ok(Some((1, 1)))).unwrap(), 32);
        // Batches above 4 do not fit at all (the planner refuses them).
        let tight = |b: usize| {
            if b > 4 {
                Err(fleet_models::ModelError::BadInput("does not fit".into()))
            } else {
                Ok(Some((1, 1)))
            }
        };
        assert_eq!(auto_batch_size(tight).unwrap(), 4);
        // No GPU: the CPU default.
        assert_eq!(auto_batch_size(|_| Ok(None)).unwrap(), CPU_BATCH);
    }
}
