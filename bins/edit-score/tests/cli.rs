//! edit-score end to end on the CPU with the real binary and the tiny Qwen3-VL fixture judge
//! (random weights: its replies are gibberish, so they are recorded and counted as parse
//! failures): the demo, bad items skipped, a kill and resume, shards + merge, two judge replicas
//! in processes (one of them dying), and refused inputs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use image::{Rgb, RgbImage};
use serde_json::{json, Value};

fn edit_score() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_edit-score"));
    c.env_remove("FLEET_REPLICA_PROCESSES")
        .env_remove("FLEET_REPLICA_EXIT_AFTER")
        .env_remove("SLURM_PROCID")
        .env_remove("SLURM_NTASKS")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE");
    c
}

fn run(args: &[&str]) -> Output {
    edit_score().args(args).output().expect("edit-score runs")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ok(out: &Output) -> (String, String) {
    let (stdout, stderr) = text(out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    (stdout, stderr)
}

fn fails(out: &Output) -> String {
    let (stdout, stderr) = text(out);
    assert!(
        !out.status.success(),
        "expected a failure; stdout:\n{stdout}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tiny_judge() -> String {
    repo()
        .join("tests/fixtures/qwen3-vl-tiny")
        .display()
        .to_string()
}

fn viescore() -> String {
    repo()
        .join("configs/judge/viescore.toml")
        .display()
        .to_string()
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A 48x32 image with a stripe at row `n` (distinct per item).
fn picture(n: u32, edited: bool) -> RgbImage {
    RgbImage::from_fn(48, 32, |x, y| {
        if y == n % 32 || (edited && x == n % 48) {
            Rgb([250, 30, 30])
        } else {
            Rgb([(x * 5) as u8, (y * 7) as u8, if edited { 200 } else { 90 }])
        }
    })
}

/// A plain-JSONL benchmark of `n` items in two categories under `dir`.
fn jsonl_benchmark(dir: &Path, n: u32) -> PathBuf {
    std::fs::create_dir_all(dir.join("img")).unwrap();
    let mut out = String::new();
    for i in 0..n {
        picture(i, false)
            .save(dir.join(format!("img/{i}_src.png")))
            .unwrap();
        picture(i, true)
            .save(dir.join(format!("img/{i}_edit.png")))
            .unwrap();
        out.push_str(
            &json!({
                "id": format!("pair-{i}"),
                "category": if i % 2 == 0 { "color_alter" } else { "subject-add" },
                "instruction": format!("Add a red line number {i}."),
                "source": format!("img/{i}_src.png"),
                "edited": format!("img/{i}_edit.png"),
            })
            .to_string(),
        );
        out.push('\n');
    }
    let path = dir.join("bench.jsonl");
    std::fs::write(&path, out).unwrap();
    path
}

fn score_args<'a>(bench: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "--benchmark",
        bench,
        "--format",
        "jsonl",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "2",
        "--no-progress",
        "--output",
        out,
    ]
}

/// Sets `flag`'s value in `args`.
fn set<'a>(args: &mut [&'a str], flag: &str, value: &'a str) {
    let i = args.iter().position(|a| *a == flag).unwrap();
    args[i + 1] = value;
}

/// What a record says, without its timing (which worker, how long, when).
fn content(r: &Value) -> Value {
    json!([
        r["index"],
        r["key"],
        r["id"],
        r["call"],
        r["raw"],
        r["score"],
        r["parse_failed"]
    ])
}

