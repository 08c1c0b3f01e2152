//! The paged KV cache ops of `fleet_models::ops`: `paged_kv_write` writes exactly the slots it
//! is given, and `paged_decode_attention`'s CPU twin equals attention composed from plain candle
//! ops (`paged_decode_attention_reference`) on shuffled block tables, lengths around the block
//! and partition sizes, inactive rows and GQA groups. With `--features cuda` on a machine with a
//! GPU, the kernels are checked against the twins (bit for bit for the write).

use candle_core::{DType, Device, Tensor};
use fleet_models::ops;

// One helper of it: the GPU tests' entry.
#[allow(dead_code)]
mod devices;
#[cfg(feature = "cuda")]
use devices::gpu_or_skip;

// ---------------------------------------------------------------------------------------------
// Deterministic random data and paged layouts.

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

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform().max(1e-300), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    fn tensor(&mut self, shape: &[usize], std: f32, dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| std * self.normal()).collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// Inputs of one decode attention call, on the CPU.
struct Case {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tables: Tensor,
    lens: Tensor,
    scale: f32,
}

impl Case {
    /// `lens.len()` rows of `heads` query heads over `kvh` KV heads of `d` dims, in a cache of
    /// `block_size`-token blocks (random contents, spare blocks too) handed out to the rows in
    /// shuffled order; a row's table entries past its length are `u32::MAX`, so reading one
    /// would fault on the GPU.
    #[allow(clippy::too_many_arguments)]
    fn new(
        rng: &mut Rng,
        dtype: DType,
        (heads, kvh): (usize, usize),
        d: usize,
        block_size: usize,
        lens: &[usize],
    ) -> Self {
        let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(block_size)).collect();
        let max_blocks = need.iter().copied().max().unwrap_or(0) + 1;
        let total = need.iter().sum::<usize>() + 3;
        let mut ids: Vec<u32> = (0..total as u32).collect();
        rng.shuffle(&mut ids);
        let mut tables = vec![u32::MAX; lens.len() * max_blocks];
        let mut next = ids.into_iter();
        for (r, &n) in need.iter().enumerate() {
            for e in &mut tables[r * max_blocks..r * max_blocks + n] {
                *e = next.next().unwrap();
            }
        }
        let lens32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        Case {
            q: rng.tensor(&[lens.len(), heads, d], 2.0, dtype),
            k: rng.tensor(&[total, kvh, block_size, d], 1.0, dtype),
            v: rng.tensor(&[total, kvh, block_size, d], 1.0, dtype),
            tables: Tensor::from_vec(tables, (lens.len(), max_blocks), &Device::Cpu).unwrap(),
            lens: Tensor::new(lens32.as_slice(), &Device::Cpu).unwrap(),
            scale: 1.0 / (d as f32).sqrt(),
        }
    }

    fn to(&self, dev: &Device) -> Self {
        let m = |t: &Tensor| t.to_device(dev).unwrap();
        Case {
            q: m(&self.q),
            k: m(&self.k),
            v: m(&self.v),
            tables: m(&self.tables),
            lens: m(&self.lens),
            scale: self.scale,
        }
    }

    fn fused(&self) -> Tensor {
        ops::paged_decode_attention(
            &self.q,
            &self.k,
            &self.v,
            &self.tables,
            &self.lens,
            self.scale,
        )
        .unwrap()
    }

    fn reference(&self) -> Tensor {
        ops::paged_decode_attention_reference(
            &self.q,
            &self.k,
            &self.v,
            &self.tables,
            &self.lens,
            self.scale,
        )
        .unwrap()
    }
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `(max |a - b|, max |b|)`.
fn diff_and_scale(a: &Tensor, b: &Tensor) -> (f32, f32) {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (f32s(a), f32s(b));
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    (diff, b.iter().map(|x| x.abs()).fold(0f32, f32::max))
}

/// Asserts `got` is within `tol` of `want` relative to want's largest value, and reports it.
fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    let (diff, scale) = diff_and_scale(got, want);
    eprintln!(
        "{what}: max diff {diff:.2e} (scale {scale:.2e}, {:.2e} relative)",
        diff / scale
    );
    assert!(
        diff <= tol * scale.max(1e-3),
        "{what}: max diff {diff} over {tol} x scale {scale}"
    );
}

