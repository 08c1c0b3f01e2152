//! Continuous batching on a paged KV cache against the lock-step batch: the same requests give
//! the same tokens, whatever the decode slots, the block size or the prefixes shared; the
//! bookkeeping (refills, cached prompt tokens) is what it should be. On the CPU always; on the
//! GPU too when built with `cuda` and one is present.

use std::path::{Path, PathBuf};

#[cfg(feature = "cuda")]
use fleet_models::{DType, DeviceLocation, DeviceMap};
use fleet_models::{
    GenerationOutput, GenerationRequest, LoadOptions, PagedOptions, SamplingParams, TextModel,
};

/// Each test's turn on the devices. A GPU has one stream per process (`fleet_models::device`),
/// and a decode step captured as a CUDA graph on it must not have another thread's work
/// enqueued meanwhile: run side by side, five of these tests failed with
/// `CUDA_ERROR_INVALID_VALUE` on an H200 (2026-11-28), each alone passes. The jobs drive a
/// device from one thread; the tests take turns.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// The fixture on the CPU, and on GPU 0 when there is one (f32 both).
fn models(name: &str) -> Vec<(String, TextModel)> {
    let dir = fixture(name);
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    let mut out = vec![(
        format!("{name} cpu"),
        TextModel::load(dir.to_str().unwrap(), &LoadOptions::default()).unwrap(),
    )];
    #[cfg(feature = "cuda")]
    if candle_core::Device::new_cuda(0).is_ok() {
        let layers = fleet_models::QwenConfig::from_file(&dir.join("config.json"))
            .unwrap()
            .num_hidden_layers;
        let opts = LoadOptions {
            dtype: DType::F32,
            device_map: Some(DeviceMap::single(DeviceLocation::Cuda(0), layers)),
            ..LoadOptions::default()
        };
        out.push((
            format!("{name} cuda:0"),
            TextModel::load(dir.to_str().unwrap(), &opts).unwrap(),
        ));
    }
    out
}

fn request(prompt: Vec<u32>, max_new: usize, sampling: SamplingParams) -> GenerationRequest {
    GenerationRequest {
        prompt_ids: prompt,
        max_new_tokens: max_new,
        sampling,
        stop_strings: vec![],
    }
}

fn ids(outputs: &[GenerationOutput]) -> Vec<(Vec<u32>, String)> {
    outputs
        .iter()
        .map(|o| (o.token_ids.clone(), format!("{:?}", o.finish_reason)))
        .collect()
}

/// Prompts of many lengths (1 to 23 tokens), each its own reply length.
fn varied_requests(sampling: impl Fn(usize) -> SamplingParams) -> Vec<GenerationRequest> {
    (0..7)
        .map(|i| {
            let len = [1, 3, 4, 5, 9, 16, 23][i];
            let prompt: Vec<u32> = (0..len).map(|t| (t * 7 + i * 13 + 3) as u32 % 90).collect();
            request(prompt, 3 + (i * 5) % 11, sampling(i))
        })
        .collect()
}

#[test]
fn refilled_paged_batches_give_the_lock_step_tokens() {
    let _turn = one_at_a_time();
    for name in ["qwen2-tiny", "qwen3-tiny"] {
        for (what, model) in models(name) {
            let gen = model.generator();
            let greedy = varied_requests(|_| SamplingParams::greedy());
            let want = ids(&gen.generate(&greedy, None).unwrap());
            // The last two read tokens back every 4 and 5 steps (refills wait for them).
            for (max_batch, block_size, cuda_graphs, sync_every) in [
                (1, 4, false, 1),
                (3, 4, true, 1),
                (2, 8, false, 1),
                (8, 16, true, 1),
                (2, 8, false, 4),
                (3, 4, false, 5),
            ] {
                let options = PagedOptions {
                    max_batch,
                    block_size,
                    num_blocks: 256,
                    cuda_graphs,
                    sync_every,
                };
                let (got, stats) = gen.generate_paged(&greedy, &options, None).unwrap();
                assert_eq!(
                    ids(&got),
                    want,
                    "{what}: greedy, {max_batch} slots, blocks of {block_size}, read every \
                     {sync_every} steps"
                );
                assert_eq!(stats.max_running, max_batch.min(greedy.len()), "{what}");
            }
        }
    }
}

