//! The Qwen3-VL judge on the tiny fixture checkpoint (random weights): requests become the
//! checkpoint's prompts, batches equal one-by-one, and its gibberish replies are recorded and
//! counted as parse failures — never given a score.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{load, prompt_set, spec, write_benchmark, GenItem, SINGLE_SET, VIE_SET};
use fleet_dist::ShardSpec;
use fleet_judge::judge::{Decoding, Judge, JudgeRequest, Part, Sampling};
use fleet_judge::qwen::{judge_model_id, load_judges_on, messages, Qwen3VlJudge};
use fleet_judge::report::Report;
use fleet_judge::run::{RunOptions, Session, SessionOptions};
use fleet_models::{DeviceLocation, DeviceMap, LoadOptions, VisionLanguageModel};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn tiny_judges(n: usize) -> (Vec<Qwen3VlJudge>, String) {
    tiny_judges_with(n, LoadOptions::default())
}

fn tiny_judges_with(n: usize, opts: LoadOptions) -> (Vec<Qwen3VlJudge>, String) {
    let dir = fixture("qwen3-vl-tiny");
    let spec = dir.to_str().unwrap();
    let id = judge_model_id(spec, &opts).unwrap();
    let maps = vec![DeviceMap::single(DeviceLocation::Cpu, 4); n];
    (load_judges_on(spec, &opts, &maps, &id).unwrap(), id)
}

/// Seeded sampling with top-p and top-k, `max_new_tokens` at most.
fn sampled(max_new_tokens: usize) -> Decoding {
    Decoding {
        max_new_tokens,
        sampling: Some(Sampling {
            temperature: 0.8,
            top_p: Some(0.9),
            top_k: Some(30),
            seed: 5,
            sampler_version: fleet_models::ops::SAMPLER_VERSION,
        }),
    }
}

fn requests() -> Vec<JudgeRequest> {
    let img = |name: &str| Arc::new(image::open(fixture("vision").join(name)).unwrap());
    vec![
        JudgeRequest {
            system: Some("You judge image edits.".into()),
            user: vec![
                Part::Image(img("a_48x64.png")),
                Part::Image(img("b_37x100.png")),
                Part::Text("Make the sky red. Reply `Score: X`.".into()),
            ],
        },
        JudgeRequest {
            system: None,
            user: vec![
                Part::Image(img("c_90x33.png")),
                Part::Text("Rate it.".into()),
            ],
        },
        JudgeRequest {
            system: Some("Be strict.".into()),
            user: vec![
                Part::Image(img("e_100x33.png")),
                Part::Image(img("a_48x64.png")),
                Part::Text("Remove the cat.".into()),
            ],
        },
    ]
}

#[test]
fn a_request_is_the_prompt_the_checkpoint_template_makes() {
    let dir = fixture("qwen3-vl-tiny");
    let vlm = VisionLanguageModel::load(dir.to_str().unwrap(), &LoadOptions::default()).unwrap();
    let r = &requests()[0];
    let (m, images) = messages(r);
    let text = vlm
        .processor
        .chat_template
        .render_json(m, true, &Default::default())
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou judge image edits.<|im_end|>\n<|im_start|>user\n\
         <|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>\
         Make the sky red. Reply `Score: X`.<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(images.len(), 2);
}

#[test]
fn a_batch_judges_as_one_by_one_greedy_and_seeded() {
    let (mut judges, id) = tiny_judges(1);
    let judge = &mut judges[0];
    assert_eq!(judge.model_id(), id);
    let reqs = requests();
    for decoding in [Decoding::greedy(6), sampled(6)] {
        let batch = judge.judge(&reqs, &decoding);
        assert_eq!(batch.len(), 3);
        for (i, r) in reqs.iter().enumerate() {
            let alone = judge.judge(std::slice::from_ref(r), &decoding).remove(0);
            assert_eq!(batch[i], alone, "request {i}, {}", decoding.describe());
            let reply = alone.unwrap();
            assert!(reply.new_tokens >= 1 && reply.new_tokens <= 6);
        }
        // The same seed gives the same replies.
        assert_eq!(judge.judge(&reqs, &decoding), batch);
    }
}

