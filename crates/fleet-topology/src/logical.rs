//! Logical devices: several devices presented on one physical GPU, so that the code paths of
//! several GPUs (layer sharding, a reference model on its own device, copies between devices)
//! run and are checked on a machine with one.
//!
//! A logical device is `cuda:N` to everything above this module: device maps, plans, the
//! loaders. Underneath, `cuda:N` is a stream of its own on physical GPU `P` with a memory cap
//! of its own (fleet-models opens it; the cap is a CUDA memory pool with that maximum size).
//! Logical devices test ordering and placement, not the interconnect or NCCL: every copy
//! between them stays in one GPU's memory, and they share its bandwidth and compute.
//!
//! Two ways to ask for them, both checked against the GPUs the process sees before anything
//! loads ([`LogicalGpus::resolve`]):
//!
//! - `--logical-gpus N[:MEM][@P]` ([`LogicalGpus::parse_flag`]): N logical devices on physical
//!   GPU P (default 0), each capped at MEM (default: an equal share of the GPU's memory);
//! - a topology file's `[[logical]]` entries ([`LogicalGpus::from_entries`], read by
//!   [`crate::Topology::from_toml_str`]): `gpu = P`, `memory = "12GiB"`, `count = 8`, so the
//!   seeds' machines (8 x 12 GB, 3 x 16 GB, ...) can be simulated on one large GPU.
//!
//! It is never silent: every logical device's name says so ([`LABEL`]), and so does every
//! plan made on them. [`install`] makes a mapping the process's own and passes it to child
//! processes (replicas) through [`LOGICAL_GPUS_ENV`].

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::budget::parse_bytes;
use crate::memory::format_bytes;
use crate::{DeviceInfo, DeviceLocation, TopologyError};

/// What every logical device's name, and every plan on them, says.
pub const LABEL: &str = "logical devices on one GPU";

/// The environment variable that carries an installed mapping to child processes (JSON), or
/// that a person sets in `--logical-gpus`'s form (`FLEET_LOGICAL_GPUS=3:20GiB cargo test ...`,
/// so that test binaries run on logical devices).
pub const LOGICAL_GPUS_ENV: &str = "FLEET_LOGICAL_GPUS";

/// One logical device: which physical GPU it lives on and how much of its memory it may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogicalDevice {
    /// The physical GPU's CUDA index (after `CUDA_VISIBLE_DEVICES`).
    pub physical: usize,
    /// The cap in bytes; `None`: an equal share of the physical GPU among its logical devices.
    pub max_memory: Option<u64>,
}

/// Logical devices `cuda:0`, `cuda:1`, ... in order, and where the request came from (a flag or
/// a file, for error messages).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogicalGpus {
    /// The logical devices; logical `cuda:i` is `devices[i]`.
    pub devices: Vec<LogicalDevice>,
    /// `--logical-gpus 8:12GiB`, or the topology file's path.
    pub source: String,
}

/// One logical device with its cap settled against the physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ResolvedDevice {
    /// Its logical location, `cuda:i`.
    pub location: DeviceLocation,
    /// The physical GPU's CUDA index.
    pub physical: usize,
    /// Its cap in bytes.
    pub max_memory: u64,
    /// The physical GPU's name.
    pub physical_name: String,
}

fn bad(source: &str, message: String) -> TopologyError {
    TopologyError::LogicalDevices {
        request: source.to_string(),
        message,
    }
}

impl LogicalGpus {
    /// Parses `--logical-gpus`: `N` (N devices on GPU 0, an equal share each), `N:MEM` (each
    /// capped at MEM: `12GiB`, `12000MB`, ...) and either with `@P` for physical GPU P
    /// (`3:16GiB@1`).
    pub fn parse_flag(spec: &str) -> Result<Self, TopologyError> {
        let source = format!("--logical-gpus {spec}");
        let usage =
            "write N, N:MEM or N:MEM@GPU (e.g. 8:12GiB: eight logical devices of 12 GiB on GPU 0)";
        let (rest, physical) = match spec.trim().split_once('@') {
            Some((r, p)) => (
                r,
                p.trim().parse::<usize>().map_err(|_| {
                    bad(
                        &source,
                        format!("`{p}` after @ is not a GPU index; {usage}"),
                    )
                })?,
            ),
            None => (spec.trim(), 0),
        };
        let (count, memory) = match rest.split_once(':') {
            Some((n, m)) => (n, Some(m)),
            None => (rest, None),
        };
        let count: usize = count.trim().parse().map_err(|_| {
            bad(
                &source,
                format!("`{count}` is not a number of devices; {usage}"),
            )
        })?;
        let max_memory = memory
            .map(|m| parse_bytes(m).map_err(|e| bad(&source, format!("{e}; {usage}"))))
            .transpose()?;
        Self::uniform(count, physical, max_memory, source)
    }

