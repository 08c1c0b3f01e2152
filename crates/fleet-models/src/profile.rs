//! Opt-in timing of the decoder's stages (`FLEET_PROFILE=1`), for finding where a step's time
//! goes on the GPU machine. Each timed stage synchronizes the device before and after, so
//! profiled runs are slower than plain ones: read the shares, not the totals.
//!
//! `FLEET_PROFILE=events` times the same stages without synchronizing: a CUDA event on the
//! device's stream at each stage's start and end, read when the report is taken. A stage's
//! `seconds` is then its span on the GPU's timeline (its kernels and any time the GPU waited
//! for the host inside it) and `host_seconds` the host's time in it, in a run whose own clocks
//! stay close to a plain run's. Where a stage's span is well above its kernels' time (ncu),
//! the GPU waited for the host. Stages their callers time themselves ([`record`]: the
//! backward's ops, gspo-train's phases) still synchronize in this mode, and keep their memory
//! columns; the event-timed stages report none.
//!
//! The coarse stages of training (names starting `train.`, `optim.`, `rollout.`) also keep the
//! most GPU memory in use while they ran (GPU 0, polled every millisecond by a thread that
//! starts with the first such stage): where a run's peak comes from. Beside it, the allocator's
//! own high-water marks over the stage: the bytes of live buffers and what its pool reserved
//! (the difference is fragmentation; the driver's figure adds the context).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use candle_core::Device;

use crate::error::Result;

static ENABLED: OnceLock<bool> = OnceLock::new();

thread_local! {
    /// Set while this thread records a CUDA graph: a synchronize then would end the capture
    /// with an error, so stages inside it are not timed (the capture as a whole is).
    static CAPTURING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as recording a CUDA graph (`true`) or no longer (`false`): [`time`] then
/// runs its stages untimed.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn set_capturing(on: bool) {
    CAPTURING.with(|c| c.set(on));
}
/// Stage -> its totals so far.
static TIMES: Mutex<BTreeMap<&'static str, StageReport>> = Mutex::new(BTreeMap::new());

/// One stage's totals (see [`take_report`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageReport {
    /// The stage's name.
    pub stage: &'static str,
    /// Synchronized wall time over all calls (with `FLEET_PROFILE=events`: the span between
    /// the stage's events on the GPU's timeline).
    pub seconds: f64,
    /// The host's time inside the stage over all calls: from its start until its work was
    /// enqueued (any read back inside it included), the closing synchronization not. For a
    /// stage timed by its caller ([`record`]), the same as `seconds`.
    pub host_seconds: f64,
    /// Calls.
    pub calls: u64,
    /// Coarse stages: the most GPU memory the driver reported in use (the context and other
    /// processes included); 0 for others.
    pub peak_bytes: u64,
    /// Coarse stages: the most bytes the allocator held in live buffers; 0 for others or
    /// without CUDA.
    pub live_peak_bytes: u64,
    /// Coarse stages: the most bytes the allocator's pool reserved (live plus freed blocks kept
    /// for reuse); 0 for others or without CUDA.
    pub reserved_peak_bytes: u64,
}
/// The most memory in use on GPU 0 since the last [`begin`].
static PEAK: AtomicU64 = AtomicU64::new(0);
static POLLER: OnceLock<()> = OnceLock::new();

/// Whether `FLEET_PROFILE` is set to something other than `0`.
pub fn enabled() -> bool {
    *ENABLED.get_or_init(|| std::env::var("FLEET_PROFILE").is_ok_and(|v| v != "0"))
}

/// Whether `FLEET_PROFILE=events`: stages timed by CUDA events, nothing synchronized.
#[cfg(feature = "cuda")]
fn events_mode() -> bool {
    static EVENTS: OnceLock<bool> = OnceLock::new();
    *EVENTS.get_or_init(|| std::env::var("FLEET_PROFILE").is_ok_and(|v| v == "events"))
}

fn coarse(stage: &str) -> bool {
    ["train.", "optim.", "rollout."]
        .iter()
        .any(|p| stage.starts_with(p))
}

