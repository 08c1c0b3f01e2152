//! The seeds' placement scenarios, planned on virtual topologies (no GPU needed).
//!
//! Unless a test says otherwise a plan is for bf16, batch 1 x 2048 tokens (KV cache for 2048
//! tokens, prefill workspace with f32 attention scores), the default reserve (10% or 1 GiB per
//! GPU) and 500 MiB of CUDA context per GPU. On a 12 GiB RTX 3060 that leaves a 10.8 GiB budget.

use fleet_topology::*;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

fn topo(name: &str) -> Topology {
    Topology::from_file(format!("{ROOT}/configs/topologies/{name}.toml")).unwrap()
}

fn qwen25(size: &str) -> ModelShape {
    ModelShape::from_config_file(format!("{ROOT}/configs/models/qwen2.5-{size}.json")).unwrap()
}

fn qwen2_shape(
    layers: usize,
    hidden: usize,
    heads: usize,
    kv: usize,
    inter: usize,
    vocab: usize,
    tied: bool,
) -> ModelShape {
    let json = format!(
        r#"{{"model_type":"qwen2","num_hidden_layers":{layers},"hidden_size":{hidden},
        "num_attention_heads":{heads},"num_key_value_heads":{kv},"intermediate_size":{inter},
        "vocab_size":{vocab},"tie_word_embeddings":{tied}}}"#
    );
    ModelShape::from_config_str(&json, "inline").unwrap()
}

/// Qwen2.5-1.5B: 28 layers, hidden 1536, 12 heads, 2 kv heads, intermediate 8960, tied.
fn qwen25_1_5b() -> ModelShape {
    qwen2_shape(28, 1536, 12, 2, 8960, 151936, true)
}

/// Qwen2.5-3B: 36 layers, hidden 2048, 16 heads, 2 kv heads, intermediate 11008, tied.
fn qwen25_3b() -> ModelShape {
    qwen2_shape(36, 2048, 16, 2, 11008, 151936, true)
}

/// Qwen3-VL-30B-A3B in the transformers layout (decoder under `text_config`). Numbers used:
/// 48 layers, hidden 2048, 32 heads, 4 kv heads, head_dim 128, 128 experts of which 8 are
/// active, moe_intermediate 768, vocab 151936, untied; vision tower 27 blocks of width 1152,
/// MLP 4304, out 2048, patch 16, merge 2, 2304 positions, 3 deepstack mergers (~0.54B).
const QWEN3_VL_30B_A3B: &str = r#"{
  "architectures": ["Qwen3VLMoeForConditionalGeneration"],
  "model_type": "qwen3_vl_moe",
  "tie_word_embeddings": false,
  "text_config": {
    "model_type": "qwen3_vl_moe_text",
    "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "vocab_size": 151936
  },
  "vision_config": {
    "model_type": "qwen3_vl_moe", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
    "out_hidden_size": 2048, "patch_size": 16, "temporal_patch_size": 2, "in_channels": 3,
    "spatial_merge_size": 2, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]
  }
}"#;

/// One replica on one GPU in bf16, sized for `workload`.
fn single(workload: Workload) -> PlanRequest {
    PlanRequest {
        mode: PlanMode::Single,
        dtype: DType::Bf16,
        workload,
        max_memory: MaxMemory::new(),
    }
}

fn auto() -> PlanRequest {
    PlanRequest::default()
}

fn with_mode(mode: &str) -> PlanRequest {
    PlanRequest {
        mode: mode.parse().unwrap(),
        ..PlanRequest::default()
    }
}

/// Checks the invariants every plan must keep.
fn check(plan: &Plan, shape: &ModelShape) {
    for r in &plan.replicas {
        r.device_map.validate(shape.num_layers).unwrap();
        assert_eq!(r.device_map.boundaries(), r.devices.len() - 1, "{plan}");
        let mut next = 0;
        for d in &r.devices {
            assert_eq!(d.layers.start, next);
            assert!(!d.layers.is_empty());
            next = d.layers.end;
            assert!(d.cost.total() <= d.budget, "{plan}");
            assert_eq!(d.headroom, d.budget - d.cost.total());
        }
        assert_eq!(next, shape.num_layers);
        assert!(r.devices[0].embed && r.devices.last().unwrap().head);
    }
}

