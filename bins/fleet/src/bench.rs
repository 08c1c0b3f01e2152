//! `fleet bench generate`: prefill and decode throughput of batched generation, and peak GPU
//! memory, measured the way `benches/transformers_generate.py` measures transformers
//! (benches/README.md has the definitions).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use fleet_models::{
    DType, DeviceLocation, DeviceMap, GenerationOutput, GenerationRequest, Generator, PagedOptions,
    QwenConfig, QwenModel, Weights,
};
use serde::Serialize;

use crate::cli::at_least;
use fleet_cli::Batching;

#[derive(Args)]
pub struct BenchGenerateArgs {
    #[command(flatten)]
    pub model: BenchModelArgs,
    /// Prompt tokens per row (at least 1).
    #[arg(long, default_value_t = 512, value_parser = at_least(1))]
    pub prompt_len: usize,
    /// New tokens per row (at least 2: the first comes from the prefill, decode is timed on
    /// the rest).
    #[arg(long, default_value_t = 128, value_parser = decode_tokens)]
    pub new_tokens: usize,
    /// Batch sizes, comma-separated (each at least 1).
    #[arg(long, default_value = "1,32", value_delimiter = ',', value_parser = at_least(1))]
    pub batch: Vec<usize>,
    /// Timed repetitions of each measurement (the median is reported; at least 1).
    #[arg(long, default_value_t = 3, value_parser = at_least(1))]
    pub repeats: usize,
    /// How requests share the decode batch: `static` (one left-padded batch; finished rows
    /// leave it) or `continuous` (a paged KV cache; a finished row's place is refilled at once).
    #[arg(long, value_enum, default_value = "static")]
    pub batching: Batching,
    /// Tokens per KV block with `--batching continuous`.
    #[arg(long, default_value_t = 16, value_parser = at_least(1))]
    pub block_size: usize,
    /// With `--batching continuous` (vLLM's name): decode op by op, not through the captured
    /// CUDA graph of each batch bucket (the default where the model allows it).
    #[arg(long)]
    pub enforce_eager: bool,
    /// With `--batching continuous` (vLLM's name): decode steps queued before their tokens
    /// are read back (each step's tokens fed to the next on the device; finished rows
    /// refilled every this many steps).
    #[arg(long, default_value_t = 1, value_parser = at_least(1))]
    pub num_scheduler_steps: usize,
    /// Open the CUDA profiler's range around the timed runs only (for
    /// `ncu --profile-from-start off`: scripts/gpu/profile_decode.sh).
    #[arg(long)]
    pub cuda_profile_range: bool,
    /// Also run the variable-length workload: this many requests, each with its own reply
    /// length (GSM8K-like, at most --new-tokens, a fixed seed), through `--batch` decode slots,
    /// static (batches of --batch wait for their longest) and continuous; reports both.
    #[arg(long)]
    pub variable_lengths: Option<usize>,
    /// The generations' sampling (transformers' names; greedy when absent, as
    /// benches/transformers_generate.py runs): row r draws with seed `--seed` + r. The timed
    /// prefill (one token) and the variable-length workload stay greedy. Sampling costs the
    /// sampler's draw over the vocabulary each step (GSPO's rollouts sample at temperature 1).
    #[command(flatten)]
    pub sampling: fleet_cli::SamplingArgs,
    /// Write the results here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `--new-tokens`: at least 2, since decode throughput counts the tokens after the first.
fn decode_tokens(s: &str) -> Result<usize, String> {
    at_least(2)(s).map_err(|e| {
        format!("{e} (the first new token comes from the prefill; decode is timed on the rest)")
    })
}

#[derive(Serialize)]
struct Run {
    batch: usize,
    prefill_tok_s: f64,
    /// `null` when the timed generate was not longer than the timed prefill (too few new
    /// tokens for the two medians to differ by more than their noise), as
    /// benches/transformers_generate.py reports it.
    decode_tok_s: Option<f64>,
    t_prefill_s: f64,
    t_generate_s: f64,
    /// Highest device memory in use seen during this batch size (all GPUs of the map, minus
    /// what was in use before the model loaded).
    peak_used_bytes: Option<u64>,
    /// Continuous batching's counters of the last timed run: decode steps, prompt passes,
    /// prompt tokens reused, and with --num-scheduler-steps above 1 the host's time queuing
    /// the steps against its wait for their tokens (the decode step's host-bound share).
    #[serde(skip_serializing_if = "Option::is_none")]
    paged: Option<fleet_models::PagedStats>,
}

/// One batch size of the variable-length workload.
#[derive(Serialize)]
struct VariableRun {
    batch: usize,
    requests: usize,
    new_tokens_total: usize,
    static_s: f64,
    continuous_s: f64,
    static_tok_s: f64,
    continuous_tok_s: f64,
    /// continuous over static throughput.
    speedup: f64,
}

#[derive(Serialize)]
struct Report {
    engine: &'static str,
    commit: String,
    device: String,
    device_map: String,
    config: String,
    shape: serde_json::Value,
    dtype: String,
    prompt_len: usize,
    new_tokens: usize,
    weights_bytes: Option<u64>,
    batching: Batching,
    /// Continuous batching's settings: decode through captured graphs, steps per read.
    cuda_graphs: bool,
    num_scheduler_steps: usize,
    /// The timed generations' sampling, with row 0's seed (row r's is that plus r); greedy
    /// when no sampling flag was given.
    sampling: fleet_models::SamplingParams,
    runs: Vec<Run>,
    /// The variable-length workload, static and continuous, per batch size.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    variable: Vec<VariableRun>,
    /// On logical devices, that they are (one GPU's bandwidth and compute shared by all).
    #[serde(skip_serializing_if = "Option::is_none")]
    logical_devices: Option<String>,
}

fn used_bytes(gpus: &[usize]) -> Option<u64> {
    gpus.iter()
        .map(|&g| fleet_topology::gpu_used_bytes(g))
        .sum::<Option<u64>>()
}

/// The median, the mean of the middle two for an even count (as Python's `statistics.median`,
/// which the reference scripts use).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n.is_multiple_of(2) {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

pub fn generate(args: &BenchGenerateArgs) -> Result<()> {
    let (devices, dtype) = args.model.placement("fleet bench generate")?;
    let gpus: Vec<usize> = devices.iter().filter_map(|d| d.cuda_ordinal()).collect();
    let baseline = used_bytes(&gpus).unwrap_or(0);

    let (label, model) = args.model.build(&devices, dtype)?;
    let cfg = model.config().clone();
    sync(&model)?;
    let weights_bytes = used_bytes(&gpus).map(|u| u.saturating_sub(baseline));

    let device_name = match devices[0] {
        DeviceLocation::Cuda(n) => fleet_topology::discover()?
            .into_iter()
            .find(|d| d.location == DeviceLocation::Cuda(n))
            .map(|d| d.name)
            .unwrap_or_else(|| format!("cuda:{n}")),
        DeviceLocation::Cpu => "cpu".into(),
    };
    // Never stop early: the benchmark generates exactly new_tokens per row.
    let generator = Generator::new(&model, None, Vec::new(), 0);
    let mut runs = Vec::new();
    let mut variable = Vec::new();
    for &b in &args.batch {
        let prompts: Vec<Vec<u32>> = (0..b)
            .map(|r| bench_prompt(r, args.prompt_len, args.model.seed, cfg.vocab_size))
            .collect();
        let requests: Vec<GenerationRequest> = prompts
            .iter()
            .enumerate()
            .map(|(r, p)| -> Result<GenerationRequest> {
                Ok(GenerationRequest {
                    sampling: args.sampling.params(0.0, args.model.seed + r as u64)?,
                    ..GenerationRequest::greedy(p.clone(), args.new_tokens)
                })
            })
            .collect::<Result<_>>()?;
        let run_all = |requests: &[GenerationRequest]| -> Result<RunOutputs> {
            Ok(match args.batching {
                Batching::Static => (generator.generate(requests, None)?, None),
                Batching::Continuous => {
                    let options = paged_options(requests, b, args);
                    let (out, stats) = generator.generate_paged(requests, &options, None)?;
                    (out, Some(stats))
                }
            })
        };
        // The prompts alone, the way the batching runs them (continuous: the admitted prompts
        // in batched passes into the paged cache): one new token each.
        let time_prefill = || -> Result<f64> {
            match args.batching {
                Batching::Static => prefill(&model, &prompts),
                Batching::Continuous => {
                    let first: Vec<GenerationRequest> = prompts
                        .iter()
                        .map(|p| GenerationRequest::greedy(p.clone(), 1))
                        .collect();
                    let t = Instant::now();
                    run_all(&first)?;
                    sync(&model)?;
                    Ok(t.elapsed().as_secs_f64())
                }
            }
        };
        // Warm-up: kernel loading, cuBLAS handles, allocator growth.
        time_prefill()?;
        // The timed runs' sampling, so that its first use is not timed.
        let warm = GenerationRequest {
            sampling: requests[0].sampling.clone(),
            ..GenerationRequest::greedy(prompts[0].clone(), 4.min(args.new_tokens))
        };
        run_all(&vec![warm; b])?;
        sync(&model)?;

        fleet_models::profile::take_report(); // drop the warm-up's stages
        let watch = (!gpus.is_empty()).then(|| {
            let locations: Vec<_> = gpus.iter().map(|&g| DeviceLocation::Cuda(g)).collect();
            fleet_topology::MemoryWatch::start(&locations)
        });
        let mut t_prefill = Vec::new();
        let mut t_generate = Vec::new();
        let mut paged = None;
        for _ in 0..args.repeats {
            t_prefill.push(time_prefill()?);
            if args.cuda_profile_range {
                fleet_models::profile::cuda_profiler_range(true)?;
            }
            let t = Instant::now();
            let (out, stats) = run_all(&requests)?;
            paged = stats;
            sync(&model)?;
            t_generate.push(t.elapsed().as_secs_f64());
            if args.cuda_profile_range {
                fleet_models::profile::cuda_profiler_range(false)?;
            }
            if out.iter().any(|o| o.token_ids.len() != args.new_tokens) {
                bail!("a row stopped before {} tokens", args.new_tokens);
            }
        }
        // Every GPU's peak above what the GPUs held before the model was loaded.
        let peak = watch.map(|w| {
            w.finish()
                .iter()
                .filter(|(k, _)| k.starts_with("cuda"))
                .map(|(_, v)| v)
                .sum::<u64>()
                .saturating_sub(baseline)
        });
        let (tp, tg) = (median(t_prefill), median(t_generate));
        let run = Run {
            batch: b,
            prefill_tok_s: (b * args.prompt_len) as f64 / tp,
            decode_tok_s: (tg > tp).then(|| (b * (args.new_tokens - 1)) as f64 / (tg - tp)),
            t_prefill_s: tp,
            t_generate_s: tg,
            peak_used_bytes: peak.map(|p| p.max(weights_bytes.unwrap_or(0))),
            paged,
        };
        eprintln!(
            "batch {:>3}: prefill {:>9.0} tok/s  decode {:>8} tok/s  peak {}",
            run.batch,
            run.prefill_tok_s,
            run.decode_tok_s
                .map_or_else(|| "n/a".into(), |d| format!("{d:.1}")),
            run.peak_used_bytes
                .map(|p| format!("{:.2} GiB", p as f64 / (1u64 << 30) as f64))
                .unwrap_or_else(|| "-".into())
        );
        if let Some(p) = run.paged.as_ref().filter(|p| p.burst_queue_us > 0) {
            eprintln!(
                "           decode bursts: host queued {:.1} ms, waited {:.1} ms for the device",
                p.burst_queue_us as f64 / 1e3,
                p.burst_wait_us as f64 / 1e3
            );
        }
        print_profile(b);
        runs.push(run);
        if let Some(n) = args.variable_lengths {
            let v = variable_lengths(&model, &generator, n, b, args, cfg.vocab_size)?;
            eprintln!(
                "batch {:>3}, {} requests of their own lengths: static {:>8.1} tok/s, \
                 continuous {:>8.1} tok/s ({:.2}x)",
                b, v.requests, v.static_tok_s, v.continuous_tok_s, v.speedup
            );
            variable.push(v);
        }
    }
    let report = Report {
        engine: "fleet",
        commit: fleet_runs::commit_id(),
        device: device_name,
        device_map: model.device_map().to_string(),
        config: label,
        shape: serde_json::json!({
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "heads": cfg.num_attention_heads, "kv_heads": cfg.num_kv_heads(),
            "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
            "parameters": cfg.num_parameters(),
        }),
        dtype: args.model.dtype_name(),
        prompt_len: args.prompt_len,
        new_tokens: args.new_tokens,
        weights_bytes,
        batching: args.batching,
        cuda_graphs: !args.enforce_eager,
        num_scheduler_steps: args.num_scheduler_steps,
        sampling: args.sampling.params(0.0, args.model.seed)?,
        runs,
        variable,
        logical_devices: fleet_topology::logical::describe(),
    };
    fleet_cli::bench::write_report(&report, args.json.as_deref())?;
    Ok(())
}

/// The model a benchmark runs, shared by the benchmark commands: on `cuda:0` in bf16 unless
/// told otherwise; placed by hand (the plan flags are refused).
#[derive(Args)]
#[command(
    mut_arg("device", |a| a.default_value("cuda:0")),
    mut_arg("dtype", |a| a.default_value("bf16").help(fleet_cli::FIXED_DTYPE_HELP)),
    mut_arg("gpu_mode", |a| a.hide(true)),
    mut_arg("gpu_ids", |a| a.hide(true)),
    mut_arg("max_memory", |a| a.hide(true))
)]
pub struct BenchModelArgs {
    /// A model shape (a config.json, e.g. configs/models/qwen2.5-7b.json): random weights are
    /// made directly on the device(s).
    #[arg(long, conflicts_with = "model")]
    pub config: Option<PathBuf>,
    /// A real checkpoint (local dir or hub id) instead of a shape.
    #[arg(long)]
    pub model: Option<String>,
    /// --device, --dtype.
    #[command(flatten)]
    pub placement: fleet_cli::PlacementArgs,
    /// Seed of the random weights and prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl BenchModelArgs {
    /// `--device`'s list and `--dtype` (`command` names the benchmark in errors).
    pub fn placement(&self, command: &str) -> Result<(Vec<DeviceLocation>, DType)> {
        self.placement.by_hand(command)
    }

