//! A run's output for fleet: what a job writes, and how it resumes after a kill.
//!
//! This crate sits above `fleet-topology` (a manifest says when the run is on logical devices)
//! and `fleet-data` (digests), below every job. It knows nothing of processes, ranks, models or
//! tensors: where the work runs is `fleet-dist`'s. It holds:
//!
//! - [`RunDir`] — a long run's output directory: one writer at a time (an OS file lock) and a
//!   [`Manifest`] of what determines its records, so a resume with another model or other
//!   settings is refused with the fields that differ. [`commit_id`] / [`fleet_version`]: the
//!   build a manifest names, registered by the binary ([`set_build`]).
//! - [`JsonlLog`] — append-only per-item records (and caches) whose torn last line, left by a
//!   kill, is repaired before the next append.
//! - [`merge_jsonl`] — merges the per-shard JSONL record files into one file sorted by `index`.
//! - [`write_atomic`] / [`write_json_atomic`] — summaries, reports and checkpoints written whole
//!   or not at all; [`set_created_permissions`], [`remove_stale_temporaries`].
//! - [`StepError`] — the errors of a job's assembly (a setting that cannot work, a failed
//!   step with what was being done), shared by the job crates; [`step_error_from!`].

#![warn(missing_docs)]

mod atomic;
mod jsonl;
mod merge;
mod run_dir;
mod step_error;

use std::path::PathBuf;

pub use atomic::{
    remove_stale_temporaries, set_created_permissions, write_atomic, write_json_atomic,
};
pub use jsonl::{BadLine, JsonlContents, JsonlLog, TailRepair};
pub use merge::{
    merge_jsonl, Duplicate, InputStats, MalformedLine, MergeReport, MAX_LISTED_MISSING,
};
pub use run_dir::{
    commit_id, fleet_version, set_build, FieldDiff, Manifest, RunDir, RunDirOptions, RunDirState,
    LOCK_FILE, MANIFEST_FILE,
};
pub use step_error::{Cause, StepContext, StepError};

/// Errors of this crate. Each message names the file at fault and what to change.
#[derive(Debug, thiserror::Error)]
pub enum RunsError {
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

impl RunsError {
    /// An I/O error while doing `action` on `path`.
    pub fn io(action: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        RunsError::Io {
            action,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Result type of this crate.
pub type Result<T, E = RunsError> = std::result::Result<T, E>;
