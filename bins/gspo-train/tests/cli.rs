//! gspo-train end to end on the CPU: the embedded default, checkpoints loadable by fleet, an
//! exact resume after a kill, refused resumes, bad datasets, the plan.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn gspo_train() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gspo-train"))
}

fn run(args: &[&str]) -> Output {
    gspo_train().args(args).output().expect("gspo-train runs")
}

fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn fails(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "expected a failure; stdout:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The directory holding the Python `package` a test needs (installed by
/// `scripts/fixtures/fetch_<package>.sh` into `target/<package>-py`, or where `env` points):
/// `None`, with SKIPPED on stderr, when it is not there — a failure instead when `env` is set
/// (as CI sets it).
fn python_package(env: &str, package: &str) -> Option<PathBuf> {
    let dir = match std::env::var(env) {
        Ok(p) => PathBuf::from(p),
        Err(_) => repo().join(format!("target/{package}-py")),
    };
    if dir.join(package).is_dir() {
        return Some(dir);
    }
    assert!(
        std::env::var(env).is_err(),
        "{env}={} holds no {package} package: run scripts/fixtures/fetch_{package}.sh",
        dir.display()
    );
    eprintln!("SKIPPED: no {package} package (scripts/fixtures/fetch_{package}.sh)");
    None
}

/// Runs `script` with python3 on `args`, the packages in `python_path`, and parses the last
/// line it prints as JSON (the library's own output may precede it).
fn python_json(python_path: &Path, script: &str, args: &[&Path]) -> serde_json::Value {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .env("PYTHONPATH", python_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap()
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn the_embedded_default_trains_and_writes_checkpoints_metrics_and_plots() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let stdout = ok(&run(&[
        "--output-dir",
        out.to_str().unwrap(),
        "--max-steps",
        "8",
        "--set",
        "save_steps=4",
    ]));
    assert!(stdout.contains("8 steps in"), "{stdout}");
    let m = metrics(&out);
    assert_eq!(m.len(), 8);
    for key in [
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "entropy",
        "completions/mean_length",
        "completions/clipped_ratio",
        "grad_norm",
        "learning_rate",
        "num_tokens",
        "rewards/gsm8k_exact/mean",
        "generation_seconds",
        "peak_memory_bytes",
    ] {
        assert!(m[7].get(key).is_some(), "{key} missing: {}", m[7]);
    }
    for name in [
        "reward.png",
        "reward.svg",
        "loss.png",
        "loss.svg",
        "manifest.json",
    ] {
        assert!(out.join(name).exists(), "{name}");
    }
    // Checkpoints in HF layout, the newest two kept, `latest` pointing at the last.
    let latest = std::fs::read_to_string(out.join("latest")).unwrap();
    assert_eq!(latest.trim(), "checkpoint-8");
    let ckpt = out.join("checkpoint-8");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        assert!(ckpt.join(f).exists(), "{f}");
    }
    // fleet loads the trained checkpoint and generates from it.
    let model = fleet_models::TextModel::load(ckpt.to_str().unwrap(), &Default::default()).unwrap();
    let ids = model.tokenizer().unwrap().encode("3+4=").unwrap();
    let out_text = model
        .generate(&[fleet_models::GenerationRequest::greedy(ids, 3)], None)
        .unwrap();
    assert!(out_text[0].token_ids.len() <= 3);
}

/// Issue 10, item 6: a run killed after a checkpoint and resumed ends with the same weights,
/// optimizer state and metrics as a run that was never interrupted.
#[test]
fn a_killed_run_resumes_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = tmp.path().join("whole");
    let common = [
        "--max-steps",
        "12",
        "--set",
        "save_steps=4",
        "--set",
        "save_total_limit=5",
    ];
    let mut args = vec!["--output-dir", whole.to_str().unwrap()];
    args.extend(common);
    ok(&run(&args));

    let killed = tmp.path().join("killed");
    let mut args = vec!["--output-dir", killed.to_str().unwrap()];
    args.extend(common);
    let mut child = gspo_train()
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill it as soon as its first checkpoint is complete.
    let started = Instant::now();
    while !killed.join("latest").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "no checkpoint appeared"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let finished_before_kill = killed.join("checkpoint-12").exists();
    // Started again without --resume: refused, nothing touched.
    let err = fails(&run(&args));
    assert!(
        err.contains("--resume") && err.contains("--overwrite"),
        "{err}"
    );
    args.push("--resume");
    ok(&run(&args));
    assert!(
        !finished_before_kill,
        "the run finished before it could be killed"
    );
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let a = std::fs::read(whole.join("checkpoint-12").join(file)).unwrap();
        let b = std::fs::read(killed.join("checkpoint-12").join(file)).unwrap();
        assert!(a == b, "{file} differs after the resume");
    }
    let strip = |v: Vec<serde_json::Value>| -> Vec<serde_json::Value> {
        v.into_iter()
            .map(|mut r| {
                // Timings and memory differ between runs; the training does not.
                let o = r.as_object_mut().unwrap();
                for k in fleet_gspo::StepMetrics::CLOCK_FIELDS {
                    o.remove(k);
                }
                r
            })
            .collect()
    };
    assert_eq!(strip(metrics(&whole)), strip(metrics(&killed)));
}