/// Rows of length 0 are exactly zero.
fn assert_inactive_rows_zero(what: &str, out: &Tensor, lens: &[usize]) {
    for (r, &len) in lens.iter().enumerate() {
        if len == 0 {
            let row = f32s(&out.get(r).unwrap());
            assert!(
                row.iter().all(|&x| x == 0.0),
                "{what}: inactive row {r} is not zeros"
            );
        }
    }
}

/// One ulp-ish of the dtype, relative to the output's scale.
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1e-2,
    }
}

// ---------------------------------------------------------------------------------------------
// CPU: the twin against the reference.

/// Lengths around the block size and past one partition, an inactive row, in batches of 1..9.
fn length_sets(block_size: usize) -> Vec<Vec<usize>> {
    let bs = block_size;
    vec![
        vec![1],
        vec![bs - 1, 0, bs + 1],
        vec![bs, 700],
        vec![1, bs - 1, bs, bs + 1, 0, 700, 1100, 257, 33],
    ]
}

#[test]
fn twin_matches_reference() {
    let mut rng = Rng(1);
    // Groups 1, 2 and 7 (Qwen2.5-0.5B's 14 heads over 2).
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (heads, kvh) in [(4, 4), (8, 4), (14, 2)] {
            for (d, bs) in [(64, 16), (128, 16), (128, 32)] {
                for lens in length_sets(bs) {
                    let c = Case::new(&mut rng, dtype, (heads, kvh), d, bs, &lens);
                    let (got, want) = (c.fused(), c.reference());
                    assert_eq!(got.dtype(), dtype);
                    let what = format!("{dtype:?} h{heads}/{kvh} d{d} bs{bs} lens {lens:?}");
                    assert_close(&what, &got, &want, tolerance(dtype));
                    assert_inactive_rows_zero(&what, &got, &lens);
                }
            }
        }
    }
}

/// Every head_dim the kernel takes is a multiple of 32 up to 256; group 16 is the largest.
#[test]
fn twin_matches_reference_for_other_head_dims_and_groups() {
    let mut rng = Rng(2);
    for (d, heads, kvh) in [(32, 2, 1), (96, 6, 3), (256, 8, 2), (128, 16, 1)] {
        let lens = [300, 17, 0];
        let c = Case::new(&mut rng, DType::F32, (heads, kvh), d, 16, &lens);
        let what = format!("f32 h{heads}/{kvh} d{d}");
        assert_close(&what, &c.fused(), &c.reference(), 1e-5);
    }
}

/// A row whose table names the same `base` blocks `r` times attends over `r` copies of the same
/// keys and values: the same softmax, so the same output, whether it spans one partition or
/// seventeen.
fn repeated_blocks_case(rng: &mut Rng, dtype: DType, repeats: &[usize]) -> (Case, Vec<usize>) {
    let (heads, kvh, d, bs, base) = (8, 2, 128, 16, 6);
    let max_blocks = base * repeats.iter().max().unwrap();
    let mut tables = vec![u32::MAX; repeats.len() * max_blocks];
    let mut ids: Vec<u32> = (0..base as u32 + 2).collect();
    rng.shuffle(&mut ids);
    for (r, &n) in repeats.iter().enumerate() {
        for i in 0..n * base {
            tables[r * max_blocks + i] = ids[i % base];
        }
    }
    let lens: Vec<usize> = repeats.iter().map(|&n| n * base * bs).collect();
    let lens32: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
    // Every row's query is the same, so every row's output is too.
    let q = rng.tensor(&[1, heads, d], 2.0, dtype);
    let case = Case {
        q: q.repeat((repeats.len(), 1, 1)).unwrap(),
        k: rng.tensor(&[base + 2, kvh, bs, d], 1.0, dtype),
        v: rng.tensor(&[base + 2, kvh, bs, d], 1.0, dtype),
        tables: Tensor::from_vec(tables, (repeats.len(), max_blocks), &Device::Cpu).unwrap(),
        lens: Tensor::new(lens32.as_slice(), &Device::Cpu).unwrap(),
        scale: 1.0 / (d as f32).sqrt(),
    };
    (case, lens)
}

