//! The placement flags, spelled, documented and parsed once for every binary.

use fleet_models::DType;
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

/// `--dtype`'s help where a command fixes its default (`mut_arg`) instead of choosing it by
/// where the model goes.
pub const FIXED_DTYPE_HELP: &str = "Compute dtype: bf16, f16 or f32.";

/// Which GPUs a job may use and how much of each (accelerate's `max_memory`).
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

/// The placement flags of all four binaries (`#[command(flatten)]`): where a model goes — by
/// hand (`--device`) or by plan (`--gpu-mode`, `--gpu-ids`, `--max-memory`) — and in what
/// dtype.
///
/// A binary gives a flag its own default or help with clap's `mut_arg` on its command
/// (`fleet generate` runs on `cpu` in f32 unless told otherwise, the benchmarks on `cuda:0` in
/// bf16); the spelling, the parsing and the errors stay here. A command that places only by
/// hand refuses the plan flags ([`PlacementArgs::by_hand`]) and hides them; one that places only
/// by plan reads `--device` as the plan it names ([`PlacementArgs::request`]).
#[derive(clap::Args, Debug, Clone, Default, PartialEq)]
pub struct PlacementArgs {
    /// Device(s): `cpu`, `cuda:0`, or a comma list such as `cuda:0,cuda:1` to split the layers
    /// over several GPUs in contiguous ranges (one replica). For a job that places by plan,
    /// `cuda:N` is `--gpu-mode single --gpu-ids N` and a list is `--gpu-mode layer-sharded`
    /// over those GPUs.
    #[arg(long, conflicts_with_all = ["gpu_mode", "gpu_ids"])]
    pub device: Option<String>,
    /// Compute dtype: bf16, f16 or f32; without it bf16 when the model goes on GPUs, f32 on the
    /// CPU (where bf16 is several times slower).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Placement by plan (default auto): auto, single, data-parallel (one replica per GPU),
    /// layer-sharded or sharded (one replica over all GPUs) or hybrid[:N] (replicas of N GPUs
    /// each).
    // The text is also --help's, where `hybrid[:N]` must read as written (not a doc link).
    #[allow(rustdoc::broken_intra_doc_links)]
    #[arg(long)]
    pub gpu_mode: Option<String>,
    /// The GPUs and their budgets.
    #[command(flatten)]
    pub gpus: GpuSelectionArgs,
}

impl PlacementArgs {
    /// `--gpu-mode`, `auto` when not given.
    pub fn gpu_mode(&self) -> &str {
        self.gpu_mode.as_deref().unwrap_or("auto")
    }

    /// `--device`'s list, if given.
    pub fn devices(&self) -> anyhow::Result<Option<Vec<DeviceLocation>>> {
        self.device.as_deref().map(parse_devices).transpose()
    }

    /// `--dtype`, or the default for where the model goes ([`fleet_models::dtype_or_default`]).
    pub fn dtype_or_default(&self, on_gpus: bool) -> anyhow::Result<DType> {
        Ok(fleet_models::dtype_or_default(
            self.dtype.as_deref(),
            on_gpus,
        )?)
    }

    /// The devices and dtype of a command that places by hand (`command` names it in the
    /// error): the plan flags are refused rather than ignored. `--device` and `--dtype` must
    /// have defaults (the command's `mut_arg`).
    pub fn by_hand(&self, command: &str) -> anyhow::Result<(Vec<DeviceLocation>, DType)> {
        self.refuse_plan_flags(command)?;
        let device = self.device.as_deref().unwrap_or("cpu");
        let devices = parse_devices(device)?;
        let on_gpus = devices.iter().any(|d| d.cuda_ordinal().is_some());
        Ok((devices, self.dtype_or_default(on_gpus)?))
    }

    /// An error naming the first plan flag given to `command`, which places by hand.
    pub fn refuse_plan_flags(&self, command: &str) -> anyhow::Result<()> {
        let plan_flags = [
            ("--gpu-mode", self.gpu_mode.is_some()),
            ("--gpu-ids", self.gpus.gpu_ids.is_some()),
            ("--max-memory", self.gpus.max_memory.is_some()),
        ];
        if let Some((flag, _)) = plan_flags.iter().find(|(_, given)| *given) {
            anyhow::bail!(
                "{command} places its model by hand: {flag} does not apply; name the devices \
                 with --device (e.g. cuda:0,cuda:1)"
            );
        }
        Ok(())
    }

