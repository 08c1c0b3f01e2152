//! Reductions and in-place updates of large tensors without a second tensor of their size, and
//! the seed of a backward from a known gradient. On CUDA the sum of squares and the in-place
//! scaling (the gradient clipping's two passes) are kernels of their own (`reduce.cu`).

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor, D};

use super::{butterfly, contiguous, Float};

/// `t[r0..r0 + n] = f(t[r0..r0 + n], r0, n)` in place for slices of about `slice_elements`
/// elements along the first dimension (a scalar as `[1]`), so that an elementwise update of a
/// large tensor needs no second tensor of its size. `t` must be contiguous and own its storage
/// alone for the caller (gradient sums, optimizer state).
pub fn update_rows_in_place(
    t: &Tensor,
    slice_elements: usize,
    f: impl Fn(&Tensor, usize, usize) -> candle_core::Result<Tensor>,
) -> candle_core::Result<()> {
    let t = if t.rank() == 0 {
        t.reshape(1)?
    } else {
        t.clone()
    };
    let rows = t.dim(0)?;
    let per_row = (t.elem_count() / rows.max(1)).max(1);
    let step = (slice_elements / per_row).max(1);
    for start in (0..rows).step_by(step) {
        let n = step.min(rows - start);
        let out = f(&t.narrow(0, start, n)?, start, n)?.contiguous()?;
        t.slice_set(&out, 0, start)?;
    }
    Ok(())
}

/// `sum(x * x)` as a 0-d f32 tensor, summed over the last dimension first: candle reduces a
/// whole tensor in one thread block, which is slow for large ones, while a reduction over the
/// last dimension runs one block per row. A large `x` is squared in slices of its first
/// dimension (16M elements each), so the squares never need a second tensor of its size (the
/// gradient norm of a 0.5-1 GB embedding gradient).
///
/// On CUDA (f32, f16, bf16) two kernels instead: per-block partial sums of squares straight
/// from the tensor (f32 fused multiply-adds, no f32 copy or squared temporaries), then one
/// block sums the partials: two launches a tensor where the composed ops took four or five a
/// 16M-element slice, each with an f32 temporary (a CPU twin of the kernels' order checks
/// them).
pub fn sum_squares(x: &Tensor) -> candle_core::Result<Tensor> {
    const SLICE_ELEMENTS: usize = 16 << 20;
    // A strided tensor keeps the sliced path below (a contiguous copy of a large gradient
    // would be one more tensor of its size).
    if x.device().is_cuda()
        && x.is_contiguous()
        && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
        && x.elem_count() > 0
    {
        return x.apply_op1_no_bwd(&SumSquares);
    }
    let n = x.elem_count();
    if x.rank() < 2 || n <= SLICE_ELEMENTS {
        return row_sums_first(&x.to_dtype(DType::F32)?.sqr()?);
    }
    let rows = x.dim(0)?;
    let step = (SLICE_ELEMENTS / (n / rows).max(1)).max(1);
    let mut total: Option<Tensor> = None;
    for start in (0..rows).step_by(step) {
        let len = step.min(rows - start);
        let part = row_sums_first(&x.narrow(0, start, len)?.to_dtype(DType::F32)?.sqr()?)?;
        total = Some(match total {
            Some(t) => (t + part)?,
            None => part,
        });
    }
    total.ok_or_else(|| candle_core::Error::Msg("sum_squares of an empty tensor".into()))
}

/// Threads of a reduction block (a power of two; the launches give the kernels as many floats
/// of shared memory), which the twin's order follows.
const REDUCE_THREADS: usize = 256;

/// Blocks of the sum of squares' first pass over `n` elements: each thread at least 16
/// elements, at most 1024 blocks (their partials are summed by one block).
fn reduce_blocks(n: usize) -> usize {
    n.div_ceil(REDUCE_THREADS * 16).clamp(1, 1024)
}

/// The sum of squares as the CUDA kernels compute it (a 0-d f32); on the CPU its twin.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SumSquares;

