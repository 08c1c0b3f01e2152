//! The fused ops of `fleet_models::ops`: their backward against central finite differences and
//! against candle's autograd of the same math composed from plain tensor ops (f32, CPU), and
//! their forward in bf16/f16 against the composed math rounded the way transformers rounds.
//!
//! Shapes are tiny and cover what the decoder uses: left padding (masked_softmax), per-row and
//! shared RoPE tables, a projection bias, grouped-query attention (h != kvh).

use candle_core::{DType, Device, Tensor, Var, D};
use fleet_models::ops;

// One helper of it: the GPU tests' entry.
#[allow(dead_code)]
mod devices;
#[cfg(feature = "cuda")]
use devices::gpu_or_skip;

// ---------------------------------------------------------------------------------------------
// Deterministic random tensors.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform().max(1e-300), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    fn tensor(&mut self, shape: &[usize], mean: f32, std: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| mean + std * self.normal()).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }
}

// ---------------------------------------------------------------------------------------------
// The gradient checks.

/// A function of some input tensors returning output tensors.
type Forward<'a> = &'a dyn Fn(&[Tensor]) -> Vec<Tensor>;

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    max_abs(&(a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap())
}

/// Random cotangents: the loss is `sum_i <out_i, r_i>`, so its gradient with respect to the
/// outputs is `r` (every output element gets its own weight).
fn cotangents(outs: &[Tensor], rng: &mut Rng) -> Vec<Tensor> {
    outs.iter()
        .map(|o| {
            rng.tensor(o.dims(), 0.0, 1.0)
                .to_device(o.device())
                .unwrap()
        })
        .collect()
}

/// The loss in f64 (the finite differences need more than f32's 7 digits for the sum).
fn loss64(f: Forward, inputs: &[Tensor], rs: &[Tensor]) -> f64 {
    f(inputs)
        .iter()
        .zip(rs)
        .map(|(o, r)| {
            (o.to_dtype(DType::F64).unwrap() * r.to_dtype(DType::F64).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        })
        .sum()
}

/// The gradients of the loss with respect to `inputs[i]` for `i` in `diff`, by candle's
/// backward (the inputs become `Var`s).
fn autograd(f: Forward, inputs: &[Tensor], diff: &[usize], rs: &[Tensor]) -> Vec<Tensor> {
    let xs: Vec<Tensor> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if diff.contains(&i) {
                Var::from_tensor(t).unwrap().as_tensor().clone()
            } else {
                t.clone()
            }
        })
        .collect();
    let outs = f(&xs);
    for o in &outs {
        assert!(o.track_op(), "an output of a tracked input must be tracked");
    }
    let mut loss = Tensor::zeros((), DType::F32, outs[0].device()).unwrap();
    for (o, r) in outs.iter().zip(rs) {
        let term = (o.to_dtype(DType::F32).unwrap() * r)
            .unwrap()
            .sum_all()
            .unwrap();
        loss = (loss + term).unwrap();
    }
    let grads = loss.backward().unwrap();
    diff.iter()
        .map(|&i| {
            grads
                .get(&xs[i])
                .unwrap_or_else(|| panic!("no gradient for input {i}"))
                .clone()
        })
        .collect()
}

/// `inputs` with `inputs[i]` replaced by `x`.
fn with(inputs: &[Tensor], i: usize, x: Tensor) -> Vec<Tensor> {
    let mut v = inputs.to_vec();
    v[i] = x;
    v
}

const FD_EPS: f32 = 1e-3;
const FD_REL: f32 = 1e-2;

/// Central differences for every element of `inputs[i]`, against `grad`: the largest error must
/// be within `FD_REL` of the gradient's largest element.
fn check_fd_elementwise(
    name: &str,
    f: Forward,
    inputs: &[Tensor],
    i: usize,
    rs: &[Tensor],
    grad: &Tensor,
) {
    let x: Vec<f32> = inputs[i].flatten_all().unwrap().to_vec1().unwrap();
    let an: Vec<f32> = grad.flatten_all().unwrap().to_vec1().unwrap();
    let shape = inputs[i].dims().to_vec();
    let scale = an.iter().fold(0f32, |m, g| m.max(g.abs()));
    assert!(scale > 1e-3, "{name}: input {i}: gradient is (nearly) zero");
    let mut worst = 0f32;
    for j in 0..x.len() {
        let (mut p, mut m) = (x.clone(), x.clone());
        p[j] += FD_EPS;
        m[j] -= FD_EPS;
        let step = f64::from(p[j]) - f64::from(m[j]);
        let lp = loss64(
            f,
            &with(
                inputs,
                i,
                Tensor::from_vec(p, &*shape, &Device::Cpu).unwrap(),
            ),
            rs,
        );
        let lm = loss64(
            f,
            &with(
                inputs,
                i,
                Tensor::from_vec(m, &*shape, &Device::Cpu).unwrap(),
            ),
            rs,
        );
        let fd = ((lp - lm) / step) as f32;
        let err = (fd - an[j]).abs();
        worst = worst.max(err);
        assert!(
            err <= FD_REL * scale,
            "{name}: input {i} element {j}: finite difference {fd} vs backward {} (scale {scale})",
            an[j]
        );
    }
    eprintln!(
        "{name}: input {i}: {} elements, worst |fd - bwd| = {worst:.2e} (scale {scale:.2e})",
        x.len()
    );
}

/// Central differences along random directions `v`: `(L(x + eps v) - L(x - eps v)) / 2 eps`
/// against `<grad, v>`, within `FD_REL` relative.
fn check_fd_directions(
    name: &str,
    f: Forward,
    inputs: &[Tensor],
    i: usize,
    rs: &[Tensor],
    grad: &Tensor,
    rng: &mut Rng,
) {
    for k in 0..4 {
        let v = rng.tensor(inputs[i].dims(), 0.0, 1.0);
        let dx = (&v * f64::from(FD_EPS)).unwrap();
        let lp = loss64(f, &with(inputs, i, (&inputs[i] + &dx).unwrap()), rs);
        let lm = loss64(f, &with(inputs, i, (&inputs[i] - &dx).unwrap()), rs);
        let fd = ((lp - lm) / (2.0 * f64::from(FD_EPS))) as f32;
        let an = (grad * &v)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            (fd - an).abs() <= FD_REL * an.abs().max(1e-2),
            "{name}: input {i} direction {k}: finite difference {fd} vs backward {an}"
        );
    }
}

/// The whole check for one op: the fused op's gradients (candle backward through the custom
/// op's `bwd`) against central differences (every element when `elementwise`, random
/// directions otherwise) and against candle's autograd of `reference` (within `tight` of the
/// gradient's scale). Every output and every gradient is checked.
fn check_op(
    name: &str,
    fused: Forward,
    reference: Forward,
    inputs: &[Tensor],
    diff: &[usize],
    rng: &mut Rng,
) {
    let outs = fused(inputs);
    let refs = reference(inputs);
    assert_eq!(outs.len(), refs.len());
    for (k, (o, r)) in outs.iter().zip(&refs).enumerate() {
        assert!(
            !o.track_op(),
            "{name}: output {k} of untracked inputs is tracked"
        );
        let d = max_diff(o, r);
        assert!(
            d <= 1e-5 * max_abs(r).max(1.0),
            "{name}: forward output {k}: {d}"
        );
    }
    let rs = cotangents(&outs, rng);
    let grads = autograd(fused, inputs, diff, &rs);
    let want = autograd(reference, inputs, diff, &rs);
    for ((&i, g), w) in diff.iter().zip(&grads).zip(&want) {
        assert_eq!(
            g.dims(),
            inputs[i].dims(),
            "{name}: gradient shape of input {i}"
        );
        let d = max_diff(g, w);
        let scale = max_abs(w);
        assert!(
            d <= 1e-5 * scale.max(1.0),
            "{name}: input {i}: backward vs autograd of the composed math: {d} (scale {scale})"
        );
        eprintln!("{name}: input {i}: |bwd - autograd(reference)| = {d:.2e} (scale {scale:.2e})");
        if inputs[i].elem_count() <= 512 {
            check_fd_elementwise(name, fused, inputs, i, &rs, g);
        }
        check_fd_directions(name, fused, inputs, i, &rs, g, rng);
    }
}

// ---------------------------------------------------------------------------------------------
// The composed references: plain candle ops (all differentiable), rounding as transformers
// does when the inputs are bf16/f16 (f32 statistics, model-dtype products).

fn rms_norm_ref(x: &Tensor, w: &Tensor, eps: f32) -> Tensor {
    let xf = x.to_dtype(DType::F32).unwrap();
    let r = (xf.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + f64::from(eps))
        .unwrap()
        .sqrt()
        .unwrap()
        .recip()
        .unwrap();
    let normed = xf.broadcast_mul(&r).unwrap().to_dtype(x.dtype()).unwrap();
    normed.broadcast_mul(w).unwrap()
}

fn softmax_ref(x: &Tensor) -> Tensor {
    let m = x.max_keepdim(D::Minus1).unwrap();
    let e = x.broadcast_sub(&m).unwrap().exp().unwrap();
    e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
}

/// The additive mask of `masked_softmax`'s contract, for scores of `shape`.
fn mask(
    shape: &[usize],
    pads: &[u32],
    rows_per_batch: usize,
    q_len: usize,
    offset: usize,
) -> Tensor {
    let kv_len = shape[shape.len() - 1];
    let rows: usize = shape.iter().product::<usize>() / kv_len;
    let mut m = Vec::with_capacity(rows * kv_len);
    for r in 0..rows {
        let qi = offset + r % q_len;
        let p = pads[r / rows_per_batch] as usize;
        for j in 0..kv_len {
            let visible = j <= qi && (j >= p || j == qi);
            m.push(if visible { 0f32 } else { -1e30 });
        }
    }
    Tensor::from_vec(m, shape, &Device::Cpu).unwrap()
}

fn silu_ref(x: &Tensor) -> Tensor {
    let sig = (x.neg().unwrap().exp().unwrap() + 1.0)
        .unwrap()
        .recip()
        .unwrap();
    (x * sig).unwrap()
}

/// `x * cos + rotate_half(x) * sin` on head-major `x` `[b, n, t, d]` (transformers'
/// apply_rotary_pos_emb), with `cos`/`sin` `[t, d/2]` or `[b, t, d/2]`.
fn rope_ref(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (b, _, t, d) = x.dims4().unwrap();
    let full = |c: &Tensor| {
        let c = Tensor::cat(&[c, c], D::Minus1).unwrap();
        if c.rank() == 2 {
            c.reshape((1, 1, t, d)).unwrap()
        } else {
            c.reshape((b, 1, t, d)).unwrap()
        }
    };
    let half = d / 2;
    let x1 = x.narrow(3, 0, half).unwrap();
    let x2 = x.narrow(3, half, half).unwrap();
    let rot = Tensor::cat(&[&x2.neg().unwrap(), &x1], 3).unwrap();
    (x.broadcast_mul(&full(cos)).unwrap() + rot.broadcast_mul(&full(sin)).unwrap()).unwrap()
}