    /// The plan the flags ask for: `--gpu-mode` over `--gpu-ids`, or else the one replica
    /// that `--device` names (a default `--device` a command sets never outranks a given
    /// `--gpu-mode`, which clap keeps from being given with it). `--device cpu` is not a plan:
    /// run with `CUDA_VISIBLE_DEVICES=` to place on the CPU.
    pub fn plan_mode_and_gpus(&self) -> anyhow::Result<(String, Option<Vec<usize>>)> {
        self.mode_and_gpus(|ids| {
            Ok(if ids.len() == 1 {
                "single"
            } else {
                "layer-sharded"
            }
            .to_string())
        })
    }

    /// `--gpu-mode` over `--gpu-ids`, or else the mode `mode_of` gives `--device`'s GPUs (in
    /// order) and those GPUs — for a job whose modes are its own (gspo-train's presets).
    /// `--device cpu` is an error: run with `CUDA_VISIBLE_DEVICES=` to place on the CPU.
    pub fn mode_and_gpus(
        &self,
        mode_of: impl FnOnce(&[usize]) -> anyhow::Result<String>,
    ) -> anyhow::Result<(String, Option<Vec<usize>>)> {
        let devices = match &self.gpu_mode {
            Some(_) => None,
            None => self.devices()?,
        };
        let Some(devices) = devices else {
            return Ok((self.gpu_mode().to_string(), self.gpus.gpu_ids.clone()));
        };
        let ids: Vec<usize> = devices
            .iter()
            .map(|d| {
                d.cuda_ordinal().ok_or_else(|| {
                    anyhow::anyhow!(
                        "--device {}: this job places its model on GPUs by plan; to run it on \
                         the CPU, hide the GPUs (CUDA_VISIBLE_DEVICES=) and leave out --device",
                        self.device.as_deref().unwrap_or_default()
                    )
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok((mode_of(&ids)?, Some(ids)))
    }

    /// The request the flags make for `workload` (an unknown mode or a budget that does not
    /// parse is an error naming it).
    pub fn request(&self, workload: Workload) -> anyhow::Result<PlacementRequest> {
        let (mode, gpu_ids) = self.plan_mode_and_gpus()?;
        Ok(PlacementRequest::from_flags(
            &mode,
            gpu_ids,
            self.gpus.max_memory.as_deref(),
            workload,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        placement: PlacementArgs,
    }

    fn parse(args: &[&str]) -> Result<PlacementArgs, clap::Error> {
        let mut argv = vec!["test"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).map(|c| c.placement)
    }

    #[test]
    fn device_names_the_plan_of_one_replica() {
        let p = parse(&["--device", "cuda:1"]).unwrap();
        assert_eq!(
            p.plan_mode_and_gpus().unwrap(),
            ("single".into(), Some(vec![1]))
        );
        let p = parse(&["--device", "cuda:2,cuda:0"]).unwrap();
        assert_eq!(
            p.plan_mode_and_gpus().unwrap(),
            ("layer-sharded".into(), Some(vec![2, 0]))
        );
        let p = parse(&["--gpu-ids", "0,1"]).unwrap();
        assert_eq!(
            p.plan_mode_and_gpus().unwrap(),
            ("auto".into(), Some(vec![0, 1]))
        );
        let err = parse(&["--device", "cpu"])
            .unwrap()
            .plan_mode_and_gpus()
            .unwrap_err();
        assert!(err.to_string().contains("CUDA_VISIBLE_DEVICES"), "{err}");
    }

    #[test]
    fn device_conflicts_with_the_plan_flags() {
        assert!(parse(&["--device", "cuda:0", "--gpu-mode", "single"]).is_err());
        assert!(parse(&["--device", "cuda:0", "--gpu-ids", "0"]).is_err());
    }

    #[test]
    fn by_hand_refuses_plan_flags_and_defaults_dtype_to_the_device() {
        let err = parse(&["--max-memory", "0=10GiB"])
            .unwrap()
            .by_hand("fleet logits")
            .unwrap_err();
        assert!(err.to_string().contains("--max-memory"), "{err}");
        let (devices, dtype) = parse(&[]).unwrap().by_hand("x").unwrap();
        assert_eq!((devices, dtype), (vec![DeviceLocation::Cpu], DType::F32));
        let (devices, dtype) = parse(&["--device", "cuda:0"])
            .unwrap()
            .by_hand("x")
            .unwrap();
        assert_eq!(
            (devices, dtype),
            (vec![DeviceLocation::Cuda(0)], DType::BF16)
        );
    }
}
