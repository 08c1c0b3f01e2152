//! Opt-in timing of the decoder's stages (`FLEET_PROFILE=1`), for finding where a step's time
//! goes on the GPU machine. Each timed stage synchronizes the device before and after, so
//! profiled runs are slower than plain ones: read the shares, not the totals.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use candle_core::Device;

use crate::error::Result;

static ENABLED: OnceLock<bool> = OnceLock::new();
static TIMES: Mutex<BTreeMap<&'static str, (f64, u64)>> = Mutex::new(BTreeMap::new());

/// Whether `FLEET_PROFILE` is set to something other than `0`.
pub fn enabled() -> bool {
    *ENABLED.get_or_init(|| std::env::var("FLEET_PROFILE").is_ok_and(|v| v != "0"))
}

/// Runs `f`; when profiling, adds its synchronized wall time to `stage`.
pub(crate) fn time<T>(
    dev: &Device,
    stage: &'static str,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    if !enabled() {
        return f();
    }
    dev.synchronize()?;
    let t = Instant::now();
    let out = f()?;
    dev.synchronize()?;
    let mut times = TIMES.lock().unwrap_or_else(|e| e.into_inner());
    let e = times.entry(stage).or_insert((0.0, 0));
    e.0 += t.elapsed().as_secs_f64();
    e.1 += 1;
    Ok(out)
}

/// Stage name, total seconds and calls since the last reset; empty unless profiling.
pub fn take_report() -> Vec<(&'static str, f64, u64)> {
    let mut times = TIMES.lock().unwrap_or_else(|e| e.into_inner());
    let out = times.iter().map(|(k, (s, n))| (*k, *s, *n)).collect();
    times.clear();
    out
}
