//! Flags of each subcommand and the small commands (`devices`, `generate`, `logits`).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use fleet_models::{
    parse_dtype, ChatMessage, DeviceMap, GenerationRequest, LoadOptions, PagedOptions, TextModel,
};
use fleet_serve::{Replicas, Text};

use fleet_cli::{out, outln};

/// fleet: Qwen models on one GPU, on all GPUs of a machine, or across machines.
#[derive(Parser)]
#[command(name = "fleet", version = fleet_cli::VERSION, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub logical: fleet_cli::LogicalGpusArg,
}

#[derive(Subcommand)]
pub enum Command {
    /// List the GPUs this process can use (name, compute capability, memory), or the CPU.
    Devices(DevicesArgs),
    /// Chat with a model: renders the checkpoint's chat template and streams the reply.
    Generate(GenerateArgs),
    /// Print the logits of given token ids (JSON), for parity checks.
    Logits(LogitsArgs),
    /// Say before loading whether and how a model fits: per device the layers it holds and the
    /// bytes of weights, KV cache, workspace and headroom.
    Plan(PlanArgs),
    /// Benchmarks, run on the GPU machine.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Prefill and decode throughput and peak memory of batched generation.
    Generate(crate::bench::BenchGenerateArgs),
    /// Throughput of batched generation with one replica per device (fleet-dist's pool), the
    /// replicas as threads of this process (`generate --gpu-mode data-parallel` runs replicas
    /// after the first in processes of their own).
    DataParallel(crate::bench_dp::BenchDataParallelArgs),
}

#[derive(Args)]
pub struct DevicesArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Flags shared by the commands that load a checkpoint: the placement flags run on `cpu` in
/// f32 unless told otherwise (the precision parity is checked in).
#[derive(Args, Clone)]
#[command(
    mut_arg("device", |a| a.default_value("cpu")),
    mut_arg("dtype", |a| a.default_value("f32").help(fleet_cli::FIXED_DTYPE_HELP))
)]
pub struct ModelArgs {
    /// A local checkpoint directory or a hub id (owner/name).
    #[arg(long)]
    pub model: String,
    /// Hub revision (branch, tag or commit).
    #[arg(long)]
    pub revision: Option<String>,
    /// --device, --dtype; --gpu-mode, --gpu-ids, --max-memory where the command places by plan.
    #[command(flatten)]
    pub placement: fleet_cli::PlacementArgs,
}

impl ModelArgs {
    /// dtype and revision as load options (no device map).
    pub fn options(&self) -> Result<LoadOptions> {
        Ok(LoadOptions {
            dtype: parse_dtype(self.placement.dtype.as_deref().unwrap_or("f32"))?,
            revision: self.revision.clone(),
            ..LoadOptions::default()
        })
    }

    /// The checkpoint's config.json (no weights fetched).
    pub fn config(&self) -> Result<fleet_models::QwenConfig> {
        let config = fleet_models::ModelSource::config_file(
            &self.model,
            self.revision.as_deref(),
            &self.options()?.hub,
        )?;
        Ok(fleet_models::QwenConfig::from_file(&config)?)
    }

    /// The model on `--device` (`command` names the command in the error when a plan flag is
    /// given instead).
    pub fn load(&self, command: &str) -> Result<TextModel> {
        let (devices, _) = self.placement.by_hand(command)?;
        // The map needs the layer count, which is in config.json: read that file first (no
        // weights fetched), then load with the map.
        let opts = self.options()?;
        let cfg = self.config()?;
        let map = if devices.len() == 1 {
            DeviceMap::single(devices[0], cfg.num_hidden_layers)
        } else {
            DeviceMap::split_layers(&devices, cfg.num_hidden_layers)?
        };
        tracing::info!("placing {}", map);
        let opts = LoadOptions {
            device_map: Some(map),
            ..opts
        };
        Ok(TextModel::load(&self.model, &opts)?)
    }
}

