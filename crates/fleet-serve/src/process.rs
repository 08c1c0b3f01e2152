//! Replicas in processes of their own.
//!
//! Several GPUs driven by threads of one process contend in the CUDA driver: measured on four
//! H200s, replicas of a small model (where kernel launches and allocations dominate) each ran
//! ~30% slower in one process than alone, and eight 7B replicas ~20% slower, while one process
//! per GPU lost 0–5% (docs/benchmarks.md). So [`crate::Replicas`] keeps its first replica in
//! the calling process and runs every other replica in a child process: the same program
//! started again with [`WORKER_ENV`] set, which loads the replica and answers batches as JSON
//! lines on its stdin and stdout.
//!
//! A program opts in by calling [`serve_if_replica_worker`] first thing in `main`: in a child
//! it serves and exits; in the parent it records that the program can be started as a replica
//! worker. A program that never calls it keeps every replica in-process.
//!
//! A worker serves one [`ModelKind`]: the batch line and its answer are the kind's
//! ([`ModelKind::encode`], [`ModelKind::serve`]); a vision-language batch's images travel as
//! raw RGB8 files in /dev/shm, lossless, so the worker's preprocessing — the checkpoint's own,
//! fixed by its preprocessor_config.json — sees the pixels the parent has.

use std::io::{BufRead, BufReader, Write};
use std::marker::PhantomData;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

use fleet_models::{DeviceMap, HubOptions, LoadOptions, ModelError, Result};
use serde::{Deserialize, Serialize};

use crate::kind::{ModelKind, Text, VisionLanguage};
use crate::stream::StreamConfig;
use crate::wire::Spool;

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

/// What a worker loads.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct WorkerSpec {
    /// [`ModelKind::NAME`].
    kind: String,
    model: String,
    revision: Option<String>,
    dtype: String,
    device_map: DeviceMap,
    hub_cache_dir: Option<std::path::PathBuf>,
    hub_offline: bool,
    #[serde(default)]
    image_backend: fleet_models::vision::ResizeBackend,
    #[serde(default)]
    decode_slots: Option<usize>,
}

impl WorkerSpec {
    fn load_options(&self) -> Result<LoadOptions> {
        Ok(LoadOptions {
            dtype: fleet_models::parse_dtype(&self.dtype)?,
            device_map: Some(self.device_map.clone()),
            revision: self.revision.clone(),
            hub: HubOptions {
                cache_dir: self.hub_cache_dir.clone(),
                offline: self.hub_offline,
            },
            image_backend: self.image_backend,
            decode_slots: self.decode_slots,
        })
    }
}

/// One line from a worker.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum WorkerReply<O> {
    /// Loaded; the replica's name.
    Ready(String),
    /// A batch's outputs, in order.
    Done(Vec<O>),
    /// Loading or a batch failed.
    Failed(String),
    /// A stream's step: the requests that finished, with their ids, and the prompt tokens the
    /// step's newcomers found in the cache.
    Stepped {
        done: Vec<(u64, O)>,
        cached_prompt_tokens: u64,
    },
}

/// A stream line of the parent ([`crate::ReplicaStream`]): continuous batching in the worker,
/// one step per `step` line. Text models only.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "stream", rename_all = "snake_case")]
enum StreamLine {
    /// Start the worker's paged session (answered by an empty `stepped`).
    Open(StreamConfig),
    /// Queue a request (no answer; a request that is refused fails the next step).
    Submit { id: u64, request: serde_json::Value },
    /// Run one step and answer with the requests that finished.
    Step,
}

/// In a replica worker (started by [`crate::Replicas`]): loads the replica, serves batches
/// until stdin closes, and exits the process. Anywhere else: records that this program can be
/// started as a worker, and returns. Call it first thing in `main`, before anything writes to
/// stdout.
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

/// Whether [`crate::Replicas`] starts the replicas of `maps` after the first as child
/// processes: only when there are several, the program opted in, and they use GPUs (CPU
/// replicas share the same cores either way) — unless [`PROCESSES_ENV`] says `0` (never) or
/// `1` (for CPU replicas too).
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

/// Writes one reply line to the parent.
fn send<O: Serialize>(out: &mut impl Write, reply: &WorkerReply<O>) -> Result<()> {
    let line = serde_json::to_string(reply).map_err(|e| ModelError::Replicas(e.to_string()))?;
    writeln!(out, "{line}")
        .and_then(|_| out.flush())
        .map_err(|e| ModelError::Replicas(format!("writing to the parent: {e}")))
}

/// A worker: the spec read, then the kind it names served.
fn serve(spec_json: &str) -> Result<()> {
    let spec: WorkerSpec = match serde_json::from_str(spec_json) {
        Ok(spec) => spec,
        Err(e) => {
            let e = ModelError::BadInput(format!("{WORKER_ENV} does not parse: {e}"));
            send(
                &mut std::io::stdout(),
                &WorkerReply::<()>::Failed(e.to_string()),
            )?;
            return Err(e);
        }
    };
    match spec.kind.as_str() {
        Text::NAME => serve_as::<Text>(&spec),
        VisionLanguage::NAME => serve_as::<VisionLanguage>(&spec),
        other => {
            let e = ModelError::BadInput(format!(
                "{WORKER_ENV} names a model kind `{other}` this program does not serve"
            ));
            send(
                &mut std::io::stdout(),
                &WorkerReply::<()>::Failed(e.to_string()),
            )?;
            Err(e)
        }
    }
}

