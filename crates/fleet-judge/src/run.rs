//! The scoring loop: every (item, call) of a benchmark judged once, recorded as it finishes,
//! resumable, over one judge or a pool of judges (one per replica).
//!
//! ```text
//! let session = Session::open(out_dir, spec, &SessionOptions::default())?; // RunDir + records
//! let plan = session.plan(&loaded, shard)?;        // keys of this shard's calls (images read)
//! let info = session.run(judges, &plan, &RunOptions::default())?;  // judge what is not done
//! let report = Report::from_dir(out_dir, &commit)?; report.write(out_dir)?;
//! ```
//!
//! - [`Session::open`] opens the output directory with [`fleet_runs::RunDir`] (one writer; a
//!   manifest of the prompt set, model id, decoding, retry policy and resize, so the records of
//!   a directory are of one configuration; `overwrite` starts over) and its records log
//!   ([`RecordStore`], a torn last line repaired).
//! - [`Session::plan`] takes this shard's items ([`ShardSpec::select`]), checks that the
//!   prompt set can fill every item's templates, renders the prompts and computes each call's
//!   key from the image bytes ([`crate::records::record_key`]).
//! - [`Session::run`] skips calls whose key is recorded, cuts the rest into batches of
//!   `batch_size` and hands them to a [`fleet_dist::ReplicaPool`] of [`JudgeWorker`]s — one per
//!   judge — that share the queue. A worker loads the batch's images (checked against the
//!   planned digests; the edit resized to the source for GEdit-Bench), judges, parses, appends
//!   each record as soon as it is known and, when a reply does not parse and a retry is
//!   configured, judges those requests once more with the retry's fixed seed (recorded as a
//!   retry). A judge that fails a whole batch (or breaks the one-reply-per-request contract)
//!   fails the pool item: the batch goes back to the queue for another judge, which skips what
//!   was already recorded, and the failure is reported in [`RunInfo::workers`]. A call that
//!   has no reply at the end (a request that failed alone, an image that cannot be read, a
//!   batch every judge failed) is listed in [`RunInfo::failed`] and recorded as failed with
//!   its errors ([`Record::failed`]): the report counts it, and a rerun leaves it unless
//!   [`RunOptions::retry_failed`]. Nothing is ever given a substitute score.
//! - A record that cannot be written (a full disk) ends the run at once ([`StopRun`]): no
//!   further call is judged, and [`Session::run`] returns the error naming the file.
//! - At the end the run writes `scores.jsonl` (this benchmark's records, by index) and
//!   `run.json` ([`RunInfo`]) atomically.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use fleet_dist::{DistError, ItemResult, PoolOptions, ReplicaPool, ShardSpec, StopRun, Worker};
use fleet_models::vision::ResizeBackend;
use fleet_runs::{Manifest, RunDir, RunDirOptions, RunDirState, RunsError};
use image::DynamicImage;
use serde_json::Value;

use crate::benchmark::{resize_to_source, ImageRef, Item, Loaded};
use crate::judge::{Decoding, Judge, JudgeReply, JudgeRequest, Part, Sampling};
use crate::parse::{parse_reply, ParseFailed};
use crate::prompts::{ImageRole, PromptError, PromptSet};
use crate::records::{
    record_key, sha256_hex, FailedCall, FirstAttempt, KeyParts, OpenReport, Record, RecordStore,
    RecordsError, RetryInfo, RunInfo, Timing, WorkerInfo, JOB, RECORDS_FILE, RUN_FILE, SCORES_FILE,
};

