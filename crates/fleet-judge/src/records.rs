//! Results: one append-only JSONL record per (item, prompt call), keyed so that a rerun skips
//! what is done and rescores what changed; the per-run summary; shards merged.
//!
//! An output directory (opened with [`fleet_runs::RunDir`] by [`crate::run::Session`]: one
//! writer at a time, a manifest of what determines the records, `--overwrite` to start over)
//! holds:
//!
//! - [`RECORDS_FILE`] (`records.jsonl`) — every record ever made for this manifest, appended
//!   one line per finished call through [`fleet_runs::JsonlLog`] (a line torn by a kill is
//!   repaired on open, so nothing scored before the kill is lost). [`RecordStore`] reads it and
//!   knows which keys are done.
//! - [`SCORES_FILE`] (`scores.jsonl`) — written atomically at the end of each run: the records
//!   of *this* benchmark's calls (by key), sorted by their global `index`. A record of an image
//!   that has since changed stays in `records.jsonl` but is not in `scores.jsonl`. Shards are
//!   merged from their `scores.jsonl` with [`fleet_runs::merge_jsonl`] ([`merge_shards`]).
//! - [`RUN_FILE`] (`run.json`) — [`RunInfo`]: what ran (prompt set, model, decoding, shard) and
//!   the counts, read by the report and the merge.
//!
//! A record's key ([`record_key`]) is sha256 over: the pair id, the sha256 of the source image's
//! bytes and of the edited image's bytes (as stored: the file, or the decoded base64), whether
//! the edit is resized to the source, the prompt set's hash, the sha256 of the rendered prompt
//! (so an edited instruction or description is rescored), the call, the model id, and the
//! decoding (greedy or sampled with its seed, max_new_tokens, and the retry policy).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use fleet_dist::ShardSpec;
use fleet_runs::{JsonlLog, Manifest, MergeReport, RunsError, TailRepair};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::judge::{Decoding, Sampling};
use crate::prompts::{hex, PromptSetId, Scheme};

/// The records log in an output directory.
pub const RECORDS_FILE: &str = "records.jsonl";
/// The current scores of the run's benchmark, sorted by index.
pub const SCORES_FILE: &str = "scores.jsonl";
/// The run's summary ([`RunInfo`]).
pub const RUN_FILE: &str = "run.json";

/// Errors of the record files and the merge.
#[derive(Debug, thiserror::Error)]
pub enum RecordsError {
    /// A file operation of fleet-runs failed (lock, manifest, append, atomic write).
    #[error(transparent)]
    Runs(#[from] RunsError),
    /// A file could not be read.
    #[error("cannot read {path}: {source}; check that the shard's output directory is complete")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A `run.json` that does not parse.
    #[error("{path} does not parse as a run summary ({message}); rerun that shard (it resumes from its records)")]
    BadRunFile {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A shard directory without a manifest or run summary.
    #[error("{dir} has no {file}: it is not a finished edit-score output directory; finish that shard (rerun it: it resumes) or leave it out")]
    NotAShard {
        /// The directory.
        dir: PathBuf,
        /// The file missing.
        file: &'static str,
    },
    /// Shards made with different settings.
    #[error("shards {first} and {other} were made differently: {diffs}; merge only shards of one run (same prompt set, model, decoding)")]
    ShardMismatch {
        /// The first shard's directory.
        first: PathBuf,
        /// The differing shard's directory.
        other: PathBuf,
        /// The fields that differ.
        diffs: String,
    },
    /// The shard set is not one split of one benchmark.
    #[error("the shards given are not a complete split: {problem}; pass every shard's output directory once")]
    ShardSet {
        /// What is wrong (missing, repeated or inconsistent shards).
        problem: String,
    },
    /// A shard has calls without a record.
    #[error("shard(s) not finished: {list}; rerun them (they resume), or merge with allow_incomplete (the report then counts those items as not scored)")]
    Incomplete {
        /// `dir: N of M calls recorded` per shard.
        list: String,
    },
    /// No shard directories were given.
    #[error("no shard directories to merge: pass the output directory of every shard")]
    NoShards,
}

/// Result of this module.
pub type Result<T, E = RecordsError> = std::result::Result<T, E>;

/// The first attempt of a call whose reply did not parse, kept when the call was retried.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FirstAttempt {
    /// Its reply.
    pub raw: String,
    /// Why it did not parse.
    pub reason: String,
    /// Tokens it generated.
    pub new_tokens: usize,
    /// Whether it ended at an end-of-sequence token.
    pub stopped_at_eos: bool,
}

/// A retry of a parse failure: the retry's sampling (fixed seed) and the first attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetryInfo {
    /// How the retry was decoded (sampled with a fixed seed).
    pub sampling: Sampling,
    /// The attempt that did not parse.
    pub first: FirstAttempt,
}

