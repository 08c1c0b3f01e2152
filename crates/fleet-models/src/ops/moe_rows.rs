//! The MoE layer's row movements around its expert GEMMs, one kernel each on CUDA: the
//! prefill's gather of each routed slot's token row into expert order ([`gather_rows`]) and
//! every path's weighted sum of a token's expert outputs ([`moe_combine`]). candle's
//! `index_select`, broadcast multiply and strided sum took 42% of a 30B-A3B judge prefill pass's
//! kernel time on an H200 (2026-11-28f: 187 of 443 ms, at 0.1–0.4 TB/s) for work that reads
//! and writes a few hundred MB. Each kernel has its candle twin (`*_reference`): the CPU's
//! path, and the GPU tests' reference, bit for bit.

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};

use super::{contig, EnvSwitch};
use crate::error::{ModelError, Result};

/// Whether [`gather_rows`] and [`moe_combine`] take their kernels on CUDA: on by default,
/// `FLEET_MOE_ROWS_KERNEL=0` for the candle twins (for comparison).
static KERNEL: EnvSwitch = EnvSwitch::new("FLEET_MOE_ROWS_KERNEL", true);

/// Test switch for the kernels of this module: `Some(on)` forces them, `None` leaves them to
/// `FLEET_MOE_ROWS_KERNEL`.
#[cfg(all(test, feature = "cuda"))]
fn set_kernel(on: Option<bool>) {
    KERNEL.force(on);
}

/// The rows `idx` (u32 `[m]`, each below `x`'s row count) of `x` (`[n, ..]`, any dtype):
/// `[m, ..]`, as `x.index_select(idx, 0)`. On CUDA one kernel copies the rows in the widest
/// unit (16 bytes down to 1) that divides a row and both starts; elsewhere candle's
/// `index_select`. No gradient.
pub fn gather_rows(x: &Tensor, idx: &Tensor) -> Result<Tensor> {
    if idx.rank() != 1 || idx.dtype() != DType::U32 || x.rank() == 0 {
        return Err(ModelError::BadInput(format!(
            "gather_rows: x {:?} (at least one dimension) and idx {:?} {:?} (u32, one \
             dimension)",
            x.dims(),
            idx.dims(),
            idx.dtype()
        )));
    }
    if !(x.device().is_cuda() && KERNEL.on()) {
        return gather_rows_reference(x, idx);
    }
    Ok(contig(x)?.apply_op2_no_bwd(&contig(idx)?, &GatherRows)?)
}

/// [`gather_rows`] in candle's ops: `x.index_select(idx, 0)`.
pub fn gather_rows_reference(x: &Tensor, idx: &Tensor) -> Result<Tensor> {
    Ok(x.index_select(idx, 0)?)
}

/// A MoE layer's output: for each of the `n` tokens, its `k` expert outputs scaled by their
/// routing weights and summed. `y` `[slots, hidden]` (f16 or bf16) holds the expert outputs;
/// `top_w` `[n, k]` f32 the weights; token `t`'s `j`-th output is row `position[t k + j]` of
/// `y` (u32 `[n k]`), or row `t k + j` without `position`. The weights are cast to `y`'s dtype
/// and each product rounded to it before an f32 sum in `j`'s order, rounded once, as
/// transformers scales in the model dtype: [`moe_combine_reference`]'s arithmetic, the same
/// bits. On CUDA one kernel; elsewhere the reference. No gradient.
pub fn moe_combine(y: &Tensor, top_w: &Tensor, position: Option<&Tensor>) -> Result<Tensor> {
    let (slots, _) = y.dims2()?;
    let (n, k) = top_w.dims2()?;
    let rows_named = match position {
        Some(p) => p.dims() == [n * k] && p.dtype() == DType::U32,
        None => slots == n * k,
    };
    if top_w.dtype() != DType::F32 || !rows_named || k == 0 {
        return Err(ModelError::BadInput(format!(
            "moe_combine: y {:?}, top_w {:?} {:?} (f32 [n, k], k at least 1), position {:?} \
             (u32 [n k]; without it y has n k rows)",
            y.dims(),
            top_w.dims(),
            top_w.dtype(),
            position.map(|p| (p.dims().to_vec(), p.dtype()))
        )));
    }
    let on_kernel =
        y.device().is_cuda() && KERNEL.on() && matches!(y.dtype(), DType::BF16 | DType::F16);
    if !on_kernel {
        return moe_combine_reference(y, top_w, position);
    }
    let (y, top_w) = (contig(y)?, contig(top_w)?);
    Ok(match position {
        Some(p) => y.apply_op3_no_bwd(&top_w, &contig(p)?, &MoeCombine)?,
        None => y.apply_op2_no_bwd(&top_w, &MoeCombine)?,
    })
}

