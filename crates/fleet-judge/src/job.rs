//! The edit-score job, assembled: a validated benchmark, a prompt set and a Qwen3-VL
//! checkpoint in, records, `run.json` and the report out.
//!
//! Order of work, so that mistakes cost nothing: the checkpoint is checked to be Qwen3-VL and
//! its model id computed, every call's length is checked by the checkpoint's processor (too
//! long: skipped), the output directory is opened (its lock, its manifest: a resume with other
//! settings is refused) and this shard's calls are planned; only then, and only when something
//! is left to judge, are the judge's replicas loaded (one per GPU or GPU group, by the planner;
//! replicas after the first in child processes). Records are appended as calls finish; the
//! report is written at the end.
//!
//! ```ignore
//! let loaded = load_benchmark(&path, BenchmarkLayout::Jsonl, &prompts)?;
//! let scored = job::run(loaded, &JobConfig { prompts, model, .. })?;
//! // scored.info (counts, failed calls), scored.report, scored.written (its files)
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use fleet_dist::ShardSpec;
use fleet_models::qwen3_vl::VlProcessor;
use fleet_models::vision::ResizeBackend;
use fleet_models::CheckpointFiles;
use fleet_models::{
    DType, DeviceLocation, DeviceMap, GenerationConfig, LoadOptions, ModelSource, Qwen3VlConfig,
};
use fleet_runs::{RunDirState, StepContext, StepError};
use fleet_serve::{plan_on_this_machine, PlacementRequest, Workload};
use serde_json::json;

use crate::benchmark::{load_gedit, load_jsonl, load_scorer_json, Loaded};
use crate::judge::{Decoding, Sampling};
use crate::prompts::{ImageRole, PromptSet, DEFAULT_TEMPLATE};
use crate::qwen::{judge_model_id, load_judges, load_judges_on, skip_too_long, Qwen3VlJudge};
use crate::records::RunInfo;
use crate::report::Report;
use crate::run::{RunOptions, ScoringSpec, Session, SessionOptions};

/// Skipped items printed before "and N more" (all of them go to [`SKIPPED_FILE`]).
pub const SKIPPED_SHOWN: usize = 50;

/// The file in the output directory that lists the benchmark's skipped items.
pub const SKIPPED_FILE: &str = "skipped.json";

/// The batch size on the CPU when none is given.
pub const CPU_BATCH: usize = 8;

/// The batch sizes chosen from on GPUs when none is given, largest first (on an H200, batches
/// of 16-32 judged ~1.75x faster than 8: docs/benchmarks.md).
pub const AUTO_BATCHES: [usize; 6] = [32, 16, 8, 4, 2, 1];

/// A benchmark's layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchmarkFormat {
    /// The original scorer's data JSON (Thomas-uestc/image_edit_benchmark); the edits in a
    /// directory, named by pair id.
    ScorerJson,
    /// GEdit-Bench's fullset directory with the dataset's rows as JSONL.
    Gedit,
    /// A plain JSONL: one object per line with id, category, instruction, source, edited.
    Jsonl,
}

impl BenchmarkFormat {
    /// The name the records' manifest and messages use (`scorer-json`, `gedit`, `jsonl`).
    pub fn name(self) -> &'static str {
        match self {
            BenchmarkFormat::ScorerJson => "scorer-json",
            BenchmarkFormat::Gedit => "gedit",
            BenchmarkFormat::Jsonl => "jsonl",
        }
    }
}

/// How to read a benchmark of each layout.
#[derive(Clone, Copy, Debug)]
pub enum BenchmarkLayout<'a> {
    /// The original scorer's JSON; the edited images in `edited_dir`, named by pair id.
    ScorerJson {
        /// The directory of the edited images.
        edited_dir: &'a Path,
    },
    /// GEdit-Bench's fullset directory.
    Gedit {
        /// The dataset's rows as JSONL.
        rows: &'a Path,
        /// The instructions' language (`en` or `cn`).
        language: &'a str,
        /// Where the edits are when not beside the sources.
        edited_dir: Option<&'a Path>,
    },
    /// A plain JSONL (image paths relative to the file's directory).
    Jsonl,
}

