//! Embeds the commit fleet is built from (`FLEET_BUILD_COMMIT`), so that manifests, checkpoints
//! and reports name fleet's own source whatever directory the binary later runs in.
//!
//! `FLEET_BUILD_COMMIT` in the build's environment wins (a build from a source archive with no
//! .git); else `git rev-parse HEAD` in this crate's repository, with `-dirty` when tracked files
//! differ from it; else `unknown`.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR")?);
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-env-changed=FLEET_BUILD_COMMIT");
    // A new commit, a checkout or a change of the index (staging, committing) re-runs this.
    if let Some(git_dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        for f in ["HEAD", "index", "packed-refs"] {
            println!("cargo:rerun-if-changed={git_dir}/{f}");
        }
        if let Some(head_ref) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={git_dir}/{head_ref}");
        }
    }
    // An edit of the sources makes the tree dirty (or clean again).
    for dir in ["../../crates", "../../bins", "../../Cargo.toml"] {
        println!("cargo:rerun-if-changed={dir}");
    }
    let commit = std::env::var("FLEET_BUILD_COMMIT")
        .ok()
        .map(|c| c.trim().to_string())
        .filter(|c| !c.is_empty())
        .or_else(|| {
            let head = git(&["rev-parse", "HEAD"]).filter(|h| !h.is_empty())?;
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            Some(if dirty { format!("{head}-dirty") } else { head })
        })
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=FLEET_BUILD_COMMIT={commit}");
}
