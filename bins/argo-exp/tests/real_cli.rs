//! The real-model commands end to end on the tiny fixtures: ingest a corpus, query it, compare
//! strategies on a generic JSONL dataset with the tiny Qwen checkpoint, resume, and bad input.

mod common;
use common::{argo_exp, fails, ok, TinyRun};

#[test]
fn ingest_query_compare_and_resume_on_tiny_fixtures() {
    let run = TinyRun::new();
    let tmp = &run.tmp;
    let index = run.index.clone();
    let embedder = run.embedder.clone();
    let (index_s, embedder_s) = (index.to_str().unwrap(), embedder.to_str().unwrap());
    // Again: nothing new.
    let out = ok(&run.ingest(&[]));
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
    // Without --embedder the index's own embedder is used (it used to try the hub's MiniLM).
    let same = ok(&argo_exp(&[
        "query",
        "E2 interface",
        "--index",
        index_s,
        "--top-k",
        "2",
    ]));
    assert_eq!(same, out);

    let out_dir = tmp.path().join("real");
    let model = run.model.clone();
    let args_owned = run.compare_args(&out_dir);
    let args: Vec<&str> = args_owned.iter().map(String::as_str).collect();
    let out = ok(&argo_exp(&args));
    assert!(out.contains("[real]") && out.contains("ARGO"), "{out}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["world"], "real");
    assert_eq!(summary["results"].as_array().unwrap().len(), 3);
    assert_eq!(summary["resumed_jobs"], 0);
    assert!(summary["llm"]["calls"].as_u64().unwrap() >= 9);
    // The settings its speed depends on, defaults included: continuous batching with 384
    // slots, 1,024 questions in flight, a 2 GiB pool on the CPU, tokens read every step.
    assert_eq!(
        summary["batching"],
        serde_json::json!({
            "mode": "continuous",
            "max_batch": 384,
            "max_in_flight": 1024,
            "kv_cache_bytes": 2u64 << 30,
            "num_scheduler_steps": 1,
        })
    );
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

/// Issue 14, item 1: a resume is keyed by what made the records.
#[test]
fn a_resume_with_another_model_or_settings_is_refused_and_overwrite_starts_over() {
    let run = TinyRun::new();
    let out_dir = run.tmp.path().join("real");
    let args = run.compare_args(&out_dir);
    let two = [("--n-questions", "2"), ("--strategies", "fixed-k:1")];
    ok(&run.run_with(&args, &two));
    let records = std::fs::read_to_string(out_dir.join("records.jsonl")).unwrap();
    assert_eq!(records.lines().count(), 2);
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["determines"]["step_cap"], 3);
    assert_eq!(manifest["determines"]["dtype"], "f32");
    assert!(manifest["determines"]["model"]["weights_digest"]
        .as_str()
        .unwrap()
        .starts_with("fnv1a64w:"));

    // Another step cap, threshold, dtype or model: refused, naming the field, records untouched.
    let changes: [(&[(&str, &str)], &str); 4] = [
        (&[("--step-cap", "4")], "step_cap: 3 recorded, 4 now"),
        (&[("--threshold", "0.5")], "retrieval.threshold"),
        (
            &[("--dtype", "bf16")],
            "dtype: \"f32\" recorded, \"bf16\" now",
        ),
        (
            &[(
                "--model",
                run.model
                    .with_file_name("qwen3-tiny")
                    .to_str()
                    .unwrap()
                    .to_owned()
                    .leak(),
            )],
            "model.weights_digest",
        ),
    ];
    for (change, field) in changes {
        let mut set = two.to_vec();
        set.extend_from_slice(change);
        let err = fails(&run.run_with(&args, &set));
        assert!(err.contains(field), "{change:?}: {err}");
        assert!(
            err.contains("--out") && err.contains("--overwrite"),
            "{change:?}: {err}"
        );
        assert_eq!(
            std::fs::read_to_string(out_dir.join("records.jsonl")).unwrap(),
            records
        );
    }
    // More questions or other strategies with the same settings extend the run.
    let out = ok(&run.run_with(&args, &[("--strategies", "fixed-k:1")]));
    assert!(out.contains("3 jobs (2 resumed)"), "{out}");

    // --overwrite: the old records go, the cache of the same model stays.
    let mut set = two.to_vec();
    set.push(("--step-cap", "4"));
    let cache_before = std::fs::read_to_string(out_dir.join("llm_cache.jsonl")).unwrap();
    assert!(!cache_before.is_empty());
    let overwrite = {
        let mut a = args.clone();
        a.push("--overwrite".into());
        a
    };
    let out = run.run_with(&overwrite, &set);
    let stdout = ok(&out);
    assert!(stdout.contains("2 jobs (0 resumed)"), "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("step_cap: 3 recorded, 4 now"), "{stderr}");
    let cache_after = std::fs::read_to_string(out_dir.join("llm_cache.jsonl")).unwrap();
    assert!(cache_after.starts_with(&cache_before));
    // And the new settings resume.
    let out = ok(&run.run_with(&args, &set));
    assert!(out.contains("2 jobs (2 resumed)"), "{out}");

    // Records of an older fleet (no manifest) are not resumed blindly.
    std::fs::remove_file(out_dir.join("manifest.json")).unwrap();
    let err = fails(&run.run_with(&args, &set));
    assert!(err.contains("no manifest.json"), "{err}");
}

/// Issue 14, item 2: one writer per output directory.
#[test]
fn a_second_run_on_the_same_output_directory_stops_at_once() {
    let run = TinyRun::new();
    let out_dir = run.tmp.path().join("real");
    std::fs::create_dir_all(&out_dir).unwrap();
    // Another process holds the directory (this test process, through the same OS lock).
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(out_dir.join(".fleet-lock"))
        .unwrap();
    lock.try_lock().unwrap();
    std::fs::write(out_dir.join(".fleet-lock"), "pid 4242 (a test)\n").unwrap();
    let err = fails(&run.run_with(&run.compare_args(&out_dir), &[]));
    assert!(
        err.contains("another run is writing") && err.contains("pid 4242"),
        "{err}"
    );
    assert!(!out_dir.join("records.jsonl").exists());
    drop(lock);
    ok(&run.run_with(&run.compare_args(&out_dir), &[("--n-questions", "1")]));
}

/// Issue 14, item 3: a record line torn by a kill is repaired before the resume appends.
#[test]
fn a_torn_record_line_is_cut_off_and_its_job_runs_again() {
    let run = TinyRun::new();
    let out_dir = run.tmp.path().join("real");
    let args = run.compare_args(&out_dir);
    let set = [("--n-questions", "2"), ("--strategies", "fixed-k:1")];
    ok(&run.run_with(&args, &set));
    for file in ["records.jsonl", "llm_cache.jsonl"] {
        let path = out_dir.join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let (body, last) = text.trim_end().rsplit_once('\n').unwrap();
        std::fs::write(&path, format!("{body}\n{}", &last[..last.len() / 2])).unwrap();
    }
    let out = run.run_with(&args, &set);
    let stdout = ok(&out);
    assert!(stdout.contains("2 jobs (1 resumed)"), "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cut off mid-write"), "{stderr}");
    for file in ["records.jsonl", "llm_cache.jsonl"] {
        let text = std::fs::read_to_string(out_dir.join(file)).unwrap();
        assert!(text.ends_with('\n'), "{file}");
        for line in text.lines() {
            serde_json::from_str::<serde_json::Value>(line)
                .unwrap_or_else(|e| panic!("{file}: {e}: {line}"));
        }
    }
    let out = ok(&run.run_with(&args, &set));
    assert!(out.contains("2 jobs (2 resumed)"), "{out}");
}

/// Issue 14, item 6: flags that were accepted silently.
#[test]
fn flags_that_cannot_be_honoured_are_errors() {
    let run = TinyRun::new();
    let out_dir = run.tmp.path().join("real");
    let args = run.compare_args(&out_dir);
    let cases: [(&[(&str, &str)], &str); 6] = [
        (&[("--difficulty", "easy")], "no difficulty levels"),
        (&[("--n-questions", "50")], "has only 3 questions"),
        (&[("--strategies", "argo,fixed-k:1,argo")], "listed twice"),
        (&[("--max-in-flight", "0")], "--max-in-flight"),
        (&[("--max-batch", "0")], "--max-batch"),
        (&[("--top-k", "0")], "--top-k"),
    ];
    for (set, expected) in cases {
        let err = fails(&run.run_with(&args, set));
        assert!(err.contains(expected), "{set:?}: {err}");
    }
    assert!(!out_dir.join("records.jsonl").exists());
    let err = fails(&argo_exp(&[
        "query",
        "E2",
        "--index",
        run.index.to_str().unwrap(),
        "--embedder",
        run.embedder.to_str().unwrap(),
        "--top-k",
        "0",
    ]));
    assert!(err.contains("--top-k"), "{err}");
    // Without --n-questions, a preset larger than the dataset takes all of it and says so.
    let out = run.run_with(
        &args,
        &[("--n-questions", ""), ("--strategies", "fixed-k:1")],
    );
    ok(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("asked for 1000 questions but only 3 are available"),
        "{stderr}"
    );
    let version = ok(&argo_exp(&["--version"]));
    assert!(version.starts_with("argo-exp "), "{version}");
    let help = ok(&argo_exp(&["compare", "--help"]));
    assert!(
        help.contains("llm_cache.jsonl") && help.contains("--overwrite"),
        "{help}"
    );
}

/// Issue 14, item 6: the index mirrors its documents directory and keeps its chunking.
#[test]
fn ingest_removes_deleted_documents_and_refuses_other_chunking() {
    let run = TinyRun::new();
    std::fs::remove_file(run.docs.join("a1.md")).unwrap();
    let out = ok(&run.ingest(&[]));
    assert!(
        out.contains("1 removed") && out.contains("1 chunks in all"),
        "{out}"
    );
    assert!(out.contains("removed a1.md"), "{out}");
    let err = fails(&run.ingest(&["--chunk-words", "40"]));
    assert!(
        err.contains("--rebuild") && err.contains("160 words"),
        "{err}"
    );
    let out = ok(&run.ingest(&["--chunk-words", "40", "--rebuild"]));
    assert!(out.contains("1 added"), "{out}");
    // The rebuilt index keeps its own chunking on the next ingest.
    let out = ok(&run.ingest(&[]));
    assert!(out.contains("1 unchanged"), "{out}");
}
