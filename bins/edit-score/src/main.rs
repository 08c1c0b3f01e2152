//! edit-score: a Qwen3-VL judge for image-edit benchmarks.
//!
//! The default command scores a benchmark (`edit-score --benchmark … --format … --prompts …
//! --model … --output …`; `--demo` scores a generated one with a tiny bundled judge).
//! Subcommands: `merge` (the output directories of shards into one), `report` (a directory's
//! report rebuilt), `bench` (judge throughput on random weights of a real shape, for comparison
//! with transformers) and `logits` (the judge's logits for one prompt with images, for parity
//! checks against transformers on real shapes).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod demo;
mod logits;
mod results;
mod score;

#[derive(Parser)]
#[command(
    name = "edit-score",
    version = fleet_cli::VERSION,
    about = "A Qwen3-VL judge for image-edit benchmarks",
    long_about = "A Qwen3-VL judge for image-edit benchmarks: one replica per GPU (or per GPU \
                  group), resumable per-item records, per-category reports. With no subcommand \
                  it scores --benchmark (or, with --demo, a generated benchmark with a tiny \
                  bundled judge whose random weights make its scores meaningless).",
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    score: score::ScoreArgs,
    #[command(flatten)]
    logical: fleet_cli::LogicalGpusArg,
}

#[derive(Subcommand)]
enum Command {
    /// Merge the output directories of the shards of one run (`--num-shards N`, each
    /// `--shard-index i`) into one, and write its report.
    Merge(results::MergeArgs),
    /// Rebuild the report (report.json, report.md, chart.png/.svg) of a run's or a merge's
    /// output directory and print it.
    Report(results::ReportArgs),
    /// Judge throughput (samples/s) with random weights of a model shape: prefill of images
    /// and text, greedy decoding of a fixed number of tokens.
    Bench(bench::BenchArgs),
    /// The logits of every position of one prompt with images (a safetensors file).
    Logits(logits::LogitsArgs),
}

fn main() -> ExitCode {
    fleet_serve::serve_if_replica_worker();
    fleet_cli::init();
    let cli: Cli = fleet_cli::parse_default_command_cli();
    if let Err(e) = cli.logical.install() {
        return fleet_cli::exit(Err(e));
    }
    fleet_cli::exit(match cli.command {
        None => score::run(&cli.score),
        Some(Command::Merge(a)) => results::merge(&a),
        Some(Command::Report(a)) => results::report(&a),
        Some(Command::Bench(a)) => bench::run(&a),
        Some(Command::Logits(a)) => logits::run(&a),
    })
}
