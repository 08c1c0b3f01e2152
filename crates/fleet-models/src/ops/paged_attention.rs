//! The paged KV cache's two ops of a decode step: the write of new keys or values into their
//! slots, and split-KV (flash-decoding) attention of one query token per row over the row's
//! blocks. Both are capturable in a CUDA graph: whatever changes between steps (slots, block
//! tables, lengths) is read from device memory, launches depend on shapes only, and nothing
//! syncs with the host.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::*;
use crate::error::Result;

/// The most tokens per partition of [`paged_decode_attention`]'s split-KV pass: one thread
/// block per (row, KV head, partition), so a long sequence spreads over many SMs while a
/// partition's scores still fit in shared memory. Small grids take smaller partitions (see
/// [`PAGED_ATTENTION_MIN_BLOCKS`]); the CPU twin cuts sequences at the same points.
pub const PAGED_ATTENTION_PARTITION: usize = 256;

/// The grid [`paged_decode_attention`] aims for: partitions are halved (down to
/// [`PAGED_ATTENTION_MIN_PARTITION`] tokens and the block size) until rows x KV heads x
/// partitions reaches this many blocks, about four per SM of an H100. Measured on a 7B decode
/// step at batch 1 (4 KV heads, 640 tokens): 256-token partitions gave 12 blocks and 20 us per
/// layer, 7.7% of the step. `FLEET_PAGED_MIN_BLOCKS`
/// sets another (read once: every graph of a process takes the same partitions).
pub const PAGED_ATTENTION_MIN_BLOCKS: usize = 512;

/// The smallest partition the halving goes to (or the block size, if larger): at batch 1 the
/// grid cannot reach [`PAGED_ATTENTION_MIN_BLOCKS`] anyway, and the 7B's decode (4 KV heads,
/// 640 tokens) ran faster with 17 partitions of 32 tokens (68 blocks) than with 33 of 16
/// (132 blocks: a longer combine) or 9 of 64 (36 blocks): 238.1 / 237.5 tok/s against
/// 234.9 / 235.0 and 231.2 / 232.9 (one H200, 2026-11-29f, `FLEET_PAGED_MIN_BLOCKS` 64, 512,
/// 32; a build with a GEMV kernel since removed). Batches of 8 and more reach the grid with
/// partitions of 32 tokens or more.
pub const PAGED_ATTENTION_MIN_PARTITION: usize = 32;

/// [`PAGED_ATTENTION_MIN_BLOCKS`], or `FLEET_PAGED_MIN_BLOCKS` where it is a positive number.
/// A larger grid cuts the last wave's idle SMs: the 30B-A3B judge's decode at 32 rows of
/// ~2,200 tokens runs 1,152 blocks of 256-token partitions, one full wave of the H200's and a
/// ninth of another.
static MIN_BLOCKS: EnvCount = EnvCount::new("FLEET_PAGED_MIN_BLOCKS", PAGED_ATTENTION_MIN_BLOCKS);

/// Whether [`paged_decode_attention`]'s first pass runs on the tensor cores on CUDA where it
/// can (bf16 or f16, head_dim 64 or 128, at most 8 query heads per KV head, q 16-byte
/// aligned); `FLEET_PAGED_MMA=0` for the per-lane kernel. The same partitions, workspace and
/// softmax; the scores and p·V are mma products (p rounded to the dtype for p·V, as
/// transformers' eager attention rounds it), so it agrees with the twin to the dtype's
/// rounding, not bit for bit. On an H200 (2026-11-29) it read K/V at 3.1 TB/s against the
/// per-lane kernel's 1.6–1.8 (the 7B's and the 30B-A3B judge's decode shapes); the 7B's
/// decode at batch 32 went from 5,258 to 5,908 tok/s, the 30B-A3B judge's at 96 from 4.92 to
/// 4.16 s a batch.
#[cfg(feature = "cuda")]
static PAGED_MMA: EnvSwitch = EnvSwitch::new("FLEET_PAGED_MMA", true);

/// Test switch: whether [`paged_decode_attention`] takes the tensor-core kernel in this
/// process, whatever `FLEET_PAGED_MMA` says (`None`: the environment decides).
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub fn set_paged_mma(on: Option<bool>) {
    PAGED_MMA.force(on);
}

/// Most query heads per KV head that [`paged_decode_attention`] takes (the kernel keeps the
/// group's accumulators in registers).
pub const PAGED_ATTENTION_MAX_GROUP: usize = 16;