/// Issue 10, bad input: a checkpoint of another model, a resume with a changed config.
#[test]
fn a_resume_of_another_model_or_config_is_refused_and_the_checkpoint_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let base = ["--output-dir", out.to_str().unwrap(), "--max-steps", "4"];
    ok(&run(&base));
    let ckpt = std::fs::read(out.join("checkpoint-4/model.safetensors")).unwrap();

    let mut other_lr = base.to_vec();
    other_lr.extend(["--resume", "--learning-rate", "0.1"]);
    let err = fails(&run(&other_lr));
    assert!(err.contains("config.learning_rate"), "{err}");

    let model = repo().join("tests/fixtures/qwen2-tiny");
    let data = tmp.path().join("data.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"1+1=\", \"answer\": \"#### 2\"}\n".repeat(8),
    )
    .unwrap();
    let mut other_model = base.to_vec();
    other_model.extend([
        "--resume",
        "--model",
        model.to_str().unwrap(),
        "--dataset",
        data.to_str().unwrap(),
    ]);
    let err = fails(&run(&other_model));
    assert!(err.contains("base_model.weights_digest"), "{err}");
    assert_eq!(
        std::fs::read(out.join("checkpoint-4/model.safetensors")).unwrap(),
        ckpt
    );

    // Training longer is allowed.
    let mut longer = base.to_vec();
    longer[3] = "8";
    longer.push("--resume");
    ok(&run(&longer));
    assert!(out.join("checkpoint-8").exists());
}

#[test]
fn bad_dataset_lines_are_skipped_and_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.jsonl");
    let mut text = String::new();
    for a in 0..10 {
        text.push_str(&format!(
            "{{\"prompt\": \"{a}+1=\", \"answer\": \"#### {}\"}}\n",
            a + 1
        ));
    }
    text.push_str("{\"prompt\": \"no answer\"}\nnot json\n");
    std::fs::write(&data, text).unwrap();
    let out = tmp.path().join("run");
    // The bundled model, with another dataset: the model must be named too.
    let err = fails(&run(&["--dataset", data.to_str().unwrap()]));
    assert!(err.contains("--model"), "{err}");
    let bundled = gspo_default_model();
    let res = run(&[
        "--model",
        bundled.to_str().unwrap(),
        "--dataset",
        data.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--max-steps",
        "4",
    ]);
    ok(&res);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(
        stderr.contains("10 prompts loaded") && stderr.contains("2 skipped"),
        "{stderr}"
    );
}

#[test]
fn flags_with_trl_names_and_the_seeds_aliases_override_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let err = fails(&run(&[
        "--output-dir",
        out.to_str().unwrap(),
        "--set",
        "GROUP_SIZE=3",
    ]));
    // 16 completions per micro-batch x 4 micro-batches is no multiple of 3.
    assert!(err.contains("num_generations"), "{err}");
    let err = fails(&run(&["--set", "no_such_field=1"]));
    assert!(err.contains("no_such_field"), "{err}");
    let err = fails(&run(&["--num-generations", "many"]));
    assert!(err.contains("num_generations"), "{err}");
    ok(&run(&[
        "--output-dir",
        out.to_str().unwrap(),
        "--set",
        "BATCH_SIZE=8",
        "--set",
        "GSPO_EPOCHS=2",
        "--max-steps",
        "2",
    ]));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    let cfg = &manifest["determines"]["config"];
    assert_eq!(cfg["per_device_train_batch_size"], 8);
    assert_eq!(cfg["num_iterations"], 2);
}

