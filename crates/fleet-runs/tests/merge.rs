use std::fs;
use std::path::PathBuf;

use fleet_runs::{merge_jsonl, RunsError};

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
    let p = dir.path().join(name);
    fs::write(&p, text).unwrap();
    p
}

#[test]
fn merges_sorted_with_malformed_duplicates_and_missing() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(
        &dir,
        "shard0.jsonl",
        "{\"index\":2,\"v\":\"a2\"}\n{\"index\":0,\"v\":\"a0\"}\nnot json\n\n",
    );
    let b = write(
        &dir,
        "shard1.jsonl",
        "{\"index\":5,\"v\":\"b5\"}\n{\"index\":2,\"v\":\"dup\"}\n{\"v\":\"no index\"}\n{\"index\":-1}\n[1,2]\n",
    );
    let out = dir.path().join("merged.jsonl");
    let r = merge_jsonl(&[a.clone(), b.clone()], &out).unwrap();
    let text = fs::read_to_string(&out).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        vec![
            "{\"index\":0,\"v\":\"a0\"}",
            "{\"index\":2,\"v\":\"a2\"}",
            "{\"index\":5,\"v\":\"b5\"}"
        ]
    );
    assert_eq!(r.records_written, 3);
    assert_eq!(r.max_index, Some(5));
    assert_eq!(r.missing, vec![1, 3, 4]);
    assert_eq!(r.missing_count, 3);
    assert_eq!(r.duplicates.len(), 1);
    assert_eq!(r.duplicates[0].index, 2);
    assert_eq!(r.duplicates[0].kept, (a.clone(), 1));
    assert_eq!(r.duplicates[0].dropped, (b.clone(), 2));
    let bad: Vec<(PathBuf, usize)> = r
        .malformed
        .iter()
        .map(|m| (m.file.clone(), m.line))
        .collect();
    assert_eq!(
        bad,
        vec![(a.clone(), 3), (b.clone(), 3), (b.clone(), 4), (b, 5)]
    );
    assert!(r.malformed[1].reason.contains("index"));
    assert_eq!(r.inputs[0].records, 2);
    assert_eq!(r.inputs[1].records, 1);
    assert!(!r.is_clean());
    // No temporary file is left behind.
    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
}

#[test]
fn clean_merge_and_empty_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(&dir, "a.jsonl", "{\"index\":1}\n");
    let b = write(&dir, "b.jsonl", "{\"index\":0}\n");
    let out = dir.path().join("m.jsonl");
    let r = merge_jsonl(&[a, b], &out).unwrap();
    assert!(r.is_clean());
    assert_eq!(
        fs::read_to_string(&out).unwrap(),
        "{\"index\":0}\n{\"index\":1}\n"
    );

    let e = write(&dir, "e.jsonl", "");
    let r = merge_jsonl(&[e], &out).unwrap();
    assert_eq!(r.max_index, None);
    assert_eq!(fs::read_to_string(&out).unwrap(), "");
}

#[test]
fn huge_index_does_not_blow_up_missing_list() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(&dir, "a.jsonl", "{\"index\":1000000000000}\n");
    let r = merge_jsonl(&[a], &dir.path().join("m.jsonl")).unwrap();
    assert_eq!(r.missing_count, 1_000_000_000_000);
    assert_eq!(r.missing.len(), fleet_runs::MAX_LISTED_MISSING);
}

#[test]
fn output_may_be_an_input() {
    let dir = tempfile::tempdir().unwrap();
    let a = write(&dir, "a.jsonl", "{\"index\":1}\n{\"index\":0}\n");
    merge_jsonl(std::slice::from_ref(&a), &a).unwrap();
    assert_eq!(
        fs::read_to_string(&a).unwrap(),
        "{\"index\":0}\n{\"index\":1}\n"
    );
}

#[test]
fn io_errors_name_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.jsonl");
    let e = merge_jsonl(std::slice::from_ref(&missing), &dir.path().join("m.jsonl")).unwrap_err();
    assert!(matches!(e, RunsError::ReadInput { .. }));
    assert!(e.to_string().contains("nope.jsonl"));
    let a = write(&dir, "a.jsonl", "{\"index\":0}\n");
    // A missing directory is created; a directory that is a file cannot be.
    merge_jsonl(
        std::slice::from_ref(&a),
        &dir.path().join("new_dir/m.jsonl"),
    )
    .unwrap();
    let e = merge_jsonl(std::slice::from_ref(&a), &a.join("m.jsonl")).unwrap_err();
    assert!(
        matches!(e, RunsError::WriteOutput { .. } | RunsError::Io { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("a.jsonl"), "{e}");
    let e = merge_jsonl(&[a], std::path::Path::new("/")).unwrap_err();
    assert!(matches!(e, RunsError::OutputNotAFile { .. }));
}