/// The partition kernel's shape, which fixes the twin's summation order: 4 warps; in the score
/// pass a token's [`SCORE_LANES`] lanes each sum [`CHUNK`]-element chunks `lane, lane +
/// SCORE_LANES, ...` of the K row; in the p·V pass a column's [`SETS`] lanes each sum a
/// contiguous quarter of the tokens (rounded up to a multiple of 4).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const THREADS: usize = 128;
const SCORE_LANES: usize = 4;
const CHUNK: usize = 8;
const SETS: usize = 4;

/// Whether [`paged_decode_attention`] takes this shape: head_dim a multiple of 32 up to 256,
/// at most [`PAGED_ATTENTION_MAX_GROUP`] query heads per KV head, block_size a power of two
/// from 4 to [`PAGED_ATTENTION_PARTITION`]. Other shapes (the tiny test checkpoints' head_dim
/// 16) take [`paged_decode_attention_reference`].
pub fn paged_decode_supported(head_dim: usize, group: usize, block_size: usize) -> bool {
    head_dim > 0
        && head_dim.is_multiple_of(32)
        && head_dim <= 256
        && (1..=PAGED_ATTENTION_MAX_GROUP).contains(&group)
        && block_size.is_power_of_two()
        && (4..=PAGED_ATTENTION_PARTITION).contains(&block_size)
}

/// Writes `new` (`[tokens, kv_heads, head_dim]`) into `cache` (`[num_blocks, kv_heads,
/// block_size, head_dim]`, contiguous, same dtype: f32, f16 or bf16) in place: token `t` goes
/// to slot `slots[t] = block * block_size + offset`. `slots` is `[tokens]` u32 on the cache's
/// device; `u32::MAX` skips the token (a padding row). `new` may be a strided view (the k or v
/// part of a fused projection): it is read through its strides, never copied. Called once for
/// the keys and once for the values.
///
/// A slot past the cache (other than `u32::MAX`) is an error on the CPU; the CUDA kernel skips
/// it, as it cannot report it without a host sync.
pub fn paged_kv_write(cache: &Tensor, new: &Tensor, slots: &Tensor) -> Result<()> {
    if !slots.device().same_device(cache.device()) || !new.device().same_device(cache.device()) {
        let msg = "paged_kv_write: cache, new and slots must be on one device";
        return Err(candle_core::Error::Msg(msg.into()).into());
    }
    Ok(cache.inplace_op3(new, &contig(slots)?, &PagedKvWrite)?)
}

/// Attention of one query token per row over the row's cached tokens, for a decode step.
///
/// - `q`: `[batch, heads, head_dim]` (f32, f16 or bf16);
/// - `k_cache`, `v_cache`: `[num_blocks, kv_heads, block_size, head_dim]`, contiguous, q's dtype;
/// - `block_tables`: `[batch, max_blocks]` u32, row `r`'s `i`-th block of its sequence (entries
///   past the row's length are never read);
/// - `seq_lens`: `[batch]` u32, row `r`'s tokens in the cache, the current one included; 0 marks
///   an inactive row, whose output is zeros.
///
/// Returns `[batch, heads, head_dim]` in q's dtype: `softmax(q kᵀ · scale) v` over the row's
/// tokens (no mask: paged rows have no left padding). Query head `h` reads KV head
/// `h / (heads / kv_heads)`. Scores, softmax and p·V in f32, rounded once to the dtype.
/// head_dim is a multiple of 32 up to 256; block_size a power of two from 4 to 256; at most
/// [`PAGED_ATTENTION_MAX_GROUP`] query heads per KV head; `seq_lens[r] <= max_blocks *
/// block_size` and the table entries a row reads are blocks of the cache (the CPU checks both;
/// the kernel clamps the length to the table and trusts the entries, as it cannot report without
/// a host sync).
///
/// On CUDA: pass 1, one block per (partition of up to [`PAGED_ATTENTION_PARTITION`] tokens, KV
/// head, row), each reading its K and V once for the whole query group, writes the partition's max,
/// sum of exp and unnormalised output (f32) to a workspace sized from `max_blocks`; pass 2
/// combines a row's partitions (log-sum-exp rescale) into the output. Partitions past a row's
/// length exit at once, so the grid depends on shapes only.
pub fn paged_decode_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_tables: &Tensor,
    seq_lens: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    let dev = q.device();
    if !block_tables.device().same_device(dev) || !seq_lens.device().same_device(dev) {
        let msg = "paged_decode_attention: block_tables and seq_lens must be on q's device";
        return Err(candle_core::Error::Msg(msg.into()).into());
    }
    let op = PagedDecodeAttention {
        block_tables: contig(block_tables)?,
        seq_lens: contig(seq_lens)?,
        scale,
    };
    Ok(contig(q)?.apply_op3_no_bwd(k_cache, v_cache, &op)?)
}

