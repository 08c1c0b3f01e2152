//! Running the argo-exp binary from the tests.

use std::process::{Command, Output};

/// Runs argo-exp with `args` (and a fixed commit id for the summaries).
pub fn argo_exp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_argo-exp"))
        .args(args)
        .env("FLEET_COMMIT", "cli-test-commit")
        .output()
        .expect("argo-exp runs")
}
