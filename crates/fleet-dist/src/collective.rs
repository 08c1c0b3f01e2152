//! Collectives of candle tensors between the ranks of one run (feature `tensors`).
//!
//! [`Collective`] is what a data-parallel job calls: byte all-gathers and broadcasts for small
//! metadata, f64 sums, in-place sums of tensors (one at a time, or many in buckets) and a
//! broadcast of rank 0's variables. Two engines carry it: [`TcpCollective`], this crate's
//! [`Group`] with the tensors copied through the host (the CPU path, and tests), and
//! `nccl::NcclCollective` (feature `nccl`), NCCL on the device candle computes on, with the
//! same group for the metadata. [`bench_all_reduce`] times either in nccl-tests' terms.

use std::ops::Range;

use candle_core::{DType, Tensor, Var};

use crate::{DistError, Group, Result, World};

/// Collective operations between the ranks of one run. Whatever carries the tensors, the small
/// metadata (bytes, f64 sums) goes through the TCP [`Group`] the ranks met in, which also
/// watches them: an implementation gives its group and the tensor operations.
pub trait Collective {
    /// The group the ranks met in ([`crate::rendezvous`]).
    fn group(&self) -> &Group;
    /// This rank and the world.
    fn world(&self) -> &World {
        self.group().world()
    }
    /// Every rank's bytes, in rank order.
    fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        self.group().all_gather_bytes(mine)
    }
    /// Rank 0's bytes on every rank (`mine` is read on rank 0 only).
    fn broadcast_bytes(&self, mine: Option<Vec<u8>>) -> Result<Vec<u8>> {
        self.group().broadcast_bytes(mine)
    }
    /// Element-wise sums over the ranks, the same on every rank.
    fn all_reduce_f64(&self, values: &mut [f64]) -> Result<()> {
        self.group().all_reduce_sum_f64(values)
    }
    /// Element-wise sums of a tensor over the ranks (every rank gets the same sums). NCCL sums
    /// in place and returns the same tensor; the tensor must be contiguous.
    fn all_reduce_sum(&self, t: Tensor) -> Result<Tensor>;
    /// Sums each of `tensors` over the ranks, as f32, in buckets of about `bucket_bytes`: one
    /// collective per bucket instead of one per tensor. The sums come back in the tensors'
    /// order and shapes, as f32; the tensors given are never written (NCCL sums in place, so
    /// every bucket is a buffer of its own).
    fn all_reduce_sum_bucketed(
        &self,
        tensors: &[Tensor],
        bucket_bytes: usize,
    ) -> Result<Vec<Tensor>> {
        let mut out = Vec::with_capacity(tensors.len());
        for bucket in buckets(tensors, bucket_bytes / 4) {
            let part = &tensors[bucket];
            let flat: Vec<Tensor> = part
                .iter()
                .map(|g| g.to_dtype(DType::F32)?.flatten_all())
                .collect::<candle_core::Result<_>>()?;
            // A buffer of our own: NCCL sums in place, and a caller may hand two tensors that
            // share a storage (backward does, for two parameters), which would then be added
            // twice. `cat` copies, except a bucket of one tensor, which it returns as it is.
            let own = match flat.as_slice() {
                // Not `copy()`: candle's copy clones the view's whole storage (a gradient inside
                // the flat gradient buffer would copy the buffer, for every bucket).
                [one] => one.force_contiguous()?,
                _ => Tensor::cat(&flat, 0)?,
            };
            let sums = self.all_reduce_sum(own)?;
            let mut at = 0;
            for g in part {
                let n = g.elem_count();
                out.push(sums.narrow(0, at, n)?.reshape(g.shape())?);
                at += n;
            }
        }
        Ok(out)
    }
    /// Rank 0's values of these variables on every rank.
    fn broadcast_vars(&self, vars: &[Var]) -> Result<()>;
    /// Says which engine carries the tensors (`tcp`, `nccl`).
    fn backend(&self) -> &'static str;
    /// Ends the run cleanly on this rank (the others stop watching it); to be called by every
    /// rank after its last collective. Dropping a collective without it tells the others that
    /// this rank died.
    fn finish(self: Box<Self>) -> Result<()>;
}

/// The TCP group of this crate as the collective: tensors travel through the host. For CPU
/// ranks (and tests); on GPUs use NCCL.
pub struct TcpCollective {
    group: Group,
}

impl TcpCollective {
    /// Wraps a group that has met (see [`crate::rendezvous`]).
    pub fn new(group: Group) -> Self {
        Self { group }
    }
}

