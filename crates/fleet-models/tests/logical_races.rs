//! Issue 24: logical devices on one GPU catch both races a copy between devices can have, and
//! `device::transfer`'s two waits prevent both.
//!
//! Each race is made deterministic with a delay kernel (`ops::gpu_delay`, 50 ms on one stream):
//!
//! 1. *The destination reads before the source wrote.* Device A is held up, then writes `ones`
//!    into a block it just freed (it held sevens); the copy to B is queued at once. Without the
//!    destination's wait, B copies the block before A has written it.
//! 2. *The source's buffer is reused before the copy.* Device B is held up, so the copy of A's
//!    `ones` waits on B's stream; A frees `ones` and writes nines into the same block at once.
//!    Without the source's wait, B later copies nines.
//!
//! With both waits every trial copies ones; with either off, its race shows. The mapping of
//! logical devices is process-wide, so this is a test binary of its own. On a machine without a
//! GPU it prints SKIPPED.

use candle_core::{DType, Device, Tensor};
use fleet_models::device::{set_transfer_waits, transfer};
use fleet_models::ops::gpu_delay;
use fleet_topology::{logical, DeviceLocation};

const N: usize = 1 << 20; // 4 MiB of f32
const DELAY_NS: u64 = 50_000_000;

fn all_ones(t: &Tensor) -> bool {
    t.to_vec1::<f32>().unwrap().iter().all(|&v| v == 1.0)
}

/// Race 1; true when B got the ones.
fn destination_race(a: &Device, b: &Device) -> bool {
    let sevens = Tensor::full(7f32, N, a).unwrap();
    drop(sevens);
    gpu_delay(a, DELAY_NS).unwrap();
    let ones = Tensor::ones(N, DType::F32, a).unwrap();
    let on_b = transfer(&ones, b).unwrap();
    let ok = all_ones(&on_b);
    a.synchronize().unwrap();
    ok
}

/// Race 2; true when B got the ones.
fn source_race(a: &Device, b: &Device) -> bool {
    gpu_delay(b, DELAY_NS).unwrap();
    let ones = Tensor::ones(N, DType::F32, a).unwrap();
    let on_b = transfer(&ones, b).unwrap();
    drop(ones);
    let nines = Tensor::full(9f32, N, a).unwrap();
    let ok = all_ones(&on_b);
    a.synchronize().unwrap();
    drop(nines);
    ok
}

#[test]
fn both_races_are_caught_and_both_waits_prevent_them() {
    let gpus = fleet_topology::discover()
        .map(|d| d.iter().any(|d| d.location.cuda_ordinal().is_some()))
        .unwrap_or(false);
    if !gpus || !candle_core::utils::cuda_is_available() {
        eprintln!("SKIPPED: logical devices need a GPU and a CUDA build");
        return;
    }
    logical::install(logical::LogicalGpus::parse_flag("2:2GiB").unwrap()).unwrap();
    let a = fleet_models::open_device(DeviceLocation::Cuda(0)).unwrap();
    let b = fleet_models::open_device(DeviceLocation::Cuda(1)).unwrap();
    const TRIALS: usize = 3;
    let run = |dst: bool, src: bool| {
        set_transfer_waits(dst, src);
        let first: Vec<bool> = (0..TRIALS).map(|_| destination_race(&a, &b)).collect();
        let second: Vec<bool> = (0..TRIALS).map(|_| source_race(&a, &b)).collect();
        set_transfer_waits(true, true);
        (first, second)
    };
    let (d, s) = run(true, true);
    println!("both waits: destination race copied ones {d:?}, source race {s:?}");
    assert!(
        d.iter().chain(&s).all(|&ok| ok),
        "with both waits every copy is right"
    );
    let (d, _) = run(false, true);
    println!("no destination wait: destination race copied ones {d:?}");
    assert!(
        d.iter().any(|&ok| !ok),
        "without the destination's wait race 1 must show"
    );
    let (_, s) = run(true, false);
    println!("no source wait: source race copied ones {s:?}");
    assert!(
        s.iter().any(|&ok| !ok),
        "without the source's wait race 2 must show"
    );
}
