//! Dataset loaders: ORAN-Bench-13K on the real files, sampling, the generic JSONL format, and
//! bad input.
//!
//! The expected ORAN counts were made independently of this crate with a Python script applying
//! the documented rules (json.loads per line; empty question, no options, 3..=6 options, answer
//! in range, exact duplicates after trimming and stripping `N. ` prefixes).

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use fleet_argo::dataset::{
    load_jsonl, load_oran, sample_key, sample_order, Dataset, DatasetError, DatasetSource,
    Difficulty, FileReport, LabelStyle, SkipReason,
};

fn oran_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/oran-bench-13k");
    assert!(
        dir.join("fin_E.json").exists(),
        "ORAN-Bench-13K not found at {}: these tests read the real files (see shared/data)",
        dir.display()
    );
    dir
}

fn load(difficulty: Difficulty) -> Dataset {
    match load_oran(&oran_dir(), difficulty) {
        Ok(d) => d,
        Err(e) => panic!("loading ORAN-Bench {difficulty}: {e}"),
    }
}

/// Expected per-file numbers.
struct Expect {
    name: &'static str,
    lines: usize,
    loaded: usize,
    skipped: &'static [(SkipReason, usize)],
    repeated_question_texts: usize,
    repeated_option_texts: usize,
    correct_positions: [usize; 6],
}

const EASY: Expect = Expect {
    name: "fin_E.json",
    lines: 1139,
    loaded: 1128,
    skipped: &[(SkipReason::Duplicate, 11)],
    repeated_question_texts: 118,
    repeated_option_texts: 1,
    correct_positions: [392, 368, 213, 155, 0, 0],
};
const MEDIUM: Expect = Expect {
    name: "fin_M.json",
    lines: 9570,
    loaded: 9428,
    skipped: &[
        (SkipReason::EmptyQuestion, 84),
        (SkipReason::NoOptions, 32),
        (SkipReason::AmbiguousCorrect, 3),
        (SkipReason::Duplicate, 23),
    ],
    repeated_question_texts: 151,
    repeated_option_texts: 5,
    correct_positions: [2490, 3212, 2271, 1454, 0, 1],
};
const HARD: Expect = Expect {
    name: "fin_H.json",
    lines: 3243,
    loaded: 3216,
    skipped: &[
        (SkipReason::EmptyQuestion, 4),
        (SkipReason::NoOptions, 13),
        (SkipReason::AmbiguousCorrect, 2),
        (SkipReason::Duplicate, 8),
    ],
    repeated_question_texts: 45,
    repeated_option_texts: 1,
    correct_positions: [998, 1278, 636, 302, 2, 0],
};

fn check_file(file: &FileReport, e: &Expect) {
    assert_eq!(file.path.file_name().unwrap(), e.name);
    assert_eq!(file.lines, e.lines, "{}: lines", e.name);
    assert_eq!(file.blank_lines, 0, "{}: blank lines", e.name);
    assert_eq!(file.loaded, e.loaded, "{}: loaded", e.name);
    let expected: Vec<(SkipReason, usize)> = e.skipped.to_vec();
    let got: Vec<(SkipReason, usize)> = file.skipped.iter().map(|(r, n)| (*r, *n)).collect();
    let mut expected_sorted = expected.clone();
    expected_sorted.sort();
    assert_eq!(got, expected_sorted, "{}: skipped by reason", e.name);
    assert_eq!(
        file.loaded + file.skipped_total(),
        file.lines - file.blank_lines
    );
    assert_eq!(
        file.repeated_question_texts, e.repeated_question_texts,
        "{}: repeated question texts",
        e.name
    );
    assert_eq!(
        file.repeated_option_texts, e.repeated_option_texts,
        "{}: repeated option texts",
        e.name
    );
    assert_eq!(file.correct_positions, e.correct_positions.to_vec());
    // Every skipped line is remembered here (all counts are below the cap).
    assert_eq!(file.skipped_lines.len(), file.skipped_total());
}

#[test]
fn oran_counts_per_file() {
    for (difficulty, expect) in [
        (Difficulty::Easy, &EASY),
        (Difficulty::Medium, &MEDIUM),
        (Difficulty::Hard, &HARD),
    ] {
        let data = load(difficulty);
        assert_eq!(data.report.files.len(), 1);
        check_file(&data.report.files[0], expect);
        assert_eq!(data.questions.len(), expect.loaded);
        assert!(data
            .questions
            .iter()
            .all(|q| q.difficulty == Some(difficulty)));
    }
}

