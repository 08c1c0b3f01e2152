//! What fleet's binaries share (as ripgrep's `grep-cli`): the version and commit they were
//! built from ([`VERSION`], [`init`]), stdout that a reader may close without costing the run
//! its files ([`stdout`], [`out!`], [`outln!`]), the flags every binary spells the same way
//! ([`SamplingArgs`], [`PlacementArgs`] — `--device`, `--dtype`, `--gpu-mode`, `--gpu-ids`,
//! `--max-memory`, flattened by all four binaries), the logging set-up, and `main`'s handling
//! of the command's result ([`exit`]).

#![warn(missing_docs)]

pub mod bench;
pub mod stdout;

mod placement;
mod sampling;

pub use placement::{parse_devices, GpuSelectionArgs, PlacementArgs, FIXED_DTYPE_HELP};
pub use sampling::SamplingArgs;

/// How generation requests share the decode batch: every binary's `--batching`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Batching {
    /// One left-padded batch per call; finished rows leave it, nobody joins it.
    Static,
    /// Continuous batching on a paged KV cache: a finished request's place is refilled at
    /// once, and prompt blocks seen before are not computed again.
    Continuous,
}

use std::io::IsTerminal;
use std::process::ExitCode;

/// The commit fleet was built from (`git rev-parse HEAD` at build time, `-dirty` when tracked
/// files differed from it; `FLEET_BUILD_COMMIT` set at build time wins; else `unknown`).
pub const BUILD_COMMIT: &str = env!("FLEET_BUILD_COMMIT");

/// `--version` of every binary: fleet's version and the commit it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("FLEET_BUILD_COMMIT"),
    ")"
);

// `--dtype`'s default, said the same way by every binary and job (defined beside the dtypes).
pub use fleet_models::{default_dtype, dtype_or_default};

/// What every binary does first: registers the build ([`BUILD_COMMIT`] becomes what manifests,
/// checkpoints and reports record through `fleet_runs::commit_id`) and sets up logging
/// ([`init_logging`]).
pub fn init() {
    fleet_runs::set_build(env!("CARGO_PKG_VERSION"), BUILD_COMMIT);
    init_logging();
}

/// Logs of the libraries (tracing) to stderr, `warn` and above unless `RUST_LOG` says
/// otherwise: a warning such as a checkpoint tensor the model does not use reaches the user.
/// Colour only when stderr is a terminal: no escape codes in a log file or a pipe.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

/// The exit of a command: success, or the error and its causes on stderr and failure.
///
/// The message only, also with `RUST_BACKTRACE=1` set: an error returned here is the user's
/// to fix (a bad flag, a missing file) and says what to do; a backtrace is for bugs, which
/// panic and get one from the panic hook.
pub fn exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", error_message(&e));
            ExitCode::FAILURE
        }
    }
}

/// `Error: <message>` and, when there are causes, `Caused by:` with each one numbered, as
/// anyhow prints an error returned from `main`, without the backtrace.
///
/// A GPU out-of-memory error (candle's carries a backtrace of unnamed frames) is printed without
/// the frames and with what to do, naming the logical devices' caps when the process runs on
/// them.
pub fn error_message(error: &anyhow::Error) -> String {
    let mut text = format!("Error: {error}");
    let causes: Vec<String> = error.chain().skip(1).map(|c| c.to_string()).collect();
    if !causes.is_empty() {
        text.push_str("\n\nCaused by:");
        for (i, cause) in causes.iter().enumerate() {
            text.push_str(&format!("\n    {i}: {cause}"));
        }
    }
    if text.contains("CUDA_ERROR_OUT_OF_MEMORY") {
        text = without_backtrace(&text);
        text.push_str(&format!("\n\n{}", out_of_memory_hint()));
    }
    text
}

