//! The next token of every row on the device: transformers' sampling processors (repetition
//! penalty, temperature, top-k, top-p, min-p) and the draw in one kernel, with the
//! log-probability of the token drawn. Only the ids and log-probabilities leave the device.

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use super::*;
use crate::error::Result;

/// The version of the sampler's draws: the same logits, params and seed give the same token
/// under one version. Version 2 ([`sample_tokens`]) draws top-k / top-p rows on the device;
/// version 1 drew them on the host from a per-row `StdRng` (plain temperature and greedy rows
/// draw the same tokens under both). Records and resume keys of sampled runs carry it, so that
/// draws of two versions never mix.
pub const SAMPLER_VERSION: u32 = 2;

/// One row's sampling, as [`sample_tokens`] takes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    /// The row's seed.
    pub seed: u64,
    /// Its step (tokens generated so far): with the seed, it picks the row's noise.
    pub counter: u32,
    /// Temperature; 0 is greedy (the argmax of the penalised logits).
    pub temperature: f64,
    /// Keep the `top_k` highest scores (ties at the k-th kept); 0 = off.
    pub top_k: u32,
    /// Keep the highest scores whose mass above reaches `top_p`; >= 1 = off.
    pub top_p: f32,
    /// Keep scores whose probability is at least `min_p` times the top one's; 0 = off.
    pub min_p: f32,
    /// transformers' repetition penalty on the tokens of [`sample_tokens`]'s `seen`; 1 = off.
    pub repetition_penalty: f32,
}

impl RowSampling {
    /// The 8 u32 of the row in `params`.
    fn words(&self) -> [u32; 8] {
        let inv_t = if self.temperature > 0.0 {
            (1.0 / self.temperature) as f32
        } else {
            0.0
        };
        [
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.counter,
            inv_t.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.repetition_penalty.to_bits(),
        ]
    }
}

/// Picks the next token of every row of `logits` (`[rows, vocab]`, f32, or bf16/f16 read as
/// f32) and returns
/// `(ids [rows] u32, logprobs [rows] f32)` on the host: each row's token and its log-probability
/// under the raw logits (before penalty, temperature and filters; vLLM's `raw_logprobs`).
///
/// Per row, in transformers' order: the repetition penalty on the ids of `seen[row]` (the
/// prompt's and the generated tokens; divided when positive, multiplied when negative), then
/// 1/temperature, then top-k, top-p and min-p, then a draw from the softmax of what is kept by
/// the Gumbel-max trick — the argmax of `score - ln(-ln u)`, `u` a hash of (seed, counter,
/// token) — so a row's token depends on its logits, its params and its step only, not on the
/// batch or the device. A greedy row (temperature 0) takes the argmax of the penalised logits.
///
/// Thresholds without a sort: a radix select over the scores' order keys finds the k-th score
/// (top-k) and the lowest score whose higher scores' mass stays below top-p (masses in fixed
/// point, 2^-40 of the top token's, so sums do not depend on order); min-p keeps scores at least
/// `max + ln(min_p)`. Ties at a threshold are kept (transformers keeps top-k ties; its top-p
/// breaks them by sort order). The CUDA kernel and the CPU twin run the same steps.
pub fn sample_tokens(
    logits: &Tensor,
    rows: &[RowSampling],
    seen: &[&[u32]],
) -> Result<(Vec<u32>, Vec<f32>)> {
    let out: Vec<u32> = sample_tokens_on_device(logits, rows, seen)?
        .flatten_all()?
        .to_vec1()?;
    Ok(out.chunks(2).map(|c| (c[0], f32::from_bits(c[1]))).unzip())
}