/// `save_strategy = "no"` (HF's name) trains and logs without writing any checkpoint, and a
/// best model to load at the end then has nothing to come from.
#[test]
fn save_strategy_no_writes_no_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let o = out.to_str().unwrap();
    let args = [
        "--output-dir",
        o,
        "--max-steps",
        "2",
        "--set",
        "save_steps=1",
    ];
    let stdout = ok(&run(&[&args[..], &["--set", "save_strategy=no"]].concat()));
    assert_eq!(metrics(&out).len(), 2);
    let checkpoints: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("checkpoint-"))
        .collect();
    assert!(checkpoints.is_empty(), "{checkpoints:?}");
    assert!(!stdout.contains("checkpoint "), "{stdout}");
    let err = fails(&run(&[
        &args[..],
        &[
            "--set",
            "save_strategy=no",
            "--set",
            "load_best_model_at_end=true",
        ],
    ]
    .concat()));
    assert!(err.contains("save_strategy"), "{err}");
    let err = fails(&run(
        &[&args[..], &["--set", "save_strategy=epoch"]].concat()
    ));
    assert!(
        err.contains("save_strategy") && err.contains("steps"),
        "{err}"
    );
}

#[test]
fn plan_says_what_fits_where_without_loading() {
    let out = ok(&run(&["--plan"]));
    assert!(out.contains("cpu"), "{out}");
    assert!(out.to_lowercase().contains("weights"), "{out}");
}

/// `--plan --topology`: a plan for GPUs this machine does not have, from a checkpoint directory
/// without weights (config.json and the tokenizer are enough); `--topology` alone is refused.
#[test]
fn plan_for_a_topology_file_needs_no_weights_and_no_gpus() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("qwen2.5-1.5b");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        repo().join("configs/models/qwen2.5-1.5b.json"),
        model.join("config.json"),
    )
    .unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(
            repo().join("tests/fixtures/qwen2-tiny").join(f),
            model.join(f),
        )
        .unwrap();
    }
    let dataset = repo().join("assets/gspo-default/train.jsonl");
    let topology = repo().join("configs/topologies/h200-2x.toml");
    let args = [
        "--model",
        model.to_str().unwrap(),
        "--dataset",
        dataset.to_str().unwrap(),
        "--gpu-mode",
        "2gpu",
        "--topology",
        topology.to_str().unwrap(),
    ];
    let mut with_plan = args.to_vec();
    with_plan.push("--plan");
    let out = ok(&run(&with_plan));
    assert!(out.contains("cuda:0") && out.contains("cuda:1"), "{out}");
    assert!(out.contains("sized from config.json"), "{out}");
    // The compute dtype a GPU run would use: bf16.
    assert!(out.contains("bf16 compute"), "{out}");
    let err = fails(&run(&args));
    assert!(err.contains("--plan"), "{err}");
}

/// `--auto-find-batch-size`: a budget the configured micro-batch (16) does not fit makes it 8,
/// with steps_per_generation and gradient_accumulation_steps doubled; the run then equals one
/// configured that way (no row is without loss tokens here, so the normalisations agree), and
/// has the configured batch's rollouts, loss and gradient norm. One micro-batch per generation
/// batch, so that the training phase, not the rollouts' KV cache, makes the peak (the
/// micro-batch can only lower that one).
#[test]
fn auto_find_batch_size_fits_the_micro_batch_and_keeps_the_batches() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |name: &str| tmp.path().join(name).display().to_string();
    let common = [
        "--max-steps",
        "4",
        "--set",
        "save_steps=1000",
        "--set",
        "steps_per_generation=1",
    ];
    let run_with = |out: &str, extra: &[&str]| -> Output {
        let mut args = vec!["--output-dir", out];
        args.extend_from_slice(&common);
        args.extend_from_slice(extra);
        run(&args)
    };
    let (auto, explicit, configured) = (dir("auto"), dir("explicit"), dir("configured"));
    // Between the plans of micro-batch 8 (2.32 MiB) and 16 (2.7 MiB).
    let budget = "cpu=2.5MiB";
    let out = run_with(&auto, &["--max-memory", budget, "--auto-find-batch-size"]);
    ok(&out);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.contains("per_device_train_batch_size 16 -> 8")
            && log.contains("steps_per_generation 1 -> 2")
            && log.contains("gradient_accumulation_steps 1 -> 2"),
        "{log}"
    );
    ok(&run_with(
        &explicit,
        &[
            "--set",
            "per_device_train_batch_size=8",
            "--set",
            "steps_per_generation=2",
            "--set",
            "gradient_accumulation_steps=2",
        ],
    ));
    ok(&run_with(&configured, &[]));
    let timing = |k: &str| {
        k.contains("seconds")
            || k.contains("time")
            || k.contains("per_second")
            || k == "peak_memory_bytes"
    };
    let strip = |m: Vec<serde_json::Value>| -> Vec<serde_json::Value> {
        m.into_iter()
            .map(|mut v| {
                v.as_object_mut().unwrap().retain(|k, _| !timing(k));
                v
            })
            .collect()
    };
    let a = strip(metrics(Path::new(&auto)));
    assert_eq!(a.len(), 4);
    assert_eq!(a, strip(metrics(Path::new(&explicit))));
    // The same rollouts as the configured micro-batch: rewards and lengths per step.
    let c = strip(metrics(Path::new(&configured)));
    for (x, y) in a.iter().zip(&c) {
        for key in [
            "reward",
            "reward_std",
            "completions/mean_length",
            "num_tokens",
        ] {
            assert_eq!(x[key], y[key], "{key}");
        }
        // The loss and the gradient are the configured micro-batch's, summed in two halves.
        for key in ["loss", "grad_norm"] {
            let (p, q) = (x[key].as_f64().unwrap(), y[key].as_f64().unwrap());
            assert!(
                (p - q).abs() <= 1e-4 * q.abs().max(1e-3),
                "{key}: {p} vs {q}"
            );
        }
    }
    // Without the flag the same budget is an error naming the way out.
    let err = fails(&run_with(&dir("refused"), &["--max-memory", budget]));
    assert!(err.contains("does not fit"), "{err}");
}

