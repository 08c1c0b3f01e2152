//! GSPO training plans (policy, reference, reward model) on the virtual topologies.
//!
//! Unless a test says otherwise the step is [`TrainingWorkload::default`]: bf16, micro-batch
//! 8 x (512 prompt + 256 completion) tokens, gradient checkpointing on, log-softmax in chunks
//! of 512 rows, rollouts of 32 sequences (8 generations x 4 prompts); default reserves (10% or
//! 1 GiB per GPU: 10.80 GiB of a 12 GiB RTX 3060, 126.36 GiB of a 140.4 GiB H200) and 500 MiB
//! of CUDA context per GPU.

use fleet_topology::*;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

fn topo(name: &str) -> Topology {
    Topology::from_file(format!("{ROOT}/configs/topologies/{name}.toml")).unwrap()
}

fn qwen25(size: &str) -> ModelShape {
    ModelShape::from_config_file(format!("{ROOT}/configs/models/qwen2.5-{size}.json")).unwrap()
}

/// Qwen2.5-1.5B: 28 layers, hidden 1536, 12 heads, 2 kv heads, intermediate 8960, tied.
fn qwen25_1_5b() -> ModelShape {
    ModelShape::from_config_str(
        r#"{"model_type":"qwen2","num_hidden_layers":28,"hidden_size":1536,
        "num_attention_heads":12,"num_key_value_heads":2,"intermediate_size":8960,
        "vocab_size":151936,"tie_word_embeddings":true}"#,
        "qwen2.5-1.5b",
    )
    .unwrap()
}

/// A reward model on a Qwen2.5 body: one label.
fn reward_model(size: &str) -> ModelShape {
    qwen25(size).with_classification_head(1).unwrap()
}

fn request(preset: &str, reference: bool) -> TrainingRequest {
    TrainingRequest {
        preset: preset.parse().unwrap(),
        reference,
        ..TrainingRequest::default()
    }
}

fn with_batch(mut r: TrainingRequest, batch: usize) -> TrainingRequest {
    r.workload.per_device_train_batch_size = batch;
    r
}

/// The invariants of every training plan.
fn check(plan: &TrainingPlan, policy: &ModelShape) {
    plan.policy.validate(policy.num_layers).unwrap();
    for map in [&plan.reference, &plan.reward].into_iter().flatten() {
        assert_eq!(map.devices().len(), 1, "frozen models sit on one device");
    }
    let mut policy_layers = 0;
    for d in &plan.devices {
        assert!(!d.roles.is_empty());
        let sum = |f: fn(&RoleCost) -> u64| d.roles.iter().map(|r| f(&r.cost)).sum::<u64>();
        assert_eq!(d.persistent, sum(RoleCost::persistent));
        assert_eq!(d.rollout, sum(RoleCost::rollout));
        assert_eq!(d.training, sum(RoleCost::training));
        assert_eq!(
            d.total,
            d.overhead + d.persistent + d.rollout.max(d.training)
        );
        let gpu = d.device != DeviceLocation::Cpu;
        assert_eq!(d.overhead, if gpu { TRAINING_CONTEXT_BYTES } else { 0 });
        assert!(d.fits(), "{plan}");
        assert_eq!(d.headroom, d.budget - d.total);
        for r in &d.roles {
            if r.role == TrainingRole::Policy {
                assert!(!r.layers.is_empty());
                policy_layers += r.layers.len();
                assert_eq!(
                    r.embed,
                    plan.policy.embed == d.device && r.layers.start == 0
                );
                assert_eq!(r.head, plan.policy.head == d.device);
            }
        }
    }
    assert_eq!(policy_layers, policy.num_layers);
    assert!(plan.idle.iter().all(|i| plan.device(*i).is_none()));
}

fn roles_on(plan: &TrainingPlan, device: DeviceLocation) -> Vec<TrainingRole> {
    plan.device(device)
        .map(|d| d.roles.iter().map(|r| r.role).collect())
        .unwrap_or_default()
}

