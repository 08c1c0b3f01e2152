//! Replicas in processes of their own.
//!
//! Several GPUs driven by threads of one process contend in the CUDA driver: measured on four
//! H200s, replicas of a small model (where kernel launches and allocations dominate) each ran
//! ~30% slower in one process than alone, and eight 7B replicas ~20% slower, while one process
//! per GPU lost 0–5% (docs/benchmarks.md). So [`crate::placement::Replicas`] keeps its first
//! replica in the calling process and runs every other replica in a child process: the same
//! program started again with [`WORKER_ENV`] set, which loads the replica and answers batches
//! as JSON lines on its stdin and stdout.
//!
//! A program opts in by calling [`serve_if_replica_worker`] first thing in `main`: in a child
//! it serves and exits; in the parent it records that the program can be started as a replica
//! worker. A program that never calls it keeps every replica in-process.
//!
//! A worker serves one of two kinds of replica ([`ReplicaKind`]): a text model
//! ([`crate::TextModel`], batches of [`GenerationRequest`]s) or a Qwen3-VL model
//! ([`crate::VisionLanguageModel`], batches of [`crate::vl_replicas::VlRequest`]s: chat
//! messages with their images as raw RGB8 files in /dev/shm, lossless, so the worker's
//! preprocessing — the checkpoint's own, fixed by its preprocessor_config.json — sees the
//! pixels the parent has).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

use crate::vl_replicas::{generate_vl, Spool, VlOutcome, VlRequest, WireVlRequest};
use crate::{
    DeviceMap, GenerationOutput, GenerationRequest, HubOptions, LoadOptions, ModelError, Result,
    TextModel, VisionLanguageModel,
};

/// The environment variable that makes a program a replica worker; it holds the worker's
/// `WorkerSpec` as JSON.
pub const WORKER_ENV: &str = "FLEET_REPLICA_WORKER";

/// Whether replicas run in processes: `FLEET_REPLICA_PROCESSES=0` keeps them all in-process
/// (to compare), `1` (the default) uses processes when the program opted in.
pub const PROCESSES_ENV: &str = "FLEET_REPLICA_PROCESSES";

/// For tests of failure handling: a worker started with this variable set to `N` answers `N`
/// batches, then exits with status 3 on receiving the next one, as a crashed replica would
/// (the parent sees a replica process that stopped mid-batch). Unset in real runs.
pub const EXIT_AFTER_ENV: &str = "FLEET_REPLICA_EXIT_AFTER";

static CAN_SPAWN: AtomicBool = AtomicBool::new(false);

/// What a replica worker serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaKind {
    /// A text model ([`TextModel`]): batches of [`GenerationRequest`]s.
    #[default]
    Text,
    /// A Qwen3-VL model ([`VisionLanguageModel`]): batches of chats with images.
    VisionLanguage,
}

/// What a worker loads.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct WorkerSpec {
    #[serde(default)]
    kind: ReplicaKind,
    model: String,
    revision: Option<String>,
    dtype: String,
    device_map: DeviceMap,
    hub_cache_dir: Option<std::path::PathBuf>,
    hub_offline: bool,
    #[serde(default)]
    image_backend: crate::vision::ResizeBackend,
}

/// One line from a worker.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum WorkerReply {
    /// Loaded; the replica's name.
    Ready(String),
    /// A batch's outputs, in order.
    Done(Vec<GenerationOutput>),
    /// A vision-language batch's outcomes, in order: an output, or why that request failed.
    Outcomes(Vec<VlOutcome>),
    /// Loading or a batch failed.
    Failed(String),
}