fn b(x: f64) -> f64 {
    x / 1e9
}

#[test]
fn parameter_counts_match_the_published_sizes() {
    // Published: 1.54B, 3.09B, 7.61B, 14.7B, 32.5B (32.76B with the untied lm_head), 72.7B.
    let cases = [
        (qwen25_1_5b(), 1.54),
        (qwen25_3b(), 3.09),
        (qwen25("7b"), 7.62),
        (qwen25("14b"), 14.77),
        (qwen25("32b"), 32.76),
        (qwen25("72b"), 72.71),
    ];
    for (shape, want) in cases {
        let got = b(shape.total_params() as f64);
        assert!((got - want).abs() < 0.01, "{got} vs {want}");
    }
    // 7B in bf16 is 15.2 GB.
    let w = qwen25("7b").total_weight_bytes(DType::Bf16);
    assert!((b(w as f64) - 15.23).abs() < 0.01);
    assert_eq!(qwen25("7b").total_weight_bytes(DType::F32), 2 * w);
}

#[test]
fn qwen3_vl_moe_shape_is_about_31b() {
    let s = ModelShape::from_config_str(QWEN3_VL_30B_A3B, "qwen3-vl").unwrap();
    assert_eq!(s.num_layers, 48);
    assert_eq!(s.head_dim, 128);
    assert_eq!(s.moe.as_ref().unwrap().num_experts, 128);
    let vision = b(s.vision_params() as f64);
    assert!((0.5..0.65).contains(&vision), "vision {vision}B");
    let total = b(s.total_params() as f64);
    assert!((30.5..31.5).contains(&total), "total {total}B");
}

#[test]
fn kv_cache_and_tied_weights() {
    let s = qwen25("7b");
    // 2 * kv_heads 4 * head_dim 128 * 2 bytes per layer and token.
    assert_eq!(s.kv_bytes_per_token_per_layer(DType::Bf16), 2048);
    let w = Workload::default();
    let all = s.device_cost(
        DevicePart {
            layers: 28,
            embed: true,
            head: true,
            gpu: true,
        },
        DType::Bf16,
        &w,
    );
    assert_eq!(all.kv_cache, 28 * 2048 * 2048);
    assert_eq!(all.weights, s.total_weight_bytes(DType::Bf16));
    assert_eq!(all.overhead, CONTEXT_OVERHEAD_BYTES);

    // Tied: counted once on one device; a head on another device carries a copy.
    let t = qwen25_1_5b();
    let one = t.device_cost(
        DevicePart {
            layers: 28,
            embed: true,
            head: true,
            gpu: true,
        },
        DType::Bf16,
        &w,
    );
    assert_eq!(one.weights, t.total_weight_bytes(DType::Bf16));
    let part = |layers, embed, head| DevicePart {
        layers,
        embed,
        head,
        gpu: true,
    };
    let a = t.device_cost(part(14, true, false), DType::Bf16, &w);
    let z = t.device_cost(part(14, false, true), DType::Bf16, &w);
    assert_eq!(
        a.weights + z.weights,
        one.weights + t.lm_head_params() * 2,
        "the head device needs its own copy of the tied matrix"
    );

    // Full logits (log-probs) cost batch * seq * vocab * 4 bytes on the head device.
    let full = Workload {
        batch: 2,
        seq_len: 512,
        full_logits: true,
        kv_pool_bytes: None,
        max_attention_bytes: None,
    };
    let head = t.workspace_bytes(part(0, false, true), DType::Bf16, &full);
    assert!(head >= 2 * 512 * 151936 * 4);
    // A CPU device pays no context overhead.
    let cpu = t.device_cost(
        DevicePart {
            layers: 1,
            embed: false,
            head: false,
            gpu: false,
        },
        DType::Bf16,
        &w,
    );
    assert_eq!(cpu.overhead, 0);
}

#[test]
fn small_models_give_a_replica_per_rtx3060() {
    let t = topo("rtx3060-8x");
    for shape in [qwen25_1_5b(), qwen25_3b()] {
        let p = plan(&shape, &t, &auto()).unwrap();
        check(&p, &shape);
        assert_eq!(p.replicas.len(), 8, "{p}");
        assert_eq!(p.group_size(), 1);
        assert!(p.idle.is_empty());
        // Data-parallel gives the same.
        let dp = plan(&shape, &t, &with_mode("data-parallel")).unwrap();
        assert_eq!(dp.replicas, p.replicas);
    }
}

