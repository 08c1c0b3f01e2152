//! gspo-train: GSPO reinforcement-learning fine-tuning of a Qwen model.
//!
//! With no flags it trains the bundled tiny model on the bundled synthetic task (single-digit
//! addition, rewarded by exact match) on the CPU: the embedded default. `--config` takes a TOML
//! of TRL's GRPOConfig names (configs/gspo/); flags and `--set key=value` override it.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use fleet_cli::outln;
use fleet_gspo::{prepare, GspoConfig, RunOptions, StepMetrics};
use indicatif::{ProgressBar, ProgressStyle};

/// The embedded default's config (configs/gspo/default.toml).
const DEFAULT_CONFIG: &str = include_str!("../../../configs/gspo/default.toml");

/// The bundled model and task (assets/gspo-default/, made by
/// scripts/fixtures/make_gspo_default.py).
const DEFAULT_FILES: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../../../assets/gspo-default/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../../assets/gspo-default/generation_config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../../assets/gspo-default/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../../assets/gspo-default/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../../assets/gspo-default/tokenizer_config.json"),
    ),
    (
        "train.jsonl",
        include_bytes!("../../../assets/gspo-default/train.jsonl"),
    ),
];

#[derive(Parser, Debug)]
#[command(
    name = "gspo-train",
    version = fleet_cli::VERSION,
    about = "GSPO RL fine-tuning of Qwen LLMs (TRL's GRPOConfig names)",
    long_about = "GSPO reinforcement-learning fine-tuning of Qwen LLMs. With no flags: the \
                  embedded default (a tiny bundled model learns single-digit addition from \
                  rewards on the CPU). Settings use TRL's GRPOConfig names; the seed's \
                  BATCH_SIZE, GROUP_SIZE and GSPO_EPOCHS are accepted by --set.",
    mut_arg("gpu_mode", |a| a.help(
        "Placement of policy, reference and reward: 1gpu, 2gpu (policy over GPUs 0,1; \
         reference and reward on 1), 3gpu (policy over 0,1; reference and reward on 2) or auto \
         (the default)."
    )),
    mut_arg("device", |a| a.help(
        "The GPUs of a preset, in its order: one is 1gpu, two 2gpu, three 3gpu (e.g. \
         cuda:2,cuda:3). To train on the CPU, hide the GPUs (CUDA_VISIBLE_DEVICES=)."
    ))
)]
struct Cli {
    #[command(flatten)]
    logical: fleet_cli::LogicalGpusArg,
    /// Training config TOML (configs/gspo/*.toml; TRL's names). Default: the embedded default.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The policy to train: a checkpoint directory or a hub id (default: the config's
    /// model_name_or_path, else the bundled tiny model).
    #[arg(long)]
    model: Option<String>,
    /// Hub revision of --model.
    #[arg(long)]
    revision: Option<String>,
    /// Prompt dataset, JSONL: `prompt` (text or chat messages) and `answer` (GSM8K's
    /// `question`/`answer` accepted). Default: the config's dataset_name, else the bundled task.
    #[arg(long)]
    dataset: Option<PathBuf>,
    /// Where checkpoints, metrics.jsonl and the plots go (config: output_dir).
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// Completions per prompt, G (GROUP_SIZE).
    #[arg(long)]
    num_generations: Option<String>,
    /// Completions per micro-batch (BATCH_SIZE).
    #[arg(long)]
    per_device_train_batch_size: Option<String>,
    /// Passes over each generation batch (GSPO_EPOCHS).
    #[arg(long)]
    num_iterations: Option<String>,
    /// Micro-batches a generation batch is cut into (the paper: 4).
    #[arg(long)]
    steps_per_generation: Option<String>,
    /// Lower clip range of the sequence ratio (GSPO: 3e-4).
    #[arg(long)]
    epsilon: Option<String>,
    /// Upper clip range (GSPO: 4e-4).
    #[arg(long)]
    epsilon_high: Option<String>,
    /// KL coefficient to the reference model (0: no reference model is loaded).
    #[arg(long)]
    beta: Option<String>,
    /// AdamW learning rate.
    #[arg(long)]
    learning_rate: Option<String>,
    /// Most tokens per completion.
    #[arg(long)]
    max_completion_length: Option<String>,
    /// Optimizer steps to train.
    #[arg(long)]
    max_steps: Option<String>,
    /// Run seed (sampling, shuffling).
    #[arg(long)]
    seed: Option<String>,
    /// Dtype of the trained weights, their gradients and AdamW's moments: `float32` (default)
    /// or `bfloat16` (TRL's arithmetic and memory with a bf16-loaded model; updates below a
    /// weight's bf16 resolution round away).
    #[arg(long)]
    torch_dtype: Option<String>,
    /// Fit the micro-batch to memory before loading (transformers' name): the largest
    /// per_device_train_batch_size from the configured one down whose plan fits, with
    /// steps_per_generation and gradient_accumulation_steps grown to keep the same batches.
    #[arg(long)]
    auto_find_batch_size: bool,
    /// Any config field, or BATCH_SIZE / GROUP_SIZE / GSPO_EPOCHS: `--set GROUP_SIZE=8`.
    #[arg(long = "set", value_name = "KEY=VALUE", long_help = set_help())]
    set: Vec<String>,
    /// Placement and dtype: --gpu-mode (a preset), --gpu-ids, --max-memory or --device;
    /// --dtype.
    #[command(flatten)]
    placement: fleet_cli::PlacementArgs,
    /// Keep every block's activations instead of recomputing them in the backward (faster,
    /// more memory).
    #[arg(long)]
    no_gradient_checkpointing: bool,
    /// Print where everything goes and what it costs per device, then stop (loads nothing).
    #[arg(long)]
    plan: bool,
    /// With --plan: plan for the GPUs of this topology file (configs/topologies/*.toml)
    /// instead of this machine's, e.g. to size a run before renting the machine.
    #[arg(long, requires = "plan")]
    topology: Option<PathBuf>,
    /// Continue from the newest checkpoint in the output directory (an error when it holds
    /// none, as TRL's resume_from_checkpoint).
    #[arg(long)]
    resume: bool,
    /// Continue from this checkpoint of the output directory (TRL's resume_from_checkpoint
    /// with a path), e.g. an earlier one when the newest is damaged; the later ones are removed.
    #[arg(long, value_name = "DIR")]
    resume_from_checkpoint: Option<PathBuf>,
    /// Remove an earlier run's checkpoints and metrics from the output directory and start over.
    #[arg(long)]
    overwrite: bool,
    /// Data-parallel: start this many ranks on this machine, one GPU each (torchrun's name).
    #[arg(long, help_heading = "Data parallel")]
    nproc_per_node: Option<usize>,
    /// Machines of the run (with --nproc-per-node, started by hand on each).
    #[arg(long, default_value_t = 1, help_heading = "Data parallel")]
    nnodes: usize,
    /// This machine's index among --nnodes.
    #[arg(long, default_value_t = 0, help_heading = "Data parallel")]
    node_rank: usize,
    /// Address of rank 0's machine, reachable from every machine.
    #[arg(long, default_value = "127.0.0.1", help_heading = "Data parallel")]
    master_addr: String,
    /// Port rank 0 listens on for the rendezvous.
    #[arg(long, default_value_t = 29500, help_heading = "Data parallel")]
    master_port: u16,
    /// `none` (default): the config's batch is the global batch, shared by the ranks, the
    /// learning rate unchanged; `linear`: each rank takes the config's batch, and the learning
    /// rate is multiplied by the number of ranks (the linear scaling rule).
    #[arg(long, default_value = "none", help_heading = "Data parallel")]
    scale_lr: String,
    /// Seconds a rank may be silent (dead or stalled) before every rank stops with an error
    /// naming it; also how long the rendezvous waits for every rank.
    #[arg(long, default_value_t = 180, help_heading = "Data parallel")]
    dist_timeout: u64,
    /// Instead of training: time all-reduce between the ranks (the collective the gradients
    /// go through: NCCL on GPUs) for sizes from 4 KiB up to this, e.g. `1GiB`, and print
    /// nccl-tests' columns (algbw, busbw); with --output-dir also all_reduce_perf.json.
    #[arg(long, value_name = "MAX_SIZE", help_heading = "Data parallel")]
    bench_all_reduce: Option<String>,
}