#[test]
fn the_demo_scores_its_generated_benchmark_and_writes_the_report() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("demo");
    let o = out.to_str().unwrap();
    let (stdout, stderr) = ok(&run(&[
        "--demo",
        "--output",
        o,
        "--max-new-tokens",
        "8",
        "--no-progress",
    ]));
    assert!(stderr.contains("RANDOM WEIGHTS"), "{stderr}");
    assert!(stderr.contains("Qwen/Qwen3-VL-8B-Instruct"), "{stderr}");
    assert!(stdout.contains("12 call(s): 12 judged now"), "{stdout}");
    let report = read_json(&out.join("report.json"));
    assert_eq!(report["items"], 6);
    assert_eq!(report["categories"].as_array().unwrap().len(), 3);
    let (scored, failed, not_scored) = (
        report["items_scored"].as_u64().unwrap(),
        report["parse_failed"].as_u64().unwrap(),
        report["not_scored"].as_u64().unwrap(),
    );
    assert_eq!(scored + failed + not_scored, 6);
    assert_eq!(not_scored, 0);
    assert!(failed >= 5, "random weights should not parse: {report}");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        md.contains("## Per category") && md.contains("subject-add"),
        "{md}"
    );
    assert!(out.join("chart.png").is_file() && out.join("benchmark/benchmark.jsonl").is_file());
    let run_info = read_json(&out.join("run.json"));
    assert_eq!(run_info["calls_total"], 12);
    assert_eq!(run_info["calls_recorded"], 12);
    // Again: everything is recorded, nothing is judged, no model is loaded.
    let (stdout, stderr) = ok(&run(&["--demo", "--output", o, "--max-new-tokens", "8"]));
    assert!(stderr.contains("12 recorded, 0 to judge"), "{stderr}");
    assert!(!stderr.contains("judge loaded"), "{stderr}");
    assert!(stdout.contains("0 judged now, 12 resumed"), "{stdout}");
}

fn png_b64(img: &RgbImage) -> String {
    let mut bytes = std::io::Cursor::new(Vec::new());
    img.write_to(&mut bytes, image::ImageOutputFormat::Png)
        .unwrap();
    base64::engine::general_purpose::STANDARD.encode(bytes.into_inner())
}

#[test]
fn a_scorer_json_with_bad_items_lists_them_and_scores_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let edited = tmp.path().join("edited");
    let mut items = Vec::new();
    for (i, subset) in ["物理", "环境", "物理", "因果"].iter().enumerate() {
        let pair = format!("pair_{i}");
        items.push(json!({
            "subset": subset,
            "original_image_path": format!("images/{subset}/{pair}.png"),
            "src_img_b64": if i == 3 { "not base64 at all!".to_string() } else { png_b64(&picture(i as u32, false)) },
            "edit_instruction_en": format!("Make edit {i}."),
            "original_description_en": "A picture.",
            "tags": ["t"],
            "difficulty": "easy",
        }));
        // Item 2 has no edited image.
        if i != 2 {
            std::fs::create_dir_all(edited.join(subset)).unwrap();
            picture(i as u32, true)
                .save(edited.join(subset).join(format!("{pair}.png")))
                .unwrap();
        }
    }
    let bench = tmp.path().join("data.json");
    std::fs::write(&bench, serde_json::to_string_pretty(&items).unwrap()).unwrap();
    let out = tmp.path().join("out");
    let (b, e, o, m, p) = (
        bench.to_str().unwrap(),
        edited.to_str().unwrap(),
        out.to_str().unwrap(),
        tiny_judge(),
        viescore(),
    );
    let (_, stderr) = ok(&run(&[
        "--benchmark",
        b,
        "--format",
        "scorer-json",
        "--edited-dir",
        e,
        "--prompts",
        &p,
        "--model",
        &m,
        "--max-new-tokens",
        "8",
        "--no-progress",
        "--output",
        o,
    ]));
    assert!(stderr.contains("2 items loaded, 2 skipped"), "{stderr}");
    assert!(
        stderr.contains("skipped pair_2: item 3: no edited image"),
        "{stderr}"
    );
    assert!(
        stderr.contains("skipped pair_3: item 4: field src_img_b64 is not valid base64"),
        "{stderr}"
    );
    let info = read_json(&out.join("run.json"));
    assert_eq!(info["skipped"]["missing edited image"], 1);
    assert_eq!(info["skipped"]["bad base64"], 1);
    assert_eq!(info["items"], 2);
    assert_eq!(info["calls_total"], 4);
    assert_eq!(info["calls_recorded"], 4);
    let skipped = read_json(&out.join("skipped.json"));
    assert_eq!(skipped.as_array().unwrap().len(), 2);
    let report = read_json(&out.join("report.json"));
    assert_eq!(report["skipped_total"], 2);
    let ids: BTreeSet<String> = lines(&out.join("scores.jsonl"))
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, BTreeSet::from(["pair_0".into(), "pair_1".into()]));

    // The same file declared as a JSONL: every line is refused, and the message says to check
    // --format.
    let err = fails(&run(&[
        "--benchmark",
        b,
        "--format",
        "jsonl",
        "--prompts",
        &p,
        "--model",
        &m,
        "--output",
        tmp.path().join("out2").to_str().unwrap(),
    ]));
    assert!(err.contains("check --format"), "{err}");
    assert!(err.contains("data.json"), "{err}");
}

