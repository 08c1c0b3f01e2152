//! A one-turn chat rendered with the checkpoint's own template, streamed to stdout.
//!
//! `cargo run -p fleet-examples --example chat -- tests/fixtures/qwen2-tiny "Hello!"`

use std::io::Write;

use anyhow::Result;
use fleet_models::{ChatMessage, GenerationRequest, LoadOptions, SamplingParams, TextModel};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let spec = args
        .next()
        .unwrap_or_else(|| "Qwen/Qwen2.5-0.5B-Instruct".into());
    let question = args.next().unwrap_or_else(|| "Why is the sky blue?".into());
    let model = TextModel::load(&spec, &LoadOptions::default())?;

    let messages = [
        ChatMessage::new("system", "You are a concise assistant."),
        ChatMessage::new("user", question),
    ];
    let request = GenerationRequest {
        prompt_ids: model.chat_prompt(&messages, true)?,
        max_new_tokens: 64,
        sampling: SamplingParams {
            temperature: 0.7,
            top_p: Some(0.9),
            top_k: None,
            seed: 42,
            min_p: None,
            repetition_penalty: None,
        },
        stop_strings: vec![],
    };
    let mut print = |e: fleet_models::StreamEvent<'_>| {
        print!("{}", e.text_delta);
        let _ = std::io::stdout().flush();
    };
    let out = model.generate(&[request], Some(&mut print))?;
    println!("\n[{:?}]", out[0].finish_reason);
    Ok(())
}