/// The bundled model's directory (as the embedded default writes it).
fn gspo_default_model() -> PathBuf {
    repo().join("assets/gspo-default")
}

/// Issue 10, item 4: a reward model (sequence-classification head) as a reward function next
/// to a rule-based one, weighted.
#[test]
fn a_reward_model_scores_completions_beside_a_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("rm.toml");
    let reward_model = repo().join("tests/fixtures/qwen2-tiny-reward");
    let shipped = std::fs::read_to_string(repo().join("configs/gspo/default.toml")).unwrap();
    let head = shipped.split("[[reward_funcs]]").next().unwrap();
    std::fs::write(
        &config,
        format!(
            "{head}[[reward_funcs]]\nname = \"gsm8k_exact\"\nweight = 1.0\n\n[[reward_funcs]]\nname = \"reward_model\"\nweight = 0.5\nmodel = \"{}\"\n",
            reward_model.display()
        ),
    )
    .unwrap();
    let out = tmp.path().join("run");
    ok(&run(&[
        "--config",
        config.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--max-steps",
        "2",
    ]));
    let m = metrics(&out);
    let rm = m[0]["rewards/reward_model/mean"].as_f64().unwrap();
    assert!(rm.is_finite() && rm != 0.0, "{}", m[0]);
    assert!(m[0]["rewards/gsm8k_exact/mean"].is_number());
    // A causal LM named as a reward model is refused before training.
    std::fs::write(
        &config,
        std::fs::read_to_string(&config)
            .unwrap()
            .replace("qwen2-tiny-reward", "qwen2-tiny"),
    )
    .unwrap();
    let err = fails(&run(&[
        "--config",
        config.to_str().unwrap(),
        "--output-dir",
        tmp.path().join("run2").to_str().unwrap(),
    ]));
    assert!(err.contains("not a reward model"), "{err}");
}

/// Issue 28, item 1: the user's own TRL-style Python function, unchanged, as a command
/// beside a built-in rule: its scores reach the metrics under its own name with its failures
/// counted; a function that fails on every completion stops training with its message.
#[test]
fn a_users_python_reward_function_trains_beside_a_rule() {
    let tmp = tempfile::tempdir().unwrap();
    // The user's file: TRL's signature, nothing of fleet's.
    let user = tmp.path().join("my_rewards.py");
    std::fs::write(
        &user,
        "def prefers_seven(completions, answer, **kwargs):\n    \
         return [1.0 if c.strip() == '7' else 0.0 for c in completions]\n\n\
         def broken(completions, **kwargs):\n    raise ValueError('no reference column')\n",
    )
    .unwrap();
    let server = repo().join("examples/rewards/fleet_reward.py");
    let shipped = std::fs::read_to_string(repo().join("configs/gspo/default.toml")).unwrap();
    let head = shipped.split("[[reward_funcs]]").next().unwrap();
    let config = |function: &str| {
        format!(
            "{head}[[reward_funcs]]\nname = \"gsm8k_exact\"\n\n[[reward_funcs]]\nname = \"command\"\n\
             weight = 0.5\ncommand = [\"python3\", \"{}\", \"{}:{function}\"]\n",
            server.display(),
            user.display()
        )
    };
    let path = tmp.path().join("user.toml");
    std::fs::write(&path, config("prefers_seven")).unwrap();
    let out = tmp.path().join("run");
    ok(&run(&[
        "--config",
        path.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--max-steps",
        "2",
    ]));
    let m = metrics(&out);
    assert!(m[0]["rewards/prefers_seven/mean"].is_number(), "{}", m[0]);
    assert_eq!(m[0]["rewards/prefers_seven/failed"], 0.0);
    assert_eq!(m[0]["failed_rewards"], 0);

    std::fs::write(&path, config("broken")).unwrap();
    let err = fails(&run(&[
        "--config",
        path.to_str().unwrap(),
        "--output-dir",
        tmp.path().join("run2").to_str().unwrap(),
        "--max-steps",
        "2",
    ]));
    assert!(err.contains("none of its"), "{err}");
    assert!(err.contains("ValueError: no reference column"), "{err}");
}

