//! Devices and placement for fleet.
//!
//! This is the lowest crate of the workspace: it holds facts (which devices exist, how much memory
//! they have) and plans (which device holds which part of a model), and no model code. The model
//! loader in `fleet-models` consumes a [`DeviceMap`] and builds every block on the device it names.
//!
//! # Module map
//!
//! * `device_map` — [`DeviceLocation`] (`cpu`, `cuda:N`) and [`DeviceMap`] (embedding, each
//!   decoder layer, final norm + head).
//! * `discover` — the GPUs of this machine through the CUDA driver (feature `cuda`), with peer
//!   access; [`enable_peer_access`].
//! * `topology` — [`Topology`]: GPUs to plan on, from TOML (`configs/topologies/`) or from
//!   discovery; `--gpu-ids` selection.
//! * [`logical`] — logical devices: several `cuda:N` on one physical GPU, each with its own
//!   stream and memory cap ([`logical::LogicalGpus`], from `--logical-gpus` or a topology
//!   file's `[[logical]]` entries), always labelled as such; [`discover`] reports them once
//!   installed.
//! * `checkpoint` — [`CheckpointParams`]: exact parameter counts per part from safetensors
//!   headers.
//! * `memory` — [`ModelShape`] from config.json (dense, MoE, vision towers, classification
//!   heads of reward models) and the inference memory model: weights, KV cache, workspace per
//!   device ([`DeviceCost`]).
//! * `training` — the training memory model: [`TrainingWorkload`] and what each role of a GSPO
//!   step needs on a device ([`RoleCost`]: f32 master weights, gradients, AdamW moments, the
//!   rollout copy and KV cache, activations with or without gradient checkpointing); the
//!   activation constants in one place ([`C_FORWARD`], [`C_PEAK`]).
//! * `budget` — [`MaxMemory`]: accelerate-style `max_memory` budgets and the default reserve.
//! * `planner` — [`plan`]: inference replicas (modes single, data-parallel, layer-sharded,
//!   hybrid, auto).
//! * `training_plan` — [`plan_training`]: the policy, reference and reward model of a GSPO run
//!   placed by preset (`1gpu`, `2gpu`, `3gpu`, `auto`), each device's sum over roles checked
//!   against its budget ([`TrainingPlan`]).

mod budget;
mod checkpoint;
mod device_map;
mod discover;
pub mod logical;
mod memory;
mod memory_watch;
mod planner;
mod topology;
mod training;
mod training_plan;

pub use budget::{default_reserve, parse_bytes, MaxMemory, MemoryLimit};
pub use checkpoint::CheckpointParams;
pub use device_map::{DeviceLocation, DeviceMap};
pub use discover::{discover, enable_peer_access, gpu_memory_info, DeviceInfo};
pub use memory::{
    format_bytes, DType, DeviceCost, DevicePart, ModelShape, MoeShape, VisionShape, Workload,
    CONTEXT_OVERHEAD_BYTES, GIB, MIB,
};
pub use memory_watch::{
    cpu_peak_bytes, gpu_pool_high_water, gpu_used_bytes, reset_gpu_pool_high_water, MemoryWatch,
};
pub use planner::{plan, DevicePlan, Plan, PlanMode, PlanRequest, ReplicaPlan};
pub use topology::{Gpu, PeerAccess, Topology};
pub use training::{
    ActivationBytes, ActivationCoefficients, BlockCoefficients, RoleCost, TrainingWorkload,
    ADAM_MOMENT_BYTES, ALLOCATOR_SLACK_PERCENT, BLOCK_WEIGHT_COPIES, CHECKPOINT_STORED_TENSORS,
    C_FORWARD, C_PEAK, FROZEN_LOGIT_CHUNK_TENSORS, GRADIENT_BYTES, LOGIT_CHUNK_TENSORS,
    LOGPROB_TENSORS, MASTER_WEIGHT_BYTES, TRAINING_CONTEXT_BYTES,
};
pub use training_plan::{
    plan_training, RolePlacement, TrainingDevicePlan, TrainingPlan, TrainingPreset,
    TrainingRequest, TrainingRole,
};

