//! A job's model on this machine's GPUs: the placement flags, the planner run on the live
//! topology, and the device map of each replica.

use fleet_models::{
    DType, DeviceLocation, DeviceMap, LoadOptions, ModelError, ModelSource, Result,
};
use fleet_topology::{CheckpointParams, ModelShape, Plan, PlanRequest, Topology};
pub use fleet_topology::{MaxMemory, PlanMode, Workload};

use crate::kind::ModelKind;

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
        kv_pool_bytes: None,
        max_attention_bytes: Some(max_attention_bytes),
    }
}

/// The workload of continuous batching: a paged KV pool of `kv_pool_bytes`, and a workspace
/// for one prompt pass — at most [`fleet_models::generation::prefill_pass_tokens`] tokens, or
/// one prompt of up to 4096 alone — with its attention scores under `max_attention_bytes`. The
/// decode slots do not enter it: a decode step of any number of rows needs far less than a
/// prompt pass.
pub fn paged_workload(kv_pool_bytes: u64, max_attention_bytes: u64) -> Workload {
    const SEQ_LEN: usize = 4096;
    Workload {
        batch: fleet_models::generation::prefill_pass_tokens()
            .div_ceil(SEQ_LEN)
            .max(1),
        seq_len: SEQ_LEN,
        full_logits: false,
        max_attention_bytes: Some(max_attention_bytes),
        kv_pool_bytes: Some(kv_pool_bytes),
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

/// The device maps of the replicas of checkpoint `spec` (a model of kind `K`) on this machine:
/// the planner's ([`plan_on_this_machine`]: `--gpu-mode`, `--gpu-ids`, `max_memory`; one
/// replica per GPU, or per GPU group when the model does not fit one), with the plan; one CPU
/// map (and no plan) on a machine without GPUs.
pub fn device_maps<K: ModelKind>(
    spec: &str,
    opts: &LoadOptions,
    request: &PlacementRequest,
) -> Result<(Vec<DeviceMap>, Option<Plan>)> {
    match plan_on_this_machine(spec, opts, request)? {
        Some(plan) => Ok((
            plan.replicas.iter().map(|r| r.device_map.clone()).collect(),
            Some(plan),
        )),
        None => {
            let source = ModelSource::parse(spec, opts.revision.as_deref())?;
            let config = source.resolve(&opts.hub)?.config;
            let layers = K::layers(&config)?;
            Ok((vec![DeviceMap::single(DeviceLocation::Cpu, layers)], None))
        }
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
