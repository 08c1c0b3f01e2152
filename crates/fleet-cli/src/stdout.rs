//! Results to stdout, where a reader that stops reading (`fleet plan ... | head -n 1`) ends the
//! command quietly.
//!
//! Rust ignores SIGPIPE, so a write to a closed pipe fails with EPIPE and `println!` panics on
//! it. Restoring SIGPIPE's default would end the process at that write, but it would end it just
//! as silently when `generate --gpu-mode` writes a batch to a replica process that has died:
//! that must stay an error naming the replica, with its batches re-queued to the others. So the
//! commands write stdout through [`write()`], a closed stdout travels up as [`StdoutClosed`], and
//! `main` turns it into a quiet exit.

use std::fmt;
use std::io::{self, Write};

/// Stdout's reader has gone away: nothing is wrong, the command ends quietly (exit status 0).
#[derive(Debug)]
pub struct StdoutClosed;

impl fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stdout was closed by its reader")
    }
}

impl std::error::Error for StdoutClosed {}

/// Writes `args` to stdout and flushes it (so that a closed pipe shows here, not at exit).
/// A closed stdout is [`StdoutClosed`]; other failures (a full disk) are errors that say so.
pub fn write(args: fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut out = io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.flush())
        .map_err(|e| match e.kind() {
            io::ErrorKind::BrokenPipe => anyhow::Error::new(StdoutClosed),
            _ => anyhow::Error::new(e).context("writing to stdout"),
        })
}

/// Whether `error` is (or wraps) [`StdoutClosed`].
pub fn is_closed(error: &anyhow::Error) -> bool {
    error.downcast_ref::<StdoutClosed>().is_some()
}

/// `print!` that returns `anyhow::Result<()>` through [`write()`].
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::stdout::write(format_args!($($arg)*))
    };
}

/// `println!` that returns `anyhow::Result<()>` through [`write()`].
#[macro_export]
macro_rules! outln {
    () => {
        $crate::stdout::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::stdout::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}