/// Where the time went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Wall time of the judge call of this record's batch, in milliseconds.
    pub batch_ms: f64,
    /// Requests in that batch.
    pub batch_size: usize,
    /// Wall time of the retry batch, when there was one.
    pub retry_ms: Option<f64>,
    /// Who judged it (the worker's name, e.g. `GPU 0`).
    pub worker: String,
    /// When the record was written (seconds since the Unix epoch).
    pub unix_time: u64,
}

/// One (item, call) judged: the scores, or the parse failure with the raw reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// The call's global position: item index in the whole benchmark times the calls per
    /// item, plus the call's position (what [`fleet_runs::merge_jsonl`] sorts on).
    pub index: u64,
    /// The record key ([`record_key`]).
    pub key: String,
    /// The pair id.
    pub id: String,
    /// The category.
    pub category: String,
    /// The call (`score`, `sc`, `pq`).
    pub call: String,
    /// The parsed scores (one for `Score: X`, the list for VIEScore); `None` when the reply did
    /// not parse.
    pub scores: Option<Vec<f64>>,
    /// The call's value: the score, or the minimum of the list (VIEScore); `None` when the
    /// reply did not parse.
    pub score: Option<f64>,
    /// Why the reply did not parse (`None` when it did). Such a record counts as a parse
    /// failure and never enters a mean.
    pub parse_failed: Option<String>,
    /// The reply (of the retry, when there was one).
    pub raw: String,
    /// Tokens the reply has.
    pub new_tokens: usize,
    /// Whether the reply ended at an end-of-sequence token (`false`: cut at max_new_tokens).
    pub stopped_at_eos: bool,
    /// The retry, when the first reply did not parse and a retry was configured.
    pub retry: Option<RetryInfo>,
    /// The run's decoding (the first attempt's).
    pub decoding: Decoding,
    /// The judge's model id.
    pub model_id: String,
    /// The prompt set.
    pub prompt_set: PromptSetId,
    /// Timings.
    pub timing: Timing,
    /// Why the judge could not judge this call (its errors, in order), when it could not: such
    /// a record has no reply and no score, counts as failed in the report, and is not judged
    /// again by a rerun unless asked (`--retry-failed`). `None` for a judged call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

impl Record {
    /// Whether the reply parsed.
    pub fn parsed(&self) -> bool {
        self.failed.is_none() && self.parse_failed.is_none() && self.score.is_some()
    }

    /// Whether the judge failed on the call (no reply).
    pub fn judge_failed(&self) -> bool {
        self.failed.is_some()
    }
}

/// The sha256 of some bytes, hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// What a record's key is made of.
#[derive(Debug, Clone, Copy)]
pub struct KeyParts<'a> {
    /// The pair id.
    pub pair_id: &'a str,
    /// sha256 (hex) of the source image's bytes.
    pub source_sha256: &'a str,
    /// sha256 (hex) of the edited image's bytes.
    pub edited_sha256: &'a str,
    /// Whether the edit is resized to the source before judging (GEdit-Bench).
    pub resize_edited_to_source: bool,
    /// transformers' image-processor backend the judge's images are prepared with
    /// (`torchvision` or `pillow`: they differ in the last level of some pixels).
    pub image_backend: &'a str,
    /// The prompt set's hash.
    pub prompt_set_hash: &'a str,
    /// sha256 (hex) of the rendered prompt (system and user text, the item's instruction,
    /// description and category filled in), so an edited instruction is rescored too.
    pub prompt_sha256: &'a str,
    /// The call.
    pub call: &'a str,
    /// The judge's model id.
    pub model_id: &'a str,
    /// The decoding.
    pub decoding: &'a Decoding,
    /// The retry policy (`None`: no retry).
    pub retry: Option<&'a Sampling>,
}