/// Qwen2.5-0.5B (0.494B parameters: 5.9 GB of weights and moments, 2.0 GB of gradients in the
/// step, 1.0 GB inference copy during rollouts) fits one RTX 3060 at 4 and at the default 8
/// sequences per micro-batch; at 32 the activations take it over, and auto shards it over
/// three. A reference and a reward model (0.5B each, 0.99 GB of bf16 weights) go on a second
/// GPU.
#[test]
fn qwen05_policy_fits_one_rtx3060() {
    let t = topo("rtx3060-8x");
    let s = qwen25("0.5b");
    let p = plan_training(&s, None, &t, &with_batch(request("auto", false), 4)).unwrap();
    check(&p, &s);
    assert_eq!(
        p.policy,
        DeviceMap::single(DeviceLocation::Cuda(0), 24),
        "{p}"
    );
    assert_eq!(p.gpus_used(), 1);
    assert_eq!(p.idle.len(), 7);
    assert!((p.devices[0].total as f64 / GIB as f64) > 9.5, "{p}");
    // 1gpu says the same.
    let one = plan_training(&s, None, &t, &with_batch(request("1gpu", false), 4)).unwrap();
    assert_eq!(one.policy, p.policy);

    // The default 8 still fits one GPU; at 32 one is not enough and auto shards over three.
    let p8 = plan_training(&s, None, &t, &request("auto", false)).unwrap();
    assert_eq!(p8.policy.devices().len(), 1, "{p8}");
    let p32 = plan_training(&s, None, &t, &with_batch(request("auto", false), 32)).unwrap();
    check(&p32, &s);
    assert_eq!(p32.policy.devices().len(), 3, "{p32}");
    assert!(matches!(
        plan_training(&s, None, &t, &with_batch(request("1gpu", false), 32)),
        Err(TopologyError::DoesNotFit { .. })
    ));

    // With a reference and a reward model: the policy stays on cuda:0, both frozen models
    // go to the least-loaded GPU, cuda:1.
    let rm = reward_model("0.5b");
    let p = plan_training(&s, Some(&rm), &t, &with_batch(request("auto", true), 4)).unwrap();
    check(&p, &s);
    assert_eq!(
        p.policy,
        DeviceMap::single(DeviceLocation::Cuda(0), 24),
        "{p}"
    );
    assert_eq!(
        p.reference,
        Some(DeviceMap::single(DeviceLocation::Cuda(1), 24))
    );
    assert_eq!(
        p.reward,
        Some(DeviceMap::single(DeviceLocation::Cuda(1), 24))
    );
    assert_eq!(p.gpus_used(), 2);
}

/// Qwen2.5-1.5B: 27.8 GB (25.9 GiB) of training state and inference copy, more than two
/// RTX 3060 budgets hold: one GPU does not fit, auto shards it over four.
#[test]
fn qwen15_needs_sharding_on_rtx3060() {
    let t = topo("rtx3060-8x");
    let s = qwen25_1_5b();
    let err = plan_training(&s, None, &t, &request("1gpu", false)).unwrap_err();
    let TopologyError::DoesNotFit {
        needed_bytes,
        available,
        ..
    } = &err
    else {
        panic!("{err}")
    };
    assert!(*needed_bytes > 27 * GIB, "{needed_bytes}");
    let cuda0 = DeviceLocation::Cuda(0);
    assert_eq!(
        available,
        &vec![(cuda0, MaxMemory::new().budget(cuda0, 12 * GIB))]
    );
    let msg = err.to_string();
    for want in [
        "1gpu",
        "cuda:0 needs",
        "10.80 GiB budget",
        "policy (layers 0..28)",
        "weights 5.75 GiB",
        "gradients 5.75 GiB",
        "optimizer 11.50 GiB",
        "inference copy 2.88 GiB",
        "KV cache",
        "activations",
        "per_device_train_batch_size (now 8",
        "max_completion_length (now 256",
        "at least 3 GPU(s)",
        "--gpu-mode auto",
        "2gpu",
        "--max-memory",
    ] {
        assert!(msg.contains(want), "{want}: {msg}");
    }
    // Checkpointing is on already, so it is not offered.
    assert!(!msg.contains("gradient checkpointing on"), "{msg}");

    let p = plan_training(&s, None, &t, &request("auto", false)).unwrap();
    check(&p, &s);
    assert_eq!(p.policy.devices().len(), 4, "{p}");
    assert_eq!(p.idle.len(), 4);
    // 2gpu cannot hold it either.
    assert!(plan_training(&s, None, &t, &request("2gpu", false)).is_err());
}