/// Issue 28, item 2: evaluation during training on prompts held out of the training file,
/// k samples per prompt, TRL's eval_* keys in metrics.jsonl, and the best checkpoint kept
/// (never pruned by save_total_limit) and exported at the end.
#[test]
fn evaluation_logs_eval_metrics_and_keeps_the_best_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let stdout = ok(&run(&[
        "--output-dir",
        out.to_str().unwrap(),
        "--max-steps",
        "12",
        "--set",
        "save_steps=4",
        "--set",
        "save_total_limit=1",
        "--set",
        "eval_strategy=steps",
        "--set",
        "eval_steps=4",
        "--set",
        "eval_holdout=0.1",
        "--set",
        "num_generations_eval=2",
        "--set",
        "per_device_eval_batch_size=16",
        "--set",
        "load_best_model_at_end=true",
    ]));
    let m = metrics(&out);
    let evals: Vec<&serde_json::Value> = m
        .iter()
        .filter(|l| l.get("eval_runtime").is_some())
        .collect();
    assert_eq!(
        evals
            .iter()
            .map(|e| e["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![4, 8, 12]
    );
    for e in &evals {
        for key in [
            "eval_reward",
            "eval_pass@1",
            "eval_pass@2",
            "eval_rewards/gsm8k_exact/mean",
        ] {
            assert!(e[key].is_number(), "{key} in {e}");
        }
        assert!(e["eval_prompts"].as_f64().unwrap() >= 1.0, "{e}");
    }
    assert_eq!(m.len(), 12 + 3, "12 step lines and 3 evaluations");
    // The best checkpoint is the one at the best eval_reward (the first on ties).
    let rewards: Vec<f64> = evals
        .iter()
        .map(|e| e["eval_reward"].as_f64().unwrap())
        .collect();
    let best = rewards
        .iter()
        .enumerate()
        .fold(0, |b, (i, r)| if *r > rewards[b] { i } else { b });
    let best_name = format!("checkpoint-{}", 4 * (best + 1));
    let pointer = std::fs::read_to_string(out.join("best")).unwrap();
    assert_eq!(pointer.trim(), best_name);
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoint-12/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["best_model_checkpoint"], best_name.as_str());
    assert_eq!(state["best_metric"].as_f64(), Some(rewards[best]));
    // save_total_limit = 1 keeps the newest and the best.
    assert!(out.join(&best_name).is_dir() && out.join("checkpoint-12").is_dir());
    // The best model's files in output_dir, as transformers' save_model writes them.
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        std::fs::read(out.join(&best_name).join("model.safetensors")).unwrap()
    );
    assert!(
        stdout.contains(&format!(
            "best checkpoint {}",
            out.join(&best_name).display()
        )),
        "{stdout}"
    );

    // Evaluation without prompts, and a best model that might not be saved, are refused.
    let err = fails(&run(&["--set", "eval_strategy=steps", "--max-steps", "1"]));
    assert!(err.contains("eval_holdout"), "{err}");
    let err = fails(&run(&[
        "--set",
        "eval_strategy=steps",
        "--set",
        "eval_holdout=0.1",
        "--set",
        "eval_steps=3",
        "--set",
        "save_steps=4",
        "--set",
        "load_best_model_at_end=true",
    ]));
    assert!(err.contains("a multiple of eval_steps"), "{err}");
}

