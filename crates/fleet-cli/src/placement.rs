//! The placement flags, spelled and documented once for every binary.

use fleet_serve::PlacementRequest;
use fleet_topology::{DeviceLocation, Workload};

/// `--device`'s list (`cuda:0,cuda:1`, `cpu`): the devices a model's layers are split over, in
/// order; a device listed twice, or none, is an error naming the flag.
pub fn parse_devices(s: &str) -> anyhow::Result<Vec<DeviceLocation>> {
    let devices: Vec<DeviceLocation> = s
        .split(',')
        .map(|d| d.trim().parse::<DeviceLocation>())
        .collect::<Result<_, _>>()?;
    for (i, d) in devices.iter().enumerate() {
        if devices[..i].contains(d) {
            anyhow::bail!("device {d} is listed twice in --device {s}");
        }
    }
    if devices.is_empty() {
        anyhow::bail!("--device needs at least one device");
    }
    Ok(devices)
}

/// Which GPUs a job may use and how much of each (accelerate's `max_memory`): the part of the
/// placement flags every binary shares, whatever its modes (`#[command(flatten)]`).
#[derive(clap::Args, Debug, Clone, Default, PartialEq)]
pub struct GpuSelectionArgs {
    /// Only these GPUs (comma-separated CUDA indices, after CUDA_VISIBLE_DEVICES).
    #[arg(long, value_delimiter = ',')]
    pub gpu_ids: Option<Vec<usize>>,
    /// Per-device budgets in accelerate's style, e.g. `0=60GiB,1=0.9,cpu=64GiB` (default:
    /// each GPU less 10% or 1 GiB).
    #[arg(long)]
    pub max_memory: Option<String>,
}

/// The placement flags of a job that places an inference model by plan (argo-exp's real
/// runs, edit-score): `--gpu-mode` and the GPU selection.
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct PlacementArgs {
    /// Placement: auto, single, data-parallel (one replica per GPU), layer-sharded or sharded
    /// (one replica over all GPUs) or hybrid[:N] (replicas of N GPUs each).
    #[arg(long, default_value = "auto")]
    pub gpu_mode: String,
    /// The GPUs and their budgets.
    #[command(flatten)]
    pub gpus: GpuSelectionArgs,
}

impl PlacementArgs {
    /// The request the flags make for `workload` (an unknown mode or a budget that does not
    /// parse is an error naming it).
    pub fn request(&self, workload: Workload) -> anyhow::Result<PlacementRequest> {
        Ok(PlacementRequest::from_flags(
            &self.gpu_mode,
            self.gpus.gpu_ids.clone(),
            self.gpus.max_memory.as_deref(),
            workload,
        )?)
    }
}