#[path = "common/kernel_shaped.rs"]
mod kernel_shaped;

/// [`kernel_shaped::model`] all on `device`.
fn kernel_shaped_model(device: &candle_core::Device) -> fleet_models::QwenModel {
    let location = match device {
        candle_core::Device::Cuda(_) => fleet_models::DeviceLocation::Cuda(0),
        _ => fleet_models::DeviceLocation::Cpu,
    };
    kernel_shaped::model(|layers| fleet_models::DeviceMap::single(location, layers))
}

#[test]
fn the_paged_decode_kernel_gives_the_lock_step_tokens_with_and_without_graphs() {
    let _turn = one_at_a_time();
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    let mut devices = vec![candle_core::Device::Cpu];
    #[cfg(feature = "cuda")]
    if let Ok(gpu) = candle_core::Device::new_cuda(0) {
        devices.push(gpu);
    }
    for device in devices {
        let model = kernel_shaped_model(&device);
        let gen = fleet_models::Generator::new(&model, None, Vec::new(), 0);
        // Request 1 is request 0 again (forked when admitted with it), to a shorter length.
        let requests: Vec<GenerationRequest> = [0, 0, 1, 2, 3, 4, 5]
            .into_iter()
            .enumerate()
            .map(|(k, i)| {
                let prompt: Vec<u32> = (0..(3 + 40 * i))
                    .map(|t| ((t * 31 + i * 7) % 500) as u32)
                    .collect();
                request(prompt, 5 + 3 * i - k.min(1), SamplingParams::greedy())
            })
            .collect();
        let want = ids(&gen.generate(&requests, None).unwrap());
        // Seeded sampling (top-k, top-p, temperature): graphs change no token either.
        let sampled: Vec<GenerationRequest> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| GenerationRequest {
                sampling: SamplingParams {
                    temperature: 0.9,
                    top_k: Some(40),
                    top_p: Some(0.9),
                    seed: 11 + i as u64,
                    ..SamplingParams::greedy()
                },
                ..r.clone()
            })
            .collect();
        let mut sampled_want = None;
        // Graphs step by step, and in bursts of 4 steps between reads.
        for (cuda_graphs, sync_every) in [(false, 1), (true, 1), (true, 4)] {
            let options = PagedOptions {
                max_batch: 4,
                block_size: 16,
                num_blocks: 128,
                cuda_graphs,
                sync_every,
            };
            let what = format!("{device:?}, graphs {cuda_graphs}, read every {sync_every}");
            let (got, stats) = gen.generate_paged(&requests, &options, None).unwrap();
            assert_eq!(ids(&got), want, "{what}");
            // On a GPU every batch bucket used (4, 2, 1 as rows finish) is captured.
            let captured = cuda_graphs && device.is_cuda();
            assert_eq!(stats.graphs_captured > 0, captured, "{what}");
            let (got, _) = gen.generate_paged(&sampled, &options, None).unwrap();
            let got = ids(&got);
            match &sampled_want {
                None => sampled_want = Some(got),
                Some(w) => assert_eq!(&got, w, "{what}: seeded sampling"),
            }
        }
    }
}

