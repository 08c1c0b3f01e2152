//! A job's model on the machine's GPUs: a plan from fleet-topology turned into loaded
//! replicas, and batched generation spread over them by fleet-dist's replica pool.
//!
//! ```no_run
//! use fleet_models::placement::{PlacementRequest, Replicas};
//! use fleet_models::{GenerationRequest, LoadOptions};
//!
//! # fn main() -> fleet_models::Result<()> {
//! let opts = LoadOptions::default();
//! let request = PlacementRequest::new("data-parallel".parse()?);
//! let replicas = Replicas::load_planned("Qwen/Qwen2.5-7B-Instruct", &opts, &request)?;
//! let requests = vec![GenerationRequest::greedy(vec![1, 2, 3], 16); 64];
//! let outputs = replicas.generate(&requests, 32, false)?;
//! # Ok(()) }
//! ```

use std::sync::Mutex;

use fleet_dist::{BoxError, ItemResult, PoolOptions, ReplicaPool, Worker};
use fleet_topology::{CheckpointParams, ModelShape, Plan, PlanRequest, Topology};
pub use fleet_topology::{MaxMemory, PlanMode, Workload};

use crate::replica_process::ReplicaProcess;
use crate::{
    DType, DeviceLocation, DeviceMap, GenerationOutput, GenerationRequest, LoadOptions, ModelError,
    ModelSource, Result, TextModel,
};

/// Where a job wants its model: the seeds' `--gpu-mode`, `--gpu-ids`, a `max_memory` budget
/// and the batch each replica must hold.
#[derive(Debug, Clone)]
pub struct PlacementRequest {
    /// single, data-parallel, layer-sharded, `hybrid[:N]` or auto.
    pub mode: PlanMode,
    /// Only these GPUs (CUDA indices), in this order; `None` = every visible GPU.
    pub gpu_ids: Option<Vec<usize>>,
    /// Per-device budgets.
    pub max_memory: MaxMemory,
    /// Sequences and tokens per sequence each replica must hold.
    pub workload: Workload,
}

impl PlacementRequest {
    /// From the jobs' placement flags as typed: `--gpu-mode` (any spelling [`PlanMode`]
    /// parses, `sharded` included), `--gpu-ids`, `--max-memory` (accelerate's style; none: the
    /// default budgets), and the workload each replica must hold.
    pub fn from_flags(
        gpu_mode: &str,
        gpu_ids: Option<Vec<usize>>,
        max_memory: Option<&str>,
        workload: Workload,
    ) -> Result<Self> {
        Ok(PlacementRequest {
            mode: gpu_mode.parse()?,
            gpu_ids,
            max_memory: match max_memory {
                Some(m) => m.parse()?,
                None => MaxMemory::new(),
            },
            workload,
        })
    }

    /// `mode` on every visible GPU with the default budgets and workload.
    pub fn new(mode: PlanMode) -> Self {
        PlacementRequest {
            mode,
            gpu_ids: None,
            max_memory: MaxMemory::new(),
            workload: Workload::default(),
        }
    }
}

/// The workload a job sizes its replicas for: KV cache for `batch` sequences of 4096 tokens
/// (prompt with retrieved context plus the reply), logits of the last position only, and
/// prefills split by the caller so that their attention scores stay under
/// `max_attention_bytes`.
pub fn default_workload(batch: usize, max_attention_bytes: u64) -> Workload {
    Workload {
        batch: batch.max(1),
        seq_len: 4096,
        full_logits: false,
        max_attention_bytes: Some(max_attention_bytes),
    }
}

/// The planner's dtype for a candle dtype (f32 for anything it does not know).
fn plan_dtype(dtype: DType) -> fleet_topology::DType {
    match dtype {
        DType::BF16 => fleet_topology::DType::Bf16,
        DType::F16 => fleet_topology::DType::F16,
        _ => fleet_topology::DType::F32,
    }
}