/// [`paged_decode_attention`] from plain candle ops, on any device, to test the twin and the
/// kernel against: each row's blocks gathered into a contiguous `[kv_heads, seq_len, head_dim]`,
/// repeated for the query group, `softmax(q kᵀ · scale) v` in f32, rounded once to q's dtype.
/// Reads the tables and lengths back to the host.
pub fn paged_decode_attention_reference(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_tables: &Tensor,
    seq_lens: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    let (batch, heads, hd) = q.dims3()?;
    let (_, kvh, bs, _) = k_cache.dims4()?;
    let group = heads / kvh;
    let tables: Vec<Vec<u32>> = block_tables.to_vec2()?;
    let lens: Vec<u32> = seq_lens.to_vec1()?;
    let dev = q.device();
    let mut rows = Vec::with_capacity(batch);
    for (table, &len) in tables.iter().zip(&lens) {
        let len = len as usize;
        if len == 0 {
            rows.push(Tensor::zeros((heads, hd), DType::F32, dev)?);
            continue;
        }
        let n = len.div_ceil(bs);
        let blocks = Tensor::new(&table[..n], dev)?;
        // [n, kvh, bs, hd] -> [kvh, n * bs, hd] -> the first len tokens -> [heads, len, hd].
        let gather = |cache: &Tensor| -> candle_core::Result<Tensor> {
            cache
                .index_select(&blocks, 0)?
                .transpose(0, 1)?
                .reshape((kvh, n * bs, hd))?
                .narrow(1, 0, len)?
                .to_dtype(DType::F32)?
                .unsqueeze(1)?
                .expand((kvh, group, len, hd))?
                .reshape((heads, len, hd))
        };
        let (k, v) = (gather(k_cache)?, gather(v_cache)?);
        let qr = q.get(rows.len())?.to_dtype(DType::F32)?.unsqueeze(1)?;
        let scores = (qr.matmul(&k.t()?.contiguous()?)? * f64::from(scale))?;
        let p = candle_nn::ops::softmax_last_dim(&scores)?;
        rows.push(p.matmul(&v)?.squeeze(1)?);
    }
    Ok(Tensor::stack(&rows, 0)?.to_dtype(q.dtype())?)
}

// ---------------------------------------------------------------------------------------------
// paged_kv_write

struct PagedKvWrite;

/// The shapes of one [`paged_kv_write`].
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct WriteDims {
    tokens: usize,
    kv_heads: usize,
    block_size: usize,
    head_dim: usize,
    num_slots: usize,
}

fn write_dims(cache: &Layout, new: &Layout, slots: &Layout) -> candle_core::Result<WriteDims> {
    let &[num_blocks, kv_heads, block_size, head_dim] = cache.dims() else {
        candle_core::bail!(
            "paged_kv_write: cache {:?} must be [num_blocks, kv_heads, block_size, head_dim]",
            cache.dims()
        )
    };
    if cache.contiguous_offsets().is_none() {
        candle_core::bail!("paged_kv_write: the cache must be contiguous (it is written in place)");
    }
    let tokens = slots.dims().first().copied().unwrap_or(0);
    if new.dims() != [tokens, kv_heads, head_dim] || slots.dims() != [tokens] {
        candle_core::bail!(
            "paged_kv_write: new {:?} and slots {:?} must be [tokens, {kv_heads}, {head_dim}] and [tokens]",
            new.dims(),
            slots.dims()
        );
    }
    Ok(WriteDims {
        tokens,
        kv_heads,
        block_size,
        head_dim,
        num_slots: num_blocks * block_size,
    })
}

/// The CPU twin: the same copies as the kernel, element by element.
fn kv_write_cpu<T: Copy>(
    cache: &mut [T],
    cl: &Layout,
    new: &[T],
    nl: &Layout,
    slots: &[u32],
    d: &WriteDims,
) -> candle_core::Result<()> {
    // Checked before anything is written, so an error leaves the cache as it was.
    if let Some((t, s)) = slots
        .iter()
        .enumerate()
        .find(|(_, &s)| s != u32::MAX && s as usize >= d.num_slots)
    {
        candle_core::bail!(
            "paged_kv_write: slot {s} of token {t} is past the cache's {} slots",
            d.num_slots
        );
    }
    let Some((a, b)) = cl.contiguous_offsets() else {
        candle_core::bail!("paged_kv_write: the cache must be contiguous")
    };
    let cache = &mut cache[a..b];
    let (o, st) = (nl.start_offset(), nl.stride());
    for (t, &slot) in slots.iter().enumerate() {
        if slot == u32::MAX {
            continue;
        }
        let (blk, off) = (slot as usize / d.block_size, slot as usize % d.block_size);
        for h in 0..d.kv_heads {
            let dst = ((blk * d.kv_heads + h) * d.block_size + off) * d.head_dim;
            for i in 0..d.head_dim {
                cache[dst + i] = new[o + t * st[0] + h * st[1] + i * st[2]];
            }
        }
    }
    Ok(())
}

