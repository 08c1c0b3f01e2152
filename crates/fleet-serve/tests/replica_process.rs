//! Replicas in processes of their own, for real: this test program is its own replica worker
//! (`harness = false`, so `main` can call `serve_if_replica_worker` first, as fleet's binaries
//! do). CPU replicas stand in for GPUs; `FLEET_REPLICA_PROCESSES=1` puts them in processes.

use std::sync::Arc;

use fleet_models::{
    DeviceLocation, DeviceMap, GenerationOutput, GenerationRequest, LoadOptions, SamplingParams,
    TextModel, VisionLanguageModel,
};
use fleet_serve::{
    generate_chats, serve_if_replica_worker, ChatRequest, Replica, Replicas, StreamConfig, Text,
    VisionLanguage, EXIT_AFTER_ENV, PROCESSES_ENV,
};

mod common;
use common::{fixture, requests};

fn main() {
    serve_if_replica_worker();
    // SAFETY: set before any other thread exists; the workers inherit it.
    unsafe { std::env::set_var(PROCESSES_ENV, "1") };
    replicas_in_processes_generate_what_one_model_generates();
    streams_in_processes_generate_what_one_model_generates();
    a_stream_whose_process_dies_is_an_error_naming_it();
    a_batch_that_fails_in_every_process_is_reported();
    vl_replicas_in_processes_generate_what_one_model_generates();
    a_vl_replica_process_that_dies_is_an_error_naming_it();
    println!("replica_process: 6 tests passed");
}

/// Nine requests, what one model generates for them, and three CPU replicas of that model
/// (the first in this process, two in processes of their own).
fn one_model_and_three_replicas() -> (
    Vec<GenerationRequest>,
    Vec<GenerationOutput>,
    Replicas<Text>,
) {
    let dir = fixture("qwen2-tiny");
    let spec = dir.to_str().unwrap();
    let opts = LoadOptions::default();
    let single = TextModel::load(spec, &opts).unwrap();
    let requests = requests(9);
    let expected = single.generate(&requests, None).unwrap();
    let cpu = DeviceMap::single(DeviceLocation::Cpu, single.model.config().num_hidden_layers);
    let replicas = Replicas::<Text>::load(spec, &opts, &[cpu.clone(), cpu.clone(), cpu]).unwrap();
    (requests, expected, replicas)
}

fn replicas_in_processes_generate_what_one_model_generates() {
    let (requests, expected, replicas) = one_model_and_three_replicas();
    assert_eq!(replicas.len(), 3);
    assert_eq!(
        replicas.in_processes(),
        2,
        "replicas after the first run in processes"
    );
    assert_eq!(replicas.models.len(), 1);
    for max_batch in [1, 2, 4, 100] {
        let got = replicas.generate(&requests, max_batch, false).unwrap();
        assert_eq!(got.len(), expected.len());
        for (g, e) in got.iter().zip(&expected) {
            assert_eq!(g.token_ids, e.token_ids, "max_batch {max_batch}");
            assert_eq!(g.text, e.text);
            assert_eq!(g.finish_reason, e.finish_reason);
        }
    }
}

/// Continuous batching over replicas in processes (argo-exp's data-parallel LLM): requests
/// submitted one by one to the replicas, some while others run, every replica stepping its
/// own paged session; each reply is what one model gives.
fn streams_in_processes_generate_what_one_model_generates() {
    let (requests, expected, replicas) = one_model_and_three_replicas();
    assert_eq!(replicas.in_processes(), 2);
    // Tokens read back every third step: the worker's session takes the setting from the
    // stream's open line, and the replies are the same.
    let config = StreamConfig {
        num_scheduler_steps: 3,
        ..StreamConfig::new(2, 16 << 20)
    };
    let mut streams = replicas.streams(config).unwrap();
    let mut got = vec![None; requests.len()];
    let mut next = 0;
    // Three requests per replica up front, the rest one per step as replies come in.
    for (i, r) in requests.iter().enumerate().take(6) {
        streams[i % 3].submit(i as u64, r.clone()).unwrap();
        next = i + 1;
    }
    while streams.iter().any(|s| s.in_flight() > 0) {
        let busy: Vec<usize> = (0..3).filter(|&i| streams[i].in_flight() > 0).collect();
        for &i in &busy {
            streams[i].start_step().unwrap();
        }
        for &i in &busy {
            for (id, out) in streams[i].finish_step().unwrap() {
                got[id as usize] = Some(out);
                if next < requests.len() {
                    streams[i]
                        .submit(next as u64, requests[next].clone())
                        .unwrap();
                    next += 1;
                }
            }
        }
    }
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        let g = g
            .as_ref()
            .unwrap_or_else(|| panic!("request {i} came back"));
        assert_eq!(g.token_ids, e.token_ids, "request {i}");
        assert_eq!(g.finish_reason, e.finish_reason, "request {i}");
    }
}