/// Flattens tensors into one f32 host buffer.
fn to_host(tensors: &[Tensor]) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(tensors.iter().map(Tensor::elem_count).sum());
    for t in tensors {
        out.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// Cuts a host buffer back into tensors like `like` (shape, dtype, device).
fn from_host(buf: &[f32], like: &[Tensor]) -> Result<Vec<Tensor>> {
    let mut at = 0;
    let mut out = Vec::with_capacity(like.len());
    for t in like {
        let n = t.elem_count();
        let part =
            Tensor::from_slice(&buf[at..at + n], t.shape(), t.device())?.to_dtype(t.dtype())?;
        out.push(part);
        at += n;
    }
    Ok(out)
}

/// Consecutive index ranges of `tensors`, each of at most `max_elems` elements unless a single
/// tensor is larger (the buckets of [`Collective::all_reduce_sum_bucketed`]; callers that
/// process a bucket at a time cut them the same way).
pub fn buckets(tensors: &[Tensor], max_elems: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut elems) = (0, 0);
    for (i, t) in tensors.iter().enumerate() {
        let n = t.elem_count();
        if i > start && elems + n > max_elems {
            out.push(start..i);
            (start, elems) = (i, 0);
        }
        elems += n;
    }
    if start < tensors.len() {
        out.push(start..tensors.len());
    }
    out
}

impl Collective for TcpCollective {
    fn group(&self) -> &Group {
        &self.group
    }

    fn all_reduce_sum(&self, t: Tensor) -> Result<Tensor> {
        let mut buf = to_host(std::slice::from_ref(&t))?;
        self.group.all_reduce_sum_f32(&mut buf)?;
        Ok(from_host(&buf, &[t])?.remove(0))
    }

    fn broadcast_vars(&self, vars: &[Var]) -> Result<()> {
        let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_detached_tensor()).collect();
        let mine = if self.world().is_main() {
            Some(
                to_host(&tensors)?
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
            )
        } else {
            None
        };
        let bytes = self.group.broadcast_bytes(mine)?;
        let buf: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let here = tensors.iter().map(Tensor::elem_count).sum::<usize>();
        if buf.len() != here {
            return Err(DistError::WeightsMismatch {
                sent: buf.len(),
                here,
            });
        }
        for (var, value) in vars.iter().zip(from_host(&buf, &tensors)?) {
            var.set(&value)?;
        }
        Ok(())
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn finish(self: Box<Self>) -> Result<()> {
        self.group.finish()
    }
}

/// One row of [`bench_all_reduce`], in nccl-tests' terms (`all_reduce_perf`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AllReducePerf {
    /// Bytes per rank.
    pub bytes: usize,
    /// Elements per rank.
    pub count: usize,
    /// `float` or `bfloat16`, as nccl-tests names them.
    pub dtype: &'static str,
    /// Microseconds per call, the mean over the ranks.
    pub time_us: f64,
    /// Algorithm bandwidth: bytes / time, GB/s (10^9).
    pub algbw: f64,
    /// Bus bandwidth: algbw x 2 (n - 1) / n, nccl-tests' definition for all-reduce (what each
    /// link carries in a ring, comparable across rank counts).
    pub busbw: f64,
    /// The sums were right (every rank filled its buffer with rank + 1).
    pub correct: bool,
}