#[test]
fn qwen7b_on_rtx3060_is_four_replicas_of_two() {
    // 7B bf16 is 15.2 GB of weights: more than one 10.8 GiB budget, so shard groups of 2
    // (14 layers each, 7.1 GiB of weights per GPU) and 4 replicas.
    let t = topo("rtx3060-8x");
    let s = qwen25("7b");
    let p = plan(&s, &t, &auto()).unwrap();
    check(&p, &s);
    assert_eq!((p.replicas.len(), p.group_size()), (4, 2), "{p}");
    assert_eq!(p.replicas[1].device_map.embed, DeviceLocation::Cuda(2));
    assert_eq!(p.replicas[0].devices[0].layers, 0..14);
    let hybrid = plan(&s, &t, &with_mode("hybrid")).unwrap();
    assert_eq!(hybrid.replicas, p.replicas);
    // Single and data-parallel cannot hold it; the error says so and points to sharding.
    for mode in ["single", "data-parallel"] {
        let err = plan(&s, &t, &with_mode(mode)).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, TopologyError::DoesNotFit { .. }));
        assert!(msg.contains("layer-sharded"), "{msg}");
        assert!(msg.contains("cuda:0 10.80 GiB of 12.00 GiB"), "{msg}");
    }
    // Layer-sharded: one replica on the fewest GPUs (2), the rest idle.
    let ls = plan(&s, &t, &with_mode("layer-sharded")).unwrap();
    assert_eq!(
        (ls.replicas.len(), ls.group_size(), ls.idle.len()),
        (1, 2, 6)
    );
}

#[test]
fn qwen14b_on_rtx3060_is_two_replicas_of_four() {
    // 14B bf16 is 27.5 GiB of weights. Three GPUs would need ~9.2 GiB of weights each, plus
    // 1.04 GiB of prefill workspace (40 heads x 2048^2 f32 scores) and 0.5 GiB of context:
    // more than the 10.8 GiB budget. So groups of 4 (11-13 layers, 6.7-7.1 GiB each) and two
    // replicas: the same count that groups of 3 would have given (8 / 3 = 2).
    let t = topo("rtx3060-8x");
    let s = qwen25("14b");
    let p = plan(&s, &t, &auto()).unwrap();
    check(&p, &s);
    assert_eq!((p.replicas.len(), p.group_size()), (2, 4), "{p}");
    assert!(p.idle.is_empty());
    assert!(matches!(
        plan(&s, &t, &with_mode("hybrid:3")),
        Err(TopologyError::DoesNotFit { .. })
    ));
    // With a shorter workload (512 tokens) groups of 3 do fit: still 2 replicas, 2 GPUs idle.
    let short = PlanRequest {
        mode: PlanMode::Hybrid {
            group_size: Some(3),
        },
        workload: Workload {
            batch: 1,
            seq_len: 512,
            full_logits: false,
            kv_pool_bytes: None,
            max_attention_bytes: None,
        },
        ..PlanRequest::default()
    };
    let p3 = plan(&s, &t, &short).unwrap();
    check(&p3, &s);
    assert_eq!(
        (p3.replicas.len(), p3.group_size(), p3.idle.len()),
        (2, 3, 2)
    );
    assert!(matches!(
        plan(&s, &t, &with_mode("hybrid:9")),
        Err(TopologyError::GroupTooLarge { .. })
    ));
}

