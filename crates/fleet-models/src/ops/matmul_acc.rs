//! `acc += aᵀ · b` in place: a weight gradient added to its sum by the GEMM itself (cuBLASLt
//! with `beta = 1`), instead of a product of the weight's size written, read back by an add,
//! written again and copied into the sum.

use candle_core::{CpuStorage, Layout, Tensor};

use super::*;
use crate::error::{ModelError, Result};

/// `acc[m, n] += aᵀ · b` for `a` `[k, m]` and `b` `[k, n]` (contiguous, the dtype of `acc`),
/// in place: products summed in f32, the product rounded to the dtype and added to `acc` with
/// a second rounding, as torch accumulates a gradient (`grad += aᵀ b`, both in bf16). On
/// CUDA (f16, bf16) one cuBLASLt GEMM reading `acc` as its `C` (`beta = 1`); on the CPU the
/// twin. `acc` must be contiguous (a view into a larger buffer is fine). No gradient.
///
/// The vocabulary projection's weight gradient `grad_logitsᵀ · h`: per chunk of token rows it
/// is a `[vocab, hidden]` product, which added through a temporary cost five passes over the
/// embedding's size (and a copy of the transposed operand) where this costs two.
pub fn add_matmul_tn_(acc: &Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
    let (k, m) = a.dims2()?;
    let (kb, n) = b.dims2()?;
    if kb != k || acc.dims() != [m, n] || a.dtype() != acc.dtype() || b.dtype() != acc.dtype() {
        return Err(ModelError::BadInput(format!(
            "add_matmul_tn_: acc {:?} {:?} += aᵀ {:?} {:?} · b {:?} {:?} do not fit",
            acc.dims(),
            acc.dtype(),
            a.dims(),
            a.dtype(),
            b.dims(),
            b.dtype()
        )));
    }
    if !acc.is_contiguous() {
        return Err(ModelError::BadInput(
            "add_matmul_tn_: the sum must be contiguous".into(),
        ));
    }
    Ok(acc.inplace_op3(&contig(a)?, &contig(b)?, &AddMatmulTn)?)
}

/// Whether the trainer should add a weight gradient with [`add_matmul_tn_`] for these
/// operands: on CUDA in f16 or bf16 (cuBLASLt's f32 GEMM is TF32, which an f32 model must not
/// get) with every operand starting on 16 bytes (cuBLASLt's heuristic assumes aligned
/// pointers; a contiguous copy of a strided operand starts at 0). Not on the CPU, where the op
/// is its twin, a plain loop far slower than candle's GEMM for a real vocabulary.
pub fn add_matmul_tn_supported(acc: &Tensor, a: &Tensor, b: &Tensor) -> bool {
    let aligned = |t: &Tensor| {
        !t.is_contiguous()
            || (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16)
    };
    acc.device().is_cuda()
        && matches!(acc.dtype(), DType::BF16 | DType::F16)
        && acc.is_contiguous()
        && [acc, a, b].into_iter().all(aligned)
}

struct AddMatmulTn;

/// The twin: `acc[i][j] = T(acc[i][j] + T(Σ_r a[r][i] · b[r][j]))`, the sum in f32 in `r`
/// order.
fn add_matmul_tn_cpu<T: Float>(acc: &mut [T], a: &[T], b: &[T], (k, m, n): (usize, usize, usize)) {
    let mut row = vec![0f32; n];
    for i in 0..m {
        row.iter_mut().for_each(|v| *v = 0.0);
        for r in 0..k {
            let ai = a[r * m + i].to_f32();
            for (v, bj) in row.iter_mut().zip(&b[r * n..(r + 1) * n]) {
                *v += ai * bj.to_f32();
            }
        }
        for (c, v) in acc[i * n..(i + 1) * n].iter_mut().zip(&row) {
            *c = T::from_f32(c.to_f32() + T::round(*v));
        }
    }
}

/// `(k, m, n)` of `acc[m, n] += aᵀ[m, k] · b[k, n]`.
fn dims(acc: &Layout, a: &Layout, b: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    match (acc.dims(), a.dims(), b.dims()) {
        (&[m, n], &[k, ma], &[kb, nb]) if ma == m && nb == n && kb == k => Ok((k, m, n)),
        _ => candle_core::bail!(
            "add_matmul_tn_: acc {:?}, a {:?}, b {:?} do not fit",
            acc.dims(),
            a.dims(),
            b.dims()
        ),
    }
}

