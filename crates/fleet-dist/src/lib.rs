//! Execution across devices and processes for fleet.
//!
//! This crate sits between `fleet-topology` (facts and plans) and `fleet-models` (model code) and
//! never imports model code. It holds:
//!
//! - [`ReplicaPool`] — one OS thread per [`Worker`] (one replica per GPU), a shared work queue
//!   (faster workers take more items), results in input order, failed items retried on other
//!   workers and never replaced by a default value, per-worker progress bars.
//! - [`ShardSpec`] — which part of a job this process runs: from `--num-shards/--shard-index`,
//!   SLURM (`SLURM_PROCID`/`SLURM_NTASKS`) or torchrun (`RANK`/`WORLD_SIZE`).
//! - [`merge_jsonl`] — merges the per-shard JSONL record files into one file sorted by `index`.
//! - [`RunDir`] — a long run's output directory: one writer at a time (an OS file lock) and a
//!   [`Manifest`] of what determines its records, so a resume with another model or other
//!   settings is refused with the fields that differ.
//! - [`JsonlLog`] — append-only per-item records (and caches) whose torn last line, left by a
//!   kill, is repaired before the next append.
//! - [`write_atomic`] / [`write_json_atomic`] — summaries, reports and checkpoints written whole
//!   or not at all; [`files_digest`] — content digests of weights and data for manifests.

#![warn(missing_docs)]

mod atomic;
mod digest;
mod jsonl;
mod merge;
mod pool;
mod run_dir;
mod shard;

use std::path::PathBuf;

pub use atomic::{write_atomic, write_json_atomic};
pub use digest::{bytes_digest, files_digest, Fnv64};
pub use jsonl::{BadLine, JsonlContents, JsonlLog, TailRepair};
pub use merge::{
    merge_jsonl, Duplicate, InputStats, MalformedLine, MergeReport, MAX_LISTED_MISSING,
};
pub use pool::{
    BoxError, FailureRecord, ItemError, ItemResult, PoolOptions, PoolOutput, PoolReport,
    ReplicaPool, Worker, WorkerReport,
};
pub use run_dir::{
    commit_id, FieldDiff, Manifest, RunDir, RunDirOptions, RunDirState, LOCK_FILE, MANIFEST_FILE,
};
pub use shard::{ShardSource, ShardSpec};

/// Errors of this crate. Each message names the value at fault and what to change.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The pool was given items but no worker to run them.
    #[error("the replica pool got {items} items but no workers: pass at least one worker (one per GPU or replica)")]
    NoWorkers {
        /// Number of items that would have run.
        items: usize,
    },
    /// `PoolOptions::max_attempts` was zero.
    #[error("max_attempts = 0 would never run an item: use at least 1, or None for one attempt per worker")]
    ZeroAttempts,
    /// A shard count of zero.
    #[error("{source_name} gives a shard count of 0: the number of shards must be at least 1")]
    ZeroShards {
        /// Where the count came from (`--num-shards`, `SLURM_NTASKS`, `WORLD_SIZE`).
        source_name: String,
    },
    /// A shard index not below the shard count.
    #[error("shard index {index} (from {source_name}) is out of range for {count} shards: use an index in 0..{count}")]
    ShardIndexOutOfRange {
        /// The index as given.
        index: usize,
        /// The shard count.
        count: usize,
        /// Where the values came from.
        source_name: String,
    },
    /// One value of a pair was given without the other.
    #[error("{given} is set but {missing} is not: set both, or neither")]
    IncompletePair {
        /// The flag or variable that was given.
        given: String,
        /// The flag or variable that is missing.
        missing: String,
    },
    /// An environment variable that must hold a non-negative integer does not.
    #[error("environment variable {var}=`{value}` is not a non-negative integer: fix or unset it")]
    BadEnvNumber {
        /// Variable name.
        var: String,
        /// Its value.
        value: String,
    },
    /// An input file of a merge could not be read.
    #[error(
        "cannot read shard records `{path}`: {source}; check the path and that the shard finished"
    )]
    ReadInput {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An output file (merged records, a summary, a manifest) could not be written.
    #[error("cannot write `{path}`: {source}; check that its directory exists and is writable")]
    WriteOutput {
        /// The file (or its temporary sibling).
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file or directory could not be read or written.
    #[error("cannot {action} `{path}`: {source}")]
    Io {
        /// What was being done (`read`, `append to`, `lock`, ...).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A value could not be serialized.
    #[error("cannot serialize {what}: {source}")]
    Json {
        /// What was being written.
        what: String,
        /// The cause.
        source: serde_json::Error,
    },
    /// Another process holds the output directory.
    #[error("another run is writing to `{dir}` ({holder}): wait for it to finish, or give this run another output directory")]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// Who holds it, as the holder wrote it in the lock file.
        holder: String,
    },
    /// The directory's records were made by another model or other settings.
    #[error("`{manifest}` says the records there were made differently: {}; {ways_out}", diffs.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("; "))]
    ManifestMismatch {
        /// The manifest file.
        manifest: PathBuf,
        /// The fields that differ.
        diffs: Vec<FieldDiff>,
        /// What the user can do (the job's flags).
        ways_out: String,
    },
    /// Records without a manifest: nothing says what made them.
    #[error("`{dir}` holds {} but no manifest.json (written by an older fleet, or by hand), so nothing says which model and settings made them; {ways_out}", files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "))]
    NoManifest {
        /// The directory.
        dir: PathBuf,
        /// The job's files found there.
        files: Vec<PathBuf>,
        /// What the user can do (the job's flags).
        ways_out: String,
    },
    /// A manifest that does not parse.
    #[error("manifest `{path}` does not parse ({message}): restore it, or start over with the job's overwrite flag")]
    BadManifest {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The output path has no file name (e.g. `/` or `..`).
    #[error("output path `{path}` names no file: give a file path such as `results/merged.jsonl`")]
    OutputNotAFile {
        /// The path as given.
        path: PathBuf,
    },
}

impl DistError {
    /// An I/O error while doing `action` on `path`.
    pub fn io(action: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        DistError::Io {
            action,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Result type of this crate.
pub type Result<T, E = DistError> = std::result::Result<T, E>;
