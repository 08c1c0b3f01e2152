//! The whole scoring loop with a scripted test double on small generated benchmarks: records,
//! resume after a kill, changed images, parse failures and retries, reports checked against
//! hand-computed numbers, prompt sets refused, a pool with a failing judge, shards + merge.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::*;
use fleet_dist::ShardSpec;
use fleet_judge::judge::Sampling;
use fleet_judge::prompts::{PromptError, PromptSet};
use fleet_judge::records::{
    merge_shards, read_records, MergeOptions, Record, RecordsError, RunInfo, RECORDS_FILE,
    RUN_FILE, SCORES_FILE,
};
use fleet_judge::report::Report;
use fleet_judge::run::{RunError, RunOptions, Session, SessionOptions};
use fleet_runs::RunDirState;

const MODEL: &str = "test/scripted@0";

fn ok(s: &str) -> Result<String, String> {
    Ok(s.to_string())
}

/// Categories A: items 1, 2, 3 (3 does not parse); B: items 4, 5, 6.
fn single_items() -> Vec<GenItem> {
    vec![
        GenItem {
            n: 1,
            category: "A",
        },
        GenItem {
            n: 2,
            category: "A",
        },
        GenItem {
            n: 3,
            category: "A",
        },
        GenItem {
            n: 4,
            category: "B",
        },
        GenItem {
            n: 5,
            category: "B",
        },
        GenItem {
            n: 6,
            category: "B",
        },
    ]
}

fn single_table() -> Table {
    let mut t = Table::new();
    t.insert((1, "score", false), ok("Score: 6"));
    t.insert(
        (2, "score", false),
        ok("**Score: 8.0**\nThe edit is clean."),
    );
    t.insert(
        (3, "score", false),
        ok("I think the edit is fine, maybe 7 or 8."),
    );
    t.insert((4, "score", false), ok("Score: 5"));
    t.insert((5, "score", false), ok("Score: 9"));
    t.insert((6, "score", false), ok("Score: 10.000"));
    t
}