/// Loads the replica of `spec` and answers batches until stdin closes.
fn serve_as<K: ModelKind>(spec: &WorkerSpec) -> Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let model = match spec
        .load_options()
        .and_then(|opts| K::load(&spec.model, &opts))
    {
        Ok(model) => model,
        Err(e) => {
            send(&mut out, &WorkerReply::<K::Output>::Failed(e.to_string()))?;
            return Err(e);
        }
    };
    let exit_after: Option<usize> = std::env::var(EXIT_AFTER_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok());
    let name = K::device_map(&model).to_string();
    send(&mut out, &WorkerReply::<K::Output>::Ready(name))?;
    let mut stream: Option<Box<dyn StreamWorker + '_>> = None;
    let mut refused: Option<String> = None;
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
        if let Ok(msg) = serde_json::from_str::<StreamLine>(&line) {
            if let Some(reply) = stream_line::<K>(&model, &mut stream, &mut refused, msg) {
                send(&mut out, &reply)?;
            }
            continue;
        }
        let reply = match K::serve(&model, &line) {
            Ok(outputs) => WorkerReply::Done(outputs),
            Err(e) => WorkerReply::Failed(e),
        };
        send(&mut out, &reply)?;
    }
    Ok(())
}

/// A stream line in the worker; the reply to send, if the line has one.
fn stream_line<'m, K: ModelKind>(
    model: &'m K::Model,
    stream: &mut Option<Box<dyn StreamWorker + 'm>>,
    refused: &mut Option<String>,
    msg: StreamLine,
) -> Option<WorkerReply<serde_json::Value>> {
    match msg {
        StreamLine::Open(config) => Some(match K::open_stream(model, config) {
            Ok(s) => {
                *stream = Some(s);
                WorkerReply::Stepped {
                    done: Vec::new(),
                    cached_prompt_tokens: 0,
                }
            }
            Err(e) => WorkerReply::Failed(e.to_string()),
        }),
        StreamLine::Submit { id, request } => {
            let result = match stream.as_mut() {
                Some(s) => s.submit(id, request),
                None => Err(ModelError::Replicas(
                    "a request before the stream opened".into(),
                )),
            };
            if let Err(e) = result {
                refused.get_or_insert(format!("request {id}: {e}"));
            }
            None
        }
        StreamLine::Step => Some(match (refused.take(), stream.as_mut()) {
            (Some(e), _) => WorkerReply::Failed(e),
            (None, None) => WorkerReply::Failed("a step before the stream opened".into()),
            (None, Some(s)) => match s.step() {
                Ok((done, cached_prompt_tokens)) => WorkerReply::Stepped {
                    done,
                    cached_prompt_tokens,
                },
                Err(e) => WorkerReply::Failed(e.to_string()),
            },
        }),
    }
}

/// A replica worker's continuous batching ([`ModelKind::open_stream`]): requests and outputs
/// as JSON, so that the serve loop stays the same for every kind.
pub trait StreamWorker {
    /// Queues a request.
    fn submit(&mut self, id: u64, request: serde_json::Value) -> Result<()>;
    /// One step; the requests that finished, with their ids, and the prompt tokens the step's
    /// newcomers found in the cache.
    fn step(&mut self) -> Result<(Vec<(u64, serde_json::Value)>, u64)>;
}

/// A replica of kind `K` in a child process.
pub(crate) struct ReplicaProcess<K> {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Option<BufReader<ChildStdout>>,
    map: DeviceMap,
    name: String,
    kind: PhantomData<fn() -> K>,
}

impl<K: ModelKind> ReplicaProcess<K> {
    /// Starts this program as a worker loading `spec` on `map`; [`ReplicaProcess::ready`]
    /// waits for it. Several can load at once.
    pub(crate) fn spawn(spec: &str, opts: &LoadOptions, map: &DeviceMap) -> Result<Self> {
        let worker = WorkerSpec {
            kind: K::NAME.to_string(),
            model: spec.to_string(),
            revision: opts.revision.clone(),
            dtype: opts.dtype.as_str().to_string(),
            device_map: map.clone(),
            hub_cache_dir: opts.hub.cache_dir.clone(),
            hub_offline: opts.hub.offline,
            image_backend: opts.image_backend,
            decode_slots: opts.decode_slots,
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
            child,
            stdin,
            stdout,
            map: map.clone(),
            name: map.to_string(),
            kind: PhantomData,
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
            WorkerReply::Done(_) | WorkerReply::Stepped { .. } => {
                Err(self.protocol_error("an output before loading"))
            }
        }
    }