/// `qkv + bias` as head-major `[b, h + 2 kvh, t, d]`.
fn heads_ref(qkv: &Tensor, bias: &Tensor, heads: usize, d: usize) -> Tensor {
    let (b, t, _) = qkv.dims3().unwrap();
    qkv.broadcast_add(bias)
        .unwrap()
        .reshape((b, t, heads, d))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
}

/// RoPE tables for `positions` (`[rows][t]`): `(cos, sin)` `[rows, t, d/2]` in f32, as
/// transformers computes them (theta 10000).
fn tables(positions: &[Vec<usize>], d: usize) -> (Tensor, Tensor) {
    let (rows, t) = (positions.len(), positions[0].len());
    let inv: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / 10000f64.powf((2 * i) as f64 / d as f64) as f32)
        .collect();
    let (mut c, mut s) = (Vec::new(), Vec::new());
    for row in positions {
        for &p in row {
            for &f in &inv {
                c.push((p as f32 * f).cos());
                s.push((p as f32 * f).sin());
            }
        }
    }
    let shape = (rows, t, d / 2);
    (
        Tensor::from_vec(c, shape, &Device::Cpu).unwrap(),
        Tensor::from_vec(s, shape, &Device::Cpu).unwrap(),
    )
}

/// Per-row tables for a left-padded batch (`pads` padding tokens, positions counting from the
/// first real token) and the shared table of an unpadded one.
fn per_row_and_shared(pads: &[usize], t: usize, d: usize) -> ((Tensor, Tensor), (Tensor, Tensor)) {
    let rows: Vec<Vec<usize>> = pads
        .iter()
        .map(|&p| (0..t).map(|i| i.saturating_sub(p) + 3).collect())
        .collect();
    let per_row = tables(&rows, d);
    let (c, s) = tables(&[(0..t).map(|i| i + 5).collect()], d);
    (per_row, (c.get(0).unwrap(), s.get(0).unwrap()))
}

const EPS: f32 = 1e-6;

// ---------------------------------------------------------------------------------------------
// Backward of each op, f32 on the CPU.

#[test]
fn masked_softmax_backward() {
    let mut rng = Rng(1);
    // Two batch rows of 2 heads x 3 queries over 5 keys (2 cached); row 1 has 3 padding
    // keys, so its first query (position 2) sees only itself.
    let (b, heads, q_len, offset) = (2, 2, 3, 2);
    let kv_len = offset + q_len;
    let pads = [0u32, 3];
    let shape = [b, heads, q_len, kv_len];
    let pad = Tensor::new(&pads, &Device::Cpu).unwrap();
    let m = mask(&shape, &pads, heads * q_len, q_len, offset);
    let fused = |x: &[Tensor]| {
        vec![ops::masked_softmax(&x[0], &pad, heads * q_len, q_len, offset).unwrap()]
    };
    let reference = |x: &[Tensor]| vec![softmax_ref(&x[0].broadcast_add(&m).unwrap())];
    let scores = rng.tensor(&shape, 0.0, 2.0);
    check_op(
        "masked_softmax",
        &fused,
        &reference,
        std::slice::from_ref(&scores),
        &[0],
        &mut rng,
    );

    // Masked keys get no gradient.
    let rs = cotangents(&fused(std::slice::from_ref(&scores)), &mut rng);
    let g = &autograd(&fused, &[scores], &[0], &rs)[0];
    let masked = m.lt(-1.0).unwrap().to_dtype(DType::F32).unwrap();
    assert_eq!(max_abs(&(g * masked).unwrap()), 0.0);
}

#[test]
fn swiglu_backward() {
    let mut rng = Rng(2);
    let x = rng.tensor(&[2, 3, 10], 0.0, 1.5);
    let fused = |x: &[Tensor]| vec![ops::swiglu(&x[0]).unwrap()];
    let reference = |x: &[Tensor]| {
        let gate = x[0].narrow(2, 0, 5).unwrap();
        let up = x[0].narrow(2, 5, 5).unwrap();
        vec![(silu_ref(&gate) * up).unwrap()]
    };
    check_op("swiglu", &fused, &reference, &[x], &[0], &mut rng);
}

#[test]
fn rms_norm_backward() {
    let mut rng = Rng(3);
    let x = rng.tensor(&[2, 3, 8], 0.5, 1.0);
    let w = rng.tensor(&[8], 1.0, 0.3);
    let fused = |x: &[Tensor]| vec![ops::rms_norm(&x[0], &x[1], EPS).unwrap()];
    let reference = |x: &[Tensor]| vec![rms_norm_ref(&x[0], &x[1], EPS)];
    check_op("rms_norm", &fused, &reference, &[x, w], &[0, 1], &mut rng);
}

#[test]
fn add_rms_norm_backward() {
    let mut rng = Rng(4);
    let x = rng.tensor(&[2, 3, 8], 0.0, 1.0);
    let h = rng.tensor(&[2, 3, 8], 0.3, 1.0);
    let w = rng.tensor(&[8], 1.0, 0.3);
    // Both outputs carry gradient: the residual stream and the normalised input of the block.
    let fused = |x: &[Tensor]| {
        let (s, y) = ops::add_rms_norm(&x[0], &x[1], &x[2], EPS).unwrap();
        vec![s, y]
    };
    let reference = |x: &[Tensor]| {
        let s = (&x[0] + &x[1]).unwrap();
        let y = rms_norm_ref(&s, &x[2], EPS);
        vec![s, y]
    };
    check_op(
        "add_rms_norm",
        &fused,
        &reference,
        &[x, h, w],
        &[0, 1, 2],
        &mut rng,
    );

    // Only the normalised output used (the other half of the stacked output gets no gradient).
    let only_y = |x: &[Tensor]| vec![ops::add_rms_norm(&x[0], &x[1], &x[2], EPS).unwrap().1];
    let only_y_ref = |x: &[Tensor]| vec![rms_norm_ref(&(&x[0] + &x[1]).unwrap(), &x[2], EPS)];
    let inputs = [
        rng.tensor(&[3, 8], 0.0, 1.0),
        rng.tensor(&[3, 8], 0.0, 1.0),
        rng.tensor(&[8], 1.0, 0.3),
    ];
    check_op(
        "add_rms_norm (y only)",
        &only_y,
        &only_y_ref,
        &inputs,
        &[0, 1, 2],
        &mut rng,
    );
}

#[test]
fn qkv_rope_backward() {
    let mut rng = Rng(5);
    let (b, t, h, kvh, d) = (2, 3, 4, 2, 8);
    let w = (h + 2 * kvh) * d;
    let ((cos_r, sin_r), (cos_s, sin_s)) = per_row_and_shared(&[0, 2], t, d);
    for (what, cos, sin) in [("per-row", cos_r, sin_r), ("shared", cos_s, sin_s)] {
        let cs = Tensor::cat(&[&cos, &sin], D::Minus1).unwrap();
        let fused = |x: &[Tensor]| {
            let (q, k, v) = ops::qkv_rope(&x[0], &x[1], &x[2], (h, kvh), d).unwrap();
            vec![q, k, v]
        };
        let reference = |x: &[Tensor]| {
            let heads = heads_ref(&x[0], &x[1], h + 2 * kvh, d);
            let part = |s, n| heads.narrow(1, s, n).unwrap();
            vec![
                rope_ref(&part(0, h), &cos, &sin),
                rope_ref(&part(h, kvh), &cos, &sin),
                part(h + kvh, kvh),
            ]
        };
        let inputs = [
            rng.tensor(&[b, t, w], 0.0, 1.0),
            rng.tensor(&[w], 0.0, 0.5),
            cs,
        ];
        check_op(
            &format!("qkv_rope ({what} tables)"),
            &fused,
            &reference,
            &inputs,
            &[0, 1],
            &mut rng,
        );
    }
}

/// Qwen3's per-head norms + RoPE, composed: `(q, k, v)` head-major.
#[allow(clippy::too_many_arguments)]
fn qk_norm_rope_ref(
    qkv: &Tensor,
    bias: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    qw: &Tensor,
    kw: &Tensor,
    (h, kvh): (usize, usize),
    d: usize,
) -> Vec<Tensor> {
    let heads = heads_ref(qkv, bias, h + 2 * kvh, d);
    let part = |s, n| heads.narrow(1, s, n).unwrap();
    vec![
        rope_ref(&rms_norm_ref(&part(0, h), qw, EPS), cos, sin),
        rope_ref(&rms_norm_ref(&part(h, kvh), kw, EPS), cos, sin),
        part(h + kvh, kvh),
    ]
}

#[test]
fn qk_norm_rope_backward() {
    let mut rng = Rng(6);
    let (b, t, h, kvh, d) = (2, 3, 4, 2, 8);
    let w = (h + 2 * kvh) * d;
    let ((cos_r, sin_r), (cos_s, sin_s)) = per_row_and_shared(&[0, 2], t, d);
    for (what, cos, sin) in [("per-row", cos_r, sin_r), ("shared", cos_s, sin_s)] {
        // The bias as a trained parameter (added before the kernel) ...
        let fused = |x: &[Tensor]| {
            let (q, k, v) = ops::qk_norm_rope(
                &x[0],
                &x[1],
                &cs_of(&cos, &sin),
                &x[2],
                &x[3],
                EPS,
                (h, kvh),
                d,
            )
            .unwrap();
            vec![q, k, v]
        };
        let reference =
            |x: &[Tensor]| qk_norm_rope_ref(&x[0], &x[1], &cos, &sin, &x[2], &x[3], (h, kvh), d);
        let inputs = [
            rng.tensor(&[b, t, w], 0.0, 1.0),
            rng.tensor(&[w], 0.0, 0.5),
            rng.tensor(&[d], 1.0, 0.3),
            rng.tensor(&[d], 1.0, 0.3),
        ];
        check_op(
            &format!("qk_norm_rope ({what} tables, trained bias)"),
            &fused,
            &reference,
            &inputs,
            &[0, 1, 2, 3],
            &mut rng,
        );
        // ... and as a constant (added in the kernel).
        check_op(
            &format!("qk_norm_rope ({what} tables, constant bias)"),
            &fused,
            &reference,
            &inputs,
            &[0, 2, 3],
            &mut rng,
        );
    }
}