/// Errors of a scoring run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The replica pool of judges (a run stopped by a judge that cannot write its records).
    #[error(transparent)]
    Dist(#[from] DistError),
    /// The output directory, its lock, manifest or files.
    #[error(transparent)]
    Runs(#[from] RunsError),
    /// The record files.
    #[error(transparent)]
    Records(#[from] RecordsError),
    /// The prompt set cannot serve the benchmark.
    #[error(transparent)]
    Prompt(Box<PromptError>),
    /// An image could not be read while planning.
    #[error("item {id:?}: cannot read its {role} image {location}: {source}; the benchmark changed since it was loaded: load it again")]
    ImageRead {
        /// The pair id.
        id: String,
        /// `source` or `edited`.
        role: &'static str,
        /// The path, or `(inline base64)`.
        location: String,
        /// The cause.
        source: std::io::Error,
    },
    /// No judge to run the batches.
    #[error("no judge given: pass at least one (one per replica)")]
    NoJudges,
    /// `batch_size` 0.
    #[error("batch_size is 0: use at least 1 (requests per judge call)")]
    ZeroBatch,
    /// A judge's model id differs from the session's.
    #[error("judge {judge} reports model id {found:?}, but the session records {expected:?}; every replica must load the checkpoint the session was opened for")]
    ModelMismatch {
        /// The judge's position.
        judge: usize,
        /// What it reports.
        found: String,
        /// The session's.
        expected: String,
    },
    /// A decoding setting that cannot work.
    #[error("{field} = {value} {problem}")]
    BadSetting {
        /// The setting (`decoding.max_new_tokens`, `retry.temperature`, ...).
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong and what to use.
        problem: &'static str,
    },
    /// Worker names given do not match the judges.
    #[error("{names} worker names for {judges} judges: give one name per judge, or none")]
    WorkerNames {
        /// Names given.
        names: usize,
        /// Judges given.
        judges: usize,
    },
}

impl From<PromptError> for RunError {
    fn from(e: PromptError) -> Self {
        RunError::Prompt(Box::new(e))
    }
}

/// Result of this module.
pub type Result<T, E = RunError> = std::result::Result<T, E>;

/// What determines a run's records (the output directory's manifest and every record's key).
#[derive(Debug, Clone)]
pub struct ScoringSpec {
    /// The prompt set.
    pub prompts: PromptSet,
    /// The judge's model id ([`Judge::model_id`]); every judge of a run must report it.
    pub model_id: String,
    /// How replies are decoded (greedy by default).
    pub decoding: Decoding,
    /// Retry a reply that does not parse once, sampled with this (fixed-seed) setting;
    /// `None`: no retry (the default).
    pub retry: Option<Sampling>,
    /// Resize the edit to the source's size before judging, as GEdit-Bench's scorer does
    /// ([`resize_to_source`]).
    pub resize_edited_to_source: bool,
    /// transformers' image-processor backend the judge prepares images with (the judges must
    /// be loaded with it: `LoadOptions::image_backend`).
    pub image_backend: ResizeBackend,
}

/// Checks a sampling setting; `fields` names its temperature, top_p and top_k in messages.
fn check_sampling(s: &Sampling, fields: [&'static str; 3]) -> Result<()> {
    let bad = |field, value: String, problem| {
        Err(RunError::BadSetting {
            field,
            value,
            problem,
        })
    };
    if !(s.temperature.is_finite() && s.temperature > 0.0) {
        return bad(
            fields[0],
            s.temperature.to_string(),
            "must be a positive number (greedy decoding is sampling = None)",
        );
    }
    if let Some(p) = s.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return bad(
                fields[1],
                p.to_string(),
                "must lie in (0, 1] (None turns it off)",
            );
        }
    }
    if s.top_k == Some(0) {
        return bad(
            fields[2],
            "0".into(),
            "must be at least 1 (None turns it off)",
        );
    }
    Ok(())
}

impl ScoringSpec {
    /// Checks the decoding and retry settings (called by [`Session::open`]).
    pub fn validate(&self) -> Result<()> {
        if self.decoding.max_new_tokens == 0 {
            return Err(RunError::BadSetting {
                field: "decoding.max_new_tokens",
                value: "0".into(),
                problem: "leaves no room for a reply; use the prompt set's max_new_tokens (128 for `Score: X`, 512 for VIEScore)",
            });
        }
        if let Some(s) = &self.decoding.sampling {
            check_sampling(
                s,
                [
                    "decoding.sampling.temperature",
                    "decoding.sampling.top_p",
                    "decoding.sampling.top_k",
                ],
            )?;
        }
        if let Some(s) = &self.retry {
            check_sampling(s, ["retry.temperature", "retry.top_p", "retry.top_k"])?;
        }
        if let Some(n) = self.prompts.max_new_tokens {
            if self.decoding.max_new_tokens < n {
                tracing::warn!(
                    "decoding.max_new_tokens = {} is below the {} the prompt set {} was written for; replies may be cut off and fail to parse",
                    self.decoding.max_new_tokens,
                    n,
                    self.prompts.name
                );
            }
        }
        Ok(())
    }

    /// The manifest of an output directory of this configuration.
    pub fn manifest(&self) -> Manifest {
        Manifest::new(JOB)
            .with("prompt_set", self.prompts.id())
            .with("scheme", self.prompts.scheme)
            .with("model_id", &self.model_id)
            .with("decoding", self.decoding)
            .with("retry", self.retry)
            .with("resize_edited_to_source", self.resize_edited_to_source)
            .with("image_backend", self.image_backend.as_str())
    }
}

/// Files a scoring run owns in its output directory (removed by `overwrite`).
pub const OUTPUT_FILES: &[&str] = &[
    RECORDS_FILE,
    SCORES_FILE,
    RUN_FILE,
    crate::report::REPORT_JSON,
    crate::report::REPORT_MD,
    crate::report::CHART_PNG,
    crate::report::CHART_SVG,
];

/// How [`Session::open`] opens the output directory.
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    /// Remove the directory's earlier records and start over (`--overwrite`).
    pub overwrite: bool,
    /// Values kept in the manifest for reference, never compared (benchmark path, commit).
    pub about: BTreeMap<String, Value>,
}

