//! Data parallelism: N ranks (processes, one device each) train one policy.
//!
//! The semantics, as verl keeps them: one config trains the same algorithm on 1 or N devices.
//! A generation batch has the same rows whatever the world size; rank `r` samples and scores
//! the rows `[r R/N, (r+1) R/N)` (each row keeps its own sampling seed, so the completions do
//! not depend on N), then the completions and rewards are gathered so that every rank holds
//! the whole batch and computes the same group advantages (a prompt's group may be spread
//! over ranks, as in TRL). Each micro-batch of `per_device_train_batch_size` rows is cut into
//! N equal shares; a rank's loss is its share's sum over the micro-batch's sequence count, so
//! summing the gradients over the ranks gives exactly the one-device gradient. Clipping and
//! AdamW then run on identical gradients everywhere, and the replicas stay identical.
//!
//! With [`BatchScaling::Linear`] (`--scale-lr linear`) the per-rank batch is kept instead: the
//! micro-batch and the generation batch grow N-fold and the learning rate is multiplied by N
//! (the linear scaling rule, for users who grow the global batch with the GPU count).
//!
//! The collectives go through [`Collective`]: NCCL on GPUs (module `nccl`, feature `nccl`), and
//! fleet-dist's TCP [`fleet_dist::Group`] on the CPU (and for the small metadata).

use candle_core::{DType, Tensor, Var};
use fleet_dist::{Group, World};
use fleet_models::qwen::train::ParamGrads;

use crate::TrainError;

/// How the batch follows the number of ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchScaling {
    /// The global batch is the config's; each rank takes 1/N of it (verl's semantics).
    #[default]
    FixedGlobal,
    /// Each rank takes the config's batch; the global batch and the learning rate grow N-fold.
    Linear,
}

impl std::str::FromStr for BatchScaling {
    type Err = TrainError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" | "fixed" => Ok(Self::FixedGlobal),
            "linear" => Ok(Self::Linear),
            other => Err(TrainError::Setup(format!(
                "--scale-lr {other:?}: expected `linear` (keep the per-GPU batch, scale the \
                 learning rate by the GPU count) or `none` (keep the global batch: the default)"
            ))),
        }
    }
}

/// Collective operations between the ranks of one run.
pub trait Collective {
    /// This rank and the world.
    fn world(&self) -> &World;
    /// Every rank's bytes, in rank order.
    fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, TrainError>;
    /// Rank 0's bytes on every rank (`mine` is read on rank 0 only).
    fn broadcast_bytes(&self, mine: Option<Vec<u8>>) -> Result<Vec<u8>, TrainError>;
    /// Element-wise sums over the ranks, the same on every rank.
    fn all_reduce_f64(&self, values: &mut [f64]) -> Result<(), TrainError>;
    /// Element-wise sums of a tensor over the ranks (every rank gets the same sums). NCCL sums
    /// in place and returns the same tensor; the tensor must be contiguous.
    fn all_reduce_sum(&self, t: Tensor) -> Result<Tensor, TrainError>;
    /// Sums the gradients over the ranks (every rank gets the same sums), as f32, in buckets of
    /// about [`GRAD_BUCKET_BYTES`]: one collective per bucket instead of one per parameter.
    fn all_reduce_grads(&self, grads: &mut ParamGrads, params: &[Var]) -> Result<(), TrainError> {
        let dense = dense_grads(grads, params)?;
        let mut out = Vec::with_capacity(dense.len());
        for bucket in buckets(&dense, GRAD_BUCKET_BYTES / 4) {
            let part = &dense[bucket];
            let flat: Vec<Tensor> = part
                .iter()
                .map(|g| g.to_dtype(DType::F32)?.flatten_all())
                .collect::<candle_core::Result<_>>()?;
            // A buffer of our own: NCCL sums in place, and backward may hand two parameters the
            // same storage, which would then be added twice. `cat` copies, except a bucket of
            // one tensor, which it returns as it is.
            let own = match flat.as_slice() {
                [one] => one.copy()?,
                _ => Tensor::cat(&flat, 0)?,
            };
            let sums = self.all_reduce_sum(own)?;
            let mut at = 0;
            for g in part {
                let n = g.elem_count();
                out.push(Some(sums.narrow(0, at, n)?.reshape(g.shape())?));
                at += n;
            }
        }
        *grads = ParamGrads::from_vec(out);
        Ok(())
    }
    /// Rank 0's values of these variables on every rank.
    fn broadcast_vars(&self, vars: &[Var]) -> Result<(), TrainError>;
    /// Says which engine carries the tensors (`tcp`, `nccl`).
    fn backend(&self) -> &'static str;
    /// Ends the run cleanly on this rank (the others stop watching it); to be called by every
    /// rank after its last collective. Dropping a collective without it tells the others that
    /// this rank died.
    fn finish(self: Box<Self>) -> Result<(), TrainError>;
}

