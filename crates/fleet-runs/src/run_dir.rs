//! Output directories of long runs: one writer at a time, and a manifest of what made the
//! records, so a resume never mixes records of another model or other settings.
//!
//! A job opens its output directory with [`RunDir::open`] before writing anything:
//!
//! 1. it takes the directory's lock (an OS file lock on `.fleet-lock`, which holds the
//!    holder's pid): a second run on the same directory stops at once with
//!    [`RunsError::Locked`] instead of appending every record twice. The kernel drops the
//!    lock when the process ends, however it ends, so a killed run never leaves it stale;
//! 2. it compares its [`Manifest`] — every value that determines the records — with the
//!    `manifest.json` already there. Equal: the run resumes. Different: the run is refused
//!    with the fields that differ ([`RunsError::ManifestMismatch`]). A caller that asks to
//!    overwrite starts over either way: the job's own files are removed.
//!    Records without a manifest (an older fleet) are refused the same way.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::atomic::write_json_atomic;
use crate::{Result, RunsError};

/// The name of the manifest inside an output directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The name of the lock file inside an output directory.
pub const LOCK_FILE: &str = ".fleet-lock";

/// What determines the records of an output directory.
///
/// `determines` holds every value that changes a record (model weights digest, dtype, data
/// selection, each setting that changes an answer); a resume with any of them different is
/// refused. `about` holds what people want to read but that must not block a resume (paths as
/// typed, the commit, when the directory was started).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The job writing the directory (`argo-exp real`, `gspo-train`, ...).
    pub job: String,
    /// Values that determine the records, compared on resume.
    pub determines: BTreeMap<String, Value>,
    /// Values kept for reference, never compared.
    #[serde(default)]
    pub about: BTreeMap<String, Value>,
}

/// One field that differs between the manifest on disk and this run's.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldDiff {
    /// Dotted path of the field (`model.weights_digest`).
    pub field: String,
    /// The value in the directory's manifest (`None`: not there).
    pub recorded: Option<Value>,
    /// This run's value (`None`: this run has no such field).
    pub now: Option<Value>,
}

impl std::fmt::Display for FieldDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |v: &Option<Value>| match v {
            Some(v) => v.to_string(),
            None => "(absent)".to_string(),
        };
        write!(
            f,
            "{}: {} recorded, {} now",
            self.field,
            show(&self.recorded),
            show(&self.now)
        )
    }
}

impl Manifest {
    /// A manifest for `job` that determines nothing yet; `about` names the fleet build writing
    /// it (`fleet_version`, `commit`: [`fleet_version`], [`commit_id`]) and, when the process
    /// runs on logical devices ([`fleet_topology::logical`]), says so (`logical_devices`: the
    /// label and the request), so that no record made on them passes for one of real GPUs.
    pub fn new(job: impl Into<String>) -> Self {
        let mut about = BTreeMap::from([
            ("fleet_version".to_string(), Value::String(fleet_version())),
            ("commit".to_string(), Value::String(commit_id())),
        ]);
        if let Some(logical) = fleet_topology::logical::describe() {
            about.insert("logical_devices".to_string(), Value::String(logical));
        }
        Manifest {
            job: job.into(),
            determines: BTreeMap::new(),
            about,
        }
    }

    /// Adds a value that determines the records. Values are stored as JSON (nested objects
    /// compare field by field).
    pub fn with(mut self, key: &str, value: impl Serialize) -> Self {
        self.determines.insert(key.to_string(), to_json(value));
        self
    }

    /// Adds a value kept for reference only (never compared).
    pub fn note(mut self, key: &str, value: impl Serialize) -> Self {
        self.about.insert(key.to_string(), to_json(value));
        self
    }

    /// The fields of `job` and `determines` that differ between `self` (recorded) and `now`,
    /// nested objects flattened to dotted paths.
    pub fn diff(&self, now: &Manifest) -> Vec<FieldDiff> {
        let mut out = Vec::new();
        if self.job != now.job {
            out.push(FieldDiff {
                field: "job".into(),
                recorded: Some(Value::String(self.job.clone())),
                now: Some(Value::String(now.job.clone())),
            });
        }
        let recorded = flatten(&self.determines);
        let current = flatten(&now.determines);
        let keys: std::collections::BTreeSet<&String> =
            recorded.keys().chain(current.keys()).collect();
        for key in keys {
            let (a, b) = (recorded.get(key), current.get(key));
            if a != b {
                out.push(FieldDiff {
                    field: key.clone(),
                    recorded: a.cloned(),
                    now: b.cloned(),
                });
            }
        }
        out
    }

