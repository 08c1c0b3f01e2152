//! `edit-score bench`: judge throughput with random weights of a real Qwen3-VL shape, measured
//! the way `scripts/gpu/vl_bench_transformers.py` measures transformers: samples of
//! `--images-per-sample` square images plus text, preprocessed, prefilled and greedily decoded
//! for exactly `--new-tokens` tokens, in batches of `--batch`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use fleet_models::qwen3_vl::{Qwen3VlConfig, Qwen3VlModel, VlPrompt};
use fleet_models::vision::{preprocess, ImageProcessorConfig};
use fleet_models::{DeviceMap, GenerationRequest, Weights};
use serde::Serialize;

/// The released Qwen3-VL preprocessor_config.json (configs/models/qwen3-vl-preprocessor.json).
const RELEASED_PROCESSOR: &str = include_str!("../../../configs/models/qwen3-vl-preprocessor.json");

#[derive(Args)]
#[command(
    mut_arg("device", |a| a.default_value("cuda:0")),
    mut_arg("dtype", |a| a.default_value("bf16").help(fleet_cli::FIXED_DTYPE_HELP)),
    mut_arg("gpu_mode", |a| a.hide(true)),
    mut_arg("gpu_ids", |a| a.hide(true)),
    mut_arg("max_memory", |a| a.hide(true))
)]
pub struct BenchArgs {
    /// A Qwen3-VL shape (config.json, e.g. configs/models/qwen3-vl-8b.json): random weights
    /// made on the device.
    #[arg(long)]
    pub config: PathBuf,
    /// --device (a comma list splits the decoder's layers; the vision tower goes on the
    /// first), --dtype.
    #[command(flatten)]
    pub placement: fleet_cli::PlacementArgs,
    /// Side of the square images in pixels.
    #[arg(long, default_value_t = 512)]
    pub image_size: u32,
    /// Images per sample (the judge sees source and edited image: 2).
    #[arg(long, default_value_t = 2)]
    pub images_per_sample: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Samples measured (after one warm-up batch), in batches of `--batch`.
    #[arg(long, default_value_t = 4)]
    pub samples: usize,
    /// New tokens per sample (never stopped early).
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    /// How a batch generates, as `edit-score score --batching`: `continuous` (the default: a
    /// paged KV cache, --max-num-seqs decode slots) or `static` (one left-padded batch).
    #[arg(long, value_enum, default_value = "continuous")]
    pub batching: fleet_cli::Batching,
    /// With `--batching continuous`: decode slots (default: the batch).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the report here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report {
    engine: &'static str,
    commit: String,
    device: String,
    config: String,
    dtype: String,
    image_size: u32,
    images_per_sample: usize,
    image_tokens_per_sample: usize,
    prompt_tokens_per_sample: usize,
    batch: usize,
    batching: fleet_cli::Batching,
    max_num_seqs: Option<usize>,
    samples: usize,
    new_tokens: usize,
    load_s: f64,
    total_s: f64,
    samples_per_s: f64,
    /// Seconds per batch: preprocessing, prefill (vision + prompt: the generation of one
    /// token, the same prompt passes as the full generation), the rest (decode).
    preprocess_s: f64,
    prefill_s: f64,
    decode_s: f64,
    peak_used_bytes: Option<u64>,
    /// Per GPU device: the most bytes its live buffers held (its memory pool's high-water mark,
    /// weights included; on a logical device, its own pool, against its cap).
    peak_live_bytes: std::collections::BTreeMap<String, u64>,
    /// On logical devices, that they are (one GPU's bandwidth and compute shared by all).
    #[serde(skip_serializing_if = "Option::is_none")]
    logical_devices: Option<String>,
    profile: Vec<(String, f64, u64, f64)>,
}

/// A deterministic test image: gradients and stripes that differ per sample and image.
fn image(size: u32, sample: usize, k: usize) -> image::DynamicImage {
    let img = image::RgbImage::from_fn(size, size, |x, y| {
        let s = (sample * 31 + k * 17) as u32;
        image::Rgb([
            ((x * 255 / size + s) % 256) as u8,
            ((y * 255 / size + 3 * s) % 256) as u8,
            (((x / 8 + y / 8 + s) % 2) * 200) as u8,
        ])
    });
    image::DynamicImage::ImageRgb8(img)
}