impl BenchmarkLayout<'_> {
    /// The layout's format.
    pub fn format(&self) -> BenchmarkFormat {
        match self {
            BenchmarkLayout::ScorerJson { .. } => BenchmarkFormat::ScorerJson,
            BenchmarkLayout::Gedit { .. } => BenchmarkFormat::Gedit,
            BenchmarkLayout::Jsonl => BenchmarkFormat::Jsonl,
        }
    }
}

/// Loads and validates the benchmark at `path` (bad items skipped and counted); a scorer
/// JSON's categories are those `prompts` has a template for.
pub fn load_benchmark(
    path: &Path,
    layout: BenchmarkLayout<'_>,
    prompts: &PromptSet,
) -> Result<Loaded, crate::benchmark::Error> {
    match layout {
        BenchmarkLayout::ScorerJson { edited_dir } => {
            let cats = known_categories(prompts);
            let refs: Option<Vec<&str>> = cats
                .as_ref()
                .map(|c| c.iter().map(String::as_str).collect());
            load_scorer_json(path, edited_dir, refs.as_deref())
        }
        BenchmarkLayout::Gedit {
            rows,
            language,
            edited_dir,
        } => load_gedit(path, language, edited_dir, rows),
        BenchmarkLayout::Jsonl => {
            let base = path.parent().unwrap_or(Path::new("."));
            load_jsonl(path, base)
        }
    }
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

/// The sampling settings asked for; what is not given comes from the checkpoint's
/// generation_config.json, else transformers' defaults (temperature 1.0, top_p 1.0 = off,
/// top_k 50).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingChoice {
    /// Sampled replies instead of greedy decoding.
    pub do_sample: bool,
    /// Temperature.
    pub temperature: Option<f64>,
    /// Nucleus sampling (1.0 is off).
    pub top_p: Option<f64>,
    /// Top-k sampling (0 is off).
    pub top_k: Option<usize>,
    /// The seed of sampled replies (default 0).
    pub seed: Option<u64>,
    /// Retry a reply that does not parse once, sampled with this seed.
    pub retry_seed: Option<u64>,
}

/// Where the judge's replicas go.
#[derive(Clone, Debug, PartialEq)]
pub enum JudgePlacement {
    /// By the planner on this machine's GPUs (`fleet_serve::PlacementRequest::from_flags`'s
    /// mode, GPU ids and budgets); the CPU when there is none.
    Planned {
        /// auto, single, data-parallel, layer-sharded / sharded, `hybrid[:N]`.
        gpu_mode: String,
        /// Only these GPUs.
        gpu_ids: Option<Vec<usize>>,
        /// Per-device budgets in accelerate's style.
        max_memory: Option<String>,
    },
    /// This many replicas on the CPU (at least one), replicas after the first in child
    /// processes when `FLEET_REPLICA_PROCESSES=1`.
    Cpu(usize),
}

/// Everything a scoring job needs but the items.
#[derive(Debug)]
pub struct JobConfig {
    /// Where the benchmark came from (the manifest's `benchmark`).
    pub benchmark: String,
    /// Its layout.
    pub format: BenchmarkFormat,
    /// The prompt set.
    pub prompts: PromptSet,
    /// The judge checkpoint: a directory or hub id.
    pub model: String,
    /// Hub revision of `model`.
    pub revision: Option<String>,
    /// The compute dtype (the binary resolves its default: bf16 with GPUs, f32 on the CPU).
    pub dtype: DType,
    /// The image processor's backend (part of every record's key).
    pub image_backend: ResizeBackend,
    /// Resize each edit to its source's size first (GEdit-Bench's scorer does).
    pub resize_edited_to_source: bool,
    /// The output directory.
    pub output: PathBuf,
    /// Requests per judge call; `None`: [`CPU_BATCH`] on the CPU, on GPUs the largest of
    /// [`AUTO_BATCHES`] the memory plan fits without costing replicas.
    pub batch_size: Option<usize>,
    /// How a judge call's requests are decoded; the replies are the same either way.
    pub batching: JudgeBatching,
    /// The most tokens per reply; `None`: the prompt set's, else 128.
    pub max_new_tokens: Option<usize>,
    /// Greedy or sampled replies, and the retry.
    pub sampling: SamplingChoice,
    /// Where the replicas go.
    pub placement: JudgePlacement,
    /// Shards of the benchmark (launcher variables when `None`).
    pub num_shards: Option<usize>,
    /// This job's shard.
    pub shard_index: Option<usize>,
    /// Start over when the output directory's manifest differs.
    pub overwrite: bool,
    /// Judge again the calls recorded as failed.
    pub retry_failed: bool,
    /// Progress bars.
    pub progress: bool,
}

