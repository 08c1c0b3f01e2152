//! Several prompts of different lengths generated as one left-padded batch, with the layers
//! split over the given devices (`cpu` by default; e.g. `cuda:0,cuda:1` in a CUDA build).
//!
//! `cargo run -p fleet-examples --example batch_generate -- tests/fixtures/qwen2-tiny cpu`

use anyhow::Result;
use fleet_models::{
    DeviceLocation, DeviceMap, GenerationRequest, LoadOptions, QwenConfig, TextModel,
};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let spec = args
        .next()
        .unwrap_or_else(|| "Qwen/Qwen2.5-0.5B-Instruct".into());
    let devices: Vec<DeviceLocation> = args
        .next()
        .unwrap_or_else(|| "cpu".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;

    // The layer count comes from config.json; read it to build the device map.
    let files = fleet_models::ModelSource::parse(&spec, None)?.resolve(&Default::default())?;
    let layers = QwenConfig::from_file(&files.config)?.num_hidden_layers;
    let opts = LoadOptions {
        device_map: Some(DeviceMap::split_layers(&devices, layers)?),
        ..LoadOptions::default()
    };
    let model = TextModel::load(&spec, &opts)?;
    let tok = model.tokenizer()?;

    let prompts = ["Hello", "Write one sentence about the sea.", "1, 2, 3,"];
    let requests = prompts
        .iter()
        .map(|p| Ok(GenerationRequest::greedy(tok.encode(p)?, 24)))
        .collect::<Result<Vec<_>>>()?;
    for (p, out) in prompts.iter().zip(model.generate(&requests, None)?) {
        println!("{p:?} -> {:?} ({:?})", out.text, out.finish_reason);
    }
    Ok(())
}
