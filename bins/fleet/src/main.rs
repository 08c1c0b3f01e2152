//! `fleet`: the toolbox. Each subcommand turns flags into library calls and prints.

mod bench;
mod bench_dp;
mod cli;

use anyhow::Result;
use clap::Parser;

fn main() -> Result<()> {
    // A replica worker started by this program's own data-parallel path serves and exits here.
    fleet_models::replica_process::serve_if_replica_worker();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = cli::Cli::parse();
    match args.command {
        cli::Command::Devices(a) => cli::devices(&a),
        cli::Command::Generate(a) => cli::generate(&a),
        cli::Command::Logits(a) => cli::logits(&a),
        cli::Command::Plan(a) => cli::plan(&a),
        cli::Command::Bench(cli::BenchCommand::Generate(a)) => bench::generate(&a),
        cli::Command::Bench(cli::BenchCommand::DataParallel(a)) => bench_dp::run(&a),
    }
}