/// A replica process that stops mid-stream: the step's error names it (its pid), instead of
/// a hang or a reply that never comes.
fn a_stream_whose_process_dies_is_an_error_naming_it() {
    let dir = fixture("qwen2-tiny");
    let spec = dir.to_str().unwrap();
    let cpu = DeviceMap::single(DeviceLocation::Cpu, 4);
    // SAFETY: no other thread runs now; only the worker started next inherits it. The worker
    // answers the stream's open and takes one request, then exits on its first step.
    unsafe { std::env::set_var(EXIT_AFTER_ENV, "2") };
    let loaded = Replicas::<Text>::load(spec, &LoadOptions::default(), &[cpu.clone(), cpu]);
    unsafe { std::env::remove_var(EXIT_AFTER_ENV) };
    let replicas = loaded.unwrap();
    assert_eq!(replicas.in_processes(), 1);
    let mut streams = replicas.streams(StreamConfig::new(2, 16 << 20)).unwrap();
    streams[1].submit(0, requests(1)[0].clone()).unwrap();
    streams[1].start_step().unwrap();
    let err = streams[1].finish_step().unwrap_err().to_string();
    assert!(err.contains("stopped"), "{err}");
    assert!(err.contains("pid"), "{err}");
    // The replica in this process streams on.
    streams[0].submit(1, requests(1)[0].clone()).unwrap();
    while streams[0].in_flight() > 0 {
        streams[0].start_step().unwrap();
        streams[0].finish_step().unwrap();
    }
}

fn a_batch_that_fails_in_every_process_is_reported() {
    let dir = fixture("qwen2-tiny");
    let spec = dir.to_str().unwrap();
    let opts = LoadOptions::default();
    let cpu = DeviceMap::single(DeviceLocation::Cpu, 4);
    let replicas = Replicas::<Text>::load(spec, &opts, &[cpu.clone(), cpu]).unwrap();
    let mut requests = requests(9);
    requests[5].prompt_ids.clear();
    let err = replicas
        .generate(&requests, 3, false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("empty prompt"), "{err}");
    assert!(err.contains("failed on every replica"), "{err}");
    // The workers are still there for the next call.
    requests[5].prompt_ids.push(7);
    assert_eq!(replicas.generate(&requests, 3, false).unwrap().len(), 9);
}

/// Chats with one or two of the vision fixtures' images, greedy and sampled.
fn vl_requests() -> Vec<ChatRequest> {
    let img = |name: &str| Arc::new(image::open(fixture("vision").join(name)).unwrap());
    let (a, b, c) = (img("a_48x64.png"), img("b_37x100.png"), img("c_90x33.png"));
    let chat = |system: bool, n_images: usize, text: &str| {
        let mut content: Vec<serde_json::Value> = (0..n_images)
            .map(|_| serde_json::json!({"type": "image"}))
            .collect();
        content.push(serde_json::json!({"type": "text", "text": text}));
        let mut messages = Vec::new();
        if system {
            messages.push(serde_json::json!({"role": "system", "content": "You judge edits."}));
        }
        messages.push(serde_json::json!({"role": "user", "content": content}));
        serde_json::Value::Array(messages)
    };
    let mut sampled = ChatRequest::greedy(chat(false, 1, "Score it."), vec![c.clone()], 6);
    sampled.sampling = SamplingParams {
        temperature: 0.9,
        top_k: Some(20),
        top_p: Some(0.8),
        seed: 7,
        min_p: None,
        repetition_penalty: None,
    };
    vec![
        ChatRequest::greedy(
            chat(true, 2, "Compare them."),
            vec![a.clone(), b.clone()],
            8,
        ),
        ChatRequest::greedy(chat(false, 1, "Describe."), vec![b], 5),
        sampled,
        ChatRequest::greedy(chat(true, 2, "Again, with the pair."), vec![c, a], 7),
    ]
}