/// The kernels' order: thread `t` of block `b` adds the squares (f32 fused multiply-adds) of
/// elements `b * 256 + t`, a grid's width further on, ...; each block's 256 sums as a tree
/// ([`butterfly`]); then one block's thread `t` adds partials `t`, `t + 256`, ... and the tree.
fn sum_squares_twin<T: Float>(x: &[T]) -> f32 {
    let n = x.len();
    let blocks = reduce_blocks(n);
    let stride = blocks * REDUCE_THREADS;
    let partials: Vec<f32> = (0..blocks)
        .map(|b| {
            butterfly(std::array::from_fn::<f32, REDUCE_THREADS, _>(|t| {
                x.iter()
                    .skip(b * REDUCE_THREADS + t)
                    .step_by(stride)
                    .fold(0f32, |acc, v| v.to_f32().mul_add(v.to_f32(), acc))
            }))
        })
        .collect();
    butterfly(std::array::from_fn::<f32, REDUCE_THREADS, _>(|t| {
        partials
            .iter()
            .skip(t)
            .step_by(REDUCE_THREADS)
            .fold(0f32, |acc, p| acc + p)
    }))
}

impl candle_core::CustomOp1 for SumSquares {
    fn name(&self) -> &'static str {
        "fleet-sum-squares"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let v = match s {
            CpuStorage::F32(x) => sum_squares_twin(contiguous(x, l)?),
            CpuStorage::BF16(x) => sum_squares_twin(contiguous(x, l)?),
            CpuStorage::F16(x) => sum_squares_twin(contiguous(x, l)?),
            _ => candle_core::bail!("sum_squares: f32, f16 or bf16"),
        };
        Ok((CpuStorage::F32(vec![v]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::sum_squares(s, l)?, Shape::from(())))
    }
}

/// `t *= coef` in place, `coef` first rounded to `t`'s dtype and each product rounded once to
/// it (torch's `g.mul_(clip_coef.to(g.dtype))`, and candle's `broadcast_mul` by that scalar,
/// bit for bit). `t` contiguous (a view into a larger buffer is fine), f32, f16 or bf16; on
/// CUDA one kernel, on the CPU a loop.
pub fn scale_in_place(t: &Tensor, coef: f32) -> candle_core::Result<()> {
    if !t.is_contiguous() {
        candle_core::bail!("scale_in_place: the tensor must be contiguous");
    }
    let c = match t.dtype() {
        DType::F32 => coef,
        DType::BF16 => half::bf16::from_f32(coef).to_f32(),
        DType::F16 => half::f16::from_f32(coef).to_f32(),
        other => candle_core::bail!("scale_in_place: f32, f16 or bf16, not {other:?}"),
    };
    t.inplace_op1(&ScaleInPlace(c))
}

/// [`scale_in_place`] by the already-rounded factor.
struct ScaleInPlace(f32);

impl candle_core::InplaceOp1 for ScaleInPlace {
    fn name(&self) -> &'static str {
        "fleet-scale-in-place"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        fn scale<T: Float>(v: &mut [T], l: &Layout, c: f32) -> candle_core::Result<()> {
            let Some((a, b)) = l.contiguous_offsets() else {
                candle_core::bail!("scale_in_place: the tensor must be contiguous")
            };
            v[a..b]
                .iter_mut()
                .for_each(|x| *x = T::from_f32(x.to_f32() * c));
            Ok(())
        }
        match s {
            CpuStorage::F32(v) => scale(v, l, self.0),
            CpuStorage::BF16(v) => scale(v, l, self.0),
            CpuStorage::F16(v) => scale(v, l, self.0),
            _ => candle_core::bail!("scale_in_place: f32, f16 or bf16"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> candle_core::Result<()> {
        cuda::scale_in_place(s, l, self.0)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout};

    use super::{reduce_blocks, REDUCE_THREADS};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/reduce.ptx"));
    const MODULE: &str = "fleet_reduce";

    /// The address of `l`'s contiguous range of `s`, its element count and the dtype suffix.
    fn range(s: &CudaStorage, l: &Layout) -> candle_core::Result<(u64, usize, &'static str)> {
        fn at<T: CudaDType + DeviceRepr>(
            s: &CudaStorage,
            a: usize,
            b: usize,
        ) -> candle_core::Result<u64> {
            Ok(s.as_cuda_slice::<T>()?
                .slice(a..b)
                .device_ptr(&s.device().cuda_stream())
                .0)
        }
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("reduce kernels take contiguous tensors")
        };
        let ptr = match s.dtype() {
            DType::F32 => at::<f32>(s, a, b)?,
            DType::BF16 => at::<half::bf16>(s, a, b)?,
            DType::F16 => at::<half::f16>(s, a, b)?,
            other => candle_core::bail!("reduce kernels take f32, f16 or bf16, not {other:?}"),
        };
        Ok((ptr, b - a, super::super::suffix(s.dtype())?))
    }

    pub(super) fn sum_squares(s: &CudaStorage, l: &Layout) -> candle_core::Result<CudaStorage> {
        let dev = s.device().clone();
        let (ptr, n, sfx) = range(s, l)?;
        let blocks = reduce_blocks(n);
        // SAFETY: the first kernel writes every one of the `blocks` partials, the second the
        // one output.
        let partials: CudaSlice<f32> = unsafe { dev.alloc::<f32>(blocks)? };
        let out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(1)? };
        let func =
            dev.get_or_load_custom_func(&format!("sum_squares_partials_{sfx}"), MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&ptr);
        let n64 = n as u64;
        b.arg(&n64);
        b.arg(&partials);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (REDUCE_THREADS as u32, 1, 1),
            shared_mem_bytes: (REDUCE_THREADS * 4) as u32,
        };
        // SAFETY: `ptr` holds n values of the kernel's dtype; block b writes partials[b].
        unsafe { b.launch(cfg) }.w()?;
        let func = dev.get_or_load_custom_func("sum_partials", MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&partials);
        let count = blocks as i32;
        b.arg(&count);
        b.arg(&out);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (REDUCE_THREADS as u32, 1, 1),
            shared_mem_bytes: (REDUCE_THREADS * 4) as u32,
        };
        // SAFETY: one block reads the `blocks` partials and writes out[0].
        unsafe { b.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }

    pub(super) fn scale_in_place(
        s: &mut CudaStorage,
        l: &Layout,
        c: f32,
    ) -> candle_core::Result<()> {
        let dev = s.device().clone();
        let (ptr, n, sfx) = range(s, l)?;
        if n == 0 {
            return Ok(());
        }
        let func = dev.get_or_load_custom_func(&format!("scale_in_place_{sfx}"), MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&ptr);
        let n64 = n as u64;
        b.arg(&n64);
        b.arg(&c);
        // SAFETY: `ptr` holds n values of the kernel's dtype (the tensor's own range of its
        // storage); the grid-stride loop rewrites each once.
        unsafe { b.launch(super::super::cuda_util::grid_stride(n)) }.w()?;
        Ok(())
    }
}