#[test]
fn oran_mixed_pools_all_three_files() {
    let data = load(Difficulty::Mixed);
    let names: Vec<_> = data
        .report
        .files
        .iter()
        .map(|f| f.path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["fin_E.json", "fin_M.json", "fin_H.json"]);
    // No exact duplicate crosses files, so the per-file numbers are those of single loads.
    check_file(&data.report.files[0], &EASY);
    check_file(&data.report.files[1], &MEDIUM);
    check_file(&data.report.files[2], &HARD);
    assert_eq!(data.report.loaded(), 1128 + 9428 + 3216);
    assert_eq!(data.report.skipped(), 11 + 142 + 27);
    let by_reason = data.report.skipped_by_reason();
    assert_eq!(by_reason[&SkipReason::EmptyQuestion], 88);
    assert_eq!(by_reason[&SkipReason::NoOptions], 45);
    assert_eq!(by_reason[&SkipReason::Duplicate], 42);
    assert_eq!(by_reason[&SkipReason::AmbiguousCorrect], 5);
    let ids: HashSet<&str> = data.questions.iter().map(|q| q.id.as_str()).collect();
    assert_eq!(ids.len(), data.questions.len(), "ids are unique");
}

#[test]
fn oran_skipped_lines_name_their_lines() {
    let data = load(Difficulty::Mixed);
    let medium = data.report.file("fin_M.json").unwrap();
    let empty: Vec<usize> = medium
        .lines_for(SkipReason::EmptyQuestion)
        .map(|s| s.line)
        .take(3)
        .collect();
    assert_eq!(empty, [495, 536, 713]);
    let no_options: Vec<usize> = medium
        .lines_for(SkipReason::NoOptions)
        .map(|s| s.line)
        .take(3)
        .collect();
    assert_eq!(no_options, [1221, 1228, 1240]);
    let dup = medium.lines_for(SkipReason::Duplicate).next().unwrap();
    assert_eq!(dup.line, 1027);
    assert_eq!(dup.detail, "same as line 1018");

    let hard = data.report.file("fin_H.json").unwrap();
    let empty: Vec<usize> = hard
        .lines_for(SkipReason::EmptyQuestion)
        .map(|s| s.line)
        .collect();
    assert_eq!(empty, [731, 1253, 1552, 1701]);
    assert_eq!(
        hard.lines_for(SkipReason::NoOptions).next().unwrap().line,
        412
    );
    let easy = data.report.file("fin_E.json").unwrap();
    let dups: Vec<usize> = easy
        .lines_for(SkipReason::Duplicate)
        .map(|s| s.line)
        .collect();
    assert_eq!(
        dups,
        [208, 219, 367, 499, 541, 629, 655, 657, 934, 1007, 1100]
    );

    let twins: Vec<usize> = medium
        .lines_for(SkipReason::AmbiguousCorrect)
        .map(|s| s.line)
        .collect();
    assert_eq!(twins, [7061, 8748, 8817]);
    let twins: Vec<usize> = hard
        .lines_for(SkipReason::AmbiguousCorrect)
        .map(|s| s.line)
        .collect();
    assert_eq!(twins, [2233, 2238]);
    let twin = hard.lines_for(SkipReason::AmbiguousCorrect).next().unwrap();
    assert_eq!(
        twin.detail,
        "correct option 1 has the same text as option 3"
    );

    let text = data.report.to_string();
    assert!(
        text.starts_with("loaded 13772 questions, skipped 180"),
        "{text}"
    );
    assert!(text.contains("84 empty question: line 495"), "{text}");
    assert!(
        text.contains("fin_H.json (hard): 3243 lines, 3216 loaded, 27 skipped"),
        "{text}"
    );
    assert!(
        text.contains("correct option: 1: 31.0%, 2: 39.7%"),
        "{text}"
    );
}