/// Gradients reach a `Var` through the ops only when it is tracked; untracked inputs record
/// nothing (inference pays nothing for the backward).
#[test]
fn results_are_tracked_only_when_an_input_is() {
    let mut rng = Rng(7);
    let x = rng.tensor(&[2, 8], 0.0, 1.0);
    let w = rng.tensor(&[8], 1.0, 0.1);
    assert!(!ops::rms_norm(&x, &w, EPS).unwrap().track_op());
    let wv = Var::from_tensor(&w).unwrap();
    let y = ops::rms_norm(&x, wv.as_tensor(), EPS).unwrap();
    assert!(y.track_op());
    let g = y.sum_all().unwrap().backward().unwrap();
    assert!(g.get(wv.as_tensor()).is_some());
    assert!(g.get(&x).is_none());
}

/// RoPE tables in the layout the ops read: cos then sin per position.
fn cs_of(cos: &Tensor, sin: &Tensor) -> Tensor {
    Tensor::cat(&[cos, sin], cos.rank() - 1).unwrap()
}

/// A small chain of every op (a Qwen3-like attention input, scores, softmax, norms, SwiGLU):
/// `x` = qkv, bias, q_norm and k_norm weights.
fn chain(
    x: &[Tensor],
    cos: &Tensor,
    sin: &Tensor,
    (h, kvh): (usize, usize),
    d: usize,
) -> Vec<Tensor> {
    let (b, t, _) = x[0].dims3().unwrap();
    let (q, k, v) = ops::qk_norm_rope(
        &x[0],
        &x[1],
        &cs_of(cos, sin),
        &x[2],
        &x[3],
        EPS,
        (h, kvh),
        d,
    )
    .unwrap();
    let scores = q
        .reshape((b, kvh, h / kvh * t, d))
        .unwrap()
        .matmul(&k.t().unwrap())
        .unwrap();
    let pad = Tensor::new(&vec![0u32; b][..], &Device::Cpu).unwrap();
    let p = ops::masked_softmax(&scores, &pad, h * t, t, 0).unwrap();
    let (s, y) = ops::add_rms_norm(&v, &v, &x[3], EPS).unwrap();
    let z = ops::rms_norm(&y, &x[2], EPS).unwrap();
    vec![q, k, ops::swiglu(&p).unwrap(), s, z]
}