    /// A short digest of `determines` (16 hex digits), e.g. to name a cache by what made it.
    pub fn digest(&self) -> String {
        let text = serde_json::to_string(&(&self.job, &self.determines)).unwrap_or_default();
        let mut d = fleet_data::digest::Fnv64::new();
        d.update(text.as_bytes());
        d.hex()
    }

    /// Reads a manifest file; `Ok(None)` when there is none.
    pub fn read(path: &Path) -> Result<Option<Manifest>> {
        match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| RunsError::BadManifest {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(RunsError::io("read", path, e)),
        }
    }

    /// Writes the manifest atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        write_json_atomic(path, self)
    }

    /// The manifest as it reads back from disk (numbers normalised by a JSON round trip), so
    /// that a freshly built manifest compares equal to its own file.
    fn normalised(&self) -> Manifest {
        serde_json::to_string(self)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_else(|| self.clone())
    }
}

fn to_json(value: impl Serialize) -> Value {
    serde_json::to_value(value).unwrap_or_else(|e| Value::String(format!("<unserializable: {e}>")))
}

fn flatten(map: &BTreeMap<String, Value>) -> BTreeMap<String, Value> {
    fn walk(prefix: &str, value: &Value, out: &mut BTreeMap<String, Value>) {
        match value {
            Value::Object(obj) if !obj.is_empty() => {
                for (k, v) in obj {
                    walk(&format!("{prefix}.{k}"), v, out);
                }
            }
            _ => {
                out.insert(prefix.to_string(), value.clone());
            }
        }
    }
    let mut out = BTreeMap::new();
    for (k, v) in map {
        walk(k, v, &mut out);
    }
    out
}

/// How a job opens its output directory.
#[derive(Debug, Clone)]
pub struct RunDirOptions {
    /// Start over: the job's files are removed (whether or not the manifest differs).
    pub overwrite: bool,
    /// The job's files in the directory, removed on overwrite; any of them present without a
    /// manifest means records of unknown origin.
    pub owned_files: Vec<String>,
    /// The job's flag naming the output directory (`--out`, `--output-dir`), for messages.
    pub dir_flag: String,
    /// The job's flag that starts over (`--overwrite`), for messages.
    pub overwrite_flag: String,
}

impl RunDirOptions {
    /// Options for a job whose files are `owned_files`, with the usual flag names (`--out`,
    /// `--overwrite`).
    pub fn new(owned_files: &[&str], overwrite: bool) -> Self {
        RunDirOptions {
            overwrite,
            owned_files: owned_files.iter().map(|s| s.to_string()).collect(),
            dir_flag: "--out".into(),
            overwrite_flag: "--overwrite".into(),
        }
    }

    /// The same options with the job's output-directory flag named `flag` in messages.
    pub fn with_dir_flag(mut self, flag: &str) -> Self {
        self.dir_flag = flag.to_string();
        self
    }

    fn ways_out(&self) -> String {
        format!(
            "write to another directory ({} DIR), or pass {} to remove this directory's records and start over",
            self.dir_flag, self.overwrite_flag
        )
    }
}

/// How [`RunDir::open`] found the directory.
#[derive(Debug, Clone, PartialEq)]
pub enum RunDirState {
    /// No manifest and no records: a new run.
    New,
    /// The manifest matched: records there are this run's and are resumed.
    Resumed,
    /// The caller asked to overwrite (start over): these files were removed (`diffs` says how
    /// the old manifest differed; empty when it was the same or missing).
    Overwritten {
        /// Files removed.
        removed: Vec<PathBuf>,
        /// How the old manifest differed.
        diffs: Vec<FieldDiff>,
    },
}

/// An output directory held by this process: its lock lives as long as the value.
#[derive(Debug)]
pub struct RunDir {
    dir: PathBuf,
    /// Holds the OS lock; dropping it releases the directory.
    _lock: File,
    /// What was found when opening.
    pub state: RunDirState,
}

