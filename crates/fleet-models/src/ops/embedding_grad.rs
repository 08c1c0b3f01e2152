//! The embedding's backward added to its gradient sum in place, one kernel: the rows of each
//! distinct token id summed in order, then added to that id's row.

use candle_core::{CpuStorage, Layout, Tensor};

use super::*;
use crate::error::{ModelError, Result};

/// `acc[ids[j]] += g[j]` for every row `j` of `g` (`[ids.len(), hidden]`), `acc` the
/// embedding's gradient sum `[vocab, hidden]`, in place: the rows of each distinct id summed
/// in f32 in row order, the sum rounded to `acc`'s dtype and added to its row (that rounded
/// too) — the arithmetic of an f32 `index_add` into per-id sums, a cast and a `scatter_add`,
/// which is what the trainer ran before (candle's kernels for those two walk every index for
/// every output row: 7.7 ms of a 1.5B micro-step). The grouping is made on the host from
/// `ids`; one kernel on CUDA, the twin on the CPU. No gradient.
pub fn embedding_grad_add_(acc: &Tensor, g: &Tensor, ids: &[u32]) -> Result<()> {
    let (vocab, hs) = acc.dims2()?;
    if g.dims() != [ids.len(), hs] || !acc.is_contiguous() {
        return Err(ModelError::BadInput(format!(
            "embedding_grad_add_: gradient {:?} for {} ids into a sum {:?} (contiguous: {})",
            g.dims(),
            ids.len(),
            acc.dims(),
            acc.is_contiguous()
        )));
    }
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(ModelError::BadInput(format!(
            "embedding_grad_add_: token id {bad} is past the vocabulary of {vocab}"
        )));
    }
    let (packed, n_distinct) = group_rows(ids);
    let packed = Tensor::from_vec(packed, ids.len() + 2 * n_distinct + 1, acc.device())?;
    let op = EmbeddingGradAdd {
        n_distinct,
        n_rows: ids.len(),
    };
    Ok(acc.inplace_op3(&contig(g)?, &packed, &op)?)
}

/// Whether the trainer adds the embedding's gradient with [`embedding_grad_add_`] instead of
/// candle's `index_add` and `scatter_add`: on by default (`FLEET_EMBED_GRAD_KERNEL=0` turns it
/// off), or as [`set_embedding_grad_kernel`] sets it. The same sums either way.
pub fn embedding_grad_kernel() -> bool {
    KERNEL.on()
}

/// Test switch for [`embedding_grad_kernel`]: `Some(on)` forces it, `None` leaves it to the
/// environment.
pub fn set_embedding_grad_kernel(on: Option<bool>) {
    KERNEL.force(on);
}

static KERNEL: EnvSwitch = EnvSwitch::new("FLEET_EMBED_GRAD_KERNEL", true);

/// The distinct ids of `ids` in order of first appearance, and each id's index among them:
/// the grouping of an embedding's backward (this kernel's, and the trainer's index_add path).
pub fn distinct_slots(ids: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let mut slot_of: std::collections::HashMap<u32, u32> = Default::default();
    let mut distinct: Vec<u32> = Vec::new();
    let slots = ids
        .iter()
        .map(|&id| {
            *slot_of.entry(id).or_insert_with(|| {
                distinct.push(id);
                (distinct.len() - 1) as u32
            })
        })
        .collect();
    (distinct, slots)
}

/// Rows grouped by id, ids in order of first appearance: `offsets` (`n_distinct + 1`), the
/// rows of each id in increasing order, then the ids, as one array; and `n_distinct`.
fn group_rows(ids: &[u32]) -> (Vec<u32>, usize) {
    let (distinct, slots) = distinct_slots(ids);
    let mut rows_of: Vec<Vec<u32>> = vec![Vec::new(); distinct.len()];
    for (j, &s) in slots.iter().enumerate() {
        rows_of[s as usize].push(j as u32);
    }
    let mut packed = Vec::with_capacity(ids.len() + 2 * distinct.len() + 1);
    let mut at = 0u32;
    packed.push(0);
    for rows in &rows_of {
        at += rows.len() as u32;
        packed.push(at);
    }
    packed.extend(rows_of.iter().flatten());
    packed.extend(&distinct);
    (packed, distinct.len())
}

