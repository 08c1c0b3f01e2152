//! Reductions and in-place updates of large tensors without a second tensor of their size, and
//! the seed of a backward from a known gradient (no kernels of their own).

use candle_core::{DType, Tensor, D};

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
pub fn sum_squares(x: &Tensor) -> candle_core::Result<Tensor> {
    const SLICE_ELEMENTS: usize = 16 << 20;
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