#[test]
fn qwen32b_on_rtx3060_needs_seven_gpus() {
    // 32B bf16 is 65.5 GB (61 GiB): 8-10 layers per GPU, seven GPUs, one replica; cuda:7 idle.
    let t = topo("rtx3060-8x");
    let s = qwen25("32b");
    let p = plan(&s, &t, &auto()).unwrap();
    check(&p, &s);
    assert_eq!((p.replicas.len(), p.group_size()), (1, 7), "{p}");
    assert_eq!(p.idle, vec![DeviceLocation::Cuda(7)]);
    // Balanced: no device has more than two layers more than another.
    let counts: Vec<usize> = p.replicas[0]
        .devices
        .iter()
        .map(|d| d.layers.len())
        .collect();
    assert!(
        counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 2,
        "{counts:?}"
    );
    // In f32 it needs 131 GB: the error names the need, the budgets and the ways out.
    let f32 = PlanRequest {
        dtype: DType::F32,
        ..PlanRequest::default()
    };
    let err = plan(&s, &t, &f32).unwrap_err();
    let TopologyError::DoesNotFit {
        needed_bytes,
        available,
        ..
    } = &err
    else {
        panic!("{err}")
    };
    assert!(*needed_bytes > 130_000_000_000);
    assert_eq!(available.len(), 8);
    let msg = err.to_string();
    for want in ["bf16", "more GPUs", "cpu offload", "cuda:7 10.80 GiB"] {
        assert!(msg.contains(want), "{want}: {msg}");
    }
}

#[test]
fn qwen72b_on_rtx3060_offloads_only_when_asked() {
    let t = topo("rtx3060-8x");
    let s = qwen25("72b");
    let err = plan(&s, &t, &auto()).unwrap_err().to_string();
    assert!(
        err.contains("about 14 GPUs") && err.contains("cpu=64GiB to --max-memory"),
        "{err}"
    );
    let offload = PlanRequest {
        max_memory: "cpu=96GiB".parse().unwrap(),
        ..PlanRequest::default()
    };
    let p = plan(&s, &t, &offload).unwrap();
    check(&p, &s);
    let r = &p.replicas[0];
    assert_eq!(r.devices.len(), 9);
    assert_eq!(r.device_map.head, DeviceLocation::Cpu);
    assert_eq!(r.devices[8].cost.overhead, 0);
}

#[test]
fn qwen3_vl_on_six_h100_is_six_replicas() {
    // ~31B parameters, 62 GB in bf16: fits one 80 GB H100 (71.7 GiB budget), so auto mode
    // gives one replica per GPU, not one replica over several.
    let t = topo("h100-6x");
    let s = ModelShape::from_config_str(QWEN3_VL_30B_A3B, "qwen3-vl").unwrap();
    let p = plan(&s, &t, &auto()).unwrap();
    check(&p, &s);
    assert_eq!((p.replicas.len(), p.group_size()), (6, 1), "{p}");
    for (i, r) in p.replicas.iter().enumerate() {
        assert_eq!(r.device_map, DeviceMap::single(DeviceLocation::Cuda(i), 48));
    }
}

#[test]
fn qwen72b_on_h200() {
    // 72B bf16: 135.4 GiB of weights; an H200's budget is 126.4 GiB (140.4 GiB less 10%).
    let s = qwen25("72b");
    let one = plan(&s, &topo("h200-1x"), &auto()).unwrap_err().to_string();
    assert!(
        one.contains("cpu offload") && one.contains("more GPUs"),
        "{one}"
    );

    // Two H200: 40 layers each, in either mode.
    let t2 = topo("h200-2x");
    for mode in ["auto", "layer-sharded"] {
        let p = plan(&s, &t2, &with_mode(mode)).unwrap();
        check(&p, &s);
        assert_eq!((p.replicas.len(), p.group_size()), (1, 2), "{p}");
        assert_eq!(p.replicas[0].devices[1].layers, 40..80);
    }
    // Four H200: auto gives two replicas of two; layer-sharded one replica on two GPUs.
    let t4 = topo("h200-4x");
    let p = plan(&s, &t4, &auto()).unwrap();
    check(&p, &s);
    assert_eq!((p.replicas.len(), p.group_size()), (2, 2), "{p}");
    let ls = plan(&s, &t4, &with_mode("layer-sharded")).unwrap();
    assert_eq!(
        (ls.replicas.len(), ls.group_size(), ls.idle.len()),
        (1, 2, 2)
    );
    // Eight H200: four replicas.
    let p8 = plan(&s, &topo("h200-8x"), &auto()).unwrap();
    assert_eq!(p8.replicas.len(), 4);
}