/// [`sample_tokens`] left on the logits' device: `[rows, 2]` u32, each row's token and the f32
/// bits of its log-probability (column 0 can feed the next decode step with no host read).
pub fn sample_tokens_on_device(
    logits: &Tensor,
    rows: &[RowSampling],
    seen: &[&[u32]],
) -> Result<Tensor> {
    let (n, _) = logits.dims2()?;
    if rows.len() != n || seen.len() != n {
        return Err(candle_core::Error::Msg(format!(
            "sample_tokens: {n} rows of logits, {} of params, {} of seen ids",
            rows.len(),
            seen.len()
        ))
        .into());
    }
    let dev = logits.device();
    let params: Vec<u32> = rows.iter().flat_map(RowSampling::words).collect();
    let params = Tensor::from_vec(params, (n, 8), dev)?;
    // Offsets, then each row's sorted distinct ids (only rows with a penalty need them).
    let mut pen: Vec<u32> = Vec::with_capacity(n + 1);
    let mut ids: Vec<u32> = Vec::new();
    pen.push(0);
    for (r, s) in rows.iter().zip(seen) {
        if r.repetition_penalty != 1.0 {
            let mut row: Vec<u32> = s.to_vec();
            row.sort_unstable();
            row.dedup();
            ids.extend(row);
        }
        pen.push(ids.len() as u32);
    }
    pen.extend(ids);
    let pen = Tensor::from_vec(pen.clone(), pen.len(), dev)?;
    Ok(contig(logits)?.apply_op3_no_bwd(&params, &pen, &SampleTokens)?)
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

/// A float's bits reordered so that unsigned order is float order.
fn sort_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Fixed-point mass (2^-40 units) of a score `d` below the row's max.
fn fixed_mass(d: f32) -> u64 {
    (d.exp() * 1_099_511_627_776.0) as u64
}

/// One row as the kernel sees it.
struct Row<'a> {
    logits: &'a [f32],
    seen: &'a [u32],
    penalty: f32,
    inv_t: f32,
}

impl Row<'_> {
    fn score(&self, v: usize) -> f32 {
        let mut l = self.logits[v];
        if !self.seen.is_empty() && self.seen.binary_search(&(v as u32)).is_ok() {
            l = if l < 0.0 {
                l * self.penalty
            } else {
                l / self.penalty
            };
        }
        if self.inv_t > 0.0 {
            l * self.inv_t
        } else {
            l
        }
    }

    /// The key at which `weight` summed over the keys `>= t_min`, from the highest down, first
    /// reaches `target` (a radix select over the order keys, 8 bits a pass): with weight 1 the
    /// `target`-th highest key (top-k), with the fixed-point mass the lowest key whose higher
    /// keys' mass stays below `target` (top-p). 0 (keep all) when the total stays below it.
    fn radix_select(&self, t_min: u32, weight: impl Fn(f32) -> u64, mut target: u64) -> u32 {
        let mut prefix = 0u32;
        for shift in [24u32, 16, 8, 0] {
            let hi_mask = if shift == 24 {
                0
            } else {
                u32::MAX << (shift + 8)
            };
            let mut hist = [0u64; 256];
            for v in 0..self.logits.len() {
                let s = self.score(v);
                let key = sort_key(s);
                if key >= t_min && key & hi_mask == prefix {
                    hist[((key >> shift) & 0xFF) as usize] += weight(s);
                }
            }
            let mut above = 0u64;
            let Some(b) = (0..256).rev().find(|&b| {
                let reached = above + hist[b] >= target;
                if !reached {
                    above += hist[b];
                }
                reached
            }) else {
                return 0;
            };
            prefix |= (b as u32) << shift;
            target -= above;
        }
        prefix
    }
}