impl candle_core::InplaceOp3 for PagedKvWrite {
    fn name(&self) -> &'static str {
        "fleet-paged-kv-write"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let d = write_dims(l1, l2, l3)?;
        let CpuStorage::U32(slots) = s3 else {
            candle_core::bail!("paged_kv_write: slots must be u32")
        };
        let slots = contiguous(slots, l3)?;
        match (s1, s2) {
            (CpuStorage::F32(c), CpuStorage::F32(n)) => kv_write_cpu(c, l1, n, l2, slots, &d),
            (CpuStorage::F16(c), CpuStorage::F16(n)) => kv_write_cpu(c, l1, n, l2, slots, &d),
            (CpuStorage::BF16(c), CpuStorage::BF16(n)) => kv_write_cpu(c, l1, n, l2, slots, &d),
            _ => {
                candle_core::bail!("paged_kv_write: cache and new must share one of f32, f16, bf16")
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        use candle_core::backend::BackendStorage;
        let d = write_dims(l1, l2, l3)?;
        if s1.dtype() != s2.dtype() || s3.dtype() != DType::U32 {
            candle_core::bail!(
                "paged_kv_write: cache {:?}, new {:?}, slots {:?} (want one float dtype and u32)",
                s1.dtype(),
                s2.dtype(),
                s3.dtype()
            );
        }
        cuda::kv_write(s1, l1, s2, l2, s3, l3, &d)
    }
}

// ---------------------------------------------------------------------------------------------
// paged_decode_attention

/// The op on (q, k_cache, v_cache); the block tables and lengths ride along (a custom op takes
/// three tensors).
struct PagedDecodeAttention {
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: f32,
}

/// The shapes of one [`paged_decode_attention`].
#[derive(Clone, Copy)]
struct AttnDims {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
    num_blocks: usize,
    block_size: usize,
    max_blocks: usize,
}

impl AttnDims {
    /// Tokens a row's table can hold.
    fn capacity(&self) -> usize {
        self.max_blocks * self.block_size
    }

    /// Tokens per partition: [`PAGED_ATTENTION_PARTITION`], halved while the grid is smaller
    /// than [`PAGED_ATTENTION_MIN_BLOCKS`] (or `FLEET_PAGED_MIN_BLOCKS`; shapes only, so the
    /// same for a captured graph's every replay and for the twin).
    fn partition(&self) -> usize {
        let floor = self.block_size.max(PAGED_ATTENTION_MIN_PARTITION);
        let mut part = PAGED_ATTENTION_PARTITION;
        while part / 2 >= floor
            && self.batch * self.kv_heads * self.capacity().div_ceil(part) < MIN_BLOCKS.get()
        {
            part /= 2;
        }
        part
    }

    /// Partitions of the longest row the table can hold: the grid and the workspace.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn parts(&self) -> usize {
        self.capacity().div_ceil(self.partition())
    }
}

