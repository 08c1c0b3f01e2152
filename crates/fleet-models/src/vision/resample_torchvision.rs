//! torchvision's antialiased bicubic resize of 8-bit images, reproduced bit for bit.
//!
//! transformers' default image processor for Qwen2-VL / Qwen3-VL (`Qwen2VLImageProcessor`, the
//! torchvision backend) resizes the uint8 CHW tensor with
//! `torchvision.transforms.v2.functional.resize(img, [h, w], BICUBIC, antialias=True)`. On the
//! CPU, torchvision 0.26 passes uint8 straight to `torch.nn.functional.interpolate`
//! (`_do_native_uint8_resize_on_cpu` is true for bicubic, `transforms/v2/functional/
//! _geometry.py`: no cast to float, no round or clamp in Python), which runs ATen's
//! `_upsample_bicubic2d_aa` CPU kernel (`aten/src/ATen/native/cpu/UpSampleKernel.cpp`; the AVX2
//! build with at most 4 channels takes the Pillow-SIMD-derived `UpSampleKernelAVXAntialias.h`,
//! the others the generic separable kernel; both compute the same integers). The algorithm:
//!
//! - per axis, `scale = in / out` (f64); `support = 2 * max(scale, 1)`; for output index `i`,
//!   `center = scale * (i + 0.5)`, taps `xmin = max(trunc(center - support + 0.5), 0)` to
//!   `min(trunc(center + support + 0.5), in)` (at most `2 * ceil(support) + 1` of them), weight
//!   `w_j = k((j + xmin - center + 0.5) / max(scale, 1))` with Keys' cubic kernel of `a = -0.5`
//!   (written as ATen writes it), each divided by the taps' sum: the same taps as Pillow's;
//! - the weights become int16 with a precision chosen **per axis and size** (unlike Pillow's
//!   fixed 22 bits): the largest normalised weight `w_max` of the axis gives
//!   `p = min(22, the first p >= 0 with trunc(0.5 + w_max * 2^(p + 1)) >= 2^15)`, and each
//!   weight is `trunc(w * 2^p ± 0.5)` (away from zero);
//! - one pass per axis on uint8 pixels, the **horizontal pass first** whenever the width
//!   changes, then the vertical one (Pillow 13 sometimes runs the vertical first); each output
//!   is `clamp((2^(p - 1) + Σ pixel * weight) >> p, 0, 255)` in i32;
//! - equal sizes return the input unchanged (torchvision returns before interpolating).
//!
//! The two resizes differ where the weights' precision rounds differently and where Pillow
//! runs the vertical pass first: one uint8 level on a fraction of the pixels. This module is
//! written from that description (not a copy of ATen's code); `tests/vision_preprocess.rs`
//! checks it against transformers 5.17 / torch 2.11.0 / torchvision 0.26.0 goldens exactly.
//! When it was written it also equalled torch's output on 250 random cases (inputs of 1 to 399
//! pixels a side, outputs from 1 pixel to 4x larger, noise, binary and gradient images), and
//! torch's output was the same under each of ATen's CPU capabilities (`ATEN_CPU_CAPABILITY`
//! default, avx2, avx512).

/// The largest weight precision ATen tries (the loop stops before 22 bits).
const MAX_PRECISION: u32 = 22;

/// Keys' cubic convolution kernel with `a = -0.5` (antialiased bicubic), evaluated in ATen's
/// form (`cubic_convolution1` / `cubic_convolution2`); with `a` a power of two it rounds exactly
/// as Pillow's form does.
fn cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
    } else {
        0.0
    }
}

/// The int16 weights of one axis: per output index the first input index and the tap count,
/// `ksize` weights per output index (zeros past the taps), and their fixed-point precision.
struct Taps {
    bounds: Vec<(usize, usize)>,
    ksize: usize,
    weights: Vec<i16>,
    precision: u32,
}

/// The taps of resampling `in_size` samples to `out_size`, as ATen's
/// `_compute_index_ranges_int16_weights` (antialias, `align_corners = false`, no scale given).
fn taps(in_size: usize, out_size: usize) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
    let ksize = support.ceil() as usize * 2 + 1;
    let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    let mut bounds = Vec::with_capacity(out_size);
    let mut w = vec![0f64; out_size * ksize];
    let mut w_max = 0f64;
    for i in 0..out_size {
        let center = scale * (i as f64 + 0.5);
        // C++'s `static_cast<int64_t>` truncates toward zero, as `as i64` does.
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xsize = ((center + support + 0.5) as i64).min(in_size as i64) - xmin;
        let xsize = xsize.clamp(0, ksize as i64) as usize;
        let row = &mut w[i * ksize..(i + 1) * ksize];
        let mut total = 0f64;
        for (j, wj) in row.iter_mut().enumerate().take(xsize) {
            *wj = cubic(((j as i64 + xmin) as f64 - center + 0.5) * invscale);
            total += *wj;
        }
        if total != 0.0 {
            for wj in row.iter_mut().take(xsize) {
                *wj /= total;
                w_max = w_max.max(*wj);
            }
        }
        bounds.push((xmin as usize, xsize));
    }
    let mut precision = 0;
    while precision < MAX_PRECISION {
        let next = (0.5 + w_max * f64::from(1u32 << (precision + 1))) as i64;
        if next >= 1 << 15 {
            break;
        }
        precision += 1;
    }
    let unit = f64::from(1u32 << precision);
    let weights = w
        .iter()
        .map(|&x| {
            let v = x * unit;
            // C++: `(v < 0) ? (int)(-0.5 + v) : (int)(0.5 + v)`, stored as int16.
            (if v < 0.0 { -0.5 + v } else { 0.5 + v }) as i32 as i16
        })
        .collect();
    Taps {
        bounds,
        ksize,
        weights,
        precision,
    }
}