    /// `--dtype` as given (or its default), for the report.
    pub fn dtype_name(&self) -> String {
        self.placement.dtype.clone().unwrap_or_default()
    }

    /// Random weights of the shape built on `devices`, or the checkpoint loaded there; layers
    /// split over `devices` when there are several. Returns a label for the report and the model.
    pub fn build(&self, devices: &[DeviceLocation], dtype: DType) -> Result<(String, QwenModel)> {
        match (&self.config, &self.model) {
            (Some(path), None) => {
                let cfg = QwenConfig::from_file(path)?;
                let map = device_map(devices, cfg.num_hidden_layers)?;
                let t = Instant::now();
                let weights = Weights::Random { seed: self.seed };
                let model = QwenModel::new(&cfg, &weights, dtype, &map)?;
                eprintln!(
                    "built random {} in {:.1}s on {}",
                    path.display(),
                    t.elapsed().as_secs_f64(),
                    map
                );
                Ok((path.display().to_string(), model))
            }
            (None, Some(spec)) => {
                let device = devices
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(",");
                let m = crate::cli::ModelArgs {
                    model: spec.clone(),
                    revision: None,
                    placement: fleet_cli::PlacementArgs {
                        device: Some(device),
                        dtype: Some(dtype.as_str().to_string()),
                        ..Default::default()
                    },
                }
                .load("fleet bench")?;
                Ok((spec.clone(), m.model))
            }
            _ => bail!("give --config FILE (a model shape, random weights) or --model M"),
        }
    }
}