/// Issue 28, item 3: log_completions writes each generation batch's first rows (prompt,
/// completion, each reward, the advantage) once, at its first logged step, to
/// completions.jsonl, and the latest as a Markdown table.
#[test]
fn log_completions_writes_a_table_of_each_logged_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    ok(&run(&[
        "--output-dir",
        out.to_str().unwrap(),
        "--max-steps",
        "8",
        "--set",
        "log_completions=true",
        "--set",
        "num_completions_to_print=3",
    ]));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(out.join("completions.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Two generation batches of 4 steps, 3 rows each, logged at steps 1 and 5.
    assert_eq!(lines.len(), 6);
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![1, 1, 1, 5, 5, 5]);
    for l in &lines {
        assert!(l["prompt"].as_str().unwrap().contains('+'), "{l}");
        assert!(l["rewards"]["gsm8k_exact"].is_number(), "{l}");
        assert!(l["advantage"].is_number() && l["reward"].is_number(), "{l}");
    }
    let table = std::fs::read_to_string(out.join("completions.md")).unwrap();
    assert!(
        table.starts_with("# Completions at step 5 (generation batch 2)"),
        "{table}"
    );
    assert!(
        table.contains("| id | prompt | completion | gsm8k_exact | reward | advantage |"),
        "{table}"
    );
    assert_eq!(
        table.lines().filter(|l| l.starts_with("| ")).count(),
        1 + 3,
        "{table}"
    );
}

/// Issue 28, item 3: report_to = "tensorboard" writes event files that TensorBoard's own
/// reader (the tensorboard package's EventAccumulator) loads, with every step's and every
/// evaluation's scalars under transformers' tags. Needs the package
/// (scripts/fixtures/fetch_tensorboard.sh; FLEET_TENSORBOARD_PY, set by CI, makes a missing
/// one a failure instead of a skip).
#[test]
fn tensorboard_reads_the_event_files() {
    let Some(python_path) = python_package("FLEET_TENSORBOARD_PY", "tensorboard") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    ok(&run(&[
        "--output-dir",
        out.to_str().unwrap(),
        "--max-steps",
        "8",
        "--set",
        "report_to=tensorboard",
        "--set",
        "eval_strategy=steps",
        "--set",
        "eval_steps=4",
        "--set",
        "eval_holdout=0.1",
    ]));
    let m = metrics(&out);
    let losses: Vec<f64> = m
        .iter()
        .filter(|l| l.get("loss").is_some())
        .map(|l| l["loss"].as_f64().unwrap())
        .collect();
    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1])
acc.Reload()
tags = acc.Tags()["scalars"]
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags}))
"#;
    let scalars = python_json(&python_path, script, &[&out.join("runs")]);
    let loss = scalars["train/loss"].as_array().unwrap();
    assert_eq!(loss.len(), 8);
    for (i, point) in loss.iter().enumerate() {
        assert_eq!(point[0].as_u64(), Some(i as u64 + 1));
        let v = point[1].as_f64().unwrap();
        assert!(
            (v - losses[i]).abs() <= 1e-6 * losses[i].abs().max(1.0),
            "{v} vs {}",
            losses[i]
        );
    }
    let eval = scalars["eval/reward"].as_array().unwrap();
    assert_eq!(
        eval.iter()
            .map(|p| p[0].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![4, 8]
    );
    assert!(scalars["train/rewards/gsm8k_exact/mean"].is_array());
    assert!(scalars["eval/pass@1"].is_array());
}

