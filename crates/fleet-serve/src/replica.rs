//! Replicas of one checkpoint, for every kind of model: loaded per device map, the first in
//! this process and the others in child processes ([`crate::process`]) when they use GPUs;
//! batches spread over them by fleet-dist's pool ([`Replicas::generate`]), or each replica
//! driven by a caller thread of its own ([`Replicas::into_replicas`], [`Replica::generate`]).

use std::sync::Mutex;

use fleet_dist::{BoxError, ItemResult, PoolOptions, ReplicaPool, Worker};
use fleet_models::{DeviceMap, LoadOptions, ModelError, Result};

use crate::kind::ModelKind;
use crate::placement::{device_maps, PlacementRequest};
use crate::process::{use_processes, ReplicaProcess};

/// Loaded replicas of one checkpoint of kind `K`, each on its own device(s).
///
/// The first replica is always loaded in this process (its tokenizer, chat template and config
/// serve the caller). With several GPU replicas, and a program that called
/// [`crate::serve_if_replica_worker`], every other replica runs in a child process of its
/// own: GPUs driven from threads of one process contend in the CUDA driver.
pub struct Replicas<K: ModelKind> {
    /// The replicas loaded in this process: the first replica, and all of them when the others
    /// do not run in processes of their own.
    pub models: Vec<K::Model>,
    processes: Vec<Mutex<ReplicaProcess<K>>>,
}

impl<K: ModelKind> Replicas<K> {
    /// Loads one replica of `spec` per device map (`opts.device_map` is ignored). Replicas
    /// after the first start in processes of their own when the program opted in (see
    /// [`crate::process`]) and they use GPUs (`FLEET_REPLICA_PROCESSES=1` forces processes
    /// for CPU replicas too, `0` keeps every replica here); those load in parallel with the
    /// ones here.
    pub fn load(spec: &str, opts: &LoadOptions, maps: &[DeviceMap]) -> Result<Self> {
        if maps.is_empty() {
            return Err(ModelError::Replicas(
                "no device map given: one per replica".into(),
            ));
        }
        let in_processes = use_processes(maps);
        let mut processes = Vec::new();
        if in_processes {
            for (i, map) in maps.iter().enumerate().skip(1) {
                tracing::info!("starting {} {i} on {map} in a process of its own", K::LABEL);
                processes.push(ReplicaProcess::<K>::spawn(spec, opts, map)?);
            }
        }
        let local_maps = if in_processes { &maps[..1] } else { maps };
        let mut models = Vec::with_capacity(local_maps.len());
        for (i, map) in local_maps.iter().enumerate() {
            tracing::info!("loading {} {i} on {map}", K::LABEL);
            let opts = LoadOptions {
                device_map: Some(map.clone()),
                ..opts.clone()
            };
            models.push(K::load(spec, &opts)?);
        }
        for p in processes.iter_mut() {
            p.ready()?;
        }
        Ok(Replicas {
            models,
            processes: processes.into_iter().map(Mutex::new).collect(),
        })
    }

    /// Plans on this machine ([`device_maps`]) and loads every replica of the plan; one CPU
    /// replica on a machine without GPUs.
    pub fn load_planned(
        spec: &str,
        opts: &LoadOptions,
        request: &PlacementRequest,
    ) -> Result<Self> {
        let (maps, plan) = device_maps::<K>(spec, opts, request)?;
        match plan {
            Some(plan) => tracing::info!("placement plan:\n{plan}"),
            None => tracing::warn!("no GPU visible: one {} on the CPU", K::LABEL),
        }
        Self::load(spec, opts, &maps)
    }

    /// Replicas in all, in this process and in their own.
    pub fn len(&self) -> usize {
        self.models.len() + self.processes.len()
    }

    /// Whether there is no replica (never, once loaded).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Replicas running in processes of their own.
    pub fn in_processes(&self) -> usize {
        self.processes.len()
    }

    /// The replicas in processes of their own.
    pub(crate) fn processes(&self) -> &[Mutex<ReplicaProcess<K>>] {
        &self.processes
    }

    /// Every replica on its own, the ones in this process first, for callers that drive each
    /// replica from a thread of their own (e.g. one worker of fleet-dist's pool each).
    pub fn into_replicas(self) -> Vec<Replica<K>> {
        let local = self.models.into_iter().map(|model| {
            let map = K::device_map(&model).clone();
            Replica::new(Owned::Local(Box::new(model)), &map)
        });
        let processes = self.processes.into_iter().map(|p| {
            let p = p.into_inner().unwrap_or_else(|e| e.into_inner());
            let map = p.map().clone();
            Replica::new(Owned::Process(Mutex::new(p)), &map)
        });
        local.chain(processes).collect()
    }

    /// Generates every request, in batches of at most `max_batch` taken from a shared queue by
    /// the replicas (a faster replica takes more batches). Outputs come back in input order.
    /// A batch that fails on one replica is retried on another; an error names every failure
    /// when a batch failed everywhere.
    pub fn generate(
        &self,
        requests: &[K::Request],
        max_batch: usize,
        progress: bool,
    ) -> Result<Vec<K::Output>> {
        let batches: Vec<&[K::Request]> = requests.chunks(max_batch.max(1)).collect();
        Ok(self
            .generate_batches(&batches, progress)?
            .into_iter()
            .flatten()
            .collect())
    }

