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

use fleet_dist::{BoxError, ItemResult, PoolOptions, ReplicaPool, Worker};
use fleet_topology::{CheckpointParams, ModelShape, Plan, PlanRequest, Topology};
pub use fleet_topology::{MaxMemory, PlanMode, Workload};

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
        if let Some(ids) = &request.gpu_ids {
            return Err(ModelError::Topology(
                fleet_topology::TopologyError::UnknownGpu {
                    id: ids.first().copied().unwrap_or(0),
                    available: 0,
                },
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
pub struct Replicas {
    /// One model per replica.
    pub models: Vec<TextModel>,
}

impl Replicas {
    /// Loads one replica of `spec` per device map (`opts.device_map` is ignored).
    pub fn load(spec: &str, opts: &LoadOptions, maps: &[DeviceMap]) -> Result<Self> {
        let mut models = Vec::with_capacity(maps.len());
        for (i, map) in maps.iter().enumerate() {
            tracing::info!("loading replica {i} on {map}");
            let opts = LoadOptions {
                device_map: Some(map.clone()),
                ..opts.clone()
            };
            models.push(TextModel::load(spec, &opts)?);
        }
        Ok(Replicas { models })
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
        let workers: Vec<ReplicaWorker<'_>> = self
            .models
            .iter()
            .enumerate()
            .map(|(i, model)| ReplicaWorker { index: i, model })
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

/// One replica as a pool worker.
struct ReplicaWorker<'a> {
    index: usize,
    model: &'a TextModel,
}

impl Worker<&[GenerationRequest], Vec<GenerationOutput>> for ReplicaWorker<'_> {
    fn name(&self) -> String {
        let devices = self.model.model.device_map().devices();
        let names: Vec<String> = devices.iter().map(|d| d.to_string()).collect();
        format!("replica {} [{}]", self.index, names.join(","))
    }

    fn process(
        &mut self,
        batch: &&[GenerationRequest],
    ) -> std::result::Result<Vec<GenerationOutput>, BoxError> {
        Ok(self.model.generate(batch, None)?)
    }
}