    /// `count` logical devices on physical GPU `physical`, each capped at `max_memory`.
    pub fn uniform(
        count: usize,
        physical: usize,
        max_memory: Option<u64>,
        source: String,
    ) -> Result<Self, TopologyError> {
        if count < 1 {
            return Err(bad(
                &source,
                "0 logical devices: ask for at least 1 (2 or more to exercise several devices)"
                    .into(),
            ));
        }
        if max_memory == Some(0) {
            return Err(bad(
                &source,
                "a cap of 0 bytes leaves no room: give each logical device some memory".into(),
            ));
        }
        Ok(LogicalGpus {
            devices: vec![
                LogicalDevice {
                    physical,
                    max_memory
                };
                count
            ],
            source,
        })
    }

    /// The logical devices of a topology file's `[[logical]]` entries (`gpu`, `memory`, `count`),
    /// in order.
    pub fn from_entries(entries: &[LogicalEntry], source: &str) -> Result<Self, TopologyError> {
        let mut devices = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let field = |f: &str| format!("logical[{i}].{f}");
            let max_memory = e
                .memory
                .as_deref()
                .map(|m| {
                    parse_bytes(m).map_err(|err| TopologyError::TopologyFile {
                        file: source.to_string(),
                        field: field("memory"),
                        message: err.to_string(),
                    })
                })
                .transpose()?;
            let count = e.count.unwrap_or(1);
            if count == 0 || max_memory == Some(0) {
                return Err(TopologyError::TopologyFile {
                    file: source.to_string(),
                    field: field(if count == 0 { "count" } else { "memory" }),
                    message: "is 0: give at least 1 device of some memory, or remove the entry"
                        .into(),
                });
            }
            for _ in 0..count {
                devices.push(LogicalDevice {
                    physical: e.gpu.unwrap_or(0),
                    max_memory,
                });
            }
        }
        Ok(LogicalGpus {
            devices,
            source: source.to_string(),
        })
    }

    /// The cap of logical `cuda:i` on a GPU of `total` bytes: its own, or an equal share of what
    /// the set caps on that GPU leave.
    fn cap(&self, i: usize, total: u64) -> u64 {
        let d = self.devices[i];
        let on_gpu = || self.devices.iter().filter(|o| o.physical == d.physical);
        let set: u64 = on_gpu().filter_map(|o| o.max_memory).sum();
        let unset = on_gpu().filter(|o| o.max_memory.is_none()).count() as u64;
        d.max_memory
            .unwrap_or(total.saturating_sub(set) / unset.max(1))
    }

    /// Logical `cuda:i`'s share of its GPU's `free` bytes, at most its `cap`.
    fn free_share(&self, i: usize, free: u64, cap: u64) -> u64 {
        let physical = self.devices[i].physical;
        let sharing = self
            .devices
            .iter()
            .filter(|o| o.physical == physical)
            .count() as u64;
        (free / sharing.max(1)).min(cap)
    }

    /// `(free, cap)` of logical `cuda:i` from its physical GPU's `(free, total)`: the figures
    /// [`LogicalGpus::device_infos`] reports, for one device without listing every GPU.
    pub fn memory_of(&self, i: usize, physical_free: u64, physical_total: u64) -> (u64, u64) {
        let cap = self.cap(i, physical_total);
        (self.free_share(i, physical_free, cap), cap)
    }

    /// The physical GPU of logical `cuda:logical`.
    pub fn physical_of(&self, logical: usize) -> Option<usize> {
        self.devices.get(logical).map(|d| d.physical)
    }

    /// Settles every cap against the physical GPUs this process sees (`physical`, as
    /// [`crate::discover`] reports them): each physical index must exist, an unset cap is an
    /// equal share of its GPU's total memory, and the caps on one GPU must fit its total.
    /// Errors name the request ([`LogicalGpus::source`]) and the fix.
    pub fn resolve(&self, physical: &[DeviceInfo]) -> Result<Vec<ResolvedDevice>, TopologyError> {
        let gpus: Vec<&DeviceInfo> = physical
            .iter()
            .filter(|d| d.location.cuda_ordinal().is_some())
            .collect();
        if gpus.is_empty() {
            return Err(bad(
                &self.source,
                "logical devices live on a GPU, and this process sees none (a build without \
                 the `cuda` feature, or CUDA_VISIBLE_DEVICES hides them): run on a GPU machine \
                 with a CUDA build, or drop the logical devices to plan on the CPU"
                    .into(),
            ));
        }
        let gpu = |p: usize| gpus.iter().find(|d| d.location == DeviceLocation::Cuda(p));
        let mut out = Vec::with_capacity(self.devices.len());
        for (i, d) in self.devices.iter().enumerate() {
            let Some(info) = gpu(d.physical) else {
                let ids: Vec<String> = gpus.iter().map(|g| g.location.to_string()).collect();
                return Err(bad(
                    &self.source,
                    format!(
                        "logical cuda:{i} is on GPU {} but this process sees {} ({}): use one \
                         of those indices",
                        d.physical,
                        ids.len(),
                        ids.join(", ")
                    ),
                ));
            };
            out.push(ResolvedDevice {
                location: DeviceLocation::Cuda(i),
                physical: d.physical,
                max_memory: self.cap(i, info.total_bytes.unwrap_or(0)),
                physical_name: info.name.clone(),
            });
        }
        for info in &gpus {
            let Some(p) = info.location.cuda_ordinal() else {
                continue;
            };
            let on_it: Vec<&ResolvedDevice> = out.iter().filter(|r| r.physical == p).collect();
            let sum: u64 = on_it.iter().map(|r| r.max_memory).sum();
            let total = info.total_bytes.unwrap_or(0);
            if !on_it.is_empty() && sum > total {
                return Err(bad(
                    &self.source,
                    format!(
                        "{} logical devices on GPU {p} ask for {} in all, more than its {} \
                         ({}): ask for fewer devices or less memory each",
                        on_it.len(),
                        format_bytes(sum),
                        format_bytes(total),
                        info.name
                    ),
                ));
            }
        }
        Ok(out)
    }

    /// The logical devices as the devices a process sees: each named with its physical GPU and
    /// [`LABEL`], its cap as its total memory and its share of the GPU's free memory as free,
    /// every other logical device of the same GPU as a peer.
    pub fn device_infos(&self, physical: &[DeviceInfo]) -> Result<Vec<DeviceInfo>, TopologyError> {
        let resolved = self.resolve(physical)?;
        let i_of = |r: &ResolvedDevice| r.location.cuda_ordinal().unwrap_or(0);
        Ok(resolved
            .iter()
            .map(|r| {
                let info = physical
                    .iter()
                    .find(|d| d.location == DeviceLocation::Cuda(r.physical))
                    .expect("resolve checked the physical GPU");
                let free = info
                    .free_bytes
                    .map(|f| self.free_share(i_of(r), f, r.max_memory));
                DeviceInfo {
                    location: r.location,
                    name: format!(
                        "{} (logical {} of GPU {}, capped at {}: {LABEL})",
                        r.physical_name,
                        r.location,
                        r.physical,
                        format_bytes(r.max_memory)
                    ),
                    compute_capability: info.compute_capability,
                    total_bytes: Some(r.max_memory),
                    free_bytes: free,
                    pci_bus_id: info.pci_bus_id.clone(),
                    peers: resolved
                        .iter()
                        .filter(|o| o.physical == r.physical && o.location != r.location)
                        .filter_map(|o| o.location.cuda_ordinal())
                        .collect(),
                }
            })
            .collect())
    }
}

