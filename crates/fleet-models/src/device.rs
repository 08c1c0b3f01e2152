//! From fleet-topology's device names to candle devices, and which dtypes each can run.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use fleet_topology::{DeviceLocation, DeviceMap};

use crate::error::{ModelError, Result};

/// One candle [`Device`] per distinct location of a map. candle tells devices apart by
/// identity, so every block placed on `cuda:1` must share the same `Device` value.
#[derive(Clone)]
pub struct Devices {
    by_location: BTreeMap<DeviceLocation, Device>,
}

impl Devices {
    /// Opens every device the map names and checks that each can compute in `dtype`.
    pub fn open(map: &DeviceMap, dtype: DType) -> Result<Self> {
        let mut by_location = BTreeMap::new();
        for loc in map.devices() {
            let dev = open_device(loc)?;
            check_dtype(&dev, loc, dtype)?;
            by_location.insert(loc, dev);
        }
        // Hidden states cross between the GPUs of a map: let them copy directly.
        let gpus: Vec<usize> = by_location
            .keys()
            .filter_map(|l| l.cuda_ordinal())
            .collect();
        // FLEET_PEER_ACCESS=0 leaves peer access off, to measure what it saves.
        let peer_access_off = std::env::var("FLEET_PEER_ACCESS").is_ok_and(|v| v == "0");
        if gpus.len() > 1 && !peer_access_off {
            let pairs = fleet_topology::enable_peer_access(&gpus)?;
            tracing::info!("peer access enabled between GPU pairs {pairs:?}");
        }
        Ok(Devices { by_location })
    }

    /// The device at `loc` (which must be one of the map's).
    pub fn get(&self, loc: DeviceLocation) -> &Device {
        &self.by_location[&loc]
    }

    /// All opened devices.
    pub fn iter(&self) -> impl Iterator<Item = (&DeviceLocation, &Device)> {
        self.by_location.iter()
    }
}

/// Opens one device with an error that says what to do when it is not there.
///
/// A GPU is opened once per process with a stream of its own (`Device::new_cuda_with_stream`),
/// and every later call returns that device: all of fleet's work on one GPU — every model,
/// the NCCL collective — is ordered on one stream. Not CUDA's per-thread default stream
/// (candle's `Device::new_cuda`): its handle means "this thread's stream of the *current*
/// context", and cudarc frees a buffer on its stream's handle without making the buffer's
/// context current, so with two GPUs in one thread a buffer of one was freed in the order of
/// the other's stream and its memory handed out again while still being read (gradients,
/// hidden states and sampled tokens were wrong on two H100s, never on one GPU).
///
/// With logical devices installed ([`fleet_topology::logical`]), `cuda:N` is logical device N:
/// a stream of its own on its physical GPU, so that work on two logical devices is ordered
/// only as work on two GPUs is, with its memory pool capped; also opened once per process.
pub fn open_device(loc: DeviceLocation) -> Result<Device> {
    match loc {
        DeviceLocation::Cpu => Ok(Device::Cpu),
        DeviceLocation::Cuda(n) => {
            if !candle_core::utils::cuda_is_available() {
                return Err(ModelError::DeviceUnavailable {
                    device: loc.to_string(),
                    hint: "this build has no GPU support: rebuild with `--features cuda` (docs/gpu.md), or use --device cpu".into(),
                });
            }
            let unavailable = |e: candle_core::Error| {
                ModelError::DeviceUnavailable {
                device: loc.to_string(),
                hint: format!("{e}; `fleet devices` lists the GPUs this process can see (CUDA_VISIBLE_DEVICES applies)"),
            }
            };
            let logical = fleet_topology::logical::installed();
            let key = (logical.is_some(), n);
            // Held until the device is in the map: two threads opening one GPU get one stream.
            let mut opened = opened();
            if let Some(dev) = opened.get(&key) {
                return Ok(dev.clone());
            }
            let dev = match logical {
                None => Device::new_cuda_with_stream(n).map_err(unavailable)?,
                Some(logical) => {
                    let physical =
                        logical
                            .physical_of(n)
                            .ok_or_else(|| ModelError::DeviceUnavailable {
                                device: loc.to_string(),
                                hint: format!(
                                    "there are {} logical devices ({}): use cuda:0..cuda:{}",
                                    logical.devices.len(),
                                    logical.source,
                                    logical.devices.len().saturating_sub(1)
                                ),
                            })?;
                    tracing::info!(
                        "{loc}: a stream of its own on GPU {physical} ({})",
                        fleet_topology::logical::LABEL
                    );
                    let dev = Device::new_cuda_with_stream(physical).map_err(unavailable)?;
                    cap_logical(&dev, loc, physical)?;
                    dev
                }
            };
            skip_event_tracking(&dev);
            opened.insert(key, dev.clone());
            Ok(dev)
        }
    }
}