    /// Generates batches formed by the caller (e.g. by a token budget), each batch on one
    /// replica, taken from the shared queue; outputs per batch, in input order.
    pub fn generate_batches(
        &self,
        batches: &[&[K::Request]],
        progress: bool,
    ) -> Result<Vec<Vec<K::Output>>> {
        let batches = batches.to_vec();
        let places = self
            .models
            .iter()
            .map(Place::Local)
            .chain(self.processes.iter().map(Place::Process));
        let workers: Vec<PoolWorker<'_, K>> = places
            .enumerate()
            .map(|(index, place)| PoolWorker { index, place })
            .collect();
        let opts = PoolOptions {
            progress,
            label: "batches".into(),
            ..PoolOptions::default()
        };
        let sizes: Vec<usize> = batches.iter().map(|b| b.len()).collect();
        let out = ReplicaPool::run(workers, batches, &opts)
            .map_err(|e| ModelError::Replicas(e.to_string()))?;
        let mut outputs = Vec::with_capacity(sizes.len());
        for (i, result) in out.results.into_iter().enumerate() {
            match result {
                ItemResult::Done { output, .. } => outputs.push(output),
                ItemResult::Failed { errors } => {
                    let detail: Vec<String> = errors
                        .iter()
                        .map(|e| format!("{}: {}", e.worker_name, e.message))
                        .collect();
                    let first: usize = sizes[..i].iter().sum();
                    return Err(ModelError::Replicas(format!(
                        "batch {i} (requests {first}..{}) failed on every replica: {}",
                        first + sizes[i],
                        detail.join("; ")
                    )));
                }
            }
        }
        Ok(outputs)
    }
}

/// Where one replica runs, borrowed: the one way a batch reaches a replica.
enum Place<'a, K: ModelKind> {
    Local(&'a K::Model),
    Process(&'a Mutex<ReplicaProcess<K>>),
}

impl<K: ModelKind> Place<'_, K> {
    /// Generates one batch here or in the replica's process.
    fn generate(&self, batch: &[K::Request]) -> Result<Vec<K::Output>> {
        match self {
            Place::Local(model) => K::generate(model, batch),
            Place::Process(p) => p.lock().unwrap_or_else(|e| e.into_inner()).generate(batch),
        }
    }
}

/// One replica as a worker of the pool.
struct PoolWorker<'a, K: ModelKind> {
    index: usize,
    place: Place<'a, K>,
}

impl<'a, K: ModelKind> Worker<&'a [K::Request], Vec<K::Output>> for PoolWorker<'a, K> {
    fn name(&self) -> String {
        match &self.place {
            Place::Local(model) => {
                let devices = K::device_map(model).devices();
                let names: Vec<String> = devices.iter().map(|d| d.to_string()).collect();
                format!("replica {} [{}]", self.index, names.join(","))
            }
            Place::Process(p) => {
                let p = p.lock().unwrap_or_else(|e| e.into_inner());
                format!("replica {} [{}]", self.index, p.name())
            }
        }
    }

    fn process(
        &mut self,
        batch: &&'a [K::Request],
    ) -> std::result::Result<Vec<K::Output>, BoxError> {
        Ok(self.place.generate(batch)?)
    }
}

/// A replica held alone.
enum Owned<K: ModelKind> {
    Local(Box<K::Model>),
    Process(Mutex<ReplicaProcess<K>>),
}

/// One replica of kind `K`: loaded in this process, or in a child process of its own.
pub struct Replica<K: ModelKind> {
    owned: Owned<K>,
    devices: String,
    map: String,
}

impl<K: ModelKind> Replica<K> {
    fn new(owned: Owned<K>, map: &DeviceMap) -> Self {
        let devices: Vec<String> = map.devices().iter().map(|d| d.to_string()).collect();
        Replica {
            owned,
            devices: devices.join(","),
            map: map.to_string(),
        }
    }

    fn place(&self) -> Place<'_, K> {
        match &self.owned {
            Owned::Local(model) => Place::Local(model.as_ref()),
            Owned::Process(p) => Place::Process(p),
        }
    }

    /// The devices it uses, e.g. `cuda:0` or `cuda:0,cuda:1` (for progress bars).
    pub fn devices(&self) -> &str {
        &self.devices
    }

    /// Its device map, e.g. `embed=cuda:1 layers[0..36]=cuda:1 head=cuda:1`.
    pub fn device_map(&self) -> &str {
        &self.map
    }

    /// The worker's pid, when the replica runs in a child process.
    pub fn pid(&self) -> Option<u32> {
        match &self.owned {
            Owned::Local(_) => None,
            Owned::Process(p) => Some(p.lock().unwrap_or_else(|e| e.into_inner()).pid()),
        }
    }

    /// `cuda:0` for a replica here, `cuda:1 (pid 4242)` for one in a child process.
    pub fn name(&self) -> String {
        match self.pid() {
            Some(pid) => format!("{} (pid {pid})", self.devices),
            None => self.devices.clone(),
        }
    }

    /// The model, when the replica lives in this process.
    pub fn local(&self) -> Option<&K::Model> {
        match &self.owned {
            Owned::Local(model) => Some(model),
            Owned::Process(_) => None,
        }
    }

    /// Whether it runs in a child process.
    pub fn in_process(&self) -> bool {
        matches!(self.owned, Owned::Process(_))
    }

    /// Generates one batch, here or in the replica's process: one output per request, in
    /// order; `Err` when the whole batch failed (or the process stopped).
    pub fn generate(&mut self, batch: &[K::Request]) -> Result<Vec<K::Output>> {
        self.place().generate(batch)
    }
}
