//! One sampled token per row of logits on the device, by the Gumbel-max trick with a counter-based hash.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::*;
use crate::error::Result;

/// Samples one token per row of `logits` (`[rows, vocab]`, f32, contiguous) from
/// `softmax(logits * inv_temperature)` by the Gumbel-max trick: the argmax of
/// `logits * inv_temperature + g`, with `g = -ln(-ln(u))` and `u` a hash of (the row's seed,
/// its counter, the token) — so a row's draw depends on its seed and step only, not on the
/// batch, the device or any generator state. `params` is `[rows, 4]` u32 on the logits'
/// device: seed (low, high), counter, and `inv_temperature` as f32 bits. Returns `[rows]` u32.
///
/// Only the ids leave the device: sampling a batch costs what greedy decoding costs.
pub fn sample_gumbel(logits: &Tensor, params: &Tensor) -> Result<Tensor> {
    Ok(contig(logits)?.apply_op2_no_bwd(&contig(params)?, &SampleGumbel)?)
}

/// The `params` row of [`sample_gumbel`] for one request.
pub fn gumbel_params(seed: u64, counter: u32, temperature: f64) -> [u32; 4] {
    [
        seed as u32,
        (seed >> 32) as u32,
        counter,
        ((1.0 / temperature) as f32).to_bits(),
    ]
}

/// The uniform in (0, 1) of token `v` for a row with `seed` at step `counter` (SplitMix64's
/// finaliser over the three, 24 bits kept). The CUDA kernel computes the same.
fn gumbel_uniform(seed: u64, counter: u32, v: u32) -> f32 {
    let mut x = seed
        ^ (counter as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (v as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    ((x >> 40) as f32 + 0.5) * (1.0 / 16_777_216.0)
}

struct SampleGumbel;

impl CustomOp2 for SampleGumbel {
    fn name(&self) -> &'static str {
        "fleet-sample-gumbel"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, vocab) = l1.shape().dims2()?;
        let logits = match s1 {
            CpuStorage::F32(v) => contiguous(v, l1)?,
            _ => candle_core::bail!("sample_gumbel: logits must be f32"),
        };
        let params = match s2 {
            CpuStorage::U32(v) => contiguous(v, l2)?,
            _ => candle_core::bail!("sample_gumbel: params must be u32"),
        };
        if params.len() != rows * 4 {
            candle_core::bail!("sample_gumbel: params must be [rows, 4]");
        }
        let mut out = Vec::with_capacity(rows);
        for r in 0..rows {
            let p = &params[4 * r..4 * r + 4];
            let seed = p[0] as u64 | (p[1] as u64) << 32;
            let inv_t = f32::from_bits(p[3]);
            let row = &logits[r * vocab..(r + 1) * vocab];
            let mut best = (f32::NEG_INFINITY, 0u32);
            for (v, &l) in row.iter().enumerate() {
                let u = gumbel_uniform(seed, p[2], v as u32);
                let score = l * inv_t - (-u.ln()).ln();
                if score > best.0 {
                    best = (score, v as u32);
                }
            }
            out.push(best.1);
        }
        Ok((CpuStorage::U32(out), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::sample_gumbel(s1, l1, s2, l2)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, Layout, Shape};

    use super::super::cuda_util::*;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/sample.ptx"));
    const MODULE: &str = "fleet_sample";

    pub(super) fn sample_gumbel(
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s1.device().clone();
        let (rows, vocab) = l1.shape().dims2()?;
        let logits = input::<f32>(s1, l1)?;
        let params = input::<u32>(s2, l2)?;
        let func = dev.get_or_load_custom_func("sample_gumbel", MODULE, PTX)?;
        // SAFETY: the kernel writes one id per row.
        let out: CudaSlice<u32> = unsafe { dev.alloc::<u32>(rows)? };
        let cfg = row_blocks(rows);
        let mut b = func.builder();
        b.arg(&logits);
        b.arg(&params);
        b.arg(&out);
        let vocab = vocab as i32;
        b.arg(&vocab);
        // SAFETY: one block per row reads its vocab logits and params, writes one id.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows)))
    }
}