/// `--set`'s long help: every key it takes (TRL's GRPOConfig names), and where checkpoints
/// fall.
fn set_help() -> String {
    let mut keys = String::new();
    let mut line = String::from("   ");
    for key in fleet_gspo::config::KEYS {
        if line.len() + key.len() > 88 {
            keys.push_str(&line);
            keys.push('\n');
            line = String::from("   ");
        }
        line.push(' ');
        line.push_str(key);
    }
    keys.push_str(&line);
    format!(
        "Any config field, or the seed's BATCH_SIZE / GROUP_SIZE / GSPO_EPOCHS: `--set \
         GROUP_SIZE=8`, `--set save_steps=100`. Repeatable; applied after --config and the \
         flags. The keys (TRL's GRPOConfig names; configs/gspo/*.toml use the same):\n{keys}\n\n\
         save_steps: checkpoints are written between generation batches, so that a resume \
         never replays half of one: after the generation batch in which a multiple of \
         save_steps falls. That is TRL's step when save_steps is a multiple of the optimizer \
         steps per generation batch (steps_per_generation x num_iterations / \
         gradient_accumulation_steps), else up to one generation batch later (save_steps=250 \
         with 4 steps per batch: checkpoint-252, then checkpoint-500)."
    )
}

/// The launcher's own flags: removed from the arguments its ranks get.
const LAUNCHER_FLAGS: &[&str] = &[
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--gpu-ids",
];