/// Prompt ids shaped like a judge's chat: text, each image (expanded) with a caption, an
/// instruction.
fn prompt_ids(cfg: &Qwen3VlConfig, pads: &[usize], sample: usize) -> Vec<u32> {
    // Ordinary text ids, below the special tokens (ids >= 151643 in Qwen's vocabulary).
    let span = cfg.text.vocab_size.min(151_643) - 100;
    let text = |n: usize, salt: usize| -> Vec<u32> {
        (0..n)
            .map(|i| ((salt * 7919 + i * 104_729) % span) as u32)
            .collect()
    };
    let mut ids = text(24, sample);
    for (k, &n) in pads.iter().enumerate() {
        ids.push(cfg.vision_start_token_id);
        ids.extend(std::iter::repeat_n(cfg.image_token_id, n));
        ids.push(cfg.vision_end_token_id);
        ids.extend(text(8, sample + k + 1));
    }
    ids.extend(text(48, sample + 99));
    ids
}

fn sync(model: &Qwen3VlModel) -> Result<()> {
    for (_, d) in model.text().devices().iter() {
        d.synchronize()?;
    }
    Ok(())
}

pub fn run(args: &BenchArgs) -> Result<()> {
    if args.batch == 0 || args.samples == 0 || args.new_tokens < 2 {
        bail!("--batch and --samples must be at least 1 and --new-tokens at least 2");
    }
    let cfg = Qwen3VlConfig::from_file(&args.config)?;
    let processor = ImageProcessorConfig::from_json_str(RELEASED_PROCESSOR)?;
    let (devices, dtype) = args.placement.by_hand("edit-score bench")?;
    let gpus: Vec<usize> = devices.iter().filter_map(|d| d.cuda_ordinal()).collect();
    let baseline: u64 = gpus
        .iter()
        .filter_map(|&g| fleet_topology::gpu_used_bytes(g))
        .sum();
    let t = Instant::now();
    let map = DeviceMap::split_layers(&devices, cfg.text.num_hidden_layers)?;
    let model = Qwen3VlModel::new(&cfg, &Weights::Random { seed: args.seed }, dtype, &map)?;
    sync(&model)?;
    let load_s = t.elapsed().as_secs_f64();
    eprintln!("built random {} in {load_s:.1}s", args.config.display());

    // The samples of a batch are preprocessed in parallel, as the judge builds its requests
    // (fleet_serve::generate_chats). The images are drawn before the clock starts:
    // a judge reads them from files, which is not what is measured here.
    let batch_inputs = |first: usize| -> Result<(Vec<VlPrompt>, f64)> {
        use rayon::prelude::*;
        let images: Vec<Vec<_>> = (first..first + args.batch)
            .into_par_iter()
            .map(|s| {
                (0..args.images_per_sample)
                    .map(|k| image(args.image_size, s, k))
                    .collect()
            })
            .collect();
        let t = Instant::now();
        let prompts = images
            .par_iter()
            .enumerate()
            .map(|(i, imgs)| -> Result<VlPrompt> {
                let pre = preprocess(imgs, &processor)?;
                let pads = pre.pad_tokens(cfg.vision.spatial_merge_size);
                Ok(VlPrompt {
                    ids: prompt_ids(&cfg, &pads, first + i),
                    images: Some(pre),
                    positions: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((prompts, t.elapsed().as_secs_f64()))
    };
    let generate = |prompts: &[VlPrompt], new_tokens: usize| -> Result<()> {
        let requests: Vec<GenerationRequest> = prompts
            .iter()
            .map(|p| GenerationRequest::greedy(p.ids.clone(), new_tokens))
            .collect();
        let out = match args.batching {
            fleet_cli::Batching::Static => {
                model.generate(None, Vec::new(), 0, prompts, &requests, None)?
            }
            fleet_cli::Batching::Continuous => {
                let slots = args.max_num_seqs.unwrap_or(requests.len());
                let options = fleet_models::PagedOptions::for_requests(&requests, slots, 16);
                model
                    .generate_paged(None, Vec::new(), 0, prompts, &requests, &options, None)?
                    .0
            }
        };
        sync(&model)?;
        if out.iter().any(|o| o.token_ids.len() != new_tokens) {
            bail!("a row stopped before {new_tokens} tokens");
        }
        Ok(())
    };
    // The prefill: the same generation with one new token, so that it runs the prompt passes
    // the whole generation runs (continuous batching prefills a few prompts a pass, not the
    // batch at once); then the whole generation (which repeats it). The decode is the
    // difference.
    let run_batch = |prompts: &[VlPrompt]| -> Result<(f64, f64)> {
        let t = Instant::now();
        generate(prompts, 1)?;
        let prefill = t.elapsed().as_secs_f64();
        let t = Instant::now();
        generate(prompts, args.new_tokens)?;
        Ok((prefill, t.elapsed().as_secs_f64()))
    };

    // Warm-up: kernels, cuBLAS handles, allocator growth.
    let (warm, _) = batch_inputs(1_000_000)?;
    run_batch(&warm)?;
    fleet_models::profile::take_report();
    let image_tokens: usize = warm[0]
        .images
        .as_ref()
        .map(|i| i.pad_tokens(cfg.vision.spatial_merge_size).iter().sum())
        .unwrap_or(0);
    let prompt_tokens = warm[0].ids.len();

    let watch = (!gpus.is_empty()).then(|| fleet_topology::MemoryWatch::start(&devices));
    let batches = args.samples.div_ceil(args.batch);
    let (mut pre_s, mut prefill_s, mut gen_s) = (0.0, 0.0, 0.0);
    for b in 0..batches {
        let (prompts, tp) = batch_inputs(b * args.batch)?;
        let (pf, g) = run_batch(&prompts)?;
        pre_s += tp;
        prefill_s += pf;
        gen_s += g;
        eprintln!(
            "batch {}/{batches}: preprocess {tp:.3}s prefill {pf:.3}s generate {g:.3}s",
            b + 1
        );
    }
    // A judge's work: preprocessing and generation. Neither the drawing of the images (a judge
    // reads files) nor the separate prefill measurement is part of it.
    let total = pre_s + gen_s;
    let samples = batches * args.batch;
    let peak = watch.map(|w| {
        w.finish()
            .iter()
            .filter(|(k, _)| k.starts_with("cuda"))
            .map(|(_, v)| *v)
            .sum::<u64>()
            .saturating_sub(baseline)
    });
    let mut profile: Vec<(String, f64, u64, f64)> = fleet_models::profile::take_report()
        .into_iter()
        .map(|r| (r.stage.to_string(), r.seconds, r.calls, r.host_seconds))
        .collect();
    profile.sort_by(|a, b| b.1.total_cmp(&a.1));
    let peak_live_bytes = fleet_cli::bench::device_peaks(&devices);
    let report = Report {
        engine: "fleet",
        commit: fleet_runs::commit_id(),
        device: args.placement.device.clone().unwrap_or_default(),
        config: args.config.display().to_string(),
        dtype: dtype.as_str().to_string(),
        image_size: args.image_size,
        images_per_sample: args.images_per_sample,
        image_tokens_per_sample: image_tokens,
        prompt_tokens_per_sample: prompt_tokens,
        batch: args.batch,
        batching: args.batching,
        max_num_seqs: args.max_num_seqs,
        samples,
        new_tokens: args.new_tokens,
        load_s,
        total_s: total,
        samples_per_s: samples as f64 / total,
        preprocess_s: pre_s / batches as f64,
        prefill_s: prefill_s / batches as f64,
        decode_s: (gen_s - prefill_s) / batches as f64,
        peak_used_bytes: peak,
        peak_live_bytes,
        logical_devices: fleet_topology::logical::describe(),
        profile,
    };
    eprintln!(
        "{:.3} samples/s ({samples} samples, batch {}, {} image tokens + text per sample)",
        report.samples_per_s, args.batch, image_tokens
    );
    fleet_cli::bench::print_device_peaks(
        &report.peak_live_bytes,
        report.logical_devices.as_deref(),
    );
    fleet_cli::bench::write_report(&report, args.json.as_deref())?;
    Ok(())
}