/// The backward on bf16/f16 inputs returns gradients of the inputs' dtype, close to the f32
/// gradients at the same (rounded) inputs.
#[test]
fn half_precision_backward_returns_input_dtype() {
    let mut rng = Rng(8);
    let (b, t, h, kvh, d) = (1, 2, 2, 1, 8);
    let w = (h + 2 * kvh) * d;
    let ((cos, sin), _) = per_row_and_shared(&[0], t, d);
    let inputs = [
        rng.tensor(&[b, t, w], 0.0, 1.0),
        rng.tensor(&[w], 0.0, 0.5),
        rng.tensor(&[d], 1.0, 0.3),
        rng.tensor(&[d], 1.0, 0.3),
    ];
    for dtype in [DType::BF16, DType::F16] {
        let (c, s) = (cos.to_dtype(dtype).unwrap(), sin.to_dtype(dtype).unwrap());
        let low: Vec<Tensor> = inputs.iter().map(|x| x.to_dtype(dtype).unwrap()).collect();
        let fused = |x: &[Tensor]| chain(x, &c, &s, (h, kvh), d);
        let rs = cotangents(&fused(&low), &mut rng);
        let grads = autograd(&fused, &low, &[0, 1, 2, 3], &rs);
        let exact: Vec<Tensor> = low
            .iter()
            .map(|x| x.to_dtype(DType::F32).unwrap())
            .collect();
        let (c32, s32) = (
            c.to_dtype(DType::F32).unwrap(),
            s.to_dtype(DType::F32).unwrap(),
        );
        let fused32 = |x: &[Tensor]| chain(x, &c32, &s32, (h, kvh), d);
        let want = autograd(&fused32, &exact, &[0, 1, 2, 3], &rs);
        for (i, (g, w)) in grads.iter().zip(&want).enumerate() {
            assert_eq!(g.dtype(), dtype, "gradient {i}");
            let (diff, scale) = (max_diff(g, w), max_abs(w));
            eprintln!("{dtype:?}: gradient {i}: |g - g_f32| = {diff:.2e} (scale {scale:.2e})");
            assert!(
                diff <= 0.05 * scale,
                "{dtype:?}: gradient {i}: {diff} (scale {scale})"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Forward in bf16/f16 against the composed math rounded as transformers rounds.

/// One unit in the last place of `dtype` relative to the value: 2^-7 (bf16), 2^-10 (f16).
fn ulp(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        _ => f32::EPSILON,
    }
}

/// The fused output equals the reference but for rare one-ulp flips (a sum of squares added in
/// another order can move a rounding): at least 97% of the elements are bit-identical, none is
/// more than two ulps (relative to the output's scale) away.
fn assert_rounding_matches(name: &str, got: &Tensor, want: &Tensor) {
    let dtype = want.dtype();
    assert_eq!(got.dtype(), dtype, "{name}: dtype");
    let g: Vec<f32> = got
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let w: Vec<f32> = want
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let exact = g.iter().zip(&w).filter(|(a, b)| a == b).count();
    let worst = g
        .iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!(
        "{name} {dtype:?}: {exact}/{} bit-identical, worst {worst:.2e} (scale {scale:.2e})",
        g.len()
    );
    assert!(
        worst <= 2.0 * ulp(dtype) * scale,
        "{name} {dtype:?}: worst diff {worst}"
    );
    assert!(
        exact as f32 >= 0.97 * g.len() as f32,
        "{name} {dtype:?}: {exact}/{} exact",
        g.len()
    );
}

#[test]
fn half_precision_forward_rounds_as_transformers() {
    let mut rng = Rng(9);
    let (b, t, h, kvh, d) = (2, 5, 4, 2, 64);
    let w = (h + 2 * kvh) * d;
    let ((cos_r, sin_r), (cos_s, sin_s)) = per_row_and_shared(&[0, 3], t, d);
    for dtype in [DType::BF16, DType::F16] {
        let lo = |x: &Tensor| x.to_dtype(dtype).unwrap();
        let f32_ = |x: &Tensor| x.to_dtype(DType::F32).unwrap();

        // masked_softmax: softmax in f32 of the masked scores, rounded once.
        let (heads, q_len, offset) = (2, 4, 3);
        let shape = [b, heads, q_len, offset + q_len];
        let pads = [0u32, 5];
        let scores = lo(&rng.tensor(&shape, 0.0, 3.0));
        let pad = Tensor::new(&pads, &Device::Cpu).unwrap();
        let got = ops::masked_softmax(&scores, &pad, heads * q_len, q_len, offset).unwrap();
        let m = mask(&shape, &pads, heads * q_len, q_len, offset);
        let want = lo(&softmax_ref(&f32_(&scores).broadcast_add(&m).unwrap()));
        assert_rounding_matches("masked_softmax", &got, &want);

        // swiglu: act_fn(gate) rounded, times up in the model dtype.
        let x = lo(&rng.tensor(&[3, 7, 2 * 96], 0.0, 2.0));
        let gate = x.narrow(2, 0, 96).unwrap();
        let up = x.narrow(2, 96, 96).unwrap();
        let want = (lo(&silu_ref(&f32_(&gate))) * up).unwrap();
        assert_rounding_matches("swiglu", &ops::swiglu(&x).unwrap(), &want);

        // rms_norm and add_rms_norm.
        let x = lo(&rng.tensor(&[3, 4, 256], 0.2, 3.0));
        let r = lo(&rng.tensor(&[3, 4, 256], 0.0, 1.0));
        let nw = lo(&rng.tensor(&[256], 1.0, 0.5));
        assert_rounding_matches(
            "rms_norm",
            &ops::rms_norm(&x, &nw, EPS).unwrap(),
            &rms_norm_ref(&x, &nw, EPS),
        );
        let (s, y) = ops::add_rms_norm(&x, &r, &nw, EPS).unwrap();
        let want_s = (&x + &r).unwrap();
        assert_rounding_matches("add_rms_norm (sum)", &s, &want_s);
        assert_rounding_matches("add_rms_norm (norm)", &y, &rms_norm_ref(&want_s, &nw, EPS));

        for (what, cos, sin) in [("per-row", &cos_r, &sin_r), ("shared", &cos_s, &sin_s)] {
            let qkv = lo(&rng.tensor(&[b, t, w], 0.0, 2.0));
            let bias = lo(&rng.tensor(&[w], 0.0, 0.5));
            let (c, s) = (lo(cos), lo(sin));

            // qkv_rope (Qwen2): its contract is the math in f32 from the dtype's inputs (bias
            // add and rotation unrounded), one rounding at the end.
            let cs = Tensor::cat(&[&c, &s], D::Minus1).unwrap();
            let (q, k, v) = ops::qkv_rope(&qkv, &bias, &cs, (h, kvh), d).unwrap();
            let heads = heads_ref(&f32_(&qkv), &f32_(&bias), h + 2 * kvh, d);
            let part = |st, n| heads.narrow(1, st, n).unwrap();
            let (c32, s32) = (f32_(&c), f32_(&s));
            let name = format!("qkv_rope ({what})");
            assert_rounding_matches(&name, &q, &lo(&rope_ref(&part(0, h), &c32, &s32)));
            assert_rounding_matches(&name, &k, &lo(&rope_ref(&part(h, kvh), &c32, &s32)));
            assert_rounding_matches(&name, &v, &lo(&part(h + kvh, kvh)));

            // qkv_rope with f32 tables (the vision tower, as apply_rotary_pos_emb_vision):
            // the tables unrounded, the rotation in f32 from the dtype's inputs, one rounding.
            let (c32, s32) = (f32_(cos), f32_(sin));
            let cs32 = Tensor::cat(&[&c32, &s32], D::Minus1).unwrap();
            let (q, k, v) = ops::qkv_rope(&qkv, &bias, &cs32, (h, kvh), d).unwrap();
            let name = format!("qkv_rope, f32 tables ({what})");
            assert_rounding_matches(&name, &q, &lo(&rope_ref(&part(0, h), &c32, &s32)));
            assert_rounding_matches(&name, &k, &lo(&rope_ref(&part(h, kvh), &c32, &s32)));
            assert_rounding_matches(&name, &v, &lo(&part(h + kvh, kvh)));

            // qk_norm_rope (Qwen3): bias add in the dtype, per-head norm as Qwen3RMSNorm,
            // RoPE products and sum in the dtype with the tables cast to it.
            let qw = lo(&rng.tensor(&[d], 1.0, 0.3));
            let kw = lo(&rng.tensor(&[d], 1.0, 0.3));
            let (q, k, v) =
                ops::qk_norm_rope(&qkv, &bias, &cs_of(&c, &s), &qw, &kw, EPS, (h, kvh), d).unwrap();
            let want = qk_norm_rope_ref(&qkv, &bias, &c, &s, &qw, &kw, (h, kvh), d);
            let name = format!("qk_norm_rope ({what})");
            assert_rounding_matches(&name, &q, &want[0]);
            assert_rounding_matches(&name, &k, &want[1]);
            assert_rounding_matches(&name, &v, &want[2]);
            // The bias added before the kernel (a trained bias) rounds the same way.
            let bv = Var::from_tensor(&bias).unwrap();
            let (q2, k2, v2) = ops::qk_norm_rope(
                &qkv,
                bv.as_tensor(),
                &cs_of(&c, &s),
                &qw,
                &kw,
                EPS,
                (h, kvh),
                d,
            )
            .unwrap();
            for (a, b) in [(&q, &q2), (&k, &k2), (&v, &v2)] {
                assert_eq!(max_diff(a, b), 0.0, "{name}: tracked bias path");
            }
        }
    }
}

/// Qwen3 through the fused op equals the path it replaces (head-major copy, candle's
/// rms_norm on each q and k head, candle's rope) in f32.
#[test]
fn qk_norm_rope_equals_the_composed_qwen3_path() {
    let mut rng = Rng(10);
    let (b, t, h, kvh, d) = (2, 4, 8, 2, 16);
    let w = (h + 2 * kvh) * d;
    let ((cos_r, sin_r), (cos_s, sin_s)) = per_row_and_shared(&[1, 0], t, d);
    for (cos, sin) in [(cos_r, sin_r), (cos_s, sin_s)] {
        let qkv = rng.tensor(&[b, t, w], 0.0, 2.0);
        let bias = rng.tensor(&[w], 0.0, 0.5);
        let qw = rng.tensor(&[d], 0.3, 0.1);
        let kw = rng.tensor(&[d], 1.0, 0.3);
        let heads = heads_ref(&qkv, &bias, h + 2 * kvh, d).contiguous().unwrap();
        let part = |s, n| heads.narrow(1, s, n).unwrap().contiguous().unwrap();
        let norm = |x: &Tensor, w: &Tensor| candle_nn::ops::rms_norm(x, w, EPS).unwrap();
        let want_q = candle_nn::rotary_emb::rope(&norm(&part(0, h), &qw), &cos, &sin).unwrap();
        let want_k = candle_nn::rotary_emb::rope(&norm(&part(h, kvh), &kw), &cos, &sin).unwrap();
        let (q, k, v) =
            ops::qk_norm_rope(&qkv, &bias, &cs_of(&cos, &sin), &qw, &kw, EPS, (h, kvh), d).unwrap();
        assert!(max_diff(&q, &want_q) < 1e-5, "q {}", max_diff(&q, &want_q));
        assert!(max_diff(&k, &want_k) < 1e-5, "k {}", max_diff(&k, &want_k));
        assert_eq!(max_diff(&v, &part(h + kvh, kvh)), 0.0);
        assert!(q.is_contiguous() && k.is_contiguous() && v.is_contiguous());
    }
}

/// Shapes that do not fit are errors, not panics.
#[test]
fn bad_shapes_are_errors() {
    let mut rng = Rng(11);
    let x = rng.tensor(&[2, 8], 0.0, 1.0);
    assert!(ops::rms_norm(&x, &rng.tensor(&[7], 1.0, 0.0), EPS).is_err());
    let qkv = rng.tensor(&[1, 2, 4 * 8], 0.0, 1.0);
    let bias = rng.tensor(&[32], 0.0, 1.0);
    let (c, s) = tables(&[vec![0, 1]], 8);
    let w = rng.tensor(&[8], 1.0, 0.0);
    // h + 2 kvh = 4 heads of 8: (2, 1) fits, (3, 1) does not.
    assert!(ops::qk_norm_rope(&qkv, &bias, &cs_of(&c, &s), &w, &w, EPS, (2, 1), 8).is_ok());
    assert!(ops::qk_norm_rope(&qkv, &bias, &cs_of(&c, &s), &w, &w, EPS, (3, 1), 8).is_err());
    // Tables for 3 positions where the call has 2.
    let (c3, s3) = tables(&[vec![0, 1, 2]], 8);
    assert!(ops::qk_norm_rope(&qkv, &bias, &cs_of(&c3, &s3), &w, &w, EPS, (2, 1), 8).is_err());
    assert!(ops::qk_norm_rope(
        &qkv,
        &bias,
        &cs_of(&c, &s),
        &rng.tensor(&[4], 1.0, 0.0),
        &w,
        EPS,
        (2, 1),
        8
    )
    .is_err());
}

// ---------------------------------------------------------------------------------------------
// The CUDA kernels against their CPU twins (with `--features cuda`, on a machine with a GPU).

/// Every op on `x`, on whatever device `x` lives: `x` = scores, pad (u32), swiglu input, norm
/// input, residual, norm weight, qkv, trained bias, constant bias, per-row cs, per-row cos,
/// per-row sin, shared cs, shared cos, shared sin, q_norm weight, k_norm weight.
#[cfg(feature = "cuda")]
fn every_op(
    x: &[Tensor],
    (h, kvh): (usize, usize),
    d: usize,
    (q_len, offset): (usize, usize),
) -> Vec<Tensor> {
    let rows_per_batch = x[0].dims()[1] * q_len;
    let mut out = vec![ops::masked_softmax(&x[0], &x[1], rows_per_batch, q_len, offset).unwrap()];
    out.push(ops::swiglu(&x[2]).unwrap());
    out.push(ops::rms_norm(&x[3], &x[5], EPS).unwrap());
    let (s, y) = ops::add_rms_norm(&x[3], &x[4], &x[5], EPS).unwrap();
    out.extend([s, y]);
    for (bias, cs, cos, sin) in [
        (&x[7], &x[9], &x[10], &x[11]),
        (&x[8], &x[12], &x[13], &x[14]),
    ] {
        let (q, k, v) = ops::qkv_rope(&x[6], bias, cs, (h, kvh), d).unwrap();
        out.extend([q, k, v]);
        let (q, k, v) = ops::qk_norm_rope(
            &x[6],
            bias,
            &cs_of(cos, sin),
            &x[15],
            &x[16],
            EPS,
            (h, kvh),
            d,
        )
        .unwrap();
        out.extend([q, k, v]);
    }
    out
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_kernels_match_cpu_twins() {
    let Some(gpu) = gpu_or_skip("cuda_kernels_match_cpu_twins") else {
        return;
    };
    let mut rng = Rng(12);
    // Sizes that exercise the kernels' loops: more keys than a warp, a head_dim whose half is
    // more than a warp, norm rows that are not a multiple of 32 and longer than a block, and
    // b t (h + 2 kvh) = 90 (token, head) pairs, not a multiple of qk_norm_rope's four warps a
    // block.
    let (b, t, h, kvh, d) = (2, 5, 7, 1, 128);
    let w = (h + 2 * kvh) * d;
    let (heads, q_len, offset) = (3, 4, 67);
    let pads = [0u32, 40];
    let ((cos_r, sin_r), (cos_s, sin_s)) = per_row_and_shared(&[0, 3], t, d);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let lo = |x: Tensor| x.to_dtype(dtype).unwrap();
        let cat = |c: &Tensor, s: &Tensor| lo(Tensor::cat(&[c, s], D::Minus1).unwrap());
        let cpu = vec![
            lo(rng.tensor(&[b, heads, q_len, offset + q_len], 0.0, 3.0)),
            Tensor::new(&pads, &Device::Cpu).unwrap(),
            lo(rng.tensor(&[3, 7, 2 * 1500], 0.0, 2.0)),
            lo(rng.tensor(&[3, 4, 1500], 0.2, 3.0)),
            lo(rng.tensor(&[3, 4, 1500], 0.0, 1.0)),
            lo(rng.tensor(&[1500], 1.0, 0.5)),
            lo(rng.tensor(&[b, t, w], 0.0, 2.0)),
            lo(rng.tensor(&[w], 0.0, 0.5)),
            lo(rng.tensor(&[w], 0.0, 0.5)),
            cat(&cos_r, &sin_r),
            lo(cos_r.clone()),
            lo(sin_r.clone()),
            cat(&cos_s, &sin_s),
            lo(cos_s.clone()),
            lo(sin_s.clone()),
            lo(rng.tensor(&[d], 1.0, 0.3)),
            lo(rng.tensor(&[d], 1.0, 0.3)),
        ];
        let on_gpu: Vec<Tensor> = cpu.iter().map(|x| x.to_device(&gpu).unwrap()).collect();
        let f = |x: &[Tensor]| every_op(x, (h, kvh), d, (q_len, offset));
        let (want, got) = (f(&cpu), f(&on_gpu));
        // f32: the kernels' rsqrtf/expf and reduction order against the CPU's; half types:
        // the same roundings, so rare one-ulp flips only.
        let check = |what: String, g: &Tensor, w: &Tensor| {
            let g = g.to_device(&Device::Cpu).unwrap();
            if dtype == DType::F32 {
                let (diff, scale) = (max_diff(&g, w), max_abs(w).max(1e-3));
                eprintln!("{what} f32: gpu vs cpu {diff:.2e} (scale {scale:.2e})");
                assert!(
                    diff <= 2e-5 * scale,
                    "{what} f32: gpu vs cpu {diff} (scale {scale})"
                );
            } else {
                assert_rounding_matches(&what, &g, w);
            }
        };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            check(format!("forward output {i}"), g, w);
        }
        // With the bias trained (tracked), qk_norm_rope adds it before the kernel, which then
        // runs without one.
        let tracked = |x: &[Tensor]| {
            let mut x = x.to_vec();
            x[7] = Var::from_tensor(&x[7]).unwrap().as_tensor().clone();
            f(&x)
        };
        for (i, (g, w)) in tracked(&on_gpu).iter().zip(&tracked(&cpu)).enumerate() {
            check(format!("forward output {i} (trained bias)"), g, w);
        }
        // The backward on the GPU (candle ops on CUDA) against the CPU's.
        let diff = [0, 2, 3, 4, 5, 6, 7, 15, 16];
        let rs = cotangents(&want, &mut rng);
        let rs_gpu: Vec<Tensor> = rs.iter().map(|r| r.to_device(&gpu).unwrap()).collect();
        let want = autograd(&f, &cpu, &diff, &rs);
        let got = autograd(&f, &on_gpu, &diff, &rs_gpu);
        for ((i, g), w) in diff.iter().zip(&got).zip(&want) {
            let g = g.to_device(&Device::Cpu).unwrap();
            let (d, scale) = (max_diff(&g, w), max_abs(w).max(1e-3));
            eprintln!("{dtype:?}: gradient of input {i}: gpu vs cpu {d:.2e} (scale {scale:.2e})");
            let tol = if dtype == DType::F32 {
                1e-4
            } else {
                4.0 * ulp(dtype)
            };
            assert!(
                d <= tol * scale,
                "{dtype:?}: gradient of input {i}: {d} (scale {scale})"
            );
        }
    }
}

/// `(logp, entropy)` per row of `logits` (any dtype) at temperature `t`, in f64 from the
/// logits' values: the definition `logp_entropy` computes.
fn logp_entropy_f64(logits: &Tensor, targets: &[u32], t: f64) -> (Vec<f64>, Vec<f64>) {
    let rows = logits
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec2::<f64>()
        .unwrap();
    rows.iter()
        .zip(targets)
        .map(|(row, &tg)| {
            let z: Vec<f64> = row.iter().map(|x| x / t).collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = z.iter().map(|v| (v - m).exp()).sum();
            let lse = m + s.ln();
            let h = -z.iter().map(|v| (v - lse).exp() * (v - lse)).sum::<f64>();
            (z[tg as usize] - lse, h)
        })
        .unzip()
}

#[test]
fn logp_entropy_is_the_log_softmax_at_the_target_and_the_entropy() {
    let mut rng = Rng(31);
    let (n, vocab) = (6, 3001);
    let targets: Vec<u32> = (0..n as u32)
        .map(|i| (i * 977 + 5) % vocab as u32)
        .collect();
    let tg = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let logits = rng.tensor(&[n, vocab], 0.0, 4.0).to_dtype(dtype).unwrap();
        for t in [1.0, 0.7] {
            let (logp, ent) = ops::logp_entropy(&logits, &tg, t).unwrap();
            let (want_l, want_h) = logp_entropy_f64(&logits, &targets, t);
            for (got, want) in [(logp, want_l), (ent, want_h)] {
                let got = got.to_vec1::<f32>().unwrap();
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (*g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0),
                        "{dtype:?} T={t}: {g} vs {w}"
                    );
                }
            }
        }
    }
    // A target outside the vocabulary is an error on the CPU (NaN from the kernel), not a read
    // past the row.
    let bad = Tensor::new(&[vocab as u32; 6], &Device::Cpu).unwrap();
    let logits = rng.tensor(&[n, vocab], 0.0, 1.0);
    assert!(ops::logp_entropy(&logits, &bad, 1.0).is_err());
}