#[test]
fn oran_items_are_read_faithfully() {
    let data = load(Difficulty::Mixed);
    let by_id = |id: &str| {
        data.questions
            .iter()
            .find(|q| q.id == id)
            .unwrap_or_else(|| panic!("{id} missing"))
    };
    let first = by_id("oran-E-000001");
    assert_eq!(
        first.question,
        "Which O-RAN Working Group focuses on the architecture description of Open Radio Access Networks?"
    );
    assert_eq!(
        first.options,
        ["O-RAN.WG3", "O-RAN.WG4", "O-RAN.WG1", "O-RAN.WG5"]
    );
    assert_eq!(first.correct, 2);
    assert_eq!(first.source.line, 1);
    assert_eq!(
        first.display_options(LabelStyle::Number),
        [
            "1. O-RAN.WG3",
            "2. O-RAN.WG4",
            "3. O-RAN.WG1",
            "4. O-RAN.WG5"
        ]
    );
    assert_eq!(
        first.display_option(2, LabelStyle::Letter).as_deref(),
        Some("C. O-RAN.WG1")
    );
    assert_eq!(first.display_option(4, LabelStyle::Number), None);
    assert_eq!(first.correct_label(LabelStyle::Number), "3");
    assert_eq!(first.correct_label(LabelStyle::Letter), "C");
    // "2.  3GPP": the double space after the label is stripped too.
    assert_eq!(by_id("oran-E-000330").options[1], "3GPP");
    // The 6-option and 3-option medium items and the 5-option hard items are kept.
    let six = by_id("oran-M-003180");
    assert_eq!((six.num_options(), six.correct), (6, 5));
    let three = by_id("oran-M-003630");
    assert_eq!((three.num_options(), three.correct), (3, 0));
    for id in ["oran-H-000186", "oran-H-002598"] {
        let five = by_id(id);
        assert_eq!((five.num_options(), five.correct), (5, 4));
    }
    // Skipped items are absent.
    assert!(data.questions.iter().all(|q| q.id != "oran-M-000495"));
    assert!(data.questions.iter().all(|q| q.id != "oran-E-000208"));
    assert!(data.questions.iter().all(|q| q.id != "oran-H-002233"));
    // A repeated distractor is kept (options 1 and 3 are the same, option 4 is right).
    assert_eq!(by_id("oran-H-000931").correct, 3);
    assert!(data
        .questions
        .iter()
        .all(|q| !q.question.is_empty() && (3..=6).contains(&q.num_options())));
}

#[test]
fn sampling_is_stable_and_prefix_closed() {
    // Golden values from an independent implementation of the documented key.
    assert_eq!(sample_key(0, "oran-H-000001"), 0x0527_bc20_d661_70fc);
    assert_eq!(sample_key(42, "q1"), 0xb6eb_b43b_1edd_5243);

    let hard = load(Difficulty::Hard);
    let ids = |n: Option<usize>, seed: u64| -> Vec<String> {
        hard.sample(n, seed)
            .unwrap()
            .questions
            .into_iter()
            .map(|q| q.id)
            .collect()
    };
    assert_eq!(
        ids(Some(5), 0),
        [
            "oran-H-001594",
            "oran-H-001213",
            "oran-H-002374",
            "oran-H-001044",
            "oran-H-001241"
        ]
    );
    assert_eq!(
        ids(Some(5), 7),
        [
            "oran-H-000684",
            "oran-H-002369",
            "oran-H-000875",
            "oran-H-000798",
            "oran-H-003086"
        ]
    );
    let big = ids(Some(500), 1);
    assert_eq!(ids(Some(500), 1), big, "same seed and n, same questions");
    assert_eq!(ids(Some(100), 1), big[..100], "smaller n is a prefix");
    assert_ne!(
        ids(Some(100), 2),
        big[..100],
        "another seed, another sample"
    );
    let all = ids(None, 1);
    assert_eq!(all.len(), 3216);
    assert_eq!(all[..500], big[..]);
    assert_eq!(all.iter().collect::<HashSet<_>>().len(), 3216);

    // Independent of the order the questions are held in.
    let mut reversed = hard.questions.clone();
    reversed.reverse();
    let order: Vec<&str> = sample_order(&reversed, 1)
        .into_iter()
        .take(500)
        .map(|i| reversed[i].id.as_str())
        .collect();
    assert_eq!(order, big.iter().map(String::as_str).collect::<Vec<_>>());

    let sample = hard.sample(Some(10), 3).unwrap();
    assert!(!sample.is_short());
    assert_eq!(sample.to_string(), "sampled 10 of 3216 questions (seed 3)");
}

