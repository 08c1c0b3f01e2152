//! Linear layers: `x · wᵀ + b` with the bias added in place on CUDA, and the decode steps'
//! few-row products as a GEMV kernel that streams the weights once (with its CPU twin).

use std::sync::OnceLock;

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use super::*;
use crate::error::Result;

/// Most rows of `x` that [`linear`] sends to the GEMV kernel (a decode step of up to this many
/// sequences); more go to cuBLAS.
pub const GEMV_MAX_ROWS: usize = 4;

/// `x · wᵀ + b` of a linear layer ([`candle_nn::Linear`]'s result). On CUDA, when nothing is
/// tracked for a backward:
/// - up to [`GEMV_MAX_ROWS`] rows in f16 or bf16 (a decode step) take [`gemv`], which reads
///   each weight once at close to the memory bandwidth (cuBLAS reached 57–86% on a 7B decode
///   step at batch 1, measured with ncu on an H100); `FLEET_DECODE_GEMV=0` turns it off;
/// - the bias is added in place by one kernel after the product: candle's broadcast add is a
///   strided kernel that took 4x the GEMM itself on the vision tower's `[65536, 4304]`
///   activations (measured on an H200).
pub fn linear(layer: &candle_nn::Linear, x: &Tensor) -> Result<Tensor> {
    use candle_core::Module;
    let w = layer.weight();
    let bias = layer.bias();
    let tracked = x.track_op() || w.track_op() || bias.is_some_and(|b| b.track_op());
    if !x.device().is_cuda() || tracked {
        return Ok(layer.forward(x)?);
    }
    let dims = x.dims();
    let k = dims[dims.len() - 1];
    let rows = x.elem_count() / k.max(1);
    let y = if gemv_takes(x, w, rows) {
        gemv(&x.reshape((rows, k))?, w)?
    } else if bias.is_none() {
        return Ok(layer.forward(x)?);
    } else {
        x.reshape((rows, k))?.matmul(&w.t()?)?
    };
    if let Some(bias) = bias {
        y.inplace_op2(&contig(bias)?, &AddBiasRows)?;
    }
    let mut out_dims = dims.to_vec();
    *out_dims.last_mut().expect("rank >= 1") = w.dim(0)?;
    Ok(y.reshape(out_dims)?)
}

/// Whether [`linear`] sends this product to [`gemv`]: f16 or bf16, at most [`GEMV_MAX_ROWS`]
/// rows, contiguous inputs whose rows start on 16 bytes, and `FLEET_DECODE_GEMV` not `0`.
fn gemv_takes(x: &Tensor, w: &Tensor, rows: usize) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("FLEET_DECODE_GEMV").map_or(true, |v| v != "0"));
    let k = w.dims().last().copied().unwrap_or(0);
    let aligned = |t: &Tensor| {
        let (_, l) = t.storage_and_layout();
        l.is_contiguous() && l.start_offset().is_multiple_of(8)
    };
    on && matches!(x.dtype(), DType::BF16 | DType::F16)
        && x.dtype() == w.dtype()
        && w.rank() == 2
        && (1..=GEMV_MAX_ROWS).contains(&rows)
        && k.is_multiple_of(8)
        && aligned(x)
        && aligned(w)
}

/// `x · wᵀ` for `x` `[m, k]` with few rows and `w` `[n, k]` (f32, f16 or bf16, contiguous;
/// on CUDA f16 or bf16, `m` at most [`GEMV_MAX_ROWS`], `k` a multiple of 8, rows starting on
/// 16 bytes): `[m, n]` in the inputs' dtype. One warp per output column: lane `l` sums the
/// 8-element chunks `l, l + 32, ...` of the row in order (f32 fused multiply-adds), the 32
/// lanes are summed by the xor butterfly, and the result is rounded once to the dtype, as the
/// GEMM rounds it. On the CPU it is the kernel's twin (the same sums in the same order), for
/// testing; [`linear`] uses it on CUDA only.
pub fn gemv(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.apply_op2_no_bwd(w, &Gemv)?)
}

struct Gemv;

/// Lanes of a warp, each summing its chunks of a row.
const GEMV_LANES: usize = 32;
/// Elements per 16-byte load of f16 or bf16.
const GEMV_CHUNK: usize = 8;

fn gemv_cpu<T: Float>(x: &[T], w: &[T], k: usize) -> Vec<T> {
    let (m, n) = (x.len() / k, w.len() / k);
    let mut y = Vec::with_capacity(m * n);
    for xr in x.chunks(k) {
        for wr in w.chunks(k) {
            let mut lanes = [0f32; GEMV_LANES];
            for (lane, acc) in lanes.iter_mut().enumerate() {
                for c in (lane..k / GEMV_CHUNK).step_by(GEMV_LANES) {
                    for i in c * GEMV_CHUNK..(c + 1) * GEMV_CHUNK {
                        *acc = xr[i].to_f32().mul_add(wr[i].to_f32(), *acc);
                    }
                }
            }
            y.push(T::from_f32(butterfly(lanes)));
        }
    }
    debug_assert_eq!(y.len(), m * n);
    y
}

