//! edit-score: a Qwen3-VL judge for image-edit benchmarks.
//!
//! Subcommands: `bench` (judge throughput on random weights of a real shape, for comparison
//! with transformers) and `logits` (the judge's logits for one prompt with images, for parity
//! checks against transformers on real shapes).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod logits;

#[derive(Parser)]
#[command(
    name = "edit-score",
    version,
    about = "A Qwen3-VL judge for image-edit benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Judge throughput (samples/s) with random weights of a model shape: prefill of images
    /// and text, greedy decoding of a fixed number of tokens.
    Bench(bench::BenchArgs),
    /// The logits of every position of one prompt with images (a safetensors file).
    Logits(logits::LogitsArgs),
}

fn main() -> ExitCode {
    fleet_models::replica_process::serve_if_replica_worker();
    fleet_cli::init_logging();
    let cli = Cli::parse();
    fleet_cli::exit(match cli.command {
        Command::Bench(a) => bench::run(&a),
        Command::Logits(a) => logits::run(&a),
    })
}