/// Times [`Collective::all_reduce_sum`] as nccl-tests' `all_reduce_perf` does: per size,
/// `warmup` calls, then `iters` calls back to back between two device synchronizations; a
/// separate call checks the sums. Every rank must call it with the same arguments.
pub fn bench_all_reduce(
    c: &dyn Collective,
    device: &candle_core::Device,
    dtype: DType,
    sizes: &[usize],
    warmup: usize,
    iters: usize,
) -> Result<Vec<AllReducePerf>> {
    let n = c.world().world_size;
    let rank = c.world().rank;
    let width = dtype.size_in_bytes();
    let mut rows = Vec::with_capacity(sizes.len());
    for &bytes in sizes {
        let count = (bytes / width).max(1);
        // The check: rank r adds r + 1, so every element sums to n (n + 1) / 2 (exact in bf16
        // for the rank counts of one machine or a few).
        let t = Tensor::full((rank + 1) as f32, count, device)?.to_dtype(dtype)?;
        let sums = c.all_reduce_sum(t)?.to_dtype(DType::F32)?;
        let want = (n * (n + 1) / 2) as f64;
        let worst = (sums - want)?.abs()?.max(0)?.to_scalar::<f32>()?;
        let correct = worst == 0.0;
        // The timed buffer holds ones: repeated in-place sums grow it by n per call, which stays
        // finite for the iteration counts used here.
        let mut t = Tensor::ones(count, dtype, device)?;
        for _ in 0..warmup {
            t = c.all_reduce_sum(t)?;
        }
        device.synchronize()?;
        c.all_reduce_f64(&mut [0.0])?;
        let start = std::time::Instant::now();
        for _ in 0..iters {
            t = c.all_reduce_sum(t)?;
        }
        device.synchronize()?;
        let mut seconds = [start.elapsed().as_secs_f64() / iters.max(1) as f64];
        c.all_reduce_f64(&mut seconds)?;
        let time = seconds[0] / n as f64;
        let algbw = (count * width) as f64 / time / 1e9;
        rows.push(AllReducePerf {
            bytes: count * width,
            count,
            dtype: match dtype {
                DType::BF16 => "bfloat16",
                DType::F16 => "half",
                DType::F32 => "float",
                _ => "other",
            },
            time_us: time * 1e6,
            algbw,
            busbw: algbw * 2.0 * (n as f64 - 1.0) / n as f64,
            correct,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A world of one over TCP: every collective is the identity.
    fn solo() -> TcpCollective {
        let opts = crate::RendezvousOptions::new("solo", "a world of one");
        TcpCollective::new(crate::rendezvous(&World::single(), &opts, None).unwrap())
    }

    #[test]
    fn buckets_keep_order_and_hold_oversized_tensors_alone() {
        let t = |n: usize| Tensor::zeros(n, DType::F32, &candle_core::Device::Cpu).unwrap();
        let ts = [t(3), t(3), t(10), t(1), t(1), t(2)];
        assert_eq!(buckets(&ts, 6), vec![0..2, 2..3, 3..6]);
        assert_eq!(buckets(&ts, 100), vec![0..6]);
        assert_eq!(buckets(&ts[..0], 6), Vec::<std::ops::Range<usize>>::new());
    }

    #[test]
    fn bucketed_sums_come_back_in_order_and_shape() {
        let dev = candle_core::Device::Cpu;
        let a = Tensor::arange(0f32, 6., &dev)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let b = Tensor::new(&[7f32, 8.], &dev).unwrap();
        // 4 f32 per bucket: `a` alone, then `b`.
        let sums = solo().all_reduce_sum_bucketed(&[a, b], 16).unwrap();
        assert_eq!(sums[0].dims(), &[2, 3]);
        assert_eq!(
            sums[0].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![0., 1., 2., 3., 4., 5.]
        );
        assert_eq!(sums[1].to_vec1::<f32>().unwrap(), vec![7., 8.]);
    }

    /// The TCP collective, checking that every tensor handed to `all_reduce_sum` is a buffer
    /// of its own: offset 0 and a storage of exactly its elements (what NCCL sums in place).
    struct OwnBuffersOnly(TcpCollective);

    impl Collective for OwnBuffersOnly {
        fn group(&self) -> &Group {
            self.0.group()
        }
        fn all_reduce_sum(&self, t: Tensor) -> Result<Tensor> {
            let held = match &*t.storage_and_layout().0 {
                candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.len(),
                _ => panic!("f32 on the CPU expected"),
            };
            assert_eq!(t.layout().start_offset(), 0);
            assert_eq!(
                held,
                t.elem_count(),
                "a bucket holds a storage larger than itself"
            );
            self.0.all_reduce_sum(t)
        }
        fn broadcast_vars(&self, vars: &[Var]) -> Result<()> {
            self.0.broadcast_vars(vars)
        }
        fn backend(&self) -> &'static str {
            "test"
        }
        fn finish(self: Box<Self>) -> Result<()> {
            Box::new(self.0).finish()
        }
    }

    /// Gradients that are views inside one flat buffer (as a trainer's are) go to the
    /// collective as buckets of their own elements only: a 2-rank run on two H100s ran out of
    /// memory when each one-tensor bucket cloned the whole buffer (and NCCL refused its
    /// offset).
    #[test]
    fn buckets_of_views_copy_only_the_views() {
        let dev = candle_core::Device::Cpu;
        let flat = Tensor::arange(0f32, 1000., &dev).unwrap();
        let views = [
            flat.narrow(0, 0, 100).unwrap(),
            flat.narrow(0, 100, 300).unwrap(),
            flat.narrow(0, 400, 600).unwrap().reshape((20, 30)).unwrap(),
        ];
        // 400 f32 per bucket: each view alone, then the first two together.
        for bucket_bytes in [400, 1600] {
            let sums = OwnBuffersOnly(solo())
                .all_reduce_sum_bucketed(&views, bucket_bytes)
                .unwrap();
            for (s, v) in sums.iter().zip(&views) {
                assert_eq!(s.dims(), v.dims());
                assert_eq!(
                    s.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    v.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                );
            }
        }
    }

    #[test]
    fn the_bench_checks_sums_and_reports_bus_bandwidth() {
        let c = solo();
        let rows = bench_all_reduce(
            &c,
            &candle_core::Device::Cpu,
            DType::BF16,
            &[4096, 16384],
            1,
            2,
        )
        .unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].bytes, rows[0].count, rows[0].dtype),
            (4096, 2048, "bfloat16")
        );
        assert!(rows.iter().all(|r| r.correct && r.algbw > 0.0));
        // One rank: nothing crosses a bus.
        assert_eq!(rows[0].busbw, 0.0);
    }
}
