//! What the benchmark commands (`fleet bench`, `edit-score bench`) record and print alike.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use fleet_topology::DeviceLocation;

/// Per GPU device of `devices`: the most bytes its live buffers held (its memory pool's
/// high-water mark, weights included; on a logical device, its own pool, against its cap).
pub fn device_peaks(devices: &[DeviceLocation]) -> BTreeMap<String, u64> {
    devices
        .iter()
        .filter_map(|d| {
            let (live, _) = fleet_topology::gpu_pool_high_water(d.cuda_ordinal()?)?;
            Some((d.to_string(), live))
        })
        .collect()
}

/// Prints `peaks` one device a line on stderr and, on logical devices (`logical`:
/// [`fleet_topology::logical::describe`]), that their figures share one GPU.
pub fn print_device_peaks(peaks: &BTreeMap<String, u64>, logical: Option<&str>) {
    for (device, bytes) in peaks {
        eprintln!(
            "  peak on {device}: {}",
            fleet_topology::format_bytes(*bytes)
        );
    }
    if let Some(logical) = logical {
        eprintln!("  on {logical}: one GPU's bandwidth and compute shared by all");
    }
}

/// Writes `report` as pretty JSON to `path`, or prints it when there is none.
pub fn write_report<T: serde::Serialize>(report: &T, path: Option<&Path>) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(report)?;
    match path {
        Some(p) => std::fs::write(p, &json).with_context(|| format!("writing {}", p.display()))?,
        None => crate::outln!("{json}")?,
    }
    Ok(())
}