fn device_map(devices: &[DeviceLocation], layers: usize) -> Result<DeviceMap> {
    Ok(if devices.len() == 1 {
        DeviceMap::single(devices[0], layers)
    } else {
        DeviceMap::split_layers(devices, layers)?
    })
}

fn sync(model: &QwenModel) -> Result<()> {
    for (_, d) in model.devices().iter() {
        d.synchronize()?;
    }
    Ok(())
}

/// A run's outputs and, for continuous batching, its counters.
type RunOutputs = (Vec<GenerationOutput>, Option<fleet_models::PagedStats>);

/// Decode slots `max_batch` and blocks enough for every request at once.
fn paged_options(
    requests: &[GenerationRequest],
    max_batch: usize,
    args: &BenchGenerateArgs,
) -> PagedOptions {
    PagedOptions {
        cuda_graphs: !args.enforce_eager,
        sync_every: args.num_scheduler_steps,
        ..PagedOptions::for_requests(requests, max_batch, args.block_size)
    }
}

/// Reply lengths like GSM8K completions (log-normal around 150 tokens, most between 60 and
/// 400), at least 2 and at most `most`, from a fixed seed: the same list every run.
fn gsm8k_like_lengths(n: usize, most: usize) -> Vec<usize> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(8_000);
    (0..n)
        .map(|_| {
            // Box-Muller: a standard normal from two uniforms.
            let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            ((150f64.ln() + 0.55 * z).exp().round() as usize).clamp(2, most.max(2))
        })
        .collect()
}