impl RunDir {
    /// Opens `dir` for one run described by `manifest` (see the module docs): takes the lock,
    /// then resumes, starts, or — with `options.overwrite` — starts over.
    pub fn open(dir: &Path, manifest: &Manifest, options: &RunDirOptions) -> Result<RunDir> {
        std::fs::create_dir_all(dir).map_err(|e| RunsError::io("create directory", dir, e))?;
        let lock = lock_dir(dir)?;
        let manifest = manifest.normalised();
        let manifest_path = dir.join(MANIFEST_FILE);
        let present: Vec<PathBuf> = options
            .owned_files
            .iter()
            .map(|f| dir.join(f))
            .filter(|p| p.exists())
            .collect();
        let recorded = match Manifest::read(&manifest_path) {
            Ok(m) => m,
            Err(e @ RunsError::BadManifest { .. }) if !options.overwrite => return Err(e),
            Err(RunsError::BadManifest { .. }) => None,
            Err(e) => return Err(e),
        };
        let state = match recorded {
            Some(old) => {
                let diffs = old.diff(&manifest);
                if diffs.is_empty() && !options.overwrite {
                    RunDirState::Resumed
                } else if options.overwrite {
                    remove_files(&present)?;
                    manifest.write(&manifest_path)?;
                    RunDirState::Overwritten {
                        removed: present,
                        diffs,
                    }
                } else {
                    return Err(RunsError::ManifestMismatch {
                        manifest: manifest_path,
                        diffs,
                        ways_out: options.ways_out(),
                    });
                }
            }
            None if present.iter().any(|p| !is_empty_file(p)) && !options.overwrite => {
                return Err(RunsError::NoManifest {
                    dir: dir.to_path_buf(),
                    files: present,
                    ways_out: options.ways_out(),
                });
            }
            None if !present.is_empty() => {
                remove_files(&present)?;
                manifest.write(&manifest_path)?;
                RunDirState::Overwritten {
                    removed: present,
                    diffs: Vec::new(),
                }
            }
            None => {
                manifest.write(&manifest_path)?;
                RunDirState::New
            }
        };
        // Held alone now: what interrupted writes of earlier runs left is nobody's.
        let stale = crate::atomic::remove_stale_temporaries(dir)?;
        if !stale.is_empty() {
            tracing::info!(
                "{}: removed {} temporary file(s) left by interrupted writes",
                dir.display(),
                stale.len()
            );
        }
        Ok(RunDir {
            dir: dir.to_path_buf(),
            _lock: lock,
            state,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// A file inside the directory.
    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.dir.join(name)
    }
}

fn is_empty_file(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == 0)
}

fn remove_files(paths: &[PathBuf]) -> Result<()> {
    for p in paths {
        let removed = if p.is_dir() {
            std::fs::remove_dir_all(p)
        } else {
            std::fs::remove_file(p)
        };
        removed.map_err(|e| RunsError::io("remove", p, e))?;
    }
    Ok(())
}

/// Takes the directory's exclusive lock without waiting, and writes who holds it.
fn lock_dir(dir: &Path) -> Result<File> {
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| RunsError::io("open the lock file", &path, e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            return Err(RunsError::Locked {
                dir: dir.to_path_buf(),
                holder: holder.trim().to_string(),
            });
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(RunsError::io("lock", &path, e));
        }
    }
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let command: Vec<String> = std::env::args().collect();
    let text = format!(
        "pid {} (started at unix time {started}): {}\n",
        std::process::id(),
        command.join(" ")
    );
    // The holder note is informational: a failure to write it must not stop the run.
    let _ = file
        .set_len(0)
        .and_then(|_| file.rewind())
        .and_then(|_| file.write_all(text.as_bytes()));
    Ok(file)
}

/// The fleet build a binary registered with [`set_build`]: version and commit.
static BUILD: std::sync::OnceLock<(&'static str, &'static str)> = std::sync::OnceLock::new();

/// Registers the version and the commit this program was built from (fleet's binaries do it
/// first thing, from what their build embedded; see `fleet_cli::init`). What manifests,
/// checkpoints and reports record as the commit. Only the first call counts.
pub fn set_build(version: &'static str, commit: &'static str) {
    let _ = BUILD.set((version, commit));
}

/// The commit of fleet that is running, as the binary embedded it when it was built; never the
/// repository of the directory the program runs in. `unknown (library build)` when no binary
/// registered one ([`set_build`]): a program that uses fleet's crates as libraries.
pub fn commit_id() -> String {
    BUILD
        .get()
        .map(|(_, commit)| commit.to_string())
        .unwrap_or_else(|| "unknown (library build)".to_string())
}