/// How a judge call's requests are decoded ([`JobConfig::batching`]). The replies are the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JudgeBatching {
    /// One left-padded batch per call: every reply waits for the call's longest.
    LeftPadded,
    /// Continuous batching on a paged KV cache: a call's requests stream through this many
    /// decode slots per replica (`None`: the batch size), a finished reply's slot refilled at
    /// once ([`fleet_models::LoadOptions::decode_slots`]). On one H100 the 8B judge at 1024
    /// px, batch 16, gave 4.02 samples/s this way against 3.42 left-padded.
    Paged(Option<usize>),
}

/// A finished job: the run's summary and its report, written.
#[derive(Debug)]
pub struct Scored {
    /// Counts, skipped kinds, failed calls, workers.
    pub info: RunInfo,
    /// The report of every record in the output directory.
    pub report: Report,
    /// The report's files.
    pub written: Vec<PathBuf>,
}

/// Errors of a job: each keeps its cause chain (`source`), and a step's context names what
/// was being done with which input (`fleet_runs::StepError`).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct JobError(#[from] pub StepError);

fleet_runs::step_error_from!(
    JobError;
    fleet_models::ModelError,
    fleet_dist::DistError,
    fleet_runs::RunsError,
    crate::run::RunError,
    crate::report::ReportError,
    crate::prompts::PromptError
);

/// Scores `loaded` (the benchmark's items, validated: [`load_benchmark`]) as `config` says
/// (see the module docs) and writes the report.
pub fn run(mut loaded: Loaded, config: &JobConfig) -> Result<Scored, JobError> {
    let checkpoint = Checkpoint::open(&config.model, config)?;
    let max_new_tokens = config
        .max_new_tokens
        .or(config.prompts.max_new_tokens)
        .unwrap_or(128);
    skip_items_too_long(&mut loaded, config, &checkpoint, max_new_tokens)?;
    let (decoding, retry, notes) =
        decoding(&config.sampling, &checkpoint.generation, max_new_tokens);
    let spec = ScoringSpec {
        prompts: config.prompts.clone(),
        model_id: checkpoint.model_id.clone(),
        decoding,
        retry,
        resize_edited_to_source: config.resize_edited_to_source,
        image_backend: config.image_backend,
    };
    let session = open_session(config, spec, &loaded)?;
    let shard = ShardSpec::from_process_env(config.num_shards, config.shard_index)?;
    let plan = session.plan(&loaded, shard)?;
    let pending = plan.pending(session.store(), config.retry_failed).len();
    describe(&session, &checkpoint.model_id, &notes);
    eprintln!(
        "{shard}: items {}..{} of {}, {} call(s): {} recorded, {pending} to judge",
        plan.range.start,
        plan.range.end,
        loaded.items.len(),
        plan.tasks.len(),
        plan.tasks.len() - pending,
    );
    let (judges, batch_size) = if pending == 0 {
        (Vec::new(), config.batch_size.unwrap_or(CPU_BATCH))
    } else {
        load_replicas(config, &checkpoint)?
    };
    let info = judge(&session, judges, &plan, batch_size, config)?;
    drop(session);
    let report = Report::from_dir(&config.output, &fleet_runs::commit_id())?;
    let written = report.write(&config.output)?;
    Ok(Scored {
        info,
        report,
        written,
    })
}

/// The judge checkpoint, checked before anything is written: Qwen3-VL, its generation
/// defaults, its identity (the records' key).
struct Checkpoint {
    opts: LoadOptions,
    files: CheckpointFiles,
    config: Qwen3VlConfig,
    generation: GenerationConfig,
    model_id: String,
}