#[test]
fn budgets_change_the_plan() {
    let t = topo("h200-2x");
    let s = qwen25("7b");
    // Default: two replicas of one.
    assert_eq!(plan(&s, &t, &auto()).unwrap().replicas.len(), 2);
    // 10 GiB per GPU: one replica over both.
    let tight = PlanRequest {
        max_memory: "0=10GiB,1=10GiB".parse().unwrap(),
        ..PlanRequest::default()
    };
    let p = plan(&s, &t, &tight).unwrap();
    check(&p, &s);
    assert_eq!((p.replicas.len(), p.group_size()), (1, 2));
    assert_eq!(p.replicas[0].devices[0].budget, 10 * GIB);
    // A fraction of the total.
    let frac = PlanRequest {
        max_memory: "0=0.5,1=50%".parse().unwrap(),
        ..PlanRequest::default()
    };
    let p = plan(&s, &t, &frac).unwrap();
    assert_eq!(p.replicas[0].devices[0].budget, 143771 * MIB / 2);
}

#[test]
fn groups_prefer_peer_access() {
    let text = r#"
        name = "pairs"
        peer_groups = [[0, 2], [1, 3]]
        [[gpu]]
        name = "G"
        memory = "12GiB"
        count = 4
    "#;
    let t = Topology::from_toml_str(text, "pairs.toml").unwrap();
    let s = qwen25("7b");
    let p = plan(&s, &t, &auto()).unwrap();
    let groups: Vec<Vec<DeviceLocation>> =
        p.replicas.iter().map(|r| r.device_map.devices()).collect();
    assert_eq!(
        groups,
        vec![
            vec![DeviceLocation::Cuda(0), DeviceLocation::Cuda(2)],
            vec![DeviceLocation::Cuda(1), DeviceLocation::Cuda(3)]
        ]
    );
}

#[test]
fn selected_gpus_and_bad_requests() {
    let t = topo("rtx3060-8x");
    let sel = t.select(&[3, 5]).unwrap();
    let p = plan(&qwen25("7b"), &sel, &auto()).unwrap();
    assert_eq!(
        p.replicas[0].device_map.devices(),
        vec![DeviceLocation::Cuda(3), DeviceLocation::Cuda(5)]
    );
    let err = t.select(&[8]).unwrap_err().to_string();
    assert!(err.contains("GPU 8") && err.contains("8 GPUs"), "{err}");
    // The ids that exist are named: those of the topology, whichever they are.
    let err = t.select(&[0, 9]).unwrap_err();
    assert!(
        matches!(&err, TopologyError::GpuNotInTopology { id: 9, ids, .. } if ids.len() == 8),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("GPU 9") && msg.contains("ids 0-7") && msg.contains("--gpu-ids"),
        "{msg}"
    );
    let msg = sel.select(&[4]).unwrap_err().to_string();
    assert!(msg.contains("GPU 4") && msg.contains("(ids 3, 5)"), "{msg}");
    assert!(t.select(&[1, 1]).unwrap_err().to_string().contains("twice"));
    let none = t.select(&[]).unwrap();
    assert!(matches!(
        plan(&qwen25_1_5b(), &none, &auto()),
        Err(TopologyError::DoesNotFit { .. } | TopologyError::NoGpus { .. })
    ));
    let zero = PlanRequest {
        workload: Workload {
            batch: 0,
            seq_len: 10,
            full_logits: false,
            kv_pool_bytes: None,
            max_attention_bytes: None,
        },
        ..PlanRequest::default()
    };
    let err = plan(&qwen25_1_5b(), &t, &zero).unwrap_err().to_string();
    assert!(err.contains("batch = 0"), "{err}");
}

#[test]
fn modes_and_dtypes_parse() {
    assert_eq!("auto".parse::<PlanMode>().unwrap(), PlanMode::Auto);
    assert_eq!("DP".parse::<PlanMode>().unwrap(), PlanMode::DataParallel);
    assert_eq!(
        "layer_sharded".parse::<PlanMode>().unwrap(),
        PlanMode::LayerSharded
    );
    assert_eq!(
        "hybrid:3".parse::<PlanMode>().unwrap(),
        PlanMode::Hybrid {
            group_size: Some(3)
        }
    );
    for bad in ["hybrid:0", "hybrid:x", "pipeline-ish"] {
        let err = bad.parse::<PlanMode>().unwrap_err().to_string();
        assert!(err.contains(bad) && err.contains("layer-sharded"), "{err}");
    }
    assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::Bf16);
    assert_eq!("fp16".parse::<DType>().unwrap(), DType::F16);
    assert_eq!("F32".parse::<DType>().unwrap(), DType::F32);
    let err = "int4".parse::<DType>().unwrap_err().to_string();
    assert!(err.contains("int4") && err.contains("bf16"), "{err}");
}