/// One `[[logical]]` entry of a topology file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogicalEntry {
    /// The physical GPU (default 0).
    pub gpu: Option<usize>,
    /// Each device's cap (default: an equal share of the GPU).
    pub memory: Option<String>,
    /// How many (default 1).
    pub count: Option<usize>,
}

/// The mapping [`install`]ed in this process.
static INSTALLED: OnceLock<LogicalGpus> = OnceLock::new();
/// The mapping a parent process passed in [`LOGICAL_GPUS_ENV`], read once.
static FROM_ENV: OnceLock<Option<LogicalGpus>> = OnceLock::new();

/// Makes `logical` this process's devices (what [`crate::discover`] reports and what `cuda:N`
/// opens from now on) and passes it to child processes through [`LOGICAL_GPUS_ENV`]. Once per
/// process: a second, different mapping is an error, and so is one that differs from what a
/// parent process passed.
pub fn install(logical: LogicalGpus) -> Result<(), TopologyError> {
    let json = serde_json::to_string(&logical).expect("the mapping serializes");
    let conflict = |other: &LogicalGpus| {
        bad(
            &logical.source,
            format!(
                "this process already uses other logical devices ({}); give one mapping",
                other.source
            ),
        )
    };
    if let Some(parent) = from_env() {
        if parent.devices != logical.devices {
            return Err(conflict(parent));
        }
    }
    let got = INSTALLED.get_or_init(|| logical.clone());
    if got.devices != logical.devices {
        return Err(conflict(got));
    }
    // SAFETY (set_var): called while the process sets itself up, before it starts the threads
    // and child processes that read the environment.
    std::env::set_var(LOGICAL_GPUS_ENV, json);
    Ok(())
}