/// The decode graph's fixed-address buffers (on the CPU they drive the plain step, uncaptured)
/// give the plain step's logits: a first step, and a step `ahead` fed the drawn tokens on the
/// device, with two live rows in a bucket of four (the spare rows inactive).
#[test]
fn the_decode_step_buffers_give_the_plain_steps_logits() {
    let _turn = one_at_a_time();
    let model = kernel_shaped_model(&candle_core::Device::Cpu);
    let mut pool = fleet_models::kv_blocks::BlockPool::new(64, 16);
    let mut cache = model.new_paged_cache(64, 16).unwrap();
    let prompt = |n: usize, k: usize| {
        (0..n)
            .map(|t| ((t * 13 + k) % 500) as u32)
            .collect::<Vec<_>>()
    };
    let mut a = pool.admit(&prompt(20, 1), 3).unwrap();
    let mut b = pool.admit(&prompt(37, 2), 3).unwrap();
    model.prefill_paged_batch(&[&a, &b], &mut cache).unwrap();
    pool.append(&mut a, 7).unwrap();
    pool.append(&mut b, 11).unwrap();
    let seqs = [&a, &b];
    let mut graph = model.decode_graph(4, 4, &mut cache, false).unwrap();
    assert!(!graph.is_captured());
    let plain = model.decode_paged(&seqs, &[], &mut cache).unwrap();
    let buffered = model
        .decode_paged_with(&mut graph, &seqs, &[], 0, None, true, &mut cache)
        .unwrap();
    let rows = |t: &candle_core::Tensor| t.to_vec3::<f32>().unwrap();
    assert_eq!(rows(&buffered), rows(&plain));
    let drawn = plain.squeeze(1).unwrap().argmax_keepdim(1).unwrap();
    let plain = model
        .decode_paged_ahead(&seqs, &[], 1, Some(&drawn), false, &mut cache)
        .unwrap();
    let buffered = model
        .decode_paged_with(&mut graph, &seqs, &[], 1, Some(&drawn), false, &mut cache)
        .unwrap();
    assert_eq!(rows(&buffered), rows(&plain));
}

#[test]
fn seeded_sampling_is_the_same_paged_or_lock_step() {
    let _turn = one_at_a_time();
    for (what, model) in models("qwen2-tiny") {
        let gen = model.generator();
        // Every option of the device sampler; a repetition penalty on one row.
        let sampled = varied_requests(|i| SamplingParams {
            temperature: 0.9,
            top_k: (i % 2 == 0).then_some(20),
            top_p: (i % 3 == 0).then_some(0.9),
            seed: 100 + i as u64,
            min_p: (i % 4 == 1).then_some(0.05),
            repetition_penalty: (i == 5).then_some(1.3),
        });
        let want = ids(&gen.generate(&sampled, None).unwrap());
        for sync_every in [1, 3] {
            let options = PagedOptions {
                max_batch: 3,
                block_size: 4,
                num_blocks: 64,
                cuda_graphs: false,
                sync_every,
            };
            let (got, _) = gen.generate_paged(&sampled, &options, None).unwrap();
            assert_eq!(ids(&got), want, "{what}, read every {sync_every} steps");
        }
        // Without the penalised row, reads every 3 steps queue 3 steps at a time.
        let plain: Vec<GenerationRequest> = sampled
            .iter()
            .filter(|r| r.sampling.repetition_penalty.is_none())
            .cloned()
            .collect();
        let want = ids(&gen.generate(&plain, None).unwrap());
        let options = PagedOptions {
            max_batch: 3,
            block_size: 4,
            num_blocks: 64,
            cuda_graphs: false,
            sync_every: 3,
        };
        let (got, stats) = gen.generate_paged(&plain, &options, None).unwrap();
        assert_eq!(ids(&got), want, "{what}, bursts of 3");
        let (_, every) = gen
            .generate_paged(
                &plain,
                &PagedOptions {
                    sync_every: 1,
                    ..options
                },
                None,
            )
            .unwrap();
        assert!(stats.decode_steps >= every.decode_steps, "{what}");
    }
}

#[test]
fn a_shared_prompt_is_computed_once_per_block() {
    let _turn = one_at_a_time();
    for (what, model) in models("qwen2-tiny") {
        let gen = model.generator();
        // GSPO's group: one prompt, several seeds. And a shared instruction before different
        // questions.
        let prompt: Vec<u32> = (0..21).map(|t| (t * 5 + 1) % 90).collect();
        let mut requests: Vec<GenerationRequest> = (0..4)
            .map(|s| {
                request(
                    prompt.clone(),
                    6,
                    SamplingParams {
                        temperature: 1.0,
                        top_k: None,
                        top_p: None,
                        seed: s,
                        min_p: None,
                        repetition_penalty: None,
                    },
                )
            })
            .collect();
        for q in 0..3u32 {
            let mut p = prompt[..16].to_vec();
            p.extend([40 + q, 41 + q, 42]);
            requests.push(request(p, 5, SamplingParams::greedy()));
        }
        let want = ids(&gen.generate(&requests, None).unwrap());
        let options = PagedOptions {
            max_batch: 4,
            block_size: 4,
            num_blocks: 64,
            cuda_graphs: false,
            sync_every: 1,
        };
        let (got, stats) = gen.generate_paged(&requests, &options, None).unwrap();
        assert_eq!(ids(&got), want, "{what}");
        // The four copies are admitted together: the first computes its 21 tokens, the other
        // three fork it (nothing computed); the questions, admitted later, find the 4 blocks
        // of the 16-token instruction.
        assert_eq!(stats.prompt_tokens, 4 * 21 + 3 * 19, "{what}");
        assert_eq!(stats.cached_prompt_tokens, 3 * 21 + 3 * 16, "{what}");
        // Admitted one round apart, a copy finds the prompt's blocks but the last: 20 tokens.
        let options = PagedOptions {
            max_batch: 1,
            ..options
        };
        let (got, stats) = gen.generate_paged(&requests[..2], &options, None).unwrap();
        assert_eq!(ids(&got), want[..2].to_vec(), "{what}");
        assert_eq!(stats.cached_prompt_tokens, 20, "{what}");
    }
}