/// Errors of this crate. Each message names the value at fault and what to change.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// A device string such as `cuda:7` did not parse.
    #[error("device `{value}` is not a device: write `cpu`, `cuda` or `cuda:N` (N = GPU index)")]
    BadDevice {
        /// The string as given.
        value: String,
    },
    /// A device map does not cover the model's layers.
    #[error("device map has {got} layer entries but the model has {expected} layers")]
    LayerCountMismatch {
        /// Layers named by the map.
        got: usize,
        /// Layers in the model.
        expected: usize,
    },
    /// A layer split was asked for with no device to put layers on.
    #[error("a device map needs at least one device")]
    NoDevices,
    /// More groups than layers.
    #[error("cannot split {layers} layers over {groups} devices: use at most {layers} devices")]
    TooManyGroups {
        /// Layers in the model.
        layers: usize,
        /// Devices asked for.
        groups: usize,
    },
    /// The CUDA driver failed while discovering devices.
    #[error("CUDA driver error while reading device {ordinal}: {message}")]
    Driver {
        /// GPU index.
        ordinal: usize,
        /// The driver's message.
        message: String,
    },
    /// A file could not be read.
    #[error("cannot read `{file}`: {message}")]
    Io {
        /// The path.
        file: String,
        /// The OS error.
        message: String,
    },
    /// Logical devices that cannot be had: no GPU, a GPU index that does not exist, caps the
    /// GPU cannot hold, a flag that does not parse.
    #[error("logical devices ({request}): {message}")]
    LogicalDevices {
        /// The request: `--logical-gpus ...` or the topology file.
        request: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// A topology TOML file is malformed.
    #[error("topology file `{file}`, field `{field}`: {message}")]
    TopologyFile {
        /// The path (or the name given to the text).
        file: String,
        /// The field at fault, e.g. `gpu[0].memory`.
        field: String,
        /// What is wrong and what to write instead.
        message: String,
    },
    /// A safetensors file whose header cannot be read.
    #[error("checkpoint `{file}`: {message}")]
    Checkpoint {
        /// The file or directory.
        file: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// A model config.json lacks a field the planner needs, or has a bad value.
    #[error("model config `{file}`, field `{field}`: {message}")]
    ModelConfig {
        /// The path (or the name given to the text).
        file: String,
        /// The field at fault.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A memory size or budget value did not parse.
    #[error("memory value `{value}` does not parse: {reason}")]
    BadMemorySize {
        /// The value as given.
        value: String,
        /// What is wrong and what to write.
        reason: String,
    },
    /// A max_memory key is not a device.
    #[error("max_memory key `{key}` is not a device: write `0`, `cuda:0` or `cpu`, as in `0=10GiB,cpu=64GiB`")]
    BadMaxMemoryKey {
        /// The key (or the whole entry) as given.
        key: String,
    },
    /// A dtype name did not parse.
    #[error("dtype `{value}` is not one of bf16, f16, f32")]
    BadDType {
        /// The value as given.
        value: String,
    },
    /// A plan mode did not parse.
    #[error("plan mode `{value}` is not one of single, data-parallel, layer-sharded, hybrid, hybrid:N (N >= 1), auto")]
    BadMode {
        /// The value as given.
        value: String,
    },
    /// A workload has a zero batch or sequence length (or, for training, a zero count).
    #[error("workload {field} = {value}: it must be at least 1")]
    BadWorkload {
        /// `batch`, `seq_len`, or the [`TrainingWorkload`] field.
        field: &'static str,
        /// The value given.
        value: usize,
    },
    /// A GPU id asked for where the GPUs are numbered `0..available` (a machine's discovered
    /// GPUs; none at all on a machine without GPUs).
    #[error("GPU {id} does not exist: {}", match available {
        0 => "there is no GPU".to_string(),
        1 => "there is 1 GPU (id 0)".to_string(),
        n => format!("there are {}", gpus_text(&(0..*n).collect::<Vec<_>>())),
    })]
    UnknownGpu {
        /// The id asked for.
        id: usize,
        /// GPUs in the topology.
        available: usize,
    },
    /// A GPU id selected (`--gpu-ids`) that the topology does not have.
    #[error(
        "GPU {id} is not in topology `{topology}`, which has {}: list only those in --gpu-ids",
        gpus_text(ids)
    )]
    GpuNotInTopology {
        /// The id asked for.
        id: usize,
        /// The topology's name.
        topology: String,
        /// The GPU ids it has.
        ids: Vec<usize>,
    },
    /// A max_memory entry for a GPU that is not among the GPUs planned on.
    #[error("max_memory entry for cuda:{id}: GPU {id} is not among the GPUs planned on, which are {}; give budgets only to those (--max-memory keys are GPU ids as --gpu-ids lists them, not renumbered)", gpus_text(ids))]
    MaxMemoryGpuNotPlanned {
        /// The GPU id of the entry.
        id: usize,
        /// The GPU ids planned on.
        ids: Vec<usize>,
    },
    /// Two max_memory entries for one device.
    #[error("max_memory has two entries for {device} (keys `{first}` and `{second}`): give each device one budget")]
    DuplicateMaxMemoryKey {
        /// The device both keys name.
        device: DeviceLocation,
        /// The first key as given.
        first: String,
        /// The second key as given.
        second: String,
    },
    /// A max_memory entry of no memory at all.
    #[error("max_memory entry `{key}={value}` gives {device} no memory: {}", zero_budget_hint(*device))]
    ZeroBudget {
        /// The device.
        device: DeviceLocation,
        /// The key as given (`0`, `cuda:0`, `cpu`).
        key: String,
        /// The value as given.
        value: String,
    },
    /// A GPU id was given twice.
    #[error("GPU {id} is listed twice in the GPU ids: list each GPU once")]
    DuplicateGpu {
        /// The id.
        id: usize,
    },
    /// A hybrid group is larger than the GPUs there are.
    #[error("hybrid group size {group_size} is larger than the {gpus} GPUs available: use hybrid:{gpus} or fewer, or layer-sharded")]
    GroupTooLarge {
        /// GPUs per replica asked for.
        group_size: usize,
        /// GPUs available.
        gpus: usize,
    },
    /// The topology has no GPU to plan on.
    #[error("topology `{topology}` has no GPU: add a [[gpu]] entry, or allow cpu offload with an entry such as cpu=64GiB in --max-memory")]
    NoGpus {
        /// The topology's name.
        topology: String,
    },
    /// A training preset did not parse.
    #[error("training preset `{value}` is not one of 1gpu, 2gpu, 3gpu, auto")]
    BadTrainingPreset {
        /// The value as given.
        value: String,
    },
    /// A training preset needs more GPUs than the topology has.
    #[error("training preset {preset} places models on {needed} GPUs but there {}: use --gpu-mode {} or auto, or list more GPUs in --gpu-ids", match available {
        0 => "is no GPU".to_string(),
        1 => "is 1".to_string(),
        n => format!("are {n}"),
    }, if *available >= 2 { "2gpu" } else { "1gpu" })]
    PresetNeedsGpus {
        /// The preset.
        preset: String,
        /// GPUs it places models on.
        needed: usize,
        /// GPUs planned on.
        available: usize,
    },
    /// The model fits nowhere in the budgets.
    #[error("{model} does not fit ({mode} mode): {detail}")]
    DoesNotFit {
        /// The model, e.g. `qwen2 (32.8B parameters)`.
        model: String,
        /// The mode planned in (for a training plan, its preset).
        mode: String,
        /// Bytes one replica needs on a single device (for a training plan: every role on
        /// one device).
        needed_bytes: u64,
        /// Budget of each device considered.
        available: Vec<(DeviceLocation, u64)>,
        /// Needs, budgets and the ways out, in words.
        detail: String,
    },
}