fn from_env() -> Option<&'static LogicalGpus> {
    FROM_ENV
        .get_or_init(|| {
            let text = std::env::var(LOGICAL_GPUS_ENV).ok()?;
            // A parent fleet process passes JSON; a person (a test run, a script) may write the
            // flag's own form, `FLEET_LOGICAL_GPUS=3:20GiB`.
            let parsed = if text.trim_start().starts_with('{') {
                serde_json::from_str(&text).map_err(|e| e.to_string())
            } else {
                LogicalGpus::parse_flag(&text)
                    .map(|mut l| {
                        l.source = format!("{LOGICAL_GPUS_ENV}={text}");
                        l
                    })
                    .map_err(|e| e.to_string())
            };
            match parsed {
                Ok(l) => Some(l),
                Err(e) => {
                    tracing::error!("{LOGICAL_GPUS_ENV} does not parse ({e}); ignoring it");
                    None
                }
            }
        })
        .as_ref()
}

/// What a record made in this process says about its devices when they are logical
/// (`"3 devices, logical devices on one GPU (--logical-gpus 3:16GiB)"`), `None` on physical
/// GPUs: run manifests and benchmark records carry it so that no figure measured on logical
/// devices passes for one of real GPUs.
pub fn describe() -> Option<String> {
    installed().map(|l| format!("{} devices, {LABEL} ({})", l.devices.len(), l.source))
}

/// The process's logical devices: the installed mapping, else one passed by a parent process
/// through [`LOGICAL_GPUS_ENV`], else `None` (physical GPUs).
pub fn installed() -> Option<&'static LogicalGpus> {
    INSTALLED.get().or_else(from_env)
}