/// Plans the replicas of checkpoint `spec` on this machine's GPUs (weights counted from the
/// safetensors headers). `None` when the machine has no GPU: the caller then runs one replica
/// on the CPU.
pub fn plan_on_this_machine(
    spec: &str,
    opts: &LoadOptions,
    request: &PlacementRequest,
) -> Result<Option<Plan>> {
    let mut topology = Topology::from_devices(&fleet_topology::discover()?);
    if topology.gpus.is_empty() {
        // GPU ids in --gpu-ids or --max-memory name GPUs this machine does not have.
        let named = request
            .gpu_ids
            .as_ref()
            .and_then(|ids| ids.first().copied())
            .or_else(|| {
                request
                    .max_memory
                    .entries()
                    .find_map(|(d, _)| d.cuda_ordinal())
            });
        if let Some(id) = named {
            return Err(ModelError::Topology(
                fleet_topology::TopologyError::UnknownGpu { id, available: 0 },
            ));
        }
        return Ok(None);
    }
    if let Some(ids) = &request.gpu_ids {
        topology = topology.select(ids)?;
    }
    let source = ModelSource::parse(spec, opts.revision.as_deref())?;
    let files = source.resolve(&opts.hub)?;
    let mut shape = ModelShape::from_config_file(&files.config)?;
    if let Some(dir) = files.weights.first().and_then(|w| w.parent()) {
        shape = shape.with_checkpoint(CheckpointParams::from_dir(dir)?)?;
    }
    let plan = fleet_topology::plan(
        &shape,
        &topology,
        &PlanRequest {
            mode: request.mode,
            dtype: plan_dtype(opts.dtype),
            workload: request.workload,
            max_memory: request.max_memory.clone(),
        },
    )?;
    Ok(Some(plan))
}

/// Loaded replicas of one checkpoint, each on its own device(s).
///
/// The first replica is always loaded in this process (its tokenizer, chat template and config
/// serve the caller). With several GPU replicas, and a program that called
/// [`crate::replica_process::serve_if_replica_worker`], every other replica runs in a child
/// process of its own: GPUs driven from threads of one process contend in the CUDA driver.
pub struct Replicas {
    /// The replicas loaded in this process: the first replica, and all of them when the others
    /// do not run in processes of their own.
    pub models: Vec<TextModel>,
    processes: Vec<Mutex<ReplicaProcess>>,
}

