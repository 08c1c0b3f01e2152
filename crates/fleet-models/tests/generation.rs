//! Generation behaviour beyond greedy parity: sampling reproducibility, stop strings, streaming,
//! per-request limits, and the errors users meet with bad input.

use std::path::{Path, PathBuf};

use fleet_models::{
    DType, DeviceLocation, DeviceMap, FinishReason, GenerationRequest, LoadOptions, ModelError,
    SamplingParams, TextModel,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn load(dir: &Path) -> fleet_models::Result<TextModel> {
    TextModel::load(dir.to_str().unwrap(), &LoadOptions::default())
}

fn sampled(prompt: Vec<u32>, seed: u64) -> GenerationRequest {
    GenerationRequest {
        prompt_ids: prompt,
        max_new_tokens: 12,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: Some(50),
            top_p: Some(0.95),
            seed,
            min_p: None,
            repetition_penalty: None,
        },
        stop_strings: vec![],
    }
}

#[test]
fn seeded_sampling_repeats_and_differs_across_seeds() {
    let model = load(&fixture("qwen2-tiny")).unwrap();
    let prompt = model
        .tokenizer()
        .unwrap()
        .encode("The O-RAN fronthaul")
        .unwrap();
    let a = model.generate(&[sampled(prompt.clone(), 1)], None).unwrap();
    let b = model.generate(&[sampled(prompt.clone(), 1)], None).unwrap();
    assert_eq!(a[0].token_ids, b[0].token_ids);
    // Alone or in a batch with other requests: the same seed gives the same tokens.
    let batch = model
        .generate(
            &[sampled(vec![5, 6, 7], 9), sampled(prompt.clone(), 1)],
            None,
        )
        .unwrap();
    assert_eq!(batch[1].token_ids, a[0].token_ids);
    let others: Vec<Vec<u32>> = (2..8)
        .map(|s| {
            model.generate(&[sampled(prompt.clone(), s)], None).unwrap()[0]
                .token_ids
                .clone()
        })
        .collect();
    assert!(
        others.iter().any(|o| *o != a[0].token_ids),
        "six seeds all gave the same tokens"
    );
}

#[test]
fn stop_strings_streaming_and_limits() {
    let model = load(&fixture("qwen3-tiny")).unwrap();
    let tok = model.tokenizer().unwrap();
    let prompt = tok.encode("Open RAN radio unit").unwrap();
    let free = model
        .generate(&[GenerationRequest::greedy(prompt.clone(), 24)], None)
        .unwrap();
    let text = free[0].text.clone();
    assert!(text.chars().count() > 6, "need some text to cut: {text:?}");
    // Without streaming or stop strings the text is decoded once, at the row's end: the same
    // text as the stream's, token by token.
    assert_eq!(text, tok.decode(&free[0].token_ids, true).unwrap());
    let mut streamed_free = String::new();
    let mut on_free = |e: fleet_models::StreamEvent<'_>| streamed_free.push_str(e.text_delta);
    let out_free = model
        .generate(
            &[GenerationRequest::greedy(prompt.clone(), 24)],
            Some(&mut on_free),
        )
        .unwrap();
    assert_eq!(out_free[0].text, text);
    assert_eq!(streamed_free, text);

    // Stop at a piece of the greedy text: the output is cut right before it.
    let cut_at = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[cut_at..].chars().take(3).collect();
    let first = text.find(&stop).unwrap();
    let mut req = GenerationRequest::greedy(prompt.clone(), 24);
    req.stop_strings = vec![stop.clone()];
    let mut streamed = String::new();
    let mut events = 0;
    let mut on_token = |e: fleet_models::StreamEvent<'_>| {
        assert_eq!(e.request, 0);
        streamed.push_str(e.text_delta);
        events += 1;
    };
    let out = model.generate(&[req], Some(&mut on_token)).unwrap();
    assert_eq!(out[0].finish_reason, FinishReason::StopString);
    assert_eq!(out[0].text, text[..first]);
    assert_eq!(
        streamed, out[0].text,
        "the stream carries exactly the final text"
    );
    assert_eq!(events, out[0].token_ids.len());

    // Per-request max_new_tokens in one batch.
    let reqs = vec![
        GenerationRequest::greedy(prompt.clone(), 3),
        GenerationRequest::greedy(vec![11, 12], 7),
        GenerationRequest::greedy(prompt.clone(), 0),
    ];
    let out = model.generate(&reqs, None).unwrap();
    assert!(out[0].token_ids.len() <= 3 && out[1].token_ids.len() <= 7);
    assert!(out[2].token_ids.is_empty());
    assert_eq!(
        out[0].token_ids[..],
        free[0].token_ids[..out[0].token_ids.len()]
    );
}

