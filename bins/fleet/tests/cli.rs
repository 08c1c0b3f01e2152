//! The `fleet` binary end to end on the tiny fixtures.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fleet() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fleet"))
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Runs `cmd` with `--json <a temporary file>`, asserts that it succeeded and returns the JSON
/// it wrote.
fn json_written_by(mut cmd: Command) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let out = cmd.arg("--json").arg(&json).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

#[test]
fn devices_lists_something() {
    let out = fleet().args(["devices", "--json"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!v.as_array().unwrap().is_empty());
    let table = fleet().arg("devices").output().unwrap();
    assert!(String::from_utf8_lossy(&table.stdout).contains("device"));
}

#[test]
fn logits_json_matches_the_golden() {
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("golden/qwen3-tiny.json")).unwrap())
            .unwrap();
    let case = &golden["logits"][0];
    let ids: Vec<String> = case["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect();
    let out = fleet()
        .args(["logits", "--model"])
        .arg(fixture("qwen3-tiny"))
        .args(["--ids", &ids.join(",")])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let got = v["logits"][0].as_array().unwrap();
    for (pos, want) in case["positions"]
        .as_array()
        .unwrap()
        .iter()
        .zip(case["logits"].as_array().unwrap())
    {
        let row = got[pos.as_u64().unwrap() as usize].as_array().unwrap();
        for (a, b) in row.iter().zip(want.as_array().unwrap()) {
            assert!((a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-4);
        }
    }
}

#[test]
fn logits_to_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let ids = dir.path().join("ids.json");
    std::fs::write(&ids, r#"{"input_ids": [[1, 2, 3], [4, 5, 6]]}"#).unwrap();
    let out_file = dir.path().join("logits.safetensors");
    let out = fleet()
        .args(["logits", "--model"])
        .arg(fixture("qwen2-tiny"))
        .arg("--ids-file")
        .arg(&ids)
        .arg("--output")
        .arg(&out_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&out_file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    assert_eq!(t.shape(), &[2, 3, 1024]);
}

#[test]
fn generate_streams_a_chat_reply() {
    let out = fleet()
        .args(["generate", "--model"])
        .arg(fixture("qwen2-tiny"))
        .args(["--prompt", "What is a DU?", "--max-new-tokens", "8"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tokens"), "{err}");
}

#[test]
fn bad_input_exits_nonzero_with_a_message() {
    let out = fleet()
        .args(["logits", "--model", "/nonexistent/dir", "--ids", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/dir"));

    let out = fleet()
        .args(["logits", "--model"])
        .arg(fixture("qwen2-tiny"))
        .args(["--ids", "1,x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("`x` is not a token id"));

    let out = fleet()
        .args(["generate", "--model"])
        .arg(fixture("qwen2-tiny"))
        .args(["--prompt", "hi", "--device", "cuda:0,cuda:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("listed twice"));

    let out = fleet()
        .args(["generate", "--model"])
        .arg(fixture("qwen2-tiny"))
        .args(["--prompt", "hi", "--dtype", "int4"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("int4"));
}

#[test]
fn generate_batch_from_ids_file_matches_goldens() {
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("golden/qwen2-tiny.json")).unwrap())
            .unwrap();
    let cases = golden["greedy"].as_array().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ids = dir.path().join("ids.json");
    let prompts: Vec<&serde_json::Value> = cases.iter().map(|c| &c["input_ids"]).collect();
    std::fs::write(
        &ids,
        serde_json::json!({ "input_ids": prompts }).to_string(),
    )
    .unwrap();
    // Continuous batching (the default) and static batches, on --device and on the planned
    // path (one CPU replica here, 2 decode slots or batches of 2).
    for extra in [
        &[][..],
        &["--batching", "static"][..],
        &["--gpu-mode", "data-parallel", "--max-batch", "2"][..],
        &[
            "--gpu-mode",
            "data-parallel",
            "--max-batch",
            "2",
            "--batching",
            "static",
        ][..],
    ] {
        let out = fleet()
            .args(["generate", "--model"])
            .arg(fixture("qwen2-tiny"))
            .arg("--ids-file")
            .arg(&ids)
            .args(["--max-new-tokens", "40"])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        check_greedy_lines(&String::from_utf8_lossy(&out.stdout), cases);
    }
}

/// Each JSON line's tokens equal the golden greedy continuation.
fn check_greedy_lines(stdout: &str, cases: &[serde_json::Value]) {
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), cases.len());
    for (line, case) in lines.iter().zip(cases) {
        let n = case["max_new_tokens"].as_u64().unwrap() as usize;
        let got: Vec<u64> = line["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let want: Vec<u64> = case["output_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(got[..n.min(got.len())], want[..]);
    }
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

/// `--model config.json` from the directory that holds it (issue 23: it failed with "No such
/// file or directory" and no path).
#[test]
fn plan_takes_a_bare_config_file_name() {
    let out = fleet()
        .args(["plan", "--model", "qwen2.5-7b.json", "--topology"])
        .arg(repo("configs/topologies/rtx3060-8x.toml"))
        .current_dir(repo("configs/models"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("4 replica(s)"));
}

/// One check of the sampling flags in every binary: --top-k 0 turns the filter off, --top-p
/// outside (0, 1] and negative numbers get the real error (not clap's "unexpected argument"),
/// and a user error prints its message only, even with RUST_BACKTRACE=1, without colour
/// codes when stderr is a pipe.
#[test]
fn sampling_flags_are_checked_once_and_errors_print_no_backtrace() {
    let generate = |extra: &[&str]| {
        fleet()
            .args(["generate", "--model"])
            .arg(fixture("qwen3-tiny"))
            .args(["--prompt", "hi", "--max-new-tokens", "2", "--raw"])
            .args(extra)
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap()
    };
    let out = generate(&["--temperature", "0.7", "--top-k", "0", "--top-p", "1"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (flags, needle) in [
        (&["--temperature", "-1"][..], "--temperature -1"),
        (&["--temperature", "1", "--top-p", "2"][..], "--top-p 2"),
        (&["--temperature", "1", "--top-k", "-5"][..], "--top-k -5"),
    ] {
        let out = generate(flags);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains(needle), "{err}");
        assert!(!err.contains("unexpected argument"), "{err}");
        assert!(!err.contains("backtrace"), "{err}");
        assert!(!err.contains('\u{1b}'), "{err}");
    }
}

#[test]
fn plan_prints_replicas_for_a_virtual_topology() {
    let out = fleet()
        .args(["plan", "--model"])
        .arg(repo("configs/models/qwen2.5-7b.json"))
        .arg("--topology")
        .arg(repo("configs/topologies/rtx3060-8x.toml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("4 replica(s) of 2 GPU(s)"), "{text}");
    assert!(text.contains("headroom"), "{text}");

    // A checkpoint directory works as well as a config file, and JSON comes out with --json.
    let out = fleet()
        .args(["plan", "--json", "--model"])
        .arg(fixture("qwen3-tiny"))
        .arg("--topology")
        .arg(repo("configs/topologies/h200-2x.toml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["replicas"].as_array().unwrap().len(), 2);
}

#[test]
fn plan_that_does_not_fit_says_what_to_change() {
    let out = fleet()
        .args(["plan", "--model"])
        .arg(repo("configs/models/qwen2.5-72b.json"))
        .arg("--topology")
        .arg(repo("configs/topologies/h200-1x.toml"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("does not fit") && err.contains("more GPUs") && err.contains("cpu"),
        "{err}"
    );

    let out = fleet()
        .args(["plan", "--model"])
        .arg(repo("configs/models/qwen2.5-7b.json"))
        .arg("--topology")
        .arg(repo("configs/topologies/h200-2x.toml"))
        .args(["--max-memory", "0=10GB,1=zz"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("`zz`"));
}

/// The data-parallel path end to end: two real model replicas (CPU) behind fleet-dist's pool.
#[test]
fn data_parallel_bench_runs_real_replicas() {
    let mut cmd = fleet();
    cmd.args(["bench", "data-parallel", "--model"])
        .arg(fixture("qwen2-tiny"))
        .args(["--dtype", "f32", "--devices", "cpu,cpu", "--batch", "2"])
        .args([
            "--batches-per-replica",
            "3",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
        ]);
    let v = json_written_by(cmd);
    assert_eq!(v["items"], 6);
    assert_eq!(v["new_tokens_total"], 6 * 2 * 4);
    let per: Vec<u64> = v["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            assert!(p["busy_s"].as_f64().unwrap() > 0.0, "{p}");
            p["batches"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(per.iter().sum::<u64>(), 6);
    assert_eq!(per.len(), 2);
}

/// `bench generate` with sampling (GSPO's rollouts draw at temperature 1): it runs on the
/// paged path with reads every second step and records the sampling it timed.
#[test]
fn bench_generate_samples_when_asked() {
    let mut cmd = fleet();
    cmd.args(["bench", "generate", "--model"])
        .arg(fixture("qwen2-tiny"))
        .args(["--dtype", "f32", "--device", "cpu", "--batch", "2"])
        .args(["--prompt-len", "4", "--new-tokens", "3", "--repeats", "1"])
        .args(["--batching", "continuous", "--num-scheduler-steps", "2"])
        .args(["--temperature", "1", "--top-k", "5"]);
    let v = json_written_by(cmd);
    assert_eq!(v["sampling"]["temperature"], 1.0, "{v}");
    assert_eq!(v["sampling"]["top_k"], 5, "{v}");
    assert_eq!(v["num_scheduler_steps"], 2);
    assert_eq!(v["runs"][0]["batch"], 2);
}

#[test]
fn data_parallel_group_size_must_divide_the_devices() {
    let out = fleet()
        .args(["bench", "data-parallel", "--config"])
        .arg(fixture("qwen2-tiny/config.json"))
        .args([
            "--dtype",
            "f32",
            "--devices",
            "cpu,cpu",
            "--group-size",
            "3",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--group-size 3 must divide the 2 devices"),
        "{err}"
    );
}

/// Exit status and stderr of a run that must fail with a message, never a panic.
fn fails_with(args: &[&str]) -> String {
    let out = fleet().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} succeeded: {err}");
    assert_ne!(out.status.code(), Some(101), "{args:?} panicked: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    err
}

/// Counts of zero (and a decode length of one) are refused before any work, naming the flag
/// and the allowed range; before, `--batch 0` and `--batches-per-replica 0` panicked on an
/// empty index, `--new-tokens 0` reported a negative throughput, `--repeats 0` ran once.
#[test]
fn bench_and_other_count_flags_refuse_zero() {
    let model = fixture("qwen2-tiny");
    let model = model.to_str().unwrap();
    // Small sizes, so that a run the flag fails to stop ends quickly; the flag under test
    // replaces the entry of the same name.
    let bench_args = |sub: &str, device_flag: &str, flag: &str, value: &str| -> Vec<String> {
        let mut args: Vec<String> = ["bench", sub, "--model", model, "--dtype", "f32"]
            .map(String::from)
            .to_vec();
        args.extend([device_flag.to_string(), "cpu".into()]);
        for (f, v) in [
            ("--batch", "1"),
            ("--prompt-len", "4"),
            ("--new-tokens", "2"),
            ("--repeats", "1"),
            ("--batches-per-replica", "1"),
            ("--group-size", "1"),
        ] {
            let applies = match f {
                "--repeats" => sub == "generate",
                "--batches-per-replica" | "--group-size" => sub == "data-parallel",
                _ => true,
            };
            if applies {
                args.extend([f.to_string(), if f == flag { value } else { v }.to_string()]);
            }
        }
        args
    };
    let cases = [
        ("generate", "--device", "--batch", "0", "at least 1"),
        ("generate", "--device", "--batch", "1,0", "at least 1"),
        ("generate", "--device", "--new-tokens", "0", "at least 2"),
        ("generate", "--device", "--new-tokens", "1", "at least 2"),
        ("generate", "--device", "--repeats", "0", "at least 1"),
        ("generate", "--device", "--prompt-len", "0", "at least 1"),
        (
            "data-parallel",
            "--devices",
            "--batches-per-replica",
            "0",
            "at least 1",
        ),
        ("data-parallel", "--devices", "--batch", "0", "at least 1"),
        (
            "data-parallel",
            "--devices",
            "--new-tokens",
            "0",
            "at least 1",
        ),
        (
            "data-parallel",
            "--devices",
            "--prompt-len",
            "0",
            "at least 1",
        ),
        (
            "data-parallel",
            "--devices",
            "--group-size",
            "0",
            "at least 1",
        ),
    ];
    for (sub, device_flag, flag, value, range) in cases {
        let args = bench_args(sub, device_flag, flag, value);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = fails_with(&args);
        assert!(
            // clap names the offending item of a list: the last one here.
            err.contains(&format!(
                "'{}' for '{flag}",
                value.rsplit(',').next().unwrap()
            )) && err.contains(range),
            "bench {sub} {flag} {value}: {err}"
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let ids = dir.path().join("ids.json");
    std::fs::write(&ids, r#"{"input_ids": [[1, 2, 3]]}"#).unwrap();
    let err = fails_with(&[
        "generate",
        "--model",
        model,
        "--ids-file",
        ids.to_str().unwrap(),
        "--max-batch",
        "0",
    ]);
    assert!(
        err.contains("'--max-batch") && err.contains("at least 1"),
        "{err}"
    );
    let config = repo("configs/models/qwen2.5-7b.json");
    for flag in ["--batch", "--seq-len"] {
        let err = fails_with(&["plan", "--model", config.to_str().unwrap(), flag, "0"]);
        assert!(
            err.contains(&format!("'{flag}")) && err.contains("at least 1"),
            "{err}"
        );
    }
}

/// A reader that stops reading (`fleet plan ... | head -n 1`) ends the command quietly: no
/// "failed printing to stdout" panic (exit 101). Stdout here is a pipe whose read end is
/// closed before the command starts, so every write to it fails.
#[test]
fn a_closed_stdout_ends_quietly() {
    let plan_model = repo("configs/models/qwen2.5-7b.json");
    let topology = repo("configs/topologies/rtx3060-8x.toml");
    let tiny = fixture("qwen2-tiny");
    let (plan_model, topology, tiny) = (
        plan_model.to_str().unwrap(),
        topology.to_str().unwrap(),
        tiny.to_str().unwrap(),
    );
    let runs: [&[&str]; 5] = [
        &["plan", "--model", plan_model, "--topology", topology],
        &["devices"],
        &["devices", "--json"],
        // Streams the reply token by token.
        &[
            "generate",
            "--model",
            tiny,
            "--prompt",
            "hi",
            "--max-new-tokens",
            "8",
        ],
        &["logits", "--model", tiny, "--ids", "1,2,3"],
    ];
    for args in runs {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = fleet()
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(101), "{args:?}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("Broken pipe"),
            "{args:?}: {err}"
        );
        assert!(out.status.success(), "{args:?}: {:?} {err}", out.status);
    }
}

/// More positions than the model has: a message naming max_position_embeddings and the count,
/// not a tensor error from inside the rotary embedding.
#[test]
fn logits_past_max_position_embeddings_is_a_clear_error() {
    let model = fixture("qwen3-tiny");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let max = config["max_position_embeddings"].as_u64().unwrap() as usize;
    let ids = vec!["1"; max + 1].join(",");
    let err = fails_with(&["logits", "--model", model.to_str().unwrap(), "--ids", &ids]);
    assert!(
        err.contains("max_position_embeddings")
            && err.contains(&(max + 1).to_string())
            && err.contains(&max.to_string()),
        "{err}"
    );
    // Exactly max positions still run.
    let ids = vec!["1"; max].join(",");
    let out = fleet()
        .args(["logits", "--model", model.to_str().unwrap(), "--ids", &ids])
        .arg("--output")
        .arg(
            tempfile::tempdir()
                .unwrap()
                .path()
                .join("logits.safetensors"),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Budgets and GPU ids that the topology cannot honour are errors naming the entry and what
/// exists, where before a GPU id in --max-memory that was not in the topology did nothing and
/// `0=0` planned a GPU with no memory.
#[test]
fn plan_refuses_budgets_and_gpu_ids_it_cannot_honour() {
    let config = repo("configs/models/qwen2.5-7b.json");
    let topology = repo("configs/topologies/rtx3060-8x.toml");
    let plan = |extra: &[&str]| -> String {
        let mut args = vec![
            "plan",
            "--model",
            config.to_str().unwrap(),
            "--topology",
            topology.to_str().unwrap(),
        ];
        args.extend(extra);
        fails_with(&args)
    };
    let err = plan(&["--gpu-ids", "9"]);
    assert!(err.contains("GPU 9") && err.contains("ids 0-7"), "{err}");
    let err = plan(&["--max-memory", "9=10GiB"]);
    assert!(err.contains("cuda:9") && err.contains("ids 0-7"), "{err}");
    let err = plan(&["--gpu-ids", "2,3", "--max-memory", "0=10GiB"]);
    assert!(err.contains("GPU 0") && err.contains("ids 2, 3"), "{err}");
    let err = plan(&["--max-memory", "0=0"]);
    assert!(
        err.contains("`0=0`") && err.contains("no memory") && err.contains("--gpu-ids"),
        "{err}"
    );
    let err = plan(&["--max-memory", "0=10GiB,1=0.9,0=20GiB"]);
    assert!(
        err.contains("two entries for cuda:0") && err.contains("`0`"),
        "{err}"
    );
}

/// The ways out of a plan that does not fit name flags that `fleet plan` accepts (the planner
/// names `--gpu-mode`, which is `fleet plan --mode` under the name the other binaries use).
#[test]
fn plan_ways_out_name_flags_that_plan_accepts() {
    let help = fleet().args(["plan", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let flags_in = |text: &str| -> Vec<String> {
        text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .filter(|w| w.starts_with("--") && w.len() > 2)
            .map(String::from)
            .collect()
    };
    let accepted = flags_in(&help);
    let topology = |name: &str| repo(&format!("configs/topologies/{name}.toml"));
    let model = |size: &str| repo(&format!("configs/models/qwen2.5-{size}.json"));
    // 7B in single mode on one 12 GiB GPU: shard it; 72B on one H200: offload, more GPUs.
    for (size, topo, mode) in [("7b", "rtx3060-8x", "single"), ("72b", "h200-1x", "auto")] {
        let err = fails_with(&[
            "plan",
            "--model",
            model(size).to_str().unwrap(),
            "--topology",
            topology(topo).to_str().unwrap(),
            "--mode",
            mode,
        ]);
        let named = flags_in(&err);
        assert!(!named.is_empty(), "{err}");
        for flag in &named {
            assert!(
                accepted.contains(flag),
                "`{flag}` is named in the ways out but fleet plan does not accept it:\n{err}\n{help}"
            );
        }
    }
    // The way out taken: the same model and topology with the flag the message names.
    let out = fleet()
        .args(["plan", "--model"])
        .arg(model("7b"))
        .arg("--topology")
        .arg(topology("rtx3060-8x"))
        .args(["--gpu-mode", "layer-sharded"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("1 replica(s) of 2 GPU(s)"));
}

/// Issue 24: logical devices that cannot be had are refused before anything loads, naming the
/// flag and the fix: no GPU here (this CPU machine), a flag that does not parse, caps of 0.
#[test]
fn logical_gpus_that_cannot_be_had_are_refused_with_the_fix() {
    if candle_core::utils::cuda_is_available() {
        return;
    }
    let err = fails_with(&["--logical-gpus", "2:8GiB", "devices"]);
    assert!(
        err.contains("--logical-gpus 2:8GiB") && err.contains("sees none"),
        "{err}"
    );
    // The flag is global: after the subcommand too.
    let err = fails_with(&["devices", "--logical-gpus", "two"]);
    assert!(
        err.contains("not a number of devices") && err.contains("8:12GiB"),
        "{err}"
    );
    let err = fails_with(&["devices", "--logical-gpus", "2:0GiB"]);
    assert!(err.contains("larger than zero"), "{err}");
}