/// Without gradient checkpointing every layer's forward is kept: the 1.5B policy's
/// activations (with the allocator's slack) grow from 3.8 GiB to 40.2 GiB, auto needs all eight RTX 3060 instead of four,
/// and the error of a preset that cannot hold it offers checkpointing.
#[test]
fn checkpointing_off_is_named_as_a_way_out() {
    let t = topo("rtx3060-8x");
    let s = qwen25_1_5b();
    let mut r = request("auto", false);
    r.workload.gradient_checkpointing = false;
    let p = plan_training(&s, None, &t, &r).unwrap();
    check(&p, &s);
    assert_eq!(p.gpus_used(), 8, "{p}");
    r.preset = TrainingPreset::TwoGpu;
    let msg = plan_training(&s, None, &t, &r).unwrap_err().to_string();
    assert!(
        msg.contains("gradient checkpointing on (the whole policy's activations 3.78 GiB instead of 40.24 GiB)"),
        "{msg}"
    );
    assert!(
        msg.contains("(2gpu mode)") && msg.contains("cuda:1 needs"),
        "{msg}"
    );
}

/// Qwen2.5-7B on two H200: 122 GB of weights, moments and gradients split over both; the
/// reference (15.2 GB) and a 7B reward model (14.1 GB) on GPU 1, so GPU 0 takes more of the
/// policy's layers.
#[test]
fn qwen7b_fits_two_h200_with_2gpu() {
    let t = topo("h200-2x");
    let s = qwen25("7b");
    let rm = reward_model("7b");
    let p = plan_training(&s, Some(&rm), &t, &request("2gpu", true)).unwrap();
    check(&p, &s);
    assert_eq!(
        p.policy.devices(),
        vec![DeviceLocation::Cuda(0), DeviceLocation::Cuda(1)]
    );
    assert_eq!(p.policy.embed, DeviceLocation::Cuda(0));
    assert_eq!(p.policy.head, DeviceLocation::Cuda(1));
    assert_eq!(
        p.reference,
        Some(DeviceMap::single(DeviceLocation::Cuda(1), 28))
    );
    assert_eq!(
        p.reward,
        Some(DeviceMap::single(DeviceLocation::Cuda(1), 28))
    );
    let on0 = p
        .policy
        .layers
        .iter()
        .filter(|&&d| d == DeviceLocation::Cuda(0))
        .count();
    assert!(on0 > 14, "GPU 0 carries more layers: {p}");
    assert_eq!(
        roles_on(&p, DeviceLocation::Cuda(1)),
        vec![
            TrainingRole::Policy,
            TrainingRole::Reference,
            TrainingRole::Reward
        ]
    );
    // The policy's terms over both devices: 16 B/param of training state (the embedding and
    // the untied head are on different devices, each counted once) and 2 B/param inference copy.
    let policy: Vec<&RolePlacement> = p
        .devices
        .iter()
        .flat_map(|d| d.roles.iter().filter(|r| r.role == TrainingRole::Policy))
        .collect();
    let state: u64 = policy
        .iter()
        .map(|r| r.cost.weights + r.cost.gradients + r.cost.optimizer)
        .sum();
    assert_eq!(state, 16 * s.total_params());
    let copy: u64 = policy.iter().map(|r| r.cost.inference_copy).sum();
    assert_eq!(copy, 2 * s.total_params());
    // Frozen models: weights in bf16 only.
    let d1 = p.device(DeviceLocation::Cuda(1)).unwrap();
    let reference = &d1.roles[1].cost;
    assert_eq!(reference.weights, s.total_weight_bytes(DType::Bf16));
    assert_eq!(
        reference.gradients + reference.optimizer + reference.kv_cache,
        0
    );
    assert_eq!(d1.roles[2].cost.weights, rm.total_weight_bytes(DType::Bf16));

    // All of it on one H200 does not fit: the error names each role's terms.
    let err = plan_training(&s, Some(&rm), &t, &request("1gpu", true)).unwrap_err();
    let msg = err.to_string();
    for want in [
        "with its reference and a reward model",
        "policy (layers 0..28): weights 28.37 GiB, gradients 28.37 GiB, optimizer 56.74 GiB",
        "reference (whole model): weights 14.19 GiB",
        "reward (whole model): weights 13.17 GiB",
        "--gpu-mode auto",
    ] {
        assert!(msg.contains(want), "{want}: {msg}");
    }
    // A tighter budget makes 2gpu fail as well, naming both devices.
    let mut tight = request("2gpu", true);
    tight.max_memory = "0=60GiB,1=60GiB".parse().unwrap();
    let msg = plan_training(&s, Some(&rm), &t, &tight)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("cuda:0 needs") && msg.contains("cuda:1 needs"),
        "{msg}"
    );
    assert!(msg.contains("of 60.00 GiB budget"), "{msg}");
}