fn attn_dims(
    q: &Layout,
    k: &Layout,
    v: &Layout,
    tables: &Layout,
    lens: &Layout,
) -> candle_core::Result<AttnDims> {
    let &[batch, heads, head_dim] = q.dims() else {
        candle_core::bail!(
            "paged_decode_attention: q {:?} must be [batch, heads, head_dim]",
            q.dims()
        )
    };
    let &[num_blocks, kv_heads, block_size, kd] = k.dims() else {
        candle_core::bail!(
            "paged_decode_attention: k_cache {:?} must be [num_blocks, kv_heads, block_size, head_dim]",
            k.dims()
        )
    };
    if v.dims() != k.dims() || kd != head_dim {
        candle_core::bail!(
            "paged_decode_attention: k_cache {:?} and v_cache {:?} must be one shape with q's head_dim {head_dim}",
            k.dims(),
            v.dims()
        );
    }
    // A copy of a cache would cost more than the attention.
    if k.contiguous_offsets().is_none() || v.contiguous_offsets().is_none() {
        candle_core::bail!("paged_decode_attention: the caches must be contiguous");
    }
    if head_dim == 0 || head_dim % 32 != 0 || head_dim > 256 {
        candle_core::bail!(
            "paged_decode_attention: head_dim {head_dim} must be a multiple of 32 up to 256"
        );
    }
    if kv_heads == 0 || heads % kv_heads != 0 || heads / kv_heads > PAGED_ATTENTION_MAX_GROUP {
        candle_core::bail!(
            "paged_decode_attention: {heads} query heads over {kv_heads} kv heads (a whole group of at most {PAGED_ATTENTION_MAX_GROUP})"
        );
    }
    // The kernel finds a token's block with a shift and reads V four tokens of a block at a
    // time (paged caches use 16 or 32).
    if !block_size.is_power_of_two() || !(4..=PAGED_ATTENTION_PARTITION).contains(&block_size) {
        candle_core::bail!(
            "paged_decode_attention: block_size {block_size} must be a power of two from 4 to {PAGED_ATTENTION_PARTITION}"
        );
    }
    let max_blocks = tables.dims().get(1).copied().unwrap_or(0);
    if batch == 0 || tables.dims() != [batch, max_blocks] || max_blocks == 0 {
        candle_core::bail!(
            "paged_decode_attention: block_tables {:?} must be [{batch} >= 1, max_blocks >= 1]",
            tables.dims()
        );
    }
    if lens.dims() != [batch] {
        candle_core::bail!(
            "paged_decode_attention: seq_lens {:?} must be [{batch}]",
            lens.dims()
        );
    }
    Ok(AttnDims {
        batch,
        heads,
        kv_heads,
        group: heads / kv_heads,
        head_dim,
        num_blocks,
        block_size,
        max_blocks,
    })
}

/// One partition's result for a query group: per head the score max and sum of exp, and the
/// unnormalised output (`[group][head_dim]`).
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

/// The CPU twin of the two kernels for one (row, KV head): the output of its `group` query
/// heads into `out` (`[group][head_dim]`), with the kernels' partitions, per-lane sums, token
/// sets and combine order (see paged_attention.cu).
#[allow(clippy::too_many_arguments)]
fn decode_group<T: Float>(
    q: &[T],
    k: &[T],
    v: &[T],
    table: &[u32],
    len: usize,
    (b, h): (usize, usize),
    d: &AttnDims,
    scale: f32,
    out: &mut [T],
) {
    let (group, hd, bs) = (d.group, d.head_dim, d.block_size);
    if len == 0 {
        out.fill(T::from_f32(0.0));
        return;
    }
    let q0 = (b * d.heads + h * group) * hd;
    let qf: Vec<f32> = q[q0..q0 + group * hd].iter().map(|x| x.to_f32()).collect();
    let row = |cache: &'_ [T], t: usize| -> Vec<f32> {
        let at = ((table[t / bs] as usize * d.kv_heads + h) * bs + t % bs) * hd;
        cache[at..at + hd].iter().map(|x| x.to_f32()).collect()
    };
    let part = d.partition();
    let parts: Vec<Partial> = (0..len.div_ceil(part))
        .map(|p| {
            let start = p * part;
            let n = part.min(len - start);
            // 1. Scores: lane i of a token sums q·k over chunks i, i + 4, ... in order, then
            // the butterfly over the token's lanes.
            let mut s = vec![0f32; group * n];
            for j in 0..n {
                let kr = row(k, start + j);
                for g in 0..group {
                    let qg = &qf[g * hd..(g + 1) * hd];
                    let mut lanes = [0f32; SCORE_LANES];
                    for (lane, acc) in lanes.iter_mut().enumerate() {
                        for c in (lane..hd / CHUNK).step_by(SCORE_LANES) {
                            for i in c * CHUNK..(c + 1) * CHUNK {
                                *acc += qg[i] * kr[i];
                            }
                        }
                    }
                    s[g * n + j] = butterfly(lanes) * scale;
                }
            }
            // 2. Max, then exp(s - max) summed by lane (tokens l, l + 32, ...) and the butterfly.
            let (mut max, mut sum) = (vec![0f32; group], vec![0f32; group]);
            for g in 0..group {
                let sg = &mut s[g * n..(g + 1) * n];
                let m = sg.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut lanes = [0f32; 32];
                for (j, x) in sg.iter_mut().enumerate() {
                    *x = (*x - m).exp();
                    lanes[j % 32] += *x;
                }
                max[g] = m;
                sum[g] = butterfly(lanes);
            }
            // 3. p·V by token sets (set s: tokens [s q, s q + q), q = n / SETS rounded up to a
            // multiple of 4), the sets summed by the butterfly.
            let q4 = n.div_ceil(SETS).next_multiple_of(4);
            let mut sets = vec![0f32; SETS * group * hd];
            for j in 0..n {
                let vr = row(v, start + j);
                let set = j / q4;
                for g in 0..group {
                    let pj = s[g * n + j];
                    let a = &mut sets[(set * group + g) * hd..(set * group + g + 1) * hd];
                    for (a, x) in a.iter_mut().zip(&vr) {
                        *a += pj * x;
                    }
                }
            }
            let acc: Vec<f32> = (0..group * hd)
                .map(|i| {
                    butterfly(std::array::from_fn::<f32, SETS, _>(|set| {
                        sets[set * group * hd + i]
                    }))
                })
                .collect();
            Partial { max, sum, acc }
        })
        .collect();
    // Combine: weights exp(max_p - max), sums over the partitions in order.
    for g in 0..group {
        let m = parts
            .iter()
            .map(|p| p.max[g])
            .fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f32> = parts.iter().map(|p| (p.max[g] - m).exp()).collect();
        let l = parts
            .iter()
            .zip(&w)
            .fold(0f32, |l, (p, w)| l + p.sum[g] * w);
        for (c, o) in out[g * hd..(g + 1) * hd].iter_mut().enumerate() {
            let a = parts
                .iter()
                .zip(&w)
                .fold(0f32, |a, (p, w)| a + p.acc[g * hd + c] * w);
            *o = T::from_f32(a / l);
        }
    }
}