/// A config.json that fleet-config could not read: [`TopologyError::Io`], or
/// [`TopologyError::ModelConfig`] naming the field (`(json)` for a file that does not parse).
impl From<fleet_config::ConfigError> for TopologyError {
    fn from(e: fleet_config::ConfigError) -> Self {
        use fleet_config::ConfigError as C;
        let file = |path: &std::path::Path| path.display().to_string();
        match e {
            C::Io { path, source } => TopologyError::Io {
                file: file(&path),
                message: source.to_string(),
            },
            C::BadJson { path, message } => TopologyError::ModelConfig {
                file: file(&path),
                field: "(json)".into(),
                message: format!("not valid config.json: {message}"),
            },
            C::BadConfig {
                path,
                field,
                value,
                hint,
            } => TopologyError::ModelConfig {
                file: file(&path),
                field,
                message: format!("{value}: {hint}"),
            },
            C::UnsupportedArchitecture {
                path,
                arch,
                supported,
            } => TopologyError::ModelConfig {
                file: file(&path),
                field: "model_type".into(),
                message: format!("`{arch}` is not supported; fleet runs {supported}"),
            },
        }
    }
}

/// `no GPU`, `1 GPU (id 0)`, `8 GPUs (ids 0-7)`, `2 GPUs (ids 3, 5)`: GPU ids for messages,
/// runs of consecutive ids written as ranges.
fn gpus_text(ids: &[usize]) -> String {
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let mut j = i;
        while j + 1 < ids.len() && ids[j + 1] == ids[j] + 1 {
            j += 1;
        }
        runs.push(match j - i {
            0 => ids[i].to_string(),
            1 => format!("{}, {}", ids[i], ids[j]),
            _ => format!("{}-{}", ids[i], ids[j]),
        });
        i = j + 1;
    }
    match ids.len() {
        0 => "no GPU".into(),
        1 => format!("1 GPU (id {})", runs[0]),
        n => format!("{n} GPUs (ids {})", runs.join(", ")),
    }
}

/// What to do instead of a zero budget on `device`.
fn zero_budget_hint(device: DeviceLocation) -> &'static str {
    match device {
        DeviceLocation::Cpu => {
            "to offload nothing, leave the cpu entry out; to offload, give a size such as cpu=64GiB"
        }
        DeviceLocation::Cuda(_) => {
            "a GPU with no memory cannot hold anything; to leave the GPU out, list the GPUs to use with --gpu-ids instead, or give it a size such as 10GiB or a fraction such as 0.9"
        }
    }
}