/// The GPUs opened so far, by (logical, ordinal): one stream per GPU (and one memory pool per
/// logical `cuda:N`) for the whole process, whichever model asks for it (a policy and a
/// reference model on one GPU share it), so that their work is ordered and a logical cap
/// holds for all.
fn opened() -> std::sync::MutexGuard<'static, BTreeMap<(bool, usize), Device>> {
    static OPENED: std::sync::Mutex<BTreeMap<(bool, usize), Device>> =
        std::sync::Mutex::new(BTreeMap::new());
    OPENED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Gives logical device `loc`'s stream its memory cap ([`fleet_topology::logical::pool`]).
fn cap_logical(dev: &Device, loc: DeviceLocation, physical: usize) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(cuda), Some(n)) = (dev, loc.cuda_ordinal()) {
        let (_, cap) =
            fleet_topology::gpu_memory_info(n)?.ok_or_else(|| ModelError::DeviceUnavailable {
                device: loc.to_string(),
                hint: "the driver reports no memory for it".into(),
            })?;
        fleet_topology::logical::pool::cap_stream(
            loc,
            physical,
            cap,
            cuda.cuda_stream().cu_stream(),
        )?;
        tracing::info!("{loc}: allocations capped at {cap} bytes (a memory pool of its own)");
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (dev, loc, physical);
    Ok(())
}

/// Turns off cudarc's per-allocation CUDA events on `dev`.
///
/// cudarc creates two CUDA events for every buffer it allocates (and destroys them when the
/// buffer is freed) so that it can order buffers shared between streams. fleet runs each
/// device's work on one stream ([`open_device`]: one per GPU, or per logical device), and
/// orders every copy between devices itself ([`transfer`], both ways), so the events are not
/// needed: four driver calls per tensor for nothing. With several GPUs
/// driven from one process those calls contend inside the driver.
/// `FLEET_CUDA_EVENTS=1` keeps them, to measure what this saves.
fn skip_event_tracking(dev: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = dev {
        let keep = std::env::var("FLEET_CUDA_EVENTS").is_ok_and(|v| v == "1");
        if !keep {
            // SAFETY: the events only order work between streams of one context (cudarc's
            // multi-stream mode): between logical devices' streams fleet's `transfer` orders
            // every copy both ways, and no buffer is used on another stream without it.
            unsafe { cuda.disable_event_tracking() };
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = dev;
}

/// [`transfer`]'s waits: bit 0 the destination's wait for the source, bit 1 the source's wait
/// for the copy; 0 until first read from `FLEET_TRANSFER_WAITS`.
static TRANSFER_WAITS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
const WAITS_SET: u8 = 4;

/// Which of [`transfer`]'s two waits run: `(destination waits for the source, source waits for
/// the copy)`. Both, except where a test turns one off ([`set_transfer_waits`], or
/// `FLEET_TRANSFER_WAITS=no-destination-wait` / `no-source-wait` for a whole process) to show
/// that the stand-in for several GPUs (logical devices on one) catches the race it prevents.
pub fn transfer_waits() -> (bool, bool) {
    use std::sync::atomic::Ordering;
    let mut w = TRANSFER_WAITS.load(Ordering::Relaxed);
    if w == 0 {
        w = WAITS_SET
            | match std::env::var("FLEET_TRANSFER_WAITS").as_deref() {
                Ok("no-destination-wait") => 2,
                Ok("no-source-wait") => 1,
                _ => 3,
            };
        if w & 3 != 3 {
            tracing::warn!("FLEET_TRANSFER_WAITS: a wait of copies between devices is off (a test of the race)");
        }
        TRANSFER_WAITS.store(w, Ordering::Relaxed);
    }
    (w & 1 != 0, w & 2 != 0)
}

/// Test-only switch: sets [`transfer`]'s waits for the whole process (see [`transfer_waits`]).
/// Never turn a wait off outside a test of the race it prevents.
#[doc(hidden)]
pub fn set_transfer_waits(destination_waits: bool, source_waits: bool) {
    let w = WAITS_SET | u8::from(destination_waits) | (u8::from(source_waits) << 1);
    TRANSFER_WAITS.store(w, std::sync::atomic::Ordering::Relaxed);
}

/// `t` on `dev`, safe to use while the caller runs ahead of the GPUs. It orders both ways,
/// whatever the devices (two GPUs, or two logical devices of one GPU: DESIGN's invariant 7):
///
/// - the destination's stream waits for the source's stream before it copies: between two GPUs
///   cudarc waits for the source's writes itself, but between two streams of one context
///   (logical devices; cudarc's event tracking is off, `skip_event_tracking`) nothing would,
///   and the copy could read the source before it is written;
/// - the source's stream waits for the copy: candle frees the source buffer on the source's
///   stream as soon as the tensor is dropped, and work queued later there (the next
///   micro-batch, the next chunk of the head) could be given that memory and overwrite it before
///   the destination's stream, still busy with earlier work, performs the copy (a sharded
///   policy's gradients came back NaN).
///
/// No host sync.
pub fn transfer(t: &Tensor, dev: &Device) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    let cuda_pair = match (t.device(), dev) {
        (Device::Cuda(src), Device::Cuda(dst)) if !t.device().same_device(dev) => {
            Some((src.clone(), dst.clone()))
        }
        _ => None,
    };
    #[cfg(feature = "cuda")]
    let (wait_for_source, wait_for_copy) = transfer_waits();
    #[cfg(feature = "cuda")]
    let cuda_err = |e: candle_core::cuda_backend::cudarc::driver::DriverError| {
        candle_core::Error::Cuda(Box::new(e))
    };
    #[cfg(feature = "cuda")]
    if let (Some((src, dst)), true) = (&cuda_pair, wait_for_source) {
        let written = src.cuda_stream().record_event(None).map_err(cuda_err)?;
        dst.cuda_stream().wait(&written).map_err(cuda_err)?;
    }
    let out = t.to_device(dev)?;
    #[cfg(feature = "cuda")]
    if let (Some((src, dst)), true) = (&cuda_pair, wait_for_copy) {
        let copied = dst.cuda_stream().record_event(None).map_err(cuda_err)?;
        src.cuda_stream().wait(&copied).map_err(cuda_err)?;
    }
    Ok(out)
}

/// The compute dtype when `--dtype` is not given, and why: bf16 when the work goes on GPUs,
/// f32 on the CPU (where bf16 is several times slower).
pub fn default_dtype(gpus: bool) -> (DType, &'static str) {
    if gpus {
        (DType::BF16, "GPUs present")
    } else {
        (
            DType::F32,
            "no GPU; bf16 is several times slower on the CPU",
        )
    }
}

/// A binary's `--dtype` if given, else [`default_dtype`], said on stderr with the reason (every
/// binary and job that loads a model for the user says it the same way).
pub fn dtype_or_default(flag: Option<&str>, gpus: bool) -> Result<DType> {
    Ok(match flag {
        Some(d) => parse_dtype(d)?,
        None => {
            let (dtype, why) = default_dtype(gpus);
            eprintln!("dtype {} ({why}; --dtype to choose)", dtype.as_str());
            dtype
        }
    })
}

/// Parses `f32`, `f16`, `bf16` (and the transformers spellings `float32`, `bfloat16`, …).
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s.trim().to_ascii_lowercase().as_str() {
        "f32" | "float32" | "float" => Ok(DType::F32),
        "f16" | "float16" | "half" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        other => Err(ModelError::BadInput(format!(
            "dtype `{other}` is not one of f32, f16, bf16"
        ))),
    }
}