/// [`moe_combine`] in candle's ops: the rows picked by `position`, the weights cast to `y`'s
/// dtype, a broadcast multiply and a sum over `k`.
pub fn moe_combine_reference(
    y: &Tensor,
    top_w: &Tensor,
    position: Option<&Tensor>,
) -> Result<Tensor> {
    let (n, k) = top_w.dims2()?;
    let hidden = y.dim(1)?;
    let y = match position {
        Some(p) => y.index_select(p, 0)?,
        None => y.clone(),
    };
    let w = top_w.to_dtype(y.dtype())?.unsqueeze(2)?;
    Ok(y.reshape((n, k, hidden))?.broadcast_mul(&w)?.sum(1)?)
}

/// [`gather_rows`] as a custom op.
struct GatherRows;

/// [`moe_combine`] as a custom op (two inputs without `position`, three with it).
struct MoeCombine;

cuda_only_op!(CustomOp2 for GatherRows, "fleet-gather-rows", |_op, s1, l1, s2, l2| {
    let out = cuda::gather_rows((s1, l1), (s2, l2))?;
    let mut dims = l1.dims().to_vec();
    dims[0] = l2.dims()[0];
    Ok((out, Shape::from(dims)))
});

cuda_only_op!(CustomOp2 for MoeCombine, "fleet-moe-combine", |_op, s1, l1, s2, l2| {
    let out = cuda::moe_combine((s1, l1), (s2, l2), None)?;
    Ok((out, Shape::from((l2.dims()[0], l1.dims()[1]))))
});