/// 3gpu: the frozen models on GPU 2; auto on four H200 finds two GPUs enough: the policy alone
/// on one (its gradients exist only in the step, not during rollouts), both frozen models on
/// the other.
#[test]
fn three_gpu_preset_and_auto_on_four_h200() {
    let t = topo("h200-4x");
    let s = qwen25("7b");
    let rm = reward_model("7b");
    let p = plan_training(&s, Some(&rm), &t, &request("3gpu", true)).unwrap();
    check(&p, &s);
    assert_eq!(
        p.policy.devices(),
        vec![DeviceLocation::Cuda(0), DeviceLocation::Cuda(1)]
    );
    assert_eq!(
        roles_on(&p, DeviceLocation::Cuda(2)),
        vec![TrainingRole::Reference, TrainingRole::Reward]
    );
    assert_eq!(p.idle, vec![DeviceLocation::Cuda(3)]);
    // Without frozen models the policy alone is balanced: 14 layers each.
    let alone = plan_training(&s, None, &t, &request("3gpu", false)).unwrap();
    assert_eq!(
        alone.policy,
        DeviceMap::split_layers(&[DeviceLocation::Cuda(0), DeviceLocation::Cuda(1)], 28).unwrap()
    );
    assert_eq!(alone.idle.len(), 2);

    let auto = plan_training(&s, Some(&rm), &t, &request("auto", true)).unwrap();
    check(&auto, &s);
    assert_eq!(auto.gpus_used(), 2, "{auto}");
    assert_eq!(auto.policy, DeviceMap::single(DeviceLocation::Cuda(0), 28));
    assert_eq!(
        auto.reference,
        Some(DeviceMap::single(DeviceLocation::Cuda(1), 28))
    );
    assert_eq!(
        auto.reward,
        Some(DeviceMap::single(DeviceLocation::Cuda(1), 28))
    );
    // The reference is placed only when asked (beta > 0), the reward model only when given.
    let bare = plan_training(&s, None, &t, &request("auto", false)).unwrap();
    assert!(bare.reference.is_none() && bare.reward.is_none());
    assert!(bare.to_string().contains("reference: not placed"));
    assert!(bare.to_string().contains("reward:    not placed"));
}