/// The CPU twin of [`paged_decode_attention`]: checks the lengths and table entries the
/// kernel trusts, then one [`decode_group`] per (row, KV head), in parallel.
fn decode_cpu<T: Float>(
    q: &[T],
    k: &[T],
    v: &[T],
    tables: &[u32],
    lens: &[u32],
    d: &AttnDims,
    scale: f32,
) -> candle_core::Result<Vec<T>> {
    for (r, &len) in lens.iter().enumerate() {
        let len = len as usize;
        if len > d.capacity() {
            candle_core::bail!(
                "paged_decode_attention: row {r} has {len} tokens, past its table's {}",
                d.capacity()
            );
        }
        let table = &tables[r * d.max_blocks..(r + 1) * d.max_blocks];
        if let Some(b) = table[..len.div_ceil(d.block_size)]
            .iter()
            .find(|&&b| b as usize >= d.num_blocks)
        {
            candle_core::bail!(
                "paged_decode_attention: row {r} reads block {b} of a cache of {}",
                d.num_blocks
            );
        }
    }
    let mut out = vec![T::from_f32(0.0); d.batch * d.heads * d.head_dim];
    out.par_chunks_mut(d.group * d.head_dim)
        .enumerate()
        .for_each(|(i, o)| {
            let (b, h) = (i / d.kv_heads, i % d.kv_heads);
            let table = &tables[b * d.max_blocks..(b + 1) * d.max_blocks];
            decode_group(q, k, v, table, lens[b] as usize, (b, h), d, scale, o);
        });
    Ok(out)
}

/// A u32 tensor's values on the host (the CPU path's tables and lengths).
fn host_u32(t: &Tensor) -> candle_core::Result<Vec<u32>> {
    if t.dtype() != DType::U32 {
        candle_core::bail!("paged_decode_attention: block_tables and seq_lens must be u32");
    }
    t.flatten_all()?.to_vec1()
}