/// A clap value parser for a count that must be at least `min` (a batch, a length, a number of
/// repeats): a smaller value is refused before any work starts, in clap's words
/// (`invalid value '0' for '--batch <BATCH>': must be at least 1`).
pub fn at_least(min: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync {
    move |s: &str| {
        let n: usize = s
            .trim()
            .parse()
            .map_err(|_| format!("`{s}` is not a whole number; give {min} or more"))?;
        if n < min {
            return Err(format!("must be at least {min}"));
        }
        Ok(n)
    }
}

pub fn devices(args: &DevicesArgs) -> Result<()> {
    let devices = fleet_topology::discover()?;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&devices)?)?;
        return Ok(());
    }
    let gib = |b: Option<u64>| {
        b.map(|b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64))
            .unwrap_or_else(|| "?".into())
    };
    outln!(
        "{:<8} {:<28} {:<8} {:>12} {:>12}  pci",
        "device",
        "name",
        "cc",
        "total",
        "free"
    )?;
    let topology = fleet_topology::Topology::from_devices(&devices);
    for d in &devices {
        let cc = d
            .compute_capability
            .map(|(a, b)| format!("{a}.{b}"))
            .unwrap_or_else(|| "-".into());
        outln!(
            "{:<8} {:<28} {:<8} {:>12} {:>12}  {}",
            d.location.to_string(),
            d.name,
            cc,
            gib(d.total_bytes),
            gib(d.free_bytes),
            d.pci_bus_id.as_deref().unwrap_or("-")
        )?;
    }
    if topology.gpus.len() > 1 {
        let peers = match &topology.peer_access {
            fleet_topology::PeerAccess::All => "every pair".to_string(),
            fleet_topology::PeerAccess::None => {
                "none (copies between GPUs go through host memory)".to_string()
            }
            fleet_topology::PeerAccess::Groups(groups) => groups
                .iter()
                .map(|g| {
                    g.iter()
                        .map(|i| format!("cuda:{i}"))
                        .collect::<Vec<_>>()
                        .join("+")
                })
                .collect::<Vec<_>>()
                .join(", "),
        };
        outln!("peer access: {peers}")?;
    }
    Ok(())
}

/// `--gpu-mode` places replicas by plan on this machine's GPUs instead of `--device`, for
/// `--ids-file`'s prompts: spread over the replicas in batches of `--max-batch`; one CPU replica
/// on a machine without GPUs.
#[derive(Args)]
#[command(
    mut_arg("gpu_mode", |a| a.requires("ids_file")),
    mut_arg("gpu_ids", |a| a.requires("gpu_mode")),
    mut_arg("max_memory", |a| a.requires("gpu_mode"))
)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The user message.
    #[arg(long, required_unless_present = "ids_file")]
    pub prompt: Option<String>,
    /// Instead of a chat prompt: a JSON file {"input_ids": [[...], ...]} of prompts (any
    /// lengths); prints one JSON line per prompt, in order.
    #[arg(long, conflicts_with = "prompt")]
    pub ids_file: Option<PathBuf>,
    /// With --ids-file: sequences decoded at once per replica (at least 1).
    #[arg(long, default_value_t = 32, value_parser = at_least(1))]
    pub max_batch: usize,
    /// With --ids-file: `continuous` (a finished prompt's place goes at once to the next, on a
    /// paged KV cache that computes shared prompt prefixes once) or `static` (batches of
    /// --max-batch, each waiting for its longest). The same tokens either way.
    #[arg(long, value_enum, default_value = "continuous")]
    pub batching: fleet_cli::Batching,
    /// With --ids-file and continuous batching: decode steps queued before their tokens are
    /// read back (vLLM's name); the same tokens for any value, a finished prompt's place
    /// refilled up to that many steps later.
    #[arg(long, default_value_t = 1, value_parser = at_least(1))]
    pub num_scheduler_steps: usize,
    /// A system message (else the template's default, if it has one).
    #[arg(long)]
    pub system: Option<String>,
    /// Send the prompt as plain text, without the chat template.
    #[arg(long)]
    pub raw: bool,
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Greedy unless --temperature is above 0.
    #[command(flatten)]
    pub sampling: fleet_cli::SamplingArgs,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
}