#[test]
fn plans_serialize() {
    let p = plan(&qwen25("7b"), &topo("h200-1x"), &auto()).unwrap();
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(json["replicas"][0]["device_map"]["embed"], "cuda:0");
    assert!(
        json["replicas"][0]["devices"][0]["cost"]["weights"]
            .as_u64()
            .unwrap()
            > 15_000_000_000
    );
    assert!(p.to_string().contains("1 replica(s) of 1 GPU(s)"));
}

#[test]
fn model_config_errors_name_the_field() {
    let err = ModelShape::from_config_str(r#"{"num_hidden_layers": 2}"#, "cfg.json")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cfg.json") && err.contains("hidden_size"),
        "{err}"
    );
    let err = ModelShape::from_config_str("{", "cfg.json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("cfg.json") && err.contains("json"), "{err}");
    let bad_kv = r#"{"num_hidden_layers":2,"hidden_size":64,"num_attention_heads":4,
        "num_key_value_heads":3,"intermediate_size":128,"vocab_size":100}"#;
    let err = ModelShape::from_config_str(bad_kv, "cfg.json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("num_key_value_heads"), "{err}");
    let moe = r#"{"num_hidden_layers":2,"hidden_size":64,"num_attention_heads":4,
        "vocab_size":100,"num_experts":8}"#;
    let err = ModelShape::from_config_str(moe, "cfg.json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("num_experts_per_tok"), "{err}");
    let err = ModelShape::from_config_file("/nonexistent/config.json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/config.json"), "{err}");
}

/// The formulas of the memory model count exactly the parameters transformers saved for the
/// tiny Qwen2 (untied, biases), Qwen2 (tied, 3 shards) and Qwen3 (q/k norms) fixtures.
#[test]
fn config_formulas_match_the_safetensors_headers() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    for name in ["qwen2-tiny", "qwen2-tiny-tied-sharded", "qwen3-tiny"] {
        let dir = root.join(name);
        let estimated = ModelShape::from_config_file(dir.join("config.json")).unwrap();
        let counted = fleet_topology::CheckpointParams::from_dir(&dir).unwrap();
        assert_eq!(
            estimated.total_params(),
            counted.total(),
            "{name}: {counted:?}"
        );
        let exact = estimated.clone().with_checkpoint(counted).unwrap();
        assert_eq!(exact.layer_params(), estimated.layer_params(), "{name}");
        assert_eq!(exact.embed_params(), estimated.embed_params(), "{name}");
        assert_eq!(exact.total_params(), estimated.total_params(), "{name}");
    }
}

#[test]
fn checkpoint_with_other_layer_count_than_its_config_is_refused() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mut shape = ModelShape::from_config_file(root.join("qwen2-tiny/config.json")).unwrap();
    shape.num_layers += 1;
    let counted = fleet_topology::CheckpointParams::from_dir(root.join("qwen2-tiny")).unwrap();
    let err = shape.with_checkpoint(counted).unwrap_err().to_string();
    assert!(
        err.contains("decoder layers") && err.contains("num_hidden_layers"),
        "{err}"
    );
}

#[test]
fn truncated_safetensors_header_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("model.safetensors"), 1000u64.to_le_bytes()).unwrap();
    let err = fleet_topology::CheckpointParams::from_dir(dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("cut short"),
        "{err}"
    );
    let empty = tempfile::tempdir().unwrap();
    let err = fleet_topology::CheckpointParams::from_dir(empty.path())
        .unwrap_err()
        .to_string();
    assert!(err.contains("no *.safetensors"), "{err}");
}

