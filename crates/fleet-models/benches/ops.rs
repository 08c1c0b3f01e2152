//! The CPU twins of the fused ops (`fleet_models::ops`), at the shapes of a Qwen2.5-0.5B
//! decoder (hidden 896, 14 query heads and 2 KV heads of 64, intermediate 4864, vocab 151,936):
//! a decode step of 8 rows and a prefill of 1 row x 128 tokens. The twins are what the CPU path
//! runs and what the parity tests check the GPU kernels against.

use candle_core::{DType, Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use fleet_models::ops;
use std::hint::black_box;

const HIDDEN: usize = 896;
const HEADS: (usize, usize) = (14, 2);
const HEAD_DIM: usize = 64;
const INTERMEDIATE: usize = 4864;
const VOCAB: usize = 151_936;
const EPS: f32 = 1e-6;

fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

fn bench(c: &mut Criterion) {
    let (h, kvh) = HEADS;
    let qkv_width = (h + 2 * kvh) * HEAD_DIM;
    for (name, b, t) in [("decode 8x1", 8, 1), ("prefill 1x128", 1, 128)] {
        let tokens = b * t;
        let x = randn(&[b, t, HIDDEN]);
        let res = randn(&[b, t, HIDDEN]);
        let w = randn(&[HIDDEN]);
        c.bench_function(&format!("ops/rms_norm/{name}"), |bn| {
            bn.iter(|| ops::rms_norm(black_box(&x), &w, EPS).unwrap())
        });
        c.bench_function(&format!("ops/add_rms_norm/{name}"), |bn| {
            bn.iter(|| ops::add_rms_norm(black_box(&x), &res, &w, EPS).unwrap())
        });
        let gate_up = randn(&[b, t, 2 * INTERMEDIATE]);
        c.bench_function(&format!("ops/swiglu/{name}"), |bn| {
            bn.iter(|| ops::swiglu(black_box(&gate_up)).unwrap())
        });
        let qkv = randn(&[b, t, qkv_width]);
        let bias = randn(&[qkv_width]);
        let cs = randn(&[t, HEAD_DIM]);
        let norm_w = randn(&[HEAD_DIM]);
        c.bench_function(&format!("ops/qkv_rope/{name}"), |bn| {
            bn.iter(|| ops::qkv_rope(black_box(&qkv), &bias, &cs, HEADS, HEAD_DIM).unwrap())
        });
        c.bench_function(&format!("ops/qk_norm_rope/{name}"), |bn| {
            bn.iter(|| {
                ops::qk_norm_rope(
                    black_box(&qkv),
                    &bias,
                    &cs,
                    &norm_w,
                    &norm_w,
                    EPS,
                    HEADS,
                    HEAD_DIM,
                )
                .unwrap()
            })
        });
        // Scores of a decode step against 512 cached keys, or of the prefill against itself.
        let kv_len = if t == 1 { 512 } else { t };
        let scores = randn(&[b, kvh, h / kvh * t, kv_len]);
        let pad = Tensor::zeros(b, DType::U32, &Device::Cpu).unwrap();
        c.bench_function(&format!("ops/masked_softmax/{name}"), |bn| {
            bn.iter(|| ops::masked_softmax(black_box(&scores), &pad, h * t, t, kv_len - t).unwrap())
        });
        let logits = randn(&[tokens, VOCAB]);
        let targets = Tensor::zeros(tokens, DType::U32, &Device::Cpu).unwrap();
        c.bench_function(&format!("ops/logp_entropy/{name}"), |bn| {
            bn.iter(|| ops::logp_entropy(black_box(&logits), &targets, 1.0).unwrap())
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