/// Starts a coarse stage's memory window (see the module docs); does nothing unless profiling.
pub fn begin() {
    if !enabled() {
        return;
    }
    POLLER.get_or_init(|| {
        std::thread::spawn(|| loop {
            if let Some(used) = fleet_topology::gpu_used_bytes(0) {
                PEAK.fetch_max(used, Ordering::Relaxed);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        });
    });
    PEAK.store(0, Ordering::Relaxed);
    fleet_topology::reset_gpu_pool_high_water(0);
}

/// `FLEET_CUDA_PROFILE_STAGE=<stage>[@<n>]`: the stage and the call of it (1-based, default 1)
/// that [`profiler_window`] opens the profiler's range around.
static WINDOW: OnceLock<Option<(String, u64)>> = OnceLock::new();
/// Calls of the window's stage so far.
static WINDOW_CALLS: AtomicU64 = AtomicU64::new(0);

fn window_stage() -> Option<&'static (String, u64)> {
    WINDOW
        .get_or_init(|| {
            let v = std::env::var("FLEET_CUDA_PROFILE_STAGE").ok()?;
            let (stage, n) = match v.split_once('@') {
                Some((s, n)) => (s, n.parse().ok().filter(|&n| n >= 1)?),
                None => (v.as_str(), 1),
            };
            Some((stage.to_string(), n))
        })
        .as_ref()
}

/// Runs `f`; on the call of `stage` that `FLEET_CUDA_PROFILE_STAGE=<stage>[@<n>]` names (the
/// n-th, default the first), inside the range that `ncu --profile-from-start off` profiles, so
/// that one phase of a whole job (a training micro-step, a prefill) can be profiled without
/// its warm-up. Every stage that `FLEET_PROFILE` times is such a window; free when the variable
/// is unset.
pub fn profiler_window<T, E: From<crate::error::ModelError>>(
    stage: &str,
    f: impl FnOnce() -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    let Some((name, n)) = window_stage() else {
        return f();
    };
    if name != stage || WINDOW_CALLS.fetch_add(1, Ordering::Relaxed) + 1 != *n {
        return f();
    }
    cuda_profiler_range(true)?;
    let out = f();
    cuda_profiler_range(false)?;
    out
}

/// Runs `f`; when profiling, adds its synchronized wall time to `stage`.
pub(crate) fn time<T>(
    dev: &Device,
    stage: &'static str,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    profiler_window(stage, || time_stage(dev, stage, f))
}

fn time_stage<T>(dev: &Device, stage: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    if !enabled() || CAPTURING.with(|c| c.get()) {
        return f();
    }
    #[cfg(feature = "cuda")]
    if events_mode() {
        if let Device::Cuda(cuda) = dev {
            return events::time(cuda, stage, f);
        }
    }
    dev.synchronize()?;
    if coarse(stage) {
        begin();
    }
    let t = Instant::now();
    let out = f()?;
    let host = t.elapsed().as_secs_f64();
    dev.synchronize()?;
    record_times(stage, t.elapsed().as_secs_f64(), host, true);
    Ok(out)
}

/// `FLEET_PROFILE=events`: each stage's pair of events, read when the report is taken.
#[cfg(feature = "cuda")]
mod events {
    use std::sync::Mutex;
    use std::time::Instant;