/// The bundled model and task, written once to a directory named by their content.
fn bundled_files() -> Result<PathBuf> {
    let mut digest = fleet_data::digest::Fnv64::new();
    for (name, bytes) in DEFAULT_FILES {
        digest.update(name.as_bytes());
        digest.update(bytes);
    }
    let dir = std::env::temp_dir().join(format!("fleet-gspo-default-{}", digest.hex()));
    for (name, bytes) in DEFAULT_FILES {
        let path = dir.join(name);
        if std::fs::read(&path).ok().as_deref() != Some(*bytes) {
            fleet_runs::write_atomic(&path, bytes)?;
        }
    }
    Ok(dir)
}

fn config(cli: &Cli) -> Result<GspoConfig> {
    let mut config = match &cli.config {
        Some(path) => GspoConfig::parse_toml_unvalidated(
            &std::fs::read_to_string(path)
                .with_context(|| format!("reading the config {}", path.display()))?,
            &path.display().to_string(),
        )?,
        None => GspoConfig::parse_toml_unvalidated(DEFAULT_CONFIG, "configs/gspo/default.toml")?,
    };
    let flags = [
        ("num_generations", &cli.num_generations),
        (
            "per_device_train_batch_size",
            &cli.per_device_train_batch_size,
        ),
        ("num_iterations", &cli.num_iterations),
        ("steps_per_generation", &cli.steps_per_generation),
        ("epsilon", &cli.epsilon),
        ("epsilon_high", &cli.epsilon_high),
        ("beta", &cli.beta),
        ("learning_rate", &cli.learning_rate),
        ("max_completion_length", &cli.max_completion_length),
        ("max_steps", &cli.max_steps),
        ("seed", &cli.seed),
        ("torch_dtype", &cli.torch_dtype),
    ];
    for (key, value) in flags {
        if let Some(v) = value {
            config.apply_override(key, v)?;
        }
    }
    if cli.auto_find_batch_size {
        config.apply_override("auto_find_batch_size", "true")?;
    }
    for assignment in &cli.set {
        config.apply_assignment(assignment)?;
    }
    if let Some(dir) = &cli.output_dir {
        config.output_dir = dir.clone();
    }
    config.validate()?;
    Ok(config)
}