#[test]
fn a_session_keeps_earlier_calls_prefixes() {
    let _turn = one_at_a_time();
    for (what, model) in models("qwen2-tiny") {
        let gen = model.generator();
        let options = PagedOptions {
            max_batch: 4,
            block_size: 4,
            num_blocks: 64,
            cuda_graphs: false,
            sync_every: 1,
        };
        let mut session = gen.paged_session(&options).unwrap();
        // ARGO's second call extends the first call's prompt with what was retrieved.
        let first: Vec<u32> = (0..13).map(|t| (t * 3 + 2) % 90).collect();
        let mut second = first.clone();
        second.extend([7, 8, 9, 10, 11]);
        let calls = [
            vec![request(first.clone(), 4, SamplingParams::greedy())],
            vec![request(second.clone(), 4, SamplingParams::greedy())],
        ];
        let mut cached = Vec::new();
        for call in &calls {
            let want = ids(&gen.generate(call, None).unwrap());
            let (got, stats) = gen.generate_in(&mut session, call, None).unwrap();
            assert_eq!(ids(&got), want, "{what}");
            cached.push(stats.cached_prompt_tokens);
        }
        // The first call's 3 full blocks (12 tokens) serve the second call.
        assert_eq!(cached, vec![0, 12], "{what}");
        assert_eq!(session.hit_counts(), (12, 13 + 18), "{what}");
    }
}

#[test]
fn streaming_reports_every_token_of_every_request() {
    let _turn = one_at_a_time();
    let (_, model) = models("qwen3-tiny").remove(0);
    let gen = model.generator();
    let requests = varied_requests(|_| SamplingParams::greedy());
    let mut seen: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
    let mut on_token = |e: fleet_models::StreamEvent<'_>| seen[e.request].push(e.token_id);
    let options = PagedOptions {
        max_batch: 2,
        block_size: 8,
        num_blocks: 64,
        cuda_graphs: false,
        sync_every: 1,
    };
    let (out, _) = gen
        .generate_paged(&requests, &options, Some(&mut on_token))
        .unwrap();
    let tokens: Vec<Vec<u32>> = out.iter().map(|o| o.token_ids.clone()).collect();
    assert_eq!(seen, tokens);
}

#[test]
fn a_pool_too_small_for_one_request_is_a_clear_error() {
    let _turn = one_at_a_time();
    let (_, model) = models("qwen2-tiny").remove(0);
    let gen = model.generator();
    let requests = vec![request(vec![1; 30], 10, SamplingParams::greedy())];
    let options = PagedOptions {
        max_batch: 4,
        block_size: 4,
        num_blocks: 9,
        cuda_graphs: false,
        sync_every: 1,
    };
    let err = gen
        .generate_paged(&requests, &options, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("needs 10 KV blocks") && err.contains("has 9"),
        "{err}"
    );
    // Two requests that fit one at a time run one after the other.
    let requests = vec![
        request(vec![1; 20], 4, SamplingParams::greedy()),
        request(vec![2; 20], 4, SamplingParams::greedy()),
    ];
    let (out, stats) = gen.generate_paged(&requests, &options, None).unwrap();
    assert_eq!(stats.max_running, 1);
    assert_eq!(out.len(), 2);
}