fn quiet(batch_size: usize) -> RunOptions {
    RunOptions {
        batch_size,
        progress: false,
        ..RunOptions::default()
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

/// Runs `judges` over the benchmark in `bench` into `out`.
fn run_once(
    bench: &Path,
    out: &Path,
    prompts: &PromptSet,
    judges: Vec<Scripted>,
    shard: ShardSpec,
    batch: usize,
) -> RunInfo {
    let loaded = load(bench);
    let session = Session::open(
        out,
        spec(prompts.clone(), MODEL),
        &SessionOptions::default(),
    )
    .unwrap();
    let plan = session.plan(&loaded, shard).unwrap();
    session.run(judges, &plan, &quiet(batch)).unwrap()
}

fn scripted(table: &Arc<Table>, seen: &Arc<Mutex<Vec<Seen>>>) -> Scripted {
    Scripted::new("judge", MODEL, table.clone(), seen.clone())
}

/// Records without what differs between runs (timings, workers).
fn comparable(records: &[Record]) -> Vec<serde_json::Value> {
    records
        .iter()
        .map(|r| {
            let mut v = serde_json::to_value(r).unwrap();
            v.as_object_mut().unwrap().remove("timing");
            v
        })
        .collect()
}

#[test]
fn the_loop_records_every_call_and_the_report_matches_hand_computed_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let bench = dir.path().join("bench");
    write_benchmark(&bench, &single_items());
    let prompts = prompt_set(dir.path(), "single.toml", SINGLE_SET);
    let table = Arc::new(single_table());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let out = dir.path().join("out");
    let info = run_once(
        &bench,
        &out,
        &prompts,
        vec![scripted(&table, &seen)],
        ShardSpec::single(),
        4,
    );
    assert_eq!(info.calls_total, 6);
    assert_eq!(info.calls_recorded, 6);
    assert_eq!(info.calls_judged, 6);
    assert_eq!(info.calls_resumed, 0);
    assert_eq!(info.parse_failed_now, 1);
    assert!(info.failed.is_empty(), "{:?}", info.failed);
    assert!(info.complete());

    // What the judge saw: source then edited, the system and user texts filled in; batches of
    // at most 4; greedy.
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 6);
    let first = seen.iter().find(|s| s.item == 1).unwrap();
    assert_eq!(first.images, vec![(6, 4), (4, 4)]);
    assert_eq!(first.system.as_deref(), Some("You judge edits in A."));
    assert_eq!(
        first.text,
        "Judge this edit: edit number 1. Reply `Score: X`."
    );
    assert!(first.decoding.sampling.is_none());

    // Records: one per call, the parse failure with its raw reply and no score.
    let (records, bad) = read_records(&out.join(SCORES_FILE)).unwrap();
    assert!(bad.is_empty());
    assert_eq!(records.len(), 6);
    let idx: Vec<u64> = records.iter().map(|r| r.index).collect();
    assert_eq!(idx, vec![0, 1, 2, 3, 4, 5]);
    let r3 = &records[2];
    assert_eq!(r3.id, "pair-3");
    assert_eq!(r3.score, None);
    assert_eq!(r3.raw, "I think the edit is fine, maybe 7 or 8.");
    assert!(r3
        .parse_failed
        .as_deref()
        .unwrap()
        .contains("no `Score: X`"));
    assert_eq!(records[1].score, Some(8.0));
    assert_eq!(records[1].model_id, MODEL);
    assert_eq!(records[1].prompt_set.hash, prompts.hash());
    assert_eq!(records[1].timing.batch_size, 4);
    assert_eq!(lines(&out.join(RECORDS_FILE)).len(), 6);

    // The report, by hand: A = {6, 8} (item 3 left out), B = {5, 9, 10}.
    let report = Report::from_dir(&out, "abc123").unwrap();
    let a = report.category("A").unwrap();
    let s = &a.stats["score"];
    assert_eq!(
        (s.n, s.mean, s.std, s.median, s.min, s.max),
        (2, 7.0, 1.0, 7.0, 6.0, 8.0)
    );
    assert_eq!((a.items, a.parse_failed, a.not_scored), (3, 1, 0));
    let b = report.category("B").unwrap();
    let s = &b.stats["score"];
    assert_eq!(
        (s.n, s.mean, s.median, s.min, s.max),
        (3, 8.0, 9.0, 5.0, 10.0)
    );
    assert!(close(s.std, (14.0f64 / 3.0).sqrt()), "{}", s.std);
    assert_eq!(b.parse_failed, 0);
    let overall = report.overall("score").unwrap();
    let pooled = overall.pooled.as_ref().unwrap();
    assert_eq!(pooled.n, 5);
    assert!(close(pooled.mean, 7.6));
    assert!(close(pooled.std, (3.44f64).sqrt()), "{}", pooled.std);
    assert_eq!(pooled.median, 8.0);
    assert!(close(overall.mean_of_category_means.unwrap(), 7.5));
    assert_eq!(report.best.as_ref().unwrap().category, "B");
    assert_eq!(report.worst.as_ref().unwrap().category, "A");
    assert_eq!(
        (report.items, report.items_scored, report.parse_failed),
        (6, 5, 1)
    );
    assert_eq!(report.commit, "abc123");
    assert_eq!(report.model_id, MODEL);

    let written = report.write(&out).unwrap();
    assert_eq!(written.len(), 4);
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        md.contains("| A | 2 | 7.000 | 1.000 | 7.000 | 6.000 | 8.000 | 1 | 0 |"),
        "{md}"
    );
    assert!(md.contains("| score | 5 | 7.600 |"), "{md}");
    assert!(
        md.contains("Best category by mean score: **B** (8.000); worst: **A** (7.000)."),
        "{md}"
    );
    assert!(md.contains("population"), "{md}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["categories"][0]["stats"]["score"]["mean"], 7.0);
    let png = std::fs::read(out.join("chart.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let svg = std::fs::read_to_string(out.join("chart.svg")).unwrap();
    assert!(
        svg.contains("n=3") && svg.contains("n=2"),
        "labels in the svg"
    );
}

#[test]
fn a_kill_mid_record_loses_only_that_record_and_the_rerun_finishes_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let bench = dir.path().join("bench");
    write_benchmark(&bench, &single_items());
    let prompts = prompt_set(dir.path(), "single.toml", SINGLE_SET);
    let table = Arc::new(single_table());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let out = dir.path().join("out");
    run_once(
        &bench,
        &out,
        &prompts,
        vec![scripted(&table, &seen)],
        ShardSpec::single(),
        2,
    );
    let (full, _) = read_records(&out.join(SCORES_FILE)).unwrap();

    // A kill while the fourth record was being written: three whole lines and half of one.
    let log = out.join(RECORDS_FILE);
    let text = std::fs::read_to_string(&log).unwrap();
    let kept: Vec<&str> = text.lines().take(4).collect();
    let torn = format!(
        "{}\n{}",
        kept[..3].join("\n"),
        &kept[3][..kept[3].len() / 2]
    );
    std::fs::write(&log, torn).unwrap();
    std::fs::remove_file(out.join(SCORES_FILE)).unwrap();
    std::fs::remove_file(out.join(RUN_FILE)).unwrap();

    let seen2 = Arc::new(Mutex::new(Vec::new()));
    let loaded = load(&bench);
    let session = Session::open(
        &out,
        spec(prompts.clone(), MODEL),
        &SessionOptions::default(),
    )
    .unwrap();
    assert_eq!(session.state(), &RunDirState::Resumed);
    assert_eq!(session.opened.records, 3);
    assert!(
        session.opened.repair.is_some(),
        "the torn line was repaired"
    );
    let plan = session.plan(&loaded, ShardSpec::single()).unwrap();
    let info = session
        .run(vec![scripted(&table, &seen2)], &plan, &quiet(2))
        .unwrap();
    assert_eq!(info.calls_resumed, 3);
    assert_eq!(info.calls_judged, 3);
    let judged: Vec<u8> = seen2.lock().unwrap().iter().map(|s| s.item).collect();
    assert_eq!(judged, vec![4, 5, 6]);
    let (again, _) = read_records(&out.join(SCORES_FILE)).unwrap();
    assert_eq!(comparable(&again), comparable(&full));
    assert_eq!(lines(&log).len(), 6);
    drop(session);

    // A third run judges nothing.
    let seen3 = Arc::new(Mutex::new(Vec::new()));
    let info = run_once(
        &bench,
        &out,
        &prompts,
        vec![scripted(&table, &seen3)],
        ShardSpec::single(),
        2,
    );
    assert_eq!((info.calls_resumed, info.calls_judged), (6, 0));
    assert!(seen3.lock().unwrap().is_empty());
}

#[test]
fn a_changed_image_or_instruction_is_rescored_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let bench = dir.path().join("bench");
    write_benchmark(&bench, &single_items());
    let prompts = prompt_set(dir.path(), "single.toml", SINGLE_SET);
    let mut t = single_table();
    let table = Arc::new(t.clone());
    let out = dir.path().join("out");
    let seen = Arc::new(Mutex::new(Vec::new()));
    run_once(
        &bench,
        &out,
        &prompts,
        vec![scripted(&table, &seen)],
        ShardSpec::single(),
        4,
    );

    change_edit(&bench, 5, 1);
    t.insert((5, "score", false), ok("Score: 3"));
    let table = Arc::new(t);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let info = run_once(
        &bench,
        &out,
        &prompts,
        vec![scripted(&table, &seen)],
        ShardSpec::single(),
        4,
    );
    let judged: Vec<(u8, u8)> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| (s.item, s.version))
        .collect();
    assert_eq!(
        judged,
        vec![(5, 1)],
        "only the changed edit is judged, in its new version"
    );
    assert_eq!((info.calls_resumed, info.calls_judged), (5, 1));
    assert_eq!(
        lines(&out.join(RECORDS_FILE)).len(),
        7,
        "the old record stays in the log"
    );
    let (records, _) = read_records(&out.join(SCORES_FILE)).unwrap();
    assert_eq!(
        records.len(),
        6,
        "scores.jsonl holds the current records only"
    );
    assert_eq!(records[4].score, Some(3.0));
    let report = Report::from_dir(&out, "c").unwrap();
    assert_eq!(report.category("B").unwrap().stats["score"].mean, 6.0);

    // An edited instruction changes the prompt, so that item is rescored too.
    let jsonl = bench.join("bench.jsonl");
    let text = std::fs::read_to_string(&jsonl)
        .unwrap()
        .replace("edit number 2\"", "edit number 2, carefully\"");
    std::fs::write(&jsonl, text).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let info = run_once(
        &bench,
        &out,
        &prompts,
        vec![scripted(&table, &seen)],
        ShardSpec::single(),
        4,
    );
    assert_eq!(info.calls_judged, 1);
    assert_eq!(seen.lock().unwrap()[0].item, 2);
}