/// How [`Session::run`] runs.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Requests per judge call.
    pub batch_size: usize,
    /// Draw progress bars (per judge and a total with ETA, on a terminal).
    pub progress: bool,
    /// Names of the judges for logs and bars (`GPU 0`, ...); default `judge 0`, `judge 1`, ...
    pub worker_names: Option<Vec<String>>,
    /// A judge that fails a batch stops taking batches. Default: yes when there are several
    /// judges (the others take its work), no with one (it keeps going with the next batch).
    pub stop_failed_judge: Option<bool>,
    /// Judge again the calls recorded as failed by an earlier run (`--retry-failed`); without
    /// it they are left as recorded.
    pub retry_failed: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            batch_size: 4,
            progress: true,
            worker_names: None,
            stop_failed_judge: None,
            retry_failed: false,
        }
    }
}

/// One call to make: an item and one of the prompt set's calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// The call's global index (item index in the whole benchmark x calls + call).
    pub index: u64,
    /// The item's index in the benchmark.
    pub item: usize,
    /// The call's position in the prompt set.
    pub call: usize,
    /// The record key.
    pub key: String,
    /// The system text.
    pub system: Option<String>,
    /// The user text.
    pub user: String,
}

/// This shard's calls with their keys ([`Session::plan`]).
#[derive(Debug)]
pub struct Plan<'a> {
    items: &'a [Item],
    /// The benchmark's skipped items per kind.
    pub skipped: BTreeMap<String, usize>,
    /// The shard.
    pub shard: ShardSpec,
    /// This shard's items (indices into the benchmark).
    pub range: Range<usize>,
    /// Every call of this shard's items, in index order.
    pub tasks: Vec<Task>,
    /// sha256 of (source, edited) bytes per item of the range.
    digests: Vec<(String, String)>,
}

impl Plan<'_> {
    /// Tasks to judge: those whose key has no record in `store`, and with `retry_failed` those
    /// recorded as judge failures ([`RecordStore::is_done`]).
    pub fn pending(&self, store: &RecordStore, retry_failed: bool) -> Vec<usize> {
        (0..self.tasks.len())
            .filter(|&t| !store.is_done(&self.tasks[t].key, retry_failed))
            .collect()
    }
}

/// An open output directory: its lock, manifest and records.
#[derive(Debug)]
pub struct Session {
    run_dir: RunDir,
    store: RecordStore,
    spec: ScoringSpec,
    /// What was in the records file when it was opened.
    pub opened: OpenReport,
}

fn image_bytes(r: &ImageRef) -> std::io::Result<std::borrow::Cow<'_, [u8]>> {
    match r {
        ImageRef::Path(p) => std::fs::read(p).map(std::borrow::Cow::Owned),
        ImageRef::Bytes(b) => Ok(std::borrow::Cow::Borrowed(b.as_slice())),
    }
}

fn location(r: &ImageRef) -> String {
    match r {
        ImageRef::Path(p) => p.display().to_string(),
        ImageRef::Bytes(_) => "(inline base64)".to_string(),
    }
}