#[test]
fn eos_ends_a_row_and_is_reported() {
    // The golden with an early stop (fewer tokens than max_new_tokens) ends on an EOS id.
    let model = load(&fixture("qwen2-tiny")).unwrap();
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("golden/qwen2-tiny.json")).unwrap())
            .unwrap();
    let eos = model.eos_ids();
    let mut saw_eos = false;
    for case in g["greedy"].as_array().unwrap() {
        let ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
        let n = case["max_new_tokens"].as_u64().unwrap() as usize;
        let out = model
            .generate(&[GenerationRequest::greedy(ids, n)], None)
            .unwrap();
        if out[0].token_ids.len() < n {
            assert_eq!(out[0].finish_reason, FinishReason::Eos);
            assert!(eos.contains(out[0].token_ids.last().unwrap()));
            saw_eos = true;
        } else {
            assert_eq!(out[0].finish_reason, FinishReason::Length);
        }
    }
    assert!(saw_eos, "the goldens include an EOS stop");
}

fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let e = entry.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

#[test]
fn bad_checkpoints_name_the_file_and_fix() {
    // Missing config field.
    let d = copy_fixture("qwen2-tiny");
    let cfg = std::fs::read_to_string(d.path().join("config.json")).unwrap();
    let cfg = cfg.replace("\"num_hidden_layers\"", "\"num_hidden_layers_typo\"");
    std::fs::write(d.path().join("config.json"), cfg).unwrap();
    let e = load(d.path()).err().unwrap().to_string();
    assert!(
        e.contains("config.json") && e.contains("num_hidden_layers"),
        "{e}"
    );

    // Truncated shard.
    let d = copy_fixture("qwen2-tiny-tied-sharded");
    let shard = d.path().join("model-00002-of-00003.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let e = load(d.path()).err().unwrap().to_string();
    assert!(
        e.contains("model-00002-of-00003.safetensors") && e.contains("truncated"),
        "{e}"
    );

    // Missing shard.
    std::fs::remove_file(&shard).unwrap();
    let e = load(d.path()).err().unwrap().to_string();
    assert!(
        e.contains("model-00002-of-00003.safetensors") && e.contains("missing"),
        "{e}"
    );

    // Weights of another shape than the config says.
    let d = copy_fixture("qwen2-tiny");
    let cfg = std::fs::read_to_string(d.path().join("config.json")).unwrap();
    let cfg = cfg.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96");
    std::fs::write(d.path().join("config.json"), cfg).unwrap();
    let e = load(d.path()).err().unwrap().to_string();
    assert!(
        e.contains("mlp.gate_proj.weight") && e.contains("shape"),
        "{e}"
    );

    // Missing tokenizer: the model loads, text features say what is missing.
    let d = copy_fixture("qwen2-tiny");
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    let model = load(d.path()).unwrap();
    let e = model.tokenizer().err().unwrap().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn bad_requests_are_errors_not_panics() {
    let model = load(&fixture("qwen2-tiny")).unwrap();
    let max_pos = model.model.config().max_position_embeddings;
    let long = vec![1u32; max_pos];
    let e = model
        .generate(&[GenerationRequest::greedy(long, 8)], None)
        .unwrap_err();
    assert!(matches!(e, ModelError::BadInput(_)));
    assert!(e.to_string().contains("max_position_embeddings"), "{e}");

    let vocab = model.model.config().vocab_size as u32;
    let e = model
        .model
        .logits(&[vec![1, vocab + 5]])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&(vocab + 5).to_string()) && e.contains("vocab"),
        "{e}"
    );

    let e = model
        .generate(&[GenerationRequest::greedy(vec![], 4)], None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty prompt"), "{e}");

    let mut r = GenerationRequest::greedy(vec![1, 2], 4);
    r.sampling.temperature = -1.0;
    assert!(model
        .generate(&[r], None)
        .unwrap_err()
        .to_string()
        .contains("temperature"));

    // A device map of the wrong length, and a GPU in a CPU build.
    let cfg = model.model.config();
    let bad_map = DeviceMap::single(DeviceLocation::Cpu, cfg.num_hidden_layers + 1);
    let opts = LoadOptions {
        device_map: Some(bad_map),
        ..LoadOptions::default()
    };
    let e = TextModel::load(fixture("qwen2-tiny").to_str().unwrap(), &opts)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("layer"), "{e}");
    if !cfg!(feature = "cuda") {
        let opts = LoadOptions {
            device_map: Some(DeviceMap::single(
                DeviceLocation::Cuda(7),
                cfg.num_hidden_layers,
            )),
            dtype: DType::BF16,
            ..LoadOptions::default()
        };
        let e = TextModel::load(fixture("qwen2-tiny").to_str().unwrap(), &opts)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("cuda:7"), "{e}");
    }
}