#[test]
fn requests_submitted_as_others_finish_give_the_lock_step_tokens() {
    let _turn = one_at_a_time();
    // ARGO without a round barrier: each "episode" asks again, with its reply appended to its
    // prompt, as soon as its last call returns, while the others are still decoding.
    for (what, model) in models("qwen2-tiny") {
        let gen = model.generator();
        let options = PagedOptions {
            max_batch: 3,
            block_size: 4,
            num_blocks: 96,
            cuda_graphs: false,
            sync_every: 1,
        };
        let mut session = gen.paged_session(&options).unwrap();
        let firsts = varied_requests(|_| SamplingParams::greedy());
        let mut episode_of = std::collections::HashMap::new();
        let mut calls_left = vec![3usize; firsts.len()];
        let mut replies: Vec<Vec<(Vec<u32>, Vec<u32>)>> = vec![Vec::new(); firsts.len()];
        for (e, r) in firsts.iter().enumerate() {
            let t = gen.submit(&mut session, r.clone()).unwrap();
            episode_of.insert(t, (e, r.prompt_ids.clone()));
        }
        let mut steps = 0;
        while !session.is_idle() {
            steps += 1;
            for (ticket, out) in gen.step(&mut session, None).unwrap() {
                let (e, prompt) = episode_of.remove(&ticket).unwrap();
                replies[e].push((prompt.clone(), out.token_ids.clone()));
                calls_left[e] -= 1;
                if calls_left[e] > 0 {
                    let mut next = prompt;
                    next.extend(&out.token_ids);
                    next.push(5);
                    let t = gen
                        .submit(
                            &mut session,
                            request(next.clone(), 4, SamplingParams::greedy()),
                        )
                        .unwrap();
                    episode_of.insert(t, (e, next));
                }
            }
        }
        assert!(steps > 0 && calls_left.iter().all(|&c| c == 0), "{what}");
        // Every call's reply is what a lock-step batch of that one prompt gives.
        for (e, calls) in replies.iter().enumerate() {
            assert_eq!(calls.len(), 3, "{what}");
            for (k, (prompt, got)) in calls.iter().enumerate() {
                let max_new = if k == 0 { firsts[e].max_new_tokens } else { 4 };
                let want = gen
                    .generate(
                        &[request(prompt.clone(), max_new, SamplingParams::greedy())],
                        None,
                    )
                    .unwrap();
                assert_eq!(got, &want[0].token_ids, "{what}: episode {e} call {k}");
            }
        }
        // The follow-ups extend earlier prompts, so their leading blocks were found again.
        assert!(session.stats().cached_prompt_tokens > 0, "{what}");
        assert!(gen.step(&mut session, None).unwrap().is_empty(), "{what}");
    }
}

#[test]
fn newcomers_of_a_step_share_one_prompt_pass_and_their_common_prefix() {
    let _turn = one_at_a_time();
    for (what, model) in models("qwen2-tiny") {
        let gen = model.generator();
        // Five prompts: a common 12-token instruction, then each its own question.
        let common: Vec<u32> = (0..12).map(|t| (t * 5 + 1) % 90).collect();
        let requests: Vec<GenerationRequest> = (0..5)
            .map(|i| {
                let mut p = common.clone();
                p.extend((0..(i + 2)).map(|t| ((t * 11 + i * 7 + 40) % 90) as u32));
                request(p, 4 + i, SamplingParams::greedy())
            })
            .collect();
        let want = ids(&gen.generate(&requests, None).unwrap());
        let options = PagedOptions {
            max_batch: 8,
            block_size: 4,
            num_blocks: 64,
            cuda_graphs: false,
            sync_every: 1,
        };
        let (got, stats) = gen.generate_paged(&requests, &options, None).unwrap();
        assert_eq!(ids(&got), want, "{what}");
        // All five in one pass; the later four find the first's three instruction blocks
        // (written in that same pass, before any row reads them).
        assert_eq!(stats.prefill_passes, 1, "{what}");
        assert_eq!(stats.cached_prompt_tokens, 4 * 12, "{what}");
    }
}
