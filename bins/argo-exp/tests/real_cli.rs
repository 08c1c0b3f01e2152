//! The real-model commands end to end on the tiny fixtures: ingest a corpus, query it, compare
//! strategies on a generic JSONL dataset with the tiny Qwen checkpoint, resume, and bad input.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::argo_exp;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
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

#[test]
fn ingest_query_compare_and_resume_on_tiny_fixtures() {
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    std::fs::create_dir_all(&docs).unwrap();
    std::fs::write(
        docs.join("e2.txt"),
        "The E2 interface connects the near-RT RIC to E2 nodes.",
    )
    .unwrap();
    std::fs::write(
        docs.join("a1.md"),
        "The A1 interface carries policies to the near-RT RIC.",
    )
    .unwrap();
    let index = tmp.path().join("index");
    let embedder = repo().join("tests/fixtures/bert-tiny-st");
    let (index_s, embedder_s) = (index.to_str().unwrap(), embedder.to_str().unwrap());

    let out = ok(&argo_exp(&[
        "ingest",
        "--docs",
        docs.to_str().unwrap(),
        "--index",
        index_s,
        "--embedder",
        embedder_s,
    ]));
    assert!(
        out.contains("2 added") && out.contains("2 chunks in all"),
        "{out}"
    );
    // Again: nothing new.
    let out = ok(&argo_exp(&[
        "ingest",
        "--docs",
        docs.to_str().unwrap(),
        "--index",
        index_s,
        "--embedder",
        embedder_s,
    ]));
    assert!(
        out.contains("2 unchanged") && out.contains("0 chunks added"),
        "{out}"
    );
    let out = ok(&argo_exp(&[
        "query",
        "E2 interface",
        "--index",
        index_s,
        "--embedder",
        embedder_s,
        "--top-k",
        "2",
    ]));
    assert_eq!(out.lines().count(), 2, "{out}");

    let data = tmp.path().join("questions.jsonl");
    let mut lines = String::new();
    for i in 0..3 {
        lines.push_str(&format!(
            "{{\"id\": \"t{i}\", \"question\": \"Which interface links the RIC to E2 nodes ({i})?\", \"options\": [\"A1\", \"E2\", \"O1\"], \"answer\": 2}}\n"
        ));
    }
    std::fs::write(&data, lines).unwrap();
    let out_dir = tmp.path().join("real");
    // Short replies keep the CPU test quick: the tiny model writes noise anyway.
    let prompts = tmp.path().join("prompts.toml");
    let shipped = std::fs::read_to_string(repo().join("configs/argo_prompts.toml")).unwrap();
    let short = shipped
        .replace("max_new_tokens = 48", "max_new_tokens = 4")
        .replace("max_new_tokens = 128", "max_new_tokens = 4")
        .replace("max_new_tokens = 64", "max_new_tokens = 6");
    std::fs::write(&prompts, short).unwrap();
    let model = repo().join("tests/fixtures/qwen2-tiny");
    let args = [
        "compare",
        "--model",
        model.to_str().unwrap(),
        "--dtype",
        "f32",
        "--dataset",
        data.to_str().unwrap(),
        "--n-questions",
        "3",
        "--strategies",
        "argo,fixed-k:1,always-reason",
        "--step-cap",
        "3",
        "--prompts",
        prompts.to_str().unwrap(),
        "--index",
        index_s,
        "--embedder",
        embedder_s,
        "--out",
        out_dir.to_str().unwrap(),
    ];
    let out = ok(&argo_exp(&args));
    assert!(out.contains("[real]") && out.contains("ARGO"), "{out}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["world"], "real");
    assert_eq!(summary["results"].as_array().unwrap().len(), 3);
    assert_eq!(summary["resumed_jobs"], 0);
    assert!(summary["llm"]["calls"].as_u64().unwrap() >= 9);
    let records = std::fs::read_to_string(out_dir.join("records.jsonl")).unwrap();
    assert_eq!(records.lines().count(), 9);

    // Started again: every job comes from the records.
    let out = ok(&argo_exp(&args));
    assert!(out.contains("9 jobs (9 resumed)"), "{out}");

    // A real sweep over --mode small's 5 c_r points writes Graphs 1.A-1.C.
    let sweep_dir = tmp.path().join("sweep");
    let mut sweep_args: Vec<&str> = args.to_vec();
    let out_pos = sweep_args.iter().position(|a| *a == "--out").unwrap();
    sweep_args[out_pos + 1] = sweep_dir.to_str().unwrap();
    let n_pos = sweep_args
        .iter()
        .position(|a| *a == "--n-questions")
        .unwrap();
    sweep_args[n_pos + 1] = "2";
    sweep_args.extend(["--sweep", "--mode", "small", "--progress", "llm-judge"]);
    let out = ok(&argo_exp(&sweep_args));
    assert!(out.contains("real_graph1a_accuracy_vs_c_r.png"), "{out}");
    for stem in [
        "real_graph1a_accuracy_vs_c_r",
        "real_graph1b_retrievals_vs_c_r",
        "real_graph1c_accuracy_vs_cost",
    ] {
        for ext in ["png", "svg"] {
            let f = sweep_dir.join(format!("{stem}.{ext}"));
            assert!(
                std::fs::metadata(&f).unwrap().len() > 1000,
                "{}",
                f.display()
            );
        }
    }

    // Bad input: an index searched with another embedder (same weights, other truncation).
    let other = tmp.path().join("other-embedder");
    std::fs::create_dir_all(other.join("1_Pooling")).unwrap();
    for entry in std::fs::read_dir(&embedder).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, other.join(p.file_name().unwrap())).unwrap();
        }
    }
    for entry in std::fs::read_dir(embedder.join("1_Pooling")).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, other.join("1_Pooling").join(p.file_name().unwrap())).unwrap();
    }
    let cfg = other.join("sentence_bert_config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["max_seq_length"] = serde_json::json!(16);
    std::fs::write(&cfg, v.to_string()).unwrap();
    let mismatch = argo_exp(&[
        "query",
        "E2",
        "--index",
        index_s,
        "--embedder",
        other.to_str().unwrap(),
    ]);
    assert!(!mismatch.status.success());
    let err = String::from_utf8_lossy(&mismatch.stderr);
    assert!(
        err.contains("another embedder") && err.contains("max_seq_length"),
        "{err}"
    );

    // Bad input: an empty corpus.
    let empty = tmp.path().join("empty-docs");
    std::fs::create_dir_all(&empty).unwrap();
    let out = argo_exp(&[
        "ingest",
        "--docs",
        empty.to_str().unwrap(),
        "--index",
        tmp.path().join("i2").to_str().unwrap(),
        "--embedder",
        embedder_s,
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no files found"), "{err}");

    // Bad input: a dataset file that is not there.
    let missing = argo_exp(&[
        "compare",
        "--model",
        model.to_str().unwrap(),
        "--dataset",
        "/nonexistent/q.jsonl",
        "--index",
        index_s,
        "--embedder",
        embedder_s,
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    assert!(!missing.status.success());
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.contains("/nonexistent/q.jsonl"), "{err}");
}