impl Session {
    /// Opens `dir` for `spec` (see the module docs).
    pub fn open(dir: &Path, spec: ScoringSpec, options: &SessionOptions) -> Result<Session> {
        spec.validate()?;
        let mut manifest = spec.manifest();
        for (k, v) in &options.about {
            manifest = manifest.note(k, v);
        }
        let run_dir = RunDir::open(
            dir,
            &manifest,
            &RunDirOptions::new(OUTPUT_FILES, options.overwrite),
        )?;
        let (store, opened) = RecordStore::open(&run_dir.join(RECORDS_FILE))?;
        if let Some(p) = &opened.problems {
            tracing::warn!("{p}");
        }
        Ok(Session {
            run_dir,
            store,
            spec,
            opened,
        })
    }

    /// How the directory was found (new, resumed, overwritten).
    pub fn state(&self) -> &RunDirState {
        &self.run_dir.state
    }

    /// The output directory.
    pub fn dir(&self) -> &Path {
        self.run_dir.path()
    }

    /// The records.
    pub fn store(&self) -> &RecordStore {
        &self.store
    }

    /// The configuration.
    pub fn spec(&self) -> &ScoringSpec {
        &self.spec
    }

    /// The calls of `shard`'s items of `loaded`, with their keys (see the module docs).
    pub fn plan<'a>(&self, loaded: &'a Loaded, shard: ShardSpec) -> Result<Plan<'a>> {
        let range = shard.select(loaded.items.len());
        let items = &loaded.items[range.clone()];
        let prompts = &self.spec.prompts;
        prompts.check_items(items)?;
        let n_calls = prompts.calls.len() as u64;
        let mut tasks = Vec::with_capacity(items.len() * prompts.calls.len());
        let mut digests = Vec::with_capacity(items.len());
        for (offset, item) in items.iter().enumerate() {
            let gi = range.start + offset;
            let digest = |r: &ImageRef, role: &'static str| {
                image_bytes(r)
                    .map(|b| sha256_hex(&b))
                    .map_err(|source| RunError::ImageRead {
                        id: item.id.clone(),
                        role,
                        location: location(r),
                        source,
                    })
            };
            let src = digest(&item.source, "source")?;
            let edt = digest(&item.edited, "edited")?;
            for (ci, call) in prompts.calls.iter().enumerate() {
                let (system, user) = prompts.render(call, item)?;
                let mut prompt = Vec::new();
                if let Some(s) = &system {
                    prompt.extend_from_slice(s.as_bytes());
                }
                prompt.push(0);
                prompt.extend_from_slice(user.as_bytes());
                let key = record_key(&KeyParts {
                    pair_id: &item.id,
                    source_sha256: &src,
                    edited_sha256: &edt,
                    resize_edited_to_source: self.spec.resize_edited_to_source,
                    image_backend: self.spec.image_backend.as_str(),
                    prompt_set_hash: prompts.hash(),
                    prompt_sha256: &sha256_hex(&prompt),
                    call: &call.name,
                    model_id: &self.spec.model_id,
                    decoding: &self.spec.decoding,
                    retry: self.spec.retry.as_ref(),
                });
                tasks.push(Task {
                    index: gi as u64 * n_calls + ci as u64,
                    item: gi,
                    call: ci,
                    key,
                    system,
                    user,
                });
            }
            digests.push((src, edt));
        }
        let skipped = loaded
            .skip_counts()
            .into_iter()
            .map(|(k, n)| (k.to_string(), n))
            .collect();
        Ok(Plan {
            items: &loaded.items,
            skipped,
            shard,
            range,
            tasks,
            digests,
        })
    }

    /// Judges the plan's calls that have no record, with one worker per judge sharing the
    /// queue; writes `scores.jsonl` and `run.json`; returns the run's summary. When every
    /// call is recorded already no judge is needed (`judges` may be empty: a finished run
    /// rewrites its summary without loading a model).
    pub fn run<J: Judge + Send>(
        &self,
        judges: Vec<J>,
        plan: &Plan<'_>,
        options: &RunOptions,
    ) -> Result<RunInfo> {
        let retry_failed = options.retry_failed;
        if judges.is_empty() && !plan.pending(&self.store, retry_failed).is_empty() {
            return Err(RunError::NoJudges);
        }
        if options.batch_size == 0 {
            return Err(RunError::ZeroBatch);
        }
        for (i, j) in judges.iter().enumerate() {
            let found = j.model_id();
            if found != self.spec.model_id {
                return Err(RunError::ModelMismatch {
                    judge: i,
                    found,
                    expected: self.spec.model_id.clone(),
                });
            }
        }
        let names: Vec<String> = match &options.worker_names {
            Some(n) if n.len() != judges.len() => {
                return Err(RunError::WorkerNames {
                    names: n.len(),
                    judges: judges.len(),
                })
            }
            Some(n) => n.clone(),
            None => (0..judges.len()).map(|i| format!("judge {i}")).collect(),
        };
        let pending = plan.pending(&self.store, retry_failed);
        let resumed = plan.tasks.len() - pending.len();
        tracing::info!(
            calls = plan.tasks.len(),
            resumed,
            to_judge = pending.len(),
            shard = %plan.shard,
            "edit-score run"
        );
        let batches: Vec<Vec<usize>> = pending
            .chunks(options.batch_size)
            .map(<[usize]>::to_vec)
            .collect();
        let ctx = RunCtx {
            spec: &self.spec,
            plan,
            store: &self.store,
            retry_failed,
        };
        let n_judges = judges.len();
        let workers: Vec<JudgeWorker<'_, J>> = judges
            .into_iter()
            .zip(names)
            .map(|(judge, name)| JudgeWorker {
                name,
                judge,
                ctx: &ctx,
            })
            .collect();
        let pool_options = PoolOptions {
            progress: options.progress,
            stop_worker_on_error: options.stop_failed_judge.unwrap_or(n_judges > 1),
            max_attempts: None,
            label: format!("batches of up to {} calls", options.batch_size),
        };
        let started = Instant::now();
        let output = ReplicaPool::run(workers, batches.clone(), &pool_options)?;

        let mut failed: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for (batch, result) in batches.iter().zip(output.results) {
            match result {
                ItemResult::Done { output, .. } => {
                    for (t, e) in output.errors {
                        failed.entry(t).or_default().push(e);
                    }
                }
                ItemResult::Failed { errors } => {
                    for &t in batch {
                        if !self.store.is_done(&plan.tasks[t].key, retry_failed) {
                            failed
                                .entry(t)
                                .or_default()
                                .extend(errors.iter().map(|e| e.to_string()));
                        }
                    }
                }
            }
        }
        // Counted from the store, not from the batches' outputs: a batch that failed part-way
        // (and went to another judge) has records too.
        let (mut judged, mut parse_failed, mut retried) = (0, 0, 0);
        for &t in &pending {
            if let Some(r) = self
                .store
                .get(&plan.tasks[t].key)
                .filter(|r| !r.judge_failed())
            {
                judged += 1;
                parse_failed += usize::from(!r.parsed());
                retried += usize::from(r.retry.is_some());
            }
        }
        let workers = output
            .report
            .workers
            .iter()
            .map(|w| WorkerInfo {
                name: w.name.clone(),
                batches_done: w.items_done,
                batches_failed: w.items_failed,
                stopped: w.stopped.clone(),
                busy_s: w.busy.as_secs_f64(),
            })
            .collect();
        let failed_calls: Vec<FailedCall> = failed
            .into_iter()
            .filter(|(t, _)| !self.store.is_judged(&plan.tasks[*t].key))
            .map(|(t, errors)| {
                let task = &plan.tasks[t];
                FailedCall {
                    index: task.index,
                    id: plan.items[task.item].id.clone(),
                    call: self.spec.prompts.calls[task.call].name.clone(),
                    errors,
                }
            })
            .collect();
        // Each failure is recorded, so that a rerun does not judge it again unless asked.
        for f in &failed_calls {
            let task = plan
                .tasks
                .iter()
                .find(|t| t.index == f.index)
                .expect("a failed call is one of the plan's tasks");
            self.store
                .append(self.failed_record(plan, task, f.errors.join(" | ")))?;
        }
        let info = self.finish(
            plan,
            Counts {
                resumed,
                judged,
                parse_failed,
                retried,
                failed: failed_calls,
                workers,
                elapsed_s: started.elapsed().as_secs_f64(),
            },
        )?;
        Ok(info)
    }

    /// The record of a call the judge failed on: no reply, no score, the errors.
    fn failed_record(&self, plan: &Plan<'_>, task: &Task, errors: String) -> Record {
        let item = &plan.items[task.item];
        Record {
            index: task.index,
            key: task.key.clone(),
            id: item.id.clone(),
            category: item.category.clone(),
            call: self.spec.prompts.calls[task.call].name.clone(),
            scores: None,
            score: None,
            parse_failed: None,
            raw: String::new(),
            new_tokens: 0,
            stopped_at_eos: false,
            retry: None,
            decoding: self.spec.decoding,
            model_id: self.spec.model_id.clone(),
            prompt_set: self.spec.prompts.id(),
            timing: Timing {
                batch_ms: 0.0,
                batch_size: 0,
                retry_ms: None,
                worker: String::new(),
                unix_time: unix_now(),
            },
            failed: Some(errors),
        }
    }

    /// Writes `scores.jsonl` (this plan's records by index) and `run.json`.
    fn finish(&self, plan: &Plan<'_>, counts: Counts) -> Result<RunInfo> {
        let mut lines = Vec::new();
        let mut recorded = 0;
        for task in &plan.tasks {
            if let Some(mut rec) = self.store.get(&task.key) {
                let item = &plan.items[task.item];
                // The plan's position and names: the benchmark may have been reordered since.
                rec.index = task.index;
                rec.id = item.id.clone();
                rec.category = item.category.clone();
                let line = serde_json::to_vec(&rec).map_err(|source| RunsError::Json {
                    what: format!("a record for {}", SCORES_FILE),
                    source,
                })?;
                lines.extend_from_slice(&line);
                lines.push(b'\n');
                recorded += 1;
            }
        }
        fleet_runs::write_atomic(&self.run_dir.join(SCORES_FILE), &lines)?;
        let prompts = &self.spec.prompts;
        let mut items_by_category: BTreeMap<String, usize> = BTreeMap::new();
        for item in &plan.items[plan.range.clone()] {
            *items_by_category.entry(item.category.clone()).or_insert(0) += 1;
        }
        let category_labels = items_by_category
            .keys()
            .map(|c| (c.clone(), prompts.category_label(c)))
            .collect();
        let chart_labels = items_by_category
            .keys()
            .map(|c| (c.clone(), prompts.chart_label(c)))
            .collect();
        let info = RunInfo {
            shard: plan.shard,
            prompt_set: prompts.id(),
            scheme: prompts.scheme,
            calls: prompts.calls.iter().map(|c| c.name.clone()).collect(),
            model_id: self.spec.model_id.clone(),
            decoding: self.spec.decoding,
            retry: self.spec.retry,
            resize_edited_to_source: self.spec.resize_edited_to_source,
            image_backend: Some(self.spec.image_backend.as_str().to_string()),
            benchmark_items: plan.items.len(),
            items: plan.range.len(),
            items_by_category,
            category_labels,
            chart_labels,
            skipped: plan.skipped.clone(),
            calls_total: plan.tasks.len(),
            calls_recorded: recorded,
            calls_resumed: counts.resumed,
            calls_judged: counts.judged,
            parse_failed_now: counts.parse_failed,
            retried_now: counts.retried,
            failed: counts.failed,
            workers: counts.workers,
            elapsed_s: counts.elapsed_s,
        };
        fleet_runs::write_json_atomic(&self.run_dir.join(RUN_FILE), &info)?;
        Ok(info)
    }
}