#[test]
fn sampling_edge_cases() {
    let easy = load(Difficulty::Easy);
    let short = easy.sample(Some(5000), 9).unwrap();
    assert!(short.is_short());
    assert_eq!(short.questions.len(), 1128);
    assert_eq!(
        short.to_string(),
        "asked for 5000 questions but only 1128 are available: using all 1128 (seed 9)"
    );
    assert!(matches!(
        easy.sample(Some(0), 9),
        Err(DatasetError::ZeroQuestions)
    ));
}

#[test]
fn mixed_sample_draws_from_the_pool() {
    let mixed = load(Difficulty::Mixed);
    let sample = mixed.sample(Some(1000), 2024).unwrap();
    let ids: Vec<&str> = sample.questions.iter().map(|q| q.id.as_str()).collect();
    assert_eq!(
        ids[..5],
        [
            "oran-M-009554",
            "oran-M-006952",
            "oran-H-000537",
            "oran-M-004500",
            "oran-M-001983"
        ]
    );
    let count = |d| {
        sample
            .questions
            .iter()
            .filter(|q| q.difficulty == Some(d))
            .count()
    };
    assert_eq!(
        (
            count(Difficulty::Easy),
            count(Difficulty::Medium),
            count(Difficulty::Hard)
        ),
        (92, 683, 225)
    );
}

#[test]
fn difficulty_parses_with_a_clear_error() {
    for (s, d) in [
        ("easy", Difficulty::Easy),
        ("Medium", Difficulty::Medium),
        (" HARD ", Difficulty::Hard),
        ("mixed", Difficulty::Mixed),
    ] {
        assert_eq!(s.parse::<Difficulty>().unwrap(), d);
    }
    let err = "extreme".parse::<Difficulty>().unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown difficulty \"extreme\": expected one of easy, medium, hard, mixed"
    );
    assert_eq!(Difficulty::Hard.to_string(), "hard");
    assert_eq!(Difficulty::Mixed.oran_file(), None);
    assert_eq!(Difficulty::Medium.oran_file(), Some("fin_M.json"));
    assert_eq!(
        serde_json::to_string(&Difficulty::Easy).unwrap(),
        "\"easy\""
    );
}

#[test]
fn missing_oran_data_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let nowhere = tmp.path().join("no-such-dir");
    let err = load_oran(&nowhere, Difficulty::Easy).unwrap_err();
    assert!(matches!(err, DatasetError::MissingDir { .. }));
    let msg = err.to_string();
    assert!(msg.contains(&nowhere.display().to_string()), "{msg}");
    assert!(
        msg.contains("fin_E.json, fin_M.json and fin_H.json"),
        "{msg}"
    );

    // Only the easy file present: easy loads, mixed names the first missing file.
    fs::write(
        tmp.path().join("fin_E.json"),
        "[\"q?\", [\"1. a\", \"2. b\", \"3. c\"], \"2\"]\n",
    )
    .unwrap();
    let easy = load_oran(tmp.path(), Difficulty::Easy).unwrap();
    assert_eq!(easy.questions.len(), 1);
    let err = load_oran(tmp.path(), Difficulty::Mixed).unwrap_err();
    let DatasetError::MissingFile { path, .. } = &err else {
        panic!("expected MissingFile, got {err}");
    };
    assert_eq!(path, &tmp.path().join("fin_M.json"));
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!(
            "dataset file {} not found; point the data directory",
            tmp.path().join("fin_M.json").display()
        )),
        "{msg}"
    );

    let err = load_jsonl(&tmp.path().join("questions.jsonl")).unwrap_err();
    assert!(matches!(err, DatasetError::MissingFile { .. }));
    assert!(
        err.to_string().contains("questions.jsonl not found"),
        "{err}"
    );
}