/// The CPU twin of the kernel for one row: (token, raw log-probability).
fn sample_row(row: &Row<'_>, p: &[u32]) -> (u32, f32) {
    let seed = p[0] as u64 | (p[1] as u64) << 32;
    let counter = p[2];
    let (top_k, top_p, min_p) = (p[4], f32::from_bits(p[5]), f32::from_bits(p[6]));
    let vocab = row.logits.len();
    // Raw (max, sum exp) in the kernel's per-element order is not needed bit for bit: the
    // log-probability is a report, not a choice.
    let m = row.logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: f32 = row.logits.iter().map(|&l| (l - m).exp()).sum();
    let smax = (0..vocab)
        .map(|v| row.score(v))
        .fold(f32::NEG_INFINITY, f32::max);
    let greedy = row.inv_t <= 0.0;
    let mut threshold = 0u32;
    if !greedy {
        let t_k = if top_k > 0 && (top_k as usize) < vocab {
            row.radix_select(0, |_| 1, top_k as u64)
        } else {
            0
        };
        let t_p = if top_p < 1.0 {
            let mass = |s: f32| fixed_mass(s - smax);
            let total: u64 = (0..vocab)
                .map(|v| row.score(v))
                .filter(|&s| sort_key(s) >= t_k)
                .map(mass)
                .sum();
            // At least one unit: the top key always stays.
            let target = ((top_p as f64 * total as f64) as u64).max(1);
            row.radix_select(t_k, mass, target)
        } else {
            0
        };
        let t_m = if min_p > 0.0 {
            sort_key(smax + min_p.ln())
        } else {
            0
        };
        threshold = t_k.max(t_p).max(t_m);
    }
    let mut best = (f32::NEG_INFINITY, u32::MAX);
    for v in 0..vocab {
        let sc = row.score(v);
        if sort_key(sc) < threshold {
            continue;
        }
        let z = if greedy {
            sc
        } else {
            sc - (-gumbel_uniform(seed, counter, v as u32).ln()).ln()
        };
        if z > best.0 {
            best = (z, v as u32);
        }
    }
    let tok = if best.1 == u32::MAX { 0 } else { best.1 };
    (tok, row.logits[tok as usize] - m - s.ln())
}

struct SampleTokens;