/// `clamp(acc >> precision, 0, 255)` (arithmetic shift, as ATen's `int` shift).
fn to_u8(acc: i32, precision: u32) -> u8 {
    (acc >> precision).clamp(0, 255) as u8
}

/// Resizes an interleaved RGB8 buffer (`height` rows of `width` pixels) to `new_width` x
/// `new_height` exactly as torchvision 0.26 / torch 2.11 do on the CPU for a uint8 image:
/// `torchvision.transforms.v2.functional.resize(chw, [new_height, new_width],
/// InterpolationMode.BICUBIC, antialias=True)` (module docs). Equal sizes return a copy.
///
/// This is the resize of transformers' default (torchvision) Qwen2-VL / Qwen3-VL image
/// processor; [`super::resize_bicubic_rgb8`] is the Pillow one.
///
/// # Panics
/// If `src.len() != width * height * 3` or a size is zero.
pub fn resize_bicubic_rgb8_torchvision(
    src: &[u8],
    width: usize,
    height: usize,
    new_width: usize,
    new_height: usize,
) -> Vec<u8> {
    assert_eq!(src.len(), width * height * 3, "RGB8 buffer size");
    assert!(width > 0 && height > 0 && new_width > 0 && new_height > 0);
    let mut buf = if new_width != width {
        horizontal_pass(src, width, height, new_width)
    } else {
        src.to_vec()
    };
    if new_height != height {
        buf = vertical_pass(&buf, new_width, height, new_height);
    }
    buf
}

/// One horizontal pass: each row of `width` pixels resampled to `new_width`.
fn horizontal_pass(src: &[u8], width: usize, height: usize, new_width: usize) -> Vec<u8> {
    let t = taps(width, new_width);
    let half = 1i32 << (t.precision - 1);
    let mut out = vec![0u8; new_width * height * 3];
    for y in 0..height {
        let row = &src[y * width * 3..(y + 1) * width * 3];
        for xx in 0..new_width {
            let (xmin, n) = t.bounds[xx];
            let k = &t.weights[xx * t.ksize..xx * t.ksize + n];
            let mut acc = [half; 3];
            for (x, &kx) in k.iter().enumerate() {
                let p = &row[(xmin + x) * 3..(xmin + x) * 3 + 3];
                for ch in 0..3 {
                    acc[ch] += i32::from(p[ch]) * i32::from(kx);
                }
            }
            for ch in 0..3 {
                out[(y * new_width + xx) * 3 + ch] = to_u8(acc[ch], t.precision);
            }
        }
    }
    out
}

/// One vertical pass: each column of `height` pixels resampled to `new_height`.
fn vertical_pass(src: &[u8], width: usize, height: usize, new_height: usize) -> Vec<u8> {
    let t = taps(height, new_height);
    let half = 1i32 << (t.precision - 1);
    let mut out = vec![0u8; width * new_height * 3];
    let stride = width * 3;
    for yy in 0..new_height {
        let (ymin, n) = t.bounds[yy];
        let k = &t.weights[yy * t.ksize..yy * t.ksize + n];
        let dst = &mut out[yy * stride..(yy + 1) * stride];
        for (i, d) in dst.iter_mut().enumerate() {
            let mut acc = half;
            for (y, &ky) in k.iter().enumerate() {
                acc += i32::from(src[(ymin + y) * stride + i]) * i32::from(ky);
            }
            *d = to_u8(acc, t.precision);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_values() {
        assert_eq!(cubic(0.0), 1.0);
        assert_eq!(cubic(1.0), 0.0);
        assert_eq!(cubic(2.0), 0.0);
        assert_eq!(cubic(0.5), 0.5625);
        assert_eq!(cubic(-1.5), -0.0625);
    }

    #[test]
    fn precision_depends_on_the_largest_weight() {
        // Upscaling: the largest weight is 1.11 (at the border), so w * 2^15 passes 2^15 and
        // p = 14 (int16 weights up to 18193; the values ATen gives).
        let up = taps(10, 37);
        assert_eq!(up.precision, 14);
        assert_eq!(up.weights.iter().max(), Some(&18193));
        // A 4x shrink spreads the weight over 17 taps: smaller weights, more bits.
        let down = taps(400, 100);
        assert_eq!((down.precision, down.ksize), (16, 17));
        assert_eq!(down.weights.iter().max(), Some(&17112));
        for t in [&up, &down] {
            for (i, &(_, n)) in t.bounds.iter().enumerate() {
                let s: i32 = t.weights[i * t.ksize..i * t.ksize + n]
                    .iter()
                    .map(|&w| i32::from(w))
                    .sum();
                // The int16 weights sum to 2^p up to the rounding of each.
                assert!((s - (1 << t.precision)).abs() <= n as i32, "{s}");
            }
        }
    }

    #[test]
    fn constant_image_stays_constant() {
        let src = vec![77u8; 7 * 5 * 3];
        for (w, h) in [(3, 2), (16, 9), (7, 11), (1, 1)] {
            assert!(resize_bicubic_rgb8_torchvision(&src, 7, 5, w, h)
                .iter()
                .all(|&v| v == 77));
        }
    }
}
