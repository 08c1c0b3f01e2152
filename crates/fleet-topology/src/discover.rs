//! Which devices this process can use.

use serde::Serialize;

use crate::{DeviceLocation, TopologyError};

/// What the driver reports about one device.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceInfo {
    /// Where it is.
    pub location: DeviceLocation,
    /// Marketing name, e.g. `NVIDIA H200`, or `cpu`.
    pub name: String,
    /// CUDA compute capability (major, minor); `None` for the CPU.
    pub compute_capability: Option<(i32, i32)>,
    /// Total memory in bytes (GPU memory, or host RAM for the CPU when known).
    pub total_bytes: Option<u64>,
    /// Free memory in bytes right now.
    pub free_bytes: Option<u64>,
    /// PCI bus id such as `0000:3b:00.0`; `None` for the CPU.
    pub pci_bus_id: Option<String>,
    /// CUDA ordinals of the other GPUs this one can read and write directly
    /// (`cuDeviceCanAccessPeer`, over NVLink or PCIe); empty for the CPU.
    pub peers: Vec<usize>,
}

/// The GPUs the CUDA driver reports (honouring `CUDA_VISIBLE_DEVICES`), or, when none is
/// visible or the build has no `cuda` feature, the host CPU alone.
///
/// With logical devices installed ([`crate::logical::install`]), the GPUs are the logical
/// devices (`cuda:0..N`, each named with its physical GPU and "logical devices on one GPU");
/// an installed mapping the GPUs cannot serve is an error naming it.
pub fn discover() -> Result<Vec<DeviceInfo>, TopologyError> {
    let gpus = discover_gpus()?;
    if let Some(logical) = crate::logical::installed() {
        return logical.device_infos(&gpus);
    }
    if let Ok(text) = std::env::var(crate::logical::LOGICAL_GPUS_ENV) {
        // A parent process meant logical devices: running on the physical GPUs instead would
        // put `cuda:1` on another GPU, or none.
        return Err(TopologyError::LogicalDevices {
            request: crate::logical::LOGICAL_GPUS_ENV.to_string(),
            message: format!(
                "`{text}` does not parse as the mapping a parent fleet process passes; unset it \
                 and use --logical-gpus"
            ),
        });
    }
    if gpus.is_empty() {
        Ok(vec![cpu_info()])
    } else {
        Ok(gpus)
    }
}

fn cpu_info() -> DeviceInfo {
    let (total, free) = host_memory();
    DeviceInfo {
        location: DeviceLocation::Cpu,
        name: format!(
            "cpu ({} threads)",
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        ),
        compute_capability: None,
        total_bytes: total,
        free_bytes: free,
        pci_bus_id: None,
        peers: Vec::new(),
    }
}

/// MemTotal and MemAvailable from /proc/meminfo, where there is one.
fn host_memory() -> (Option<u64>, Option<u64>) {
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else {
        return (None, None);
    };
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

#[cfg(not(feature = "cuda"))]
fn discover_gpus() -> Result<Vec<DeviceInfo>, TopologyError> {
    Ok(Vec::new())
}

#[cfg(feature = "cuda")]
fn discover_gpus() -> Result<Vec<DeviceInfo>, TopologyError> {
    use cudarc::driver::{sys::CUdevice_attribute as A, CudaContext};

    // No driver (or no visible GPU) is not an error: the host CPU is reported instead.
    let count = match CudaContext::device_count() {
        Ok(n) => n.max(0) as usize,
        Err(e) => {
            tracing_free_warn(&format!("CUDA driver unavailable ({e}); reporting the CPU"));
            return Ok(Vec::new());
        }
    };
    let mut out = Vec::with_capacity(count);
    let mut devices = Vec::with_capacity(count);
    for ordinal in 0..count {
        let err = |e: cudarc::driver::DriverError| TopologyError::Driver {
            ordinal,
            message: e.to_string(),
        };
        let ctx = CudaContext::new(ordinal).map_err(err)?;
        let (free, total) = ctx.mem_get_info().map_err(err)?;
        let attr = |a| ctx.attribute(a).map_err(err);
        let pci = format!(
            "{:04x}:{:02x}:{:02x}.0",
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        );
        out.push(DeviceInfo {
            location: DeviceLocation::Cuda(ordinal),
            name: ctx.name().map_err(err)?,
            compute_capability: Some(ctx.compute_capability().map_err(err)?),
            total_bytes: Some(total as u64),
            free_bytes: Some(free as u64),
            pci_bus_id: Some(pci),
            peers: Vec::new(),
        });
        devices.push(ctx.cu_device());
    }
    for (a, info) in out.iter_mut().enumerate() {
        for (b, &dev_b) in devices.iter().enumerate() {
            if a == b {
                continue;
            }
            let mut can = 0;
            // SAFETY: a plain driver query on two valid device handles.
            let r =
                unsafe { cudarc::driver::sys::cuDeviceCanAccessPeer(&mut can, devices[a], dev_b) };
            if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                return Err(TopologyError::Driver {
                    ordinal: a,
                    message: format!("cuDeviceCanAccessPeer towards GPU {b}: {r:?}"),
                });
            }
            if can != 0 {
                info.peers.push(b);
            }
        }
    }
    Ok(out)
}