/// `text` without backtrace lines (`  12: <unknown>`, `   3: candle_core::...`,
/// `             at src/x.rs:3`); numbered causes (`    0: reading the dataset`) stay.
fn without_backtrace(text: &str) -> String {
    text.lines()
        .filter(|l| {
            let t = l.trim_start();
            let frame = t.split_once(": ").is_some_and(|(n, rest)| {
                !n.is_empty()
                    && n.chars().all(|c| c.is_ascii_digit())
                    && (rest == "<unknown>" || rest.contains("::") || rest.starts_with("__"))
            });
            let location = t.starts_with("at ") && l.len() - t.len() > 8;
            !(frame || location)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// What to do about a GPU out-of-memory error.
fn out_of_memory_hint() -> String {
    match fleet_topology::logical::installed() {
        Some(l) => {
            let caps: Vec<String> = fleet_topology::discover()
                .map(|d| {
                    d.iter()
                        .map(|d| {
                            format!(
                                "{} {}",
                                d.location,
                                d.total_bytes
                                    .map(fleet_topology::format_bytes)
                                    .unwrap_or_default()
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            format!(
                "A logical device ran out of its memory cap ({}: {}): give each more memory \
                 ({}), spread the model over more of them, or lower the batch.",
                l.source,
                caps.join(", "),
                fleet_topology::logical::LABEL
            )
        }
        None => "A GPU ran out of memory: lower the batch, spread the model over more GPUs \
                 (--gpu-mode layer-sharded or hybrid), or plan first (--plan / fleet plan) to see \
                 what fits."
            .to_string(),
    }
}

/// Parses the command line of a binary whose top-level arguments belong to its default command
/// (no subcommand) and that also has subcommands: a global flag (`--logical-gpus`) may stand
/// before a subcommand, any other top-level argument may not (clap's
/// `args_conflicts_with_subcommands` refuses global flags there too). Exits with clap's usage
/// error naming the misplaced flag, as `Parser::parse` does.
pub fn parse_default_command_cli<P: clap::Parser>() -> P {
    let mut command = P::command();
    let matches = command.clone().get_matches();
    if let Some((sub, _)) = matches.subcommand() {
        let misplaced: Vec<String> = command
            .get_arguments()
            .filter(|a| !a.is_global_set())
            .filter(|a| {
                matches!(
                    matches.value_source(a.get_id().as_str()),
                    Some(clap::parser::ValueSource::CommandLine)
                )
            })
            .map(|a| match a.get_long() {
                Some(long) => format!("--{long}"),
                None => a.get_id().to_string(),
            })
            .collect();
        if !misplaced.is_empty() {
            command
                .error(
                    clap::error::ErrorKind::ArgumentConflict,
                    format!(
                        "{} belong(s) to the default command (no subcommand), not to `{sub}`: drop it, \
                         or run without `{sub}`",
                        misplaced.join(", ")
                    ),
                )
                .exit();
        }
    }
    P::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut command).exit())
}

/// The `--logical-gpus` flag, for every binary's top-level arguments (`#[command(flatten)]`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LogicalGpusArg {
    /// Present N logical devices on one GPU (`N`, `N:MEM` each capped at MEM, `N:MEM@GPU`),
    /// each with its own stream and memory cap, to run multi-GPU placements on one GPU; every
    /// device list, plan and record then says "logical devices on one GPU".
    #[arg(long, global = true, value_name = "N[:MEM][@GPU]")]
    pub logical_gpus: Option<String>,
}

impl LogicalGpusArg {
    /// Installs the logical devices asked for ([`logical_gpus`]).
    pub fn install(&self) -> anyhow::Result<()> {
        logical_gpus(self.logical_gpus.as_deref())
    }
}

/// `--logical-gpus N[:MEM][@GPU]` (every binary's flag): presents N logical devices on one
/// physical GPU, each with its own stream and memory cap (`fleet_topology::logical`), so that
/// multi-GPU placements run on one GPU. Checked against the GPUs this process sees before
/// anything loads (no GPU, a GPU index that does not exist, caps beyond the GPU's memory: an
/// error naming the flag and the fix); then every device list, plan and log line says
/// "logical devices on one GPU". `None` leaves the physical GPUs.
pub fn logical_gpus(spec: Option<&str>) -> anyhow::Result<()> {
    let Some(spec) = spec else {
        return Ok(());
    };
    let logical = fleet_topology::logical::LogicalGpus::parse_flag(spec)?;
    fleet_topology::logical::install(logical)?;
    let devices = fleet_topology::discover()?;
    tracing::warn!(
        "{} {}: {}",
        devices.len(),
        fleet_topology::logical::LABEL,
        devices
            .iter()
            .map(|d| d.location.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_prints_its_causes_and_no_backtrace() {
        let e = anyhow::anyhow!("no such file: x.json")
            .context("reading the dataset")
            .context("gspo-train");
        assert_eq!(
            error_message(&e),
            "Error: gspo-train\n\nCaused by:\n    0: reading the dataset\n    1: no such file: x.json"
        );
        assert_eq!(
            error_message(&anyhow::anyhow!("bad flag")),
            "Error: bad flag"
        );
    }

    #[test]
    fn a_gpu_out_of_memory_error_drops_its_backtrace_and_says_what_to_do() {
        let e = anyhow::anyhow!(
            "tensor error: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")\n   0: <unknown>\n   1: candle_core::tensor::Tensor::zeros\n             at src/tensor.rs:10\n  17: __libc_start_main"
        )
        .context("loading the policy");
        let text = error_message(&e);
        assert!(
            !text.contains("<unknown>") && !text.contains("__libc") && !text.contains("tensor.rs"),
            "{text}"
        );
        assert!(
            text.contains("CUDA_ERROR_OUT_OF_MEMORY") && text.contains("Error: loading the policy"),
            "{text}"
        );
        assert!(text.contains("lower the batch"), "{text}");
    }

    #[test]
    fn the_version_names_the_commit() {
        assert!(VERSION.contains(BUILD_COMMIT), "{VERSION}");
        assert!(!BUILD_COMMIT.is_empty());
    }
}
