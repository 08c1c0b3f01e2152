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
    /// Sums the gradients over the ranks, in place (every rank gets the same sums).
    fn all_reduce_grads(&self, grads: &mut ParamGrads, params: &[Var]) -> Result<(), TrainError>;
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

/// Gradients with every missing one as zeros (a rank whose share gave a parameter no gradient
/// still contributes to the sum).
fn dense_grads(grads: &ParamGrads, params: &[Var]) -> Result<Vec<Tensor>, TrainError> {
    params
        .iter()
        .enumerate()
        .map(|(i, p)| match grads.get(i).and_then(Option::as_ref) {
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

    fn all_reduce_grads(&self, grads: &mut ParamGrads, params: &[Var]) -> Result<(), TrainError> {
        let dense = dense_grads(grads, params)?;
        let mut buf = to_host(&dense)?;
        self.group.all_reduce_sum_f32(&mut buf).map_err(dist_err)?;
        *grads = from_host(&buf, &dense)?.into_iter().map(Some).collect();
        Ok(())
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
        })
    }

    /// The global batch grows by this factor over the config's (1 with a fixed global batch).
    pub fn batch_scale(&self, config: &crate::GspoConfig) -> usize {
        self.global_micro_batch / config.per_device_train_batch_size.max(1)
    }
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

    use std::sync::Arc;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};
    use candle_core::{CpuStorage, CudaStorage, Device, InplaceOp1, Layout, Tensor, Var};
    use fleet_dist::{Group, World};
    use fleet_models::qwen::train::ParamGrads;

    use super::{dense_grads, Collective, TcpCollective};
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
        comm: Arc<Comm>,
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
                comm: Arc::new(comm),
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
        comm: Arc<Comm>,
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

        fn all_reduce_grads(
            &self,
            grads: &mut ParamGrads,
            params: &[Var],
        ) -> Result<(), TrainError> {
            // A fresh copy of each gradient: backward may hand two parameters the same
            // storage, which an in-place sum would then add twice.
            let dense = dense_grads(grads, params)?;
            let mut out = Vec::with_capacity(dense.len());
            for g in dense {
                let g = g.to_dtype(candle_core::DType::F32)?.copy()?;
                self.in_place(&g, Op::Sum)?;
                out.push(Some(g));
            }
            *grads = out;
            Ok(())
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
