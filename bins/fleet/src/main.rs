//! `fleet`: the toolbox. Each subcommand turns flags into library calls and prints.

mod bench;
mod bench_dp;
mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // A replica worker started by this program's own data-parallel path serves and exits here.
    fleet_serve::serve_if_replica_worker();
    fleet_cli::init();
    let args = cli::Cli::parse();
    if let Err(e) = args.logical.install() {
        return fleet_cli::exit(Err(e));
    }
    let result = match args.command {
        cli::Command::Devices(a) => cli::devices(&a),
        cli::Command::Generate(a) => cli::generate(&a),
        cli::Command::Logits(a) => cli::logits(&a),
        cli::Command::Plan(a) => cli::plan(&a),
        cli::Command::Bench(cli::BenchCommand::Generate(a)) => bench::generate(&a),
        cli::Command::Bench(cli::BenchCommand::DataParallel(a)) => bench_dp::run(&a),
    };
    fleet_cli::exit(result)
}