/// Issue 28, item 4: LoRA through gspo-train: the adapters train (PEFT's files in each
/// checkpoint, the base untouched), with TRL's dropout on the adapters' input a killed run
/// resumes to the same adapters (the masks are keyed by step and micro-batch), the merged model
/// is written in Hugging Face layout and fleet loads it, and a target naming no module is
/// refused before training with the model's module names.
#[test]
fn lora_trains_adapters_resumes_and_exports_the_merged_model() {
    let tmp = tempfile::tempdir().unwrap();
    let lora = [
        "--set",
        "use_peft=true",
        "--set",
        "lora_r=4",
        "--set",
        "lora_alpha=8",
        "--set",
        "lora_target_modules=q_proj,v_proj,down_proj",
        "--set",
        "lora_dropout=0.1",
        "--set",
        "save_steps=4",
        "--set",
        "learning_rate=1e-2",
    ];
    let run_to = |out: &Path, steps: &str, extra: &[&str]| {
        let mut a = vec!["--output-dir", out.to_str().unwrap(), "--max-steps", steps];
        a.extend_from_slice(&lora);
        a.extend_from_slice(extra);
        ok(&run(&a))
    };
    let straight = tmp.path().join("straight");
    let stdout = run_to(&straight, "8", &[]);
    assert!(
        stdout.contains("PEFT: PeftModel.from_pretrained"),
        "{stdout}"
    );
    let ckpt = straight.join("checkpoint-8");
    assert!(ckpt.join("adapter_config.json").is_file());
    assert!(
        !ckpt.join("model.safetensors").exists(),
        "the base is not saved"
    );
    let adapters = candle_core::safetensors::load(
        ckpt.join("adapter_model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert!(adapters
        .keys()
        .all(|k| k.starts_with("base_model.model.") && k.contains(".lora_")));
    // The B matrices moved away from zero: the adapters trained.
    let moved = adapters
        .iter()
        .filter(|(k, _)| k.contains("lora_B"))
        .any(|(_, t)| {
            t.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0
        });
    assert!(moved, "no adapter trained");
    // A run stopped at step 4 and resumed gives the same adapters.
    let resumed = tmp.path().join("resumed");
    run_to(&resumed, "4", &[]);
    run_to(&resumed, "8", &["--resume"]);
    let again = candle_core::safetensors::load(
        resumed.join("checkpoint-8/adapter_model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    for (k, t) in &adapters {
        let d = (t - &again[k]).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{k} after resume");
    }
    // The merged model: Hugging Face layout, every base name, loadable by fleet.
    let merged = straight.join("merged");
    assert!(merged.join("config.json").is_file() && merged.join("model.safetensors").is_file());
    let dataset = gspo_default_model().join("train.jsonl");
    ok(&run(&[
        "--model",
        merged.to_str().unwrap(),
        "--dataset",
        dataset.to_str().unwrap(),
        "--output-dir",
        tmp.path().join("from-merged").to_str().unwrap(),
        "--max-steps",
        "1",
    ]));

    let err = fails(&run(&[
        "--set",
        "use_peft=true",
        "--set",
        "lora_target_modules=qkv",
        "--max-steps",
        "1",
    ]));
    assert!(err.contains("q_proj, k_proj"), "{err}");
    // A checkpoint that carries adapters is not a model to start from.
    let err = fails(&run(&[
        "--model",
        ckpt.to_str().unwrap(),
        "--dataset",
        dataset.to_str().unwrap(),
        "--max-steps",
        "1",
    ]));
    assert!(
        err.contains("holds LoRA adapters") && err.contains("merged"),
        "{err}"
    );
}

/// Issue 28, item 4: PEFT's own loader takes the adapters gspo-train trained:
/// `PeftModel.from_pretrained` on the base gives the logits of the merged export (loaded by
/// transformers) and not the base's. Needs torch, transformers and peft
/// (scripts/fixtures/fetch_peft.sh; FLEET_PEFT_PY, set by CI, makes a missing one a failure
/// instead of a skip).
#[test]
fn peft_loads_the_trained_adapters() {
    let Some(python_path) = python_package("FLEET_PEFT_PY", "peft") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    ok(&run(&[
        "--output-dir",
        out.to_str().unwrap(),
        "--max-steps",
        "4",
        "--set",
        "use_peft=true",
        "--set",
        "lora_r=4",
        "--set",
        "lora_alpha=8",
        "--set",
        "lora_target_modules=all-linear",
        "--set",
        "lora_dropout=0.1",
        "--set",
        "save_steps=4",
        "--set",
        "learning_rate=1e-2",
    ]));
    let script = r#"
import json, sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
base_dir, adapter_dir, merged_dir = sys.argv[1:4]
ids = torch.tensor([[1, 5, 9, 14, 3, 7, 11, 2], [4, 8, 15, 0, 13, 12, 6, 10]])
def logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits
base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
plain = logits(base)
adapted = logits(PeftModel.from_pretrained(base, adapter_dir))
merged = logits(AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32))
print(json.dumps({
    "scale": plain.abs().max().item(),
    "adapted_vs_merged": (adapted - merged).abs().max().item(),
    "adapted_vs_base": (adapted - plain).abs().max().item(),
}))
"#;
    let report = python_json(
        &python_path,
        script,
        &[
            &gspo_default_model(),
            &out.join("checkpoint-4"),
            &out.join("merged"),
        ],
    );
    let scale = report["scale"].as_f64().unwrap();
    let merged = report["adapted_vs_merged"].as_f64().unwrap();
    let moved = report["adapted_vs_base"].as_f64().unwrap();
    eprintln!("PEFT against the merged export: {report}");
    // The merge rounds W + s·B·A once in f32.
    assert!(merged <= 1e-5 * scale.max(1.0), "{report}");
    assert!(
        moved > 1e3 * merged.max(1e-7),
        "the adapters change nothing: {report}"
    );
}

/// Issue 10, item 9: end to end, the reward rises on the synthetic task. The bundled model
/// starts at chance (one answer in thirteen); a trainer whose gradients do not reach the model,
/// or whose advantages or loss are wrong, stays there.
#[test]
fn the_reward_rises_on_the_synthetic_task() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    ok(&run(&[
        "--output-dir",
        out.to_str().unwrap(),
        "--max-steps",
        "200",
    ]));
    let rewards: Vec<f64> = metrics(&out)
        .iter()
        .map(|r| r["reward"].as_f64().unwrap())
        .collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (first, last) = (mean(&rewards[..20]), mean(&rewards[160..]));
    assert!(first < 0.15, "the model should start near chance: {first}");
    assert!(
        last > 0.3 && last > first + 0.15,
        "the reward did not rise: {first:.3} over the first 20 steps, {last:.3} over the last 40"
    );
}

