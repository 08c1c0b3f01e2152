//! Results to stdout, where a reader may stop reading (`argo-exp | head -n 3`) without costing
//! the run its results.
//!
//! Rust ignores SIGPIPE, so a write to a closed pipe fails with EPIPE and `println!` panics on
//! it. Restoring SIGPIPE's default would end the process at that write — before the summary,
//! the plots and the checkpoints it has yet to write — and would end it just as silently when
//! `generate --gpu-mode` writes a batch to a replica process that has died (that must stay an
//! error naming the replica). So the commands write stdout through [`write()`]: once stdout's
//! reader has gone, further output is dropped ([`closed`] says so) and the command goes on to
//! write its files and exit as it would have. Files never depend on stdout.

use std::fmt;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

static CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes `args` to stdout and flushes it (so that a closed pipe shows here, not at exit).
/// A closed stdout is not an error: the output is dropped and [`closed`] becomes true. Other
/// failures (a full disk behind a redirection) are errors that say so.
pub fn write(args: fmt::Arguments<'_>) -> anyhow::Result<()> {
    if closed() {
        return Ok(());
    }
    let mut out = io::stdout().lock();
    match out.write_fmt(args).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
            CLOSED.store(true, Ordering::Relaxed);
            Ok(())
        }
        Err(e) => Err(anyhow::Error::new(e).context("writing to stdout")),
    }
}

/// Whether stdout's reader has gone away (a write failed with a broken pipe). Output that only
/// goes to stdout (a streamed reply) may stop early then; results written to files must not.
pub fn closed() -> bool {
    CLOSED.load(Ordering::Relaxed)
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