/// A 7B policy on eight RTX 3060: 113 GiB of weights, moments and gradients alone, twelve
/// GPUs' worth.
#[test]
fn qwen7b_does_not_fit_eight_rtx3060() {
    let err = plan_training(
        &qwen25("7b"),
        None,
        &topo("rtx3060-8x"),
        &request("auto", true),
    )
    .unwrap_err();
    let TopologyError::DoesNotFit { available, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(available.len(), 8);
    let msg = err.to_string();
    assert!(
        msg.contains("at least 12 GPU(s)") && msg.contains("8 given"),
        "{msg}"
    );
    assert!(msg.contains("cuda:7 needs"), "{msg}");
}

#[test]
fn presets_need_their_gpus() {
    let s = qwen25("0.5b");
    let rm = reward_model("0.5b");
    let one = topo("h200-1x");
    let err = plan_training(&s, None, &one, &request("2gpu", false)).unwrap_err();
    assert!(
        matches!(
            err,
            TopologyError::PresetNeedsGpus {
                needed: 2,
                available: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("--gpu-mode 1gpu"), "{err}");
    let two = topo("h200-2x");
    let err = plan_training(&s, Some(&rm), &two, &request("3gpu", false)).unwrap_err();
    assert!(
        matches!(
            err,
            TopologyError::PresetNeedsGpus {
                needed: 3,
                available: 2,
                ..
            }
        ),
        "{err}"
    );
    // 3gpu with neither frozen model uses two GPUs only.
    let p = plan_training(&s, None, &two, &request("3gpu", false)).unwrap();
    check(&p, &s);
    // GPU positions follow --gpu-ids: 3gpu on GPUs 4, 6, 7 puts the frozen models on 7.
    let sel = topo("rtx3060-8x").select(&[4, 6, 7]).unwrap();
    let p = plan_training(&s, Some(&rm), &sel, &with_batch(request("3gpu", true), 2)).unwrap();
    check(&p, &s);
    assert_eq!(
        p.policy.devices(),
        vec![DeviceLocation::Cuda(4), DeviceLocation::Cuda(6)]
    );
    assert_eq!(
        p.reference,
        Some(DeviceMap::single(DeviceLocation::Cuda(7), 24))
    );
}

/// Without GPUs everything is planned on the CPU: unbounded when the host memory is unknown,
/// else within the `cpu` budget (or the host memory less the default reserve).
#[test]
fn cpu_topology_plans_on_the_cpu() {
    let s = qwen25("0.5b");
    let rm = reward_model("0.5b");
    let none = topo("rtx3060-8x").select(&[]).unwrap();
    let p = plan_training(&s, Some(&rm), &none, &request("auto", true)).unwrap();
    check(&p, &s);
    assert_eq!(p.devices.len(), 1);
    let d = &p.devices[0];
    assert_eq!(d.device, DeviceLocation::Cpu);
    assert_eq!(d.overhead, 0);
    assert_eq!(d.budget, u64::MAX);
    assert_eq!(p.policy, DeviceMap::single(DeviceLocation::Cpu, 24));
    assert_eq!(p.reward, Some(DeviceMap::single(DeviceLocation::Cpu, 24)));
    assert!(p.to_string().contains("budget unbounded"), "{p}");
    assert!(plan_training(&s, None, &none, &request("1gpu", false)).is_ok());
    assert!(matches!(
        plan_training(&s, None, &none, &request("3gpu", false)),
        Err(TopologyError::PresetNeedsGpus { available: 0, .. })
    ));

    let mut small = request("auto", false);
    small.max_memory = "cpu=4GiB".parse().unwrap();
    let msg = plan_training(&s, None, &none, &small)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("cpu needs") && msg.contains("of 4.00 GiB budget"),
        "{msg}"
    );
    assert!(msg.contains("cpu entry in --max-memory"), "{msg}");

    let host = Topology {
        cpu_bytes: Some(64 * GIB),
        ..none
    };
    let p = plan_training(&s, None, &host, &request("auto", false)).unwrap();
    assert_eq!(p.devices[0].budget, 64 * GIB - default_reserve(64 * GIB));
}

#[test]
fn bad_requests_are_named() {
    let s = qwen25("0.5b");
    let t = topo("rtx3060-8x");
    let mut r = request("auto", false);
    r.workload.head_chunk_rows = 0;
    let msg = plan_training(&s, None, &t, &r).unwrap_err().to_string();
    assert!(msg.contains("head_chunk_rows = 0"), "{msg}");
    let mut r = request("auto", false);
    r.max_memory = "9=10GiB".parse().unwrap();
    assert!(matches!(
        plan_training(&s, None, &t, &r),
        Err(TopologyError::MaxMemoryGpuNotPlanned { id: 9, .. })
    ));
    assert_eq!(
        "3GPU".parse::<TrainingPreset>().unwrap(),
        TrainingPreset::ThreeGpu
    );
    assert_eq!(
        "2-gpu".parse::<TrainingPreset>().unwrap(),
        TrainingPreset::TwoGpu
    );
    assert_eq!(
        "1gpu".parse::<TrainingPreset>().unwrap(),
        TrainingPreset::OneGpu
    );
    assert_eq!(
        "auto".parse::<TrainingPreset>().unwrap(),
        TrainingPreset::Auto
    );
    let err = "4gpu".parse::<TrainingPreset>().unwrap_err().to_string();
    assert!(
        err.contains("4gpu") && err.contains("3gpu") && err.contains("auto"),
        "{err}"
    );
    assert_eq!(TrainingPreset::ThreeGpu.to_string(), "3gpu");
}

/// A reward model's config.json (`Qwen2ForSequenceClassification`, one label in `id2label`)
/// reads as a classifier: a hidden x 1 score head instead of the (tied) lm_head.
#[test]
fn reward_model_config_is_a_classifier() {
    let text = r#"{"architectures":["Qwen2ForSequenceClassification"],"model_type":"qwen2",
        "num_hidden_layers":24,"hidden_size":896,"num_attention_heads":14,"num_key_value_heads":2,
        "intermediate_size":4864,"vocab_size":151936,"tie_word_embeddings":true,
        "id2label":{"0":"LABEL_0"},"label2id":{"LABEL_0":0}}"#;
    let rm = ModelShape::from_config_str(text, "rm/config.json").unwrap();
    assert_eq!(rm.classification_head, Some(1));
    assert!(!rm.head_shares_embedding());
    assert_eq!(rm.head_outputs(), 1);
    assert_eq!(rm.lm_head_params(), 896);
    assert_eq!(rm.total_params(), reward_model("0.5b").total_params());
    // Without id2label transformers' default is 2 labels.
    let two = text.replace(r#""id2label":{"0":"LABEL_0"},"#, "");
    let rm2 = ModelShape::from_config_str(&two, "rm/config.json").unwrap();
    assert_eq!(rm2.classification_head, Some(2));
    // A language model is not one.
    assert_eq!(qwen25("0.5b").classification_head, None);
    // Its inference workspace is num_labels wide on the head device.
    let part = DevicePart {
        layers: 0,
        embed: false,
        head: true,
        gpu: true,
    };
    let w = Workload {
        batch: 4,
        seq_len: 100,
        full_logits: true,
        kv_pool_bytes: None,
        max_attention_bytes: None,
    };
    assert_eq!(
        rm.workspace_bytes(part, DType::Bf16, &w),
        4 * 4 * 100 * 896 * 2 + 4 * 100 * 4
    );
}

/// The displayed plan: the maps, a table per device with each role's terms, the sums.
#[test]
fn plans_display_and_serialize() {
    let s = qwen25("7b");
    let rm = reward_model("7b");
    let p = plan_training(&s, Some(&rm), &topo("h200-2x"), &request("2gpu", true)).unwrap();
    let text = p.to_string();
    for want in [
        "training plan on 2x H200 141 GB (preset 2gpu)",
        "micro-batch 8 x (512 prompt + 256 completion) tokens, gradient checkpointing on",
        "rollouts 32 sequences (8 generations x 4 prompts)",
        "policy:    embed=cuda:0 layers[0..",
        "reference: cuda:1",
        "reward:    cuda:1",
        "cuda:0: total",
        "of budget 126.36 GiB (headroom",
        "weights   gradients   optimizer  infer copy    KV cache     prefill activations",
        "reference  whole (28 layers)",
        "= context 700.0 MiB + persistent",
    ] {
        assert!(text.contains(want), "{want}:\n{text}");
    }
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(json["reference"]["embed"], "cuda:1");
    assert_eq!(json["devices"][1]["roles"][1]["role"], "reference");
    assert_eq!(json["preset"], "2gpu");
    assert!(
        json["devices"][0]["roles"][0]["cost"]["optimizer"]
            .as_u64()
            .unwrap()
            > 30_000_000_000
    );
}
