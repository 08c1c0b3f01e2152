//! `edit-score logits`: one prompt's logits, for parity checks against transformers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use fleet_models::qwen3_vl::{expand_image_pads, Qwen3VlConfig, Qwen3VlModel, VlPrompt};
use fleet_models::vision::{preprocess, ImageProcessorConfig};
use fleet_models::{DeviceMap, Weights};

#[derive(Args)]
#[command(
    mut_arg("device", |a| a.default_value("cpu")),
    mut_arg("dtype", |a| a.default_value("f32").help(fleet_cli::FIXED_DTYPE_HELP)),
    mut_arg("gpu_mode", |a| a.hide(true)),
    mut_arg("gpu_ids", |a| a.hide(true)),
    mut_arg("max_memory", |a| a.hide(true))
)]
pub struct LogitsArgs {
    /// A Qwen3-VL checkpoint directory (config.json, safetensors, preprocessor_config.json).
    #[arg(long)]
    pub model: PathBuf,
    /// A JSON file {"input_ids": [...], "images": ["a.png", ...]}: ids as the chat template
    /// renders them with one <|image_pad|> per image (expanded here), or already expanded.
    #[arg(long)]
    pub inputs: PathBuf,
    /// Where to write the safetensors file with "logits" (f32, [len, vocab]).
    #[arg(long)]
    pub output: PathBuf,
    /// --device (one), --dtype.
    #[command(flatten)]
    pub placement: fleet_cli::PlacementArgs,
}

#[derive(serde::Deserialize)]
struct Inputs {
    input_ids: Vec<u32>,
    #[serde(default)]
    images: Vec<PathBuf>,
}

pub fn run(args: &LogitsArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.inputs)
        .with_context(|| format!("reading {}", args.inputs.display()))?;
    let inputs: Inputs = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: expected {{\"input_ids\": [...], \"images\": [\"a.png\", ...]}}",
            args.inputs.display()
        )
    })?;
    let cfg = Qwen3VlConfig::from_file(&args.model.join("config.json"))?;
    let base = args.inputs.parent().unwrap_or(Path::new("."));
    let images = inputs
        .images
        .iter()
        .map(|p| {
            let p = if p.is_absolute() {
                p.clone()
            } else {
                base.join(p)
            };
            image::open(&p).with_context(|| format!("reading image {}", p.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    let prompt = if images.is_empty() {
        VlPrompt {
            ids: inputs.input_ids,
            images: None,
            positions: None,
        }
    } else {
        let processor =
            ImageProcessorConfig::from_file(args.model.join("preprocessor_config.json"))?;
        let pre = preprocess(&images, &processor)?;
        let counts = pre.pad_tokens(cfg.vision.spatial_merge_size);
        let pads = inputs
            .input_ids
            .iter()
            .filter(|&&t| t == cfg.image_token_id)
            .count();
        let ids = if pads == counts.iter().sum::<usize>() {
            inputs.input_ids
        } else if pads == counts.len() {
            expand_image_pads(&inputs.input_ids, cfg.image_token_id, &counts)?
        } else {
            bail!(
                "{}: {pads} <|image_pad|> ids for {} images that need {counts:?}",
                args.inputs.display(),
                images.len()
            );
        };
        VlPrompt {
            ids,
            images: Some(pre),
            positions: None,
        }
    };
    let (devices, dtype) = args.placement.by_hand("edit-score logits")?;
    let [device] = devices[..] else {
        bail!(
            "edit-score logits runs on one device; --device names {}",
            devices.len()
        );
    };
    let map = DeviceMap::single(device, cfg.text.num_hidden_layers);
    let files: Vec<PathBuf> = safetensors_files(&args.model)?;
    let weights = Weights::from_safetensors(&files)?;
    let model = Qwen3VlModel::new(&cfg, &weights, dtype, &map)?;
    let logits = model
        .logits(&prompt)?
        .to_device(&candle_core::Device::Cpu)?;
    candle_core::safetensors::save(
        &HashMap::from([("logits".to_string(), logits)]),
        &args.output,
    )
    .with_context(|| format!("writing {}", args.output.display()))?;
    eprintln!(
        "wrote {} ({} positions)",
        args.output.display(),
        prompt.ids.len()
    );
    Ok(())
}

/// The checkpoint's shards (index order) or its single file.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let source = fleet_models::ModelSource::parse(&dir.display().to_string(), None)?;
    Ok(source
        .resolve(&fleet_models::HubOptions::from_env())?
        .weights)
}