fn run(cli: &Cli) -> Result<()> {
    if let Some(max) = &cli.bench_all_reduce {
        return bench_all_reduce(cli, max);
    }
    let config = config(cli)?;
    let mut label = None;
    let (model, dataset) = match (
        cli.model.clone().or(config.model_name_or_path.clone()),
        cli.dataset.clone().or(config.dataset_name.clone()),
    ) {
        (Some(m), Some(d)) => (m, d),
        (None, None) => {
            let dir = bundled_files()?;
            label = Some("bundled tiny Qwen2 (assets/gspo-default), single-digit addition");
            (dir.display().to_string(), dir.join("train.jsonl"))
        }
        (Some(_), None) => bail!(
            "--model is given but no --dataset (nor dataset_name in the config): give the prompts \
             to train on"
        ),
        (None, Some(_)) => bail!(
            "--dataset is given but no --model (nor model_name_or_path in the config): give the \
             checkpoint to train"
        ),
    };
    let gpus = match &cli.topology {
        Some(path) => !fleet_topology::Topology::from_file(path)?.gpus.is_empty(),
        None => fleet_topology::discover()?
            .iter()
            .any(|d| d.location.cuda_ordinal().is_some()),
    };
    let dtype = cli.placement.dtype_or_default(gpus)?;
    let (preset, gpu_ids) = preset_and_gpus(&cli.placement)?;
    let opts = RunOptions {
        model: model.clone(),
        revision: cli.revision.clone(),
        dataset: dataset.clone(),
        dtype,
        preset: preset.parse()?,
        gpu_ids,
        max_memory: match &cli.placement.gpus.max_memory {
            Some(m) => m.parse()?,
            None => Default::default(),
        },
        gradient_checkpointing: !cli.no_gradient_checkpointing,
        resume: cli.resume,
        resume_from_checkpoint: cli.resume_from_checkpoint.clone(),
        overwrite: cli.overwrite,
        plan_only: cli.plan,
        topology: cli.topology.clone(),
        dist: dist_options(cli)?,
    };
    let is_main = opts.dist.as_ref().is_none_or(|d| d.world.is_main());
    let prepared = prepare(&config, &opts)?;
    if !is_main {
        // The other ranks train quietly: rank 0 prints, logs and writes.
        let mut trainer = prepared.trainer.context("the trainer was not prepared")?;
        trainer.train(&mut |_| {})?;
        trainer.finish()?;
        return Ok(());
    }
    eprintln!("{}", prepared.dataset_report.trim_end());
    if cli.plan {
        outln!("{}", prepared.plan)?;
        return Ok(());
    }
    if let Some(env) = &prepared.environment {
        eprintln!("{env}");
    }
    let l = &prepared.layout;
    eprintln!(
        "batch: {} completions per micro-batch over all processes ({} per process), {} per \
         generation batch ({} prompts x G = {}); {} optimizer steps per epoch; learning rate x{}",
        l.global_micro_batch,
        l.per_rank_micro_batch,
        l.global_generation_batch,
        l.prompts_per_generation,
        config.num_generations,
        l.steps_per_epoch,
        l.lr_scale
    );
    eprintln!("{}", config.policy_explanation());
    if let Some(from) = &prepared.resumed_from {
        eprintln!("resuming from {}", from.display());
    }
    let mut trainer = prepared.trainer.context("the trainer was not prepared")?;
    let bar = ProgressBar::new(trainer.total_steps).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps  {elapsed} (ETA {eta})  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(trainer.state.step);
    let started = Instant::now();
    // The rewards of this run's steps, for the summary line (the full records are in
    // metrics.jsonl).
    let mut rewards: Vec<Option<f64>> = Vec::new();
    let value = |v: Option<f64>| v.map_or("-".into(), |r| format!("{r:.3}"));
    trainer.train_with(
        &mut |m: &StepMetrics| {
            bar.set_position(m.step);
            bar.set_message(format!(
                "reward {} loss {:.4}{}",
                value(m.reward),
                m.loss,
                m.kl.map_or(String::new(), |kl| format!(" kl {kl:.4}"))
            ));
            rewards.push(m.reward);
        },
        &mut |e: &fleet_gspo::EvalMetrics| {
            let passes: Vec<String> = e
                .values
                .iter()
                .filter(|(k, _)| k.starts_with("eval_pass@"))
                .map(|(k, v)| format!("{} {}", &k[5..], value(*v)))
                .collect();
            bar.println(format!(
                "eval at step {}: reward {}, {} ({} prompts, {:.1} s)",
                e.step,
                value(e.get("eval_reward")),
                passes.join(", "),
                value(e.get("eval_prompts")),
                e.eval_runtime
            ));
        },
    )?;
    bar.finish_and_clear();
    if let Some(merged) = trainer.export_merged()? {
        outln!(
            "merged the LoRA adapters into {} (transformers: AutoModelForCausalLM.from_pretrained)",
            merged.display()
        )?;
    }
    if let Some(best) = trainer.export_best()? {
        outln!(
            "best checkpoint {} ({} = {}): its model files are in {}",
            best.display(),
            config.best_metric().map(|m| m.0).unwrap_or_default(),
            value(trainer.state.best_metric),
            trainer.config.output_dir.display()
        )?;
    }
    // FLEET_PROFILE=1: where the time went (each stage synchronized; read the shares); with
    // FLEET_PROFILE=events each stage's span on the GPU's timeline, nothing synchronized.
    // Memory (coarse stages): the driver's figure, then the allocator's live and reserved bytes.
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    for r in fleet_models::profile::take_report() {
        eprintln!(
            "profile {:<32} {:>9.3} s {:>6} calls  host {:>9.3} s  peak {:>7.2} GiB  live {:>7.2} GiB  pool {:>7.2} GiB",
            r.stage,
            r.seconds,
            r.calls,
            r.host_seconds,
            gib(r.peak_bytes),
            gib(r.live_peak_bytes),
            gib(r.reserved_peak_bytes)
        );
    }
    let out = trainer.config.output_dir.clone();
    summarize(&rewards, started.elapsed().as_secs_f64(), &out)?;
    let subtitle = format!(
        "{} | G={} lr={} seed={}",
        label.map(str::to_string).unwrap_or_else(|| format!(
            "{model} | {}",
            dataset.file_name().unwrap_or_default().to_string_lossy()
        )),
        config.num_generations,
        config.learning_rate,
        config.seed
    );
    let (_, all) = fleet_gspo::MetricsLog::open(&out.join("metrics.jsonl"))?;
    for path in fleet_gspo::plot_training(&out, &all.records, &subtitle)? {
        outln!("wrote {}", path.display())?;
    }
    trainer.finish()?;
    drop(prepared.run_dir);
    Ok(())
}

