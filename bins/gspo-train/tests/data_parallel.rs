//! Data-parallel gspo-train on the CPU, with real processes and real sockets (TCP collectives
//! stand in for NCCL): N ranks train like one process with the same global batch, two
//! "nodes" like one node of two, a run resumes on another number of ranks, and a rank that
//! dies or runs another config stops the others with an error naming it.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn gspo_train() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gspo-train"));
    // A rank started by hand must not think a parent launcher started it.
    for v in [
        "FLEET_LAUNCHER",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
    ] {
        c.env_remove(v);
    }
    c
}

fn ok(out: &Output) -> (String, String) {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    (stdout, stderr)
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn port() -> String {
    fleet_dist::pick_free_port().unwrap().to_string()
}

/// The embedded default for `steps` steps into `out`, plus `extra` flags.
fn args(out: &Path, steps: u32, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--output-dir",
        out.to_str().unwrap(),
        "--max-steps",
        &steps.to_string(),
        "--set",
        "save_steps=4",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn f(v: &serde_json::Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

/// Same rewards, and losses and gradient norms within float-summation tolerance.
fn assert_same_curve(a: &[serde_json::Value], b: &[serde_json::Value], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: step counts");
    for (x, y) in a.iter().zip(b) {
        let step = &x["step"];
        assert_eq!(x["reward"], y["reward"], "{what}: reward at step {step}");
        assert_eq!(
            x["num_tokens"], y["num_tokens"],
            "{what}: tokens at step {step}"
        );
        for key in ["loss", "grad_norm", "entropy"] {
            let (p, q) = (f(x, key), f(y, key));
            assert!(
                (p - q).abs() <= 1e-4 * (1.0 + p.abs()),
                "{what}: {key} at step {step}: {p} vs {q}"
            );
        }
    }
}

/// Weights of two checkpoints within `tol`.
fn assert_same_weights(a: &Path, b: &Path, tol: f32) {
    assert_same_tensors(
        &a.join("model.safetensors"),
        &b.join("model.safetensors"),
        tol as f64,
    );
}

/// Every tensor of two safetensors files, by name, of one shape and within `tol` (in f64).
fn assert_same_tensors(a: &Path, b: &Path, tol: f64) {
    let load = |p: &Path| candle_core::safetensors::load(p, &candle_core::Device::Cpu).unwrap();
    let (ta, tb) = (load(a), load(b));
    assert_eq!(ta.len(), tb.len());
    let f64_ = |t: &candle_core::Tensor| t.to_dtype(candle_core::DType::F64).unwrap();
    for (name, x) in &ta {
        let y = &tb[name];
        assert_eq!(x.dims(), y.dims(), "{name}");
        let d = (f64_(x) - f64_(y))
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!(d <= tol, "{name}: max |diff| {d} > {tol}");
    }
}

#[test]
fn two_ranks_train_like_one_process_with_the_same_global_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    let two = tmp.path().join("two");
    ok(&gspo_train().args(args(&one, 8, &[])).output().unwrap());
    let (stdout, stderr) = ok(&gspo_train()
        .args(args(
            &two,
            8,
            &["--nproc-per-node", "2", "--master-port", &port()],
        ))
        .output()
        .unwrap());
    let all = format!("{stdout}{stderr}");
    for line in [
        "Distributed environment: MULTI_CPU",
        "Number of processes: 2",
        "Number of nodes: 1",
        "16 completions per micro-batch over all processes (8 per process)",
    ] {
        assert!(all.contains(line), "{line:?} missing:\n{all}");
    }
    assert_same_curve(&metrics(&one), &metrics(&two), "1 vs 2 ranks");
    assert_same_weights(&one.join("checkpoint-8"), &two.join("checkpoint-8"), 1e-5);
}

#[test]
fn two_nodes_on_one_machine_train_like_one_node_of_two() {
    let tmp = tempfile::tempdir().unwrap();
    let node = tmp.path().join("node");
    let nodes = tmp.path().join("nodes");
    ok(&gspo_train()
        .args(args(
            &node,
            4,
            &["--nproc-per-node", "2", "--master-port", &port()],
        ))
        .output()
        .unwrap());
    let p = port();
    let start = |rank: &str| -> Child {
        gspo_train()
            .args(args(
                &nodes,
                4,
                &[
                    "--nproc-per-node",
                    "1",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    rank,
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    &p,
                ],
            ))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (start("0"), start("1"));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let (_, err0) = ok(&a);
    ok(&b);
    assert!(err0.contains("Number of nodes: 2"), "{err0}");
    // The same arithmetic in the same order: identical, not merely close.
    assert_eq!(metrics(&node).len(), 4);
    for (x, y) in metrics(&node).iter().zip(metrics(&nodes)) {
        for key in ["reward", "loss", "grad_norm", "num_tokens"] {
            assert_eq!(x[key], y[key], "{key} at step {}", x["step"]);
        }
    }
    assert_same_weights(&node.join("checkpoint-4"), &nodes.join("checkpoint-4"), 0.0);
}

#[test]
fn a_run_resumes_on_another_number_of_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let straight = tmp.path().join("straight");
    let moved = tmp.path().join("moved");
    ok(&gspo_train().args(args(&straight, 8, &[])).output().unwrap());
    // Two ranks up to the checkpoint at step 4, then one process to step 8.
    ok(&gspo_train()
        .args(args(
            &moved,
            4,
            &["--nproc-per-node", "2", "--master-port", &port()],
        ))
        .output()
        .unwrap());
    let (_, stderr) = ok(&gspo_train()
        .args(args(&moved, 8, &["--resume"]))
        .output()
        .unwrap());
    assert!(stderr.contains("resuming from"), "{stderr}");
    assert_same_curve(&metrics(&straight), &metrics(&moved), "resumed on 1 rank");
    assert_same_weights(
        &straight.join("checkpoint-8"),
        &moved.join("checkpoint-8"),
        1e-5,
    );
}

/// Issue 28, item 5: ZeRO stage 1 (each rank keeps and updates the moments of its share of the
/// parameters, then gathers the others') trains exactly as unsharded data parallelism: the same
/// weights bit for bit on two ranks; on three, the curve of one process; a sharded checkpoint
/// (the moments gathered by rank 0) resumes on another number of ranks; one process is refused.
#[test]
fn zero_stage_1_gives_the_unsharded_weights_and_resumes_on_other_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = tmp.path().join("plain");
    let zero = tmp.path().join("zero");
    let two = |out: &Path, steps: u32, extra: &[&str]| {
        let mut e = vec!["--nproc-per-node", "2"];
        e.extend_from_slice(extra);
        let port = port();
        e.extend_from_slice(&["--master-port", &port]);
        ok(&gspo_train().args(args(out, steps, &e)).output().unwrap());
    };
    two(&plain, 8, &[]);
    two(&zero, 8, &["--set", "zero_stage=1"]);
    assert_same_weights(&plain.join("checkpoint-8"), &zero.join("checkpoint-8"), 0.0);
    // bf16 compute with f32 masters: each rank also keeps the f32 masters of its share only
    // (the others' parameters in bf16, refreshed from their owners): still the same bits, and
    // the checkpoint holds every f32 master.
    let (plain16, zero16) = (tmp.path().join("plain16"), tmp.path().join("zero16"));
    two(&plain16, 4, &["--dtype", "bf16"]);
    two(&zero16, 4, &["--dtype", "bf16", "--set", "zero_stage=1"]);
    assert_same_weights(
        &plain16.join("checkpoint-4"),
        &zero16.join("checkpoint-4"),
        0.0,
    );
    let masters = candle_core::safetensors::load(
        zero16.join("checkpoint-4/model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert!(masters
        .values()
        .all(|t| t.dtype() == candle_core::DType::F32));
    // The optimizer state is whole in the checkpoint, and the same as unsharded.
    let moments = |p: &Path| p.join("checkpoint-8/optimizer.safetensors");
    assert_same_tensors(&moments(&plain), &moments(&zero), 0.0);

    // Three ranks (a batch three can share), sharded, from a two-rank sharded checkpoint at
    // step 4: the curve of one process.
    let batch = ["--set", "per_device_train_batch_size=24"];
    let one = tmp.path().join("one");
    ok(&gspo_train().args(args(&one, 8, &batch)).output().unwrap());
    let moved = tmp.path().join("moved");
    let mut e: Vec<&str> = batch.to_vec();
    let p = port();
    e.extend_from_slice(&[
        "--set",
        "zero_stage=1",
        "--nproc-per-node",
        "2",
        "--master-port",
        &p,
    ]);
    ok(&gspo_train().args(args(&moved, 4, &e)).output().unwrap());
    let mut e: Vec<&str> = batch.to_vec();
    let p = port();
    e.extend_from_slice(&[
        "--set",
        "zero_stage=1",
        "--nproc-per-node",
        "3",
        "--master-port",
        &p,
        "--resume",
    ]);
    let (_, stderr) = ok(&gspo_train().args(args(&moved, 8, &e)).output().unwrap());
    assert!(stderr.contains("resuming from"), "{stderr}");
    assert_same_curve(&metrics(&one), &metrics(&moved), "zero 2 -> 3 ranks");
    assert_same_weights(&one.join("checkpoint-8"), &moved.join("checkpoint-8"), 1e-5);

    // One process has nothing to shard.
    let out = gspo_train()
        .args(args(
            &tmp.path().join("solo"),
            1,
            &["--set", "zero_stage=1"],
        ))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("zero_stage = 1") && err.contains("--nproc-per-node"),
        "{err}"
    );
}

/// A rank started by hand, torchrun-style.
fn rank(rank: usize, world: usize, port: &str, out: &Path, extra: &[&str]) -> Command {
    let mut c = gspo_train();
    c.args(args(out, 100_000, extra))
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

#[test]
fn a_rank_that_dies_stops_the_others_with_its_name() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let p = port();
    let extra = ["--dist-timeout", "5", "--set", "save_steps=100000"];
    let mut r0 = rank(0, 2, &p, &out, &extra).spawn().unwrap();
    let mut r1 = rank(1, 2, &p, &out, &extra).spawn().unwrap();
    // Kill rank 1 once training is under way.
    let started = Instant::now();
    while !out.join("metrics.jsonl").exists()
        || std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .is_empty()
    {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "training never started"
        );
        if let Some(status) = r0.try_wait().unwrap() {
            let out = r0.wait_with_output().unwrap();
            panic!(
                "rank 0 ended before the kill ({status}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    r1.kill().unwrap();
    r1.wait().unwrap();
    let killed = Instant::now();
    let out0 = loop {
        if let Some(_status) = r0.try_wait().unwrap() {
            break r0.wait_with_output().unwrap();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "rank 0 still runs 30 s after rank 1 died"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let stderr = String::from_utf8_lossy(&out0.stderr);
    assert!(!out0.status.success());
    assert!(stderr.contains("rank 1"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_rank_with_another_config_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let p = port();
    let r0 = rank(0, 2, &p, &out, &["--dist-timeout", "20"])
        .spawn()
        .unwrap();
    let r1 = rank(
        1,
        2,
        &p,
        &out,
        &["--dist-timeout", "20", "--learning-rate", "0.5"],
    )
    .spawn()
    .unwrap();
    let (o0, o1) = (
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
    );
    for o in [&o0, &o1] {
        assert!(!o.status.success());
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(stderr.contains("rank 1"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    // Nothing was trained.
    assert!(!out.join("checkpoint-4").exists());
}

#[test]
fn a_batch_the_ranks_cannot_share_is_refused_with_the_ways_out() {
    let tmp = tempfile::tempdir().unwrap();
    let out = gspo_train()
        .args(args(
            &tmp.path().join("run"),
            4,
            &["--nproc-per-node", "3", "--master-port", &port()],
        ))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot be shared by 3"), "{stderr}");
    assert!(stderr.contains("--scale-lr linear"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn the_all_reduce_bench_reports_nccl_tests_columns_with_right_sums() {
    let dir = tempfile::tempdir().unwrap();
    let out = gspo_train()
        .args([
            "--nproc-per-node",
            "2",
            "--master-port",
            &port(),
            "--bench-all-reduce",
            "64KiB",
            "--output-dir",
            dir.path().to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let (stdout, _) = ok(&out);
    assert!(stdout.contains("busbw(GB/s)"), "{stdout}");
    assert!(stdout.contains("backend tcp"), "{stdout}");
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("all_reduce_perf.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(json["world_size"], 2);
    let rows = json["rows"].as_array().unwrap();
    // 4, 16 and 64 KiB, in f32 and bf16.
    assert_eq!(rows.len(), 6, "{json}");
    for r in rows {
        assert_eq!(r["correct"], true, "{r}");
        // Two ranks: nccl-tests' bus bandwidth equals the algorithm bandwidth.
        let (alg, bus) = (f(r, "algbw"), f(r, "busbw"));
        assert!(alg > 0.0 && (alg - bus).abs() <= 1e-9 * alg, "{r}");
    }
    assert_eq!(rows[0]["bytes"], 4096);
    assert_eq!(rows[3]["dtype"], "bfloat16");

    // One process alone has no ranks to time.
    let alone = gspo_train()
        .args(["--bench-all-reduce", "64KiB"])
        .output()
        .unwrap();
    assert!(!alone.status.success());
    let err = String::from_utf8_lossy(&alone.stderr);
    assert!(err.contains("--nproc-per-node"), "{err}");
}

/// `--plan --nproc-per-node 2` plans one rank of two without starting any: under ZeRO stage 1
/// the rank's moments halve and, with bf16 compute, its f32 masters too (the other half held
/// in bf16); gradients stay whole.
#[test]
fn the_plan_shows_zero_stage_1_saving_per_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let policy_row = |zero: &str| -> Vec<u64> {
        let out = gspo_train()
            .args([
                "--plan",
                "--dtype",
                "bf16",
                "--nproc-per-node",
                "2",
                "--output-dir",
            ])
            .arg(tmp.path().join(zero))
            .args(["--set", &format!("zero_stage={zero}")])
            .output()
            .unwrap();
        let (stdout, _) = ok(&out);
        assert_eq!(
            stdout.contains("zero_stage = 1: this process of 2 keeps about 1/2 of the AdamW moments and of the f32 masters"),
            zero == "1",
            "{stdout}"
        );
        let row = stdout
            .lines()
            .find(|l| l.trim_start().starts_with("policy ") && l.contains(" B "))
            .unwrap_or_else(|| panic!("no policy row in\n{stdout}"));
        // weights, gradients, optimizer: the first three byte counts.
        let words: Vec<&str> = row.split_whitespace().collect();
        words
            .windows(2)
            .filter(|w| w[1] == "B")
            .map(|w| w[0].parse().unwrap())
            .take(3)
            .collect()
    };
    let (plain, zero) = (policy_row("0"), policy_row("1"));
    let (weights, grads, moments) = (plain[0], plain[1], plain[2]);
    // 4 bytes of f32 master per parameter, 2 of bf16 for the other rank's half.
    let params = weights / 4;
    assert_eq!(
        zero[0],
        params.div_ceil(2) * 4 + (params - params.div_ceil(2)) * 2
    );
    assert_eq!(zero[1], grads);
    assert_eq!(zero[2], moments.div_ceil(2));
}
