//! Load a checkpoint (local directory or hub id) and print its shape and next-token logits.
//!
//! `cargo run -p fleet-examples --example load_checkpoint -- tests/fixtures/qwen2-tiny`

use anyhow::Result;
use fleet_models::{LoadOptions, TextModel};

fn main() -> Result<()> {
    let spec = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "Qwen/Qwen2.5-0.5B-Instruct".into());
    let model = TextModel::load(&spec, &LoadOptions::default())?;
    let cfg = model.model.config();
    println!(
        "{}: {} layers, hidden {}, {} parameters",
        model.source.id(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_parameters()
    );
    let ids = model.tokenizer()?.encode("The capital of France is")?;
    let logits = model.model.logits(&[ids])?; // [1, len, vocab], f32
    let last = logits.squeeze(0)?.get(logits.dim(1)? - 1)?;
    let best = last.argmax(0)?.to_scalar::<u32>()?;
    println!(
        "most likely next token: {:?}",
        model.tokenizer()?.decode(&[best], false)?
    );
    Ok(())
}
