//! Replicas in processes of their own, for real: this test program is its own replica worker
//! (`harness = false`, so `main` can call `serve_if_replica_worker` first, as fleet's binaries
//! do). CPU replicas stand in for GPUs; `FLEET_REPLICA_PROCESSES=1` puts them in processes.

use fleet_models::placement::Replicas;
use fleet_models::replica_process::{serve_if_replica_worker, PROCESSES_ENV};
use fleet_models::{DeviceLocation, DeviceMap, LoadOptions, TextModel};

mod common;
use common::{fixture, requests};

fn main() {
    serve_if_replica_worker();
    // SAFETY: set before any other thread exists; the workers inherit it.
    unsafe { std::env::set_var(PROCESSES_ENV, "1") };
    replicas_in_processes_generate_what_one_model_generates();
    a_batch_that_fails_in_every_process_is_reported();
    println!("replica_process: 2 tests passed");
}

fn replicas_in_processes_generate_what_one_model_generates() {
    let dir = fixture("qwen2-tiny");
    let spec = dir.to_str().unwrap();
    let opts = LoadOptions::default();
    let single = TextModel::load(spec, &opts).unwrap();
    let requests = requests(9);
    let expected = single.generate(&requests, None).unwrap();

    let cpu = DeviceMap::single(DeviceLocation::Cpu, single.model.config().num_hidden_layers);
    let replicas = Replicas::load(spec, &opts, &[cpu.clone(), cpu.clone(), cpu]).unwrap();
    assert_eq!(replicas.len(), 3);
    assert_eq!(
        replicas.in_processes(),
        2,
        "replicas after the first run in processes"
    );
    assert_eq!(replicas.models.len(), 1);
    for max_batch in [1, 2, 4, 100] {
        let got = replicas.generate(&requests, max_batch, false).unwrap();
        assert_eq!(got.len(), expected.len());
        for (g, e) in got.iter().zip(&expected) {
            assert_eq!(g.token_ids, e.token_ids, "max_batch {max_batch}");
            assert_eq!(g.text, e.text);
            assert_eq!(g.finish_reason, e.finish_reason);
        }
    }
}

fn a_batch_that_fails_in_every_process_is_reported() {
    let dir = fixture("qwen2-tiny");
    let spec = dir.to_str().unwrap();
    let opts = LoadOptions::default();
    let cpu = DeviceMap::single(DeviceLocation::Cpu, 4);
    let replicas = Replicas::load(spec, &opts, &[cpu.clone(), cpu]).unwrap();
    let mut requests = requests(9);
    requests[5].prompt_ids.clear();
    let err = replicas
        .generate(&requests, 3, false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("empty prompt"), "{err}");
    assert!(err.contains("failed on every replica"), "{err}");
    // The workers are still there for the next call.
    requests[5].prompt_ids.push(7);
    assert_eq!(replicas.generate(&requests, 3, false).unwrap().len(), 9);
}