fn check_dtype(dev: &Device, loc: DeviceLocation, dtype: DType) -> Result<()> {
    match (dev, dtype) {
        (_, DType::F32 | DType::F16 | DType::BF16) if !dev.is_cuda() => Ok(()),
        (_, DType::F32) => Ok(()),
        #[cfg(feature = "cuda")]
        (Device::Cuda(cuda), DType::BF16 | DType::F16) => {
            let (major, minor) =
                cuda.cuda_stream()
                    .context()
                    .compute_capability()
                    .map_err(|e| ModelError::DeviceUnavailable {
                        device: loc.to_string(),
                        hint: e.to_string(),
                    })?;
            let needed = if dtype == DType::BF16 { 8 } else { 6 };
            if major < needed {
                return Err(ModelError::UnsupportedDtype {
                    dtype: format!("{dtype:?}").to_lowercase(),
                    device: format!("{loc} (compute capability {major}.{minor})"),
                    hint: format!(
                        "it needs compute capability {needed}.0 or newer; use --dtype {}",
                        if dtype == DType::BF16 {
                            "f16 or f32"
                        } else {
                            "f32"
                        }
                    ),
                });
            }
            Ok(())
        }
        _ => Err(ModelError::UnsupportedDtype {
            dtype: format!("{dtype:?}").to_lowercase(),
            device: loc.to_string(),
            hint: "use f32, f16 or bf16".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_parse() {
        assert_eq!(parse_dtype("bfloat16").unwrap(), DType::BF16);
        assert_eq!(parse_dtype("F32").unwrap(), DType::F32);
        assert!(parse_dtype("int8")
            .unwrap_err()
            .to_string()
            .contains("int8"));
    }

    #[test]
    fn missing_gpu_is_a_clear_error() {
        if candle_core::utils::cuda_is_available() {
            return;
        }
        let e = open_device(DeviceLocation::Cuda(3))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cuda:3") && e.contains("--features cuda"), "{e}");
    }
}