/// This process as a rank of a data-parallel run, from the launcher's, torchrun's or SLURM's
/// variables; `None` for a plain run.
fn dist_options(cli: &Cli) -> Result<Option<fleet_gspo::DistOptions>> {
    let scaling: fleet_gspo::BatchScaling = cli.scale_lr.parse()?;
    let world = match (fleet_dist::World::from_env()?, cli.nproc_per_node) {
        // --plan --nproc-per-node N: the plan of rank 0 of N processes on this node (each
        // rank's batch share, ZeRO's shards); nothing is started.
        (None, Some(n)) if cli.plan && n > 1 => Some(fleet_dist::World {
            world_size: n,
            local_world_size: n,
            ..fleet_dist::World::single()
        }),
        (world, _) => world,
    };
    let Some(world) = world else {
        if scaling != fleet_gspo::BatchScaling::FixedGlobal {
            eprintln!(
                "warning: --scale-lr applies to data-parallel runs only; one process trains as \
                 configured"
            );
        }
        return Ok(None);
    };
    if cli.dist_timeout == 0 {
        bail!("--dist-timeout 0: give the seconds a rank may be silent, e.g. 180");
    }
    let timeout = std::time::Duration::from_secs(cli.dist_timeout);
    Ok(Some(fleet_gspo::DistOptions {
        world,
        scaling,
        rendezvous_timeout: timeout,
        failure_timeout: timeout,
    }))
}

/// `--gpu-mode` over `--gpu-ids`, or the preset `--device`'s GPUs make (one: 1gpu, two: 2gpu,
/// three: 3gpu, over those GPUs in order).
fn preset_and_gpus(placement: &fleet_cli::PlacementArgs) -> Result<(String, Option<Vec<usize>>)> {
    placement.mode_and_gpus(|ids| {
        if !(1..=3).contains(&ids.len()) {
            bail!(
                "--device names {} GPUs: gspo-train's --device names one, two or three (the \
                 1gpu, 2gpu or 3gpu preset over them)",
                ids.len()
            );
        }
        Ok(format!("{}gpu", ids.len()))
    })
}