#[cfg(feature = "cuda")]
#[test]
fn head_kernels_match_cpu() {
    let Some(gpu) = gpu_or_skip("head_kernels_match_cpu") else {
        return;
    };
    let mut rng = Rng(32);
    // A vocabulary longer than a block's stride many times over, and a row count that is not
    // a multiple of anything.
    let (n, vocab) = (7, 151_936);
    let targets: Vec<u32> = (0..n as u32)
        .map(|i| (i * 40_013 + 11) % vocab as u32)
        .collect();
    let tg = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    let g = rng.tensor(&[n], 0.0, 1.0);
    for dtype in [DType::F32, DType::BF16] {
        let logits = rng.tensor(&[n, vocab], 0.0, 4.0).to_dtype(dtype).unwrap();
        let on = |t: &Tensor| t.to_device(&gpu).unwrap();
        for t in [1.0, 0.7] {
            let (l_gpu, h_gpu) = ops::logp_entropy(&on(&logits), &on(&tg), t).unwrap();
            let (want_l, want_h) = logp_entropy_f64(&logits, &targets, t);
            for (what, got, want) in [("logp", l_gpu, want_l), ("entropy", h_gpu, want_h)] {
                let got = got
                    .to_device(&Device::Cpu)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                for (a, b) in got.iter().zip(&want) {
                    eprintln!("{dtype:?} T={t} {what}: gpu {a} vs f64 {b}");
                    assert!((*a as f64 - b).abs() <= 1e-4 * b.abs().max(1.0));
                }
            }
            let want = ops::logp_grad(&logits, &tg, &g, t).unwrap();
            let got = ops::logp_grad(&on(&logits), &on(&tg), &on(&g), t).unwrap();
            let got = got.to_device(&Device::Cpu).unwrap();
            if dtype == DType::F32 {
                let (d, scale) = (max_diff(&got, &want), max_abs(&want).max(1e-6));
                eprintln!("logp_grad f32 T={t}: gpu vs cpu {d:.2e} (scale {scale:.2e})");
                assert!(d <= 1e-4 * scale);
            } else {
                assert_rounding_matches(&format!("logp_grad T={t}"), &got, &want);
            }
        }
    }
}

/// The norms' one-pass kernels (rows of whole 16-byte vectors: 1, 2 and 4 vectors a thread)
/// and the scalar kernel they fall back to (a row that is not, an input that does not start
/// on a vector) against the CPU twin, with the decode shapes' rows (one to a few): RMSNorm,
/// the add + RMSNorm, and the vision tower's LayerNorm and add + LayerNorm.
#[cfg(feature = "cuda")]
#[test]
fn cuda_norm_kernels_match_their_twin_on_every_path() {
    let Some(gpu) = gpu_or_skip("cuda_norm_kernels_match_their_twin_on_every_path") else {
        return;
    };
    let mut rng = Rng(41);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // 896/1536/3584: the 0.5B/1.5B/7B hidden sizes; 12288 and 20000: two and four vectors
        // a thread (f32: four and five, so the scalar kernel); 1500: not whole vectors;
        // 1152 and 4608: the vision tower's width and its mergers' (four patches).
        for (rows, n) in [
            (1, 3584),
            (5, 1152),
            (2, 4608),
            (3, 896),
            (64, 1536),
            (2, 12288),
            (1, 20000),
            (3, 1500),
        ] {
            let lo = |x: Tensor| x.to_dtype(dtype).unwrap();
            // One spare element in front: the inputs then also run from an odd offset.
            let x = lo(rng.tensor(&[rows * n + 1], 0.2, 3.0));
            let r = lo(rng.tensor(&[rows * n + 1], 0.0, 1.0));
            let w = lo(rng.tensor(&[n], 1.0, 0.5));
            let b = lo(rng.tensor(&[n], 0.0, 0.5));
            let ln = ops::LayerNorm::new(&w, &b, EPS).unwrap();
            for skew in [0, 1] {
                let cut = |t: &Tensor| {
                    t.narrow(0, skew, rows * n)
                        .unwrap()
                        .reshape((rows, n))
                        .unwrap()
                };
                let (xc, rc) = (cut(&x), cut(&r));
                let on = |t: &Tensor| t.to_device(&gpu).unwrap();
                let want = [
                    ops::rms_norm(&xc, &w, EPS).unwrap(),
                    ops::add_rms_norm(&xc, &rc, &w, EPS).unwrap().0,
                    ops::add_rms_norm(&xc, &rc, &w, EPS).unwrap().1,
                    ln.forward(&xc).unwrap(),
                    ln.forward_add(&xc, &rc).unwrap().0,
                    ln.forward_add(&xc, &rc).unwrap().1,
                ];
                // The GPU's inputs are views into one buffer, as the CPU's are.
                let (xg, rg) = (on(&x), on(&r));
                let cut_g = |t: &Tensor| {
                    t.narrow(0, skew, rows * n)
                        .unwrap()
                        .reshape((rows, n))
                        .unwrap()
                };
                let (xg, rg, wg) = (cut_g(&xg), cut_g(&rg), on(&w));
                let (sg, yg) = ops::add_rms_norm(&xg, &rg, &wg, EPS).unwrap();
                let lng = ops::LayerNorm::new(&wg, &on(&b), EPS).unwrap();
                let (lsg, lyg) = lng.forward_add(&xg, &rg).unwrap();
                let got = [
                    ops::rms_norm(&xg, &wg, EPS).unwrap(),
                    sg,
                    yg,
                    lng.forward(&xg).unwrap(),
                    lsg,
                    lyg,
                ];
                for (what, g, w) in [
                    ("rms_norm", &got[0], &want[0]),
                    ("add (sum)", &got[1], &want[1]),
                    ("add (norm)", &got[2], &want[2]),
                    ("layer_norm", &got[3], &want[3]),
                    ("add_layer_norm (sum)", &got[4], &want[4]),
                    ("add_layer_norm (norm)", &got[5], &want[5]),
                ] {
                    let g = g.to_device(&Device::Cpu).unwrap();
                    let what = format!("{what} {rows}x{n} skew {skew}");
                    if dtype == DType::F32 {
                        let (d, scale) = (max_diff(&g, w), max_abs(w).max(1e-3));
                        eprintln!("{what} f32: gpu vs cpu {d:.2e}");
                        assert!(d <= 2e-5 * scale, "{what} f32: {d} (scale {scale})");
                    } else {
                        assert_rounding_matches(&what, &g, w);
                    }
                }
            }
        }
    }
}

/// qkv_rope with f32 tables on half-precision inputs (the vision tower's shape: head_dim 72,
/// 36 threads a head) on the GPU against its CPU twin.
#[cfg(feature = "cuda")]
#[test]
fn cuda_qkv_rope_with_f32_tables_matches_its_twin() {
    let Some(gpu) = gpu_or_skip("cuda_qkv_rope_with_f32_tables_matches_its_twin") else {
        return;
    };
    let mut rng = Rng(13);
    let (t, heads, d) = (37, 4, 72);
    let w = 3 * heads * d;
    let ((cos, sin), _) = per_row_and_shared(&[0], t, d);
    let cs = Tensor::cat(&[&cos.get(0).unwrap(), &sin.get(0).unwrap()], D::Minus1).unwrap();
    for dtype in [DType::BF16, DType::F16] {
        let qkv = rng.tensor(&[1, t, w], 0.0, 2.0).to_dtype(dtype).unwrap();
        let bias = Tensor::zeros(w, dtype, &Device::Cpu).unwrap();
        let run = |dev: &Device| {
            let (q, k, v) = ops::qkv_rope(
                &qkv.to_device(dev).unwrap(),
                &bias.to_device(dev).unwrap(),
                &cs.to_device(dev).unwrap(),
                (heads, heads),
                d,
            )
            .unwrap();
            [q, k, v].map(|x| x.to_device(&Device::Cpu).unwrap())
        };
        let (want, got) = (run(&Device::Cpu), run(&gpu));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_rounding_matches(&format!("qkv_rope f32 tables, output {i}"), g, w);
        }
    }
}