/// A caller that splits its prefills under an attention budget is planned with that budget:
/// the 7B shape at batch 128 x 4096 needs ~350 GiB of attention scores at once, but fits one
/// H200 when prefills are capped at 16 GiB.
#[test]
fn capped_attention_makes_a_large_batch_fit() {
    let shape = qwen25("7b");
    let layers = DevicePart {
        layers: 28,
        embed: true,
        head: true,
        gpu: true,
    };
    let uncapped = Workload {
        batch: 128,
        seq_len: 4096,
        full_logits: false,
        kv_pool_bytes: None,
        max_attention_bytes: None,
    };
    let capped = Workload {
        max_attention_bytes: Some(16 << 30),
        ..uncapped
    };
    let big = shape.workspace_bytes(layers, DType::Bf16, &uncapped);
    let small = shape.workspace_bytes(layers, DType::Bf16, &capped);
    assert!(big > 300 << 30, "{big}");
    // What is left is the hidden states and the MLP of the full batch.
    assert!(small < big / 4, "{small}");
    let h200 = topo("h200-1x");
    assert!(plan(&shape, &h200, &single(uncapped)).is_err());
    assert_eq!(
        plan(&shape, &h200, &single(capped)).unwrap().replicas.len(),
        1
    );
}

/// Budgets the planner cannot honour are errors naming the entry, for every caller of `plan`:
/// a GPU the topology does not have (or that `--gpu-ids` left out), a budget of no memory.
#[test]
fn budgets_for_gpus_not_planned_on_are_errors() {
    let t = topo("rtx3060-8x");
    let s = qwen25("7b");
    let with_budget = |m: &str| PlanRequest {
        max_memory: m.parse().unwrap(),
        ..PlanRequest::default()
    };
    let err = plan(&s, &t, &with_budget("0=10GiB,9=10GiB")).unwrap_err();
    assert!(
        matches!(&err, TopologyError::MaxMemoryGpuNotPlanned { id: 9, .. }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("cuda:9") && msg.contains("ids 0-7") && msg.contains("--max-memory"),
        "{msg}"
    );
    // After `--gpu-ids 3,5` the keys are still the GPUs' own ids, not 0 and 1.
    let sel = t.select(&[3, 5]).unwrap();
    let msg = plan(&s, &sel, &with_budget("0=10GiB"))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("GPU 0") && msg.contains("(ids 3, 5)") && msg.contains("not renumbered"),
        "{msg}"
    );
    let p = plan(&s, &sel, &with_budget("3=11GiB,5=11GiB,cpu=8GiB")).unwrap();
    assert_eq!(p.replicas[0].devices[0].budget, 11 * GIB);

    // A zero budget built in code (the parser refuses it already) is refused by plan too.
    let mut zero = MaxMemory::new();
    zero.set(DeviceLocation::Cuda(1), MemoryLimit::Bytes(0));
    let request = PlanRequest {
        max_memory: zero,
        ..PlanRequest::default()
    };
    let err = plan(&s, &t, &request).unwrap_err();
    assert!(
        matches!(
            &err,
            TopologyError::ZeroBudget {
                device: DeviceLocation::Cuda(1),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("--gpu-ids"), "{err}");
}

/// Issue 24: the seed's 8 x 12 GB machine as logical devices on one H200 plans as the real one
/// does (the same replicas and layers), and the plan says it is on logical devices.
#[test]
fn the_seeds_machine_as_logical_devices_plans_like_the_machine_and_says_so() {
    let logical = topo("rtx3060-8x-on-h200");
    assert_eq!(logical.gpus.len(), 8);
    assert!(logical.gpus.iter().all(|g| g.total_bytes == 12 * GIB));
    assert!(logical.name.contains(logical::LABEL), "{}", logical.name);
    let l = logical
        .logical
        .as_ref()
        .expect("the file's logical devices");
    assert_eq!((l.devices.len(), l.physical_of(7)), (8, Some(0)));
    let s = qwen25("7b");
    let on_logical = plan(&s, &logical, &auto()).unwrap();
    let on_real = plan(&s, &topo("rtx3060-8x"), &auto()).unwrap();
    check(&on_logical, &s);
    assert_eq!(on_logical.replicas.len(), on_real.replicas.len());
    for (a, b) in on_logical.replicas.iter().zip(&on_real.replicas) {
        assert_eq!(a.device_map, b.device_map);
    }
    assert!(
        on_logical.to_string().contains(logical::LABEL),
        "{on_logical}"
    );
}

/// Issue 24: a topology file whose logical devices its GPU cannot hold is refused, naming the
/// file and the fix.
#[test]
fn logical_devices_beyond_the_gpu_are_refused_in_the_file() {
    let text = r#"
[[gpu]]
name = "NVIDIA H100"
memory = "80GiB"
[[logical]]
memory = "12GiB"
count = 8
"#;
    let e = Topology::from_toml_str(text, "seed.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("seed.toml")
            && e.contains("8 logical devices on GPU 0")
            && e.contains("less memory"),
        "{e}"
    );
    let e = Topology::from_toml_str(
        &text.replace("memory = \"12GiB\"\ncount", "gpu = 2\ncount"),
        "seed.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("GPU 2"), "{e}");
}

/// A paged KV pool is charged as its bytes, split over the devices by their layers, whatever
/// the batch: continuous batching at 256 decode slots with a 64 GiB pool fits one H200, where
/// KV for 256 full-length sequences would not.
#[test]
fn a_paged_pool_is_charged_by_its_bytes_and_split_by_layers() {
    let shape = qwen25("7b");
    let part = |layers| DevicePart {
        layers,
        embed: false,
        head: false,
        gpu: true,
    };
    let pool = Workload {
        batch: 2,
        seq_len: 4096,
        full_logits: false,
        max_attention_bytes: Some(1 << 30),
        kv_pool_bytes: Some(64 << 30),
    };
    assert_eq!(
        shape.device_cost(part(28), DType::Bf16, &pool).kv_cache,
        64 << 30
    );
    assert_eq!(
        shape.device_cost(part(7), DType::Bf16, &pool).kv_cache,
        16 << 30
    );
    let h200 = topo("h200-1x");
    assert_eq!(
        plan(&shape, &h200, &single(pool)).unwrap().replicas.len(),
        1
    );
    let per_sequence = Workload {
        batch: 256,
        kv_pool_bytes: None,
        ..pool
    };
    assert!(plan(&shape, &h200, &single(per_sequence)).is_err());
    // A pool larger than the GPU is refused.
    let too_big = Workload {
        kv_pool_bytes: Some(200 << 30),
        ..pool
    };
    assert!(plan(&shape, &h200, &single(too_big)).is_err());
}

/// The room a plan leaves for a paged pool is what a second plan can charge: the 7B on one
/// H200 leaves ~100 GiB beside its weights and a prompt pass, a pool of that size fits and
/// one GiB more does not; sharded over two GPUs, each device's headroom counts for its
/// layers' share.
#[test]
fn the_room_left_for_a_paged_pool_is_what_fits() {
    let shape = qwen25("7b");
    let request = |mode, pool| PlanRequest {
        mode,
        dtype: DType::Bf16,
        workload: Workload {
            batch: 2,
            seq_len: 4096,
            full_logits: false,
            max_attention_bytes: Some(1 << 30),
            kv_pool_bytes: Some(pool),
        },
        max_memory: MaxMemory::new(),
    };
    let h200 = topo("h200-1x");
    let room = plan(&shape, &h200, &request(PlanMode::Single, 0))
        .unwrap()
        .kv_pool_room()
        .unwrap();
    assert!((95u64 << 30..115 << 30).contains(&room), "{room}");
    let full = plan(&shape, &h200, &request(PlanMode::Single, room)).unwrap();
    assert_eq!(full.kv_pool_room(), Some(room));
    assert!(full.replicas[0].devices[0].headroom < 1 << 20);
    assert!(plan(&shape, &h200, &request(PlanMode::Single, room + (1 << 30))).is_err());

    let two = topo("h200-2x");
    let pair = PlanMode::Hybrid {
        group_size: Some(2),
    };
    let sharded = plan(&shape, &two, &request(pair, 0)).unwrap();
    assert_eq!(sharded.replicas[0].devices.len(), 2);
    let room2 = sharded.kv_pool_room().unwrap();
    assert!(room2 > room, "two GPUs hold more pool: {room2} vs {room}");
    assert!(plan(&shape, &two, &request(pair, room2)).is_ok());
    assert!(plan(&shape, &two, &request(pair, room2 + (2 << 30))).is_err());
}
