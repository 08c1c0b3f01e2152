//! Pillow's bicubic resampling of 8-bit images, reproduced bit for bit.
//!
//! This is the resize of [`super::ResizeBackend::Pillow`]; fleet's default backend is
//! torchvision's (`resample_torchvision.rs`, as transformers' default processor).
//!
//! transformers' PIL backend resizes with `PIL.Image.resize(size, BICUBIC)`, which runs Pillow's
//! `ImagingResample` (`src/libImaging/Resample.c`): a separable, antialiased convolution with the
//! cubic kernel of `a = -0.5` (support 2, widened by the scale factor when downscaling), one
//! pass per axis on uint8 pixels with fixed-point weights (22 fractional bits), rounding and
//! clipping to 0..=255 after each pass. Pillow 13 runs the horizontal pass first unless the
//! height shrinks by more than twice the pixels the width does (older Pillow: always
//! horizontal first; the two orders differ by a few levels where they differ). This is the same
//! arithmetic and order, written from the algorithm's description, so the output equals
//! Pillow 13's exactly (checked by `tests/vision_preprocess.rs` on the fixtures, and on 400
//! random sizes and images when it was written).

/// Fractional bits of the fixed-point weights (Pillow: `32 - 8 - 2`).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// The cubic convolution kernel with `a = -0.5` (Keys), support 2.
fn bicubic_filter(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per output index: the first input index used, and the fixed-point weights from there on.
struct Coeffs {
    bounds: Vec<(usize, usize)>,
    ksize: usize,
    weights: Vec<i32>,
}

/// The weights of resampling `in_size` samples to `out_size` (Pillow's `precompute_coeffs`
/// then `normalize_coeffs_8bpc`, over the whole input: box = (0, in_size)).
fn coeffs(in_size: usize, out_size: usize) -> Coeffs {
    const SUPPORT: f64 = 2.0;
    // Pillow takes the box edges as C floats; small integers are exact in f32 and f64 alike.
    let in0 = 0.0f64;
    let scale = (in_size as f32 - 0.0f32) as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = SUPPORT * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = in0 + (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's `(int)` truncates toward zero, as `as i64` does.
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) - xmin;
        let xmax = xmax.max(0) as usize;
        let mut ww = 0.0f64;
        for (x, kx) in k.iter_mut().enumerate().take(xmax) {
            let w = bicubic_filter(((x as i64 + xmin) as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        for x in 0..ksize {
            let v = if x < xmax {
                if ww != 0.0 {
                    k[x] / ww
                } else {
                    k[x]
                }
            } else {
                0.0
            };
            let scaled = v * f64::from(1u32 << PRECISION_BITS);
            weights[xx * ksize + x] = if v < 0.0 {
                (-0.5 + scaled) as i32
            } else {
                (0.5 + scaled) as i32
            };
        }
        bounds.push((xmin as usize, xmax));
    }
    Coeffs {
        bounds,
        ksize,
        weights,
    }
}

/// Pillow's `clip8`: drop the fractional bits (arithmetic shift) and clamp to 0..=255.
fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes an interleaved RGB8 buffer (`height` rows of `width` pixels) to `new_width` x
/// `new_height` exactly as Pillow's `Image.resize((new_width, new_height), Image.BICUBIC)`
/// does for an `RGB` image (no `reducing_gap`, no box). Equal sizes return a copy.
///
/// This is the resize of transformers' PIL backend (`Qwen2VLImageProcessorPil`,
/// [`super::ResizeBackend::Pillow`]); transformers' default processor resizes with torchvision
/// ([`super::resize_bicubic_rgb8_torchvision`]).
///
/// # Panics
/// If `src.len() != width * height * 3` or a size is zero.
pub fn resize_bicubic_rgb8(
    src: &[u8],
    width: usize,
    height: usize,
    new_width: usize,
    new_height: usize,
) -> Vec<u8> {
    assert_eq!(src.len(), width * height * 3, "RGB8 buffer size");
    assert!(width > 0 && height > 0 && new_width > 0 && new_height > 0);
    // Pillow >= 13 runs the vertical pass first when the height shrinks by more than twice the
    // pixels the width does (`ImagingResampleInner`); the order changes the rounding between
    // the passes.
    let (dh, dw) = (
        height as i64 - new_height as i64,
        width as i64 - new_width as i64,
    );
    let vertical_first = dh > 0 && dh > dw * 2;
    let mut buf = src.to_vec();
    let (mut w, mut h) = (width, height);
    let passes: [bool; 2] = if vertical_first {
        [false, true]
    } else {
        [true, false]
    };
    for horizontal in passes {
        if horizontal && new_width != w {
            buf = horizontal_pass(&buf, w, h, new_width);
            w = new_width;
        } else if !horizontal && new_height != h {
            buf = vertical_pass(&buf, w, h, new_height);
            h = new_height;
        }
    }
    buf
}

/// One horizontal pass: each row of `width` pixels resampled to `new_width`.
fn horizontal_pass(src: &[u8], width: usize, height: usize, new_width: usize) -> Vec<u8> {
    let half = 1i32 << (PRECISION_BITS - 1);
    let c = coeffs(width, new_width);
    let mut out = vec![0u8; new_width * height * 3];
    for y in 0..height {
        let row = &src[y * width * 3..(y + 1) * width * 3];
        for xx in 0..new_width {
            let (xmin, n) = c.bounds[xx];
            let k = &c.weights[xx * c.ksize..xx * c.ksize + n];
            let mut acc = [half; 3];
            for (x, &kx) in k.iter().enumerate() {
                let p = &row[(xmin + x) * 3..(xmin + x) * 3 + 3];
                for ch in 0..3 {
                    acc[ch] += i32::from(p[ch]) * kx;
                }
            }
            for ch in 0..3 {
                out[(y * new_width + xx) * 3 + ch] = clip8(acc[ch]);
            }
        }
    }
    out
}

/// One vertical pass: each column of `height` pixels resampled to `new_height`.
fn vertical_pass(src: &[u8], width: usize, height: usize, new_height: usize) -> Vec<u8> {
    let half = 1i32 << (PRECISION_BITS - 1);
    let c = coeffs(height, new_height);
    let mut out = vec![0u8; width * new_height * 3];
    for yy in 0..new_height {
        let (ymin, n) = c.bounds[yy];
        let k = &c.weights[yy * c.ksize..yy * c.ksize + n];
        for x in 0..width {
            let mut acc = [half; 3];
            for (y, &ky) in k.iter().enumerate() {
                let p = &src[((ymin + y) * width + x) * 3..((ymin + y) * width + x) * 3 + 3];
                for ch in 0..3 {
                    acc[ch] += i32::from(p[ch]) * ky;
                }
            }
            for ch in 0..3 {
                out[(yy * width + x) * 3 + ch] = clip8(acc[ch]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_values() {
        assert_eq!(bicubic_filter(0.0), 1.0);
        assert_eq!(bicubic_filter(1.0), 0.0);
        assert_eq!(bicubic_filter(2.0), 0.0);
        assert_eq!(bicubic_filter(0.5), 0.5625);
        assert_eq!(bicubic_filter(-1.5), -0.0625);
    }

    #[test]
    fn constant_image_stays_constant() {
        let src = vec![77u8; 7 * 5 * 3];
        for (w, h) in [(3, 2), (16, 9), (7, 11)] {
            assert!(resize_bicubic_rgb8(&src, 7, 5, w, h)
                .iter()
                .all(|&v| v == 77));
        }
    }
}