#[test]
fn an_image_changed_after_the_plan_fails_its_calls_and_the_batch_goes_on() {
    // VIEScore (two calls an item, sharing its pair) and the whole benchmark in one batch, so
    // that the changed pair is loaded once for both its calls, beside the others (a batch
    // loads its items in parallel): both its calls are recorded as failed, naming the file,
    // and every other call is judged.
    let dir = tempfile::tempdir().unwrap();
    let bench = dir.path().join("bench");
    let items: Vec<GenItem> = (1..=4)
        .map(|n| GenItem {
            n,
            category: "color_alter",
        })
        .collect();
    write_benchmark(&bench, &items);
    let prompts = prompt_set(dir.path(), "vie.toml", VIE_SET);
    let mut t = Table::new();
    for n in 1..=4 {
        t.insert((n, "sc", false), ok("{\"score\": [7, 8]}"));
        t.insert((n, "pq", false), ok("{\"score\": [6, 9]}"));
    }
    let table = Arc::new(t);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let out = dir.path().join("out");
    let loaded = load(&bench);
    let session = Session::open(&out, spec(prompts, MODEL), &SessionOptions::default()).unwrap();
    let plan = session.plan(&loaded, ShardSpec::single()).unwrap();
    change_edit(&bench, 3, 1);
    let info = session
        .run(vec![scripted(&table, &seen)], &plan, &quiet(8))
        .unwrap();
    let mut judged: Vec<(u8, String)> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| (s.item, s.call.to_string()))
        .collect();
    judged.sort();
    let want: Vec<(u8, String)> = [1, 2, 4]
        .into_iter()
        .flat_map(|n| [(n, "pq".to_string()), (n, "sc".to_string())])
        .collect();
    assert_eq!(judged, want, "every call of an unchanged item is judged");
    assert_eq!(info.calls_judged, 6);
    let (records, _) = read_records(&out.join(RECORDS_FILE)).unwrap();
    let failed: Vec<&Record> = records.iter().filter(|r| r.failed.is_some()).collect();
    assert_eq!(failed.len(), 2, "both calls of the changed item");
    for r in &failed {
        let why = r.failed.as_deref().unwrap();
        assert!(
            why.contains("the edited image") && why.contains("edit/3.png"),
            "{why}"
        );
        assert!(why.contains("changed since the run was planned"), "{why}");
        assert_eq!(r.score, None);
    }
}