/// The TCP group of fleet-dist as the collective: tensors travel through the host. For CPU
/// ranks (and tests); on GPUs use NCCL.
pub struct TcpCollective {
    group: Group,
}

impl TcpCollective {
    /// Wraps a group that has met (see [`fleet_dist::rendezvous`]).
    pub fn new(group: Group) -> Self {
        Self { group }
    }

    /// The group, for the metadata.
    pub fn group(&self) -> &Group {
        &self.group
    }
}

fn dist_err(e: fleet_dist::DistError) -> TrainError {
    TrainError::Output(e)
}

/// Flattens tensors into one f32 host buffer.
fn to_host(tensors: &[Tensor]) -> Result<Vec<f32>, TrainError> {
    let mut out = Vec::with_capacity(tensors.iter().map(Tensor::elem_count).sum());
    for t in tensors {
        out.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// Cuts a host buffer back into tensors like `like` (shape, dtype, device).
fn from_host(buf: &[f32], like: &[Tensor]) -> Result<Vec<Tensor>, TrainError> {
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

/// Bytes of gradients summed by one collective (PyTorch DDP's default bucket is 25 MiB; larger
/// buckets reach more of the link's bandwidth, see docs/benchmarks.md).
pub const GRAD_BUCKET_BYTES: usize = 64 << 20;

/// Consecutive index ranges of `tensors`, each of at most `max_elems` elements unless a single
/// tensor is larger.
fn buckets(tensors: &[Tensor], max_elems: usize) -> Vec<std::ops::Range<usize>> {
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

/// Gradients with every missing one as zeros (a rank whose share gave a parameter no gradient
/// still contributes to the sum).
fn dense_grads(grads: &ParamGrads, params: &[Var]) -> Result<Vec<Tensor>, TrainError> {
    params
        .iter()
        .enumerate()
        .map(|(i, p)| match grads.get(i) {
            Some(g) => Ok(g.clone()),
            None => Ok(p.as_tensor().zeros_like()?),
        })
        .collect()
}

impl Collective for TcpCollective {
    fn world(&self) -> &World {
        self.group.world()
    }

    fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, TrainError> {
        self.group.all_gather_bytes(mine).map_err(dist_err)
    }

    fn broadcast_bytes(&self, mine: Option<Vec<u8>>) -> Result<Vec<u8>, TrainError> {
        self.group.broadcast_bytes(mine).map_err(dist_err)
    }

    fn all_reduce_f64(&self, values: &mut [f64]) -> Result<(), TrainError> {
        self.group.all_reduce_sum_f64(values).map_err(dist_err)
    }

    fn all_reduce_sum(&self, t: Tensor) -> Result<Tensor, TrainError> {
        let mut buf = to_host(std::slice::from_ref(&t))?;
        self.group.all_reduce_sum_f32(&mut buf).map_err(dist_err)?;
        Ok(from_host(&buf, &[t])?.remove(0))
    }

    fn broadcast_vars(&self, vars: &[Var]) -> Result<(), TrainError> {
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
        let bytes = self.group.broadcast_bytes(mine).map_err(dist_err)?;
        let buf: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if buf.len() != tensors.iter().map(Tensor::elem_count).sum::<usize>() {
            return Err(TrainError::Setup(format!(
                "rank 0 sent {} weights, this rank's model has {}: the ranks do not run the \
                 same model",
                buf.len(),
                tensors.iter().map(Tensor::elem_count).sum::<usize>()
            )));
        }
        for (var, value) in vars.iter().zip(from_host(&buf, &tensors)?) {
            var.set(&value)?;
        }
        Ok(())
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn finish(self: Box<Self>) -> Result<(), TrainError> {
        self.group.finish().map_err(dist_err)
    }
}

/// How the rows of a generation batch and of each micro-batch are shared among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    /// This rank.
    pub rank: usize,
    /// Ranks.
    pub world_size: usize,
}

impl Shares {
    /// One process.
    pub const SINGLE: Shares = Shares {
        rank: 0,
        world_size: 1,
    };

    /// This rank's part `[start, end)` of `n` items (n divisible by the world size).
    pub fn range(&self, n: usize) -> std::ops::Range<usize> {
        let per = n / self.world_size;
        self.rank * per..(self.rank + 1) * per
    }

    /// This rank's part of a micro-batch's rows.
    pub fn of<'a, T>(&self, rows: &'a [T]) -> &'a [T] {
        &rows[self.range(rows.len())]
    }
}

/// The batch arithmetic of a run on `world_size` ranks, as printed at the start.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchLayout {
    /// Ranks.
    pub world_size: usize,
    /// Rows of one micro-batch over all ranks.
    pub global_micro_batch: usize,
    /// Rows each rank computes per micro-batch.
    pub per_rank_micro_batch: usize,
    /// Completions per generation batch over all ranks.
    pub global_generation_batch: usize,
    /// Prompts per generation batch over all ranks.
    pub prompts_per_generation: usize,
    /// Optimizer steps per generation batch.
    pub steps_per_generation_batch: usize,
    /// Optimizer steps per epoch of the dataset (0 when the dataset is smaller than a batch).
    pub steps_per_epoch: u64,
    /// Multiplies the config's learning rate.
    pub lr_scale: f64,
    /// Parts each configured micro-batch runs as (auto_find_batch_size; 1 otherwise): the
    /// loss stays normalised over the configured micro-batch.
    pub micro_split: usize,
}

impl BatchLayout {
    /// The layout of `config` on `world_size` ranks over `num_prompts` prompts.
    pub fn new(
        config: &crate::GspoConfig,
        world_size: usize,
        scaling: BatchScaling,
        num_prompts: usize,
    ) -> Result<Self, TrainError> {
        let n = world_size.max(1);
        let per_device = config.per_device_train_batch_size;
        let (global_micro, lr_scale) = match scaling {
            BatchScaling::FixedGlobal => {
                if !per_device.is_multiple_of(n) {
                    return Err(TrainError::Setup(format!(
                        "per_device_train_batch_size = {per_device} cannot be shared by {n} \
                         processes: with the global batch fixed (the default) each process \
                         takes per_device_train_batch_size / processes rows; choose a multiple \
                         of {n}, or pass --scale-lr linear to keep {per_device} rows per process"
                    )));
                }
                (per_device, 1.0)
            }
            BatchScaling::Linear => (per_device * n, n as f64),
        };
        let scale = global_micro / per_device;
        let global_generation_batch = config.generation_batch_size() * scale;
        let prompts_per_generation = config.prompts_per_generation() * scale;
        let steps_per_generation_batch =
            config.micro_steps_per_generation() / config.gradient_accumulation_steps.max(1);
        let steps_per_epoch = (num_prompts / prompts_per_generation.max(1)) as u64
            * steps_per_generation_batch as u64;
        Ok(Self {
            world_size: n,
            global_micro_batch: global_micro,
            per_rank_micro_batch: global_micro / n,
            global_generation_batch,
            prompts_per_generation,
            steps_per_generation_batch,
            steps_per_epoch,
            lr_scale,
            micro_split: 1,
        })
    }

    /// The global batch grows by this factor over the config's (1 with a fixed global batch).
    pub fn batch_scale(&self, config: &crate::GspoConfig) -> usize {
        self.global_micro_batch / config.per_device_train_batch_size.max(1)
    }
}

/// The GPUs of this rank among the `visible` ones when one process per GPU was started by a
/// launcher that shows every rank all of the node's GPUs (torchrun, SLURM without
/// `--gpus-per-task`): local rank `k` of `n` takes the `k`-th of `n` equal slices, as
/// torchrun's `cuda:LOCAL_RANK` convention does for one GPU per rank. `None` when the rank sees
/// one GPU or none (fleet's launcher sets CUDA_VISIBLE_DEVICES per rank) or runs alone on its
/// node.
pub fn rank_gpus(world: &World, visible: &[usize]) -> Result<Option<Vec<usize>>, TrainError> {
    let n = world.local_world_size;
    if visible.len() <= 1 || n <= 1 {
        return Ok(None);
    }
    if !visible.len().is_multiple_of(n) {
        return Err(TrainError::Setup(format!(
            "this rank sees {} GPUs ({visible:?}) and its node runs {n} ranks (LOCAL_WORLD_SIZE): \
             the GPUs cannot be shared equally; start one rank per GPU, give --gpu-ids, or set \
             CUDA_VISIBLE_DEVICES for each rank",
            visible.len()
        )));
    }
    let per = visible.len() / n;
    let k = world.local_rank;
    Ok(Some(visible[k * per..(k + 1) * per].to_vec()))
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
) -> Result<Vec<AllReducePerf>, TrainError> {
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

/// The distributed environment in accelerate's words, for the start of a run.
pub fn describe_environment(world: &World, backend: &str, device: &str) -> String {
    let mode = if world.world_size > 1 {
        if device.starts_with("cuda") {
            "MULTI_GPU"
        } else {
            "MULTI_CPU"
        }
    } else if device.starts_with("cuda") {
        "NO (one GPU)"
    } else {
        "NO (CPU)"
    };
    format!(
        "Distributed environment: {mode}  Backend: {backend}  Launcher: {}\n\
         Number of processes: {}\nNumber of nodes: {}\nProcess index: {}\nLocal process index: \
         {}\nDevice: {device}",
        world.launcher, world.world_size, world.nnodes, world.rank, world.local_rank
    )
}

/// The rank's collectives: NCCL on a GPU (feature `nccl`), TCP otherwise.
pub struct DataParallel {
    /// The collectives.
    pub collective: Box<dyn Collective>,
    /// How the batch follows the world size.
    pub scaling: BatchScaling,
}

impl DataParallel {
    /// Ends the run cleanly on this rank (see [`Collective::finish`]).
    pub fn finish(self) -> Result<(), TrainError> {
        self.collective.finish()
    }

    /// This rank and the world.
    pub fn world(&self) -> &World {
        self.collective.world()
    }

    /// The row shares of this rank.
    pub fn shares(&self) -> Shares {
        Shares {
            rank: self.world().rank,
            world_size: self.world().world_size,
        }
    }
}

#[cfg(feature = "nccl")]
pub mod nccl {
    //! NCCL collectives on the device candle computes on (cudarc's communicator, created in
    //! the thread that uses it, on candle's stream), with fleet-dist's TCP group for the small
    //! metadata and the communicator's unique id.

    use std::rc::Rc;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};
    use candle_core::{CpuStorage, CudaStorage, Device, InplaceOp1, Layout, Tensor, Var};
    use fleet_dist::{Group, World};

    use super::{Collective, TcpCollective};
    use crate::TrainError;

    /// Bytes of an NCCL unique id.
    pub const ID_BYTES: usize = 128;

    /// A new NCCL unique id (rank 0), as the bytes the rendezvous hands to every rank.
    pub fn new_id() -> Result<Vec<u8>, TrainError> {
        let id = Id::new().map_err(|e| TrainError::Setup(format!("ncclGetUniqueId: {e:?}")))?;
        Ok(id.internal().iter().map(|&c| c as u8).collect())
    }

    /// NCCL for the tensors, TCP for the rest.
    pub struct NcclCollective {
        tcp: TcpCollective,
        comm: Rc<Comm>,
    }

    impl NcclCollective {
        /// Joins the communicator (blocks until every rank has joined).
        pub fn new(group: Group, device: &Device) -> Result<Self, TrainError> {
            let Device::Cuda(cuda) = device else {
                return Err(TrainError::Setup(format!(
                    "NCCL needs a CUDA device; this rank computes on {device:?}"
                )));
            };
            let bytes = group.root_payload().to_vec();
            if bytes.len() != ID_BYTES {
                return Err(TrainError::Setup(format!(
                    "rank 0 sent an NCCL id of {} bytes, expected {ID_BYTES}",
                    bytes.len()
                )));
            }
            let mut internal = [0 as core::ffi::c_char; ID_BYTES];
            for (dst, src) in internal.iter_mut().zip(&bytes) {
                *dst = *src as core::ffi::c_char;
            }
            let world = group.world().clone();
            let comm = Comm::from_rank(
                cuda.cuda_stream(),
                world.rank,
                world.world_size,
                Id::uninit(internal),
            )
            .map_err(|e| TrainError::Setup(format!("ncclCommInitRank: {e:?}")))?;
            Ok(Self {
                tcp: TcpCollective::new(group),
                comm: Rc::new(comm),
            })
        }

        fn in_place(&self, t: &Tensor, op: Op) -> Result<(), TrainError> {
            t.inplace_op1(&NcclOp {
                comm: self.comm.clone(),
                op,
            })?;
            Ok(())
        }
    }

    #[derive(Clone, Copy)]
    enum Op {
        Sum,
        BroadcastFromRoot,
    }

    /// One NCCL call on a tensor's storage, in place, on candle's stream.
    struct NcclOp {
        comm: Rc<Comm>,
        op: Op,
    }

    impl InplaceOp1 for NcclOp {
        fn name(&self) -> &'static str {
            "nccl"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
            candle_core::bail!("NCCL runs on CUDA tensors only")
        }

        fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
            if !l.is_contiguous() || l.start_offset() != 0 {
                candle_core::bail!("NCCL needs a contiguous tensor from offset 0")
            }
            let n = l.shape().elem_count();
            match s.dtype() {
                candle_core::DType::F32 => call::<f32>(&self.comm, self.op, s, n),
                candle_core::DType::BF16 => call::<half::bf16>(&self.comm, self.op, s, n),
                other => {
                    candle_core::bail!("NCCL collectives here take f32 or bf16, not {other:?}")
                }
            }
        }
    }

    /// One collective in place on the first `n` values of `s`.
    fn call<T: candle_core::cuda_backend::CudaDType + NcclType>(
        comm: &Comm,
        op: Op,
        s: &mut CudaStorage,
        n: usize,
    ) -> candle_core::Result<()> {
        let mut view = s.as_cuda_slice_mut::<T>()?.slice_mut(0..n);
        let done = match op {
            Op::Sum => comm.all_reduce_in_place(&mut view, &ReduceOp::Sum),
            Op::BroadcastFromRoot => comm.broadcast_in_place(&mut view, 0),
        };
        done.map(|_| ())
            .map_err(|e| candle_core::Error::Msg(format!("NCCL: {e:?}")))
    }

    impl Collective for NcclCollective {
        fn world(&self) -> &World {
            self.tcp.world()
        }

        fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, TrainError> {
            self.tcp.all_gather_bytes(mine)
        }

        fn broadcast_bytes(&self, mine: Option<Vec<u8>>) -> Result<Vec<u8>, TrainError> {
            self.tcp.broadcast_bytes(mine)
        }

        fn all_reduce_f64(&self, values: &mut [f64]) -> Result<(), TrainError> {
            self.tcp.all_reduce_f64(values)
        }

        fn all_reduce_sum(&self, t: Tensor) -> Result<Tensor, TrainError> {
            let t = if t.is_contiguous() && t.layout().start_offset() == 0 {
                t
            } else {
                t.copy()?
            };
            self.in_place(&t, Op::Sum)?;
            Ok(t)
        }

        fn broadcast_vars(&self, vars: &[Var]) -> Result<(), TrainError> {
            for v in vars {
                if !matches!(
                    v.dtype(),
                    candle_core::DType::F32 | candle_core::DType::BF16
                ) {
                    return Err(TrainError::Setup(format!(
                        "broadcast of {:?} weights: master weights are f32 or bf16",
                        v.dtype()
                    )));
                }
                self.in_place(v.as_tensor(), Op::BroadcastFromRoot)?;
            }
            Ok(())
        }

        fn backend(&self) -> &'static str {
            "nccl"
        }

        fn finish(self: Box<Self>) -> Result<(), TrainError> {
            // Every rank's NCCL work is done once the TCP group has said goodbye.
            Box::new(self.tcp).finish()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::IndexOp;

    #[test]
    fn shares_cut_rows_evenly_in_rank_order() {
        let rows: Vec<usize> = (0..8).collect();
        let a = Shares {
            rank: 0,
            world_size: 2,
        };
        let b = Shares {
            rank: 1,
            world_size: 2,
        };
        assert_eq!(a.of(&rows), &[0, 1, 2, 3]);
        assert_eq!(b.of(&rows), &[4, 5, 6, 7]);
        assert_eq!(Shares::SINGLE.of(&rows), &rows[..]);
    }

    fn world(local_rank: usize, local_world_size: usize) -> World {
        World {
            rank: local_rank,
            world_size: local_world_size,
            local_rank,
            local_world_size,
            ..World::single()
        }
    }

    #[test]
    fn a_rank_that_sees_every_gpu_of_its_node_takes_its_own() {
        // torchrun's convention: local rank k uses cuda:k.
        assert_eq!(
            rank_gpus(&world(1, 4), &[0, 1, 2, 3]).unwrap(),
            Some(vec![1])
        );
        // Two GPUs per rank (a sharded policy per rank).
        assert_eq!(
            rank_gpus(&world(1, 2), &[0, 1, 2, 3]).unwrap(),
            Some(vec![2, 3])
        );
        // fleet's launcher shows each rank one GPU; a lone rank keeps what it sees.
        assert_eq!(rank_gpus(&world(3, 4), &[5]).unwrap(), None);
        assert_eq!(rank_gpus(&world(0, 1), &[0, 1]).unwrap(), None);
        assert_eq!(rank_gpus(&world(0, 4), &[]).unwrap(), None);
        let err = rank_gpus(&world(0, 3), &[0, 1, 2, 3])
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot be shared equally"), "{err}");
        assert!(err.contains("CUDA_VISIBLE_DEVICES"), "{err}");
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
    fn bucketed_gradients_come_back_in_their_shapes() {
        // A world of one over TCP: the sums are the gradients themselves.
        let dev = candle_core::Device::Cpu;
        let params: Vec<Var> = [vec![2usize, 3], vec![4], vec![1, 1]]
            .into_iter()
            .map(|s| Var::zeros(s, DType::F32, &dev).unwrap())
            .collect();
        let g0 = Tensor::arange(0f32, 6., &dev)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let mut grads = ParamGrads::from_vec(vec![
            Some(g0.clone()),
            None,
            Some(g0.i((0, 0..1)).unwrap().reshape((1, 1)).unwrap()),
        ]);
        let c = LoopbackCollective(World::single(), false);
        c.all_reduce_grads(&mut grads, &params).unwrap();
        let got: Vec<Vec<f32>> = grads
            .iter()
            .map(|g| {
                g.as_ref()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            })
            .collect();
        assert_eq!(
            got,
            vec![vec![0., 1., 2., 3., 4., 5.], vec![0.; 4], vec![0.]]
        );
        assert_eq!(grads.get(0).unwrap().dims(), &[2, 3]);
        assert_eq!(grads.get(2).unwrap().dims(), &[1, 1]);
    }

    /// Doubles a CPU f32 tensor in place, as NCCL sums in place (two ranks, equal gradients).
    struct DoubleInPlace;

    impl candle_core::InplaceOp1 for DoubleInPlace {
        fn name(&self) -> &'static str {
            "double"
        }
        fn cpu_fwd(
            &self,
            s: &mut candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<()> {
            if let candle_core::CpuStorage::F32(v) = s {
                v.iter_mut().for_each(|x| *x *= 2.0);
            }
            Ok(())
        }
    }

    #[test]
    fn in_place_sums_never_write_into_the_gradients_given() {
        let dev = candle_core::Device::Cpu;
        let g = Tensor::new(&[1f32, 2., 3.], &dev).unwrap();
        // One parameter: a bucket of one tensor, which `cat` would hand back as it is.
        let one = [Var::zeros(3, DType::F32, &dev).unwrap()];
        let mut grads = ParamGrads::from_vec(vec![Some(g.clone())]);
        LoopbackCollective(World::single(), true)
            .all_reduce_grads(&mut grads, &one)
            .unwrap();
        let summed: Vec<f32> = grads.get(0).unwrap().to_vec1().unwrap();
        assert_eq!(summed, vec![2., 4., 6.]);
        assert_eq!(g.to_vec1::<f32>().unwrap(), vec![1., 2., 3.]);
        // Two parameters handed the same storage by backward: each summed once.
        let two = [
            Var::zeros(3, DType::F32, &dev).unwrap(),
            Var::zeros(3, DType::F32, &dev).unwrap(),
        ];
        let mut grads = ParamGrads::from_vec(vec![Some(g.clone()), Some(g.clone())]);
        LoopbackCollective(World::single(), true)
            .all_reduce_grads(&mut grads, &two)
            .unwrap();
        for s in grads.iter() {
            assert_eq!(s.unwrap().to_vec1::<f32>().unwrap(), vec![2., 4., 6.]);
        }
        assert_eq!(g.to_vec1::<f32>().unwrap(), vec![1., 2., 3.]);
    }

    /// One rank alone: every collective is the identity (`false`), or the
    /// sum of two ranks with the same gradients, written in place like NCCL's (`true`).
    struct LoopbackCollective(World, bool);

    impl Collective for LoopbackCollective {
        fn world(&self) -> &World {
            &self.0
        }
        fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, TrainError> {
            Ok(vec![mine])
        }
        fn broadcast_bytes(&self, mine: Option<Vec<u8>>) -> Result<Vec<u8>, TrainError> {
            Ok(mine.unwrap_or_default())
        }
        fn all_reduce_f64(&self, _: &mut [f64]) -> Result<(), TrainError> {
            Ok(())
        }
        fn all_reduce_sum(&self, t: Tensor) -> Result<Tensor, TrainError> {
            if self.1 {
                t.inplace_op1(&DoubleInPlace)?;
            }
            Ok(t)
        }
        fn broadcast_vars(&self, _: &[Var]) -> Result<(), TrainError> {
            Ok(())
        }
        fn backend(&self) -> &'static str {
            if self.1 {
                "in-place"
            } else {
                "loopback"
            }
        }
        fn finish(self: Box<Self>) -> Result<(), TrainError> {
            Ok(())
        }
    }

    #[test]
    fn the_bench_checks_sums_and_reports_bus_bandwidth() {
        let c = LoopbackCollective(World::single(), false);
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

    #[test]
    fn layout_keeps_the_global_batch_or_scales_it() {
        let c = crate::GspoConfig {
            per_device_train_batch_size: 4,
            num_generations: 2,
            steps_per_generation: 1,
            gradient_accumulation_steps: 1,
            ..Default::default()
        };
        // The seed's table: 29,500 samples (here completions: 14,750 prompts x G = 2), a
        // per-GPU batch of 4 -> 7,375 / 3,687 / 1,843 / 921 steps per epoch on 1 / 2 / 4 / 8
        // GPUs: accelerate's semantics, which is --scale-lr linear.
        for (n, steps) in [(1, 7_375u64), (2, 3_687), (4, 1_843), (8, 921)] {
            let l = BatchLayout::new(&c, n, BatchScaling::Linear, 14_750).unwrap();
            assert_eq!(l.per_rank_micro_batch, 4);
            assert_eq!(l.global_micro_batch, 4 * n);
            assert_eq!(l.lr_scale, n as f64);
            assert_eq!(l.steps_per_epoch, steps, "{n} GPUs");
        }
        // A fixed global batch: the same steps per epoch on any number of GPUs.
        for n in [1, 2, 4] {
            let l = BatchLayout::new(&c, n, BatchScaling::FixedGlobal, 14_750).unwrap();
            assert_eq!(l.steps_per_epoch, 7_375);
            assert_eq!(l.per_rank_micro_batch, 4 / n);
        }
        let fixed = BatchLayout::new(&c, 2, BatchScaling::FixedGlobal, 100).unwrap();
        assert_eq!(fixed.global_micro_batch, 4);
        assert_eq!(fixed.per_rank_micro_batch, 2);
        assert_eq!(fixed.lr_scale, 1.0);
        let err = BatchLayout::new(&c, 3, BatchScaling::FixedGlobal, 100)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot be shared by 3"), "{err}");
        assert!(err.contains("--scale-lr linear"), "{err}");
    }
}
