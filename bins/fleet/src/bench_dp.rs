//! `fleet bench data-parallel`: batched generation throughput with one model replica per
//! device, driven by fleet-dist's replica pool (a shared queue of batches). The replicas are
//! threads of this process, so this measures the pool and the host-side contention between
//! GPUs of one process; the jobs' path (`fleet_serve::Replicas`) runs replicas after
//! the first in processes of their own.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use fleet_dist::{ItemResult, PoolOptions, ReplicaPool, Worker};
use fleet_models::{DeviceLocation, GenerationRequest, Generator, QwenModel};
use serde::Serialize;

use crate::cli::at_least;

/// `--device` (alias `--devices`) lists the replicas' devices here.
#[derive(Args)]
#[command(mut_arg("device", |a| a.visible_alias("devices").help(
    "The devices, e.g. `cuda:0,cuda:1,cuda:2,cuda:3` (`cpu,cpu` works too): one replica per \
     device, or per `--group-size` consecutive devices."
)))]
pub struct BenchDataParallelArgs {
    /// The model of every replica.
    #[command(flatten)]
    pub model: crate::bench::BenchModelArgs,
    /// Devices per replica: each replica's layers are split over this many consecutive devices
    /// of `--devices` (hybrid mode: replicas of shard groups; at least 1).
    #[arg(long, default_value_t = 1, value_parser = at_least(1))]
    pub group_size: usize,
    /// Prompts per batch (one queue item; at least 1).
    #[arg(long, default_value_t = 32, value_parser = at_least(1))]
    pub batch: usize,
    /// Queue items per replica (at least 1).
    #[arg(long, default_value_t = 4, value_parser = at_least(1))]
    pub batches_per_replica: usize,
    /// Prompt tokens per row (at least 1).
    #[arg(long, default_value_t = 512, value_parser = at_least(1))]
    pub prompt_len: usize,
    /// New tokens per row (at least 1).
    #[arg(long, default_value_t = 128, value_parser = at_least(1))]
    pub new_tokens: usize,
    /// Show per-replica progress bars.
    #[arg(long)]
    pub progress: bool,
    /// Write the results here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One replica: a model on its device(s), generating whole batches of `new_tokens` each. It
/// borrows the model, so that freeing the weights (seconds for a 72B shape) happens after the
/// timed pool run, not inside it.
struct Replica<'m> {
    name: String,
    model: &'m QwenModel,
    new_tokens: usize,
}

impl Worker<Vec<Vec<u32>>, usize> for Replica<'_> {
    fn name(&self) -> String {
        self.name.clone()
    }

    /// Generates the batch (never stopping early) and returns the new tokens.
    fn process(&mut self, prompts: &Vec<Vec<u32>>) -> Result<usize, fleet_dist::BoxError> {
        // No EOS ids: every row generates exactly `new_tokens`.
        let generator = Generator::new(self.model, None, Vec::new(), 0);
        let requests: Vec<GenerationRequest> = prompts
            .iter()
            .map(|p| GenerationRequest::greedy(p.clone(), self.new_tokens))
            .collect();
        let out = generator.generate(&requests, None)?;
        Ok(out.iter().map(|o| o.token_ids.len()).sum())
    }
}

#[derive(Serialize)]
struct Report {
    engine: &'static str,
    commit: String,
    config: String,
    dtype: String,
    devices: Vec<String>,
    group_size: usize,
    batch: usize,
    prompt_len: usize,
    new_tokens: usize,
    items: usize,
    new_tokens_total: usize,
    wall_s: f64,
    decode_tok_s: f64,
    /// Per replica: name, batches done, seconds busy generating.
    replicas: Vec<ReplicaReport>,
    /// On logical devices, that they are (one GPU's bandwidth and compute shared by all).
    #[serde(skip_serializing_if = "Option::is_none")]
    logical_devices: Option<String>,
    /// Per GPU device: the most bytes its live buffers held (its memory pool's high-water mark,
    /// weights included; on a logical device, its own pool, against its cap).
    peak_live_bytes: std::collections::BTreeMap<String, u64>,
}

#[derive(Serialize)]
struct ReplicaReport {
    name: String,
    batches: usize,
    busy_s: f64,
    new_tok_s_while_busy: f64,
}