/// In a replica worker (started by [`crate::placement::Replicas`]): loads the replica, serves
/// batches until stdin closes, and exits the process. Anywhere else: records that this program
/// can be started as a worker, and returns. Call it first thing in `main`, before anything
/// writes to stdout.
pub fn serve_if_replica_worker() {
    let Ok(spec) = std::env::var(WORKER_ENV) else {
        CAN_SPAWN.store(true, Ordering::Relaxed);
        return;
    };
    let code = match serve(&spec) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("fleet replica worker: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// Whether [`crate::placement::Replicas`] starts the replicas of `maps` after the first as
/// child processes: only when there are several, the program opted in, and they use GPUs
/// (CPU replicas share the same cores either way) — unless [`PROCESSES_ENV`] says `0` (never)
/// or `1` (for CPU replicas too).
pub(crate) fn use_processes(maps: &[DeviceMap]) -> bool {
    let setting = std::env::var(PROCESSES_ENV).ok();
    let on_gpu = maps
        .iter()
        .any(|m| m.devices().iter().any(|d| d.cuda_ordinal().is_some()));
    maps.len() > 1
        && CAN_SPAWN.load(Ordering::Relaxed)
        && match setting.as_deref() {
            Some("0") => false,
            Some("1") => true,
            _ => on_gpu,
        }
}

/// A loaded replica in a worker.
enum Served {
    Text(Box<TextModel>),
    VisionLanguage(Box<VisionLanguageModel>),
}

fn serve(spec_json: &str) -> Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut send = |reply: &WorkerReply| -> Result<()> {
        let line = serde_json::to_string(reply).map_err(|e| ModelError::Replicas(e.to_string()))?;
        writeln!(out, "{line}")
            .and_then(|_| out.flush())
            .map_err(|e| ModelError::Replicas(format!("writing to the parent: {e}")))
    };
    let model = match load(spec_json) {
        Ok(model) => model,
        Err(e) => {
            send(&WorkerReply::Failed(e.to_string()))?;
            return Err(e);
        }
    };
    let name = match &model {
        Served::Text(m) => m.model.device_map().to_string(),
        Served::VisionLanguage(m) => m.model.text().device_map().to_string(),
    };
    let exit_after: Option<usize> = std::env::var(EXIT_AFTER_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok());
    send(&WorkerReply::Ready(name))?;
    for (served, line) in std::io::stdin().lock().lines().enumerate() {
        let line =
            line.map_err(|e| ModelError::Replicas(format!("reading from the parent: {e}")))?;
        if exit_after == Some(served) {
            eprintln!(
                "fleet replica worker: {EXIT_AFTER_ENV}={served}: exiting on batch {} (a test of failure handling)",
                served + 1
            );
            std::process::exit(3);
        }
        let reply = match &model {
            Served::Text(model) => match serde_json::from_str::<Vec<GenerationRequest>>(&line) {
                Ok(batch) => match model.generate(&batch, None) {
                    Ok(outputs) => WorkerReply::Done(outputs),
                    Err(e) => WorkerReply::Failed(e.to_string()),
                },
                Err(e) => WorkerReply::Failed(format!("a batch that does not parse: {e}")),
            },
            Served::VisionLanguage(model) => {
                match serde_json::from_str::<Vec<WireVlRequest>>(&line) {
                    Ok(batch) => serve_vl_batch(model, batch),
                    Err(e) => WorkerReply::Failed(format!("a batch that does not parse: {e}")),
                }
            }
        };
        send(&reply)?;
    }
    Ok(())
}

/// Decodes a vision-language batch (a request whose images do not decode fails alone) and
/// generates the rest as one batch.
fn serve_vl_batch(model: &VisionLanguageModel, batch: Vec<WireVlRequest>) -> WorkerReply {
    use rayon::prelude::*;
    let n = batch.len();
    let mut outcomes: Vec<Option<VlOutcome>> = vec![None; n];
    let mut requests = Vec::with_capacity(n);
    let mut index = Vec::with_capacity(n);
    // Read in parallel, as the parent wrote them.
    let decoded: Vec<_> = batch
        .into_par_iter()
        .map(WireVlRequest::into_request)
        .collect();
    for (i, wire) in decoded.into_iter().enumerate() {
        match wire {
            Ok(r) => {
                requests.push(r);
                index.push(i);
            }
            Err(e) => outcomes[i] = Some(Err(format!("request {i}: {e}"))),
        }
    }
    if !requests.is_empty() {
        match generate_vl(model, &requests) {
            Ok(out) => {
                for (i, o) in index.into_iter().zip(out) {
                    outcomes[i] = Some(o);
                }
            }
            Err(e) => return WorkerReply::Failed(e.to_string()),
        }
    }
    WorkerReply::Outcomes(
        outcomes
            .into_iter()
            .map(|o| o.expect("every request has an outcome"))
            .collect(),
    )
}

fn load(spec_json: &str) -> Result<Served> {
    let spec: WorkerSpec = serde_json::from_str(spec_json)
        .map_err(|e| ModelError::BadInput(format!("{WORKER_ENV} does not parse: {e}")))?;
    let opts = LoadOptions {
        dtype: crate::parse_dtype(&spec.dtype)?,
        device_map: Some(spec.device_map),
        revision: spec.revision,
        hub: HubOptions {
            cache_dir: spec.hub_cache_dir,
            offline: spec.hub_offline,
        },
        image_backend: spec.image_backend,
    };
    Ok(match spec.kind {
        ReplicaKind::Text => Served::Text(Box::new(TextModel::load(&spec.model, &opts)?)),
        ReplicaKind::VisionLanguage => {
            Served::VisionLanguage(Box::new(VisionLanguageModel::load(&spec.model, &opts)?))
        }
    })
}

/// A replica in a child process.
pub(crate) struct ReplicaProcess {
    kind: ReplicaKind,
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Option<BufReader<ChildStdout>>,
    name: String,
}

impl ReplicaProcess {
    /// Starts this program as a worker loading `spec` (a replica of `kind`) on `map`;
    /// [`ReplicaProcess::ready`] waits for it. Several can load at once.
    pub(crate) fn spawn(
        kind: ReplicaKind,
        spec: &str,
        opts: &LoadOptions,
        map: &DeviceMap,
    ) -> Result<Self> {
        let worker = WorkerSpec {
            kind,
            model: spec.to_string(),
            revision: opts.revision.clone(),
            dtype: opts.dtype.as_str().to_string(),
            device_map: map.clone(),
            hub_cache_dir: opts.hub.cache_dir.clone(),
            hub_offline: opts.hub.offline,
            image_backend: opts.image_backend,
        };
        let exe = std::env::current_exe()
            .map_err(|e| ModelError::Replicas(format!("cannot find this program: {e}")))?;
        let spawn_err = |e: std::io::Error| {
            ModelError::Replicas(format!(
                "starting a replica process ({}) on {map}: {e}; {PROCESSES_ENV}=0 keeps replicas in this process",
                exe.display()
            ))
        };
        let mut child = Command::new(&exe)
            .env(
                WORKER_ENV,
                serde_json::to_string(&worker).expect("the spec serializes"),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(spawn_err)?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().map(BufReader::new);
        Ok(ReplicaProcess {
            kind,
            child,
            stdin,
            stdout,
            name: map.to_string(),
        })
    }

    /// Waits until the worker has loaded its replica.
    pub(crate) fn ready(&mut self) -> Result<()> {
        match self.receive()? {
            WorkerReply::Ready(name) => {
                self.name = format!("{name} (pid {})", self.child.id());
                Ok(())
            }
            WorkerReply::Failed(e) => Err(ModelError::Replicas(format!(
                "the replica process for {} could not load: {e}",
                self.name
            ))),
            WorkerReply::Done(_) | WorkerReply::Outcomes(_) => {
                Err(self.protocol_error("an output before loading"))
            }
        }
    }

    /// The replica's devices and the worker's pid.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The worker's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends one batch (a JSON line) and reads the worker's reply.
    fn call<T: Serialize>(&mut self, batch: &[T]) -> Result<WorkerReply> {
        let line = serde_json::to_string(batch).map_err(|e| ModelError::Replicas(e.to_string()))?;
        let stdin = self.stdin.as_mut().ok_or_else(|| {
            ModelError::Replicas(format!("replica process {} is closed", self.name))
        })?;
        writeln!(stdin, "{line}")
            .and_then(|_| stdin.flush())
            .map_err(|e| self.died(&e.to_string()))?;
        self.receive()
    }

    /// Generates one batch in a text worker.
    pub(crate) fn generate(
        &mut self,
        batch: &[GenerationRequest],
    ) -> Result<Vec<GenerationOutput>> {
        self.expect_kind(ReplicaKind::Text)?;
        match self.call(batch)? {
            WorkerReply::Done(outputs) if outputs.len() == batch.len() => Ok(outputs),
            WorkerReply::Done(outputs) => Err(self.protocol_error(&format!(
                "{} outputs for a batch of {}",
                outputs.len(),
                batch.len()
            ))),
            WorkerReply::Failed(e) => Err(ModelError::Replicas(e)),
            WorkerReply::Ready(_) => Err(self.protocol_error("a second ready")),
            WorkerReply::Outcomes(_) => Err(self.protocol_error("vision-language outcomes")),
        }
    }

    /// Generates one batch in a vision-language worker: one outcome per request, in order;
    /// `Err` when the whole batch failed (or the worker stopped).
    pub(crate) fn generate_vl(&mut self, batch: &[VlRequest]) -> Result<Vec<VlOutcome>> {
        self.expect_kind(ReplicaKind::VisionLanguage)?;
        // The images go as raw pixel files (see `WireVlRequest`), written in parallel; the
        // spool removes what the worker has not.
        use rayon::prelude::*;
        let spool = Spool::new();
        let wire = batch
            .par_iter()
            .map(|r| WireVlRequest::from_request(r, &spool))
            .collect::<Result<Vec<_>>>()?;
        match self.call(&wire)? {
            WorkerReply::Outcomes(out) if out.len() == batch.len() => Ok(out),
            WorkerReply::Outcomes(out) => Err(self.protocol_error(&format!(
                "{} outcomes for a batch of {}",
                out.len(),
                batch.len()
            ))),
            WorkerReply::Failed(e) => Err(ModelError::Replicas(e)),
            WorkerReply::Ready(_) => Err(self.protocol_error("a second ready")),
            WorkerReply::Done(_) => Err(self.protocol_error("text outputs")),
        }
    }

    fn expect_kind(&self, kind: ReplicaKind) -> Result<()> {
        if self.kind == kind {
            Ok(())
        } else {
            Err(ModelError::Replicas(format!(
                "replica process {} serves a {:?} model, not {kind:?}",
                self.name, self.kind
            )))
        }
    }

    fn receive(&mut self) -> Result<WorkerReply> {
        let mut line = String::new();
        let read = match self.stdout.as_mut() {
            Some(stdout) => stdout.read_line(&mut line),
            None => Ok(0),
        };
        let n = read.map_err(|e| self.died(&e.to_string()))?;
        if n == 0 {
            return Err(self.died("it closed its output"));
        }
        serde_json::from_str(&line).map_err(|e| {
            self.protocol_error(&format!(
                "a line that does not parse ({e}): {}",
                line.trim()
            ))
        })
    }

    fn died(&mut self, what: &str) -> ModelError {
        let status = match self.child.try_wait() {
            Ok(Some(status)) => format!(", {status}"),
            _ => String::new(),
        };
        ModelError::Replicas(format!(
            "replica process {} stopped ({what}{status}); its error is above, on stderr",
            self.name
        ))
    }

    fn protocol_error(&self, what: &str) -> ModelError {
        ModelError::Replicas(format!(
            "replica process {} sent {what}: is something else writing to its stdout?",
            self.name
        ))
    }
}

impl Drop for ReplicaProcess {
    /// Closing its stdin ends the worker's loop (and closing its stdout ends a batch it is
    /// still writing); it exits and frees its GPU memory.
    fn drop(&mut self) {
        drop(self.stdin.take());
        drop(self.stdout.take());
        let _ = self.child.wait();
    }
}