/// Rows spanning 1, 3, 5 and 17 partitions give the one-partition row's output (and the
/// reference's) up to float rounding.
fn check_partition_independence(dev: &Device) {
    let mut rng = Rng(3);
    let repeats = [1, 8, 13, 43]; // 96, 768, 1248, 4128 tokens
    let (case, lens) = repeated_blocks_case(&mut rng, DType::F32, &repeats);
    let case = case.to(dev);
    let got = case.fused();
    let first = got.get(0).unwrap();
    for (r, len) in lens.iter().enumerate().skip(1) {
        let what = format!("{dev:?}: {len} tokens vs 96");
        assert_close(&what, &got.get(r).unwrap(), &first, 1e-5);
    }
    assert_close(
        &format!("{dev:?}: vs reference"),
        &got,
        &case.reference(),
        1e-5,
    );
}

#[test]
fn result_does_not_depend_on_partitions() {
    check_partition_independence(&Device::Cpu);
}

/// Bad inputs are refused with a message, not read out of bounds.
#[test]
fn decode_attention_refuses_bad_inputs() {
    let mut rng = Rng(4);
    let c = Case::new(&mut rng, DType::F32, (4, 2), 64, 16, &[20, 5]);
    let run = |lens: &[u32], tables: &Tensor| {
        let lens = Tensor::new(lens, &Device::Cpu).unwrap();
        ops::paged_decode_attention(&c.q, &c.k, &c.v, tables, &lens, c.scale)
    };
    // Longer than the table holds; a table entry past the cache.
    assert!(run(&[20, 1000], &c.tables).is_err());
    let bad = Tensor::new(&[[0u32, 1], [99, 0]], &Device::Cpu).unwrap();
    assert!(run(&[20, 5], &bad).is_err());
    // head_dim not a multiple of 32; a group past 16.
    let q = rng.tensor(&[2, 4, 40], 1.0, DType::F32);
    let k = rng.tensor(&[4, 2, 16, 40], 1.0, DType::F32);
    assert!(ops::paged_decode_attention(&q, &k, &k, &c.tables, &c.lens, 1.0).is_err());
    let q = rng.tensor(&[2, 34, 64], 1.0, DType::F32);
    assert!(ops::paged_decode_attention(&q, &c.k, &c.v, &c.tables, &c.lens, 1.0).is_err());
}

// ---------------------------------------------------------------------------------------------
// paged_kv_write

/// A cache, new rows (a strided view of a wider tensor, as k sits in a fused projection) and
/// slots with padding rows; the expected cache computed by hand.
struct WriteCase {
    cache: Tensor,
    new: Tensor,
    slots: Vec<u32>,
}

fn write_case(rng: &mut Rng, dtype: DType) -> WriteCase {
    let (blocks, kvh, bs, d, tokens) = (6, 2, 16, 64, 7);
    // Layer 1 of a [2, ...] cache: a contiguous view that does not start at 0.
    let cache = rng
        .tensor(&[2, blocks, kvh, bs, d], 1.0, dtype)
        .get(1)
        .unwrap();
    // Offset by 100 so that no written value equals the one it replaces.
    let wide = rng
        .tensor(&[tokens, 3 * kvh, d], 1.0, DType::F32)
        .affine(1.0, 100.0)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let new = wide.narrow(1, kvh, kvh).unwrap();
    assert!(!new.is_contiguous());
    let slots = vec![3, u32::MAX, 17, 0, (blocks * bs - 1) as u32, u32::MAX, 40];
    WriteCase { cache, new, slots }
}

/// The cache after the write, computed element by element from `new`'s values.
fn expected_write(c: &WriteCase) -> Vec<f32> {
    let (_, kvh, bs, d) = c.cache.dims4().unwrap();
    let mut want = f32s(&c.cache);
    let new = f32s(&c.new.contiguous().unwrap());
    for (t, &slot) in c.slots.iter().enumerate() {
        if slot == u32::MAX {
            continue;
        }
        let (blk, off) = (slot as usize / bs, slot as usize % bs);
        for h in 0..kvh {
            for i in 0..d {
                want[((blk * kvh + h) * bs + off) * d + i] = new[(t * kvh + h) * d + i];
            }
        }
    }
    want
}