impl Checkpoint {
    fn open(model: &str, job: &JobConfig) -> Result<Self, JobError> {
        let opts = LoadOptions {
            dtype: job.dtype,
            revision: job.revision.clone(),
            image_backend: job.image_backend,
            decode_slots: match job.batching {
                JudgeBatching::Paged(slots) => slots,
                JudgeBatching::LeftPadded => None,
            },
            ..LoadOptions::default()
        };
        let files = ModelSource::parse(model, opts.revision.as_deref())
            .and_then(|s| s.resolve(&opts.hub))
            .context(|| format!("finding the judge checkpoint --model {model}"))?;
        let config = Qwen3VlConfig::from_file(&files.config)
            .context(|| format!("--model {model} cannot be the judge"))?;
        let generation = match &files.generation_config {
            Some(p) => GenerationConfig::from_file(p).map_err(fleet_models::ModelError::from)?,
            None => GenerationConfig::default(),
        };
        eprintln!("judge {model}: computing its identity (the records' key) ...");
        let model_id = judge_model_id(model, &opts)?;
        Ok(Checkpoint {
            opts,
            files,
            config,
            generation,
            model_id,
        })
    }
}

/// Every call's length, by the checkpoint's processor (no weights): an item too long for the
/// judge is skipped now rather than failing at judge time; none left is an error.
fn skip_items_too_long(
    loaded: &mut Loaded,
    job: &JobConfig,
    checkpoint: &Checkpoint,
    max_new_tokens: usize,
) -> Result<(), JobError> {
    let model = &job.model;
    let processor = VlProcessor::with_config(&checkpoint.files, checkpoint.config.clone())
        .context(|| format!("--model {model}: its processor files"))?
        .with_image_backend(job.image_backend);
    let too_long = skip_too_long(
        loaded,
        &job.prompts,
        &processor,
        max_new_tokens,
        job.resize_edited_to_source,
    )?;
    if too_long == 0 {
        return Ok(());
    }
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
        return Err(JobError::from(StepError::Invalid(format!(
            "no item of {} fits the judge: every one is too long (above); \
             shorten the instructions, shrink the images or lower --max-new-tokens",
            job.benchmark
        ))));
    }
    Ok(())
}

/// The decoding, the retry's sampling and notes on where the sampling settings came from.
fn decoding(
    choice: &SamplingChoice,
    generation: &GenerationConfig,
    max_new_tokens: usize,
) -> (Decoding, Option<Sampling>, Vec<String>) {
    let mut notes = Vec::new();
    let decoding = if choice.do_sample {
        let (s, from) = sampling(choice, generation, choice.seed.unwrap_or(0));
        notes.push(format!("sampled: {from}"));
        Decoding {
            max_new_tokens,
            sampling: Some(s),
        }
    } else {
        Decoding::greedy(max_new_tokens)
    };
    let retry = choice.retry_seed.map(|seed| {
        let (s, from) = sampling(choice, generation, seed);
        notes.push(format!("retry of unparsed replies: {from}"));
        s
    });
    (decoding, retry, notes)
}

/// Sampling settings from the choice, the checkpoint's generation_config.json, then
/// transformers' defaults; `seed` given. Returns the setting and where each value came from.
fn sampling(choice: &SamplingChoice, gen: &GenerationConfig, seed: u64) -> (Sampling, String) {
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
    let temperature = pick_f("temperature", choice.temperature, gen.temperature, 1.0);
    let top_p = pick_f("top_p", choice.top_p, gen.top_p, 1.0);
    let top_k = match (choice.top_k, gen.top_k) {
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
            sampler_version: fleet_models::ops::SAMPLER_VERSION,
        },
        from.join(", "),
    )
}

/// Opens the output directory (resume, refuse or overwrite, said on stderr) and writes the
/// benchmark's skipped items to [`SKIPPED_FILE`].
fn open_session(job: &JobConfig, spec: ScoringSpec, loaded: &Loaded) -> Result<Session, JobError> {
    let output = &job.output;
    let mut about = BTreeMap::new();
    about.insert("benchmark".to_string(), json!(job.benchmark));
    about.insert("format".to_string(), json!(job.format.name()));
    about.insert("model".to_string(), json!(job.model));
    about.insert("revision".to_string(), json!(job.revision));
    about.insert("commit".to_string(), json!(fleet_runs::commit_id()));
    about.insert(
        "fleet_version".to_string(),
        json!(fleet_runs::fleet_version()),
    );
    let session = Session::open(
        output,
        spec,
        &SessionOptions {
            overwrite: job.overwrite,
            about,
        },
    )
    .context(|| format!("opening the output directory {}", output.display()))?;
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
    Ok(session)
}

