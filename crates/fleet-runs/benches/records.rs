//! Per-item JSONL records (`fleet_runs::JsonlLog`), the resume path of every job: opening a run
//! directory's records of 10,000 judged items (reading, checking and repairing the file) and
//! appending one record (one `write` call per finished item).

use criterion::{criterion_group, criterion_main, Criterion};
use fleet_runs::JsonlLog;
use serde::{Deserialize, Serialize};
use std::hint::black_box;

/// A record of the size the judge writes per item.
#[derive(Serialize, Deserialize)]
struct Record {
    key: String,
    category: String,
    score: f64,
    reply: String,
    tokens: usize,
}

fn record(i: usize) -> Record {
    Record {
        key: format!("item-{i:06}/sample-0"),
        category: ["add", "remove", "replace", "style"][i % 4].into(),
        score: (i % 11) as f64 / 10.0,
        reply: "The edit follows the instruction; the background is unchanged. ".repeat(4),
        tokens: 96 + i % 32,
    }
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("records.jsonl");
    {
        let (mut log, _) = JsonlLog::open::<Record>(&path).unwrap();
        for i in 0..10_000 {
            log.append(&record(i)).unwrap();
        }
    }
    c.bench_function("records/open 10k", |b| {
        b.iter(|| JsonlLog::open::<Record>(black_box(&path)).unwrap())
    });
    let (mut log, _) = JsonlLog::open::<Record>(&dir.path().join("appended.jsonl")).unwrap();
    let one = record(7);
    c.bench_function("records/append one", |b| {
        b.iter(|| log.append(black_box(&one)).unwrap())
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