/// `--bench-all-reduce MAX`: all-reduce timings between the ranks, printed by rank 0.
fn bench_all_reduce(cli: &Cli, max: &str) -> Result<()> {
    let max_bytes = fleet_topology::parse_bytes(max)
        .with_context(|| format!("--bench-all-reduce {max}"))? as usize;
    let dist = dist_options(cli)?.context(
        "--bench-all-reduce times the collective between ranks: start them with \
         --nproc-per-node N (or under torchrun or SLURM)",
    )?;
    let world_size = dist.world.world_size;
    let is_main = dist.world.is_main();
    let (rows, backend) = fleet_gspo::run::all_reduce_bench(
        &dist,
        preset_and_gpus(&cli.placement)?.1.as_deref(),
        max_bytes,
    )?;
    if !is_main {
        return Ok(());
    }
    outln!(
        "# all-reduce (sum, in place) over {world_size} ranks, backend {backend}; 20 calls per \
         size after 5 warm-up calls"
    )?;
    outln!("# busbw = algbw x 2(n-1)/n (nccl-tests' definition for all-reduce)")?;
    outln!(
        "{:>12} {:>12} {:>9} {:>11} {:>12} {:>12} {:>7}",
        "size(B)",
        "count",
        "type",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "#wrong"
    )?;
    for r in &rows {
        outln!(
            "{:>12} {:>12} {:>9} {:>11.1} {:>12.2} {:>12.2} {:>7}",
            r.bytes,
            r.count,
            r.dtype,
            r.time_us,
            r.algbw,
            r.busbw,
            if r.correct { "0" } else { "WRONG" }
        )?;
    }
    if let Some(dir) = &cli.output_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("all_reduce_perf.json");
        let json =
            serde_json::json!({ "world_size": world_size, "backend": backend, "rows": rows });
        fleet_runs::write_atomic(&path, serde_json::to_string_pretty(&json)?.as_bytes())?;
        outln!("wrote {}", path.display())?;
    }
    if rows.iter().any(|r| !r.correct) {
        bail!("all-reduce returned wrong sums (rows marked WRONG)");
    }
    Ok(())
}

/// `--nproc-per-node N`: starts N ranks of this program on this machine and waits for them.
fn launch(cli: &Cli, nproc: usize) -> Result<()> {
    if nproc == 0 {
        bail!("--nproc-per-node 0: give the number of processes (GPUs) to start on this machine");
    }
    if cli.node_rank >= cli.nnodes {
        bail!(
            "--node-rank {} with --nnodes {}: node ranks go from 0 to {}",
            cli.node_rank,
            cli.nnodes,
            cli.nnodes - 1
        );
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args = fleet_dist::strip_launcher_args(&args, LAUNCHER_FLAGS, &[]);
    let spec = fleet_dist::LaunchSpec {
        nproc_per_node: nproc,
        nnodes: cli.nnodes,
        node_rank: cli.node_rank,
        master_addr: cli.master_addr.clone(),
        master_port: cli.master_port,
        gpu_ids: preset_and_gpus(&cli.placement)?.1,
        program: std::env::current_exe().context("finding this program to start its ranks")?,
        args,
        env: Vec::new(),
    };
    let report = fleet_dist::launch(&spec)?;
    report.into_result()?;
    Ok(())
}

/// Reward at the start and at the end of this run, and where things are.
fn summarize(records: &[Option<f64>], seconds: f64, out: &Path) -> Result<()> {
    let mean = |rs: &[Option<f64>]| -> Option<f64> {
        let v: Vec<f64> = rs.iter().flatten().copied().collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let k = (records.len() / 10).max(1);
    if let (Some(first), Some(last)) = (
        mean(&records[..k.min(records.len())]),
        mean(&records[records.len().saturating_sub(k)..]),
    ) {
        outln!(
            "{} steps in {:.1} s: mean reward {:.3} over the first {k} steps -> {:.3} over the last {k}",
            records.len(),
            seconds,
            first,
            last
        )?;
    }
    if let Ok(latest) = fleet_gspo::checkpoint::latest(out) {
        let loader = if latest
            .join(fleet_gspo::checkpoint::ADAPTER_WEIGHTS)
            .exists()
        {
            "PEFT: PeftModel.from_pretrained(base, dir)"
        } else {
            "transformers: AutoModelForCausalLM.from_pretrained"
        };
        outln!("checkpoint {} ({loader})", latest.display())?;
    }
    outln!("metrics {}", out.join("metrics.jsonl").display())?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    fleet_serve::serve_if_replica_worker();
    fleet_cli::init();
    let cli = Cli::parse();
    if let Err(e) = cli.logical.install() {
        return fleet_cli::exit(Err(e));
    }
    match cli.nproc_per_node {
        Some(n) if !cli.plan && std::env::var_os("FLEET_LAUNCHER").is_none() => {
            fleet_cli::exit(launch(&cli, n))
        }
        _ => fleet_cli::exit(run(&cli)),
    }
}
