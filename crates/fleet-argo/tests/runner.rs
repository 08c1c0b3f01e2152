//! Real runs: the lock-step runner's bookkeeping with a scripted LLM (a test double for
//! orchestration only), and the real path with the tiny Qwen fixture, the tiny BERT embedder
//! and an index built from files.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::Device;
use fleet_argo::dataset::{Question, SourceLocation};
use fleet_argo::index::{Chunking, VectorIndex};
use fleet_argo::llm::{cache_manifest, FleetLlm, Llm, LlmError, LlmReply, LlmRequest, LlmStats};
use fleet_argo::prompts::Prompts;
use fleet_argo::runner::{run_jobs, summarize, Job, ProgressRule, RecordsFile, Retriever};
use fleet_argo::{MdpParams, Strategy, StrategyKind};
use fleet_models::embedder::{EmbedderOptions, SentenceEmbedder};
use fleet_models::{DeviceLocation, DeviceMap, LoadOptions};
use fleet_serve::{Replicas, Text};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn cpu_map() -> DeviceMap {
    DeviceMap::single(DeviceLocation::Cpu, 4)
}

/// The identity of the checkpoint at `spec` (weights, config, tokenizer by content).
fn jobs_model_identity(spec: &str) -> fleet_models::CheckpointIdentity {
    fleet_models::ModelSource::parse(spec, None)
        .unwrap()
        .resolve(&fleet_models::HubOptions::from_env())
        .unwrap()
        .identity()
        .unwrap()
}

fn embedder() -> SentenceEmbedder {
    let dir = repo().join("tests/fixtures/bert-tiny-st");
    SentenceEmbedder::load(dir.to_str().unwrap(), &EmbedderOptions::default()).unwrap()
}

/// A three-document corpus ingested into a fresh index under `dir`.
fn corpus_index(dir: &Path, embedder: &SentenceEmbedder) -> VectorIndex {
    let docs = dir.join("docs");
    std::fs::create_dir_all(docs.join("sub")).unwrap();
    std::fs::write(
        docs.join("e2.txt"),
        "The E2 interface connects the near-RT RIC to E2 nodes.\n\nE2 setup is started by the E2 node.",
    )
    .unwrap();
    std::fs::write(
        docs.join("a1.md"),
        "# A1\n\nThe A1 interface carries policies from the non-RT RIC to the near-RT RIC.",
    )
    .unwrap();
    std::fs::write(
        docs.join("sub/o1.txt"),
        "O1 is the management interface of O-RAN network functions.",
    )
    .unwrap();
    // A broken PDF is skipped with a reason; a real one is read.
    std::fs::write(docs.join("notes.pdf"), b"%PDF-1.4").unwrap();
    std::fs::copy(
        repo().join("tests/fixtures/docs/e2.pdf"),
        docs.join("sub/e2.pdf"),
    )
    .unwrap();
    let mut index = VectorIndex::create(
        &dir.join("index"),
        embedder.id(),
        embedder.dim(),
        Chunking::default(),
    );
    let report = index.ingest_dir(&docs, embedder, &mut |_, _| {}).unwrap();
    assert_eq!(report.added.len(), 4, "{report:?}");
    assert_eq!(report.skipped.len(), 1, "{report:?}");
    assert_eq!(report.skipped[0].0, "notes.pdf");
    let pdf_chunk = index
        .chunks()
        .iter()
        .find(|c| c.source.ends_with("e2.pdf"))
        .expect("the PDF's text is indexed");
    assert!(
        pdf_chunk
            .text
            .contains("E2 setup is started by the E2 node."),
        "{}",
        pdf_chunk.text
    );
    index.save().unwrap();
    index
}

fn question(id: &str, correct: usize) -> Arc<Question> {
    Arc::new(Question {
        id: id.into(),
        question: format!("Which interface connects the near-RT RIC to E2 nodes? ({id})"),
        options: vec!["A1".into(), "E2".into(), "O1".into(), "F1".into()],
        correct,
        difficulty: None,
        source: SourceLocation {
            file: PathBuf::from("test.jsonl"),
            line: 1,
        },
    })
}