/// Row `r`'s prompt of the bench: `len` ids from a fixed formula of `r` and the seed, so
/// that no two rows share a prefix.
fn bench_prompt(r: usize, len: usize, seed: u64, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((r * 7919 + i * 104_729 + seed as usize) % vocab) as u32)
        .collect()
}

/// The variable-length workload at `batch` decode slots: `n` requests, each with a prompt of
/// its own (a reused prompt would give continuous batching prefix-cache hits that the static
/// batches cannot have), static batches of `batch` against continuous batching.
fn variable_lengths(
    model: &QwenModel,
    generator: &Generator<'_>,
    n: usize,
    batch: usize,
    args: &BenchGenerateArgs,
    vocab: usize,
) -> Result<VariableRun> {
    let lengths = gsm8k_like_lengths(n, args.new_tokens);
    let requests: Vec<GenerationRequest> = lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let prompt = bench_prompt(i, args.prompt_len, args.model.seed, vocab);
            GenerationRequest::greedy(prompt, len)
        })
        .collect();
    let total: usize = lengths.iter().sum();
    let t = Instant::now();
    for chunk in requests.chunks(batch) {
        generator.generate(chunk, None)?;
    }
    sync(model)?;
    let static_s = t.elapsed().as_secs_f64();
    let options = paged_options(&requests, batch, args);
    let t = Instant::now();
    let (out, _) = generator.generate_paged(&requests, &options, None)?;
    sync(model)?;
    let continuous_s = t.elapsed().as_secs_f64();
    if out
        .iter()
        .zip(&lengths)
        .any(|(o, &l)| o.token_ids.len() != l)
    {
        bail!("a request stopped before its length");
    }
    Ok(VariableRun {
        batch,
        requests: n,
        new_tokens_total: total,
        static_s,
        continuous_s,
        static_tok_s: total as f64 / static_s,
        continuous_tok_s: total as f64 / continuous_s,
        speedup: static_s / continuous_s,
    })
}