pub fn run(args: &BenchDataParallelArgs) -> Result<()> {
    // A device may hold several replicas here (`cpu,cpu`): no duplicate check.
    let placement = &args.model.placement;
    placement.refuse_plan_flags("fleet bench data-parallel")?;
    let locations: Vec<DeviceLocation> = placement
        .device
        .as_deref()
        .unwrap_or("cuda:0")
        .split(',')
        .map(|d| d.trim().parse())
        .collect::<Result<_, _>>()?;
    let dtype = placement.dtype_or_default(locations.iter().any(|d| d.cuda_ordinal().is_some()))?;
    if !locations.len().is_multiple_of(args.group_size) {
        bail!(
            "--group-size {} must divide the {} devices of --devices",
            args.group_size,
            locations.len()
        );
    }
    let mut models = Vec::new();
    let mut label = String::new();
    for group in locations.chunks(args.group_size) {
        let (l, model) = args.model.build(group, dtype)?;
        label = l;
        models.push((group, model));
    }
    let mut replicas: Vec<Replica<'_>> = models
        .iter()
        .enumerate()
        .map(|(i, (group, model))| {
            let names: Vec<String> = group.iter().map(|d| d.to_string()).collect();
            Replica {
                name: format!("replica {i} {}", names.join("+")),
                model,
                new_tokens: args.new_tokens,
            }
        })
        .collect();
    let vocab = replicas
        .first()
        .map(|r| r.model.config().vocab_size)
        .unwrap_or(1);
    let replicas_n = replicas.len();
    let n_items = replicas_n * args.batches_per_replica;
    let items: Vec<Vec<Vec<u32>>> = (0..n_items)
        .map(|it| {
            (0..args.batch)
                .map(|r| {
                    (0..args.prompt_len)
                        .map(|i| ((it * 31 + r * 7919 + i * 104_729) % vocab) as u32)
                        .collect()
                })
                .collect()
        })
        .collect();
    // Warm-up on every replica (kernel loading, allocator growth), not timed.
    for r in replicas.iter_mut() {
        r.new_tokens = 2.min(args.new_tokens);
        r.process(&items[0])
            .map_err(|e| anyhow::anyhow!("warm-up on {}: {e}", r.name))?;
        r.new_tokens = args.new_tokens;
    }
    let opts = PoolOptions {
        progress: args.progress,
        label: "batches".into(),
        ..PoolOptions::default()
    };
    let start = Instant::now();
    let out = ReplicaPool::run(replicas, items, &opts)?;
    let wall = start.elapsed().as_secs_f64();
    let mut total = 0;
    for (i, r) in out.results.iter().enumerate() {
        match r {
            ItemResult::Done { output, .. } => total += output,
            ItemResult::Failed { errors } => bail!("batch {i} failed on every replica: {errors:?}"),
        }
    }
    let peak_live_bytes = fleet_cli::bench::device_peaks(&locations);
    let report = Report {
        engine: "fleet",
        commit: fleet_runs::commit_id(),
        config: label,
        dtype: args.model.dtype_name(),
        devices: locations.iter().map(|d| d.to_string()).collect(),
        group_size: args.group_size,
        batch: args.batch,
        prompt_len: args.prompt_len,
        new_tokens: args.new_tokens,
        items: n_items,
        new_tokens_total: total,
        wall_s: wall,
        decode_tok_s: total as f64 / wall,
        replicas: out
            .report
            .workers
            .iter()
            .map(|w| ReplicaReport {
                name: w.name.clone(),
                batches: w.items_done,
                busy_s: w.busy.as_secs_f64(),
                new_tok_s_while_busy: (w.items_done * args.batch * args.new_tokens) as f64
                    / w.busy.as_secs_f64().max(1e-9),
            })
            .collect(),
        logical_devices: fleet_topology::logical::describe(),
        peak_live_bytes,
    };
    eprintln!(
        "{} replica(s) of {} device(s): {} batches of {} x ({} + {}) in {:.2}s: {:.1} new tok/s",
        replicas_n,
        args.group_size,
        n_items,
        args.batch,
        args.prompt_len,
        args.new_tokens,
        wall,
        report.decode_tok_s
    );
    fleet_cli::bench::print_device_peaks(
        &report.peak_live_bytes,
        report.logical_devices.as_deref(),
    );
    fleet_cli::bench::write_report(&report, args.json.as_deref())?;
    Ok(())
}