/// `--torch-dtype bfloat16`: weights, gradients and AdamW moments in bf16 (TRL's arithmetic with
/// a bf16 model); the checkpoint holds bf16 tensors, and a resume continues bit for bit.
#[test]
fn bf16_master_weights_train_save_bf16_and_resume_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let straight = tmp.path().join("straight");
    let resumed = tmp.path().join("resumed");
    let args = |out: &Path, steps: &str| -> Vec<String> {
        [
            "--output-dir",
            out.to_str().unwrap(),
            "--max-steps",
            steps,
            "--set",
            "save_steps=4",
            "--torch-dtype",
            "bfloat16",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let run_args = |a: Vec<String>| gspo_train().args(a).output().expect("gspo-train runs");
    ok(&run_args(args(&straight, "8")));
    ok(&run_args(args(&resumed, "4")));
    let mut more = args(&resumed, "8");
    more.push("--resume".into());
    ok(&run_args(more));
    let (a, b) = (metrics(&straight), metrics(&resumed));
    assert_eq!(a.len(), 8);
    for (x, y) in a.iter().zip(&b) {
        for key in ["reward", "loss", "grad_norm"] {
            assert_eq!(x[key], y[key], "{key} at step {}", x["step"]);
        }
        assert!(x["loss"].as_f64().is_some_and(f64::is_finite));
    }
    let ckpt = straight.join("checkpoint-8");
    let weights =
        candle_core::safetensors::load(ckpt.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    assert!(weights
        .values()
        .all(|t| t.dtype() == candle_core::DType::BF16));
    let opt = candle_core::safetensors::load(
        ckpt.join("optimizer.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert!(opt
        .iter()
        .filter(|(k, _)| k.starts_with("exp_avg"))
        .all(|(_, t)| t.dtype() == candle_core::DType::BF16));
    // The same run in f32 differs: the setting is part of the run, not a no-op.
    let f32_run = tmp.path().join("f32");
    ok(&gspo_train()
        .args([
            "--output-dir",
            f32_run.to_str().unwrap(),
            "--max-steps",
            "8",
            "--set",
            "save_steps=4",
        ])
        .output()
        .unwrap());
    let c = metrics(&f32_run);
    assert!(a.iter().zip(&c).any(|(x, y)| x["loss"] != y["loss"]));
    // A resume with the other dtype is refused (the manifest records it).
    let out = gspo_train()
        .args([
            "--output-dir",
            straight.to_str().unwrap(),
            "--max-steps",
            "12",
            "--set",
            "save_steps=4",
            "--resume",
        ])
        .output()
        .unwrap();
    let stderr = fails(&out);
    assert!(stderr.contains("torch_dtype"), "{stderr}");
}

/// Issue 24: `--logical-gpus` is gspo-train's too; on a machine without a GPU it is refused
/// before anything loads, naming the flag and the fix. With a topology file of logical devices
/// the plan says it is on logical devices.
#[test]
fn logical_gpus_are_refused_without_a_gpu_and_labelled_in_plans() {
    if fleet_topology::discover()
        .map(|d| d.iter().any(|d| d.location.cuda_ordinal().is_some()))
        .unwrap_or(false)
    {
        return;
    }
    let err = fails(&run(&["--logical-gpus", "2:12GiB", "--max-steps", "1"]));
    assert!(
        err.contains("--logical-gpus 2:12GiB") && err.contains("sees none"),
        "{err}"
    );
    let topology = repo().join("configs/topologies/rtx3060-8x-on-h200.toml");
    let out = ok(&run(&[
        "--plan",
        "--topology",
        topology.to_str().unwrap(),
        "--gpu-mode",
        "2gpu",
    ]));
    assert!(out.contains("logical devices on one GPU"), "{out}");
}
