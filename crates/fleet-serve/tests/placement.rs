//! Replicas: batched generation spread over several loaded copies of a model returns what one
//! copy returns, in input order. CPU replicas stand in for GPUs here; the GPU path is the same
//! code with other device maps (measured by `fleet bench data-parallel` on the GPU machine).

use fleet_models::{DeviceLocation, DeviceMap, LoadOptions, TextModel};
use fleet_serve::{PlacementRequest, Replicas, Text};

mod common;
use common::{fixture, requests};

#[test]
fn two_replicas_generate_what_one_model_generates_in_input_order() {
    let dir = fixture("qwen2-tiny");
    let spec = dir.to_str().unwrap();
    let opts = LoadOptions::default();
    let single = TextModel::load(spec, &opts).unwrap();
    let requests = requests(7);
    let expected = single.generate(&requests, None).unwrap();

    let cpu = DeviceMap::single(DeviceLocation::Cpu, single.model.config().num_hidden_layers);
    let replicas = Replicas::<Text>::load(spec, &opts, &[cpu.clone(), cpu]).unwrap();
    assert_eq!(replicas.len(), 2);
    for max_batch in [1, 2, 3, 100] {
        let got = replicas.generate(&requests, max_batch, false).unwrap();
        assert_eq!(got.len(), requests.len());
        for (g, e) in got.iter().zip(&expected) {
            assert_eq!(g.token_ids, e.token_ids, "max_batch {max_batch}");
        }
    }
}

#[test]
fn planned_placement_without_gpus_is_one_cpu_replica() {
    if cfg!(feature = "cuda") {
        return; // a CUDA build may see GPUs; this is the CPU machine's behaviour.
    }
    let dir = fixture("qwen3-tiny");
    let spec = dir.to_str().unwrap();
    let request = PlacementRequest::new("data-parallel".parse().unwrap());
    let replicas = Replicas::<Text>::load_planned(spec, &LoadOptions::default(), &request).unwrap();
    assert_eq!(replicas.len(), 1);
    assert_eq!(
        replicas.models[0].model.device_map().devices(),
        vec![DeviceLocation::Cpu]
    );

    let on_gpu_3 = PlacementRequest {
        gpu_ids: Some(vec![3]),
        ..request
    };
    let err = Replicas::<Text>::load_planned(spec, &LoadOptions::default(), &on_gpu_3)
        .err()
        .expect("GPU 3 on a machine without GPUs")
        .to_string();
    assert!(err.contains("GPU 3 does not exist"), "{err}");

    // A budget for a GPU the machine does not have is not silently ignored either.
    let budget_for_gpu_9 = PlacementRequest {
        max_memory: "9=10GiB".parse().unwrap(),
        ..PlacementRequest::new("data-parallel".parse().unwrap())
    };
    let err = Replicas::<Text>::load_planned(spec, &LoadOptions::default(), &budget_for_gpu_9)
        .err()
        .expect("a budget for GPU 9 on a machine without GPUs")
        .to_string();
    assert!(err.contains("GPU 9"), "{err}");
}