#[test]
fn kv_write_writes_exactly_the_slots_given() {
    let mut rng = Rng(5);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let c = write_case(&mut rng, dtype);
        let want = expected_write(&c);
        let before = f32s(&c.cache);
        let slots = Tensor::new(c.slots.as_slice(), &Device::Cpu).unwrap();
        ops::paged_kv_write(&c.cache, &c.new, &slots).unwrap();
        let got = f32s(&c.cache);
        assert_eq!(got, want, "{dtype:?}: the cache after the write");
        let changed = got.iter().zip(&before).filter(|(a, b)| a != b).count();
        // Five tokens written (two skipped), 2 heads x 64 dims each.
        assert_eq!(changed, 5 * 2 * 64, "{dtype:?}: elements changed");
    }
}

#[test]
fn kv_write_refuses_a_slot_past_the_cache_and_writes_nothing() {
    let mut rng = Rng(6);
    let c = write_case(&mut rng, DType::F32);
    let before = f32s(&c.cache);
    let mut slots = c.slots.clone();
    slots[5] = 6 * 16; // one past the last slot
    let slots = Tensor::new(slots.as_slice(), &Device::Cpu).unwrap();
    assert!(ops::paged_kv_write(&c.cache, &c.new, &slots).is_err());
    assert_eq!(f32s(&c.cache), before);
    // A dtype mismatch and a shape mismatch.
    let slots = Tensor::new(c.slots.as_slice(), &Device::Cpu).unwrap();
    let new16 = c.new.to_dtype(DType::BF16).unwrap();
    assert!(ops::paged_kv_write(&c.cache, &new16, &slots).is_err());
    assert!(ops::paged_kv_write(&c.cache, &c.new.narrow(0, 0, 3).unwrap(), &slots).is_err());
}

// ---------------------------------------------------------------------------------------------
// CUDA: the kernels against the twins (with `--features cuda`, on a machine with a GPU).

/// The per-lane partition kernel (`FLEET_PAGED_MMA` forced off here: it stays the path for
/// f32, other head dims and larger groups): every dtype, head_dim 64 and 128, groups 1, 2, 7
/// and 4, block sizes 16 and 32, batches of 1, 8 and 64 with lengths up to 4100 (17
/// partitions).
#[cfg(feature = "cuda")]
#[test]
fn gpu_decode_attention_matches_twin() {
    let Some(gpu) = gpu_or_skip("gpu_decode_attention_matches_twin") else {
        return;
    };
    ops::set_paged_mma(Some(false));
    let mut rng = Rng(7);
    let mut case_index = 0;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for d in [64, 128] {
            for (heads, kvh) in [(4, 4), (8, 4), (14, 2), (32, 8)] {
                for bs in [16, 32] {
                    let lens: Vec<usize> = match case_index % 3 {
                        0 => vec![4100],
                        1 => vec![0, 1, bs - 1, bs, bs + 1, 700, 2049, 4100],
                        _ => (0..64)
                            .map(|i| match i {
                                0 => 0,
                                1 => 1,
                                2 => 257,
                                _ => rng.below(600),
                            })
                            .collect(),
                    };
                    case_index += 1;
                    let cpu = Case::new(&mut rng, dtype, (heads, kvh), d, bs, &lens);
                    let want = cpu.fused();
                    let got = cpu.to(&gpu).fused();
                    assert_eq!(got.dtype(), dtype);
                    let what = format!(
                        "gpu {dtype:?} d{d} h{heads}/{kvh} bs{bs} batch {}",
                        lens.len()
                    );
                    let tol = if dtype == DType::F32 { 2e-6 } else { 1e-2 };
                    assert_close(&what, &got, &want, tol);
                    assert_inactive_rows_zero(&what, &got, &lens);
                }
            }
        }
    }
    ops::set_paged_mma(None);
}