/// `requests` with continuous batching over every replica (`max_batch` slots each, KV for
/// that many of the longest request, tokens read back every `num_scheduler_steps`): each
/// request goes to the least busy replica as slots free up. Outputs in request order.
fn generate_streamed(
    replicas: &Replicas<Text>,
    requests: &[GenerationRequest],
    max_batch: usize,
    num_scheduler_steps: usize,
) -> Result<Vec<fleet_models::GenerationOutput>> {
    let options = PagedOptions::for_requests(requests, max_batch, 16);
    let kv_bytes = options.num_blocks as u64 * replicas.models[0].model.paged_block_bytes(16);
    let mut streams = replicas.streams(fleet_serve::StreamConfig {
        num_scheduler_steps,
        ..fleet_serve::StreamConfig::new(max_batch, kv_bytes)
    })?;
    let mut outputs = vec![None; requests.len()];
    let mut next = 0;
    let bar = indicatif::ProgressBar::new(requests.len() as u64);
    loop {
        // Keep every replica's slots (and a step's worth more) busy.
        while next < requests.len() {
            let s = streams
                .iter_mut()
                .min_by_key(|s| s.in_flight())
                .expect("a replica");
            if s.in_flight() >= 2 * max_batch {
                break;
            }
            s.submit(next as u64, requests[next].clone())?;
            next += 1;
        }
        if streams.iter().all(|s| s.in_flight() == 0) {
            break;
        }
        for (id, out) in fleet_serve::step_all(&mut streams)? {
            outputs[id as usize] = Some(out);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    Ok(outputs
        .into_iter()
        .map(|o| o.expect("every request came back"))
        .collect())
}

pub fn generate(args: &GenerateArgs) -> Result<()> {
    let sampling = args.sampling.params(0.0, args.seed)?;
    let request = |prompt_ids: Vec<u32>| GenerationRequest {
        prompt_ids,
        max_new_tokens: args.max_new_tokens,
        sampling: sampling.clone(),
        stop_strings: args.stop.clone(),
    };
    if let Some(path) = &args.ids_file {
        let requests: Vec<GenerationRequest> =
            read_ids_file(path)?.into_iter().map(request).collect();
        let outputs = match &args.model.placement.gpu_mode {
            Some(_) => {
                let longest = requests
                    .iter()
                    .map(|r| r.prompt_ids.len())
                    .max()
                    .unwrap_or(1);
                let placement = args.model.placement.request(fleet_topology::Workload {
                    batch: args.max_batch.min(requests.len()).max(1),
                    seq_len: longest + args.max_new_tokens,
                    full_logits: false,
                    kv_pool_bytes: None,
                    max_attention_bytes: None,
                })?;
                let loading = std::time::Instant::now();
                let replicas = Replicas::<Text>::load_planned(
                    &args.model.model,
                    &args.model.options()?,
                    &placement,
                )?;
                eprintln!(
                    "{} replica(s) ({} in processes of their own), loaded in {:.1} s",
                    replicas.len(),
                    replicas.in_processes(),
                    loading.elapsed().as_secs_f64()
                );
                let generating = std::time::Instant::now();
                let outputs = match args.batching {
                    fleet_cli::Batching::Static => {
                        replicas.generate(&requests, args.max_batch, true)?
                    }
                    fleet_cli::Batching::Continuous => generate_streamed(
                        &replicas,
                        &requests,
                        args.max_batch,
                        args.num_scheduler_steps,
                    )?,
                };
                let secs = generating.elapsed().as_secs_f64();
                let tokens: usize = outputs.iter().map(|o| o.token_ids.len()).sum();
                eprintln!(
                    "generated {tokens} tokens in {secs:.2} s: {:.1} new tok/s",
                    tokens as f64 / secs.max(1e-9)
                );
                outputs
            }
            None => {
                let model = args.model.load("fleet generate")?;
                match args.batching {
                    fleet_cli::Batching::Static => {
                        let mut outputs = Vec::with_capacity(requests.len());
                        for batch in requests.chunks(args.max_batch) {
                            outputs.extend(model.generate(batch, None)?);
                        }
                        outputs
                    }
                    fleet_cli::Batching::Continuous => {
                        let options = PagedOptions {
                            sync_every: args.num_scheduler_steps,
                            ..PagedOptions::for_requests(&requests, args.max_batch, 16)
                        };
                        model
                            .generator()
                            .generate_paged(&requests, &options, None)?
                            .0
                    }
                }
            }
        };
        for out in outputs {
            outln!("{}", serde_json::to_string(&out)?)?;
        }
        return Ok(());
    }
    let model = args.model.load("fleet generate")?;
    let prompt = args.prompt.clone().unwrap_or_default();
    let prompt_ids = if args.raw {
        model.tokenizer()?.encode(&prompt)?
    } else {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage::new("system", s.clone()));
        }
        messages.push(ChatMessage::new("user", prompt));
        model.chat_prompt(&messages, true)?
    };
    let request = request(prompt_ids);
    let start = std::time::Instant::now();
    let mut write_error = None;
    let mut on_token = |e: fleet_models::StreamEvent<'_>| {
        if write_error.is_some() {
            return;
        }
        if let Err(err) = out!("{}", e.text_delta) {
            write_error = Some(err);
        } else if fleet_cli::stdout::closed() {
            // The reply goes only to stdout and nobody reads the rest of it: stop now, as
            // SIGPIPE's default would, rather than generate it for nobody.
            std::process::exit(0);
        }
    };
    let out = model.generate(std::slice::from_ref(&request), Some(&mut on_token))?;
    if let Some(err) = write_error {
        return Err(err);
    }
    let secs = start.elapsed().as_secs_f64();
    outln!()?;
    eprintln!(
        "[{} tokens, {:?}, {:.1} tok/s]",
        out[0].token_ids.len(),
        out[0].finish_reason,
        out[0].token_ids.len() as f64 / secs
    );
    Ok(())
}