#[test]
fn gedit_bench_is_read_from_its_layout_with_the_edit_resized_to_the_source() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("fullset");
    let mut rows = String::new();
    for (i, (task, lang)) in [
        ("color_alter", "en"),
        ("subject-add", "en"),
        ("subject-add", "en"),
        ("color_alter", "cn"),
    ]
    .iter()
    .enumerate()
    {
        let key = format!("k{i}");
        let dir = root.join(task).join(lang);
        std::fs::create_dir_all(&dir).unwrap();
        picture(i as u32, false)
            .save(dir.join(format!("{key}_SRCIMG.png")))
            .unwrap();
        // The edit at another size (GEdit's scorer resizes it to the source's); item 2 has none.
        if i != 2 {
            image::imageops::resize(
                &picture(i as u32, true),
                40,
                40,
                image::imageops::FilterType::Nearest,
            )
            .save(dir.join(format!("{key}.png")))
            .unwrap();
        }
        rows.push_str(
            &json!({"task_type": task, "key": key, "instruction": format!("edit {i}"),
                    "instruction_language": lang})
            .to_string(),
        );
        rows.push('\n');
    }
    let rows_path = tmp.path().join("rows.jsonl");
    std::fs::write(&rows_path, rows).unwrap();
    let out = tmp.path().join("out");
    let (r, rp, o, m, p) = (
        root.display().to_string(),
        rows_path.display().to_string(),
        out.display().to_string(),
        tiny_judge(),
        viescore(),
    );
    let (_, stderr) = ok(&run(&[
        "--benchmark",
        &r,
        "--format",
        "gedit",
        "--gedit-rows",
        &rp,
        "--language",
        "en",
        "--prompts",
        &p,
        "--model",
        &m,
        "--max-new-tokens",
        "8",
        "--no-progress",
        "--output",
        &o,
    ]));
    assert!(stderr.contains("2 items loaded, 1 skipped"), "{stderr}");
    assert!(stderr.contains("skipped k2"), "{stderr}");
    let info = read_json(&out.join("run.json"));
    assert_eq!(info["resize_edited_to_source"], true);
    assert_eq!(info["calls_recorded"], 4);
    assert_eq!(
        info["items_by_category"],
        json!({"color_alter": 1, "subject-add": 1})
    );
}

