//! Peak memory in use, per GPU, seen by a background thread.
//!
//! The CUDA allocator returns freed memory to the driver, so sampling only between steps
//! misses the peak: a thread polls every GPU every 2 ms and keeps each one's maximum. On a
//! GPU the figure is what the driver reports in use (`total - free`, so other processes'
//! memory too: subtract a baseline taken before loading to isolate one's own); the CPU's is
//! the process's resident high-water mark (`VmHWM`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{gpu_memory_info, DeviceLocation};

/// Bytes in use on GPU `ordinal` now (`None` without a CUDA build or driver). For a logical
/// device with its cap in place: the bytes its live buffers hold in its memory pool.
pub fn gpu_used_bytes(ordinal: usize) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if crate::logical::installed().is_some() {
        use cudarc::driver::sys::CUmemPool_attribute as A;
        if let Some(v) =
            crate::logical::pool::attribute(ordinal, A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        {
            return Some(v);
        }
    }
    let (free, total) = gpu_memory_info(ordinal).ok().flatten()?;
    Some(total.saturating_sub(free))
}

/// The high-water marks of GPU `ordinal`'s stream-ordered allocator (the device's default
/// memory pool, which candle allocates from) since the last [`reset_gpu_pool_high_water`]:
/// `(live, reserved)` — the most bytes held by live buffers, and the most the pool held from
/// the driver (live plus freed blocks kept for reuse). Unlike the driver's figure they are
/// this process's alone, and `reserved - live` is what fragmentation cost. `None` without a
/// CUDA build or driver.
pub fn gpu_pool_high_water(ordinal: usize) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    {
        use cudarc::driver::sys::CUmemPool_attribute as A;
        let pool = default_pool(ordinal)?;
        let read = |attr: A| -> Option<u64> {
            let mut v: u64 = 0;
            // SAFETY: a query of a valid pool handle into a u64, the attribute's documented type.
            let r = unsafe {
                cudarc::driver::sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast())
            };
            (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some(v)
        };
        Some((
            read(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            read(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        ))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        None
    }
}

/// Resets the high-water marks of [`gpu_pool_high_water`] to the current values.
pub fn reset_gpu_pool_high_water(ordinal: usize) {
    #[cfg(feature = "cuda")]
    {
        use cudarc::driver::sys::CUmemPool_attribute as A;
        let Some(pool) = default_pool(ordinal) else {
            return;
        };
        for attr in [
            A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            let mut zero: u64 = 0;
            // SAFETY: setting a high-water attribute takes a u64, and 0 resets it.
            unsafe {
                cudarc::driver::sys::cuMemPoolSetAttribute(
                    pool,
                    attr,
                    (&mut zero as *mut u64).cast(),
                )
            };
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = ordinal;
}

/// The pool `ordinal`'s allocations come from: a logical device's own, else the GPU's default.
#[cfg(feature = "cuda")]
fn default_pool(ordinal: usize) -> Option<cudarc::driver::sys::CUmemoryPool> {
    if crate::logical::installed().is_some() {
        return crate::logical::pool::pool_of(ordinal);
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal).ok()?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: a plain query on a valid device handle.
    let r = unsafe { cudarc::driver::sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
    (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some(pool)
}

/// The process's resident-memory high-water mark (Linux `VmHWM`), `None` elsewhere.
pub fn cpu_peak_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Polls the memory in use on some GPUs and keeps each one's maximum above its baseline.
pub struct MemoryWatch {
    gpus: Vec<usize>,
    stop: Arc<AtomicBool>,
    peaks: Arc<Vec<AtomicU64>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl MemoryWatch {
    /// Starts polling the GPUs among `devices` (the CPU is read at [`MemoryWatch::peaks`]).
    pub fn start(devices: &[DeviceLocation]) -> MemoryWatch {
        let mut gpus: Vec<usize> = devices.iter().filter_map(|d| d.cuda_ordinal()).collect();
        gpus.sort_unstable();
        gpus.dedup();
        let stop = Arc::new(AtomicBool::new(false));
        let peaks: Arc<Vec<AtomicU64>> = Arc::new(gpus.iter().map(|_| AtomicU64::new(0)).collect());
        let handle = (!gpus.is_empty()).then(|| {
            let (s, p, g) = (stop.clone(), peaks.clone(), gpus.clone());
            std::thread::spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    for (i, &gpu) in g.iter().enumerate() {
                        if let Some(used) = gpu_used_bytes(gpu) {
                            p[i].fetch_max(used, Ordering::Relaxed);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
        });
        MemoryWatch {
            gpus,
            stop,
            peaks,
            handle,
        }
    }

    /// The peaks so far, by device name (`cuda:0`, ...; `cpu` when known).
    pub fn peaks(&self) -> BTreeMap<String, u64> {
        let mut out: BTreeMap<String, u64> = self
            .gpus
            .iter()
            .zip(self.peaks.iter())
            .map(|(g, p)| {
                (
                    DeviceLocation::Cuda(*g).to_string(),
                    p.load(Ordering::Relaxed),
                )
            })
            .collect();
        if let Some(cpu) = cpu_peak_bytes() {
            out.insert(DeviceLocation::Cpu.to_string(), cpu);
        }
        out
    }

    /// Stops polling and returns the peaks.
    pub fn finish(mut self) -> BTreeMap<String, u64> {
        self.stop_thread();
        self.peaks()
    }

    fn stop_thread(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for MemoryWatch {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_peak_is_read_and_gpus_need_a_driver() {
        let watch = MemoryWatch::start(&[DeviceLocation::Cpu]);
        let peaks = watch.finish();
        if cfg!(target_os = "linux") {
            assert!(peaks["cpu"] > 0);
        }
        assert!(!peaks.keys().any(|k| k.starts_with("cuda")));
    }
}