/// The key of a record: sha256 (hex) over the length-prefixed [`KeyParts`].
pub fn record_key(parts: &KeyParts<'_>) -> String {
    let decoding = serde_json::to_string(&(parts.decoding, parts.retry)).unwrap_or_default();
    let fields: [&[u8]; 11] = [
        b"fleet-judge record v2",
        parts.pair_id.as_bytes(),
        parts.source_sha256.as_bytes(),
        parts.edited_sha256.as_bytes(),
        if parts.resize_edited_to_source {
            b"resize-edited-to-source"
        } else {
            b"as-is"
        },
        parts.image_backend.as_bytes(),
        parts.prompt_set_hash.as_bytes(),
        parts.prompt_sha256.as_bytes(),
        parts.call.as_bytes(),
        parts.model_id.as_bytes(),
        decoding.as_bytes(),
    ];
    let mut h = Sha256::new();
    for f in fields {
        h.update((f.len() as u64).to_le_bytes());
        h.update(f);
    }
    hex(&h.finalize())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What [`RecordStore::open`] found in the file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpenReport {
    /// Records read.
    pub records: usize,
    /// The repair of a line torn by a kill, if any.
    pub repair: Option<TailRepair>,
    /// Complete lines that did not parse (left in place; their calls run again).
    pub bad_lines: usize,
    /// A one-line account of the problems, for the user; `None` when there were none.
    pub problems: Option<String>,
}

struct StoreInner {
    log: JsonlLog,
    done: HashMap<String, Record>,
}

/// The records log of an output directory: reads what is there, appends new records, and
/// answers which keys are done. Shared by the workers of a pool (`&RecordStore` is enough:
/// appends are serialized inside).
pub struct RecordStore {
    inner: Mutex<StoreInner>,
    path: PathBuf,
}

impl std::fmt::Debug for RecordStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordStore")
            .field("path", &self.path)
            .field("records", &self.len())
            .finish()
    }
}

impl RecordStore {
    /// Opens (or creates) a records file. A torn last line is repaired
    /// ([`fleet_runs::JsonlLog::open`]); the caller must be the only writer (it holds the
    /// output directory's [`fleet_runs::RunDir`]). When a key repeats, the last record wins.
    pub fn open(path: &Path) -> Result<(RecordStore, OpenReport)> {
        let (log, contents) = JsonlLog::open::<Record>(path)?;
        let report = OpenReport {
            records: contents.records.len(),
            repair: contents.repair.clone(),
            bad_lines: contents.bad_lines.len(),
            problems: contents.problems(path),
        };
        let done = contents
            .records
            .into_iter()
            .map(|r| (r.key.clone(), r))
            .collect();
        Ok((
            RecordStore {
                inner: Mutex::new(StoreInner { log, done }),
                path: path.to_path_buf(),
            },
            report,
        ))
    }

    /// Whether a record with this key exists.
    pub fn contains(&self, key: &str) -> bool {
        lock(&self.inner).done.contains_key(key)
    }

    /// Whether the call of this key needs no judging: it has a record, and that record is
    /// not a judge failure to be retried (`retry_failed`).
    pub fn is_done(&self, key: &str, retry_failed: bool) -> bool {
        lock(&self.inner)
            .done
            .get(key)
            .is_some_and(|r| !(retry_failed && r.judge_failed()))
    }

    /// Whether this key has a record with a reply (not a judge failure).
    pub fn is_judged(&self, key: &str) -> bool {
        lock(&self.inner)
            .done
            .get(key)
            .is_some_and(|r| !r.judge_failed())
    }

    /// The record of a key.
    pub fn get(&self, key: &str) -> Option<Record> {
        lock(&self.inner).done.get(key).cloned()
    }

    /// Appends a record (one line, one write) and marks its key done.
    pub fn append(&self, record: Record) -> Result<()> {
        let mut inner = lock(&self.inner);
        inner.log.append(&record)?;
        inner.done.insert(record.key.clone(), record);
        Ok(())
    }

    /// Records known (read or appended), one per key.
    pub fn len(&self) -> usize {
        lock(&self.inner).done.len()
    }

    /// Whether no record is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A call the judge failed on in a run (or whose image could not be read): recorded with its
/// errors as a failed [`Record`], and judged again only with `--retry-failed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedCall {
    /// The call's global index.
    pub index: u64,
    /// The pair id.
    pub id: String,
    /// The call.
    pub call: String,
    /// What happened, in order (`[worker] message`).
    pub errors: Vec<String>,
}