cuda_only_op!(CustomOp3 for MoeCombine, "fleet-moe-combine", |_op, s1, l1, s2, l2, s3, l3| {
    let out = cuda::moe_combine((s1, l1), (s2, l2), Some((s3, l3)))?;
    Ok((out, Shape::from((l2.dims()[0], l1.dims()[1]))))
});

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/moe_rows.ptx"));
    const MODULE: &str = "fleet_moe_rows";

    /// [`super::gather_rows`]: one grid-stride kernel over the output's copy units.
    pub(super) fn gather_rows(
        (xs, xl): (&CudaStorage, &Layout),
        (is, il): (&CudaStorage, &Layout),
    ) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            (xs, xl): (&CudaStorage, &Layout),
            (is, il): (&CudaStorage, &Layout),
        ) -> candle_core::Result<CudaStorage> {
            let dev = xs.device().clone();
            let x = input::<T>(xs, xl)?;
            let idx = input::<u32>(is, il)?;
            let n_rows = xl.dims()[0];
            let row = xl.shape().elem_count() / n_rows.max(1);
            let m = il.dims()[0];
            let size = std::mem::size_of::<T>();
            // The widest unit dividing a row's bytes and x's first byte (the output's buffer
            // starts aligned).
            let (row_bytes, start_bytes) = (row * size, xl.start_offset() * size);
            let unit = [16usize, 4, 2, 1]
                .into_iter()
                .find(|u| row_bytes.is_multiple_of(*u) && start_bytes.is_multiple_of(*u))
                .unwrap_or(1);
            let func =
                dev.get_or_load_custom_func(&format!("gather_rows_u{unit}b"), MODULE, PTX)?;
            // SAFETY: the kernel writes every unit of the m rows.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(m * row)? };
            let units = row_bytes / unit;
            let cfg = grid_stride(m * units);
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&idx);
            b.arg(&out);
            let (m_i, units_i, n_i) = (m as i64, units as i32, n_rows as i64);
            b.arg(&m_i);
            b.arg(&units_i);
            b.arg(&n_i);
            // SAFETY: the grid-stride loop writes m * units units of out, reading idx[0..m]
            // and only rows of x below n_rows (a larger index writes zeros).
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        let a = ((xs, xl), (is, il));
        if is.dtype() != DType::U32 {
            candle_core::bail!("gather_rows: idx must be u32, not {:?}", is.dtype());
        }
        match xs.dtype() {
            DType::F32 => run::<f32>(a.0, a.1),
            DType::F16 => run::<f16>(a.0, a.1),
            DType::BF16 => run::<bf16>(a.0, a.1),
            DType::U32 => run::<u32>(a.0, a.1),
            other => candle_core::bail!("gather_rows: {other:?} on CUDA"),
        }
    }

    /// [`super::moe_combine`]: one grid-stride kernel over the output's 16-byte vectors (or
    /// elements, for rows that are not whole vectors).
    pub(super) fn moe_combine(
        (ys, yl): (&CudaStorage, &Layout),
        (ws, wl): (&CudaStorage, &Layout),
        position: Option<(&CudaStorage, &Layout)>,
    ) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            (ys, yl): (&CudaStorage, &Layout),
            (ws, wl): (&CudaStorage, &Layout),
            position: Option<(&CudaStorage, &Layout)>,
        ) -> candle_core::Result<CudaStorage> {
            let dev = ys.device().clone();
            let y = input::<T>(ys, yl)?;
            let w = input::<f32>(ws, wl)?;
            let (slots, cols) = yl.shape().dims2()?;
            let (n, k) = wl.shape().dims2()?;
            // The kernel trusts the positions to name rows of y (the routing's sort made them a
            // permutation of the slots); without them it reads rows up to n k.
            if position.is_none() && slots != n * k {
                candle_core::bail!("moe_combine: y has {slots} rows, not n k = {}", n * k);
            }
            let per_vec = 16 / std::mem::size_of::<T>();
            let vec = cols.is_multiple_of(per_vec) && yl.start_offset().is_multiple_of(per_vec);
            let func = dev.get_or_load_custom_func(
                &format!(
                    "moe_combine_{}{}",
                    if vec { "vec_" } else { "" },
                    suffix(ys.dtype())?
                ),
                MODULE,
                PTX,
            )?;
            // SAFETY: the kernel writes every element of the n rows.
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(n * cols)? };
            let cfg = grid_stride(n * if vec { cols / per_vec } else { cols });
            let mut b = func.builder();
            b.arg(&y);
            b.arg(&w);
            let pos = position.map(|(s, l)| input::<u32>(s, l)).transpose()?;
            // Without positions the kernel reads slot t k + j: a null pointer says so.
            let null = 0u64;
            match &pos {
                Some(p) => b.arg(p),
                None => b.arg(&null),
            };
            b.arg(&out);
            let (n_i, k_i, cols_i) = (n as i64, k as i32, cols as i32);
            b.arg(&n_i);
            b.arg(&k_i);
            b.arg(&cols_i);
            // SAFETY: the grid-stride loop writes n * cols elements of out, reading top_w's
            // n k weights, position's n k entries and the rows of y they name (below slots: the
            // caller's permutation), 16 bytes at a time on the vector path (cols a multiple and
            // y's start aligned, checked above).
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        if ws.dtype() != DType::F32 {
            candle_core::bail!("moe_combine: top_w must be f32, not {:?}", ws.dtype());
        }
        match ys.dtype() {
            DType::F16 => run::<f16>((ys, yl), (ws, wl), position),
            DType::BF16 => run::<bf16>((ys, yl), (ws, wl), position),
            other => candle_core::bail!("moe_combine: {other:?} on CUDA (f16 or bf16)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The CPU path is the reference: the rows each index names, and each token's weighted
    /// outputs summed (the weights rounded to bf16 first).
    #[test]
    fn the_reference_gathers_and_sums_the_named_rows() {
        let dev = Device::Cpu;
        let x = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0]], &dev).unwrap();
        let idx = Tensor::new(&[2u32, 0, 2], &dev).unwrap();
        let got: Vec<Vec<f32>> = gather_rows(&x, &idx).unwrap().to_vec2().unwrap();
        assert_eq!(got, [[5.0, 6.0], [1.0, 2.0], [5.0, 6.0]]);

        let y = x.to_dtype(DType::BF16).unwrap();
        let w = Tensor::new(&[[0.5f32], [0.25], [1.0 / 3.0]], &dev)
            .unwrap()
            .reshape((1, 3))
            .unwrap();
        let pos = Tensor::new(&[1u32, 2, 0], &dev).unwrap();
        let out = moe_combine(&y, &w, Some(&pos)).unwrap();
        let got: Vec<f32> = out
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap();
        let third = half::bf16::from_f32(1.0 / 3.0).to_f32();
        let want: Vec<f32> = [(3.0f32, 5.0f32, 1.0f32), (4.0, 6.0, 2.0)]
            .iter()
            .map(|&(a, b, c)| {
                let r = |v: f32| half::bf16::from_f32(v).to_f32();
                r(0.5 * a + 0.25 * b + r(third * c))
            })
            .collect();
        assert_eq!(got, want);
        // Without positions, row t k + j.
        let plain = moe_combine(&y, &w, None).unwrap();
        assert_eq!(plain.dims(), [1, 2]);
    }

    #[test]
    fn shapes_that_name_no_rows_are_refused() {
        let dev = Device::Cpu;
        let y = Tensor::zeros((4, 8), DType::BF16, &dev).unwrap();
        let w = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
        // Four rows, not n k = 6, and no positions.
        let err = moe_combine(&y, &w, None).unwrap_err().to_string();
        assert!(err.contains("moe_combine"), "{err}");
        let pos = Tensor::zeros(5, DType::U32, &dev).unwrap();
        assert!(moe_combine(&y, &w, Some(&pos)).is_err());
        let w16 = w.to_dtype(DType::BF16).unwrap();
        assert!(moe_combine(&y, &w16, Some(&pos)).is_err());
        let idx = Tensor::zeros(3, DType::F32, &dev).unwrap();
        assert!(gather_rows(&y, &idx).is_err());
    }

    /// Both kernels against their candle twins on the GPU, bit for bit: rows of whole vectors
    /// and of other widths (copy units of 16, 4 and 2 bytes; the combine's element kernel),
    /// inputs that start past their buffer's start, both dtypes, with and without positions.
    #[cfg(feature = "cuda")]
    #[test]
    fn kernels_match_their_twins_bit_for_bit() {
        use super::super::{test_gpu, test_tensor};
        let Some(dev) = test_gpu("kernels_match_their_twins_bit_for_bit") else {
            return;
        };
        let bits = |t: &Tensor| -> Vec<u16> {
            let t = t.flatten_all().unwrap();
            match t.dtype() {
                DType::BF16 => t
                    .to_vec1::<half::bf16>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect(),
                _ => t
                    .to_vec1::<half::f16>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect(),
            }
        };
        // Rows 1.. of a tensor one row longer: a contiguous input starting `cols` elements in.
        let rows_past_the_first = |rows: usize, cols: usize, seed: u64, scale: f64, dt: DType| {
            test_tensor(&[rows + 1, cols], seed)
                .affine(scale, 0.0)
                .unwrap()
                .to_device(&dev)
                .unwrap()
                .to_dtype(dt)
                .unwrap()
                .narrow(0, 1, rows)
                .unwrap()
        };
        set_kernel(Some(true));
        let (n, k) = (37usize, 8usize);
        for dt in [DType::BF16, DType::F16] {
            for cols in [2048usize, 24, 14, 13] {
                let x = rows_past_the_first(n, cols, 1, 1.0, dt);
                let token_of: Vec<u32> = (0..n * k).map(|s| ((s * 7 + 3) % n) as u32).collect();
                let idx = Tensor::from_vec(token_of, n * k, &dev).unwrap();
                let got = gather_rows(&x, &idx).unwrap();
                let want = gather_rows_reference(&x, &idx).unwrap();
                assert_eq!(got.dims(), [n * k, cols]);
                assert!(bits(&got) == bits(&want), "gather {dt:?} cols {cols}");

                let y = rows_past_the_first(n * k, cols, 2, 4.0, dt);
                let w = candle_nn::ops::softmax_last_dim(
                    &test_tensor(&[n, k], 3).to_device(&dev).unwrap(),
                )
                .unwrap();
                // A permutation of the slots, as the sorted prefill's positions are.
                let perm: Vec<u32> = (0..n * k)
                    .map(|s| ((s * 11 + 5) % (n * k)) as u32)
                    .collect();
                let pos = Tensor::from_vec(perm, n * k, &dev).unwrap();
                for p in [None, Some(&pos)] {
                    let got = moe_combine(&y, &w, p).unwrap();
                    let want = moe_combine_reference(&y, &w, p).unwrap();
                    assert_eq!(got.dims(), [n, cols]);
                    assert!(
                        bits(&got) == bits(&want),
                        "combine {dt:?} cols {cols} positions {}",
                        p.is_some()
                    );
                }
            }
        }
        set_kernel(None);
    }
}