/// candle-core as patched in vendor/candle-core stores a node's first gradient instead of
/// adding it to zeros: every later contribution must still be summed, through views
/// (transpose, broadcast, narrow) and ops that hand one gradient to both sides (an addition).
/// The loss below uses `y = W x` three ways, `W` twice more and once as a transposed right-hand
/// side (`z Wᵀ`, a linear layer); its gradients have closed forms.
#[test]
fn patched_backward_sums_every_contribution() {
    let dev = Device::Cpu;
    let mut rng = Rng(11);
    let w = Var::from_tensor(&rng.tensor(&[3, 4], 0.0, 1.0)).unwrap();
    let x = Var::from_tensor(&rng.tensor(&[4, 2], 0.0, 1.0)).unwrap();
    let c = rng.tensor(&[3, 2], 0.0, 1.0);
    let (wt, xt) = (w.as_tensor(), x.as_tensor());
    // y = W x used three times: weighted by c, through its transpose weighted by cᵀ, and its
    // first row broadcast; plus W itself twice through one addition (W + W).
    let y = wt.matmul(xt).unwrap();
    let l1 = (&y * &c).unwrap().sum_all().unwrap();
    let l2 = (y.t().unwrap() * c.t().unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    let row = y.narrow(0, 0, 1).unwrap().broadcast_as((5, 2)).unwrap();
    let l3 = row.sum_all().unwrap();
    let l4 = (wt + wt).unwrap().sum_all().unwrap();
    // And W as a linear layer's transposed right-hand side (the patch's matmul path).
    let z = Var::from_tensor(&rng.tensor(&[2, 4], 0.0, 1.0)).unwrap();
    let c2 = rng.tensor(&[2, 3], 0.0, 1.0);
    let zt = z.as_tensor();
    let l5 = (zt.matmul(&wt.t().unwrap()).unwrap() * &c2)
        .unwrap()
        .sum_all()
        .unwrap();
    let loss = ((((l1 + l2).unwrap() + l3).unwrap() + l4).unwrap() + l5).unwrap();
    let g = loss.backward().unwrap();
    // dL/dy = 2c + 5 e0 (row 0 gets 5 from the broadcast); dL/dW = dL/dy xᵀ + 2 + c2ᵀ z;
    // dL/dx = Wᵀ dL/dy; dL/dz = c2 W.
    let mut e0 = vec![0f32; 6];
    e0[..2].fill(5.0);
    let dy = ((&c * 2.0).unwrap() + Tensor::from_vec(e0, (3, 2), &dev).unwrap()).unwrap();
    let dw = ((dy.matmul(&xt.t().unwrap()).unwrap() + 2.0).unwrap()
        + c2.t().unwrap().matmul(zt).unwrap())
    .unwrap();
    let dx = wt.t().unwrap().matmul(&dy).unwrap();
    let dz = c2.matmul(wt).unwrap();
    let gw = g.get(wt).unwrap();
    assert!(
        gw.is_contiguous(),
        "a weight's gradient comes back contiguous"
    );
    for (name, got, want) in [
        ("W", gw, &dw),
        ("x", g.get(xt).unwrap(), &dx),
        ("z", g.get(zt).unwrap(), &dz),
    ] {
        let err = max_diff(got, want);
        assert!(err < 1e-5, "d loss / d {name}: max error {err}");
    }
}

/// The patched narrow backward (vendor/candle-core, `accumulate_narrow`): a stacked tensor
/// read through disjoint narrows (as a multi-output op's outputs are) gets each narrow's
/// gradient copied into its range of one zeroed tensor; narrows that overlap, narrows along
/// another dimension, and a contribution from another op are still added. Each case against
/// the closed form (the narrows' weights in their ranges, summed), in f32 and bf16.
#[test]
fn patched_narrow_backward_sums_every_contribution() {
    let dev = Device::Cpu;
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    // (case, narrows (dim, start, len), where the whole tensor's other use joins the loss).
    let cases = [
        ("disjoint", vec![(0, 0, 1), (0, 2, 2), (0, 1, 1)], None),
        ("overlapping", vec![(0, 0, 2), (0, 1, 2)], None),
        ("same range twice", vec![(1, 0, 2), (1, 0, 2)], None),
        ("two dimensions", vec![(0, 0, 2), (2, 1, 3)], None),
        ("another op first", vec![(0, 0, 1), (0, 1, 3)], Some(0)),
        ("another op between", vec![(0, 0, 1), (0, 1, 3)], Some(1)),
        ("another op last", vec![(0, 0, 1), (0, 1, 3)], Some(2)),
    ];
    for dtype in [DType::F32, DType::BF16] {
        for (what, narrows, whole) in &cases {
            let mut rng = Rng(29);
            let s = Var::from_tensor(&rng.tensor(&[4, 3, 5], 0.0, 1.0).to_dtype(dtype).unwrap())
                .unwrap();
            let st = s.as_tensor();
            let c: Vec<Tensor> = (0..=narrows.len())
                .map(|_| rng.tensor(&[4, 3, 5], 0.0, 1.0).to_dtype(dtype).unwrap())
                .collect();
            let mut loss = Tensor::zeros((), DType::F32, &dev).unwrap();
            let mut want = Tensor::zeros((4, 3, 5), DType::F32, &dev).unwrap();
            let other = c[narrows.len()].clone();
            for (k, &(dim, start, len)) in narrows.iter().enumerate() {
                if *whole == Some(k) {
                    loss = (loss + f(&(st * &other).unwrap()).sum_all().unwrap()).unwrap();
                    want = (want + f(&other)).unwrap();
                }
                let w = c[k].narrow(dim, start, len).unwrap();
                let l = (st.narrow(dim, start, len).unwrap() * &w).unwrap();
                loss = (loss + f(&l).sum_all().unwrap()).unwrap();
                let placed = Tensor::zeros((4, 3, 5), DType::F32, &dev).unwrap();
                placed
                    .slice_set(&f(&w).contiguous().unwrap(), dim, start)
                    .unwrap();
                want = (want + placed).unwrap();
            }
            if *whole == Some(narrows.len()) {
                loss = (loss + f(&(st * &other).unwrap()).sum_all().unwrap()).unwrap();
                want = (want + f(&other)).unwrap();
            }
            let g = loss.backward().unwrap();
            let err = max_diff(&f(g.get(st).unwrap()), &want);
            // bf16: where two weights meet, their sum is rounded to bf16.
            let tol = if dtype == DType::F32 || *what == "disjoint" {
                0.0
            } else {
                2e-2
            };
            assert!(err <= tol, "{what} {dtype:?}: max error {err}");
        }
    }
}

/// The weight gradient added by the GEMM (`add_matmul_tn_`, cuBLASLt with `beta = 1`) on the
/// GPU against its CPU twin, into a view of a larger buffer as the gradient sums are, at the
/// vocabulary projection's shape (a chunk of 441 token rows, a 1536-wide hidden state) and a
/// small odd one; nothing outside the view changes.
#[cfg(feature = "cuda")]
#[test]
fn cuda_add_matmul_tn_matches_its_twin() {
    let Some(gpu) = gpu_or_skip("cuda_add_matmul_tn_matches_its_twin") else {
        return;
    };
    let mut rng = Rng(77);
    for dtype in [DType::BF16, DType::F16] {
        for (k, m, n) in [(441, 4096, 1536), (7, 24, 40)] {
            let lo = |x: Tensor| x.to_dtype(dtype).unwrap();
            let a = lo(rng.tensor(&[k, m], 0.0, 0.05));
            let b = lo(rng.tensor(&[k, n], 0.0, 1.0));
            let start = lo(rng.tensor(&[m * n], 0.0, 0.5));
            // The sum sits 8 elements into its buffer (16 bytes), as a later parameter's slot.
            let buffer = |dev: &Device| {
                let buf = Tensor::zeros(8 + m * n + 8, dtype, dev).unwrap();
                buf.slice_set(&start.to_device(dev).unwrap(), 0, 8).unwrap();
                buf
            };
            let (cpu_buf, gpu_buf) = (buffer(&Device::Cpu), buffer(&gpu));
            let view = |t: &Tensor| t.narrow(0, 8, m * n).unwrap().reshape((m, n)).unwrap();
            let on = |t: &Tensor| t.to_device(&gpu).unwrap();
            ops::add_matmul_tn_(&view(&cpu_buf), &a, &b).unwrap();
            assert!(ops::add_matmul_tn_supported(
                &view(&gpu_buf),
                &on(&a),
                &on(&b)
            ));
            ops::add_matmul_tn_(&view(&gpu_buf), &on(&a), &on(&b)).unwrap();
            let got = gpu_buf.to_device(&Device::Cpu).unwrap();
            let what = format!("add_matmul_tn_ {k}x{m}x{n}");
            // For the record: how many equal the sum rounded once (the product not rounded).
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let once = (f(&start).reshape((m, n)).unwrap()
                + f(&a).t().unwrap().matmul(&f(&b)).unwrap())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
            let same = (f(&view(&got)) - f(&once))
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .filter(|d| **d == 0.0)
                .count();
            eprintln!(
                "{what} {dtype:?}: {same}/{} equal to the sum rounded once",
                m * n
            );
            assert_rounding_matches(&what, &view(&got), &view(&cpu_buf));
            for edge in [0, 8 + m * n] {
                let e: Vec<f32> = got
                    .narrow(0, edge, 8)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                assert_eq!(e, vec![0.0; 8], "{what}: written outside the view");
            }
        }
    }
}

/// The training passes' attention on the GPU: the flash kernel's forward with its backward
/// (`attention::flash_backward`) against candle's autograd through the unfused path, in bf16,
/// at the 1.5B's heads (12 of 128, 2 KV heads) and the 0.5B's (14 of 64), causal, one row
/// left-padded. The outputs differ by the kernels' roundings; the gradients recompute the same
/// probabilities with the same kernels.
#[cfg(feature = "cuda")]
#[test]
fn cuda_flash_attention_backward_matches_the_unfused_autograd() {
    use fleet_models::attention;
    let Some(gpu) = gpu_or_skip("cuda_flash_attention_backward_matches_the_unfused_autograd")
    else {
        return;
    };
    let mut rng = Rng(91);
    for (h, kvh, d) in [(12, 2, 128), (14, 2, 64)] {
        let (b, l) = (2, 80);
        let scale = (d as f32).powf(-0.5);
        let on = |t: Tensor| t.to_dtype(DType::BF16).unwrap().to_device(&gpu).unwrap();
        let q = on(rng.tensor(&[b, h, l, d], 0.0, scale));
        let k = on(rng.tensor(&[b, kvh, l, d], 0.0, 1.0));
        let v = on(rng.tensor(&[b, kvh, l, d], 0.0, 1.0));
        let g = rng.tensor(&[b, h, l, d], 0.0, 1.0).to_device(&gpu).unwrap();
        let mask = attention::Mask {
            causal: true,
            key_start: Some(Tensor::new(&[0u32, 5], &gpu).unwrap()),
        };
        // `token_major`: the decoder's entry (`attend_token_major`, no transposes recorded),
        // brought back to head-major for the comparison.
        let run = |fused: bool, token_major: bool| {
            let (qv, kv, vv) = (
                Var::from_tensor(&q).unwrap(),
                Var::from_tensor(&k).unwrap(),
                Var::from_tensor(&v).unwrap(),
            );
            let (qt, kt, vt) = (qv.as_tensor(), kv.as_tensor(), vv.as_tensor());
            let out = if token_major {
                attention::attend_token_major(qt, kt, vt, 1.0, &mask, fused)
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap()
            } else {
                attention::attend(qt, kt, vt, 1.0, &mask, fused, None).unwrap()
            };
            let loss = (out.to_dtype(DType::F32).unwrap() * &g)
                .unwrap()
                .sum_all()
                .unwrap();
            let grads = loss.backward().unwrap();
            let grad = |v: &Var| grads.get(v.as_tensor()).unwrap().clone();
            [out, grad(&qv), grad(&kv), grad(&vv)]
        };
        assert!(attention::supported(&q.transpose(1, 2).unwrap()));
        let unfused = run(false, false);
        for (entry, flash) in [
            ("attend", run(true, false)),
            ("token-major", run(true, true)),
        ] {
            for (what, a, w) in [
                ("out", &flash[0], &unfused[0]),
                ("dq", &flash[1], &unfused[1]),
                ("dk", &flash[2], &unfused[2]),
                ("dv", &flash[3], &unfused[3]),
            ] {
                let (diff, scale) = (max_diff(a, w), max_abs(w).max(1e-3));
                eprintln!("flash backward ({entry}) h{h} d{d} {what}: {diff:.2e} of {scale:.2e}");
                assert!(
                    diff <= 2e-2 * scale,
                    "{entry} h{h} d{d} {what}: {diff} (scale {scale})"
                );
            }
        }
    }
}

/// qkv_rope's fused backward (on by default; forced here) on the GPU: the kernel against its CPU
/// twin (1.5B heads, shared and per-row tables), then the op's gradients with the kernel
/// against the composed backward on the same GPU.
#[cfg(feature = "cuda")]
#[test]
fn cuda_qkv_rope_fused_backward_matches_twin_and_composed() {
    let Some(gpu) = gpu_or_skip("cuda_qkv_rope_fused_backward_matches_twin_and_composed") else {
        return;
    };
    let mut rng = Rng(57);
    let (b, t, h, kvh, d) = (2, 67, 12, 2, 128);
    let w = (h + 2 * kvh) * d;
    let grad = rng
        .tensor(&[b * t * w], 0.0, 1.0)
        .to_dtype(DType::BF16)
        .unwrap();
    let angles = rng.tensor(&[b, t, d / 2], 0.0, 2.0);
    let per_row = Tensor::cat(&[angles.cos().unwrap(), angles.sin().unwrap()], 2)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let shared = per_row.get(0).unwrap();
    for (what, cs) in [("per-row", &per_row), ("shared", &shared)] {
        let want = ops::qkv_rope_backward(&grad, cs, (b, t), (h, kvh), d).unwrap();
        let got = ops::qkv_rope_backward(
            &grad.to_device(&gpu).unwrap(),
            &cs.to_device(&gpu).unwrap(),
            (b, t),
            (h, kvh),
            d,
        )
        .unwrap()
        .to_device(&Device::Cpu)
        .unwrap();
        let (diff, scale) = (max_diff(&got, &want), max_abs(&want));
        eprintln!("qkv_rope_bwd {what}: gpu vs twin {diff:.2e} of {scale:.2e}");
        assert!(diff <= 1e-5 * scale, "{what}: {diff}");
    }
    // Through the op: the gradients of qkv and the bias, fused against composed.
    let qkv = rng
        .tensor(&[b, t, w], 0.0, 1.0)
        .to_dtype(DType::BF16)
        .unwrap();
    let bias = rng.tensor(&[w], 0.0, 0.1).to_dtype(DType::BF16).unwrap();
    let cot = rng.tensor(&[b * t * w], 0.0, 1.0).to_device(&gpu).unwrap();
    let run = |fused: bool| {
        ops::set_qkv_rope_fused_backward(Some(fused));
        let qv = Var::from_tensor(&qkv.to_device(&gpu).unwrap()).unwrap();
        let bv = Var::from_tensor(&bias.to_device(&gpu).unwrap()).unwrap();
        let cs = per_row.to_device(&gpu).unwrap();
        let (q, k, v) = ops::qkv_rope(qv.as_tensor(), bv.as_tensor(), &cs, (h, kvh), d).unwrap();
        let flat = Tensor::cat(
            &[
                q.flatten_all().unwrap(),
                k.flatten_all().unwrap(),
                v.flatten_all().unwrap(),
            ],
            0,
        )
        .unwrap();
        let loss = (flat.to_dtype(DType::F32).unwrap() * &cot)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        ops::set_qkv_rope_fused_backward(None);
        [
            grads.get(qv.as_tensor()).unwrap().clone(),
            grads.get(bv.as_tensor()).unwrap().clone(),
        ]
    };
    let (fused, composed) = (run(true), run(false));
    for (what, a, c) in [
        ("dqkv", &fused[0], &composed[0]),
        ("dbias", &fused[1], &composed[1]),
    ] {
        let (a, c) = (
            a.to_device(&Device::Cpu).unwrap(),
            c.to_device(&Device::Cpu).unwrap(),
        );
        assert_rounding_matches(&format!("qkv_rope backward {what}"), &a, &c);
    }
}

/// The embedding-gradient kernel on the GPU against its CPU twin, bit for bit (the same sums in
/// the same order): a bf16 sum with a bf16 gradient and an f32 sum with an f32 one, token ids
/// repeated as a batch repeats them.
#[cfg(feature = "cuda")]
#[test]
fn cuda_embedding_grad_add_matches_its_twin() {
    let Some(gpu) = gpu_or_skip("cuda_embedding_grad_add_matches_its_twin") else {
        return;
    };
    let mut rng = Rng(63);
    let (vocab, hs, n) = (1000, 1536, 700);
    let ids: Vec<u32> = (0..n)
        .map(|j| ((j * 37 + j / 5) % 211) as u32 * 4)
        .collect();
    for dtype in [DType::BF16, DType::F32] {
        let start = rng.tensor(&[vocab, hs], 0.0, 1.0).to_dtype(dtype).unwrap();
        let g = rng.tensor(&[n, hs], 0.0, 1.0).to_dtype(dtype).unwrap();
        let cpu = start.copy().unwrap();
        ops::embedding_grad_add_(&cpu, &g, &ids).unwrap();
        let on_gpu = start.to_device(&gpu).unwrap();
        ops::embedding_grad_add_(&on_gpu, &g.to_device(&gpu).unwrap(), &ids).unwrap();
        let diff = max_diff(&on_gpu.to_device(&Device::Cpu).unwrap(), &cpu);
        eprintln!("embedding_grad_add_ {dtype:?}: gpu vs twin {diff:.2e}");
        assert_eq!(diff, 0.0, "{dtype:?}");
    }
}

/// The stacking kernel on the GPU against candle's cast, affine and cat (its reference) on the
/// GPU, bit for bit, forward and backward: the 1.5B's q/k/v weights with the attention scale
/// folded into q (whole 16-byte vectors), their biases (parts of 1,536 and 256 elements, and
/// an odd-length case that takes the element-wise kernel), gate/up without a scale, in bf16
/// and f32.
#[cfg(feature = "cuda")]
#[test]
fn cuda_concat_rows_matches_cast_affine_and_cat() {
    let Some(gpu) = gpu_or_skip("cuda_concat_rows_matches_cast_affine_and_cat") else {
        return;
    };
    let mut rng = Rng(71);
    let scale = Some(1.0 / (128f64).sqrt());
    let cases = [
        (
            "qkv weights",
            vec![vec![1536, 1536], vec![256, 1536], vec![256, 1536]],
            scale,
        ),
        ("qkv biases", vec![vec![1536], vec![256], vec![256]], scale),
        (
            "odd lengths",
            vec![vec![13, 3], vec![5, 3], vec![7, 3]],
            scale,
        ),
        ("gate/up", vec![vec![1200, 896], vec![1200, 896]], None),
        ("two odd parts", vec![vec![9], vec![4]], Some(0.3)),
    ];
    for dtype in [DType::BF16, DType::F32] {
        for (what, shapes, s) in &cases {
            let vars: Vec<Var> = shapes
                .iter()
                .map(|sh| {
                    Var::from_tensor(
                        &rng.tensor(sh, 0.0, 1.0)
                            .to_dtype(dtype)
                            .unwrap()
                            .to_device(&gpu)
                            .unwrap(),
                    )
                    .unwrap()
                })
                .collect();
            let parts: Vec<&Tensor> = vars.iter().map(Var::as_tensor).collect();
            let run = |kernel: bool| {
                ops::set_concat_rows_kernel(Some(kernel));
                let out = ops::concat_rows(&parts, *s).unwrap();
                ops::set_concat_rows_kernel(None);
                // A loss whose gradient differs per element.
                let w = rng_free_weights(out.dims(), dtype, &gpu);
                let grads = (out.to_dtype(DType::F32).unwrap() * w.to_dtype(DType::F32).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let gs: Vec<Tensor> = parts
                    .iter()
                    .map(|p| grads.get(p).unwrap().clone())
                    .collect();
                (out, gs)
            };
            let (k_out, k_grads) = run(true);
            let (r_out, r_grads) = run(false);
            let diff = max_diff(
                &k_out.to_device(&Device::Cpu).unwrap(),
                &r_out.to_device(&Device::Cpu).unwrap(),
            );
            eprintln!("concat_rows {what} {dtype:?}: kernel vs reference {diff:.2e}");
            assert_eq!(diff, 0.0, "{what} {dtype:?} forward");
            for (i, (a, b)) in k_grads.iter().zip(&r_grads).enumerate() {
                let d = max_diff(
                    &a.to_device(&Device::Cpu).unwrap(),
                    &b.to_device(&Device::Cpu).unwrap(),
                );
                assert_eq!(d, 0.0, "{what} {dtype:?} gradient of part {i}");
            }
        }
    }
}

/// Deterministic weights of `shape` (a ramp), for a loss with a different gradient per element.
#[cfg(feature = "cuda")]
fn rng_free_weights(shape: &[usize], dtype: DType, dev: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(dev)
        .unwrap()
}

/// The RMSNorm backward's one-pass vector rows kernel (the default; `FLEET_NORM_BWD_VEC=0` off)
/// against the scalar rows kernel on the GPU, through both ops (RMSNorm, and the residual add
/// with the RMSNorm after it, whose sum's gradient the kernel adds): the gradients of the
/// input(s) and the weight, at the 0.5B/1.5B/7B hidden sizes, the vision width, two vectors a
/// thread, a row too wide for two (20000 bf16: the scalar kernel, since four vectors a thread
/// need more registers than a block has — the launch failed on an H200), and a width of no
/// whole vectors (the scalar kernel either way). The two sum in other
/// orders: f32 within 1e-5 of the scale, bf16 within one rounding (2⁻⁷ of the scale).
#[cfg(feature = "cuda")]
#[test]
fn cuda_norm_backward_vector_kernel_matches_the_scalar_kernel() {
    let Some(gpu) = gpu_or_skip("cuda_norm_backward_vector_kernel_matches_the_scalar_kernel")
    else {
        return;
    };
    let mut rng = Rng(43);
    for dtype in [DType::F32, DType::BF16] {
        for (rows, n) in [
            (64, 1536),
            (3, 896),
            (2, 3584),
            (5, 1152),
            (2, 12288),
            (1, 20000),
            (3, 1500),
        ] {
            let on = |t: Tensor| t.to_dtype(dtype).unwrap().to_device(&gpu).unwrap();
            let x = on(rng.tensor(&[rows, n], 0.2, 3.0));
            let h = on(rng.tensor(&[rows, n], 0.0, 1.0));
            let w = on(rng.tensor(&[n], 1.0, 0.5));
            let c = on(rng.tensor(&[rows, n], 0.0, 1.0));
            let c2 = on(rng.tensor(&[rows, n], 0.0, 1.0));
            let grads = |vector: bool| {
                ops::set_norm_backward_vector_kernel(Some(vector));
                let (xv, hv, wv) = (
                    Var::from_tensor(&x).unwrap(),
                    Var::from_tensor(&h).unwrap(),
                    Var::from_tensor(&w).unwrap(),
                );
                let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                let y = ops::rms_norm(xv.as_tensor(), wv.as_tensor(), EPS).unwrap();
                let (s, z) =
                    ops::add_rms_norm(xv.as_tensor(), hv.as_tensor(), wv.as_tensor(), EPS).unwrap();
                let loss = ((f(&(y * &c).unwrap()).sum_all().unwrap()
                    + f(&(z * &c2).unwrap()).sum_all().unwrap())
                .unwrap()
                    + f(&(s * &c).unwrap()).sum_all().unwrap())
                .unwrap();
                let g = loss.backward().unwrap();
                ops::set_norm_backward_vector_kernel(None);
                [xv, hv, wv].map(|v| {
                    g.get(v.as_tensor())
                        .unwrap()
                        .to_device(&Device::Cpu)
                        .unwrap()
                })
            };
            let (vec, scalar) = (grads(true), grads(false));
            for (what, a, b) in [
                ("dx", &vec[0], &scalar[0]),
                ("dh", &vec[1], &scalar[1]),
                ("dw", &vec[2], &scalar[2]),
            ] {
                let (d, scale) = (max_diff(a, b), max_abs(b).max(1e-3));
                let tol = if dtype == DType::F32 {
                    1e-5
                } else {
                    1.0 / 128.0
                };
                eprintln!("norm backward {what} {rows}x{n} {dtype:?}: vector vs scalar {d:.2e} (scale {scale:.2e})");
                assert!(
                    d <= tol * scale,
                    "{what} {rows}x{n} {dtype:?}: {d} (scale {scale})"
                );
            }
        }
    }
}

/// `transpose12`'s kernel on the GPU against candle's transpose and copy, element for element:
/// the training attention's gradient shape (token-major, heads of 128 and 64), a view that
/// starts inside its buffer, and a width of no whole vectors (candle's copy either way).
#[cfg(feature = "cuda")]
#[test]
fn cuda_transpose12_matches_candles_copy() {
    let Some(gpu) = gpu_or_skip("cuda_transpose12_matches_candles_copy") else {
        return;
    };
    let mut rng = Rng(47);
    for dtype in [DType::BF16, DType::F32] {
        for dims in [[4, 300, 12, 128], [2, 77, 14, 64], [3, 5, 7, 9]] {
            let n: usize = dims.iter().product();
            let flat = rng
                .tensor(&[n + 8], 0.0, 1.0)
                .to_dtype(dtype)
                .unwrap()
                .to_device(&gpu)
                .unwrap();
            let x = flat
                .narrow(0, 8, n)
                .unwrap()
                .reshape(dims.as_slice())
                .unwrap();
            ops::set_transpose12_kernel(Some(true));
            let got = ops::transpose12(&x).unwrap();
            ops::set_transpose12_kernel(None);
            let want = x.transpose(1, 2).unwrap().contiguous().unwrap();
            assert_eq!(got.dims(), want.dims());
            let d = max_diff(
                &got.to_device(&Device::Cpu).unwrap(),
                &want.to_device(&Device::Cpu).unwrap(),
            );
            eprintln!("transpose12 {dims:?} {dtype:?}: kernel vs candle {d:.2e}");
            assert_eq!(d, 0.0, "{dims:?} {dtype:?}");
        }
    }
}

/// candle's `copy2d` on the GPU (as patched: one contiguous run is a memcpy unless
/// `FLEET_COPY2D_MEMCPY=0`, else the published kernel) against the CPU's, element for element:
/// `cat` along the first dimension of views that start inside their buffers (contiguous runs),
/// `slice_set` of a block into a buffer at an offset, and `cat` along the last dimension (a
/// strided copy, the kernel either way), in bf16, f32 and u32.
#[cfg(feature = "cuda")]
#[test]
fn cuda_copy2d_matches_the_cpu() {
    let Some(gpu) = gpu_or_skip("cuda_copy2d_matches_the_cpu") else {
        return;
    };
    let mut rng = Rng(53);
    for dtype in [DType::BF16, DType::F32, DType::U32] {
        let make = |rng: &mut Rng, n: usize| {
            let t = rng.tensor(&[n], 0.0, 100.0).abs().unwrap();
            t.to_dtype(dtype).unwrap()
        };
        let a = make(&mut rng, 3 * 37 + 5);
        let b = make(&mut rng, 2 * 37 + 1);
        let view = |t: &Tensor, skip: usize, rows: usize| {
            t.narrow(0, skip, rows * 37)
                .unwrap()
                .reshape((rows, 37))
                .unwrap()
        };
        let ops_on = |a: &Tensor, b: &Tensor| {
            let (va, vb) = (view(a, 5, 3), view(b, 1, 2));
            let rows = Tensor::cat(&[&va, &vb], 0).unwrap();
            let cols = Tensor::cat(&[&va.narrow(0, 0, 2).unwrap(), &vb], 1).unwrap();
            let buf = Tensor::zeros((7, 37), dtype, a.device()).unwrap();
            buf.slice_set(&vb.contiguous().unwrap(), 0, 4).unwrap();
            [rows, cols, buf].map(|t| {
                t.to_device(&Device::Cpu)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
            })
        };
        let want = ops_on(&a, &b);
        let got = ops_on(&a.to_device(&gpu).unwrap(), &b.to_device(&gpu).unwrap());
        for (what, g, w) in [
            ("cat rows", &got[0], &want[0]),
            ("cat columns", &got[1], &want[1]),
            ("slice_set", &got[2], &want[2]),
        ] {
            assert_eq!(max_diff(g, w), 0.0, "{what} {dtype:?}");
        }
    }
}

/// FlashAttention-3's forward (feature `fa3`, `FLEET_FA3`) against fleet's flash kernel on the
/// GPU, bf16: at head dim 128 a causal GQA prefill (group 4), a causal continuation whose keys
/// run past the queries (group 7: the last query sees every key) and a non-causal batch of
/// whole sequences; at head dim 72 (zero-padded to 128) the vision tower's shape. The
/// non-causal inputs are views of one fused projection, as the tower's are. The two sum in
/// other orders: within 2e-2 of the scale.
#[cfg(feature = "fa3")]
#[test]
fn cuda_fa3_matches_the_flash_kernel() {
    use fleet_models::attention::{flash_attention, set_fa3, Mask};
    let Some(gpu) = gpu_or_skip("cuda_fa3_matches_the_flash_kernel") else {
        return;
    };
    let mut rng = Rng(53);
    for (b, q_len, kv_len, heads, kv_heads, d, causal) in [
        (2, 300, 300, 32, 8, 128, true),
        (1, 64, 320, 28, 4, 128, true),
        (4, 1024, 1024, 16, 16, 128, false),
        (2, 4096, 4096, 16, 16, 72, false),
    ] {
        let on = |t: Tensor| t.to_dtype(DType::BF16).unwrap().to_device(&gpu).unwrap();
        let (q, k, v) = if heads == kv_heads && q_len == kv_len {
            // As the vision tower hands them over: views of one fused projection
            // `[b, len, 3, heads, d]`, not contiguous.
            let qkv = on(rng.tensor(&[b, q_len, 3, heads, d], 0.0, 1.0));
            let part = |i| qkv.narrow(2, i, 1).unwrap().squeeze(2).unwrap();
            (part(0), part(1), part(2))
        } else {
            (
                on(rng.tensor(&[b, q_len, heads, d], 0.0, 1.0)),
                on(rng.tensor(&[b, kv_len, kv_heads, d], 0.0, 1.0)),
                on(rng.tensor(&[b, kv_len, kv_heads, d], 0.0, 1.0)),
            )
        };
        let mask = Mask {
            causal,
            key_start: None,
        };
        let run = |fa3: bool| {
            set_fa3(Some(fa3));
            let out = flash_attention(&q, &k, &v, 0.088, &mask).unwrap();
            set_fa3(None);
            out.to_dtype(DType::F32)
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap()
        };
        let (fa3, fleet) = (run(true), run(false));
        let (diff, scale) = (max_diff(&fa3, &fleet), max_abs(&fleet).max(1e-3));
        eprintln!(
            "fa3 vs fleet b{b} q{q_len} kv{kv_len} h{heads}/{kv_heads} d{d} causal {causal}: \
             {diff:.2e} (scale {scale:.2e})"
        );
        assert!(diff <= 2e-2 * scale, "d{d}: {diff} (scale {scale})");
    }
}
