//! `y = x · w[e]ᵀ` over consecutive row groups, one group per expert: the MoE prefill's two
//! projections of the rows sorted by expert, in one cuBLAS call (`cublasGemmGroupedBatchedEx`)
//! where a loop of one GEMM per expert made 128 launches and a concatenation per projection.

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use super::*;
use crate::error::{ModelError, Result};

/// `x` `[rows, k]` whose first `counts[0]` rows belong to expert 0, the next `counts[1]` to
/// expert 1 and so on, against `w` `[experts, n, k]`: `[rows, n]`, each row times its expert's
/// weights transposed (`F.linear` per expert). f32, f16 or bf16, contiguous; on CUDA f16 or
/// bf16 only (cuBLAS's f32 path may run as TF32, which an f32 model must not get), outside a
/// graph capture (the pointer arrays are uploaded), with `k` and `n` multiples of 8 and both
/// inputs starting on 16 bytes (cuBLAS's kernels assume aligned matrices). Products summed in
/// f32 (the twin in `k` order and rounded once; cuBLAS in its own order, split-K partials
/// possibly rounded to the dtype), so the two agree to the dtype's rounding, not bit for bit.
/// No gradient.
pub fn grouped_linear(x: &Tensor, w: &Tensor, counts: &[usize]) -> Result<Tensor> {
    let (rows, _) = x.dims2()?;
    let (experts, _, _) = w.dims3()?;
    if counts.len() != experts || counts.iter().sum::<usize>() != rows {
        return Err(ModelError::BadInput(format!(
            "grouped_linear: {} group counts summing to {} for {experts} experts and {rows} rows",
            counts.len(),
            counts.iter().sum::<usize>()
        )));
    }
    Ok(contig(x)?.apply_op2_no_bwd(
        &contig(w)?,
        &GroupedLinear {
            counts: counts.to_vec(),
        },
    )?)
}

/// [`grouped_linear`] as a custom op.
#[derive(Debug, Clone)]
struct GroupedLinear {
    counts: Vec<usize>,
}

impl GroupedLinear {
    /// `(rows, n, k)`, checked.
    fn dims(&self, l1: &Layout, l2: &Layout) -> candle_core::Result<(usize, usize, usize)> {
        let (rows, k) = l1.shape().dims2()?;
        let (experts, n, k2) = l2.shape().dims3()?;
        if k != k2 || experts != self.counts.len() {
            candle_core::bail!(
                "grouped_linear: x [{rows}, {k}] against w [{experts}, {n}, {k2}] with {} groups",
                self.counts.len()
            );
        }
        Ok((rows, n, k))
    }
}

/// The twin: each group's rows times its expert's weights transposed, summed in f32 in `k`
/// order and rounded once ([`super::linear`]'s skinny twin, per expert).
fn grouped_linear_cpu<T: Float>(x: &[T], w: &[T], counts: &[usize], n: usize, k: usize) -> Vec<T> {
    let mut y = Vec::with_capacity(x.len() / k * n);
    let mut start = 0;
    for (e, &c) in counts.iter().enumerate() {
        let rows = &x[start * k..(start + c) * k];
        y.extend(super::linear::skinny_cpu(
            rows,
            &w[e * n * k..(e + 1) * n * k],
            k,
        ));
        start += c;
    }
    y
}