fn row_sums_first(x: &Tensor) -> candle_core::Result<Tensor> {
    let n = x.elem_count();
    if x.rank() < 2 || n < (1 << 16) {
        return x.sum_all();
    }
    let last = x.dim(D::Minus1)?;
    // Rows of a useful width: the tensor's own last dimension when it is wide enough, else
    // the whole tensor cut into rows of 1024 when it divides.
    let rows = if last >= 256 {
        x.reshape(((), last))?
    } else if n.is_multiple_of(1024) {
        x.flatten_all()?.reshape(((), 1024))?
    } else {
        return x.sum_all();
    };
    rows.sum(1)?.sum_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A tensor past the slice size is squared in slices: the sum matches f64 arithmetic, in
    /// f32 and bf16, and a small one takes the whole-tensor path to the same value.
    #[test]
    fn sum_squares_in_slices_matches_the_exact_sum() {
        let (rows, cols) = (4099usize, 4097usize); // 16.8M elements: two slices, one short
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| ((i.wrapping_mul(2654435761) % 2001) as f32 - 1000.0) / 1000.0)
            .collect();
        let x = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
        // Each case's sum of squares in f64 against sum_squares.
        let check = |t: &Tensor| {
            let values = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            let exact: f64 = values
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|&x| f64::from(x) * f64::from(x))
                .sum();
            let got = f64::from(sum_squares(t).unwrap().to_scalar::<f32>().unwrap());
            assert!((got - exact).abs() / exact < 1e-5, "{got} vs {exact}");
        };
        check(&x);
        check(&x.to_dtype(DType::BF16).unwrap());
        check(&x.narrow(0, 0, 3).unwrap());
        // The kernels' twin: the same sum to f32 rounding, in their order.
        for t in [
            x.clone(),
            x.narrow(0, 0, 3).unwrap(),
            x.to_dtype(DType::BF16).unwrap(),
        ] {
            let exact = sum_squares(&t).unwrap().to_scalar::<f32>().unwrap();
            let twin = t
                .apply_op1_no_bwd(&SumSquares)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!((twin - exact).abs() / exact < 1e-5, "{twin} vs {exact}");
        }
    }

    /// The in-place scaling is candle's multiplication by the scalar rounded to the dtype, bit
    /// for bit, on a view into a larger buffer (the rest untouched).
    #[test]
    fn scale_in_place_is_the_rounded_product() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let buf = crate::ops::test_tensor(&[10, 7], 5)
                .to_dtype(dtype)
                .unwrap();
            let before = buf.copy().unwrap();
            let view = buf.narrow(0, 2, 5).unwrap();
            let coef = 0.318_309_87f32;
            let c = Tensor::new(coef, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let want = view.broadcast_mul(&c).unwrap();
            scale_in_place(&view, coef).unwrap();
            assert_eq!(crate::ops::max_abs_diff(&view, &want), 0.0, "{dtype:?}");
            let rest = |t: &Tensor| {
                Tensor::cat(&[t.narrow(0, 0, 2).unwrap(), t.narrow(0, 7, 3).unwrap()], 0).unwrap()
            };
            assert_eq!(crate::ops::max_abs_diff(&rest(&buf), &rest(&before)), 0.0);
        }
    }

    /// On a GPU: the sum-of-squares kernels against their twin bit for bit (one block, many
    /// blocks, the 1024-block cap; every dtype), and the scaling kernel against the CPU's.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_reduce_kernels_match_their_twins() {
        let Some(gpu) = crate::ops::test_gpu("cuda_reduce_kernels_match_their_twins") else {
            return;
        };
        for n in [1usize, 255, 4097, 1 << 20, (1 << 22) + 3, 30_000_001] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let x = crate::ops::test_tensor(&[n], n as u64)
                    .to_dtype(dtype)
                    .unwrap();
                let want = x
                    .apply_op1_no_bwd(&SumSquares)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                let got = sum_squares(&x.to_device(&gpu).unwrap())
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "n={n} {dtype:?}: {got} vs {want}"
                );
                let on_gpu = x.to_device(&gpu).unwrap();
                scale_in_place(&on_gpu, 0.37).unwrap();
                scale_in_place(&x, 0.37).unwrap();
                let d = crate::ops::max_abs_diff(&on_gpu.to_device(&Device::Cpu).unwrap(), &x);
                assert_eq!(d, 0.0, "scale n={n} {dtype:?}");
            }
        }
    }
}

