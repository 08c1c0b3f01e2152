//! Parity with HF transformers on the tiny checkpoints of tests/fixtures (made by
//! scripts/fixtures/make_qwen_fixtures.py; the goldens are transformers' float32 outputs).
//!
//! `FLEET_TEST_DEVICES` (default `cpu`) names the device(s) the models run on; a comma list
//! splits the layers over them, e.g. `cpu,cuda:0` or `cuda:0,cuda:1` on the GPU machine.

use std::path::{Path, PathBuf};

use fleet_models::{
    continuation_logprobs, ChatMessage, DType, DeviceLocation, DeviceMap, GenerationRequest,
    LoadOptions, TextModel,
};
use serde::Deserialize;

mod devices;
use devices::test_devices;

const CHECKPOINTS: [&str; 3] = ["qwen2-tiny", "qwen2-tiny-tied-sharded", "qwen3-tiny"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

#[derive(Deserialize)]
struct Golden {
    logits: Vec<LogitsCase>,
    greedy: Vec<GreedyCase>,
    logprobs: Vec<LogprobCase>,
}

#[derive(Deserialize)]
struct LogitsCase {
    input_ids: Vec<u32>,
    positions: Vec<usize>,
    logits: Vec<Vec<f32>>,
}

#[derive(Deserialize, Clone)]
struct GreedyCase {
    input_ids: Vec<u32>,
    max_new_tokens: usize,
    output_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct LogprobCase {
    input_ids: Vec<u32>,
    continuation_ids: Vec<u32>,
    logprobs: Vec<f32>,
}

fn golden(name: &str) -> Golden {
    let p = fixtures().join("golden").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn load_on(name: &str, devices: &[DeviceLocation]) -> TextModel {
    let dir = fixtures().join(name);
    let cfg = fleet_models::QwenConfig::from_file(&dir.join("config.json")).unwrap();
    let map = DeviceMap::split_layers(devices, cfg.num_hidden_layers).unwrap();
    let opts = LoadOptions {
        dtype: DType::F32,
        device_map: Some(map),
        ..LoadOptions::default()
    };
    TextModel::load(dir.to_str().unwrap(), &opts).unwrap()
}

fn load(name: &str) -> TextModel {
    load_on(name, &test_devices())
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn logits_match_transformers_within_1e_4() {
    for name in CHECKPOINTS {
        let model = load(name);
        for case in golden(name).logits {
            let logits: Vec<Vec<Vec<f32>>> = model
                .model
                .logits(std::slice::from_ref(&case.input_ids))
                .unwrap()
                .to_vec3()
                .unwrap();
            for (pos, want) in case.positions.iter().zip(&case.logits) {
                let d = max_abs_diff(&logits[0][*pos], want);
                assert!(
                    d < 1e-4,
                    "{name}: len {} position {pos}: max abs diff {d}",
                    case.input_ids.len()
                );
            }
        }
    }
}

#[test]
fn greedy_continuations_are_token_identical() {
    for name in CHECKPOINTS {
        let model = load(name);
        for case in golden(name).greedy {
            let out = model
                .generate(
                    &[GenerationRequest::greedy(
                        case.input_ids.clone(),
                        case.max_new_tokens,
                    )],
                    None,
                )
                .unwrap();
            assert_eq!(
                out[0].token_ids,
                case.output_ids,
                "{name}: prompt of {} tokens",
                case.input_ids.len()
            );
        }
    }
}

/// All greedy prompts of a checkpoint in one left-padded batch give what each gives alone
/// (and what transformers gives).
#[test]
fn batched_left_padded_generation_equals_one_by_one() {
    for name in CHECKPOINTS {
        let model = load(name);
        let cases = golden(name).greedy;
        let requests: Vec<GenerationRequest> = cases
            .iter()
            .map(|c| GenerationRequest::greedy(c.input_ids.clone(), c.max_new_tokens))
            .collect();
        let lengths: Vec<usize> = cases.iter().map(|c| c.input_ids.len()).collect();
        assert!(
            lengths.iter().any(|&l| l != lengths[0]),
            "prompts must differ in length"
        );
        let batched = model.generate(&requests, None).unwrap();
        for (i, case) in cases.iter().enumerate() {
            let alone = model
                .generate(std::slice::from_ref(&requests[i]), None)
                .unwrap();
            assert_eq!(
                batched[i].token_ids, alone[0].token_ids,
                "{name}: request {i}"
            );
            assert_eq!(
                batched[i].token_ids, case.output_ids,
                "{name}: request {i} vs transformers"
            );
        }
    }
}

#[test]
fn logprobs_match_transformers() {
    for name in CHECKPOINTS {
        let model = load(name);
        let g = golden(name);
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = g
            .logprobs
            .iter()
            .map(|c| (c.input_ids.clone(), c.continuation_ids.clone()))
            .collect();
        // Batched (left-padded) and one at a time.
        let batched = continuation_logprobs(&model.model, &pairs, model.pad_id()).unwrap();
        for (i, case) in g.logprobs.iter().enumerate() {
            let d = max_abs_diff(&batched[i], &case.logprobs);
            assert!(d < 1e-4, "{name}: case {i} batched: {d}");
            let alone =
                continuation_logprobs(&model.model, &pairs[i..i + 1], model.pad_id()).unwrap();
            let d = max_abs_diff(&alone[0], &case.logprobs);
            assert!(d < 1e-4, "{name}: case {i} alone: {d}");
        }
    }
}

/// Splitting the layers into groups (one device each, in order) changes nothing.
#[test]
fn split_device_map_gives_the_same_logits() {
    let devices = test_devices();
    for name in CHECKPOINTS {
        let whole = load_on(name, &devices[..1]);
        let ids = &golden(name).logits[1].input_ids;
        let want: Vec<f32> = whole
            .model
            .logits(std::slice::from_ref(ids))
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for groups in [2, 4] {
            let split: Vec<DeviceLocation> =
                (0..groups).map(|g| devices[g % devices.len()]).collect();
            let model = load_on(name, &split);
            assert_eq!(model.model.device_map().layers.len(), 4);
            let got: Vec<f32> = model
                .model
                .logits(std::slice::from_ref(ids))
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let d = max_abs_diff(&got, &want);
            assert!(d < 1e-5, "{name}: {groups} groups: {d}");
        }
    }
}

#[derive(Deserialize)]
struct ChatCase {
    checkpoint: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    #[serde(default)]
    extra: serde_json::Map<String, serde_json::Value>,
    text: String,
    input_ids: Vec<u32>,
}

#[test]
fn chat_templates_render_exactly_as_transformers() {
    let p = fixtures().join("golden/chat_templates.json");
    let cases: Vec<ChatCase> = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    assert!(cases.len() >= 3);
    for (i, case) in cases.iter().enumerate() {
        let dir = fixtures().join(&case.checkpoint);
        let template =
            fleet_models::ChatTemplate::from_tokenizer_config(&dir.join("tokenizer_config.json"))
                .unwrap()
                .unwrap();
        let text = template
            .render(&case.messages, case.add_generation_prompt, &case.extra)
            .unwrap();
        assert_eq!(text, case.text, "case {i} ({})", case.checkpoint);
        let tok = fleet_models::TextTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        assert_eq!(
            tok.encode(&text).unwrap(),
            case.input_ids,
            "case {i} token ids"
        );
    }
}