fn params(c_r: f64) -> MdpParams {
    MdpParams {
        c_r,
        ..MdpParams::default()
    }
}

fn fixed_k(k: u32) -> Strategy {
    Strategy::new(StrategyKind::FixedK { k }, 1.0, None).unwrap()
}

/// Replies by component, recognised from the shipped prompts' wording; counts calls.
struct ScriptedLlm {
    answer: String,
    judge: String,
    calls: Mutex<LlmStats>,
}

impl Llm for ScriptedLlm {
    fn complete(&self, requests: &[LlmRequest]) -> Result<Vec<LlmReply>, LlmError> {
        let mut stats = self.calls.lock().unwrap();
        stats.calls += requests.len() as u64;
        stats.batches += 1;
        Ok(requests
            .iter()
            .map(|r| {
                let user = &r.messages.last().unwrap().content;
                let text = if user.contains("Reply with yes or no") {
                    self.judge.clone()
                } else if user.contains("search query") {
                    "Query: E2 interface near-RT RIC".to_string()
                } else if user.contains("new note") {
                    "E2 links the RIC and E2 nodes.".to_string()
                } else {
                    self.answer.clone()
                };
                LlmReply {
                    text,
                    prompt_tokens: 10,
                    new_tokens: 5,
                    cached: false,
                }
            })
            .collect())
    }

    fn stats(&self) -> LlmStats {
        *self.calls.lock().unwrap()
    }

    fn model_id(&self) -> String {
        "scripted".into()
    }
}