/// edit-score --max-num-seqs: a call's requests stream through fewer decode slots (each
/// newcomer's vision tower and prefill between the others' steps): the same replies.
#[test]
fn continuous_batching_judges_as_the_left_padded_batch() {
    let (mut plain, _) = tiny_judges(1);
    let (mut streamed, _) = tiny_judges_with(
        1,
        LoadOptions {
            decode_slots: Some(2),
            ..LoadOptions::default()
        },
    );
    let reqs: Vec<JudgeRequest> = requests().into_iter().cycle().take(7).collect();
    for decoding in [Decoding::greedy(9), sampled(9)] {
        assert_eq!(
            streamed[0].judge(&reqs, &decoding),
            plain[0].judge(&reqs, &decoding),
            "{}",
            decoding.describe()
        );
    }
}

#[test]
fn the_model_id_is_the_content_and_the_dtype() {
    let dir = fixture("qwen3-vl-tiny");
    let f32_opts = LoadOptions::default();
    let id = judge_model_id(dir.to_str().unwrap(), &f32_opts).unwrap();
    assert!(id.starts_with("qwen3-vl-tiny@fnv1a64w:"), "{id}");
    assert!(id.ends_with(" f32"), "{id}");
    // The same files elsewhere: the same id; a changed config: another.
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("qwen3-vl-tiny");
    std::fs::create_dir(&copy).unwrap();
    for f in std::fs::read_dir(&dir).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, copy.join(f.file_name().unwrap())).unwrap();
    }
    assert_eq!(
        judge_model_id(copy.to_str().unwrap(), &f32_opts).unwrap(),
        id
    );
    let cfg = copy.join("generation_config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("997", "996")).unwrap();
    assert_ne!(
        judge_model_id(copy.to_str().unwrap(), &f32_opts).unwrap(),
        id
    );
    let bf16 = LoadOptions {
        dtype: fleet_models::DType::BF16,
        ..LoadOptions::default()
    };
    assert!(judge_model_id(dir.to_str().unwrap(), &bf16)
        .unwrap()
        .ends_with(" bf16"));
}