/// One worker (judge replica) of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// Its name.
    pub name: String,
    /// Batches it finished.
    pub batches_done: usize,
    /// Batches it failed.
    pub batches_failed: usize,
    /// Why it stopped early, if it did.
    pub stopped: Option<String>,
    /// Seconds spent judging.
    pub busy_s: f64,
}

/// What ran and how it went: `run.json`, written at the end of every run and by the merge.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// The shard (`single` for a whole run or a merge).
    pub shard: ShardSpec,
    /// The prompt set.
    pub prompt_set: PromptSetId,
    /// Its scheme.
    pub scheme: Scheme,
    /// The calls per item, in order.
    pub calls: Vec<String>,
    /// The judge's model id.
    pub model_id: String,
    /// The decoding.
    pub decoding: Decoding,
    /// The retry policy.
    pub retry: Option<Sampling>,
    /// Whether edits were resized to their source (GEdit-Bench).
    pub resize_edited_to_source: bool,
    /// transformers' image-processor backend the images were prepared with (`None` in
    /// summaries written before fleet recorded it).
    #[serde(default)]
    pub image_backend: Option<String>,
    /// Items in the whole benchmark (all shards).
    pub benchmark_items: usize,
    /// Items of this shard (or of all merged shards).
    pub items: usize,
    /// Those items per category.
    pub items_by_category: BTreeMap<String, usize>,
    /// Display labels per category (from the prompt set), for reports and charts.
    pub category_labels: BTreeMap<String, String>,
    /// ASCII-friendly labels per category for charts (the embedded font has no CJK glyphs).
    pub chart_labels: BTreeMap<String, String>,
    /// Benchmark items skipped at load, per kind (the whole benchmark's).
    pub skipped: BTreeMap<String, usize>,
    /// Calls of these items.
    pub calls_total: usize,
    /// Calls with a record now (in `scores.jsonl`).
    pub calls_recorded: usize,
    /// Calls found done when the run started (resumed).
    pub calls_resumed: usize,
    /// Calls judged in this run.
    pub calls_judged: usize,
    /// Calls of this run whose reply did not parse (after any retry).
    pub parse_failed_now: usize,
    /// Calls of this run that were retried.
    pub retried_now: usize,
    /// Calls without a record after this run.
    pub failed: Vec<FailedCall>,
    /// The judge replicas.
    pub workers: Vec<WorkerInfo>,
    /// Seconds the judging took.
    pub elapsed_s: f64,
}

impl RunInfo {
    /// Whether every call has a record.
    pub fn complete(&self) -> bool {
        self.calls_recorded == self.calls_total
    }

