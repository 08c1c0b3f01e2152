//! Dropout masks that can be drawn again: LoRA's dropout on the adapters' input must give the
//! backward's recompute of a block the mask its forward used, so a mask is a function of a key.

use candle_core::{DType, Device, Shape, Tensor};

use crate::error::Result;

/// A dropout mask of `shape` in `dtype`: each element `1 / (1 - p)` with probability `1 - p`,
/// else 0 (torch's `nn.Dropout` scaling), the same for the same `key` on the same device. On
/// the CPU each element's draw is SplitMix64 of the key and its index; on a GPU the device's
/// generator (curand) seeded with the key draws the whole mask, so a CPU and a GPU mask of one
/// key differ (as torch's do).
pub fn dropout_mask(
    shape: &Shape,
    p: f64,
    key: u64,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let keep = 1.0 / (1.0 - p);
    let uniform = match device {
        Device::Cpu => {
            let n = shape.elem_count();
            let draws: Vec<f32> = (0..n as u64)
                .map(|i| (splitmix(key ^ i.wrapping_mul(0xd1b5_4a32_d192_ed03)) >> 40) as f32)
                .map(|u| u / (1u64 << 24) as f32)
                .collect();
            Tensor::from_vec(draws, shape, device)?
        }
        _ => {
            device.set_seed(key)?;
            Tensor::rand(0f32, 1f32, shape, device)?
        }
    };
    Ok((uniform.ge(p)?.to_dtype(DType::F32)? * keep)?.to_dtype(dtype)?)
}

/// SplitMix64's output for state `z` (its finaliser of `z` plus the golden-ratio step): the
/// crate's one counter-based hash (dropout draws, LoRA's starting `A`, dropout keys).
pub(crate) fn splitmix(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_gives_one_mask_and_keeps_about_one_minus_p() {
        let shape = Shape::from((64, 512));
        let m = |key| dropout_mask(&shape, 0.25, key, DType::F32, &Device::Cpu).unwrap();
        let (a, b, c) = (m(7), m(7), m(8));
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(v(&a), v(&b));
        assert_ne!(v(&a), v(&c));
        let kept = v(&a).iter().filter(|&&x| x != 0.0).count() as f64 / (64.0 * 512.0);
        assert!((kept - 0.75).abs() < 0.01, "{kept}");
        assert!(v(&a)
            .iter()
            .all(|&x| x == 0.0 || (x - 1.0 / 0.75).abs() < 1e-6));
    }
}