#[test]
fn a_retry_uses_the_fixed_seed_and_is_recorded_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let bench = dir.path().join("bench");
    write_benchmark(&bench, &single_items()[..3]);
    let prompts = prompt_set(dir.path(), "single.toml", SINGLE_SET);
    let mut t = single_table();
    // Item 3 parses when sampled; item 2 never parses.
    t.insert((3, "score", true), ok("Score: 4"));
    t.insert((2, "score", false), ok("Score: twelve"));
    t.insert((2, "score", true), ok("Score: 12"));
    let table = Arc::new(t);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let retry = Sampling {
        temperature: 0.7,
        top_p: Some(0.8),
        top_k: Some(20),
        seed: 1234,
        sampler_version: fleet_models::ops::SAMPLER_VERSION,
    };
    let mut sp = spec(prompts, MODEL);
    sp.retry = Some(retry);
    let out = dir.path().join("out");
    let loaded = load(&bench);
    let session = Session::open(&out, sp, &SessionOptions::default()).unwrap();
    let plan = session.plan(&loaded, ShardSpec::single()).unwrap();
    let info = session
        .run(vec![scripted(&table, &seen)], &plan, &quiet(3))
        .unwrap();
    assert_eq!((info.retried_now, info.parse_failed_now), (2, 1));
    let retried: Vec<(u8, u64)> = seen
        .lock()
        .unwrap()
        .iter()
        .filter_map(|s| s.decoding.sampling.map(|d| (s.item, d.seed)))
        .collect();
    assert_eq!(retried, vec![(2, 1234), (3, 1234)]);
    let (records, _) = read_records(&out.join(SCORES_FILE)).unwrap();
    let r3 = &records[2];
    assert_eq!(r3.score, Some(4.0));
    let info3 = r3.retry.as_ref().unwrap();
    assert_eq!(info3.sampling, retry);
    assert_eq!(info3.first.raw, "I think the edit is fine, maybe 7 or 8.");
    assert!(
        r3.decoding.sampling.is_none(),
        "the run's decoding stays greedy"
    );
    let r2 = &records[1];
    assert_eq!(r2.score, None);
    assert!(r2
        .parse_failed
        .as_deref()
        .unwrap()
        .contains("12 is outside [0, 10]"));
    assert_eq!(r2.raw, "Score: 12");
    assert_eq!(r2.retry.as_ref().unwrap().first.raw, "Score: twelve");
    let report = Report::from_dir(&out, "c").unwrap();
    let a = report.category("A").unwrap();
    assert_eq!(a.stats["score"].n, 2);
    assert_eq!(a.stats["score"].mean, 5.0);
    assert_eq!((a.parse_failed, a.retried), (1, 2));
}

#[test]
fn viescore_sends_sc_and_pq_and_reports_sc_pq_and_o() {
    let dir = tempfile::tempdir().unwrap();
    let bench = dir.path().join("bench");
    write_benchmark(
        &bench,
        &[
            GenItem {
                n: 1,
                category: "color_alter",
            },
            GenItem {
                n: 2,
                category: "color_alter",
            },
            GenItem {
                n: 3,
                category: "color_alter",
            },
        ],
    );
    let prompts = prompt_set(dir.path(), "vie.toml", VIE_SET);
    let mut t = Table::new();
    t.insert(
        (1, "sc", false),
        ok("```json\n{\"score\": [7, 9], \"reasoning\": \"ok\"}\n```"),
    );
    t.insert(
        (1, "pq", false),
        ok("{\"score\": [8, 6], \"reasoning\": \"ok\"}"),
    );
    t.insert(
        (2, "sc", false),
        ok("{\"score\": [4, 4], \"reasoning\": \"meh\"}"),
    );
    t.insert(
        (2, "pq", false),
        ok("{\"score\": [9, 9], \"reasoning\": \"fine\"}"),
    );
    t.insert((3, "sc", false), ok("[6, 0]"));
    t.insert(
        (3, "pq", false),
        ok("{\"score\": [5, 5], \"reasoning\": \"x\"}"),
    );
    let table = Arc::new(t);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut sp = spec(prompts, MODEL);
    sp.resize_edited_to_source = true;
    let out = dir.path().join("out");
    let loaded = load(&bench);
    let session = Session::open(&out, sp, &SessionOptions::default()).unwrap();
    let plan = session.plan(&loaded, ShardSpec::single()).unwrap();
    assert_eq!(plan.tasks.len(), 6);
    let info = session
        .run(vec![scripted(&table, &seen)], &plan, &quiet(4))
        .unwrap();
    assert_eq!(info.calls_recorded, 6);
    assert_eq!(info.parse_failed_now, 1);
    for s in seen.lock().unwrap().iter() {
        match s.call {
            // Source, then the edit resized to the source's size (GEdit-Bench).
            "sc" => {
                assert_eq!(s.images, vec![(6, 4), (6, 4)]);
                assert!(s.text.contains(&format!("edit number {}", s.item)));
            }
            "pq" => assert_eq!(s.images, vec![(6, 4)]),
            other => panic!("unexpected call {other}"),
        }
        assert!(s.system.is_none());
    }
    let report = Report::from_dir(&out, "c").unwrap();
    assert_eq!(report.metrics, vec!["SC", "PQ", "O"]);
    let c = report.category("color_alter").unwrap();
    // SC: min[7,9]=7, min[4,4]=4 (item 3's SC did not parse); PQ: 6, 9, 5; O: sqrt(42), 6.
    assert_eq!((c.stats["SC"].n, c.stats["SC"].mean), (2, 5.5));
    assert_eq!(c.stats["PQ"].n, 3);
    assert!(close(c.stats["PQ"].mean, 20.0 / 3.0));
    assert_eq!(c.stats["O"].n, 2);
    assert!(close(c.stats["O"].mean, (42f64.sqrt() + 6.0) / 2.0));
    assert!(close(c.stats["O"].min, 6.0));
    assert_eq!(c.parse_failed, 1);
    assert_eq!(c.parse_failed_calls.get("sc"), Some(&1));
    assert_eq!(c.parse_failed_calls.get("pq"), None);
    assert_eq!(report.primary, "O");
    assert_eq!(report.items_scored, 2);
    report.write(&out).unwrap();
    // Issue 23: the chart draws SC, PQ and O, and its title says so (not only the primary O).
    let svg = std::fs::read_to_string(out.join("chart.svg")).unwrap();
    assert!(
        svg.contains("mean SC, PQ and O per category"),
        "title in the svg"
    );
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| color_alter | 2 | 5.500 |"), "{md}");
    assert!(md.contains("| 1 (1/0) | 0 |"), "{md}");
}

