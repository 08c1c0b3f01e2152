//! The devices the model tests run on.

use fleet_models::DeviceLocation;

/// `FLEET_TEST_DEVICES` (default `cpu`): a comma list (`cuda:0,cuda:1`) splits the decoder's
/// layers over those devices; `cpu,cpu` runs the boundary code on one machine.
pub fn test_devices() -> Vec<DeviceLocation> {
    std::env::var("FLEET_TEST_DEVICES")
        .unwrap_or_else(|_| "cpu".into())
        .split(',')
        .map(|d| {
            d.parse()
                .unwrap_or_else(|e| panic!("FLEET_TEST_DEVICES entry {d:?}: {e}"))
        })
        .collect()
}

/// The first GPU, or `None` on a machine without one (the test says so and passes): the GPU
/// kernel tests' entry.
#[cfg(feature = "cuda")]
#[allow(dead_code)] // only the binaries with GPU kernel tests call it
pub fn gpu_or_skip(test: &str) -> Option<candle_core::Device> {
    match candle_core::Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("{test}: no CUDA device ({e}); not run");
            None
        }
    }
}