#[test]
fn oran_bad_lines_are_skipped_and_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let lines = [
        r#"["Good one?", ["1. a", "2. b", "3. c", "4. d"], "2"]"#, // 1 loaded
        r#"["Truncated", ["1. a", "2. b""#,                        // 2 malformed JSON
        r#"{"question": "object, not array"}"#,                    // 3 wrong format
        r#"["Two elements", ["1. a", "2. b", "3. c"]]"#,           // 4 wrong format
        "",                                                        // 5 blank
        r#"["Two options", ["1. a", "2. b"], "1"]"#,               // 6 too few
        r#"["Seven", ["1. a", "2. b", "3. c", "4. d", "5. e", "6. f", "7. g"], "1"]"#, // 7 too many
        r#"["Answer x", ["1. a", "2. b", "3. c"], "x"]"#,          // 8 unreadable answer
        r#"["Answer 5", ["1. a", "2. b", "3. c", "4. d"], "5"]"#,  // 9 out of range
        r#"["Empty option", ["1. a", "2. ", "3. c"], "1"]"#,       // 10 empty option
        r#"["   ", ["1. a", "2. b", "3. c"], "1"]"#,               // 11 empty question
        r#"["Good one?", ["1. a", "2.  b", "3. c", "4. d"], "2"]"#, // 12 duplicate of 1
        r#"["Good one?", ["1. a", "2. b", "3. c", "4. d"], "3"]"#, // 13 loaded: other answer
        r#"["Numeric answer", ["1. a", "2. b", "3. c"], 3]"#,      // 14 loaded
        r#"["Option 1 not a string", [1, "2. b", "3. c"], "1"]"#,  // 15 wrong format
    ];
    let mut content = lines.join("\n");
    content.push('\n');
    let mut bytes = content.into_bytes();
    bytes.extend_from_slice(b"[\"bad utf8 \xff\", [\"1. a\", \"2. b\", \"3. c\"], \"1\"]\r\n"); // 16
    fs::write(tmp.path().join("fin_H.json"), bytes).unwrap();

    let data = load_oran(tmp.path(), Difficulty::Hard).unwrap();
    let file = &data.report.files[0];
    assert_eq!(file.lines, 16);
    assert_eq!(file.blank_lines, 1);
    assert_eq!(file.loaded, 3);
    let reasons: Vec<(usize, SkipReason)> = file
        .skipped_lines
        .iter()
        .map(|s| (s.line, s.reason))
        .collect();
    assert_eq!(
        reasons,
        [
            (2, SkipReason::MalformedJson),
            (3, SkipReason::BadFormat),
            (4, SkipReason::BadFormat),
            (6, SkipReason::TooFewOptions),
            (7, SkipReason::TooManyOptions),
            (8, SkipReason::BadAnswer),
            (9, SkipReason::AnswerOutOfRange),
            (10, SkipReason::EmptyOption),
            (11, SkipReason::EmptyQuestion),
            (12, SkipReason::Duplicate),
            (15, SkipReason::BadFormat),
            (16, SkipReason::MalformedJson),
        ]
    );
    assert_eq!(file.repeated_question_texts, 1);
    let ids: Vec<&str> = data.questions.iter().map(|q| q.id.as_str()).collect();
    assert_eq!(ids, ["oran-H-000001", "oran-H-000013", "oran-H-000014"]);
    assert_eq!(data.questions[2].correct, 2);
    let text = file.to_string();
    assert!(text.contains("line 2 (EOF while parsing"), "{text}");
    assert!(
        text.contains("line 16 (invalid UTF-8 at byte 11)"),
        "{text}"
    );
    assert!(text.contains("line 12 (same as line 1)"), "{text}");
    assert!(text.contains("line 9 (answer 5 with 4 options)"), "{text}");
}

#[test]
fn a_file_with_nothing_usable_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("array.jsonl");
    // A pretty-printed JSON array instead of JSON Lines.
    fs::write(&path, "[\n  {\"question\": \"q\"}\n]\n").unwrap();
    let err = load_jsonl(&path).unwrap_err();
    assert!(matches!(err, DatasetError::NoQuestions { .. }));
    let msg = err.to_string();
    assert!(msg.contains("no usable questions in"), "{msg}");
    assert!(
        msg.contains("2 malformed JSON (lines 1, 3; line 1: "),
        "{msg}"
    );
    assert!(
        msg.contains("1 wrong format (line 2: missing field \"options\" (or \"choices\"))"),
        "{msg}"
    );
    assert!(
        msg.contains("expected JSON Lines, one object per line"),
        "{msg}"
    );

    fs::write(&path, "\n\n").unwrap();
    let msg = load_jsonl(&path).unwrap_err().to_string();
    assert!(msg.contains("2 blank lines, nothing else"), "{msg}");
}