#[test]
fn a_text_only_checkpoint_is_refused_naming_qwen3_vl() {
    let dir = fixture("qwen3-tiny");
    let opts = LoadOptions::default();
    let maps = vec![DeviceMap::single(DeviceLocation::Cpu, 2)];
    let err = match load_judges_on(dir.to_str().unwrap(), &opts, &maps, "x") {
        Ok(_) => panic!("a text-only checkpoint loaded as a judge"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("qwen3_vl"), "{err}");
    assert!(err.contains("config.json"), "{err}");
}

/// The whole loop with the real (random) judge: every call recorded, gibberish counted as
/// parse failures with the raw reply, no score anywhere; a rerun judges nothing.
#[test]
fn random_weights_give_recorded_and_counted_parse_failures() {
    let tmp = tempfile::tempdir().unwrap();
    let bench = tmp.path().join("bench");
    let items: Vec<GenItem> = (1..=5)
        .map(|n| GenItem {
            n,
            category: if n % 2 == 0 { "color" } else { "style" },
        })
        .collect();
    write_benchmark(&bench, &items);
    let loaded = load(&bench);
    let out = tmp.path().join("out");
    for (set_name, text, calls) in [("single.toml", SINGLE_SET, 1), ("vie.toml", VIE_SET, 2)] {
        let (judges, id) = tiny_judges(2);
        let prompts = prompt_set(tmp.path(), set_name, text);
        let mut s = spec(prompts, &id);
        s.decoding = Decoding::greedy(8);
        let dir = out.join(set_name);
        let session = Session::open(&dir, s.clone(), &SessionOptions::default()).unwrap();
        let plan = session.plan(&loaded, ShardSpec::single()).unwrap();
        let options = RunOptions {
            batch_size: 2,
            progress: false,
            ..RunOptions::default()
        };
        let info = session.run(judges, &plan, &options).unwrap();
        assert_eq!(info.calls_total, 5 * calls);
        assert_eq!(info.calls_judged, 5 * calls);
        assert_eq!(info.calls_recorded, 5 * calls);
        assert!(info.failed.is_empty(), "{:?}", info.failed);
        assert_eq!(info.workers.len(), 2);
        let records: Vec<_> = plan
            .tasks
            .iter()
            .map(|t| session.store().get(&t.key).unwrap())
            .collect();
        // Random weights reply gibberish: each is a parse failure with its raw text.
        let failed = records.iter().filter(|r| !r.parsed()).count();
        assert_eq!(info.parse_failed_now, failed);
        for r in records.iter().filter(|r| !r.parsed()) {
            assert!(r.score.is_none() && r.scores.is_none());
            assert!(r.parse_failed.as_deref().is_some_and(|p| !p.is_empty()));
            assert!(r.new_tokens >= 1);
        }
        assert!(failed >= 4, "{failed} of {} parse failures", records.len());
        drop(session);
        let report = Report::from_dir(&dir, "test").unwrap();
        let pf_calls: usize = report
            .categories
            .iter()
            .flat_map(|c| c.parse_failed_calls.values())
            .sum();
        assert_eq!(pf_calls, failed);
        let items_failed: usize = report.categories.iter().map(|c| c.parse_failed).sum();
        assert!(items_failed >= failed / calls, "{items_failed}");
        // A rerun finds everything done.
        let (judges, _) = tiny_judges(1);
        let session = Session::open(&dir, s, &SessionOptions::default()).unwrap();
        let plan = session.plan(&loaded, ShardSpec::single()).unwrap();
        let info = session.run(judges, &plan, &options).unwrap();
        assert_eq!((info.calls_resumed, info.calls_judged), (5 * calls, 0));
    }
}

/// Issue 23: an item whose call can never fit the judge is skipped before anything loads, by
/// the checkpoint's processor (no weights), instead of failing at judge time on every rerun.
#[test]
fn items_too_long_for_the_judge_are_skipped_up_front() {
    use fleet_judge::benchmark::SkipKind;
    use fleet_judge::qwen::skip_too_long;
    use fleet_models::qwen3_vl::VlProcessor;

    let dir = tempfile::tempdir().unwrap();
    let items: Vec<GenItem> = (1..=3).map(|n| GenItem { n, category: "A" }).collect();
    let bench = write_benchmark(dir.path(), &items);
    // Item 2's instruction alone is longer than the tiny judge's 2048 positions.
    let text = std::fs::read_to_string(&bench).unwrap();
    let long = "paint the sky a deep red ".repeat(600);
    std::fs::write(&bench, text.replace("edit number 2", long.trim())).unwrap();
    let prompts = prompt_set(dir.path(), "single.toml", SINGLE_SET);
    let processor = VlProcessor::load(
        fixture("qwen3-vl-tiny").to_str().unwrap(),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(processor.max_positions(), 2048);

    let mut loaded = load(dir.path());
    assert_eq!(
        skip_too_long(&mut loaded, &prompts, &processor, 64, false).unwrap(),
        1
    );
    let ids: Vec<&str> = loaded.items.iter().map(|i| i.id.as_str()).collect();
    assert_eq!(ids, ["pair-1", "pair-3"]);
    let s = &loaded.skipped[0];
    assert_eq!((s.id.as_str(), s.kind), ("pair-2", SkipKind::PromptTooLong));
    assert!(
        s.reason.contains("max_position_embeddings = 2048"),
        "{}",
        s.reason
    );
    assert!(s.reason.contains("call score"), "{}", s.reason);

    // The reply's room counts too: with max_new_tokens near the limit nothing fits.
    let mut loaded = load(dir.path());
    assert_eq!(
        skip_too_long(&mut loaded, &prompts, &processor, 2040, false).unwrap(),
        3
    );
    assert!(loaded.items.is_empty());
    // A short prompt with a modest reply fits (the same count the model's prefill uses).
    let mut loaded = load(dir.path());
    loaded.items.retain(|i| i.id != "pair-2");
    assert_eq!(
        skip_too_long(&mut loaded, &prompts, &processor, 1024, true).unwrap(),
        0
    );
}