impl candle_core::InplaceOp3 for AddMatmulTn {
    fn name(&self) -> &'static str {
        "fleet-add-matmul-tn"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let d = dims(l1, l2, l3)?;
        let Some((o0, o1)) = l1.contiguous_offsets() else {
            candle_core::bail!("add_matmul_tn_: the sum must be contiguous")
        };
        match (s1, s2, s3) {
            (CpuStorage::F32(c), CpuStorage::F32(a), CpuStorage::F32(b)) => {
                add_matmul_tn_cpu(&mut c[o0..o1], contiguous(a, l2)?, contiguous(b, l3)?, d)
            }
            (CpuStorage::BF16(c), CpuStorage::BF16(a), CpuStorage::BF16(b)) => {
                add_matmul_tn_cpu(&mut c[o0..o1], contiguous(a, l2)?, contiguous(b, l3)?, d)
            }
            (CpuStorage::F16(c), CpuStorage::F16(a), CpuStorage::F16(b)) => {
                add_matmul_tn_cpu(&mut c[o0..o1], contiguous(a, l2)?, contiguous(b, l3)?, d)
            }
            _ => candle_core::bail!("add_matmul_tn_: inputs must share one of f32, f16, bf16"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let d = dims(l1, l2, l3)?;
        cuda::add_matmul_tn(s1, l1, s2, l2, s3, l3, d)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{CudaStorage, Layout};
    use half::{bf16, f16};

    use super::super::cuda_util::*;

    pub(super) fn add_matmul_tn(
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
        (k, m, n): (usize, usize, usize),
    ) -> candle_core::Result<()> {
        fn run<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
            s1: &mut CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
            (k, m, n): (usize, usize, usize),
        ) -> candle_core::Result<()>
        where
            CudaBlasLT: Matmul<T>,
        {
            let dev = s1.device().clone();
            let Some((c0, c1)) = l1.contiguous_offsets() else {
                candle_core::bail!("add_matmul_tn_: the sum must be contiguous")
            };
            let (a, b) = (input::<T>(s2, l2)?, input::<T>(s3, l3)?);
            let Some(lt) = super::super::epilogue::cublaslt_handle(&dev)? else {
                candle_core::bail!("add_matmul_tn_: no cuBLASLt handle yet inside a capture")
            };
            // Column-major, as cuBLAS sees it: accᵀ [n, m] += bᵀ [n, k] · a [k, m], where
            // b (row-major [k, n]) is bᵀ stored column-major with ld n, and a (row-major
            // [k, m]) is the transpose of the column-major [m, k] operand with ld m.
            let cfg = MatmulConfig {
                transa: false,
                transb: true,
                transc: false,
                m: n as u64,
                n: m as u64,
                k: k as u64,
                alpha: 1.0,
                lda: n as i64,
                ldb: m as i64,
                beta: 1.0,
                ldc: n as i64,
                stride_a: None,
                stride_b: None,
                stride_c: None,
                stride_bias: None,
                batch_size: None,
            };
            let mut acc = s1.as_cuda_slice_mut::<T>()?.slice_mut(c0..c1);
            // SAFETY: b holds k * n elements, a k * m and acc m * n (dims checked them against
            // the layouts); acc is C and D of the GEMM, read and written in place.
            unsafe { lt.matmul(cfg, &b, &a, &mut acc, None, None) }
                .map_err(|e| candle_core::Error::Cuda(Box::new(e)).bt())
        }
        match s1.dtype() {
            candle_core::DType::F16 => run::<f16>(s1, l1, s2, l2, s3, l3, (k, m, n)),
            candle_core::DType::BF16 => run::<bf16>(s1, l1, s2, l2, s3, l3, (k, m, n)),
            other => candle_core::bail!("add_matmul_tn_: {other:?} on CUDA (f16 or bf16)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The twin against candle's product: `acc + aᵀ b`.
    #[test]
    fn twin_adds_the_transposed_product() {
        let dev = Device::Cpu;
        let a = Tensor::randn(0f32, 1.0, (5, 7), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, (5, 3), &dev).unwrap();
        let start = Tensor::randn(0f32, 1.0, (7, 3), &dev).unwrap();
        let want = (&start + a.t().unwrap().matmul(&b).unwrap()).unwrap();
        // A view into a larger buffer, as the gradient sums are.
        let buffer = Tensor::zeros(4 + 21, DType::F32, &dev).unwrap();
        let acc = buffer.narrow(0, 4, 21).unwrap().reshape((7, 3)).unwrap();
        acc.slice_set(&start, 0, 0).unwrap();
        add_matmul_tn_(&acc, &a, &b).unwrap();
        let d = max_abs_diff(&acc, &want);
        assert!(d < 1e-5, "{d}");
        let head: Vec<f32> = buffer.narrow(0, 0, 4).unwrap().to_vec1().unwrap();
        assert_eq!(head, vec![0.0; 4], "nothing outside the view is written");
    }

    #[test]
    fn mismatched_shapes_are_refused() {
        let dev = Device::Cpu;
        let acc = Tensor::zeros((7, 3), DType::F32, &dev).unwrap();
        let a = Tensor::zeros((5, 7), DType::F32, &dev).unwrap();
        let b = Tensor::zeros((4, 3), DType::F32, &dev).unwrap();
        let err = add_matmul_tn_(&acc, &a, &b).unwrap_err().to_string();
        assert!(err.contains("do not fit"), "{err}");
    }
}