    /// The replica's devices and the worker's pid.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The device map it was started with.
    pub(crate) fn map(&self) -> &DeviceMap {
        &self.map
    }

    /// The worker's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Generates one batch in the worker: one output per request, in order; `Err` when the
    /// whole batch failed (or the worker stopped).
    pub(crate) fn generate(&mut self, batch: &[K::Request]) -> Result<Vec<K::Output>> {
        // Whatever files the batch's images went to are removed with the spool, after the
        // reply (the worker removes those it read).
        let spool = Spool::new();
        let line = K::encode(batch, &spool)?;
        self.send_line(&line)?;
        match self.receive()? {
            WorkerReply::Done(outputs) if outputs.len() == batch.len() => Ok(outputs),
            WorkerReply::Done(outputs) => Err(self.protocol_error(&format!(
                "{} outputs for a batch of {}",
                outputs.len(),
                batch.len()
            ))),
            WorkerReply::Failed(e) => Err(ModelError::Replicas(e)),
            WorkerReply::Ready(_) => Err(self.protocol_error("a second ready")),
            WorkerReply::Stepped { .. } => Err(self.protocol_error("a stream step for a batch")),
        }
    }

    /// Writes one line to the worker.
    fn send_line(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().ok_or_else(|| {
            ModelError::Replicas(format!("replica process {} is closed", self.name))
        })?;
        writeln!(stdin, "{line}")
            .and_then(|_| stdin.flush())
            .map_err(|e| self.died(&e.to_string()))
    }

    fn receive(&mut self) -> Result<WorkerReply<K::Output>> {
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

impl<K> Drop for ReplicaProcess<K> {
    /// Closing its stdin ends the worker's loop (and closing its stdout ends a batch it is
    /// still writing); it exits and frees its GPU memory.
    fn drop(&mut self) {
        drop(self.stdin.take());
        drop(self.stdout.take());
        let _ = self.child.wait();
    }
}

/// The parent's side of a worker's stream (text models: [`crate::ReplicaStream`]).
impl ReplicaProcess<Text> {
    /// Opens the worker's paged session of `config`.
    pub(crate) fn stream_open(&mut self, config: StreamConfig) -> Result<()> {
        let line = StreamLine::Open(config);
        self.send_line(&serde_json::to_string(&line).map_err(stream_encode)?)?;
        self.stream_receive().map(|_| ())
    }

    /// Queues a request in the worker's session.
    pub(crate) fn stream_submit(
        &mut self,
        id: u64,
        request: &fleet_models::GenerationRequest,
    ) -> Result<()> {
        let request = serde_json::to_value(request).map_err(stream_encode)?;
        let line = StreamLine::Submit { id, request };
        self.send_line(&serde_json::to_string(&line).map_err(stream_encode)?)
    }

    /// Asks the worker for one step (its answer is [`ReplicaProcess::stream_stepped`]'s).
    pub(crate) fn stream_step(&mut self) -> Result<()> {
        self.send_line(&serde_json::to_string(&StreamLine::Step).map_err(stream_encode)?)
    }

    /// The answer to the last step: the requests that finished, with their ids, and the
    /// prompt tokens found in the cache.
    pub(crate) fn stream_stepped(&mut self) -> Result<StreamStep> {
        self.stream_receive()
    }

    fn stream_receive(&mut self) -> Result<StreamStep> {
        match self.receive()? {
            WorkerReply::Stepped {
                done,
                cached_prompt_tokens,
            } => Ok((done, cached_prompt_tokens)),
            WorkerReply::Failed(e) => Err(ModelError::Replicas(format!(
                "replica process {}: {e}",
                self.name
            ))),
            WorkerReply::Ready(_) | WorkerReply::Done(_) => {
                Err(self.protocol_error("a batch answer to a stream line"))
            }
        }
    }
}

/// A stream step's finished requests and the prompt tokens found in the cache.
pub(crate) type StreamStep = (Vec<(u64, fleet_models::GenerationOutput)>, u64);

fn stream_encode(e: serde_json::Error) -> ModelError {
    ModelError::Replicas(format!("a stream line for a replica process: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica process's stream opens with the parent's whole config: the open line
    /// carries the steps between reads beside the slots and the KV budget, and the worker's
    /// session is made with them (a worker that dropped them would decode the same tokens, so
    /// the stream tests alone could not tell).
    #[test]
    fn the_open_line_carries_the_whole_stream_config() {
        let config = StreamConfig {
            num_scheduler_steps: 3,
            ..StreamConfig::new(2, 16 << 20)
        };
        let line = serde_json::to_string(&StreamLine::Open(config)).unwrap();
        match serde_json::from_str::<StreamLine>(&line).unwrap() {
            StreamLine::Open(got) => assert_eq!(got, config, "{line}"),
            other => panic!("{line} read back as {other:?}"),
        }
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen2-tiny");
        let model =
            fleet_models::TextModel::load(dir.to_str().unwrap(), &LoadOptions::default()).unwrap();
        let options = crate::stream::stream_options(&model, config);
        assert_eq!((options.max_batch, options.sync_every), (2, 3));
    }
}