impl CustomOp3 for PagedDecodeAttention {
    fn name(&self) -> &'static str {
        "fleet-paged-decode-attention"
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
        let d = attn_dims(
            l1,
            l2,
            l3,
            self.block_tables.layout(),
            self.seq_lens.layout(),
        )?;
        let (tables, lens) = (host_u32(&self.block_tables)?, host_u32(&self.seq_lens)?);
        let out = float_cpu!("paged_decode_attention", (s1, l1) => q, (s2, l2) => k, (s3, l3) => v;
            decode_cpu(q, k, v, &tables, &lens, &d, self.scale)?);
        Ok((out, l1.shape().clone()))
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
        use candle_core::backend::BackendStorage;
        let d = attn_dims(
            l1,
            l2,
            l3,
            self.block_tables.layout(),
            self.seq_lens.layout(),
        )?;
        if s1.dtype() != s2.dtype() || s1.dtype() != s3.dtype() {
            candle_core::bail!(
                "paged_decode_attention: q {:?}, k_cache {:?}, v_cache {:?} must share a dtype",
                s1.dtype(),
                s2.dtype(),
                s3.dtype()
            );
        }
        if self.block_tables.dtype() != DType::U32 || self.seq_lens.dtype() != DType::U32 {
            candle_core::bail!("paged_decode_attention: block_tables and seq_lens must be u32");
        }
        let out = cuda::decode_attention(self, &d, s1, l1, s2, l2, s3, l3)?;
        Ok((out, l1.shape().clone()))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout};
    use half::{bf16, f16};

    use super::super::cuda_util::*;
    use super::super::suffix;
    use super::{AttnDims, PagedDecodeAttention, WriteDims, THREADS};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/paged_attention.ptx"));
    const MODULE: &str = "fleet_paged_attention";

    pub(super) fn kv_write(
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
        d: &WriteDims,
    ) -> candle_core::Result<()> {
        fn run<T: CudaDType + DeviceRepr>(
            s1: &mut CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
            d: &WriteDims,
        ) -> candle_core::Result<()> {
            if d.tokens == 0 {
                return Ok(());
            }
            let dev = s1.device().clone();
            let Some((a, b)) = l1.contiguous_offsets() else {
                candle_core::bail!("paged_kv_write: the cache must be contiguous")
            };
            // `new` is read through its strides from its first element on.
            let src = s2.as_cuda_slice::<T>()?.slice(l2.start_offset()..);
            let slots = input::<u32>(s3, l3)?;
            let func = dev.get_or_load_custom_func(
                &format!("paged_kv_write_{}", suffix(s1.dtype())?),
                MODULE,
                PTX,
            )?;
            let mut cache = s1.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
            let cfg = LaunchConfig {
                grid_dim: (d.tokens as u32, 1, 1),
                block_dim: ((d.kv_heads * d.head_dim).clamp(32, 256) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut bld = func.builder();
            bld.arg(&mut cache);
            bld.arg(&src);
            bld.arg(&slots);
            let (kvh, bs, hd) = (d.kv_heads as i32, d.block_size as i32, d.head_dim as i32);
            bld.arg(&kvh);
            bld.arg(&bs);
            bld.arg(&hd);
            let st = l2.stride();
            let longs = [d.num_slots as i64, st[0] as i64, st[1] as i64, st[2] as i64];
            for a in &longs {
                bld.arg(a);
            }
            // SAFETY: one block per token reads its row of `new` through the layout's strides
            // (inside its storage) and writes kv_heads * head_dim elements of one slot of the
            // cache, a slot the kernel checks against num_slots.
            unsafe { bld.launch(cfg) }.w()?;
            Ok(())
        }
        match s1.dtype() {
            DType::F32 => run::<f32>(s1, l1, s2, l2, s3, l3, d),
            DType::F16 => run::<f16>(s1, l1, s2, l2, s3, l3, d),
            DType::BF16 => run::<bf16>(s1, l1, s2, l2, s3, l3, d),
            other => candle_core::bail!("paged_kv_write: unsupported dtype {other:?}"),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn decode_attention(
        op: &PagedDecodeAttention,
        d: &AttnDims,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + DeviceRepr>(
            op: &PagedDecodeAttention,
            d: &AttnDims,
            s1: &CudaStorage,
            l1: &Layout,
            s2: &CudaStorage,
            l2: &Layout,
            s3: &CudaStorage,
            l3: &Layout,
        ) -> candle_core::Result<CudaStorage> {
            let dev = s1.device().clone();
            let (q, kc, vc) = (
                input::<T>(s1, l1)?,
                input::<T>(s2, l2)?,
                input::<T>(s3, l3)?,
            );
            let (ts, tl) = op.block_tables.storage_and_layout();
            let tables = input::<u32>(
                held("paged_decode_attention", "block_tables", &ts, &dev)?,
                tl,
            )?;
            let (ls, ll) = op.seq_lens.storage_and_layout();
            let lens = input::<u32>(held("paged_decode_attention", "seq_lens", &ls, &dev)?, ll)?;
            // The kernel reads K and V rows in 16-byte words.
            let width = s1.dtype().size_in_bytes();
            let aligned = |l: &Layout| (l.start_offset() * width).is_multiple_of(16);
            if !aligned(l2) || !aligned(l3) {
                candle_core::bail!("paged_decode_attention: the caches must start 16-byte aligned");
            }
            let sfx = suffix(s1.dtype())?;
            let (part, n_parts) = (d.partition(), d.parts());
            let rows = d.batch * d.heads;
            // The combine kernel holds a weight and a sum per partition in shared memory.
            if n_parts * 8 > 48 * 1024 {
                candle_core::bail!(
                    "paged_decode_attention: {} tokens per row is past the {} the combine holds",
                    d.capacity(),
                    48 * 1024 / 8 * part
                );
            }
            // Sized from shapes only; partitions past a row's length are neither written nor read.
            // SAFETY: pass 1 writes every entry pass 2 reads.
            let ws_max: CudaSlice<f32> = unsafe { dev.alloc::<f32>(rows * n_parts)? };
            let ws_sum: CudaSlice<f32> = unsafe { dev.alloc::<f32>(rows * n_parts)? };
            let ws_out: CudaSlice<f32> = unsafe { dev.alloc::<f32>(rows * n_parts * d.head_dim)? };
            // SAFETY: pass 2 writes every output element (zeros for inactive rows).
            let out: CudaSlice<T> = unsafe { dev.alloc::<T>(rows * d.head_dim)? };

            // The tensor-core kernel where it applies (its q loads are 16 bytes wide).
            let mma = super::PAGED_MMA.on()
                && matches!(s1.dtype(), DType::BF16 | DType::F16)
                && matches!(d.head_dim, 64 | 128)
                && d.group <= 8
                && aligned(l1);
            let (name, smem) = if mma {
                // Scores of 8 heads, then their max and sum.
                let name = format!("paged_attn_partition_mma_{sfx}_d{}", d.head_dim);
                (name, (8 * part + 16) * 4)
            } else {
                // The smallest group bound the kernels are built for (their accumulators).
                let bound = [2, 4, 8, 16]
                    .into_iter()
                    .find(|&g| d.group <= g)
                    .unwrap_or(16);
                let name = format!("paged_attn_partition_{sfx}_e{}_g{bound}", d.head_dim / 32);
                // q and scores of the group, then its max and sum: 33 KiB at most (group 16,
                // D 256).
                let smem = (d.group * d.head_dim + d.group * part + 2 * d.group) * 4;
                (name, smem)
            };
            let func = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
            let cfg = LaunchConfig {
                grid_dim: (n_parts as u32, d.kv_heads as u32, d.batch as u32),
                block_dim: (THREADS as u32, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            let mut bld = func.builder();
            bld.arg(&q);
            bld.arg(&kc);
            bld.arg(&vc);
            bld.arg(&tables);
            bld.arg(&lens);
            bld.arg(&ws_max);
            bld.arg(&ws_sum);
            bld.arg(&ws_out);
            let ints = [
                d.kv_heads as i32,
                d.group as i32,
                d.block_size.trailing_zeros() as i32,
                d.max_blocks as i32,
                n_parts as i32,
                part as i32,
            ];
            for a in &ints {
                bld.arg(a);
            }
            bld.arg(&op.scale);
            // SAFETY: each block reads q's group, the K/V rows of the blocks its row's table
            // names for its partition's tokens (the length clamped to the table), and writes
            // its partition's workspace entries; shared memory as sized above.
            unsafe { bld.launch(cfg) }.w()?;

            let func =
                dev.get_or_load_custom_func(&format!("paged_attn_combine_{sfx}"), MODULE, PTX)?;
            let cfg = LaunchConfig {
                grid_dim: (d.heads as u32, d.batch as u32, 1),
                block_dim: (d.head_dim.min(128) as u32, 1, 1),
                // Rounded to 16 bytes: the compiler reads the weights four at a time.
                shared_mem_bytes: (2 * n_parts.next_multiple_of(4) * 4) as u32,
            };
            let mut bld = func.builder();
            bld.arg(&ws_max);
            bld.arg(&ws_sum);
            bld.arg(&ws_out);
            bld.arg(&lens);
            bld.arg(&out);
            let ints = [
                d.heads as i32,
                d.head_dim as i32,
                d.capacity() as i32,
                n_parts as i32,
                part as i32,
            ];
            for a in &ints {
                bld.arg(a);
            }
            // SAFETY: one block per (query head, row) reads the partitions its row's length
            // covers and writes the head's head_dim outputs.
            unsafe { bld.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
        match s1.dtype() {
            DType::F32 => run::<f32>(op, d, s1, l1, s2, l2, s3, l3),
            DType::F16 => run::<f16>(op, d, s1, l1, s2, l2, s3, l3),
            DType::BF16 => run::<bf16>(op, d, s1, l1, s2, l2, s3, l3),
            other => candle_core::bail!("paged_decode_attention: unsupported dtype {other:?}"),
        }
    }
}