struct Counts {
    resumed: usize,
    judged: usize,
    parse_failed: usize,
    retried: usize,
    failed: Vec<FailedCall>,
    workers: Vec<WorkerInfo>,
    elapsed_s: f64,
}

/// What the workers share.
struct RunCtx<'a> {
    spec: &'a ScoringSpec,
    plan: &'a Plan<'a>,
    store: &'a RecordStore,
    retry_failed: bool,
}

/// Seconds since the Unix epoch.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Appends a record; a failed write ends the whole run ([`StopRun`]): every further call would
/// be judged and lost (a full disk).
fn append(store: &RecordStore, record: Record) -> std::result::Result<(), fleet_dist::BoxError> {
    store.append(record).map_err(|e| StopRun::new(e).into())
}

/// What one batch came to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchOutcome {
    /// Records appended.
    pub recorded: usize,
    /// Of those, replies that did not parse (after any retry).
    pub parse_failed: usize,
    /// Calls retried.
    pub retried: usize,
    /// Calls left without a record: (task, `[worker] message`).
    pub errors: Vec<(usize, String)>,
}

/// A judge as a [`fleet_dist::Worker`]: processes one batch of tasks (see the module docs).
pub struct JudgeWorker<'a, J> {
    name: String,
    judge: J,
    ctx: &'a RunCtx<'a>,
}

