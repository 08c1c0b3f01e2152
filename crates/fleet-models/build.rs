//! With the `cuda` feature, compiles the kernels in `kernels/` (ops.cu: fused decoder ops;
//! attention.cu: fused attention) to PTX with nvcc (the toolkit that candle's kernels are built
//! with: $CUDA_HOME/bin/nvcc, else nvcc on PATH) for CUDA_COMPUTE_CAP.

use std::path::PathBuf;
use std::process::Command;

/// Kernel sources, each compiled to `$OUT_DIR/<name>.ptx`.
const KERNELS: [&str; 2] = ["ops", "attention"];

fn main() {
    for k in KERNELS {
        println!("cargo:rerun-if-changed=kernels/{k}.cu");
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
    for k in KERNELS {
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
            .arg(out_dir.join(format!("{k}.ptx")))
            .arg(format!("kernels/{k}.cu"))
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!(
                "{} failed ({s}) compiling kernels/{k}.cu; see its messages above",
                nvcc.display()
            ),
            Err(e) => panic!(
                "cannot run {} ({e}): the `cuda` feature needs the CUDA toolkit; set CUDA_HOME (docs/gpu.md)",
                nvcc.display()
            ),
        }
    }
}
