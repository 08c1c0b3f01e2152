// fleet's build of candle-flash-attn-v3 (FLEET_PATCH.md): the published build.rs clones CUTLASS
// from GitHub through cudaforge and compiles 49 kernel files (~2 hours on 2 cores, ~120 MB of
// objects). This one compiles flash_api.cu and the bf16, head dim 128 kernel with nvcc against
// the CUTLASS checkout named by FLEET_CUTLASS_DIR (commit 4c42f73, the one the crate pins:
// `include` and `tools/util/include`), for sm_90a, into a static library.
use std::path::PathBuf;
use std::process::Command;

const KERNEL_FILES: &[&str] = &["flash_api.cu", "flash_fwd_hdim128_bf16_sm90.cu"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=hkernel");
    println!("cargo:rerun-if-env-changed=FLEET_CUTLASS_DIR");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let cutlass = PathBuf::from(std::env::var("FLEET_CUTLASS_DIR").unwrap_or_else(|_| {
        panic!(
            "FLEET_CUTLASS_DIR is not set: point it at a CUTLASS checkout of commit \
             4c42f73fdab5787e3bb57717f35a8cb1b3c0dc6d (its include/ and tools/util/include/), \
             e.g. `git -C <cutlass clone> archive 4c42f73 include tools/util/include | tar x -C \
             /tmp/cutlass`, then FLEET_CUTLASS_DIR=/tmp/cutlass"
        )
    }));
    if !cutlass.join("include/cutlass/cutlass.h").exists() {
        panic!(
            "FLEET_CUTLASS_DIR={}: no include/cutlass/cutlass.h there",
            cutlass.display()
        );
    }
    let nvcc = std::env::var("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin/nvcc"))
        .unwrap_or_else(|_| PathBuf::from("nvcc"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let mut objects = Vec::new();
    for f in KERNEL_FILES {
        let obj = out.join(format!("{f}.o"));
        let status = Command::new(&nvcc)
            .env_remove("NVCC_APPEND_FLAGS")
            .current_dir("hkernel")
            .args([
                "-c",
                f,
                "-o",
                obj.to_str().expect("utf-8 path"),
                "-std=c++17",
                "-O3",
                "-gencode",
                "arch=compute_90a,code=sm_90a",
                // CUDA 13 names these typedefs with their version; this CUTLASS wants the
                // unversioned names.
                "-DPFN_cuTensorMapEncodeTiled=PFN_cuTensorMapEncodeTiled_v12000",
                "-DPFN_cuTensorMapEncodeIm2col=PFN_cuTensorMapEncodeIm2col_v12000",
                "-U__CUDA_NO_HALF_OPERATORS__",
                "-U__CUDA_NO_HALF_CONVERSIONS__",
                "-U__CUDA_NO_BFLOAT16_OPERATORS__",
                "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                "-U__CUDA_NO_BFLOAT162_OPERATORS__",
                "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
                "-D_USE_MATH_DEFINES",
                "-DUSE_CUTLASS",
                "--expt-relaxed-constexpr",
                "--expt-extended-lambda",
                "--use_fast_math",
                "-Xcompiler",
                "-fPIC",
            ])
            .arg(format!("-I{}", cutlass.join("include").display()))
            .arg(format!("-I{}", cutlass.join("tools/util/include").display()))
            .arg("-I.")
            .status()
            .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
        if !status.success() {
            panic!("nvcc failed on hkernel/{f}");
        }
        objects.push(obj);
    }
    let lib = out.join("libflashattentionv3.a");
    let _ = std::fs::remove_file(&lib);
    let status = Command::new("ar")
        .arg("rcs")
        .arg(&lib)
        .args(&objects)
        .status()
        .expect("running ar");
    assert!(status.success(), "ar failed");
    println!("cargo:rustc-link-search={}", out.display());
    println!("cargo:rustc-link-lib=static=flashattentionv3");
    println!("cargo:rustc-link-lib=dylib=cudart");
    println!("cargo:rustc-link-lib=dylib=stdc++");
}