type Images = (Arc<DynamicImage>, Arc<DynamicImage>);

impl RunCtx<'_> {
    /// Loads an item's two images, checked against the planned digests.
    fn load_pair(&self, item: usize) -> std::result::Result<Images, String> {
        let plan = self.plan;
        let it = &plan.items[item];
        let (src_sha, edt_sha) = &plan.digests[item - plan.range.start];
        let load = |r: &ImageRef, sha: &str, role: &str| {
            let bytes = image_bytes(r)
                .map_err(|e| format!("cannot read the {role} image {}: {e}", location(r)))?;
            if sha256_hex(&bytes) != sha {
                return Err(format!(
                    "the {role} image {} changed since the run was planned; run again to score the new one",
                    location(r)
                ));
            }
            image::load_from_memory(&bytes)
                .map_err(|e| format!("the {role} image {} does not decode: {e}", location(r)))
        };
        let source = load(&it.source, src_sha, "source")?;
        let mut edited = load(&it.edited, edt_sha, "edited")?;
        if self.spec.resize_edited_to_source {
            edited = resize_to_source(&edited, &source);
        }
        Ok((Arc::new(source), Arc::new(edited)))
    }
}

impl<J> JudgeWorker<'_, J> {
    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        task: &Task,
        reply: &JudgeReply,
        parsed: std::result::Result<Vec<f64>, ParseFailed>,
        retry: Option<RetryInfo>,
        batch_ms: f64,
        batch_size: usize,
        retry_ms: Option<f64>,
    ) -> Record {
        let ctx = self.ctx;
        let call = &ctx.spec.prompts.calls[task.call];
        let item = &ctx.plan.items[task.item];
        let (scores, score, parse_failed) = match parsed {
            Ok(scores) => {
                let min = scores.iter().copied().fold(f64::INFINITY, f64::min);
                (Some(scores), Some(min), None)
            }
            Err(pf) => {
                let mut reason = pf.reason;
                if !reply.stopped_at_eos {
                    reason.push_str(&format!(
                        " (the reply was cut at max_new_tokens={}: raise it)",
                        ctx.spec.decoding.max_new_tokens
                    ));
                }
                (None, None, Some(reason))
            }
        };
        Record {
            index: task.index,
            key: task.key.clone(),
            id: item.id.clone(),
            category: item.category.clone(),
            call: call.name.clone(),
            scores,
            score,
            parse_failed,
            raw: reply.text.clone(),
            new_tokens: reply.new_tokens,
            stopped_at_eos: reply.stopped_at_eos,
            retry,
            decoding: ctx.spec.decoding,
            model_id: ctx.spec.model_id.clone(),
            prompt_set: ctx.spec.prompts.id(),
            timing: Timing {
                batch_ms,
                batch_size,
                retry_ms,
                worker: self.name.clone(),
                unix_time: unix_now(),
            },
            failed: None,
        }
    }
}