/// `(free, total)` bytes of GPU `ordinal` right now; `None` in a build without CUDA. For a
/// logical device: its cap as the total and its share of the physical GPU's free memory (at
/// most the cap) as free.
pub fn gpu_memory_info(ordinal: usize) -> Result<Option<(u64, u64)>, TopologyError> {
    if let Some(logical) = crate::logical::installed() {
        let Some(physical) = logical.physical_of(ordinal) else {
            return Err(TopologyError::LogicalDevices {
                request: logical.source.clone(),
                message: format!(
                    "cuda:{ordinal} is not one of the {} logical devices",
                    logical.devices.len()
                ),
            });
        };
        // Only its own GPU is asked (this is polled by memory watches).
        return Ok(physical_memory_info(physical)?
            .map(|(free, total)| logical.memory_of(ordinal, free, total)));
    }
    physical_memory_info(ordinal)
}

fn physical_memory_info(ordinal: usize) -> Result<Option<(u64, u64)>, TopologyError> {
    #[cfg(feature = "cuda")]
    {
        let err = |e: cudarc::driver::DriverError| TopologyError::Driver {
            ordinal,
            message: e.to_string(),
        };
        let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(err)?;
        let (free, total) = ctx.mem_get_info().map_err(err)?;
        Ok(Some((free as u64, total as u64)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Ok(None)
    }
}

/// Enables direct (peer-to-peer) access between every ordered pair of the given GPUs that
/// supports it, and returns those pairs. Copies between GPUs of a pair then go over NVLink or
/// PCIe directly instead of through host memory (candle never enables this itself). A build
/// without CUDA, or fewer than two GPUs, enables nothing.
///
/// Logical devices ([`crate::logical`]) are mapped to their physical GPUs first: logical
/// devices of one GPU need no peer access (their memory is one GPU's).
pub fn enable_peer_access(ordinals: &[usize]) -> Result<Vec<(usize, usize)>, TopologyError> {
    let mapped: Vec<usize>;
    let ordinals = match crate::logical::installed() {
        Some(logical) => {
            let mut physical: Vec<usize> = ordinals
                .iter()
                .filter_map(|&o| logical.physical_of(o))
                .collect();
            physical.sort_unstable();
            physical.dedup();
            mapped = physical;
            &mapped[..]
        }
        None => ordinals,
    };
    #[cfg(feature = "cuda")]
    {
        use cudarc::driver::{sys, CudaContext};
        let mut ctxs = Vec::with_capacity(ordinals.len());
        for &o in ordinals {
            let ctx = CudaContext::new(o).map_err(|e| TopologyError::Driver {
                ordinal: o,
                message: e.to_string(),
            })?;
            ctxs.push((o, ctx));
        }
        let mut enabled = Vec::new();
        for (a, ctx_a) in &ctxs {
            for (b, ctx_b) in &ctxs {
                if a == b {
                    continue;
                }
                let driver = |what: &str, r: sys::CUresult| TopologyError::Driver {
                    ordinal: *a,
                    message: format!("{what} towards GPU {b}: {r:?}"),
                };
                let mut can = 0;
                // SAFETY: plain driver queries on valid device handles.
                let r = unsafe {
                    sys::cuDeviceCanAccessPeer(&mut can, ctx_a.cu_device(), ctx_b.cu_device())
                };
                if r != sys::CUresult::CUDA_SUCCESS {
                    return Err(driver("cuDeviceCanAccessPeer", r));
                }
                if can == 0 {
                    continue;
                }
                ctx_a.bind_to_thread().map_err(|e| TopologyError::Driver {
                    ordinal: *a,
                    message: e.to_string(),
                })?;
                // SAFETY: the current context is a's; b's context is alive for the call.
                let r = unsafe { sys::cuCtxEnablePeerAccess(ctx_b.cu_ctx(), 0) };
                match r {
                    sys::CUresult::CUDA_SUCCESS
                    | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                        enabled.push((*a, *b))
                    }
                    other => return Err(driver("cuCtxEnablePeerAccess", other)),
                }
            }
        }
        Ok(enabled)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinals;
        Ok(Vec::new())
    }
}

#[cfg(feature = "cuda")]
fn tracing_free_warn(msg: &str) {
    // This crate carries no logging dependency; stderr is where a CLI user looks.
    eprintln!("warning: {msg}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_access_is_a_no_op_without_gpus() {
        if cfg!(not(feature = "cuda")) {
            assert!(enable_peer_access(&[0, 1]).unwrap().is_empty());
        }
    }

    #[test]
    fn cpu_build_reports_the_cpu() {
        let devices = discover().unwrap();
        assert!(!devices.is_empty());
        if cfg!(not(feature = "cuda")) {
            assert_eq!(devices.len(), 1);
            assert_eq!(devices[0].location, DeviceLocation::Cpu);
            assert!(devices[0].name.starts_with("cpu"));
        }
    }
}