impl candle_core::CustomOp2 for GroupedLinear {
    fn name(&self) -> &'static str {
        "fleet-grouped-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, n, k) = self.dims(l1, l2)?;
        let out = float_cpu!("grouped_linear", (s1, l1) => x, (s2, l2) => w;
            grouped_linear_cpu(x, w, &self.counts, n, k));
        Ok((out, Shape::from((rows, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (rows, n, k) = self.dims(l1, l2)?;
        if !(k.is_multiple_of(8)
            && n.is_multiple_of(8)
            && l1.start_offset().is_multiple_of(8)
            && l2.start_offset().is_multiple_of(8))
        {
            candle_core::bail!(
                "grouped_linear on CUDA: k {k} and n {n} must be multiples of 8 and the inputs \
                 start on 16 bytes (offsets {} and {})",
                l1.start_offset(),
                l2.start_offset()
            );
        }
        let y = cuda::grouped_linear((s1, l1), (s2, l2), &self.counts, (rows, n, k))?;
        Ok((y, Shape::from((rows, n))))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::cublas::sys;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr,
    };
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaStorage, Layout};
    use half::{bf16, f16};

    use super::super::cuda_util::*;

    pub(super) fn grouped_linear(
        (s1, l1): (&CudaStorage, &Layout),
        (s2, l2): (&CudaStorage, &Layout),
        counts: &[usize],
        (rows, n, k): (usize, usize, usize),
    ) -> candle_core::Result<CudaStorage> {
        fn run<T: CudaDType + DeviceRepr>(
            (s1, l1): (&CudaStorage, &Layout),
            (s2, l2): (&CudaStorage, &Layout),
            counts: &[usize],
            (rows, n, k): (usize, usize, usize),
            data_type: sys::cudaDataType_t,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            if stream_capturing(&dev)? {
                candle_core::bail!(
                    "grouped_linear uploads its pointer arrays: not inside a capture"
                );
            }
            let (x, w) = (input::<T>(s1, l1)?, input::<T>(s2, l2)?);
            // SAFETY: the groups' products cover every one of the rows x n outputs (counts sum
            // to rows: checked by grouped_linear).
            let mut y: CudaSlice<T> = unsafe { dev.alloc::<T>(rows * n)? };
            let stream = dev.cuda_stream();
            grouped_gemm::<T>(&dev, &stream, (&x, &w, &mut y), counts, (n, k), data_type)?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev))
        }

        /// The call itself, writing `y` in place (its guards end before `y` is handed on).
        fn grouped_gemm<T: CudaDType + DeviceRepr>(
            dev: &candle_core::CudaDevice,
            stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
            (x, w, y): (
                &candle_core::cuda_backend::cudarc::driver::CudaView<'_, T>,
                &candle_core::cuda_backend::cudarc::driver::CudaView<'_, T>,
                &mut CudaSlice<T>,
            ),
            counts: &[usize],
            (n, k): (usize, usize),
            data_type: sys::cudaDataType_t,
        ) -> candle_core::Result<()> {
            let (x0, _gx) = x.device_ptr(stream);
            let (w0, _gw) = w.device_ptr(stream);
            let (y0, _gy) = y.device_ptr_mut(stream);
            let size = std::mem::size_of::<T>() as u64;
            // One group of one problem per expert with rows (their row counts differ).
            // Column-major, as cuBLAS sees it: y_eᵀ [n, m_e] = w_e [n, k] · x_eᵀ [k, m_e], where
            // w_e (row-major [n, k]) is the transpose of a column-major [k, n] with ld k and
            // x_e (row-major [m_e, k]) is a column-major [k, m_e] with ld k.
            let (mut a_ptrs, mut b_ptrs, mut c_ptrs, mut ms) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let mut offset = 0u64;
            for (e, &c) in counts.iter().enumerate() {
                if c > 0 {
                    a_ptrs.push(w0 + e as u64 * (n * k) as u64 * size);
                    b_ptrs.push(x0 + offset * k as u64 * size);
                    c_ptrs.push(y0 + offset * n as u64 * size);
                    ms.push(c as i32);
                }
                offset += c as u64;
            }
            let groups = ms.len();
            if groups == 0 {
                return Ok(());
            }
            let a_dev = dev.clone_htod(&a_ptrs)?;
            let b_dev = dev.clone_htod(&b_ptrs)?;
            let c_dev = dev.clone_htod(&c_ptrs)?;
            let (a_p, _ga) = a_dev.device_ptr(stream);
            let (b_p, _gb) = b_dev.device_ptr(stream);
            let (c_p, _gc) = c_dev.device_ptr(stream);
            let per = |v: i32| vec![v; groups];
            let (transa, transb) = (
                vec![sys::cublasOperation_t::CUBLAS_OP_T; groups],
                vec![sys::cublasOperation_t::CUBLAS_OP_N; groups],
            );
            let (alpha, beta) = (vec![1f32; groups], vec![0f32; groups]);
            let (m_arr, k_arr, ld_k, ld_n, sizes) = (
                per(n as i32),
                per(k as i32),
                per(k as i32),
                per(n as i32),
                per(1),
            );
            let blas = dev.cublas_handle();
            // SAFETY: group g reads expert e's n x k weights and its m_g x k rows of x and writes
            // its m_g x n rows of y, all inside their buffers (the offsets run over counts, which
            // sum to rows); the host arrays outlive the call, which reads them before returning;
            // the device pointer arrays are freed after the call on the same stream.
            unsafe {
                sys::cublasGemmGroupedBatchedEx(
                    *blas.handle(),
                    transa.as_ptr(),
                    transb.as_ptr(),
                    m_arr.as_ptr(),
                    ms.as_ptr(),
                    k_arr.as_ptr(),
                    alpha.as_ptr().cast(),
                    a_p as *const *const std::ffi::c_void,
                    data_type,
                    ld_k.as_ptr(),
                    b_p as *const *const std::ffi::c_void,
                    data_type,
                    ld_k.as_ptr(),
                    beta.as_ptr().cast(),
                    c_p as *const *mut std::ffi::c_void,
                    data_type,
                    ld_n.as_ptr(),
                    groups as i32,
                    sizes.as_ptr(),
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                )
            }
            .result()
            .map_err(|e| candle_core::Error::Msg(format!("grouped_linear: cuBLAS: {e:?}")))
        }
        let a = ((s1, l1), (s2, l2), counts, (rows, n, k));
        match s1.dtype() {
            candle_core::DType::F16 => {
                run::<f16>(a.0, a.1, a.2, a.3, sys::cudaDataType_t::CUDA_R_16F)
            }
            candle_core::DType::BF16 => {
                run::<bf16>(a.0, a.1, a.2, a.3, sys::cudaDataType_t::CUDA_R_16BF)
            }
            other => candle_core::bail!("grouped_linear: {other:?} on CUDA (f16 or bf16)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, IndexOp};

    use super::*;

    /// The twin is each group's rows times its expert's weights transposed (candle's matmul in
    /// f32), empty groups included; mismatched counts are an error naming them.
    #[test]
    fn twin_is_each_groups_product() {
        let dev = Device::Cpu;
        let (experts, n, k) = (4, 6, 5);
        let counts = [2, 0, 3, 1];
        let x = test_tensor(&[6, k], 1);
        let w = test_tensor(&[experts, n, k], 2).to_device(&dev).unwrap();
        let got = grouped_linear(&x, &w, &counts).unwrap();
        let mut at = 0;
        for (e, &c) in counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            let want = x
                .narrow(0, at, c)
                .unwrap()
                .matmul(&w.i(e).unwrap().t().unwrap())
                .unwrap();
            let d = max_abs_diff(&got.narrow(0, at, c).unwrap(), &want);
            assert!(d < 1e-5, "expert {e}: {d}");
            at += c;
        }
        let bf = grouped_linear(
            &x.to_dtype(DType::BF16).unwrap(),
            &w.to_dtype(DType::BF16).unwrap(),
            &counts,
        )
        .unwrap();
        assert_eq!(bf.dtype(), DType::BF16);
        let e = grouped_linear(&x, &w, &[2, 0, 3]).unwrap_err().to_string();
        assert!(e.contains("3 group counts"), "{e}");
    }

    /// On a GPU: cuBLAS's grouped GEMM against the twin on the MoE's shapes (bf16: the sums run
    /// in another order, so to a few units in the last place of the largest output).
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_grouped_linear_matches_its_twin() {
        let Some(gpu) = test_gpu("cuda_grouped_linear_matches_its_twin") else {
            return;
        };
        for (counts, n, k) in [
            (vec![3usize, 0, 17, 1], 64, 32),
            (vec![40, 0, 0, 300, 7, 1, 0, 220], 1536, 2048),
            (vec![5, 1, 33, 0, 0, 0, 2, 90], 2048, 768),
        ] {
            let rows: usize = counts.iter().sum();
            let x = test_tensor(&[rows, k], 3).to_dtype(DType::BF16).unwrap();
            let w = (test_tensor(&[counts.len(), n, k], 4) * 0.05)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let want = grouped_linear(&x, &w, &counts).unwrap();
            let got = grouped_linear(
                &x.to_device(&gpu).unwrap(),
                &w.to_device(&gpu).unwrap(),
                &counts,
            )
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap();
            let d = max_abs_diff(&got, &want);
            let scale = max_abs(&want);
            println!(
                "grouped_linear {counts:?} n={n} k={k}: max |cuBLAS - twin| = {d} (max {scale})"
            );
            assert!(d <= 0.02 * scale, "cuBLAS's grouped GEMM differs by {d}");
        }
    }
}