/// Each row must fit the model's positions, not the padded batch: a long prompt with a short
/// reply and a short prompt with a long reply share a batch whose cache is longer than
/// max_position_embeddings, and the short row equals its generation alone.
#[test]
fn rows_that_fit_run_together_even_when_the_padded_batch_does_not() {
    let model = load(&fixture("qwen2-tiny")).unwrap();
    let max = model.model.config().max_position_embeddings;
    let long: Vec<u32> = (0..max - 4).map(|i| (i % 900) as u32 + 10).collect();
    let short = GenerationRequest::greedy(vec![11, 12, 13], 40);
    let batch = [GenerationRequest::greedy(long.clone(), 4), short.clone()];
    let out = model.generate(&batch, None).unwrap();
    let alone = model.generate(std::slice::from_ref(&short), None).unwrap();
    assert_eq!(out[1].token_ids, alone[0].token_ids);
    let too_long = GenerationRequest::greedy(long, 5);
    let err = model.generate(&[too_long], None).unwrap_err().to_string();
    assert!(
        err.contains("request 0") && err.contains("max_position_embeddings"),
        "{err}"
    );
}

/// Plain temperature sampling on the device (Gumbel-max): the frequencies follow
/// softmax(logits / T), a row's draw depends on its seed and step only, and seeded requests
/// repeat alone or in a batch.
#[test]
fn temperature_sampling_on_the_device_follows_the_softmax() {
    use candle_core::{Device, Tensor};
    use fleet_models::ops::{sample_tokens, RowSampling};
    let logits = [0.0f32, 1.0, 2.0, -1.0];
    for temperature in [1.0f64, 0.5] {
        let rows = 40_000;
        let flat: Vec<f32> = (0..rows).flat_map(|_| logits).collect();
        let t = Tensor::from_vec(flat, (rows, 4), &Device::Cpu).unwrap();
        let params: Vec<RowSampling> = (0..rows as u64)
            .map(|r| RowSampling {
                seed: r * 7919 + 1,
                counter: (r % 3) as u32,
                temperature,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                repetition_penalty: 1.0,
            })
            .collect();
        let seen: Vec<&[u32]> = vec![&[]; rows];
        let (ids, _) = sample_tokens(&t, &params, &seen).unwrap();
        let z: f64 = logits.iter().map(|&l| (l as f64 / temperature).exp()).sum();
        for (v, &l) in logits.iter().enumerate() {
            let want = (l as f64 / temperature).exp() / z;
            let got = ids.iter().filter(|&&i| i == v as u32).count() as f64 / rows as f64;
            assert!(
                (got - want).abs() < 0.01,
                "T={temperature} token {v}: {got:.4} vs {want:.4}"
            );
        }
        // The same seed and step give the same token.
        let (again, _) = sample_tokens(&t, &params, &seen).unwrap();
        assert_eq!(ids, again);
    }

    let model = load(&fixture("qwen2-tiny")).unwrap();
    let plain = |seed| GenerationRequest {
        prompt_ids: vec![5, 6, 7],
        max_new_tokens: 8,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            seed,
            min_p: None,
            repetition_penalty: None,
        },
        stop_strings: vec![],
    };
    let alone = model.generate(&[plain(3)], None).unwrap();
    let batch = model
        .generate(&[plain(4), plain(3), sampled(vec![9, 9], 1)], None)
        .unwrap();
    assert_eq!(alone[0].token_ids, batch[1].token_ids);
    assert_ne!(batch[0].token_ids, batch[1].token_ids);
}