#[derive(Args)]
#[command(
    mut_arg("gpu_mode", |a| a.hide(true)),
    mut_arg("gpu_ids", |a| a.hide(true)),
    mut_arg("max_memory", |a| a.hide(true))
)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated token ids of one sequence.
    #[arg(long, conflicts_with = "ids_file")]
    pub ids: Option<String>,
    /// A JSON file {"input_ids": [[...], ...]} of equal-length sequences.
    #[arg(long)]
    pub ids_file: Option<PathBuf>,
    /// Write a safetensors file with tensor "logits" (f32, [n, len, vocab]) instead of JSON on
    /// stdout (for large vocabularies).
    #[arg(long)]
    pub output: Option<PathBuf>,
}

pub fn logits(args: &LogitsArgs) -> Result<()> {
    let ids: Vec<Vec<u32>> = match (&args.ids, &args.ids_file) {
        (Some(s), _) => vec![s
            .split(',')
            .map(|t| {
                t.trim()
                    .parse::<u32>()
                    .with_context(|| format!("--ids: `{t}` is not a token id"))
            })
            .collect::<Result<_>>()?],
        (None, Some(p)) => read_ids_file(p)?,
        (None, None) => bail!("give --ids 1,2,3 or --ids-file FILE"),
    };
    // Checked before loading (a large checkpoint takes a while to load): a position past the
    // model's last has no rotary embedding.
    let flag = if args.ids.is_some() {
        "--ids"
    } else {
        "--ids-file"
    };
    let max_positions = args.model.config()?.max_position_embeddings;
    if let Some(row) = ids.iter().find(|r| r.len() > max_positions) {
        bail!(
            "{flag}: a sequence of {} positions is longer than this model's \
             max_position_embeddings = {max_positions}; give at most {max_positions} ids per \
             sequence",
            row.len()
        );
    }
    let model = args.model.load("fleet logits")?;
    let logits = model
        .model
        .logits(&ids)?
        .to_device(&candle_core::Device::Cpu)?;
    match &args.output {
        Some(path) => {
            candle_core::safetensors::save(&HashMap::from([("logits".to_string(), logits)]), path)
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        None => {
            let v: Vec<Vec<Vec<f32>>> = logits.to_vec3()?;
            outln!("{}", serde_json::json!({ "input_ids": ids, "logits": v }))?;
        }
    }
    Ok(())
}

/// Reads {"input_ids": [[...], ...]}.
fn read_ids_file(path: &std::path::Path) -> Result<Vec<Vec<u32>>> {
    #[derive(serde::Deserialize)]
    struct IdsFile {
        input_ids: Vec<Vec<u32>>,
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_json::from_str::<IdsFile>(&text)
        .with_context(|| {
            format!(
                "{}: expected {{\"input_ids\": [[ids...], ...]}}",
                path.display()
            )
        })?
        .input_ids)
}

#[derive(Args)]
#[command(
    mut_arg("gpu_mode", |a| a.visible_alias("mode")),
    mut_arg("dtype", |a| a.default_value("bf16").help(fleet_cli::FIXED_DTYPE_HELP))
)]
pub struct PlanArgs {
    /// A checkpoint directory, a hub id (only config.json is fetched) or a config.json file
    /// such as configs/models/qwen2.5-7b.json.
    #[arg(long)]
    pub model: String,
    /// Hub revision.
    #[arg(long)]
    pub revision: Option<String>,
    /// A topology TOML (configs/topologies/) or `live` for the GPUs of this machine.
    #[arg(long, default_value = "live")]
    pub topology: String,
    /// The placement planned (--gpu-mode, alias --mode; or --device), --gpu-ids,
    /// --max-memory and --dtype (default bf16).
    #[command(flatten)]
    pub placement: fleet_cli::PlacementArgs,
    /// Sequences per replica the plan must hold (at least 1).
    #[arg(long, default_value_t = 1, value_parser = at_least(1))]
    pub batch: usize,
    /// Tokens per sequence (prompt + generated; at least 1).
    #[arg(long, default_value_t = 2048, value_parser = at_least(1))]
    pub seq_len: usize,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn plan(args: &PlanArgs) -> Result<()> {
    use fleet_topology::{ModelShape, PlanRequest, Topology, Workload};
    let config = fleet_models::ModelSource::config_file(
        &args.model,
        args.revision.as_deref(),
        &fleet_models::HubOptions::from_env(),
    )?;
    let mut shape = ModelShape::from_config_file(&config)?;
    // A checkpoint directory (local, or a hub snapshot already in the cache) gives exact
    // parameter counts from its safetensors headers; a lone config.json gives estimates.
    // A bare file name (`--model config.json`) lives in the working directory.
    let dir = match config.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    let has_weights = std::fs::read_dir(dir)
        .with_context(|| format!("listing {} for the checkpoint's weights", dir.display()))?
        .filter_map(|e| e.ok())
        .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"));
    if has_weights {
        shape = shape.with_checkpoint(fleet_topology::CheckpointParams::from_dir(dir)?)?;
    }
    let mut topology = if args.topology == "live" {
        Topology::from_devices(&fleet_topology::discover()?)
    } else {
        Topology::from_file(&args.topology)?
    };
    let (mode, gpu_ids) = args.placement.plan_mode_and_gpus()?;
    if let Some(ids) = &gpu_ids {
        topology = topology.select(ids)?;
    }
    let request = PlanRequest {
        mode: mode.parse()?,
        dtype: args.placement.dtype.as_deref().unwrap_or("bf16").parse()?,
        workload: Workload {
            batch: args.batch,
            seq_len: args.seq_len,
            ..Workload::default()
        },
        max_memory: match &args.placement.gpus.max_memory {
            Some(m) => m.parse()?,
            None => fleet_topology::MaxMemory::new(),
        },
    };
    let plan = fleet_topology::plan(&shape, &topology, &request)?;
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&plan)?)?;
    } else {
        out!("{plan}")?;
    }
    Ok(())
}
