//! Issue 26: a model over several devices decodes through one CUDA graph per device segment,
//! the stream copied between them, and gives the tokens of its plain lock-step decode. The
//! devices are the first two real GPUs where there are two, then two logical devices of one
//! GPU (process-wide, so a test binary of its own, and the real GPUs first); two placements
//! cover every kind of segment: the embedding and the head sharing a layer's device, and each
//! on a device of its own. On a machine without a GPU it prints SKIPPED.

use fleet_models::{DeviceLocation, DeviceMap, GenerationRequest, PagedOptions, SamplingParams};
use fleet_topology::logical;

#[path = "common/kernel_shaped.rs"]
mod kernel_shaped;

#[test]
fn sharded_decode_graphs_give_the_lock_step_tokens() {
    let real = fleet_topology::discover()
        .map(|d| {
            d.iter()
                .filter(|d| d.location.cuda_ordinal().is_some())
                .count()
        })
        .unwrap_or(0);
    if real == 0 || !candle_core::utils::cuda_is_available() {
        eprintln!("SKIPPED: logical devices need a GPU and a CUDA build");
        return;
    }
    if real >= 2 {
        eprintln!("two real GPUs");
        segments_decode_as_lock_step();
    } else {
        eprintln!("one real GPU: the two-GPU case is not run");
    }
    logical::install(logical::LogicalGpus::parse_flag("2:2GiB").unwrap()).unwrap();
    eprintln!("two logical devices of GPU 0");
    segments_decode_as_lock_step();
}

/// Both placements over `cuda:0` and `cuda:1`, whatever they are in this process.
fn segments_decode_as_lock_step() {
    let (a, b) = (DeviceLocation::Cuda(0), DeviceLocation::Cuda(1));
    let placements = [
        // Segments: embedding + layer 0 on a, layer 1 + head on b.
        DeviceMap {
            embed: a,
            layers: vec![a, b],
            head: b,
        },
        // Segments: the embedding alone on a, both layers on b, the head alone on a.
        DeviceMap {
            embed: a,
            layers: vec![b, b],
            head: a,
        },
    ];
    let requests: Vec<GenerationRequest> = (0..5)
        .map(|i| GenerationRequest {
            prompt_ids: (0..(3 + 37 * i))
                .map(|t| ((t * 29 + i * 5) % 500) as u32)
                .collect(),
            max_new_tokens: 4 + 3 * i,
            sampling: SamplingParams::greedy(),
            stop_strings: vec![],
        })
        .collect();
    let tokens = |o: &[fleet_models::GenerationOutput]| -> Vec<Vec<u32>> {
        o.iter().map(|o| o.token_ids.clone()).collect()
    };
    // The plain lock-step decode on one device: random weights are keyed by name, so every
    // placement holds the same model.
    let one = kernel_shaped::model(|n| DeviceMap {
        embed: a,
        layers: vec![a; n],
        head: a,
    });
    let on_one = tokens(
        &fleet_models::Generator::new(&one, None, Vec::new(), 0)
            .generate(&requests, None)
            .unwrap(),
    );
    for (p, map) in placements.into_iter().enumerate() {
        let model = kernel_shaped::model(|_| map.clone());
        let gen = fleet_models::Generator::new(&model, None, Vec::new(), 0);
        let want = tokens(&gen.generate(&requests, None).unwrap());
        assert_eq!(
            want, on_one,
            "placement {p}: the plain decode against one device"
        );
        for sync_every in [1, 3] {
            let options = PagedOptions {
                max_batch: 4,
                block_size: 16,
                num_blocks: 64,
                cuda_graphs: true,
                sync_every,
            };
            let (got, stats) = gen.generate_paged(&requests, &options, None).unwrap();
            assert_eq!(tokens(&got), want, "placement {p}, read every {sync_every}");
            assert!(stats.graphs_captured > 0, "placement {p}: nothing captured");
        }
    }
}