/// fleet's version: the registered binary's ([`set_build`]), else this crate's.
pub fn fleet_version() -> String {
    BUILD
        .get()
        .map(|(version, _)| version.to_string())
        .unwrap_or_else(|| env!("CARGO_PKG_VERSION").to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(model: &str, step_cap: u32) -> Manifest {
        Manifest::new("test job")
            .with(
                "model",
                serde_json::json!({"weights_digest": model, "dtype": "f32"}),
            )
            .with("step_cap", step_cap)
            .with("threshold", 0.3f32)
            .note("out", "some/path")
    }

    fn options(overwrite: bool) -> RunDirOptions {
        RunDirOptions::new(&["records.jsonl", "summary.json"], overwrite)
    }

    #[test]
    fn same_manifest_resumes_and_another_is_refused_with_the_fields() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::open(dir.path(), &manifest("aaa", 3), &options(false)).unwrap();
        assert_eq!(run.state, RunDirState::New);
        std::fs::write(run.join("records.jsonl"), "{}\n").unwrap();
        drop(run);
        // A different `about` does not matter.
        let same = manifest("aaa", 3).note("out", "elsewhere");
        let run = RunDir::open(dir.path(), &same, &options(false)).unwrap();
        assert_eq!(run.state, RunDirState::Resumed);
        drop(run);

        let err = RunDir::open(dir.path(), &manifest("bbb", 5), &options(false)).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("model.weights_digest: \"aaa\" recorded, \"bbb\" now"),
            "{msg}"
        );
        assert!(msg.contains("step_cap: 3 recorded, 5 now"), "{msg}");
        assert!(!msg.contains("dtype"), "{msg}");
        assert!(
            msg.contains("--out") && msg.contains("--overwrite"),
            "{msg}"
        );
        // Refused: the records are untouched.
        assert_eq!(
            std::fs::read_to_string(dir.path().join("records.jsonl")).unwrap(),
            "{}\n"
        );
    }

    #[test]
    fn overwrite_removes_the_jobs_files_only() {
        let dir = tempfile::tempdir().unwrap();
        drop(RunDir::open(dir.path(), &manifest("aaa", 3), &options(false)).unwrap());
        std::fs::write(dir.path().join("records.jsonl"), "{}\n").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
        let run = RunDir::open(dir.path(), &manifest("bbb", 3), &options(true)).unwrap();
        match &run.state {
            RunDirState::Overwritten { removed, diffs } => {
                assert_eq!(removed, &vec![dir.path().join("records.jsonl")]);
                assert_eq!(diffs.len(), 1);
            }
            s => panic!("{s:?}"),
        }
        assert!(!dir.path().join("records.jsonl").exists());
        assert!(dir.path().join("notes.txt").exists());
        let now = Manifest::read(&dir.path().join(MANIFEST_FILE))
            .unwrap()
            .unwrap();
        assert!(now.diff(&manifest("bbb", 3)).is_empty());
    }

    #[test]
    fn overwrite_starts_over_even_with_the_same_manifest() {
        let dir = tempfile::tempdir().unwrap();
        drop(RunDir::open(dir.path(), &manifest("aaa", 3), &options(false)).unwrap());
        std::fs::write(dir.path().join("records.jsonl"), "{}\n").unwrap();
        let run = RunDir::open(dir.path(), &manifest("aaa", 3), &options(true)).unwrap();
        assert_eq!(
            run.state,
            RunDirState::Overwritten {
                removed: vec![dir.path().join("records.jsonl")],
                diffs: Vec::new()
            }
        );
        assert!(!dir.path().join("records.jsonl").exists());
    }

    #[test]
    fn records_without_manifest_are_refused_unless_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("records.jsonl"), "{}\n").unwrap();
        let err = RunDir::open(dir.path(), &manifest("aaa", 3), &options(false)).unwrap_err();
        assert!(matches!(err, RunsError::NoManifest { .. }), "{err}");
        assert!(err.to_string().contains("records.jsonl"), "{err}");
        let run = RunDir::open(dir.path(), &manifest("aaa", 3), &options(true)).unwrap();
        assert!(matches!(run.state, RunDirState::Overwritten { .. }));
    }

    #[test]
    fn a_second_writer_is_refused_while_the_first_holds_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunDir::open(dir.path(), &manifest("aaa", 3), &options(false)).unwrap();
        let err = RunDir::open(dir.path(), &manifest("aaa", 3), &options(false)).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, RunsError::Locked { .. }), "{msg}");
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        drop(first);
        RunDir::open(dir.path(), &manifest("aaa", 3), &options(false)).unwrap();
    }

    #[test]
    fn float_fields_compare_equal_after_a_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let m = Manifest::new("j").with("x", 0.1f32).with("y", 1e-4f64);
        drop(RunDir::open(dir.path(), &m, &options(false)).unwrap());
        let run = RunDir::open(dir.path(), &m, &options(false)).unwrap();
        assert_eq!(run.state, RunDirState::Resumed);
    }
}