#[test]
fn the_original_rubrics_send_only_the_edit_with_the_category_rubric() {
    use base64::Engine as _;
    let dir = tempfile::tempdir().unwrap();
    let edited = dir.path().join("edited");
    write_png(&edited.join("物理").join("p1.png"), 4, 4, [1, 0, 0]);
    write_png(&edited.join("指代").join("p2.png"), 4, 4, [2, 0, 0]);
    write_png(&dir.path().join("src.png"), 6, 4, [9, 9, 9]);
    let src = base64::engine::general_purpose::STANDARD
        .encode(std::fs::read(dir.path().join("src.png")).unwrap());
    let item = |subset: &str, path: &str| {
        serde_json::json!({
            "subset": subset, "original_description_en": "a red car",
            "edit_instruction_en": "make the car blue", "src_img_b64": src,
            "original_image_path": path,
        })
    };
    let json = dir.path().join("bench.json");
    std::fs::write(
        &json,
        serde_json::json!([item("物理", "imgs/p1.png"), item("指代", "imgs/p2.png")]).to_string(),
    )
    .unwrap();
    let loaded = fleet_judge::benchmark::load_scorer_json(&json, &edited, None).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/judge");
    let prompts = PromptSet::load(&root.join("original-rubrics.toml")).unwrap();
    let mut t = Table::new();
    t.insert((1, "score", false), ok("**Score: 7.5**"));
    t.insert((2, "score", false), ok("评分：6"));
    let table = Arc::new(t);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let out = dir.path().join("out");
    let session = Session::open(&out, spec(prompts, MODEL), &SessionOptions::default()).unwrap();
    let plan = session.plan(&loaded, ShardSpec::single()).unwrap();
    session
        .run(vec![scripted(&table, &seen)], &plan, &quiet(2))
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0].images, vec![(4, 4)], "only the edited image");
    let system = seen[0].system.as_deref().unwrap();
    assert!(
        system.contains("Physical & Geometric Consistency"),
        "{system}"
    );
    assert!(seen[1].system.as_deref().unwrap().contains("Referential"));
    assert!(seen[0]
        .text
        .contains("- Original Description: a red car\n- Edit Instruction: make the car blue\n"));
    let report = Report::from_dir(&out, "c").unwrap();
    let phys = report.category("物理").unwrap();
    assert_eq!(phys.label, "物理 (physical)");
    assert_eq!(phys.chart_label, "physical");
    assert_eq!(phys.stats["score"].mean, 7.5);
    // A Chinese label is not `Score:` unless the set lists it.
    assert_eq!(report.category("指代").unwrap().parse_failed, 1);
    report.write(&out).unwrap();
}

