//! Rotary position embeddings' host-side tables, shared by the text decoder (1-D positions,
//! M-RoPE's three axes) and the vision tower (a patch's row and column): the frequencies and
//! the cos/sin of every index, in f32 as transformers computes them.

/// `1 / theta^(2i / dim)` for `i < dim / 2`: the power in f64, rounded to f32, the reciprocal in
/// f32 (transformers' `inv_freq`, `dim` the rotated width: a text head's dimension, half of a
/// vision head's).
pub(crate) fn inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / dim as f64) as f32)
        .collect()
}

/// `(cos, sin)` of `index * f` (f32) for every index below `n` and every frequency, row-major
/// `[n, inv_freq.len()]`.
pub(crate) fn angle_tables(n: usize, inv_freq: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut cos = Vec::with_capacity(n * inv_freq.len());
    let mut sin = Vec::with_capacity(n * inv_freq.len());
    for index in 0..n {
        for &f in inv_freq {
            let angle = index as f32 * f;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    (cos, sin)
}