fn gemv_dims(l1: &Layout, l2: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    let ((m, k), (n, k2)) = (l1.shape().dims2()?, l2.shape().dims2()?);
    if k != k2 || !k.is_multiple_of(GEMV_CHUNK) {
        candle_core::bail!("gemv: x [{m}, {k}] and w [{n}, {k2}] (k a multiple of 8)");
    }
    Ok((m, n, k))
}

impl candle_core::CustomOp2 for Gemv {
    fn name(&self) -> &'static str {
        "fleet-gemv"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, n, k) = gemv_dims(l1, l2)?;
        let out = float_cpu!("gemv", (s1, l1) => x, (s2, l2) => w; gemv_cpu(x, w, k));
        Ok((out, Shape::from((m, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (m, n, k) = gemv_dims(l1, l2)?;
        Ok((cuda::gemv(s1, l1, s2, l2, (m, n, k))?, Shape::from((m, n))))
    }
}

/// In place `y[r, :] += bias` (CUDA only; [`linear`] takes candle's path elsewhere).
struct AddBiasRows;

impl candle_core::InplaceOp2 for AddBiasRows {
    fn name(&self) -> &'static str {
        "fleet-add-bias-rows"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("add_bias_rows runs on CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        cuda::add_bias_rows(s1, l1, s2, l2)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/linear.ptx"));
    const MODULE: &str = "fleet_linear";

    /// Warps (output columns) per block of the GEMV kernel.
    const GEMV_WARPS: usize = 8;

    pub(super) fn gemv(
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        (m, n, k): (usize, usize, usize),
    ) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            (m, n, k): (usize, usize, usize),
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            if !(1..=super::GEMV_MAX_ROWS).contains(&m) {
                candle_core::bail!("gemv: {m} rows (1 to {})", super::GEMV_MAX_ROWS);
            }
            if !(l1.start_offset().is_multiple_of(8) && l2.start_offset().is_multiple_of(8)) {
                candle_core::bail!("gemv: the inputs' rows must start on 16 bytes");
            }
            let (x, w) = (input::<T>(s1, l1)?, input::<T>(s2, l2)?);
            let func = dev.get_or_load_custom_func(
                &format!("gemv_{}_m{m}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            // SAFETY: the kernel writes every one of the m x n outputs.
            let y: CudaSlice<T> = unsafe { dev.alloc::<T>(m * n)? };
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(GEMV_WARPS) as u32, 1, 1),
                block_dim: ((32 * GEMV_WARPS) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut builder = func.builder();
            builder.arg(&x);
            builder.arg(&w);
            builder.arg(&y);
            let (n, k) = (n as i32, k as i32);
            builder.arg(&n);
            builder.arg(&k);
            // SAFETY: warp j of block b reads row b * GEMV_WARPS + j of w (if below n) and
            // the m rows of x, 16 bytes at a time (k a multiple of 8, rows aligned: checked),
            // and writes that column of y.
            unsafe { builder.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev))
        }
        match s1.dtype() {
            candle_core::DType::F16 => run::<f16>(s1, l1, s2, l2, (m, n, k)),
            candle_core::DType::BF16 => run::<bf16>(s1, l1, s2, l2, (m, n, k)),
            other => candle_core::bail!("gemv: {other:?} on CUDA (f16 or bf16)"),
        }
    }

    pub(super) fn add_bias_rows(
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        fn run<T: CudaDType + DeviceRepr>(
            s1: &mut CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
        ) -> candle_core::Result<()> {
            let dev = s1.device().clone();
            let (rows, cols) = l1.shape().dims2()?;
            let (Some((a, b)), Some(_)) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
                candle_core::bail!("add_bias_rows: inputs must be contiguous")
            };
            if l2.shape().elem_count() != cols {
                candle_core::bail!(
                    "add_bias_rows: bias of {} for {cols} columns",
                    l2.shape().elem_count()
                );
            }
            let bias = input::<T>(s2, l2)?;
            let func = dev.get_or_load_custom_func(
                &format!("add_bias_rows_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            let mut y = s1.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
            let n = rows * cols;
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(256).min(65535 * 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut builder = func.builder();
            builder.arg(&mut y);
            builder.arg(&bias);
            let (rows, cols) = (rows as i64, cols as i32);
            builder.arg(&rows);
            builder.arg(&cols);
            // SAFETY: the kernel reads the bias and updates the rows x cols outputs in place.
            unsafe { builder.launch(cfg) }.w()?;
            Ok(())
        }
        match s1.dtype() {
            candle_core::DType::F32 => run::<f32>(s1, l1, s2, l2),
            candle_core::DType::F16 => run::<f16>(s1, l1, s2, l2),
            candle_core::DType::BF16 => run::<bf16>(s1, l1, s2, l2),
            other => candle_core::bail!("add_bias_rows: unsupported dtype {other:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest |a - b| over all elements, in f32.
    pub(super) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        (f(a) - f(b))
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    pub(super) fn randn(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        // A small LCG: the same values every run, no RNG state shared between tests.
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &candle_core::Device::Cpu).unwrap()
    }

    /// The CPU twin is the product (in f32, to rounding), for every row count the kernel
    /// takes and k with and without a remainder past the unrolled chunks.
    #[test]
    fn gemv_twin_is_the_product() {
        for (m, n, k) in [(1, 5, 8), (2, 33, 264), (3, 7, 1032), (4, 19, 3584)] {
            let (x, w) = (randn(&[m, k], 1), randn(&[n, k], 2));
            let got = gemv(&x, &w).unwrap();
            let want = x.matmul(&w.t().unwrap()).unwrap();
            let diff = max_abs_diff(&got, &want);
            assert!(diff < 1e-4 * (k as f32).sqrt(), "m {m} n {n} k {k}: {diff}");
        }
    }

    /// Shapes the kernel does not take are refused with the shapes named.
    #[test]
    fn gemv_refuses_mismatched_or_unaligned_k() {
        let err = gemv(&randn(&[1, 12], 1), &randn(&[3, 12], 2)).unwrap_err();
        assert!(err.to_string().contains("[1, 12]"), "{err}");
        assert!(gemv(&randn(&[1, 16], 1), &randn(&[3, 8], 2)).is_err());
    }
}

#[cfg(all(test, feature = "cuda"))]
mod kernel_tests {
    use super::*;

    /// The GEMV kernel gives its twin's values exactly (f16 and bf16, 1 to 4 rows, k with and
    /// without a remainder past the unrolled chunks, columns past a block's last warp), and
    /// [`linear`] takes it for few rows (with the bias added after) and cuBLAS for more.
    #[test]
    fn gemv_kernel_matches_its_twin() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        let r = |s: &[usize], seed: u64, dtype: DType| {
            super::tests::randn(s, seed).to_dtype(dtype).unwrap()
        };
        for dtype in [DType::BF16, DType::F16] {
            for (m, n, k) in [(1, 13, 8), (2, 300, 264), (3, 37, 1032), (4, 129, 3584)] {
                let (x, w) = (r(&[m, k], 3, dtype), r(&[n, k], 4, dtype));
                let want = gemv(&x, &w).unwrap().to_dtype(DType::F32).unwrap();
                let got = gemv(&x.to_device(&dev).unwrap(), &w.to_device(&dev).unwrap())
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_device(&candle_core::Device::Cpu)
                    .unwrap();
                assert_eq!(
                    got.to_vec2::<f32>().unwrap(),
                    want.to_vec2::<f32>().unwrap(),
                    "{dtype:?} m {m} n {n} k {k}"
                );
            }
            // Through linear: 3 rows of a 3-D input take the kernel, the bias added after.
            let layer = candle_nn::Linear::new(
                r(&[40, 64], 5, dtype).to_device(&dev).unwrap(),
                Some(r(&[40], 6, dtype).to_device(&dev).unwrap()),
            );
            let x = r(&[3, 1, 64], 7, dtype).to_device(&dev).unwrap();
            let got = linear(&layer, &x).unwrap();
            let product = gemv(&x.reshape((3, 64)).unwrap(), layer.weight()).unwrap();
            let want = product
                .broadcast_add(layer.bias().unwrap())
                .unwrap()
                .reshape((3, 1, 40))
                .unwrap();
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            assert_eq!(
                f(&got).to_vec1::<f32>().unwrap(),
                f(&want).to_vec1::<f32>().unwrap(),
                "{dtype:?} linear"
            );
        }
    }

    /// [`linear`]'s in-place bias add gives candle's `Linear` result, in every float dtype,
    /// for 2-D and 3-D inputs.
    #[test]
    fn linear_bias_in_place_matches_candle() {
        use candle_core::Module;
        let dev = candle_core::Device::new_cuda(0).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for shape in [vec![37, 72], vec![3, 41, 72]] {
                let r = |s: &[usize]| {
                    Tensor::randn(0f32, 1.0, s, &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap()
                };
                let layer = candle_nn::Linear::new(r(&[136, 72]), Some(r(&[136])));
                let x = r(&shape);
                let want = layer.forward(&x).unwrap();
                let got = linear(&layer, &x).unwrap();
                assert_eq!(want.dims(), got.dims());
                let diff = super::tests::max_abs_diff(&want, &got);
                println!("linear {dtype:?} {shape:?}: max |candle - in place| = {diff}");
                assert_eq!(diff, 0.0, "the bias add rounds differently");
            }
        }
    }
}