#[test]
fn prompt_sets_with_unknown_placeholders_or_unfillable_ones_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("typo.toml");
    std::fs::write(&path, SINGLE_SET.replace("{instruction}", "{instrucion}")).unwrap();
    let err = PromptSet::load(&path).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, PromptError::UnknownPlaceholder { .. }),
        "{msg}"
    );
    assert!(msg.contains("typo.toml"), "{msg}");
    assert!(msg.contains("calls.score.templates.default.user"), "{msg}");
    assert!(msg.contains("{instrucion}"), "{msg}");

    // {description}: plain JSONL items have none, so the run is refused before judging.
    let bench = dir.path().join("bench");
    write_benchmark(&bench, &single_items()[..1]);
    let prompts = prompt_set(
        dir.path(),
        "desc.toml",
        &SINGLE_SET.replace("Judge this edit", "Given {description}, judge"),
    );
    let loaded = load(&bench);
    let session = Session::open(
        &dir.path().join("out"),
        spec(prompts, MODEL),
        &SessionOptions::default(),
    )
    .unwrap();
    let err = session.plan(&loaded, ShardSpec::single()).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, RunError::Prompt(e) if matches!(**e, PromptError::Unfillable { .. })),
        "{msg}"
    );
    assert!(
        msg.contains("{description}") && msg.contains("pair-1"),
        "{msg}"
    );
}

#[test]
fn a_resume_with_another_model_is_refused_and_overwrite_starts_over() {
    let dir = tempfile::tempdir().unwrap();
    let bench = dir.path().join("bench");
    write_benchmark(&bench, &single_items()[..2]);
    let prompts = prompt_set(dir.path(), "single.toml", SINGLE_SET);
    let table = Arc::new(single_table());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let out = dir.path().join("out");
    run_once(
        &bench,
        &out,
        &prompts,
        vec![scripted(&table, &seen)],
        ShardSpec::single(),
        2,
    );
    let err = Session::open(
        &out,
        spec(prompts.clone(), "other/model@1"),
        &SessionOptions::default(),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("model_id") && msg.contains("--overwrite"),
        "{msg}"
    );
    let session = Session::open(
        &out,
        spec(prompts.clone(), "other/model@1"),
        &SessionOptions {
            overwrite: true,
            ..SessionOptions::default()
        },
    )
    .unwrap();
    assert!(matches!(session.state(), RunDirState::Overwritten { .. }));
    assert!(session.store().is_empty());
    drop(session);
    // Settings that cannot work are refused with the field.
    let mut bad = spec(prompts.clone(), MODEL);
    bad.retry = Some(Sampling {
        temperature: 0.0,
        top_p: None,
        top_k: None,
        seed: 1,
        sampler_version: fleet_models::ops::SAMPLER_VERSION,
    });
    let err = Session::open(&dir.path().join("o2"), bad, &SessionOptions::default()).unwrap_err();
    assert!(err.to_string().contains("retry.temperature = 0"), "{err}");
    let mut bad = spec(prompts.clone(), MODEL);
    bad.decoding.max_new_tokens = 0;
    let err = Session::open(&dir.path().join("o2"), bad, &SessionOptions::default()).unwrap_err();
    assert!(err.to_string().contains("decoding.max_new_tokens"), "{err}");
    let session = Session::open(
        &out,
        spec(prompts.clone(), "other/model@1"),
        &SessionOptions::default(),
    )
    .unwrap();
    // A judge that reports another model than the session's is refused.
    let loaded = load(&bench);
    let plan = session.plan(&loaded, ShardSpec::single()).unwrap();
    let err = session
        .run(vec![scripted(&table, &seen)], &plan, &quiet(2))
        .unwrap_err();
    assert!(matches!(err, RunError::ModelMismatch { .. }), "{err}");
}

