//! A kernel that keeps a stream busy: tests make one device late with it.

/// Keeps `dev`'s stream busy for about `ns` nanoseconds (a one-thread kernel spinning on the
/// GPU's global timer; `gpu_delay.cu`), without blocking the host. Tests use it to
/// make one device's work late, so that a race between devices is deterministic. Nothing on the
/// CPU.
pub fn gpu_delay(dev: &candle_core::Device, ns: u64) -> candle_core::Result<()> {
    match dev {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(cuda) => cuda::spin_ns(cuda, ns),
        _ => {
            let _ = ns;
            Ok(())
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gpu_delay.ptx"));
    const MODULE: &str = "fleet_gpu_delay";

    pub(super) fn spin_ns(dev: &candle_core::CudaDevice, ns: u64) -> candle_core::Result<()> {
        let func = dev.get_or_load_custom_func("spin_ns", MODULE, PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&ns);
        // SAFETY: the kernel reads no memory; it only spins.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}
