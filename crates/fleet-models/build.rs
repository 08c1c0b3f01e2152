//! With the `cuda` feature, compiles the kernels to PTX with nvcc (the toolkit that candle's
//! kernels are built with: $CUDA_HOME/bin/nvcc, else nvcc on PATH) for CUDA_COMPUTE_CAP:
//! every `src/ops/<op>.cu` (each fused op's kernels, beside its launcher) and
//! `src/attention.cu` (fused attention), each to `$OUT_DIR/<name>.ptx`.

use std::path::PathBuf;
use std::process::Command;

/// Every kernel source, sorted: `src/ops/*.cu` and `src/attention.cu`.
fn kernel_sources() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir("src/ops")
        .expect("src/ops is part of the crate")
        .map(|e| e.expect("src/ops is readable").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    out.push(PathBuf::from("src/attention.cu"));
    out.sort();
    out
}

fn main() {
    let sources = kernel_sources();
    // A new .cu in src/ops changes the directory; the headers (common.cuh, included by every
    // op's kernel, and gemv.cuh) are watched one by one.
    println!("cargo:rerun-if-changed=src/ops");
    for h in std::fs::read_dir("src/ops").expect("src/ops is part of the crate") {
        let h = h.expect("src/ops is readable").path();
        if h.extension().is_some_and(|e| e == "cuh") {
            println!("cargo:rerun-if-changed={}", h.display());
        }
    }
    for k in &sources {
        println!("cargo:rerun-if-changed={}", k.display());
    }
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap = cap.trim().trim_end_matches('a').replace('.', "");
    // What the kernels were built for: the fused attention exists from sm_80 on.
    println!("cargo:rustc-env=FLEET_CUDA_COMPUTE_CAP={cap}");
    let nvcc = std::env::var("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin/nvcc"))
        .ok()
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    for k in &sources {
        let name = k.file_stem().expect("a .cu file").to_string_lossy();
        let status = Command::new(&nvcc)
            // Flags meant for fatbins (e.g. --compress-mode) do not apply to PTX output.
            .env_remove("NVCC_APPEND_FLAGS")
            .args([
                "--ptx",
                "-O3",
                "-std=c++17",
                &format!("-arch=sm_{cap}"),
                "-o",
            ])
            .arg(out_dir.join(format!("{name}.ptx")))
            .arg(k)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!(
                "{} failed ({s}) compiling {}; see its messages above",
                nvcc.display(),
                k.display()
            ),
            Err(e) => panic!(
                "cannot run {} ({e}): the `cuda` feature needs the CUDA toolkit; set CUDA_HOME (docs/gpu.md)",
                nvcc.display()
            ),
        }
    }
}
