//! The answer parser on replies of the kinds a run sees: a bare label, an explicit final
//! statement after reasoning, a Qwen3 think block, and a long explanation that names other
//! options before its answer (the parser's slowest path: every line is scanned).

use criterion::{criterion_group, criterion_main, Criterion};
use fleet_data::answer::{parse_answer, parse_answer_with_options};
use std::hint::black_box;

fn replies() -> Vec<(&'static str, String)> {
    let explanation = "Option 1 describes the O-DU, which hosts the RLC and MAC layers. \
                       Option 2 is the near-RT RIC, which runs xApps on the E2 interface. \
                       Option 4 is the SMO, which hosts the non-RT RIC and rApps. "
        .repeat(12);
    vec![
        ("bare label", "3".to_string()),
        (
            "statement",
            "The E2 interface connects the near-RT RIC to the E2 nodes.\nThe answer is 2.".into(),
        ),
        (
            "think block",
            "<think>First, the O1 interface is for management...\nSo it must be 4.</think>\n\
             **Answer:** 4"
                .into(),
        ),
        (
            "long explanation",
            format!("{explanation}\nTherefore the correct option is 2."),
        ),
    ]
}

fn bench(c: &mut Criterion) {
    let options = ["O-DU", "near-RT RIC", "O-CU-UP", "SMO"];
    let mut group = c.benchmark_group("parse_answer");
    for (name, reply) in replies() {
        group.bench_function(name, |b| b.iter(|| parse_answer(black_box(&reply), 4)));
    }
    group.finish();
    let mut group = c.benchmark_group("parse_answer_with_options");
    for (name, reply) in replies() {
        group.bench_function(name, |b| {
            b.iter(|| parse_answer_with_options(black_box(&reply), &options))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