    use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent};
    use candle_core::CudaDevice;

    use crate::error::{ModelError, Result};

    /// A stage's call not yet read: its events and the host's seconds in it.
    struct Pending {
        stage: &'static str,
        start: CudaEvent,
        end: CudaEvent,
        host: f64,
    }

    /// Calls whose events are not yet read, in order.
    static PENDING: Mutex<Vec<Pending>> = Mutex::new(Vec::new());

    /// Calls held before the oldest are read (each read waits for its end event): enough for
    /// a long run's stages between reports, few enough to keep the events' handles bounded.
    const MAX_PENDING: usize = 1 << 16;

    fn record(cuda: &CudaDevice) -> Result<CudaEvent> {
        cuda.cuda_stream()
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| ModelError::Candle(candle_core::Error::Msg(format!("profile event: {e}"))))
    }

    pub(super) fn time<T>(
        cuda: &CudaDevice,
        stage: &'static str,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let start = record(cuda)?;
        let t = Instant::now();
        let out = f()?;
        let host = t.elapsed().as_secs_f64();
        let end = record(cuda)?;
        let mut pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
        pending.push(Pending {
            stage,
            start,
            end,
            host,
        });
        if pending.len() >= MAX_PENDING {
            let older: Vec<Pending> = pending.drain(..MAX_PENDING / 2).collect();
            drop(pending);
            read(older);
        }
        Ok(out)
    }

    /// Adds every pending call's span and host time to the totals.
    pub(super) fn read_all() {
        let all = std::mem::take(&mut *PENDING.lock().unwrap_or_else(|e| e.into_inner()));
        read(all);
    }

    fn read(calls: Vec<Pending>) {
        for p in calls {
            // elapsed_ms waits for both events; a failed read (a device error) leaves the call
            // out, said on stderr, rather than report a made-up span.
            match p.start.elapsed_ms(&p.end) {
                Ok(ms) => super::record_times(p.stage, f64::from(ms) / 1e3, p.host, false),
                Err(e) => eprintln!(
                    "profile: stage {} left out, its events unread: {e}",
                    p.stage
                ),
            }
        }
    }
}

/// Adds `seconds` to `stage` (for callers outside this crate that time their own stages,
/// synchronizing the device themselves and calling [`begin`] at the start of a coarse one);
/// does nothing unless profiling.
pub fn record(stage: &'static str, seconds: f64) {
    record_times(stage, seconds, seconds, true);
}

/// [`record`] with the host's part of the time given apart; `memory`: whether the memory
/// window is this stage's (a synchronized stage, not one read from its events later).
fn record_times(stage: &'static str, seconds: f64, host_seconds: f64, memory: bool) {
    if !enabled() {
        return;
    }
    let (peak, (live, reserved)) = if coarse(stage) && memory {
        (
            PEAK.load(Ordering::Relaxed),
            fleet_topology::gpu_pool_high_water(0).unwrap_or((0, 0)),
        )
    } else {
        (0, (0, 0))
    };
    let mut times = TIMES.lock().unwrap_or_else(|e| e.into_inner());
    let e = times.entry(stage).or_insert(StageReport {
        stage,
        seconds: 0.0,
        host_seconds: 0.0,
        calls: 0,
        peak_bytes: 0,
        live_peak_bytes: 0,
        reserved_peak_bytes: 0,
    });
    e.seconds += seconds;
    e.host_seconds += host_seconds;
    e.calls += 1;
    e.peak_bytes = e.peak_bytes.max(peak);
    e.live_peak_bytes = e.live_peak_bytes.max(live);
    e.reserved_peak_bytes = e.reserved_peak_bytes.max(reserved);
}

/// Every stage's totals since the last call, by name; empty unless profiling. With
/// `FLEET_PROFILE=events` it first waits for the stages' events.
pub fn take_report() -> Vec<StageReport> {
    #[cfg(feature = "cuda")]
    events::read_all();
    let mut times = TIMES.lock().unwrap_or_else(|e| e.into_inner());
    let out = times.values().copied().collect();
    times.clear();
    out
}

/// Opens (`on`) or closes the range that `ncu --profile-from-start off` profiles (the driver's
/// `cuProfilerStart` / `cuProfilerStop`), so that a profile holds the timed work only, not the
/// model's build and warm-up. Does nothing without CUDA.
pub fn cuda_profiler_range(on: bool) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::sys;
        // SAFETY: both calls take no arguments and only toggle the attached profiler; a
        // context is current on this thread once a CUDA device was opened (and without a
        // profiler attached they do nothing).
        let r = unsafe {
            if on {
                sys::cuProfilerStart()
            } else {
                sys::cuProfilerStop()
            }
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(crate::error::ModelError::Candle(candle_core::Error::Msg(
                format!("cuProfiler{}: {r:?}", if on { "Start" } else { "Stop" }),
            )));
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = on;
    Ok(())
}