/// The tensor-core partition kernel (`FLEET_PAGED_MMA`, forced on here) against the twin:
/// bf16 and f16, head_dim 64 and 128, groups 1, 2, 4, 7 and 8 (the judges' and Qwen2.5's), block
/// sizes 16 and 32, lengths across tiles and partitions (to 4100), inactive rows, and a row
/// whose K and V repeat over 1 to 43 partitions (the same output). It must differ from the
/// per-lane kernel somewhere (other sums, p rounded to the dtype): otherwise the switch did
/// not take it.
#[cfg(feature = "cuda")]
#[test]
fn gpu_mma_decode_attention_matches_twin() {
    let Some(gpu) = gpu_or_skip("gpu_mma_decode_attention_matches_twin") else {
        return;
    };
    let mut rng = Rng(11);
    let mut case_index = 0;
    let mut differs = false;
    for dtype in [DType::BF16, DType::F16] {
        for d in [64, 128] {
            for (heads, kvh) in [(4, 4), (8, 4), (32, 8), (14, 2), (32, 4)] {
                for bs in [16, 32] {
                    let lens: Vec<usize> = match case_index % 3 {
                        0 => vec![4100, 15],
                        1 => vec![0, 1, bs - 1, bs, bs + 1, 17, 700, 2049, 4100],
                        _ => (0..48)
                            .map(|i| match i {
                                0 => 0,
                                1 => 1,
                                2 => 257,
                                _ => rng.below(2300),
                            })
                            .collect(),
                    };
                    case_index += 1;
                    let cpu = Case::new(&mut rng, dtype, (heads, kvh), d, bs, &lens);
                    let want = cpu.fused();
                    let on_gpu = cpu.to(&gpu);
                    ops::set_paged_mma(Some(false));
                    let per_lane = on_gpu.fused();
                    ops::set_paged_mma(Some(true));
                    let got = on_gpu.fused();
                    let again = on_gpu.fused();
                    ops::set_paged_mma(None);
                    let what = format!(
                        "gpu mma {dtype:?} d{d} h{heads}/{kvh} bs{bs} batch {}",
                        lens.len()
                    );
                    assert_eq!(f32s(&got), f32s(&again), "{what}: not repeatable");
                    assert_close(&what, &got, &want, 1e-2);
                    assert_inactive_rows_zero(&what, &got, &lens);
                    differs |= f32s(&got) != f32s(&per_lane);
                }
            }
        }
    }
    assert!(
        differs,
        "the tensor-core kernel gave the per-lane kernel's bits everywhere"
    );
    // One partition or seventeen: the same softmax over repeated blocks (bf16 here).
    let (case, lens) = repeated_blocks_case(&mut rng, DType::BF16, &[1, 8, 13, 43]);
    let case = case.to(&gpu);
    ops::set_paged_mma(Some(true));
    let got = case.fused();
    ops::set_paged_mma(None);
    let first = got.get(0).unwrap();
    for (r, len) in lens.iter().enumerate().skip(1) {
        assert_close(
            &format!("mma: {len} tokens vs 96"),
            &got.get(r).unwrap(),
            &first,
            1e-2,
        );
    }
}