/// The sampling kernel against its CPU twin (with `--features cuda`, on a machine with a GPU):
/// a vocabulary of Qwen's size, every option alone and together, greedy and sampled rows in
/// one batch. The two compute exp and ln in their own libraries, so a row whose draw or
/// threshold sits within an ulp may differ; all but a few rows must agree.
#[cfg(feature = "cuda")]
#[test]
fn gpu_sampling_kernel_matches_its_twin() {
    use candle_core::{Device, Tensor};
    use fleet_models::ops::{sample_tokens, RowSampling};
    let Ok(gpu) = Device::new_cuda(0) else {
        eprintln!("gpu_sampling_kernel_matches_its_twin: no CUDA device; not run");
        return;
    };
    let vocab = 151_936;
    let rows = 48;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let logits: Vec<f32> = (0..rows * vocab)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // A few tokens stand out, as in a real distribution.
            let u = (x >> 40) as f32 / (1u64 << 24) as f32;
            if x.is_multiple_of(1000) {
                8.0 + 4.0 * u
            } else {
                4.0 * u - 2.0
            }
        })
        .collect();
    let seen: Vec<u32> = (0..200).map(|i| (i * 7919) % vocab as u32).collect();
    let params: Vec<RowSampling> = (0..rows)
        .map(|r| {
            let o = r % 8;
            RowSampling {
                seed: 1000 + r as u64,
                counter: (r / 8) as u32,
                temperature: if o == 0 { 0.0 } else { 0.7 },
                top_k: if o == 2 || o == 6 { 50 } else { 0 },
                top_p: if o == 3 || o == 6 { 0.9 } else { 1.0 },
                min_p: if o == 4 || o == 6 { 0.05 } else { 0.0 },
                repetition_penalty: if o == 5 || o == 6 || o == 7 { 1.3 } else { 1.0 },
            }
        })
        .collect();
    let seen_rows: Vec<&[u32]> = vec![&seen; rows];
    let cpu = Tensor::from_vec(logits, (rows, vocab), &Device::Cpu).unwrap();
    let (want, want_lp) = sample_tokens(&cpu, &params, &seen_rows).unwrap();
    let (got, got_lp) = sample_tokens(&cpu.to_device(&gpu).unwrap(), &params, &seen_rows).unwrap();
    let differ: Vec<usize> = (0..rows).filter(|&r| want[r] != got[r]).collect();
    assert!(
        differ.len() <= 2,
        "rows {differ:?} differ: {want:?} vs {got:?}"
    );
    for r in 0..rows {
        if want[r] == got[r] {
            assert!(
                (want_lp[r] - got_lp[r]).abs() < 1e-3,
                "row {r}: {} vs {}",
                want_lp[r],
                got_lp[r]
            );
        }
    }
    // Replays draw the same.
    let (again, _) = sample_tokens(&cpu.to_device(&gpu).unwrap(), &params, &seen_rows).unwrap();
    assert_eq!(again, got);
    // bf16 and f16 logits (a graph step's, in the model's dtype) read as they are: the same
    // draws and log-probabilities, bit for bit, as the f32 kernel on the same values widened.
    for dtype in [candle_core::DType::BF16, candle_core::DType::F16] {
        let half = cpu.to_dtype(dtype).unwrap().to_device(&gpu).unwrap();
        let widened = half.to_dtype(candle_core::DType::F32).unwrap();
        let (got_half, lp_half) = sample_tokens(&half, &params, &seen_rows).unwrap();
        let (got_wide, lp_wide) = sample_tokens(&widened, &params, &seen_rows).unwrap();
        assert_eq!(got_half, got_wide, "{dtype:?}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&lp_half), bits(&lp_wide), "{dtype:?}");
    }
}