struct EmbeddingGradAdd {
    n_distinct: usize,
    n_rows: usize,
}

/// The twin: per id, the rows' f32 sum in order, rounded to `T`, added to the row of `acc`.
fn embedding_grad_add_cpu<T: Float, G: Float>(
    acc: &mut [T],
    g: &[G],
    packed: &[u32],
    (n_distinct, n_rows, hs): (usize, usize, usize),
) {
    let (offsets, rest) = packed.split_at(n_distinct + 1);
    let (rows, ids) = rest.split_at(n_rows);
    let mut sum = vec![0f32; hs];
    for d in 0..n_distinct {
        sum.iter_mut().for_each(|v| *v = 0.0);
        for &r in &rows[offsets[d] as usize..offsets[d + 1] as usize] {
            let row = &g[r as usize * hs..(r as usize + 1) * hs];
            for (s, v) in sum.iter_mut().zip(row) {
                *s += v.to_f32();
            }
        }
        let dst = &mut acc[ids[d] as usize * hs..(ids[d] as usize + 1) * hs];
        for (a, s) in dst.iter_mut().zip(&sum) {
            *a = T::from_f32(a.to_f32() + T::round(*s));
        }
    }
}

impl candle_core::InplaceOp3 for EmbeddingGradAdd {
    fn name(&self) -> &'static str {
        "fleet-embedding-grad-add"
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
        let hs = l1.dims()[1];
        let dims = (self.n_distinct, self.n_rows, hs);
        let Some((a0, a1)) = l1.contiguous_offsets() else {
            candle_core::bail!("embedding_grad_add_: the sum must be contiguous")
        };
        let CpuStorage::U32(packed) = s3 else {
            candle_core::bail!("embedding_grad_add_: the grouping must be u32")
        };
        let packed = contiguous(packed, l3)?;
        macro_rules! run {
            ($acc:expr, $g:expr) => {
                embedding_grad_add_cpu(&mut $acc[a0..a1], contiguous($g, l2)?, packed, dims)
            };
        }
        match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(g)) => run!(a, g),
            (CpuStorage::F32(a), CpuStorage::BF16(g)) => run!(a, g),
            (CpuStorage::F32(a), CpuStorage::F16(g)) => run!(a, g),
            (CpuStorage::BF16(a), CpuStorage::BF16(g)) => run!(a, g),
            (CpuStorage::BF16(a), CpuStorage::F32(g)) => run!(a, g),
            (CpuStorage::F16(a), CpuStorage::F16(g)) => run!(a, g),
            (CpuStorage::F16(a), CpuStorage::F32(g)) => run!(a, g),
            _ => candle_core::bail!("embedding_grad_add_: unsupported dtypes"),
        }
        Ok(())
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
        cuda::embedding_grad_add(self, s1, l1, s2, l2, s3, l3)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout};
    use half::{bf16, f16};

    use super::super::cuda_util::*;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/embedding_grad.ptx"));
    const MODULE: &str = "fleet_embedding_grad";

    pub(super) fn embedding_grad_add(
        op: &super::EmbeddingGradAdd,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        fn run<T: CudaDType + DeviceRepr, G: CudaDType + DeviceRepr>(
            op: &super::EmbeddingGradAdd,
            (s1, l1): (&mut CudaStorage, &Layout),
            (s2, l2): (&CudaStorage, &Layout),
            (s3, l3): (&CudaStorage, &Layout),
            name: &str,
        ) -> candle_core::Result<()> {
            let dev = s1.device().clone();
            let hs = l1.dims()[1];
            let Some((a0, a1)) = l1.contiguous_offsets() else {
                candle_core::bail!("embedding_grad_add_: the sum must be contiguous")
            };
            let (g, packed) = (input::<G>(s2, l2)?, input::<u32>(s3, l3)?);
            let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
            let mut acc = s1.as_cuda_slice_mut::<T>()?.slice_mut(a0..a1);
            let cfg = LaunchConfig {
                grid_dim: (op.n_distinct as u32, (hs as u32).div_ceil(256), 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = func.builder();
            b.arg(&mut acc);
            b.arg(&g);
            b.arg(&packed);
            let ints = [op.n_distinct as i32, op.n_rows as i32, hs as i32];
            for x in &ints {
                b.arg(x);
            }
            // SAFETY: one block per distinct id writes that id's row of acc (ids checked
            // against the vocabulary by the caller), reading the rows of g its offsets list.
            unsafe { b.launch(cfg) }.w()?;
            Ok(())
        }
        let io = (s1, l1);
        let (g, p) = ((s2, l2), (s3, l3));
        match (io.0.dtype(), s2.dtype()) {
            (DType::F32, DType::F32) => run::<f32, f32>(op, io, g, p, "embedding_grad_add_f32_f32"),
            (DType::F32, DType::BF16) => {
                run::<f32, bf16>(op, io, g, p, "embedding_grad_add_f32_bf16")
            }
            (DType::F32, DType::F16) => run::<f32, f16>(op, io, g, p, "embedding_grad_add_f32_f16"),
            (DType::BF16, DType::BF16) => {
                run::<bf16, bf16>(op, io, g, p, "embedding_grad_add_bf16_bf16")
            }
            (DType::BF16, DType::F32) => {
                run::<bf16, f32>(op, io, g, p, "embedding_grad_add_bf16_f32")
            }
            (DType::F16, DType::F16) => run::<f16, f16>(op, io, g, p, "embedding_grad_add_f16_f16"),
            (DType::F16, DType::F32) => run::<f16, f32>(op, io, g, p, "embedding_grad_add_f16_f32"),
            other => candle_core::bail!("embedding_grad_add_: unsupported dtypes {other:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The op equals what the trainer computed before it (an f32 index_add into per-id sums, a
    /// cast to the sum's dtype, a scatter_add), bit for bit, in f32 and in bf16.
    #[test]
    fn equals_index_add_then_scatter_add() {
        let dev = Device::Cpu;
        let (vocab, hs) = (11, 6);
        let ids: Vec<u32> = vec![3, 7, 3, 0, 10, 7, 3, 5];
        for dtype in [DType::F32, DType::BF16] {
            let start = Tensor::randn(0f32, 1.0, (vocab, hs), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let g = Tensor::randn(0f32, 1.0, (ids.len(), hs), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            // Before: per-id f32 sums by index_add, cast, scatter_add.
            let (distinct, slots) = distinct_slots(&ids);
            let n = distinct.len();
            let sums = Tensor::zeros((n, hs), DType::F32, &dev)
                .unwrap()
                .index_add(
                    &Tensor::from_vec(slots, ids.len(), &dev).unwrap(),
                    &g.to_dtype(DType::F32).unwrap(),
                    0,
                )
                .unwrap();
            let rows = Tensor::from_vec(distinct, (n, 1), &dev)
                .unwrap()
                .broadcast_as((n, hs))
                .unwrap()
                .contiguous()
                .unwrap();
            let want = start.copy().unwrap();
            want.scatter_add_set(&rows, &sums.to_dtype(dtype).unwrap(), 0)
                .unwrap();
            let got = start.copy().unwrap();
            embedding_grad_add_(&got, &g, &ids).unwrap();
            let d = max_abs_diff(&got, &want);
            assert_eq!(d, 0.0, "{dtype:?}");
        }
    }

    #[test]
    fn an_id_past_the_vocabulary_is_refused() {
        let dev = Device::Cpu;
        let acc = Tensor::zeros((4, 2), DType::F32, &dev).unwrap();
        let g = Tensor::zeros((1, 2), DType::F32, &dev).unwrap();
        let err = embedding_grad_add_(&acc, &g, &[4]).unwrap_err().to_string();
        assert!(err.contains("past the vocabulary"), "{err}");
    }
}