/// One vision-language replica per device map, each on its own.
fn load_vl_replicas(
    spec: &str,
    opts: &LoadOptions,
    maps: &[DeviceMap],
) -> fleet_models::Result<Vec<Replica<VisionLanguage>>> {
    Ok(Replicas::<VisionLanguage>::load(spec, opts, maps)?.into_replicas())
}

fn vl_replicas_in_processes_generate_what_one_model_generates() {
    let dir = fixture("qwen3-vl-tiny");
    let spec = dir.to_str().unwrap();
    let opts = LoadOptions::default();
    let single = VisionLanguageModel::load(spec, &opts).unwrap();
    let requests = vl_requests();
    let expected: Vec<_> = requests
        .iter()
        .map(|r| {
            generate_chats(&single, std::slice::from_ref(r))
                .unwrap()
                .remove(0)
                .unwrap()
        })
        .collect();
    let cpu = DeviceMap::single(DeviceLocation::Cpu, 4);
    let mut replicas = load_vl_replicas(spec, &opts, &[cpu.clone(), cpu]).unwrap();
    assert_eq!(replicas.len(), 2);
    assert!(!replicas[0].in_process() && replicas[0].local().is_some());
    assert!(
        replicas[1].in_process(),
        "the second replica runs in a process"
    );
    assert!(
        replicas[1].name().contains("(pid "),
        "{}",
        replicas[1].name()
    );
    for replica in replicas.iter_mut() {
        // One batch of all requests (left-padded) equals each request alone, in both places.
        let got = replica.generate(&requests).unwrap();
        assert_eq!(got.len(), requests.len());
        for (g, e) in got.iter().zip(&expected) {
            let g = g.as_ref().unwrap();
            assert_eq!(g.token_ids, e.token_ids, "{}", replica.name());
            assert_eq!(g.text, e.text);
            assert_eq!(g.finish_reason, e.finish_reason);
        }
    }
    // A request that cannot be built fails alone: two image parts, one image.
    let mut bad = vl_requests();
    bad[1].messages = bad[0].messages.clone();
    let got = replicas[1].generate(&bad).unwrap();
    let err = got[1].as_ref().unwrap_err();
    assert!(err.contains("request 1") && err.contains("image"), "{err}");
    assert_eq!(got[0].as_ref().unwrap().token_ids, expected[0].token_ids);
    assert_eq!(got[3].as_ref().unwrap().token_ids, expected[3].token_ids);
    // The images travelled as pixel files; none is left behind.
    let prefix = format!("fleet-vl-{}-", std::process::id());
    for dir in [std::path::PathBuf::from("/dev/shm"), std::env::temp_dir()] {
        let left: Vec<_> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .collect();
        assert!(left.is_empty(), "left in {}: {left:?}", dir.display());
    }
}

fn a_vl_replica_process_that_dies_is_an_error_naming_it() {
    let dir = fixture("qwen3-vl-tiny");
    let spec = dir.to_str().unwrap();
    let cpu = DeviceMap::single(DeviceLocation::Cpu, 4);
    // SAFETY: no other thread runs now; only the worker started next inherits it.
    unsafe { std::env::set_var(EXIT_AFTER_ENV, "1") };
    let loaded = load_vl_replicas(spec, &LoadOptions::default(), &[cpu.clone(), cpu]);
    unsafe { std::env::remove_var(EXIT_AFTER_ENV) };
    let mut replicas = loaded.unwrap();
    let requests = vl_requests();
    assert_eq!(replicas[1].generate(&requests[..1]).unwrap().len(), 1);
    let err = replicas[1]
        .generate(&requests[..1])
        .unwrap_err()
        .to_string();
    assert!(err.contains("stopped"), "{err}");
    assert!(
        err.contains(&format!("pid {}", replicas[1].pid().unwrap())),
        "{err}"
    );
    // The replica in this process is unaffected.
    assert_eq!(replicas[0].generate(&requests).unwrap().len(), 4);
}