#[test]
fn fixed_k_retrieves_k_times_then_answers_and_a_rerun_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let emb = embedder();
    let index = corpus_index(tmp.path(), &emb);
    let retriever = Retriever::new(
        &emb,
        &index,
        Device::Cpu,
        2,
        -1.0, // every new chunk counts: this test is about bookkeeping
        ProgressRule::Similarity,
    );
    let prompts = Prompts::default_prompts().unwrap();
    let llm = ScriptedLlm {
        answer: "Looking at the text... The answer is 2".into(),
        judge: "yes".into(),
        calls: Mutex::new(LlmStats::default()),
    };
    let jobs: Vec<Job> = (0..5)
        .map(|i| Job {
            question: question(&format!("q{i}"), if i == 4 { 0 } else { 1 }),
            strategy: fixed_k(2),
            params: params(0.05),
            step_cap: 10,
            seed: i,
        })
        .collect();
    let records_path = tmp.path().join("run/records.jsonl");
    let mut records = RecordsFile::open(&records_path).unwrap();
    // Issue 14, item 6: progress is reported every round, long before the first job finishes.
    let mut events: Vec<String> = Vec::new();
    let progress = run_jobs(
        jobs.clone(),
        &llm,
        &retriever,
        &prompts,
        &mut records,
        3,
        &mut |e| {
            events.push(match e {
                fleet_argo::runner::RunEvent::Round { round, .. } => format!("round {round}"),
                fleet_argo::runner::RunEvent::Finished(_) => "finished".into(),
                fleet_argo::runner::RunEvent::Resumed(n) => format!("resumed {n}"),
            })
        },
    )
    .unwrap();
    let first_finished = events.iter().position(|e| e == "finished").unwrap();
    let rounds_before = events[..first_finished]
        .iter()
        .filter(|e| e.starts_with("round"))
        .count();
    assert!(rounds_before >= 2, "{events:?}");
    let rounds: Vec<&String> = events.iter().filter(|e| e.starts_with("round")).collect();
    assert!(rounds.len() >= 3, "{events:?}");
    assert_eq!(rounds[0], "round 1", "{events:?}");
    assert_eq!((progress.jobs, progress.ran, progress.resumed), (5, 5, 0));
    // 3 calls per job (2 Decomposer + 1 Synthesizer), at most 3 jobs per batch.
    assert_eq!(llm.stats().calls, 15);
    let all: Vec<_> = jobs
        .iter()
        .map(|j| records.get(&j.key()).unwrap())
        .collect();
    for r in &all {
        assert_eq!(r.episode.retrievals, 2);
        assert_eq!(r.episode.reasons, 0);
        assert!((r.episode.cost - 0.10).abs() < 1e-12, "{}", r.episode.cost);
        assert_eq!(r.llm_calls, 3);
        assert_eq!(r.queries, vec!["E2 interface near-RT RIC"; 2]);
        // The same query twice returns the same two hits: the second retrieval finds nothing
        // new, and no chunk is gathered twice.
        let mut ev = r.evidence.clone();
        ev.sort();
        ev.dedup();
        assert_eq!(ev.len(), r.evidence.len());
        assert_eq!(r.evidence.len(), 2);
        assert_eq!(r.episode.successful_retrievals, 1);
        assert_eq!(r.answer.index(), Some(1));
    }
    let summary = summarize(&all);
    assert_eq!(summary.len(), 1);
    assert_eq!(summary[0].summary.n_questions, 5);
    assert_eq!(summary[0].summary.correct, 4);
    assert_eq!(summary[0].unparsed, 0);
    assert_eq!(summary[0].llm_calls, 15);

    // Started again: nothing to do.
    drop(records);
    let mut records = RecordsFile::open(&records_path).unwrap();
    let again = run_jobs(
        jobs.clone(),
        &llm,
        &retriever,
        &prompts,
        &mut records,
        3,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!((again.ran, again.resumed), (0, 5));
    assert_eq!(llm.stats().calls, 15);

    // A run killed mid-line: the torn line is cut off, its job runs again, and the new record
    // reads back (it is not glued to the fragment).
    let text = std::fs::read_to_string(&records_path).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    let last = lines.pop().unwrap();
    let cut = &last[..last.len() / 2];
    std::fs::write(&records_path, format!("{}\n{cut}", lines.join("\n"))).unwrap();
    let mut records = RecordsFile::open(&records_path).unwrap();
    assert!(
        matches!(
            records.repair,
            Some(fleet_runs::TailRepair::Truncated { line: 5, .. })
        ),
        "{:?}",
        records.repair
    );
    assert!(records.problems.as_deref().unwrap().contains("cut off"));
    assert_eq!(records.len(), 4);
    let again = run_jobs(
        jobs.clone(),
        &llm,
        &retriever,
        &prompts,
        &mut records,
        3,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!((again.ran, again.resumed), (1, 4));
    drop(records);
    let records = RecordsFile::open(&records_path).unwrap();
    assert_eq!((records.len(), records.bad_lines), (5, 0));
    assert!(records.problems.is_none());
    let again = run_jobs(
        jobs,
        &llm,
        &retriever,
        &prompts,
        &mut RecordsFile::open(&records_path).unwrap(),
        3,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!((again.ran, again.resumed), (0, 5));
}

#[test]
fn an_answer_that_does_not_parse_is_unparsed_and_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let emb = embedder();
    let index = corpus_index(tmp.path(), &emb);
    let retriever = Retriever::new(&emb, &index, Device::Cpu, 1, 0.0, ProgressRule::Similarity);
    let llm = ScriptedLlm {
        answer: "It could be 2 or 3.".into(),
        judge: "yes".into(),
        calls: Mutex::new(LlmStats::default()),
    };
    let jobs = vec![Job {
        question: question("q0", 1),
        strategy: fixed_k(0),
        params: params(0.05),
        step_cap: 10,
        seed: 0,
    }];
    let mut records = RecordsFile::open(&tmp.path().join("r.jsonl")).unwrap();
    let prompts = Prompts::default_prompts().unwrap();
    run_jobs(
        jobs.clone(),
        &llm,
        &retriever,
        &prompts,
        &mut records,
        8,
        &mut |_| {},
    )
    .unwrap();
    let r = records.get(&jobs[0].key()).unwrap();
    assert_eq!(r.answer.index(), None);
    assert!(!r.correct);
    let s = summarize(&[r]);
    assert_eq!((s[0].unparsed, s[0].summary.correct), (1, 0));
}

#[test]
fn real_model_runs_strategies_and_the_cache_serves_repeated_points() {
    let tmp = tempfile::tempdir().unwrap();
    let emb = embedder();
    let index = corpus_index(tmp.path(), &emb);
    let retriever = Retriever::new(&emb, &index, Device::Cpu, 2, 0.0, ProgressRule::Similarity);
    let model_dir = repo().join("tests/fixtures/qwen2-tiny");
    let spec = model_dir.to_str().unwrap();
    let opts = LoadOptions::default();
    let cpu = DeviceMap::single(DeviceLocation::Cpu, 4);
    let replicas = Replicas::<Text>::load(spec, &opts, &[cpu.clone(), cpu]).unwrap();
    let cache = tmp.path().join("llm_cache.jsonl");
    let model_manifest = cache_manifest(&replicas.models[0].files.identity().unwrap(), "f32");
    let llm = FleetLlm::new(replicas, spec, 4)
        .with_cache_file(&cache, &model_manifest, false)
        .unwrap();
    let mut prompts = Prompts::default_prompts().unwrap();
    // Short replies keep the CPU test quick; the tiny model's text is noise anyway.
    prompts.decomposer.max_new_tokens = 6;
    prompts.reasoner.max_new_tokens = 6;
    prompts.synthesizer.max_new_tokens = 8;
    let always_reason = Strategy::new(StrategyKind::AlwaysReason, 0.16, None).unwrap();
    let mut jobs = Vec::new();
    for c_r in [0.05, 0.10] {
        for q in 0..3 {
            for strategy in [fixed_k(1), always_reason.clone()] {
                jobs.push(Job {
                    question: question(&format!("q{q}"), 1),
                    strategy,
                    params: params(c_r),
                    step_cap: 4,
                    seed: q,
                });
            }
        }
    }
    let mut records = RecordsFile::open(&tmp.path().join("records.jsonl")).unwrap();
    let progress = run_jobs(
        jobs.clone(),
        &llm,
        &retriever,
        &prompts,
        &mut records,
        16,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(progress.ran, 12);
    let stats = llm.stats();
    // Fixed-1: 2 calls, Always-Reason to U = 0.16: 2 Reason + 1 Synthesizer = 3 calls; the
    // c_r = 0.10 point repeats every call of the 0.05 point, so at least half are cache hits.
    assert_eq!(stats.calls, 3 * (2 + 3) * 2);
    assert!(stats.cache_hits >= stats.calls / 2, "{stats:?}");
    let all: Vec<_> = jobs
        .iter()
        .map(|j| records.get(&j.key()).unwrap())
        .collect();
    for pair in all.chunks(6).collect::<Vec<_>>().windows(2) {
        for (a, b) in pair[0].iter().zip(pair[1]) {
            assert_eq!(a.final_text, b.final_text, "same calls at both c_r points");
        }
    }
    // Every answer is either a parsed option or counted unparsed; nothing is defaulted.
    let s = summarize(&all);
    assert_eq!(s.len(), 4);
    for x in &s {
        assert!(x.summary.correct + x.unparsed <= x.summary.n_questions);
    }
    // A second LLM on the same cache file answers everything from it; a line of another
    // format (an older fleet's cache) or a torn write is skipped.
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&cache)
            .unwrap();
        writeln!(
            f,
            r#"{{"key":{{"ids":[1,2,3],"max_new_tokens":6}},"text":"x","new_tokens":1}}"#
        )
        .unwrap();
        write!(f, r#"{{"prompt":"torn"#).unwrap();
    }
    let cpu = DeviceMap::single(DeviceLocation::Cpu, 4);
    let llm2 = FleetLlm::new(
        Replicas::<Text>::load(spec, &opts, &[cpu]).unwrap(),
        spec,
        4,
    )
    .with_cache_file(&cache, &model_manifest, false)
    .unwrap();
    let mut records2 = RecordsFile::open(&tmp.path().join("records2.jsonl")).unwrap();
    let jobs_again = jobs.clone();
    run_jobs(
        jobs,
        &llm2,
        &retriever,
        &prompts,
        &mut records2,
        16,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(llm2.stats().cache_hits, llm2.stats().calls);
    assert_eq!(llm2.stats().new_tokens, 0);
    // The torn line was cut off before llm2 appended: every line of the cache reads back,
    // except the foreign-format one, which stays as it was.
    let text = std::fs::read_to_string(&cache).unwrap();
    assert!(
        text.ends_with('\n') && !text.contains(r#"{"prompt":"torn"#),
        "torn line kept"
    );
    let unreadable = text
        .lines()
        .filter(|l| serde_json::from_str::<serde_json::Value>(l).is_err())
        .count();
    assert_eq!(unreadable, 0);
    drop(llm2);

    // Replies of another checkpoint (or dtype) are refused, or emptied on request.
    let other_model = repo().join("tests/fixtures/qwen3-tiny");
    let other_spec = other_model.to_str().unwrap();
    let other = Replicas::<Text>::load(other_spec, &opts, &[cpu_map()]).unwrap();
    let other_manifest = cache_manifest(&other.models[0].files.identity().unwrap(), "f32");
    let err = FleetLlm::new(other, other_spec, 4)
        .with_cache_file(&cache, &other_manifest, false)
        .err()
        .expect("a cache of another model is refused");
    let msg = err.to_string();
    assert!(msg.contains("model.weights_digest"), "{msg}");
    let bf16 = cache_manifest(&jobs_model_identity(spec), "bf16");
    let err = FleetLlm::new(
        Replicas::<Text>::load(spec, &opts, &[cpu_map()]).unwrap(),
        spec,
        4,
    )
    .with_cache_file(&cache, &bf16, false)
    .err()
    .expect("a cache of another dtype is refused");
    assert!(err.to_string().contains("dtype"), "{err}");
    let other = Replicas::<Text>::load(other_spec, &opts, &[cpu_map()]).unwrap();
    let fresh = FleetLlm::new(other, other_spec, 4)
        .with_cache_file(&cache, &other_manifest, true)
        .unwrap();
    assert_eq!(fresh.cache_len(), 0);
    assert_eq!(std::fs::metadata(&cache).unwrap().len(), 0);
    // The cache gives back the same replies, and the prompts' token counts kept in it.
    for j in &jobs_again {
        let (a, b) = (
            records.get(&j.key()).unwrap(),
            records2.get(&j.key()).unwrap(),
        );
        assert_eq!(a.final_text, b.final_text);
        assert_eq!(a.notes, b.notes);
        assert_eq!(a.prompt_tokens, b.prompt_tokens);
    }
}

#[test]
fn an_llm_judge_decides_whether_a_retrieval_made_progress() {
    let tmp = tempfile::tempdir().unwrap();
    let emb = embedder();
    let index = corpus_index(tmp.path(), &emb);
    let prompts = Prompts::default_prompts().unwrap();
    for (verdict, progress_expected) in [("Yes, it helps.", true), ("No.", false)] {
        let retriever = Retriever::new(&emb, &index, Device::Cpu, 1, -1.0, ProgressRule::LlmJudge);
        let llm = ScriptedLlm {
            answer: "The answer is 2".into(),
            judge: verdict.into(),
            calls: Mutex::new(LlmStats::default()),
        };
        let jobs = vec![Job {
            question: question("q0", 1),
            strategy: fixed_k(2),
            params: params(0.05),
            step_cap: 10,
            seed: 0,
        }];
        let mut records =
            RecordsFile::open(&tmp.path().join(format!("{progress_expected}.jsonl"))).unwrap();
        run_jobs(
            jobs.clone(),
            &llm,
            &retriever,
            &prompts,
            &mut records,
            4,
            &mut |_| {},
        )
        .unwrap();
        let r = records.get(&jobs[0].key()).unwrap();
        assert_eq!(r.episode.retrievals, 2);
        // The scripted Decomposer asks the same query twice: the second retrieval finds no new
        // chunk, so it is no progress and the judge is not asked.
        let expected = u32::from(progress_expected);
        assert_eq!(r.episode.successful_retrievals, expected, "{verdict}");
        // 2 Decomposer + 1 judge + 1 Synthesizer calls.
        assert_eq!(r.llm_calls, 4);
        // The chunk is kept as evidence either way; only U's progress depends on the judge.
        assert_eq!(r.evidence.len(), 1);
    }
}

/// Many requests at once are rendered on several threads; replies stay in request order and
/// equal the replies to the same requests one at a time.
#[test]
fn a_large_round_keeps_request_order() {
    let model_dir = repo().join("tests/fixtures/qwen2-tiny");
    let spec = model_dir.to_str().unwrap();
    let cpu = DeviceMap::single(DeviceLocation::Cpu, 4);
    let llm = FleetLlm::new(
        Replicas::<Text>::load(spec, &LoadOptions::default(), &[cpu]).unwrap(),
        spec,
        64,
    );
    // 66 requests (parallel rendering starts at 64), 11 distinct prompts of distinct lengths.
    let requests: Vec<LlmRequest> = (0..66)
        .map(|i| LlmRequest {
            messages: vec![fleet_models::ChatMessage::new(
                "user",
                "word ".repeat(i % 11 + 1),
            )],
            max_new_tokens: 1,
        })
        .collect();
    let together = llm.complete(&requests).unwrap();
    assert_eq!(together.len(), 66);
    for (i, t) in together.iter().enumerate() {
        assert_eq!(t.prompt_tokens, together[i % 11].prompt_tokens);
    }
    assert!(together[0].prompt_tokens < together[10].prompt_tokens);
    for (r, t) in requests.iter().zip(&together).step_by(7) {
        let alone = llm.complete(std::slice::from_ref(r)).unwrap();
        assert_eq!(alone[0].text, t.text);
        assert_eq!(alone[0].prompt_tokens, t.prompt_tokens);
    }
}

#[test]
fn a_repeated_sub_query_gets_the_hits_of_a_fresh_search() {
    let tmp = tempfile::tempdir().unwrap();
    let emb = embedder();
    let index = corpus_index(tmp.path(), &emb);
    let retriever = Retriever::new(&emb, &index, Device::Cpu, 2, 0.0, ProgressRule::Similarity);
    let queries: Vec<String> = ["E2 setup", "A1 policies", "E2 setup"]
        .iter()
        .map(|q| q.to_string())
        .collect();
    let direct = index
        .search(&emb.embed_vecs(&queries).unwrap(), 2, &Device::Cpu)
        .unwrap();
    let first = retriever.search(&queries).unwrap();
    // The second time every query is answered from memory.
    let again = retriever.search(&queries[1..]).unwrap();
    // Batches of other sizes pad differently: scores agree to float rounding.
    let same = |a: &[Vec<fleet_argo::index::Hit>], b: &[Vec<fleet_argo::index::Hit>]| {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert_eq!(
                x.iter().map(|h| h.id).collect::<Vec<_>>(),
                y.iter().map(|h| h.id).collect::<Vec<_>>()
            );
            for (h, g) in x.iter().zip(y) {
                assert!(
                    (h.score - g.score).abs() < 1e-5,
                    "{} vs {}",
                    h.score,
                    g.score
                );
            }
        }
    };
    same(&first, &direct);
    same(&again, &first[1..]);
    assert_eq!(first[0], first[2]);
    assert_eq!(again[1], first[0], "from memory: the very same hits");
}

/// No round barrier: with continuous batching each question asks its next call as soon as
/// its last one returns, and the greedy records are the lock-step run's.
#[test]
fn continuous_batching_gives_the_lock_step_records() {
    let tmp = tempfile::tempdir().unwrap();
    let emb = embedder();
    let index = corpus_index(tmp.path(), &emb);
    let retriever = Retriever::new(&emb, &index, Device::Cpu, 2, 0.0, ProgressRule::Similarity);
    let model_dir = repo().join("tests/fixtures/qwen2-tiny");
    let spec = model_dir.to_str().unwrap();
    let load = || Replicas::<Text>::load(spec, &LoadOptions::default(), &[cpu_map()]).unwrap();
    let mut prompts = Prompts::default_prompts().unwrap();
    prompts.decomposer.max_new_tokens = 5;
    prompts.reasoner.max_new_tokens = 9;
    prompts.synthesizer.max_new_tokens = 3;
    let always_reason = Strategy::new(StrategyKind::AlwaysReason, 0.16, None).unwrap();
    let mut jobs = Vec::new();
    for q in 0..4 {
        for strategy in [fixed_k(1), fixed_k(2), always_reason.clone()] {
            jobs.push(Job {
                question: question(&format!("q{q}"), 1),
                strategy,
                params: params(0.05),
                step_cap: 4,
                seed: q,
            });
        }
    }
    let lock_step = FleetLlm::new(load(), spec, 3);
    assert!(lock_step.stream().unwrap().is_none());
    let mut want = RecordsFile::open(&tmp.path().join("lock_step.jsonl")).unwrap();
    run_jobs(
        jobs.clone(),
        &lock_step,
        &retriever,
        &prompts,
        &mut want,
        8,
        &mut |_| {},
    )
    .unwrap();
    // Three decode slots for eight questions in flight: calls wait for slots and join as
    // others finish. Two replicas in this process: each call goes to the one with less work.
    // Tokens read back after every decode step, and after every third: the same records.
    for steps in [1, 3] {
        let two =
            Replicas::<Text>::load(spec, &LoadOptions::default(), &[cpu_map(), cpu_map()]).unwrap();
        assert_eq!(two.in_processes(), 0);
        let continuous = FleetLlm::new(two, spec, 3)
            .with_continuous_batching(64 << 20)
            .with_scheduler_steps(steps);
        let mut got =
            RecordsFile::open(&tmp.path().join(format!("continuous-{steps}.jsonl"))).unwrap();
        let progress = run_jobs(
            jobs.clone(),
            &continuous,
            &retriever,
            &prompts,
            &mut got,
            8,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(progress.ran, jobs.len());
        for j in &jobs {
            let what = format!("{}, read every {steps}", j.key());
            let (a, b) = (want.get(&j.key()).unwrap(), got.get(&j.key()).unwrap());
            assert_eq!(a.final_text, b.final_text, "{what}");
            assert_eq!(a.notes, b.notes, "{what}");
            assert_eq!(a.queries, b.queries, "{what}");
            assert_eq!(a.evidence, b.evidence, "{what}");
            assert_eq!(a.episode, b.episode, "{what}");
            assert_eq!(a.answer, b.answer, "{what}");
            assert_eq!(
                (a.llm_calls, a.prompt_tokens, a.new_tokens),
                (b.llm_calls, b.prompt_tokens, b.new_tokens),
                "{what}"
            );
        }
        // The same calls, counted the same; the model ran each distinct call once either way.
        let (s, c) = (lock_step.stats(), continuous.stats());
        assert_eq!((s.calls, s.cache_hits), (c.calls, c.cache_hits));
        assert_eq!(
            (s.prompt_tokens, s.new_tokens),
            (c.prompt_tokens, c.new_tokens)
        );
        // A question's later calls extend its earlier prompts, and all share the system prompt:
        // their leading blocks were not computed again.
        assert_eq!(s.cached_prompt_tokens, 0);
        assert!(
            c.cached_prompt_tokens > c.prompt_tokens / 4,
            "{} of {} prompt tokens reused",
            c.cached_prompt_tokens,
            c.prompt_tokens
        );
    }
}