/// The other head_dims the kernel instantiates, and the largest group.
#[cfg(feature = "cuda")]
#[test]
fn gpu_decode_attention_other_head_dims() {
    let Some(gpu) = gpu_or_skip("gpu_decode_attention_other_head_dims") else {
        return;
    };
    let mut rng = Rng(8);
    for (d, heads, kvh) in [
        (32, 2, 1),
        (96, 6, 3),
        (160, 4, 2),
        (256, 8, 2),
        (128, 16, 1),
    ] {
        let lens = [1300, 17, 0, 256];
        let cpu = Case::new(&mut rng, DType::BF16, (heads, kvh), d, 16, &lens);
        let what = format!("gpu bf16 h{heads}/{kvh} d{d}");
        assert_close(&what, &cpu.to(&gpu).fused(), &cpu.fused(), 1e-2);
    }
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_result_does_not_depend_on_partitions() {
    let Some(gpu) = gpu_or_skip("gpu_result_does_not_depend_on_partitions") else {
        return;
    };
    check_partition_independence(&gpu);
}

#[cfg(feature = "cuda")]
#[test]
fn gpu_kv_write_equals_cpu_bit_for_bit() {
    let Some(gpu) = gpu_or_skip("gpu_kv_write_equals_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = Rng(9);
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let c = write_case(&mut rng, dtype);
        let want = expected_write(&c);
        let slots = Tensor::new(c.slots.as_slice(), &Device::Cpu).unwrap();
        // The same views on the GPU: layer 1 of the cache, the narrowed rows.
        let cache_gpu = c
            .cache
            .unsqueeze(0)
            .unwrap()
            .repeat((2, 1, 1, 1, 1))
            .unwrap()
            .to_device(&gpu)
            .unwrap();
        let cache_gpu = cache_gpu.get(1).unwrap();
        let wide = Tensor::cat(&[&c.new, &c.new, &c.new], 1)
            .unwrap()
            .to_device(&gpu)
            .unwrap();
        let (_, kvh, _) = c.new.dims3().unwrap();
        let new_gpu = wide.narrow(1, kvh, kvh).unwrap();
        ops::paged_kv_write(&c.cache, &c.new, &slots).unwrap();
        ops::paged_kv_write(&cache_gpu, &new_gpu, &slots.to_device(&gpu).unwrap()).unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            let t = t.to_device(&Device::Cpu).unwrap().flatten_all().unwrap();
            match dtype {
                DType::F32 => t
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
                DType::BF16 => t
                    .to_vec1::<half::bf16>()
                    .unwrap()
                    .iter()
                    .map(|x| u32::from(x.to_bits()))
                    .collect(),
                _ => t
                    .to_vec1::<half::f16>()
                    .unwrap()
                    .iter()
                    .map(|x| u32::from(x.to_bits()))
                    .collect(),
            }
        };
        assert_eq!(
            bits(&cache_gpu),
            bits(&c.cache),
            "{dtype:?}: gpu cache vs cpu cache"
        );
        assert_eq!(f32s(&c.cache), want, "{dtype:?}: cpu cache vs by hand");
    }
}

/// The kernels' time at two decode shapes, bf16, the per-lane first pass and the tensor-core
/// one (`FLEET_PAGED_MMA`): Qwen2.5-7B's (28 heads over 4, head_dim 128), batch 64 at 2048
/// tokens a row, and the 30B-A3B judge's (32 over 4), batch 96 at 2,270. Reported, not asserted
/// (a diagnostic beside the benches: K and V are read once, so the rate is the cache bytes over
/// the time).
#[cfg(feature = "cuda")]
#[test]
fn gpu_decode_attention_rate() {
    let Some(gpu) = gpu_or_skip("gpu_decode_attention_rate") else {
        return;
    };
    for (batch, heads, kvh, len) in [(64, 28, 4, 2048), (96, 32, 4, 2272)] {
        let (d, bs) = (128, 16);
        let blocks = batch * len / bs;
        let r = |s: &[usize]| {
            Tensor::randn(0f32, 1.0, s, &gpu)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap()
        };
        let (q, k, v) = (
            r(&[batch, heads, d]),
            r(&[blocks, kvh, bs, d]),
            r(&[blocks, kvh, bs, d]),
        );
        let per_row = len / bs;
        let tables: Vec<u32> = (0..blocks as u32).rev().collect();
        let tables = Tensor::from_vec(tables, (batch, per_row), &gpu).unwrap();
        let lens = Tensor::new(vec![len as u32; batch].as_slice(), &gpu).unwrap();
        let run = || ops::paged_decode_attention(&q, &k, &v, &tables, &lens, 0.088).unwrap();
        for mma in [false, true] {
            ops::set_paged_mma(Some(mma));
            run();
            gpu.synchronize().unwrap();
            let iters = 50;
            let t = std::time::Instant::now();
            for _ in 0..iters {
                run();
            }
            gpu.synchronize().unwrap();
            ops::set_paged_mma(None);
            let secs = t.elapsed().as_secs_f64() / iters as f64;
            let bytes = (2 * blocks * kvh * bs * d * 2) as f64;
            eprintln!(
                "paged decode attention{}, batch {batch} x {len} tokens, {heads}/{kvh} heads, \
                 d 128, bf16: {:.1} us, {:.0} GB/s of K/V",
                if mma { " (tensor cores)" } else { "" },
                secs * 1e6,
                bytes / secs / 1e9
            );
        }
    }
}