/// Says on stderr which prompt set, images, judge and decoding the session scores with.
fn describe(session: &Session, model_id: &str, notes: &[String]) {
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
}

/// The judge's replicas, on the CPU or by the planner, and the batch size (chosen by the plan
/// when not given).
fn load_replicas(
    job: &JobConfig,
    checkpoint: &Checkpoint,
) -> Result<(Vec<Qwen3VlJudge>, usize), JobError> {
    let started = Instant::now();
    let (model, model_id) = (&job.model, &checkpoint.model_id);
    let mut opts = checkpoint.opts.clone();
    let mut batch_size = job.batch_size.unwrap_or(CPU_BATCH);
    let judges = match &job.placement {
        JudgePlacement::Cpu(n) => {
            let layers = checkpoint.config.text.num_hidden_layers;
            let maps = vec![DeviceMap::single(DeviceLocation::Cpu, layers); (*n).max(1)];
            paged_slots(&mut opts, job.batching, batch_size);
            load_judges_on(model, &opts, &maps, model_id)?
        }
        JudgePlacement::Planned {
            gpu_mode,
            gpu_ids,
            max_memory,
        } => {
            let mut placement = PlacementRequest::from_flags(
                gpu_mode,
                gpu_ids.clone(),
                max_memory.as_deref(),
                Workload {
                    batch: batch_size,
                    // Two images of ~1000 tokens each, a rubric prompt and the reply.
                    seq_len: 4096,
                    full_logits: false,
                    // GPU prefills in bf16/f16 go through fused attention: no score buffers.
                    kv_pool_bytes: None,
                    max_attention_bytes: fleet_models::attention::fused_prefill(
                        job.dtype,
                        checkpoint.config.text.head_dim(),
                    )
                    .then_some(0),
                },
            )?;
            if job.batch_size.is_none() {
                batch_size = auto_batch_size(|b| {
                    let mut r = placement.clone();
                    r.workload.batch = b;
                    Ok(plan_on_this_machine(model, &opts, &r)?
                        .map(|p| (p.replicas.len(), p.group_size())))
                })?;
                placement.workload.batch = batch_size;
                eprintln!(
                    "batch size {batch_size} (the largest up to {} that the memory plan fits; \
                     --batch-size to choose)",
                    AUTO_BATCHES[0]
                );
            }
            paged_slots(&mut opts, job.batching, batch_size);
            load_judges(model, &opts, &placement, model_id)?
        }
    };
    let names: Vec<String> = judges.iter().map(|j| j.name()).collect();
    eprintln!(
        "judge loaded in {:.1}s: {} replica(s): {}",
        started.elapsed().as_secs_f64(),
        judges.len(),
        names.join(", ")
    );
    Ok((judges, batch_size))
}

/// Runs the pending calls over the judges (none needed when nothing is pending).
fn judge(
    session: &Session,
    judges: Vec<Qwen3VlJudge>,
    plan: &crate::run::Plan<'_>,
    batch_size: usize,
    job: &JobConfig,
) -> Result<RunInfo, JobError> {
    let worker_names = (!judges.is_empty()).then(|| {
        judges
            .iter()
            .enumerate()
            .map(|(i, j)| format!("judge {i} [{}]", j.name()))
            .collect()
    });
    Ok(session.run(
        judges,
        plan,
        &RunOptions {
            batch_size,
            progress: job.progress,
            worker_names,
            stop_failed_judge: None,
            retry_failed: job.retry_failed,
        },
    )?)
}

/// The largest of [`AUTO_BATCHES`] whose plan (`plan_for(batch)`: replicas and GPUs per
/// replica, `None` without GPUs) keeps batch 1's replicas: a larger batch must not cost a
/// replica nor spread one over more GPUs. [`CPU_BATCH`] without GPUs.
/// The decode slots of [`JudgeBatching::Paged`] without a number: the batch size, once known.
fn paged_slots(opts: &mut LoadOptions, batching: JudgeBatching, batch_size: usize) {
    if batching == JudgeBatching::Paged(None) {
        opts.decode_slots = Some(batch_size);
    }
}

fn auto_batch_size(
    plan_for: impl Fn(usize) -> fleet_models::Result<Option<(usize, usize)>>,
) -> fleet_models::Result<usize> {
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