fn write_jsonl(dir: &Path, name: &str, lines: &[&str]) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, lines.join("\n")).unwrap();
    path
}

#[test]
fn generic_format_accepts_the_documented_variants() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write_jsonl(
        tmp.path(),
        "mcq.jsonl",
        &[
            r#"{"id": "n1", "question": "Number?", "options": ["a", "b", "c"], "answer": 2}"#,
            r#"{"id": "n2", "question": "Number string?", "options": ["a", "b", "c"], "answer": " 3 "}"#,
            r#"{"id": "l1", "question": "Letter?", "options": ["a", "b", "c", "d"], "answer": "d"}"#,
            r#"{"id": "l2", "question": "Letter (B)?", "options": ["a", "b", "c"], "answer": "(B)"}"#,
            r#"{"id": "l3", "question": "Letter C.?", "options": ["a", "b", "c"], "answer": "C."}"#,
            r#"{"id": "t1", "question": "Text?", "options": ["O-RU", "O-DU", "Near-RT RIC"], "answer": "near-rt  ric"}"#,
            r#"{"id": 7, "question": "Choices + index?", "choices": ["x", "y", "z"], "answer_index": 0}"#,
            r#"{"question": "No id, object options?", "options": {"B": "bee", "A": "ay", "C": "see"}, "answer": "B", "difficulty": "hard"}"#,
            r#"{"id": "p1", "question": "Prefixed?", "options": ["A. one", "B. two", "C) three"], "answer": "B"}"#,
            r#"{"id": "p2", "question": "Partly prefixed?", "options": ["A. Smith", "Jones", "Brown"], "answer": 1}"#,
            r#"{"id": "both", "question": "Both agree?", "options": ["x", "y", "z"], "answer": 2, "answer_index": 1, "explanation": "ignored"}"#,
            r#"{"id": "num-opts", "question": "Numeric options?", "options": {"1": "10", "2": "20", "3": "30"}, "answer": "2"}"#,
        ],
    );
    let data = load_jsonl(&path).unwrap();
    assert_eq!(data.report.skipped(), 0, "{}", data.report);
    let got: Vec<(&str, usize)> = data
        .questions
        .iter()
        .map(|q| (q.id.as_str(), q.correct))
        .collect();
    assert_eq!(
        got,
        [
            ("n1", 1),
            ("n2", 2),
            ("l1", 3),
            ("l2", 1),
            ("l3", 2),
            ("t1", 2),
            ("7", 0),
            ("mcq-000008", 1),
            ("p1", 1),
            ("p2", 0),
            ("both", 1),
            ("num-opts", 1),
        ]
    );
    let by_id = |id: &str| data.questions.iter().find(|q| q.id == id).unwrap();
    assert_eq!(by_id("mcq-000008").options, ["ay", "bee", "see"]);
    assert_eq!(by_id("mcq-000008").difficulty, Some(Difficulty::Hard));
    assert_eq!(by_id("p1").options, ["one", "two", "three"]);
    assert_eq!(by_id("p2").options, ["A. Smith", "Jones", "Brown"]);
    assert_eq!(by_id("n1").difficulty, None);
    assert_eq!(by_id("n1").source.line, 1);
    assert_eq!(data.report.files[0].difficulty, None);

    // Through DatasetSource, as a config names it.
    let source = DatasetSource::Jsonl { path: path.clone() };
    assert_eq!(source.load().unwrap().questions.len(), 12);
    let json = serde_json::to_string(&source).unwrap();
    assert!(json.starts_with(r#"{"format":"jsonl","path":"#), "{json}");
}

#[test]
fn generic_format_bad_lines_are_skipped_with_reasons() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write_jsonl(
        tmp.path(),
        "bad.jsonl",
        &[
            r#"{"id": "ok", "question": "Fine?", "options": ["a", "b", "c"], "answer": 1}"#, // 1
            r#"{"id": "ok", "question": "Same id?", "options": ["a", "b", "c"], "answer": 1}"#, // 2
            r#"{"id": "ok", "question": "Fine?", "options": ["a", "b", "c"], "answer": 1}"#, // 3
            r#"{"id": "z", "question": "Zero?", "options": ["a", "b", "c"], "answer": 0}"#,  // 4
            r#"{"id": "g", "question": "G?", "options": ["a", "b", "c"], "answer": "D"}"#,   // 5
            r#"{"id": "t", "question": "Text?", "options": ["a", "b", "c"], "answer": "nope"}"#, // 6
            r#"{"id": "m", "question": "Missing answer?", "options": ["a", "b", "c"]}"#, // 7
            r#"{"id": "q", "options": ["a", "b", "c"], "answer": 1}"#,                   // 8
            r#"{"id": "k", "question": "Gap?", "options": {"A": "a", "C": "c", "D": "d"}, "answer": 1}"#, // 9
            r#"{"id": "d", "question": "Disagree?", "options": ["a", "b", "c"], "answer": 1, "answer_index": 2}"#, // 10
            r#"{"id": "h", "question": "Mixed?", "options": ["a", "b", "c"], "answer": 1, "difficulty": "mixed"}"#, // 11
            r#"{"id": "dup", "question": "Dup text?", "options": ["dup", "Dup ", "c"], "answer": "dup"}"#, // 12
            r#"{"id": "both", "question": "Both keys?", "options": ["a", "b", "c"], "choices": ["a", "b", "c"], "answer": 1}"#, // 13
            r#"not json at all"#, // 14
            r#"{"id": "ok2", "question": "Fine too?", "options": ["a", "b", "c"], "answer": 3}"#, // 15
            r#"{"id": "twin", "question": "Twin?", "options": ["x", "y", "X"], "answer": 3}"#, // 16
            r#"{"id": "twin2", "question": "Twin distractor?", "options": ["x", "y", "Y"], "answer": 1}"#, // 17
        ],
    );
    let data = load_jsonl(&path).unwrap();
    let file = &data.report.files[0];
    assert_eq!(file.loaded, 3);
    assert_eq!(file.repeated_option_texts, 1);
    let reasons: Vec<(usize, SkipReason)> = file
        .skipped_lines
        .iter()
        .map(|s| (s.line, s.reason))
        .collect();
    assert_eq!(
        reasons,
        [
            (2, SkipReason::DuplicateId),
            (3, SkipReason::Duplicate),
            (4, SkipReason::AnswerOutOfRange),
            (5, SkipReason::AnswerOutOfRange),
            (6, SkipReason::BadAnswer),
            (7, SkipReason::BadFormat),
            (8, SkipReason::BadFormat),
            (9, SkipReason::BadFormat),
            (10, SkipReason::BadAnswer),
            (11, SkipReason::BadFormat),
            (12, SkipReason::AmbiguousCorrect),
            (13, SkipReason::BadFormat),
            (14, SkipReason::MalformedJson),
            (16, SkipReason::AmbiguousCorrect),
        ]
    );
    let detail = |line: usize| {
        file.skipped_lines
            .iter()
            .find(|s| s.line == line)
            .unwrap()
            .detail
            .clone()
    };
    assert_eq!(detail(2), "id \"ok\" already used at line 1");
    assert!(
        detail(4).contains("use answer_index for 0-based"),
        "{}",
        detail(4)
    );
    assert!(
        detail(7).contains("missing field \"answer\""),
        "{}",
        detail(7)
    );
    assert!(
        detail(8).contains("missing field \"question\""),
        "{}",
        detail(8)
    );
    assert!(detail(10).contains("disagree"), "{}", detail(10));
    assert!(
        detail(12).contains("matches several options"),
        "{}",
        detail(12)
    );
    assert_eq!(detail(16), "correct option 3 has the same text as option 1");
}

#[test]
fn crlf_and_byte_order_mark_are_tolerated() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("win.jsonl");
    fs::write(
        &path,
        "\u{feff}{\"question\": \"q1\", \"options\": [\"a\", \"b\", \"c\"], \"answer\": 1}\r\n\
         {\"question\": \"q2\", \"options\": [\"a\", \"b\", \"c\"], \"answer\": 2}\r\n",
    )
    .unwrap();
    let data = load_jsonl(&path).unwrap();
    assert_eq!(data.questions.len(), 2, "{}", data.report);
    assert_eq!(data.report.files[0].lines, 2);
}