/// The memory cap of logical devices: a CUDA memory pool of each device's cap (`maxSize`, so an
/// allocation past it fails as it would on a GPU of that size), and every allocation of the
/// device's stream taken from it.
///
/// candle allocates every buffer with `cuMemAllocAsync` on the device's stream, which draws on
/// the GPU's *current* pool: one per GPU, not per stream, and cudarc offers no per-stream pool.
/// So fleet defines `cuMemAllocAsync` itself (it links the driver dynamically, and a definition
/// in the program binds the program's own calls): a stream registered here
/// ([`cap_stream`](pool::cap_stream)) allocates from its logical device's pool with
/// `cuMemAllocFromPoolAsync`; every other call goes on to the driver's own function. Frees need
/// nothing: `cuMemFreeAsync` returns memory to whichever pool it came from. What no pool
/// holds — the CUDA context, loaded kernels, cuBLAS's workspace — is outside the caps.
#[cfg(feature = "cuda")]
pub mod pool {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Mutex, OnceLock};

    use cudarc::driver::sys::{self, CUdeviceptr, CUmemoryPool, CUresult, CUstream};

    use crate::{DeviceLocation, TopologyError};

    /// (stream, pool, logical ordinal) of every capped stream, as addresses.
    static POOLS: Mutex<Vec<(usize, usize, usize)>> = Mutex::new(Vec::new());
    /// Whether any stream is capped (the common case, none, skips the lock).
    static ANY: AtomicBool = AtomicBool::new(false);

    fn pool_of_stream(stream: CUstream) -> Option<CUmemoryPool> {
        if !ANY.load(Ordering::Acquire) {
            return None;
        }
        let pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        pools
            .iter()
            .find(|(s, _, _)| *s == stream as usize)
            .map(|(_, p, _)| *p as CUmemoryPool)
    }

    /// The pool of logical `cuda:ordinal`, once its stream is capped.
    pub fn pool_of(ordinal: usize) -> Option<CUmemoryPool> {
        let pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        pools
            .iter()
            .find(|(_, _, o)| *o == ordinal)
            .map(|(_, p, _)| *p as CUmemoryPool)
    }

    type AllocAsync = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;

    /// The driver's own `cuMemAllocAsync` (the next definition after the program's).
    fn driver_alloc_async() -> Option<AllocAsync> {
        static REAL: OnceLock<Option<usize>> = OnceLock::new();
        let f = REAL.get_or_init(|| {
            // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT skips this program's
            // definition and finds libcuda's.
            let p = unsafe { libc::dlsym(libc::RTLD_NEXT, c"cuMemAllocAsync".as_ptr()) };
            (!p.is_null()).then_some(p as usize)
        });
        // SAFETY: the address is libcuda's cuMemAllocAsync, whose C signature this is.
        f.map(|p| unsafe { std::mem::transmute::<usize, AllocAsync>(p) })
    }

    /// The program's `cuMemAllocAsync` (see the module docs): from the stream's logical pool
    /// when it has one, else the driver's.
    ///
    /// # Safety
    ///
    /// The driver's contract for `cuMemAllocAsync`: `dptr` valid for a write, `stream` a stream
    /// of the current context.
    #[no_mangle]
    pub unsafe extern "C" fn cuMemAllocAsync(
        dptr: *mut CUdeviceptr,
        bytesize: usize,
        stream: CUstream,
    ) -> CUresult {
        if let Some(pool) = pool_of_stream(stream) {
            return sys::cuMemAllocFromPoolAsync(dptr, bytesize, pool, stream);
        }
        match driver_alloc_async() {
            Some(f) => f(dptr, bytesize, stream),
            // Not found (should not happen with a dynamically linked driver): what
            // cuMemAllocAsync does, spelled out — the current device's current pool.
            None => {
                let mut dev: sys::CUdevice = 0;
                let r = sys::cuCtxGetDevice(&mut dev);
                if r != CUresult::CUDA_SUCCESS {
                    return r;
                }
                let mut pool: CUmemoryPool = std::ptr::null_mut();
                let r = sys::cuDeviceGetMemPool(&mut pool, dev);
                if r != CUresult::CUDA_SUCCESS {
                    return r;
                }
                sys::cuMemAllocFromPoolAsync(dptr, bytesize, pool, stream)
            }
        }
    }

    /// Gives logical `location`'s stream (on physical GPU `physical`) a pool of `max_memory`
    /// bytes: from now on its allocations come from it and fail past the cap.
    pub fn cap_stream(
        location: DeviceLocation,
        physical: usize,
        max_memory: u64,
        stream: CUstream,
    ) -> Result<(), TopologyError> {
        let ordinal = location.cuda_ordinal().unwrap_or(0);
        let err = |what: &str, r: CUresult| TopologyError::Driver {
            ordinal: physical,
            message: format!("{what} for logical {location} ({max_memory} bytes): {r:?}"),
        };
        // SAFETY: a zeroed props struct is the documented "no special properties" value;
        // the fields set are the allocation type, the device and the maximum size.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = physical as i32;
        props.maxSize = max_memory as usize;
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out-pointer and props.
        let r = unsafe { sys::cuMemPoolCreate(&mut pool, &props) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(err("cuMemPoolCreate", r));
        }
        // Keep freed blocks for reuse within the cap instead of handing them back to the driver
        // at every synchronization (a new pool's threshold is 0): the cap is what the device
        // may hold, as a GPU's memory is.
        let mut keep: u64 = u64::MAX;
        // SAFETY: the release threshold is a u64 attribute of a valid pool.
        let r = unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast(),
            )
        };
        if r != CUresult::CUDA_SUCCESS {
            // SAFETY: the pool was just created and holds nothing.
            unsafe { sys::cuMemPoolDestroy(pool) };
            return Err(err("cuMemPoolSetAttribute", r));
        }
        let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        pools.push((stream as usize, pool as usize, ordinal));
        ANY.store(true, Ordering::Release);
        Ok(())
    }

    /// A pool attribute of logical `cuda:ordinal` (bytes).
    pub fn attribute(ordinal: usize, attr: sys::CUmemPool_attribute) -> Option<u64> {
        let pool = pool_of(ordinal)?;
        let mut v: u64 = 0;
        // SAFETY: a u64 query of a valid pool.
        let r = unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) };
        (r == CUresult::CUDA_SUCCESS).then_some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GIB;

    fn h200(ordinal: usize) -> DeviceInfo {
        DeviceInfo {
            location: DeviceLocation::Cuda(ordinal),
            name: "NVIDIA H200".into(),
            compute_capability: Some((9, 0)),
            total_bytes: Some(140 * GIB),
            free_bytes: Some(139 * GIB),
            pci_bus_id: Some(format!("0000:0{ordinal}:00.0")),
            peers: vec![],
        }
    }

    #[test]
    fn the_flag_reads_count_cap_and_gpu() {
        let l = LogicalGpus::parse_flag("8:12GiB").unwrap();
        assert_eq!(l.devices.len(), 8);
        assert!(l
            .devices
            .iter()
            .all(|d| d.physical == 0 && d.max_memory == Some(12 * GIB)));
        let l = LogicalGpus::parse_flag("3:16GiB@1").unwrap();
        assert_eq!((l.devices.len(), l.physical_of(2)), (3, Some(1)));
        let l = LogicalGpus::parse_flag("2").unwrap();
        assert_eq!(l.devices[1].max_memory, None);
        for bad in ["0", "x", "2:lots", "2:12GiB@gpu1", "2:0GiB"] {
            let e = LogicalGpus::parse_flag(bad).unwrap_err().to_string();
            assert!(e.contains("--logical-gpus"), "{bad}: {e}");
        }
    }

    #[test]
    fn caps_are_settled_against_the_gpu_and_named() {
        let phys = vec![h200(0)];
        let r = LogicalGpus::parse_flag("2")
            .unwrap()
            .resolve(&phys)
            .unwrap();
        assert_eq!(r[0].max_memory, 70 * GIB);
        let infos = LogicalGpus::parse_flag("3:16GiB")
            .unwrap()
            .device_infos(&phys)
            .unwrap();
        assert_eq!(infos.len(), 3);
        assert_eq!(infos[1].location, DeviceLocation::Cuda(1));
        assert_eq!(infos[1].total_bytes, Some(16 * GIB));
        assert!(infos[1].name.contains(LABEL), "{}", infos[1].name);
        assert!(infos[1].name.contains("NVIDIA H200"), "{}", infos[1].name);
        assert_eq!(infos[1].peers, vec![0, 2]);
    }

    #[test]
    fn unset_caps_share_what_the_set_caps_leave() {
        let entries = [
            LogicalEntry {
                gpu: Some(0),
                memory: Some("100GiB".into()),
                count: Some(1),
            },
            LogicalEntry {
                gpu: Some(0),
                memory: None,
                count: Some(2),
            },
        ];
        let l = LogicalGpus::from_entries(&entries, "mixed.toml").unwrap();
        let r = l.resolve(&[h200(0)]).unwrap();
        let caps: Vec<u64> = r.iter().map(|d| d.max_memory).collect();
        assert_eq!(caps, vec![100 * GIB, 20 * GIB, 20 * GIB]);
    }

    #[test]
    fn requests_the_gpu_cannot_hold_are_refused_with_the_fix() {
        let phys = vec![h200(0)];
        let e = LogicalGpus::parse_flag("8:20GiB")
            .unwrap()
            .resolve(&phys)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--logical-gpus 8:20GiB") && e.contains("more than its"),
            "{e}"
        );
        let e = LogicalGpus::parse_flag("2:10GiB@3")
            .unwrap()
            .resolve(&phys)
            .unwrap_err()
            .to_string();
        assert!(e.contains("GPU 3") && e.contains("cuda:0"), "{e}");
        let cpu_only = vec![DeviceInfo {
            location: DeviceLocation::Cpu,
            name: "cpu".into(),
            compute_capability: None,
            total_bytes: Some(24 * GIB),
            free_bytes: None,
            pci_bus_id: None,
            peers: vec![],
        }];
        let e = LogicalGpus::parse_flag("2")
            .unwrap()
            .resolve(&cpu_only)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sees none") && e.contains("cuda"), "{e}");
    }
}
