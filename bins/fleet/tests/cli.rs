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
    // One left-padded batch on --device, and the planned path (one CPU replica here, batches
    // of 2 through the replica pool).
    for extra in [
        &[][..],
        &["--gpu-mode", "data-parallel", "--max-batch", "2"][..],
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
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("dp.json");
    let out = fleet()
        .args(["bench", "data-parallel", "--model"])
        .arg(fixture("qwen2-tiny"))
        .args(["--dtype", "f32", "--devices", "cpu,cpu", "--batch", "2"])
        .args([
            "--batches-per-replica",
            "3",
            "--prompt-len",
            "8",
            "--new-tokens",
            "4",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
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
