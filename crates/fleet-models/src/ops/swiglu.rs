//! SwiGLU on the fused gate/up projection: `silu(gate) * up` in one kernel, with its backward.

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor, D};

use super::*;
use crate::error::Result;

/// `silu(x[.., :n]) * x[.., n:]` for `x` of last dimension `2n`.
pub fn swiglu(x: &Tensor) -> Result<Tensor> {
    let op: Arc<Box<dyn candle_core::CustomOp1 + Send + Sync>> = Arc::new(Box::new(SwiGlu));
    Ok(contig(x)?.apply_op1_arc(op)?)
}

struct SwiGlu;

pub(super) fn swiglu_cpu<T: Float>(x: &[T], n_cols: usize) -> Vec<T> {
    let mut y = Vec::with_capacity(x.len() / 2);
    for row in x.chunks(2 * n_cols) {
        let (gate, up) = row.split_at(n_cols);
        for (g, u) in gate.iter().zip(up) {
            let g = g.to_f32();
            // Rounded after the silu, as transformers computes act_fn(gate) * up.
            let act = T::from_f32(g / (1.0 + (-g).exp())).to_f32();
            y.push(T::from_f32(act * u.to_f32()));
        }
    }
    y
}

impl candle_core::CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "fleet-swiglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = l.dims();
        let n = dims[dims.len() - 1];
        if !n.is_multiple_of(2) {
            candle_core::bail!("swiglu: last dimension {n} is odd");
        }
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("non-empty") = n / 2;
        let out = float_cpu!("swiglu", (s, l) => x; swiglu_cpu(x, n / 2));
        Ok((out, Shape::from(out_dims)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::swiglu(s, l)
    }

    /// With `x = [gate | up]`: `d gate = g * up * silu'(gate)`, `d up = g * silu(gate)`, where
    /// `silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z)))`.
    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        bwd_timed(grad.device(), "bwd.swiglu", || {
            if x.device().is_cuda() {
                let g = grad.detach().to_dtype(x.dtype())?.contiguous()?;
                let dx = x.detach().contiguous()?.apply_op2_no_bwd(&g, &SwiGluBwd)?;
                return Ok(Some(dx));
            }
            let xf = x.to_dtype(DType::F32)?;
            let n = xf.dim(D::Minus1)? / 2;
            let gate = xf.narrow(D::Minus1, 0, n)?;
            let up = xf.narrow(D::Minus1, n, n)?;
            let g = grad.to_dtype(DType::F32)?;
            let sig = candle_nn::ops::sigmoid(&gate.contiguous()?)?;
            let silu = (&gate * &sig)?;
            // silu'(z) = sig + silu * (1 - sig)
            let dsilu = (&sig + (&silu * sig.affine(-1.0, 1.0)?)?)?;
            let d_gate = ((&g * up)? * dsilu)?;
            let d_up = (g * silu)?;
            Ok(Some(
                Tensor::cat(&[d_gate, d_up], D::Minus1)?.to_dtype(x.dtype())?,
            ))
        })
    }
}

/// Whether the CUDA launches may take the 16-byte vector kernels: unless `FLEET_SWIGLU_VEC=0`
/// (for measurements against the per-element kernels) or [`set_swiglu_scalar_kernels`].
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
static VECTOR: EnvSwitch = EnvSwitch::new("FLEET_SWIGLU_VEC", true);

/// Test switch: whether SwiGLU's CUDA launches (forward and backward) use only the
/// per-element kernels, for comparing them with the vector kernels (the same bits).
pub fn set_swiglu_scalar_kernels(scalar: bool) {
    VECTOR.force(scalar.then_some(false));
}

/// The fused backward as a forward-only op on CUDA tensors (the CPU keeps the composed backward).
struct SwiGluBwd;

