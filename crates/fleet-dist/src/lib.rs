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

#![warn(missing_docs)]

mod merge;
mod pool;
mod shard;

use std::path::PathBuf;

pub use merge::{
    merge_jsonl, Duplicate, InputStats, MalformedLine, MergeReport, MAX_LISTED_MISSING,
};
pub use pool::{
    BoxError, FailureRecord, ItemError, ItemResult, PoolOptions, PoolOutput, PoolReport,
    ReplicaPool, Worker, WorkerReport,
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
    /// The merged output could not be written.
    #[error("cannot write merged records `{path}`: {source}; check that its directory exists and is writable")]
    WriteOutput {
        /// The file (or its temporary sibling).
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The output path has no file name (e.g. `/` or `..`).
    #[error("output path `{path}` names no file: give a file path such as `results/merged.jsonl`")]
    OutputNotAFile {
        /// The path as given.
        path: PathBuf,
    },
}

/// Result type of this crate.
pub type Result<T, E = DistError> = std::result::Result<T, E>;