/// Seconds for one prefill of `prompts` (logits of the last position), synchronized.
fn prefill(model: &QwenModel, prompts: &[Vec<u32>]) -> Result<f64> {
    let t = Instant::now();
    let mut cache = model.new_cache(prompts[0].len())?;
    let logits = model.forward(prompts, &vec![0; prompts.len()], &mut cache, true)?;
    drop(logits);
    sync(model)?;
    Ok(t.elapsed().as_secs_f64())
}

/// With FLEET_PROFILE=1 (or `events`): where the timed runs of one batch size spent their time,
/// and the host's part of it.
fn print_profile(batch: usize) {
    let mut stages = fleet_models::profile::take_report();
    if stages.is_empty() {
        return;
    }
    stages.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let total: f64 = stages.iter().map(|s| s.seconds).sum();
    eprintln!("profile, batch {batch} (FLEET_PROFILE=1: synchronized stages, shares not speeds; events: GPU spans):");
    for r in stages {
        let (name, secs, calls) = (r.stage, r.seconds, r.calls);
        eprintln!(
            "  {name:<14} {:>9.1} ms {:>5.1}%  {calls:>7} calls  {:>8.1} us/call  host {:>9.1} ms",
            secs * 1e3,
            100.0 * secs / total,
            1e6 * secs / calls as f64,
            r.host_seconds * 1e3
        );
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    /// As Python's `statistics.median`: the middle one, or the mean of the middle two.
    #[test]
    fn median_matches_pythons() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![7.0]), 7.0);
    }
}