cuda_only_op!(CustomOp2 for SwiGluBwd, "fleet-swiglu-bwd", |_op, s1, l1, s2, l2| {
    cuda::swiglu_bwd(s1, l1, s2, l2)
});

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, Layout, Shape};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/swiglu.ptx"));
    const MODULE: &str = "fleet_swiglu";

    /// Whether the `_vec` kernels take this call ([`whole_vectors`]), unless switched off
    /// ([`super::VECTOR`]).
    fn vectorized<T>(n_cols: usize, offsets: &[usize]) -> bool {
        super::VECTOR.on() && whole_vectors::<T>(n_cols, offsets.iter().copied())
    }

    pub(super) fn swiglu(s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(
            s: &CudaStorage,
            l: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s.device().clone();
            let x = input::<T>(s, l)?;
            let n2 = l.dims()[l.dims().len() - 1];
            let n_rows = l.shape().elem_count() / n2;
            let n_cols = n2 / 2;
            let el = n_rows * n_cols;
            let vec = vectorized::<T>(n_cols, &[l.start_offset()]);
            let func = dev.get_or_load_custom_func(
                &format!(
                    "swiglu_{}{}",
                    if vec { "vec_" } else { "" },
                    suffix(s.dtype())?
                ),
                MODULE,
                PTX,
            )?;
            // SAFETY: every element is written by the kernel.
            let y: CudaSlice<T> = unsafe { dev.alloc::<T>(el)? };
            let cfg = grid_stride(if vec { el / vector_len::<T>() } else { el });
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&y);
            let (rows, cols) = (n_rows as i32, n_cols as i32);
            b.arg(&rows);
            b.arg(&cols);
            // SAFETY: the grid-stride loop covers n_rows * n_cols outputs.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev))
        }
        let dims = l.dims();
        let n = dims[dims.len() - 1];
        if !n.is_multiple_of(2) {
            candle_core::bail!("swiglu: last dimension {n} is odd");
        }
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().expect("non-empty") = n / 2;
        let out = match s.dtype() {
            candle_core::DType::F32 => run::<f32>(s, l)?,
            candle_core::DType::F16 => run::<f16>(s, l)?,
            candle_core::DType::BF16 => run::<bf16>(s, l)?,
            other => candle_core::bail!("swiglu: unsupported dtype {other:?}"),
        };
        Ok((out, Shape::from(out_dims)))
    }

    /// Backward of `swiglu` from its input `x` (`[.., 2n]`) and the output's gradient `g`
    /// (`[.., n]`): `dx`, shaped like `x`.
    pub(super) fn swiglu_bwd(
        xs: &CudaStorage,
        xl: &Layout,
        gs: &CudaStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(
            xs: &CudaStorage,
            xl: &Layout,
            gs: &CudaStorage,
            gl: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = xs.device().clone();
            let x = input::<T>(xs, xl)?;
            let g = input::<T>(gs, gl)?;
            let n2 = xl.dims()[xl.dims().len() - 1];
            let n_rows = xl.shape().elem_count() / n2;
            let n_cols = n2 / 2;
            let el = n_rows * n_cols;
            let vec = vectorized::<T>(n_cols, &[xl.start_offset(), gl.start_offset()]);
            let func = dev.get_or_load_custom_func(
                &format!(
                    "swiglu_bwd_{}{}",
                    if vec { "vec_" } else { "" },
                    suffix(xs.dtype())?
                ),
                MODULE,
                PTX,
            )?;
            // SAFETY: the kernel writes both halves of every row.
            let dx: CudaSlice<T> = unsafe { dev.alloc::<T>(2 * el)? };
            let cfg = grid_stride(if vec { el / vector_len::<T>() } else { el });
            let mut b = func.builder();
            b.arg(&x);
            b.arg(&g);
            b.arg(&dx);
            let (rows, cols) = (n_rows as i32, n_cols as i32);
            b.arg(&rows);
            b.arg(&cols);
            // SAFETY: the grid-stride loop covers n_rows * n_cols (gate, up) pairs.
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(dx, dev))
        }
        let (xd, gd) = (xl.dims(), gl.dims());
        let n2 = xd[xd.len() - 1];
        if xd.len() != gd.len()
            || xd[..xd.len() - 1] != gd[..gd.len() - 1]
            || 2 * gd[gd.len() - 1] != n2
            || xs.dtype() != gs.dtype()
        {
            candle_core::bail!("swiglu backward: x {xd:?} and grad {gd:?} do not match");
        }
        let out = match xs.dtype() {
            candle_core::DType::F32 => run::<f32>(xs, xl, gs, gl)?,
            candle_core::DType::F16 => run::<f16>(xs, xl, gs, gl)?,
            candle_core::DType::BF16 => run::<bf16>(xs, xl, gs, gl)?,
            other => candle_core::bail!("swiglu backward: unsupported dtype {other:?}"),
        };
        Ok((out, xl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn swiglu_matches_reference() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (3, 2, 10), &dev).unwrap();
        let got = swiglu(&x).unwrap();
        assert_eq!(got.dims(), &[3, 2, 5]);
        let gate = x.narrow(2, 0, 5).unwrap();
        let up = x.narrow(2, 5, 5).unwrap();
        let want = (candle_nn::ops::silu(&gate).unwrap() * up).unwrap();
        let d = (got - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-6, "{d}");
    }
}

/// On a GPU: the 16-byte vector kernels give the per-element kernels' bits, forward and
/// backward, at shapes that take them (the 0.5B and 7B MLPs) and with an odd width that does
/// not.
#[cfg(all(test, feature = "cuda"))]
mod kernel_tests {
    use super::*;

    #[test]
    fn vector_kernels_give_the_scalar_bits() {
        let dev = candle_core::Device::new_cuda(0).unwrap();
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for (rows, n) in [(37, 4864), (5, 18944), (3, 1500)] {
                let x = test_tensor(&[rows, 2 * n], 7)
                    .affine(3.0, 0.0)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .to_device(&dev)
                    .unwrap();
                let g = test_tensor(&[rows, n], 8)
                    .to_dtype(dtype)
                    .unwrap()
                    .to_device(&dev)
                    .unwrap();
                let run = || {
                    let y = swiglu(&x).unwrap();
                    let dx = x.apply_op2_no_bwd(&g, &SwiGluBwd).unwrap();
                    let host = |t: &Tensor| -> Vec<f32> {
                        t.to_dtype(DType::F32)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1()
                            .unwrap()
                    };
                    (host(&y), host(&dx))
                };
                let vector = run();
                set_swiglu_scalar_kernels(true);
                let scalar = run();
                set_swiglu_scalar_kernels(false);
                for (what, v, s) in [
                    ("forward", &vector.0, &scalar.0),
                    ("backward", &vector.1, &scalar.1),
                ] {
                    assert!(
                        v.iter().zip(s).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{dtype:?} [{rows}, {n}]: {what} differs"
                    );
                }
            }
        }
    }
}