/// A 0-d zero of `x`'s dtype whose backward hands `x` the gradient `g` (`x`'s shape and
/// dtype): where a backward starts from a known gradient of an intermediate (a checkpointed
/// segment's output), since candle's backward starts from a scalar. It stands for
/// `sum(x * g)` without computing it: that product and its sum, and the backward's
/// `1 * g`, were four full passes over a layer's hidden states per segment. Only as the
/// backward's root or a term of it (the incoming gradient there is 1 and is not read).
pub fn gradient_seed(x: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
    if x.shape() != g.shape() || x.dtype() != g.dtype() {
        candle_core::bail!(
            "gradient_seed: x {:?} {:?} and g {:?} {:?} differ",
            x.dims(),
            x.dtype(),
            g.dims(),
            g.dtype()
        );
    }
    x.apply_op2(g, GradientSeed)
}

struct GradientSeed;

impl candle_core::CustomOp2 for GradientSeed {
    fn name(&self) -> &'static str {
        "fleet-gradient-seed"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        _l1: &candle_core::Layout,
        _s2: &candle_core::CpuStorage,
        _l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let shape = candle_core::Shape::from(());
        Ok((
            candle_core::cpu_backend::CpuDevice.zeros_impl(&shape, s1.dtype())?,
            shape,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        _l1: &candle_core::Layout,
        _s2: &candle_core::CudaStorage,
        _l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let shape = candle_core::Shape::from(());
        Ok((s1.device().zeros_impl(&shape, s1.dtype())?, shape))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        g: &Tensor,
        _res: &Tensor,
        _grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(g.detach()), None))
    }
}

#[cfg(test)]
mod seed_tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn a_gradient_seed_gives_the_gradient_of_sum_x_times_g() {
        let dev = Device::Cpu;
        let x =
            Var::from_tensor(&Tensor::new(&[[0.5f32, -1.0], [2.0, 3.0]], &dev).unwrap()).unwrap();
        let w = Tensor::new(&[[1.5f32, 0.25], [-2.0, 4.0]], &dev).unwrap();
        // A function of x with an intermediate y = x * w, seeded with dL/dy = g.
        let y = (x.as_tensor() * &w).unwrap();
        let g = Tensor::new(&[[0.1f32, 0.2], [0.3, -0.4]], &dev).unwrap();
        let seeded = gradient_seed(&y, &g).unwrap().backward().unwrap();
        let composed = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let a = seeded.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        let b = composed
            .get(x.as_tensor())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(a, b);
        assert_eq!(a, vec![vec![0.15f32, 0.05], vec![-0.6, -1.6]]);
        assert!(gradient_seed(&y, &g.to_dtype(DType::F64).unwrap()).is_err());
    }
}
