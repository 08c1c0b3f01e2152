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