#[test]
fn a_failing_judge_in_a_pool_hands_its_batches_to_the_other_and_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let bench = dir.path().join("bench");
    write_benchmark(&bench, &single_items());
    let prompts = prompt_set(dir.path(), "single.toml", SINGLE_SET);
    let table = Arc::new(single_table());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut broken = Scripted::new("broken", MODEL, table.clone(), seen.clone());
    broken.fail_all = true;
    let mut good = Scripted::new("good", MODEL, table.clone(), seen.clone());
    // The good replica starts only once the broken one has failed a batch: otherwise it
    // may take all six before the broken one asks for any.
    good.wait_for = Some(broken.failed.clone());
    let loaded = load(&bench);
    let out = dir.path().join("out");
    let session = Session::open(&out, spec(prompts, MODEL), &SessionOptions::default()).unwrap();
    let plan = session.plan(&loaded, ShardSpec::single()).unwrap();
    let options = RunOptions {
        worker_names: Some(vec!["GPU 0".into(), "GPU 1".into()]),
        ..quiet(1)
    };
    let info = session.run(vec![broken, good], &plan, &options).unwrap();
    assert!(info.complete(), "every call recorded: {:?}", info.failed);
    assert!(info.failed.is_empty());
    let broken_info = &info.workers[0];
    assert_eq!(broken_info.name, "GPU 0");
    assert_eq!(broken_info.batches_done, 0);
    assert_eq!(
        broken_info.batches_failed, 1,
        "it stops after its first failure"
    );
    assert!(
        broken_info
            .stopped
            .as_deref()
            .unwrap()
            .contains("illegal memory access"),
        "{:?}",
        broken_info.stopped
    );
    assert_eq!(info.workers[1].batches_done, 6);
    let (records, _) = read_records(&out.join(SCORES_FILE)).unwrap();
    assert!(records.iter().all(|r| r.timing.worker == "GPU 1"));
    assert_eq!(records.len(), 6);

    // A request that fails alone is listed, recorded as failed and counted; a rerun leaves it
    // unless asked to retry failures (issue 23: it never succeeded and every run exited 1).
    let dir2 = tempfile::tempdir().unwrap();
    write_benchmark(dir2.path(), &single_items()[..2]);
    let mut t = single_table();
    t.insert(
        (2, "score", false),
        Err("the prompt does not fit the context".into()),
    );
    let table = Arc::new(t);
    let prompts = prompt_set(dir2.path(), "single.toml", SINGLE_SET);
    let out2 = dir2.path().join("out");
    let info = run_once(
        dir2.path(),
        &out2,
        &prompts,
        vec![Scripted::new("j", MODEL, table.clone(), seen.clone())],
        ShardSpec::single(),
        2,
    );
    assert_eq!(info.calls_judged, 1);
    assert_eq!(info.failed.len(), 1);
    assert_eq!(info.failed[0].id, "pair-2");
    assert!(info.failed[0].errors[0].contains("does not fit"));
    let (records, _) = read_records(&out2.join(SCORES_FILE)).unwrap();
    let failed: Vec<&Record> = records.iter().filter(|r| r.judge_failed()).collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].id, "pair-2");
    assert!(failed[0]
        .failed
        .as_deref()
        .unwrap()
        .contains("does not fit"));
    assert!((failed[0].score, failed[0].parse_failed.as_deref()) == (None, None));
    let report = Report::from_dir(&out2, "c").unwrap();
    assert_eq!(
        (
            report.judge_failed,
            report.not_scored,
            report.items_scored,
            report.parse_failed
        ),
        (1, 0, 1, 0)
    );
    assert!(report.to_markdown().contains("1 the judge failed on"));

    // A rerun judges nothing: the failure is recorded.
    let calls_before = seen.lock().unwrap().len();
    let rerun = |retry_failed: bool, table: Arc<Table>| {
        let loaded = load(dir2.path());
        let session = Session::open(
            &out2,
            spec(prompts.clone(), MODEL),
            &SessionOptions::default(),
        )
        .unwrap();
        let plan = session.plan(&loaded, ShardSpec::single()).unwrap();
        let options = RunOptions {
            retry_failed,
            ..quiet(2)
        };
        assert_eq!(
            plan.pending(session.store(), retry_failed).len(),
            usize::from(retry_failed)
        );
        session
            .run(
                vec![Scripted::new("j", MODEL, table, seen.clone())],
                &plan,
                &options,
            )
            .unwrap()
    };
    let again = rerun(false, table.clone());
    assert_eq!((again.calls_judged, again.failed.len()), (0, 0));
    assert_eq!(seen.lock().unwrap().len(), calls_before);
    assert_eq!(Report::from_dir(&out2, "c").unwrap().judge_failed, 1);
    // --retry-failed judges it again; now it answers.
    let mut fixed = (*table).clone();
    fixed.insert((2, "score", false), ok("Score: 3"));
    let retried = rerun(true, Arc::new(fixed));
    assert_eq!((retried.calls_judged, retried.failed.len()), (1, 0));
    assert_eq!(seen.lock().unwrap().len(), calls_before + 1);
    let report = Report::from_dir(&out2, "c").unwrap();
    assert_eq!((report.judge_failed, report.items_scored), (0, 2));
}