impl CustomOp3 for SampleTokens {
    fn name(&self) -> &'static str {
        "fleet-sample-tokens"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, vocab) = l1.shape().dims2()?;
        // Half-precision logits are read as the kernel reads them: converted to f32 exactly.
        let widened: Vec<f32>;
        let logits: &[f32] = match s1 {
            CpuStorage::F32(l) => contiguous(l, l1)?,
            CpuStorage::BF16(l) => {
                widened = contiguous(l, l1)?.iter().map(|x| x.to_f32()).collect();
                &widened
            }
            CpuStorage::F16(l) => {
                widened = contiguous(l, l1)?.iter().map(|x| x.to_f32()).collect();
                &widened
            }
            _ => candle_core::bail!("sample_tokens: logits must be f32, bf16 or f16"),
        };
        let (CpuStorage::U32(params), CpuStorage::U32(pen)) = (s2, s3) else {
            candle_core::bail!("sample_tokens: params and penalty ids must be u32")
        };
        let params = contiguous(params, l2)?;
        let pen = contiguous(pen, l3)?;
        if params.len() != rows * 8 || pen.len() < rows + 1 {
            candle_core::bail!(
                "sample_tokens: params must be [rows, 8] and pen hold rows + 1 offsets"
            );
        }
        let (offsets, ids) = pen.split_at(rows + 1);
        let mut out = Vec::with_capacity(rows * 2);
        for r in 0..rows {
            let p = &params[8 * r..8 * r + 8];
            let penalty = f32::from_bits(p[7]);
            let seen = if penalty != 1.0 {
                &ids[offsets[r] as usize..offsets[r + 1] as usize]
            } else {
                &[][..]
            };
            let row = Row {
                logits: &logits[r * vocab..(r + 1) * vocab],
                seen,
                penalty,
                inv_t: f32::from_bits(p[3]),
            };
            let (tok, logp) = sample_row(&row, p);
            out.push(tok);
            out.push(logp.to_bits());
        }
        Ok((CpuStorage::U32(out), Shape::from((rows, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::sample_tokens(s1, l1, s2, l2, s3, l3)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Shape};

    use super::super::cuda_util::*;
    use super::super::suffix;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/sample.ptx"));
    const MODULE: &str = "fleet_sample";

    pub(super) fn sample_tokens(
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s1.device().clone();
        let (rows, vocab) = l1.shape().dims2()?;
        if l2.shape().elem_count() != rows * 8 || l3.shape().elem_count() < rows + 1 {
            candle_core::bail!(
                "sample_tokens: params must be [rows, 8] and pen hold rows + 1 offsets"
            );
        }
        let params = input::<u32>(s2, l2)?;
        let pen = input::<u32>(s3, l3)?;
        let dtype = s1.dtype();
        let name = match dtype {
            DType::F32 | DType::BF16 | DType::F16 => format!("sample_tokens_{}", suffix(dtype)?),
            other => {
                candle_core::bail!("sample_tokens: logits must be f32, bf16 or f16, not {other:?}")
            }
        };
        let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        // SAFETY: the kernel writes two words per row.
        let out: CudaSlice<u32> = unsafe { dev.alloc::<u32>(rows * 2)? };
        let cfg = row_blocks(rows);
        // The logits are passed as a view of their own dtype (a device pointer either way).
        let (f32_l, bf16_l, f16_l);
        let mut b = func.builder();
        match dtype {
            DType::F32 => {
                f32_l = input::<f32>(s1, l1)?;
                b.arg(&f32_l);
            }
            DType::BF16 => {
                bf16_l = input::<half::bf16>(s1, l1)?;
                b.arg(&bf16_l);
            }
            _ => {
                f16_l = input::<half::f16>(s1, l1)?;
                b.arg(&f16_l);
            }
        }
        b.arg(&params);
        b.arg(&pen);
        b.arg(&out);
        let (vocab, n) = (vocab as i32, rows as i32);
        b.arg(&vocab);
        b.arg(&n);
        // SAFETY: one block per row reads its logits, params and penalty ids, writes two words.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((rows, 2)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn row(t: f64) -> RowSampling {
        RowSampling {
            seed: 7,
            counter: 0,
            temperature: t,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
        }
    }

    fn draw(logits: &[f32], r: RowSampling, seen: &[u32], n: u32) -> Vec<u32> {
        let t = Tensor::from_slice(logits, (1, logits.len()), &Device::Cpu).unwrap();
        (0..n)
            .map(|c| {
                let r = RowSampling { counter: c, ..r };
                sample_tokens(&t, &[r], &[seen]).unwrap().0[0]
            })
            .collect()
    }

    #[test]
    fn sort_keys_order_like_floats() {
        let xs = [-3.5f32, -1.0, -0.0, 0.0, 1e-30, 2.0, 7.25];
        for w in xs.windows(2) {
            assert!(sort_key(w[0]) <= sort_key(w[1]), "{w:?}");
        }
    }

    #[test]
    fn greedy_is_the_argmax_and_the_logprob_is_raw() {
        let logits = [0.5f32, 2.0, 1.0, -1.0];
        let t = Tensor::from_slice(&logits, (1, 4), &Device::Cpu).unwrap();
        let (ids, lp) = sample_tokens(&t, &[row(0.0)], &[&[]]).unwrap();
        assert_eq!(ids, vec![1]);
        let z: f32 = logits.iter().map(|l| (l - 2.0).exp()).sum();
        assert!((lp[0] - (0.0 - z.ln())).abs() < 1e-6, "{lp:?}");
    }

    #[test]
    fn top_k_keeps_the_k_best_and_their_ties() {
        let logits = [1.0f32, 5.0, 4.0, 4.0, 0.0, 3.0];
        let got: std::collections::BTreeSet<u32> = draw(
            &logits,
            RowSampling {
                top_k: 2,
                ..row(1.0)
            },
            &[],
            400,
        )
        .into_iter()
        .collect();
        // The second best score ties: both 4.0s stay beside the 5.0.
        assert_eq!(got, [1, 2, 3].into_iter().collect());
    }

    #[test]
    fn top_p_keeps_the_nucleus_and_min_p_the_close_ones() {
        // probs ~ [0.5, 0.3, 0.15, 0.05].
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let nucleus: std::collections::BTreeSet<u32> = draw(
            &logits,
            RowSampling {
                top_p: 0.7,
                ..row(1.0)
            },
            &[],
            400,
        )
        .into_iter()
        .collect();
        // Above token 1: 0.5 < 0.7, kept; above token 2: 0.8 >= 0.7, dropped.
        assert_eq!(nucleus, [0, 1].into_iter().collect());
        let tiny: std::collections::BTreeSet<u32> = draw(
            &logits,
            RowSampling {
                top_p: 1e-6,
                ..row(1.0)
            },
            &[],
            50,
        )
        .into_iter()
        .collect();
        assert_eq!(tiny, [0].into_iter().collect());
        // min_p 0.25: p >= 0.125 stays (0.5, 0.3, 0.15).
        let close: std::collections::BTreeSet<u32> = draw(
            &logits,
            RowSampling {
                min_p: 0.25,
                ..row(1.0)
            },
            &[],
            400,
        )
        .into_iter()
        .collect();
        assert_eq!(close, [0, 1, 2].into_iter().collect());
    }

    #[test]
    fn frequencies_follow_the_softmax_of_what_is_kept() {
        // Top-k 2 of softmax([ln 3, 0, -9]): 0.75 / 0.25 after renormalising.
        let logits = [3f32.ln(), 0.0, -9.0];
        let n = 20_000;
        let ones = draw(
            &logits,
            RowSampling {
                top_k: 2,
                ..row(1.0)
            },
            &[],
            n,
        )
        .iter()
        .filter(|&&t| t == 0)
        .count();
        let f = ones as f64 / n as f64;
        assert!((f - 0.75).abs() < 0.015, "{f}");
    }

    #[test]
    fn the_repetition_penalty_is_transformers() {
        // Token 1 seen: 2.0 / 2 = 1.0 < 1.5; token 3 seen: -1 * 2 = -2. Greedy picks token 2.
        let logits = [0.5f32, 2.0, 1.5, -1.0];
        let t = Tensor::from_slice(&logits, (1, 4), &Device::Cpu).unwrap();
        let r = RowSampling {
            repetition_penalty: 2.0,
            ..row(0.0)
        };
        let (ids, lp) = sample_tokens(&t, &[r], &[&[3, 1, 1]]).unwrap();
        assert_eq!(ids, vec![2]);
        // The log-probability is the raw logits'.
        let z: f32 = logits.iter().map(|l| (l - 2.0).exp()).sum();
        assert!((lp[0] - (1.5 - 2.0 - z.ln())).abs() < 1e-6);
    }

    #[test]
    fn a_row_draws_the_same_alone_or_in_a_batch() {
        let vocab = 50;
        let logits: Vec<f32> = (0..3 * vocab)
            .map(|i| ((i * 37) % 11) as f32 * 0.3)
            .collect();
        let rows: Vec<RowSampling> = (0..3)
            .map(|i| RowSampling {
                seed: 100 + i,
                top_k: [0, 5, 0][i as usize],
                top_p: [1.0, 1.0, 0.8][i as usize],
                ..row(0.9)
            })
            .collect();
        let t = Tensor::from_slice(&logits, (3, vocab), &Device::Cpu).unwrap();
        let seen: [&[u32]; 3] = [&[], &[], &[]];
        let (batch, _) = sample_tokens(&t, &rows, &seen).unwrap();
        for r in 0..3 {
            let one = t.narrow(0, r, 1).unwrap();
            let (alone, _) = sample_tokens(&one, &rows[r..r + 1], &seen[..1]).unwrap();
            assert_eq!(alone[0], batch[r]);
        }
    }

    #[test]
    fn half_precision_logits_draw_as_their_widened_values() {
        let vocab = 300;
        let logits: Vec<f32> = (0..4 * vocab)
            .map(|i| ((i * 7919) % 1009) as f32 * 0.013 - 6.0)
            .collect();
        let rows: Vec<RowSampling> = (0..4)
            .map(|i| RowSampling {
                seed: 5 + i,
                top_k: [0, 20, 0, 0][i as usize],
                top_p: [1.0, 1.0, 0.7, 1.0][i as usize],
                ..row([0.8, 0.8, 1.1, 0.0][i as usize])
            })
            .collect();
        let seen: [&[u32]; 4] = [&[], &[3, 9], &[], &[]];
        let t = Tensor::from_slice(&logits, (4, vocab), &Device::Cpu).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let half = t.to_dtype(dtype).unwrap();
            let widened = half.to_dtype(DType::F32).unwrap();
            let (a, lp_a) = sample_tokens(&half, &rows, &seen).unwrap();
            let (b, lp_b) = sample_tokens(&widened, &rows, &seen).unwrap();
            assert_eq!(a, b, "{dtype:?}");
            assert_eq!(lp_a, lp_b, "{dtype:?}");
        }
    }
}