fn all_failed(replies: &[std::result::Result<JudgeReply, String>]) -> Option<String> {
    if !replies.is_empty() && replies.iter().all(|r| r.is_err()) {
        let first = replies
            .iter()
            .find_map(|r| r.as_ref().err().cloned())
            .unwrap_or_default();
        Some(first)
    } else {
        None
    }
}

impl<J: Judge + Send> Worker<Vec<usize>, BatchOutcome> for JudgeWorker<'_, J> {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn process(&mut self, batch: &Vec<usize>) -> Result<BatchOutcome, fleet_dist::BoxError> {
        let ctx = self.ctx;
        let spec = ctx.spec;
        let mut outcome = BatchOutcome::default();
        // Recorded already: by an earlier attempt at this batch that failed part-way.
        let todo: Vec<usize> = batch
            .iter()
            .copied()
            .filter(|&t| !ctx.store.is_done(&ctx.plan.tasks[t].key, ctx.retry_failed))
            .collect();
        // Each item's pair once, the items in parallel: reading, hashing and decoding a pair of
        // 1024 px images takes tens of milliseconds of one core, and a batch holds dozens, all
        // before the GPU has any of the batch's work.
        let mut items: Vec<usize> = todo.iter().map(|&t| ctx.plan.tasks[t].item).collect();
        items.sort_unstable();
        items.dedup();
        let images: HashMap<usize, std::result::Result<Images, String>> = {
            use rayon::prelude::*;
            items
                .par_iter()
                .map(|&item| (item, ctx.load_pair(item)))
                .collect()
        };
        let mut requests = Vec::new();
        let mut request_tasks = Vec::new();
        for &t in &todo {
            let task = &ctx.plan.tasks[t];
            let (source, edited) = match &images[&task.item] {
                Ok(p) => p.clone(),
                Err(e) => {
                    outcome.errors.push((t, format!("[{}] {e}", self.name)));
                    continue;
                }
            };
            let call = &spec.prompts.calls[task.call];
            let mut user: Vec<Part> = call
                .images
                .iter()
                .map(|role| match role {
                    ImageRole::Source => Part::Image(source.clone()),
                    ImageRole::Edited => Part::Image(edited.clone()),
                })
                .collect();
            user.push(Part::Text(task.user.clone()));
            requests.push(JudgeRequest {
                system: task.system.clone(),
                user,
            });
            request_tasks.push(t);
        }
        drop(images);
        if requests.is_empty() {
            return Ok(outcome);
        }
        let t0 = Instant::now();
        let replies = self.judge.judge(&requests, &spec.decoding);
        let batch_ms = t0.elapsed().as_secs_f64() * 1e3;
        if replies.len() != requests.len() {
            return Err(format!(
                "the judge returned {} replies for {} requests",
                replies.len(),
                requests.len()
            )
            .into());
        }
        if let Some(first) = all_failed(&replies) {
            return Err(format!(
                "the judge failed on all {} requests: {first}",
                requests.len()
            )
            .into());
        }
        let mut retry_requests = Vec::new();
        let mut retry_meta = Vec::new();
        for (i, reply) in replies.into_iter().enumerate() {
            let t = request_tasks[i];
            let task = &ctx.plan.tasks[t];
            let call = &spec.prompts.calls[task.call];
            match reply {
                Err(e) => outcome.errors.push((t, format!("[{}] {e}", self.name))),
                Ok(reply) => match parse_reply(&reply.text, &call.format) {
                    Err(pf) if spec.retry.is_some() => {
                        retry_requests.push(requests[i].clone());
                        retry_meta.push((t, reply, pf));
                    }
                    parsed => {
                        let failed = parsed.is_err();
                        let rec =
                            self.record(task, &reply, parsed, None, batch_ms, requests.len(), None);
                        append(ctx.store, rec)?;
                        outcome.recorded += 1;
                        outcome.parse_failed += usize::from(failed);
                    }
                },
            }
        }
        let Some(retry) = spec.retry else {
            return Ok(outcome);
        };
        if retry_requests.is_empty() {
            return Ok(outcome);
        }
        let decoding = Decoding {
            max_new_tokens: spec.decoding.max_new_tokens,
            sampling: Some(retry),
        };
        let t1 = Instant::now();
        let replies = self.judge.judge(&retry_requests, &decoding);
        let retry_ms = t1.elapsed().as_secs_f64() * 1e3;
        if replies.len() != retry_requests.len() {
            return Err(format!(
                "the judge returned {} replies for {} retry requests",
                replies.len(),
                retry_requests.len()
            )
            .into());
        }
        if let Some(first) = all_failed(&replies) {
            return Err(format!(
                "the judge failed on all {} retry requests: {first}",
                retry_requests.len()
            )
            .into());
        }
        for ((t, first, first_pf), reply) in retry_meta.into_iter().zip(replies) {
            let task = &ctx.plan.tasks[t];
            let call = &spec.prompts.calls[task.call];
            match reply {
                Err(e) => outcome
                    .errors
                    .push((t, format!("[{}] retry: {e}", self.name))),
                Ok(reply) => {
                    let parsed = parse_reply(&reply.text, &call.format);
                    let failed = parsed.is_err();
                    let info = RetryInfo {
                        sampling: retry,
                        first: FirstAttempt {
                            raw: first.text,
                            reason: first_pf.reason,
                            new_tokens: first.new_tokens,
                            stopped_at_eos: first.stopped_at_eos,
                        },
                    };
                    let rec = self.record(
                        task,
                        &reply,
                        parsed,
                        Some(info),
                        batch_ms,
                        requests.len(),
                        Some(retry_ms),
                    );
                    append(ctx.store, rec)?;
                    outcome.recorded += 1;
                    outcome.retried += 1;
                    outcome.parse_failed += usize::from(failed);
                }
            }
        }
        Ok(outcome)
    }
}