#[test]
fn shards_merged_equal_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let bench = dir.path().join("bench");
    let mut items = single_items();
    items.push(GenItem {
        n: 7,
        category: "C",
    });
    write_benchmark(&bench, &items);
    let prompts = prompt_set(dir.path(), "single.toml", SINGLE_SET);
    let mut t = single_table();
    t.insert((7, "score", false), ok("Score: 2.5"));
    let table = Arc::new(t);
    let seen = Arc::new(Mutex::new(Vec::new()));

    let whole = dir.path().join("whole");
    run_once(
        &bench,
        &whole,
        &prompts,
        vec![scripted(&table, &seen)],
        ShardSpec::single(),
        3,
    );
    let shards: Vec<_> = (0..3)
        .map(|i| dir.path().join(format!("shard{i}")))
        .collect();
    for (i, d) in shards.iter().enumerate() {
        let info = run_once(
            &bench,
            d,
            &prompts,
            vec![scripted(&table, &seen)],
            ShardSpec::new(i, 3).unwrap(),
            2,
        );
        assert!(info.complete());
        assert_eq!(info.benchmark_items, 7);
    }
    // Merging needs every shard once.
    let merged = dir.path().join("merged");
    let err = merge_shards(&shards[..2], &merged, MergeOptions::default()).unwrap_err();
    assert!(matches!(err, RecordsError::ShardSet { .. }), "{err}");
    assert!(
        err.to_string().contains("shard(s) 2 of 3 are missing"),
        "{err}"
    );
    let twice = vec![shards[0].clone(), shards[1].clone(), shards[1].clone()];
    assert!(merge_shards(&twice, &merged, MergeOptions::default()).is_err());

    let outcome = merge_shards(&shards, &merged, MergeOptions::default()).unwrap();
    assert!(outcome.report.is_clean(), "{:?}", outcome.report);
    assert_eq!(outcome.info.calls_recorded, 7);
    assert_eq!(outcome.info.items, 7);

    let (a, _) = read_records(&whole.join(SCORES_FILE)).unwrap();
    let (b, _) = read_records(&merged.join(SCORES_FILE)).unwrap();
    assert_eq!(comparable(&a), comparable(&b));
    let ra = Report::from_dir(&whole, "c").unwrap();
    let rb = Report::from_dir(&merged, "c").unwrap();
    assert_eq!(ra, rb);
    rb.write(&merged).unwrap();

    let err = merge_shards(&shards, &shards[0], MergeOptions::default()).unwrap_err();
    assert!(err.to_string().contains("is one of the shards"), "{err}");

    // Shards where the judge failed on a call.
    let mut gap = (*table).clone();
    gap.remove(&(7, "score", false));
    let gap = Arc::new(gap);
    let halves: Vec<_> = (0..2)
        .map(|i| dir.path().join(format!("half{i}")))
        .collect();
    for (i, d) in halves.iter().enumerate() {
        run_once(
            &bench,
            d,
            &prompts,
            vec![scripted(&gap, &seen)],
            ShardSpec::new(i, 2).unwrap(),
            2,
        );
    }
    // The judge failed on item 7: recorded as failed, so the shards are finished and merge;
    // the merged report counts the failure.
    let m2 = dir.path().join("m2");
    let outcome = merge_shards(&halves, &m2, MergeOptions::default()).unwrap();
    assert_eq!(outcome.info.failed.len(), 1);
    assert_eq!(outcome.info.failed[0].id, "pair-7");
    let r = Report::from_dir(&m2, "c").unwrap();
    assert_eq!((r.items, r.judge_failed, r.items_scored), (7, 1, 5));
    assert_eq!(r.category("C").unwrap().judge_failed, 1);
    // A shard whose summary says calls have no record (a summary of an older fleet, which
    // left judge failures unrecorded) is refused unless allowed.
    let half1 = halves[1].join(RUN_FILE);
    let mut info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&half1).unwrap()).unwrap();
    info["calls_recorded"] = serde_json::json!(2);
    std::fs::write(&half1, info.to_string()).unwrap();
    let m3 = dir.path().join("m3");
    let err = merge_shards(&halves, &m3, MergeOptions::default()).unwrap_err();
    assert!(matches!(err, RecordsError::Incomplete { .. }), "{err}");
    assert!(
        err.to_string().contains("half1 (2 of 3 calls recorded)"),
        "{err}"
    );
    let allow = MergeOptions {
        allow_incomplete: true,
        ..MergeOptions::default()
    };
    let outcome = merge_shards(&halves, &m3, allow).unwrap();
    assert_eq!(outcome.info.failed.len(), 1);

    // A shard made with another prompt set is refused.
    let other = prompt_set(
        dir.path(),
        "other.toml",
        &SINGLE_SET.replace("Judge this", "Rate this"),
    );
    let odd = dir.path().join("odd");
    run_once(
        &bench,
        &odd,
        &other,
        vec![scripted(&table, &seen)],
        ShardSpec::new(2, 3).unwrap(),
        2,
    );
    let mixed = vec![shards[0].clone(), shards[1].clone(), odd];
    let err = merge_shards(&mixed, &dir.path().join("m2"), MergeOptions::default()).unwrap_err();
    assert!(matches!(err, RecordsError::ShardMismatch { .. }), "{err}");
    assert!(err.to_string().contains("prompt_set.hash"), "{err}");
}

/// Issue 23: transformers' two image-processor backends differ in a few pixels, so the backend
/// is part of the output directory's manifest (a resume with the other is refused) and of
/// every record's key.
#[test]
fn the_image_backend_is_part_of_the_manifest_and_the_keys() {
    use fleet_models::vision::ResizeBackend;
    let dir = tempfile::tempdir().unwrap();
    write_benchmark(dir.path(), &single_items()[..1]);
    let prompts = prompt_set(dir.path(), "single.toml", SINGLE_SET);
    let out = dir.path().join("out");
    let loaded = load(dir.path());
    let default = spec(prompts.clone(), MODEL);
    assert_eq!(default.image_backend, ResizeBackend::Torchvision);
    let key = {
        let s = Session::open(&out, default, &SessionOptions::default()).unwrap();
        let plan = s.plan(&loaded, ShardSpec::single()).unwrap();
        plan.tasks[0].key.clone()
    };
    let mut pillow = spec(prompts, MODEL);
    pillow.image_backend = ResizeBackend::Pillow;
    let err = Session::open(&out, pillow.clone(), &SessionOptions::default()).unwrap_err();
    assert!(err.to_string().contains("image_backend"), "{err}");
    let other = dir.path().join("pillow");
    let s = Session::open(&other, pillow, &SessionOptions::default()).unwrap();
    let plan = s.plan(&loaded, ShardSpec::single()).unwrap();
    assert_ne!(plan.tasks[0].key, key);
}