impl Replicas {
    /// Loads one replica of `spec` per device map (`opts.device_map` is ignored). Replicas
    /// after the first start in processes of their own when the program opted in (see
    /// [`crate::replica_process`]) and they use GPUs (`FLEET_REPLICA_PROCESSES=1` forces
    /// processes for CPU replicas too, `0` keeps every replica here); those load in parallel.
    pub fn load(spec: &str, opts: &LoadOptions, maps: &[DeviceMap]) -> Result<Self> {
        let in_processes = crate::replica_process::use_processes(maps);
        let mut processes = Vec::new();
        if in_processes {
            for (i, map) in maps.iter().enumerate().skip(1) {
                tracing::info!("starting replica {i} on {map} in a process of its own");
                processes.push(ReplicaProcess::spawn(
                    crate::replica_process::ReplicaKind::Text,
                    spec,
                    opts,
                    map,
                )?);
            }
        }
        let local_maps = if in_processes { &maps[..1] } else { maps };
        let mut models = Vec::with_capacity(local_maps.len());
        for (i, map) in local_maps.iter().enumerate() {
            tracing::info!("loading replica {i} on {map}");
            let opts = LoadOptions {
                device_map: Some(map.clone()),
                ..opts.clone()
            };
            models.push(TextModel::load(spec, &opts)?);
        }
        for p in processes.iter_mut() {
            p.ready()?;
        }
        Ok(Replicas {
            models,
            processes: processes.into_iter().map(Mutex::new).collect(),
        })
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

    /// Plans on this machine ([`plan_on_this_machine`]) and loads every replica of the plan;
    /// one CPU replica on a machine without GPUs.
    pub fn load_planned(
        spec: &str,
        opts: &LoadOptions,
        request: &PlacementRequest,
    ) -> Result<Self> {
        let maps = match plan_on_this_machine(spec, opts, request)? {
            Some(plan) => {
                tracing::info!("placement plan:\n{plan}");
                plan.replicas.iter().map(|r| r.device_map.clone()).collect()
            }
            None => {
                tracing::warn!("no GPU visible: one replica on the CPU");
                let source = ModelSource::parse(spec, opts.revision.as_deref())?;
                let config = source.resolve(&opts.hub)?.config;
                let layers = crate::QwenConfig::from_file(&config)?.num_hidden_layers;
                vec![DeviceMap::single(DeviceLocation::Cpu, layers)]
            }
        };
        Self::load(spec, opts, &maps)
    }

    /// Generates every request, in batches of at most `max_batch` taken from a shared queue by
    /// the replicas (a faster replica takes more batches). Outputs come back in input order.
    /// A batch that fails on one replica is retried on another; an error names every failure
    /// when a batch failed everywhere.
    pub fn generate(
        &self,
        requests: &[GenerationRequest],
        max_batch: usize,
        progress: bool,
    ) -> Result<Vec<GenerationOutput>> {
        let batches: Vec<&[GenerationRequest]> = requests.chunks(max_batch.max(1)).collect();
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
        batches: &[&[GenerationRequest]],
        progress: bool,
    ) -> Result<Vec<Vec<GenerationOutput>>> {
        let batches = batches.to_vec();
        let local = self
            .models
            .iter()
            .map(Replica::Local)
            .chain(self.processes.iter().map(Replica::Process));
        let workers: Vec<ReplicaWorker<'_>> = local
            .enumerate()
            .map(|(index, replica)| ReplicaWorker { index, replica })
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

/// A replica in this process or in its own.
enum Replica<'a> {
    Local(&'a TextModel),
    Process(&'a Mutex<ReplicaProcess>),
}

/// One replica as a pool worker.
struct ReplicaWorker<'a> {
    index: usize,
    replica: Replica<'a>,
}

impl Worker<&[GenerationRequest], Vec<GenerationOutput>> for ReplicaWorker<'_> {
    fn name(&self) -> String {
        match &self.replica {
            Replica::Local(model) => {
                let devices = model.model.device_map().devices();
                let names: Vec<String> = devices.iter().map(|d| d.to_string()).collect();
                format!("replica {} [{}]", self.index, names.join(","))
            }
            Replica::Process(p) => {
                let p = p.lock().unwrap_or_else(|e| e.into_inner());
                format!("replica {} [{}]", self.index, p.name())
            }
        }
    }

    fn process(
        &mut self,
        batch: &&[GenerationRequest],
    ) -> std::result::Result<Vec<GenerationOutput>, BoxError> {
        Ok(match &self.replica {
            Replica::Local(model) => model.generate(batch, None)?,
            Replica::Process(p) => p
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .generate(batch)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags as typed: every spelling of a mode the planner knows, budgets in accelerate's
    /// style, and errors that name what was wrong.
    #[test]
    fn placement_flags_are_read_as_the_planner_spells_them() {
        let r = PlacementRequest::from_flags(
            "sharded",
            Some(vec![1, 0]),
            Some("0=10GiB"),
            default_workload(4, 1 << 30),
        )
        .unwrap();
        assert_eq!(r.mode, PlanMode::LayerSharded);
        assert_eq!(r.gpu_ids, Some(vec![1, 0]));
        assert_eq!(r.workload.batch, 4);
        assert_ne!(
            format!("{:?}", r.max_memory),
            format!("{:?}", MaxMemory::new())
        );
        let r = PlacementRequest::from_flags("hybrid:2", None, None, Workload::default()).unwrap();
        assert_eq!(
            r.mode,
            PlanMode::Hybrid {
                group_size: Some(2)
            }
        );
        let err = PlacementRequest::from_flags("diagonal", None, None, Workload::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("diagonal"), "{err}");
        assert!(
            PlacementRequest::from_flags("auto", None, Some("0=lots"), Workload::default())
                .is_err()
        );
    }
}