#[test]
fn a_killed_run_resumes_without_losing_or_rescoring_anything() {
    let tmp = tempfile::tempdir().unwrap();
    let bench = jsonl_benchmark(&tmp.path().join("bench"), 16);
    let out = tmp.path().join("out");
    let (b, o, m, p) = (
        bench.to_str().unwrap(),
        out.to_str().unwrap(),
        tiny_judge(),
        viescore(),
    );
    let mut args = score_args(b, o);
    args.extend(["--prompts", &p, "--model", &m]);
    // Longer replies and one call per batch, so the kill lands mid-run.
    set(&mut args, "--max-new-tokens", "48");
    set(&mut args, "--batch-size", "1");
    let mut child = edit_score()
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let records = out.join("records.jsonl");
    let started = Instant::now();
    loop {
        let n = std::fs::read_to_string(&records)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if n >= 4 {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it could be killed"
        );
        assert!(started.elapsed() < Duration::from_secs(120), "no records");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let before = std::fs::read_to_string(&records).unwrap();
    // Whole lines written before the kill (a torn last line is repaired by the rerun).
    let complete: Vec<&str> = before
        .split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .collect();
    assert!(complete.len() < 32, "killed after the run finished");

    let (stdout, _) = ok(&run(&args));
    let info = read_json(&out.join("run.json"));
    assert_eq!(info["calls_total"], 32);
    assert_eq!(info["calls_recorded"], 32);
    let resumed = info["calls_resumed"].as_u64().unwrap() as usize;
    assert_eq!(resumed, complete.len(), "{stdout}");
    assert_eq!(
        info["calls_judged"].as_u64().unwrap() as usize,
        32 - resumed
    );
    let after = std::fs::read_to_string(&records).unwrap();
    assert!(
        after.starts_with(&complete.concat()),
        "the records written before the kill are kept as they were"
    );
    let keys: Vec<String> = lines(&records)
        .iter()
        .map(|r| r["key"].as_str().unwrap().to_string())
        .collect();
    let unique: BTreeSet<&String> = keys.iter().collect();
    assert_eq!(keys.len(), 32, "nothing judged twice");
    assert_eq!(unique.len(), 32);
}

#[test]
fn shards_merged_equal_one_run() {
    let tmp = tempfile::tempdir().unwrap();
    let bench = jsonl_benchmark(&tmp.path().join("bench"), 5);
    let b = bench.to_str().unwrap();
    let (m, p) = (tiny_judge(), viescore());
    let dir = |name: &str| tmp.path().join(name).display().to_string();
    let (whole, s0, s1, merged) = (dir("whole"), dir("s0"), dir("s1"), dir("merged"));
    let mut args = score_args(b, &whole);
    args.extend(["--prompts", &p, "--model", &m]);
    ok(&run(&args));
    for (out, index) in [(&s0, "0"), (&s1, "1")] {
        let mut a = score_args(b, out);
        a.extend([
            "--prompts",
            &p,
            "--model",
            &m,
            "--num-shards",
            "2",
            "--shard-index",
            index,
        ]);
        ok(&run(&a));
    }
    // A merge of one shard alone is refused, naming the missing one.
    let err = fails(&run(&["merge", "--output", &merged, &s0]));
    assert!(err.contains("shard(s) 1 of 2 are missing"), "{err}");
    let (stdout, _) = ok(&run(&["merge", "--output", &merged, &s0, &s1]));
    assert!(stdout.contains("5 item(s)"), "{stdout}");
    let whole_records = lines(&Path::new(&whole).join("scores.jsonl"));
    let merged_records = lines(&Path::new(&merged).join("scores.jsonl"));
    assert_eq!(whole_records.len(), 10);
    assert_eq!(
        whole_records.iter().map(content).collect::<Vec<_>>(),
        merged_records.iter().map(content).collect::<Vec<_>>()
    );
    let (a, b) = (
        read_json(&Path::new(&whole).join("report.json")),
        read_json(&Path::new(&merged).join("report.json")),
    );
    for field in ["categories", "overall", "items", "parse_failed", "model_id"] {
        assert_eq!(a[field], b[field], "{field}");
    }
    // `report` rebuilds it and prints the Markdown.
    let (stdout, _) = ok(&run(&["report", &merged]));
    assert!(stdout.contains("## Per category"), "{stdout}");
}

#[test]
fn two_judge_replicas_in_processes_share_the_queue_and_a_dead_one_hands_over() {
    let tmp = tempfile::tempdir().unwrap();
    let bench = jsonl_benchmark(&tmp.path().join("bench"), 6);
    let b = bench.to_str().unwrap();
    let (m, p) = (tiny_judge(), viescore());
    let dir = |name: &str| tmp.path().join(name).display().to_string();
    let (one, two, dead) = (dir("one"), dir("two"), dir("dead"));
    let mut args = score_args(b, &one);
    args.extend(["--prompts", &p, "--model", &m]);
    set(&mut args, "--batch-size", "1");
    ok(&run(&args));

    let with = |out: &str, exit_after: Option<&str>| {
        let mut a = score_args(b, out);
        a.extend(["--prompts", &p, "--model", &m, "--cpu-replicas", "2"]);
        set(&mut a, "--batch-size", "1");
        let mut c = edit_score();
        c.args(&a).env("FLEET_REPLICA_PROCESSES", "1");
        if let Some(n) = exit_after {
            c.env("FLEET_REPLICA_EXIT_AFTER", n);
        }
        c.output().unwrap()
    };
    let (_, stderr) = ok(&with(&two, None));
    assert!(stderr.contains("2 replica(s): cpu, cpu (pid "), "{stderr}");
    let info = read_json(&Path::new(&two).join("run.json"));
    let workers = info["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2);
    let done: Vec<u64> = workers
        .iter()
        .map(|w| w["batches_done"].as_u64().unwrap())
        .collect();
    assert_eq!(done.iter().sum::<u64>(), 12);
    assert!(
        done.iter().all(|&d| d > 0),
        "both replicas judged: {done:?}"
    );
    let records = |d: &str| {
        lines(&Path::new(d).join("scores.jsonl"))
            .iter()
            .map(content)
            .collect::<Vec<_>>()
    };
    assert_eq!(records(&one), records(&two), "two replicas judge as one");

    // The replica process dies on its first batch: the other judges everything, and the
    // failure is reported.
    let (_, stderr) = ok(&with(&dead, Some("0")));
    assert!(stderr.contains("stopped after 0 batch(es)"), "{stderr}");
    let info = read_json(&Path::new(&dead).join("run.json"));
    assert_eq!(info["calls_recorded"], 12);
    assert!(info["failed"].as_array().unwrap().is_empty());
    let w1 = &info["workers"][1];
    assert!(w1["stopped"].as_str().unwrap().contains("stopped"), "{w1}");
    assert_eq!(info["workers"][0]["batches_done"], 12);
    assert_eq!(records(&one), records(&dead));
}

#[test]
fn an_unknown_placeholder_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let bench = jsonl_benchmark(&tmp.path().join("bench"), 2);
    let prompts = tmp.path().join("mine.toml");
    std::fs::write(
        &prompts,
        "name = \"mine\"\nversion = 1\nscheme = \"single\"\n[calls.score.templates.default]\n\
         user = \"Does {edited_caption} follow {instruction}? Reply `Score: X`.\"\n",
    )
    .unwrap();
    let out = tmp.path().join("out");
    let mut args = score_args(bench.to_str().unwrap(), out.to_str().unwrap());
    let (p, m) = (prompts.display().to_string(), tiny_judge());
    args.extend(["--prompts", &p, "--model", &m]);
    let err = fails(&run(&args));
    assert!(err.contains("{edited_caption}"), "{err}");
    assert!(err.contains("mine.toml"), "{err}");
    assert!(err.contains("calls.score.templates.default.user"), "{err}");
    assert!(!out.join("records.jsonl").exists());
}

#[test]
fn a_text_only_checkpoint_is_refused_as_judge() {
    let tmp = tempfile::tempdir().unwrap();
    let bench = jsonl_benchmark(&tmp.path().join("bench"), 2);
    let out = tmp.path().join("out");
    let mut args = score_args(bench.to_str().unwrap(), out.to_str().unwrap());
    let text_model = repo()
        .join("tests/fixtures/qwen3-tiny")
        .display()
        .to_string();
    let p = viescore();
    args.extend(["--prompts", &p, "--model", &text_model]);
    let err = fails(&run(&args));
    assert!(err.contains("cannot be the judge"), "{err}");
    assert!(err.contains("qwen3_vl"), "{err}");
    assert!(err.contains("model_type=qwen3"), "{err}");
    assert!(!out.join("records.jsonl").exists());
}

#[test]
fn missing_flags_and_sampling_flags_without_sampling_are_explained() {
    let err = fails(&run(&["--format", "jsonl"]));
    assert!(
        err.contains("--benchmark") && err.contains("--demo"),
        "{err}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let bench = jsonl_benchmark(&tmp.path().join("bench"), 2);
    let out = tmp.path().join("out");
    let mut args = score_args(bench.to_str().unwrap(), out.to_str().unwrap());
    let (p, m) = (viescore(), tiny_judge());
    args.extend(["--prompts", &p, "--model", &m, "--temperature", "0.7"]);
    let err = fails(&run(&args));
    assert!(err.contains("--do-sample"), "{err}");
    // Decode slots for left-padded batches: refused, both flags named.
    let mut args = score_args(bench.to_str().unwrap(), out.to_str().unwrap());
    args.extend(["--prompts", &p, "--model", &m]);
    args.extend(["--batching", "static", "--max-num-seqs", "4"]);
    let err = fails(&run(&args));
    assert!(
        err.contains("--max-num-seqs 4") && err.contains("--batching"),
        "{err}"
    );
}

/// Issue 23: items that pass a header check but can never be judged — a PNG cut short, an
/// instruction beyond the judge's context, a line that is not UTF-8 — are skipped when the
/// benchmark is loaded, listed in skipped.json and counted in the report, and the run succeeds
/// (they made every run exit 1 with "run the same command again"); a rerun has nothing to do.
#[test]
fn items_that_can_never_be_judged_are_skipped_up_front_and_the_run_succeeds() {
    let tmp = tempfile::tempdir().unwrap();
    let bench = jsonl_benchmark(&tmp.path().join("bench"), 2);
    let dir = bench.parent().unwrap();
    // A PNG whose header reads but whose data is cut short.
    let whole = std::fs::read(dir.join("img/1_edit.png")).unwrap();
    std::fs::write(dir.join("img/cut.png"), &whole[..whole.len() * 6 / 10]).unwrap();
    let mut text = std::fs::read(&bench).unwrap();
    let item = |id: &str, instruction: &str, edited: &str| {
        json!({"id": id, "category": "color_alter", "instruction": instruction,
               "source": "img/0_src.png", "edited": edited})
        .to_string()
    };
    text.extend_from_slice(item("cut", "Add a red line.", "img/cut.png").as_bytes());
    text.push(b'\n');
    let long = "paint the sky a deep red ".repeat(600);
    text.extend_from_slice(item("long", long.trim(), "img/0_edit.png").as_bytes());
    text.push(b'\n');
    text.extend_from_slice(b"{\"id\": \"bad\xff\"}\n");
    std::fs::write(&bench, text).unwrap();

    let out = tmp.path().join("out");
    let (b, o) = (bench.to_str().unwrap(), out.to_str().unwrap());
    let prompts = viescore();
    let judge = tiny_judge();
    let mut args = score_args(b, o);
    // transformers' name for the flag (--output stays an alias).
    let i = args.iter().position(|a| *a == "--output").unwrap();
    args[i] = "--output-dir";
    args.extend(["--prompts", &prompts, "--model", &judge]);
    let (_, stderr) = ok(&run(&args));
    assert!(
        stderr.contains("1 item(s) too long for the judge"),
        "{stderr}"
    );
    let skipped = read_json(&out.join("skipped.json"));
    let kinds: BTreeSet<(String, String)> = skipped
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap().to_string(),
                s["kind"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let expected: BTreeSet<(String, String)> = [
        ("cut", "unreadable image"),
        ("long", "prompt too long"),
        ("line 5", "not UTF-8"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(kinds, expected);
    let report = read_json(&out.join("report.json"));
    assert_eq!(report["skipped_total"], 3);
    assert_eq!(report["items"], 2);
    assert_eq!(report["judge_failed"], 0);
    // Two calls (SC, PQ) for each of the two good items.
    assert_eq!(lines(&out.join("records.jsonl")).len(), 4);
    // Again: nothing to judge, nothing fails.
    let (_, stderr) = ok(&run(&args));
    assert!(stderr.contains("4 recorded, 0 to judge"), "{stderr}");
}
