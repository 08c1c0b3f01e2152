//! What fleet's binaries share (as ripgrep's `grep-cli`): stdout that ends a command quietly
//! when its reader goes away ([`stdout`], [`out!`], [`outln!`]), the logging set-up, and
//! `main`'s handling of the command's result ([`exit`]).

#![warn(missing_docs)]

pub mod stdout;

use std::process::ExitCode;

/// Logs of the libraries (tracing) to stderr, `warn` and above unless `RUST_LOG` says
/// otherwise: a warning such as a checkpoint tensor the model does not use reaches the user.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// The exit of a command: success; success when stdout's reader stopped reading (`| head`:
/// it has what it wanted); otherwise the error and its causes on stderr, as
/// `fn main() -> anyhow::Result<()>` prints them, and failure.
pub fn exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if stdout::is_closed(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:?}");
            ExitCode::FAILURE
        }
    }
}