    /// Reads a `run.json`.
    pub fn read(path: &Path) -> Result<RunInfo> {
        let text = std::fs::read_to_string(path).map_err(|source| RecordsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|e| RecordsError::BadRunFile {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }
}

/// Lines of a records file that did not parse: `(1-based line number, reason)`.
pub type BadLines = Vec<(usize, String)>;

/// Reads a `scores.jsonl` (or any records file) without opening it for writing. Lines that do
/// not parse are returned as [`BadLines`].
pub fn read_records(path: &Path) -> Result<(Vec<Record>, BadLines)> {
    let text = std::fs::read_to_string(path).map_err(|source| RecordsError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut records = Vec::new();
    let mut bad = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Record>(line) {
            Ok(r) => records.push(r),
            Err(e) => bad.push((i + 1, e.to_string())),
        }
    }
    Ok((records, bad))
}

/// Options of [`merge_shards`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MergeOptions {
    /// Remove an earlier merge's files in the output directory first.
    pub overwrite: bool,
    /// Merge even when a shard has calls without a record (they count as not scored).
    pub allow_incomplete: bool,
}

/// What [`merge_shards`] did.
#[derive(Debug, Clone)]
pub struct MergeOutcome {
    /// The merged summary (written as `run.json` in the output directory).
    pub info: RunInfo,
    /// fleet-runs' account of the JSONL merge (records, duplicates, gaps).
    pub report: MergeReport,
}

/// The job name in every edit-score manifest.
pub const JOB: &str = "edit-score";

/// Files of a merge in its output directory.
pub const MERGE_FILES: &[&str] = &[
    SCORES_FILE,
    RUN_FILE,
    crate::report::REPORT_JSON,
    crate::report::REPORT_MD,
    crate::report::CHART_PNG,
    crate::report::CHART_SVG,
];

/// Merges the output directories of the shards of one run (`--num-shards N`, each shard
/// `--shard-index i`) into `out`: checks that every shard was made with the same manifest and
/// that the shards are exactly `0..N` of one split, merges their `scores.jsonl` with
/// [`fleet_runs::merge_jsonl`] (sorted by index) and writes the combined `run.json`. `out`
/// is opened as a [`fleet_runs::RunDir`] with the shards' manifest, so a merge is refused
/// in a directory of another run. Build the report from `out` afterwards
/// ([`crate::report::Report::from_dir`]).
pub fn merge_shards(shards: &[PathBuf], out: &Path, options: MergeOptions) -> Result<MergeOutcome> {
    if shards.is_empty() {
        return Err(RecordsError::NoShards);
    }
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    if let Some(d) = shards.iter().find(|d| same(d, out)) {
        return Err(RecordsError::ShardSet {
            problem: format!(
                "the output directory {} is one of the shards; merge into a directory of its own",
                d.display()
            ),
        });
    }
    let mut manifests = Vec::new();
    let mut infos = Vec::new();
    for dir in shards {
        let manifest = Manifest::read(&dir.join(fleet_runs::MANIFEST_FILE))?.ok_or_else(|| {
            RecordsError::NotAShard {
                dir: dir.clone(),
                file: fleet_runs::MANIFEST_FILE,
            }
        })?;
        let run = dir.join(RUN_FILE);
        if !run.is_file() {
            return Err(RecordsError::NotAShard {
                dir: dir.clone(),
                file: RUN_FILE,
            });
        }
        if !dir.join(SCORES_FILE).is_file() {
            return Err(RecordsError::NotAShard {
                dir: dir.clone(),
                file: SCORES_FILE,
            });
        }
        infos.push(RunInfo::read(&run)?);
        manifests.push(manifest);
    }
    for (i, m) in manifests.iter().enumerate().skip(1) {
        let diffs = manifests[0].diff(m);
        if !diffs.is_empty() {
            return Err(RecordsError::ShardMismatch {
                first: shards[0].clone(),
                other: shards[i].clone(),
                diffs: diffs
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
    }
    let count = infos[0].shard.count;
    let mut seen: BTreeMap<usize, &PathBuf> = BTreeMap::new();
    for (info, dir) in infos.iter().zip(shards) {
        if info.shard.count != count {
            return Err(RecordsError::ShardSet {
                problem: format!(
                    "{} is shard {} of {}, {} is shard {} of {}",
                    shards[0].display(),
                    infos[0].shard.index,
                    count,
                    dir.display(),
                    info.shard.index,
                    info.shard.count
                ),
            });
        }
        if info.benchmark_items != infos[0].benchmark_items {
            return Err(RecordsError::ShardSet {
                problem: format!(
                    "{} saw a benchmark of {} items, {} one of {}; run every shard on the same benchmark",
                    shards[0].display(),
                    infos[0].benchmark_items,
                    dir.display(),
                    info.benchmark_items
                ),
            });
        }
        if let Some(prev) = seen.insert(info.shard.index, dir) {
            return Err(RecordsError::ShardSet {
                problem: format!(
                    "{} and {} are both shard {} of {count}",
                    prev.display(),
                    dir.display(),
                    info.shard.index
                ),
            });
        }
    }
    let missing: Vec<String> = (0..count)
        .filter(|i| !seen.contains_key(i))
        .map(|i| i.to_string())
        .collect();
    if !missing.is_empty() {
        return Err(RecordsError::ShardSet {
            problem: format!("shard(s) {} of {count} are missing", missing.join(", ")),
        });
    }
    let incomplete: Vec<String> = infos
        .iter()
        .zip(shards)
        .filter(|(i, _)| !i.complete())
        .map(|(i, d)| {
            format!(
                "{} ({} of {} calls recorded)",
                d.display(),
                i.calls_recorded,
                i.calls_total
            )
        })
        .collect();
    if !incomplete.is_empty() && !options.allow_incomplete {
        return Err(RecordsError::Incomplete {
            list: incomplete.join(", "),
        });
    }

    let manifest = manifests[0].clone().note(
        "merged_from",
        shards
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>(),
    );
    let run_dir = fleet_runs::RunDir::open(
        out,
        &manifest,
        &fleet_runs::RunDirOptions::new(MERGE_FILES, options.overwrite),
    )?;
    let inputs: Vec<PathBuf> = shards.iter().map(|d| d.join(SCORES_FILE)).collect();
    let report = fleet_runs::merge_jsonl(&inputs, &run_dir.join(SCORES_FILE))?;

    let mut info = infos[0].clone();
    info.shard = ShardSpec::single();
    let mut by_cat: BTreeMap<String, usize> = BTreeMap::new();
    let (mut items, mut total, mut resumed, mut judged) = (0, 0, 0, 0);
    let (mut pf, mut retried, mut elapsed) = (0, 0, 0.0f64);
    let mut failed = Vec::new();
    let mut workers = Vec::new();
    for i in &infos {
        items += i.items;
        total += i.calls_total;
        resumed += i.calls_resumed;
        judged += i.calls_judged;
        pf += i.parse_failed_now;
        retried += i.retried_now;
        elapsed = elapsed.max(i.elapsed_s);
        failed.extend(i.failed.iter().cloned());
        for (c, n) in &i.items_by_category {
            *by_cat.entry(c.clone()).or_insert(0) += n;
        }
        for (c, l) in &i.category_labels {
            info.category_labels.insert(c.clone(), l.clone());
        }
        for (c, l) in &i.chart_labels {
            info.chart_labels.insert(c.clone(), l.clone());
        }
        for w in &i.workers {
            let mut w = w.clone();
            w.name = format!("shard {} {}", i.shard.index, w.name);
            workers.push(w);
        }
    }
    info.items = items;
    info.items_by_category = by_cat;
    info.calls_total = total;
    info.calls_recorded = report.records_written;
    info.calls_resumed = resumed;
    info.calls_judged = judged;
    info.parse_failed_now = pf;
    info.retried_now = retried;
    info.failed = failed;
    info.workers = workers;
    info.elapsed_s = elapsed;
    fleet_runs::write_json_atomic(&run_dir.join(RUN_FILE), &info)?;
    Ok(MergeOutcome { info, report })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts<'a>(decoding: &'a Decoding, edited: &'a str) -> KeyParts<'a> {
        KeyParts {
            pair_id: "p1",
            source_sha256: "aa",
            edited_sha256: edited,
            resize_edited_to_source: false,
            image_backend: "torchvision",
            prompt_set_hash: "hh",
            prompt_sha256: "pp",
            call: "score",
            model_id: "m@1",
            decoding,
            retry: None,
        }
    }

    #[test]
    fn the_key_changes_with_every_part() {
        let g = Decoding::greedy(128);
        let base = record_key(&parts(&g, "bb"));
        assert_eq!(base.len(), 64);
        assert_eq!(base, record_key(&parts(&g, "bb")));
        assert_ne!(base, record_key(&parts(&g, "bc")));
        let sampled = Decoding {
            max_new_tokens: 128,
            sampling: Some(Sampling {
                temperature: 0.7,
                top_p: None,
                top_k: None,
                seed: 1,
                sampler_version: fleet_models::ops::SAMPLER_VERSION,
            }),
        };
        let s1 = record_key(&parts(&sampled, "bb"));
        assert_ne!(base, s1);
        let mut seed2 = sampled;
        if let Some(s) = seed2.sampling.as_mut() {
            s.seed = 2;
        }
        assert_ne!(s1, record_key(&parts(&seed2, "bb")));
        let mut p = parts(&g, "bb");
        p.prompt_sha256 = "pq";
        assert_ne!(base, record_key(&p));
        // transformers' Pillow backend differs from torchvision in some pixels: another key.
        let mut p = parts(&g, "bb");
        p.image_backend = "pillow";
        assert_ne!(base, record_key(&p));
        let mut p = parts(&g, "bb");
        p.call = "sc";
        assert_ne!(base, record_key(&p));
        let mut p = parts(&g, "bb");
        p.model_id = "m@2";
        assert_ne!(base, record_key(&p));
        let mut p = parts(&g, "bb");
        p.resize_edited_to_source = true;
        assert_ne!(base, record_key(&p));
        let retry = Sampling {
            temperature: 0.7,
            top_p: None,
            top_k: None,
            seed: 0,
            sampler_version: fleet_models::ops::SAMPLER_VERSION,
        };
        let mut p = parts(&g, "bb");
        p.retry = Some(&retry);
        assert_ne!(base, record_key(&p));
        // Length prefixes: moving a character between fields changes the key.
        let mut a = parts(&g, "bb");
        a.pair_id = "p1a";
        a.source_sha256 = "a";
        assert_ne!(base, record_key(&a));
    }
}
