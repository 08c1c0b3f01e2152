//! `fleet`: the toolbox. Each subcommand turns flags into library calls and prints.

mod bench;
mod bench_dp;
mod cli;
mod stdout;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // A replica worker started by this program's own data-parallel path serves and exits here.
    fleet_models::replica_process::serve_if_replica_worker();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = cli::Cli::parse();
    let result = match args.command {
        cli::Command::Devices(a) => cli::devices(&a),
        cli::Command::Generate(a) => cli::generate(&a),
        cli::Command::Logits(a) => cli::logits(&a),
        cli::Command::Plan(a) => cli::plan(&a),
        cli::Command::Bench(cli::BenchCommand::Generate(a)) => bench::generate(&a),
        cli::Command::Bench(cli::BenchCommand::DataParallel(a)) => bench_dp::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout stopped reading (`| head`): it has what it wanted.
        Err(e) if stdout::is_closed(&e) => ExitCode::SUCCESS,
        Err(e) => {
            // As `fn main() -> anyhow::Result<()>` prints it: the message and its causes.
            eprintln!("Error: {e:?}");
            ExitCode::FAILURE
        }
    }
}
