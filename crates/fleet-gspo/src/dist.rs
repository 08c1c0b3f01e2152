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
//! The collectives are fleet-dist's [`fleet_dist::Collective`]: NCCL on GPUs
//! (`fleet_dist::nccl`, feature `nccl`), its TCP group on the CPU (and for the small metadata).
//! What is GSPO's here: the batch arithmetic, the row shares, and the gradients of
//! [`ParamGrads`] summed through any collective ([`AllReduceGrads`]).

use candle_core::{Tensor, Var};
use fleet_dist::{Collective, World};
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

/// Bytes of gradients summed by one collective (PyTorch DDP's default bucket is 25 MiB; larger
/// buckets reach more of the link's bandwidth, see docs/benchmarks.md).
pub const GRAD_BUCKET_BYTES: usize = 64 << 20;

/// Gradient sums over the ranks, for any of fleet-dist's collectives.
pub trait AllReduceGrads {
    /// Sums the gradients over the ranks (every rank gets the same sums), in f32, in buckets
    /// of about [`GRAD_BUCKET_BYTES`] (one collective per bucket instead of one per
    /// parameter), each bucket's sums written back into the gradients in place, in their
    /// dtype: no second copy of the gradients exists (returned as new f32 tensors, the sums
    /// of a 7B model's bf16 gradients were 30 GB beside the 15 GB buffer, and two H100s ran
    /// out of memory).
    fn all_reduce_grads(&self, grads: &mut ParamGrads, params: &[Var]) -> Result<(), TrainError>;
}

impl<C: Collective + ?Sized> AllReduceGrads for C {
    fn all_reduce_grads(&self, grads: &mut ParamGrads, params: &[Var]) -> Result<(), TrainError> {
        let dense = dense_grads(grads, params)?;
        for range in fleet_dist::buckets(&dense, GRAD_BUCKET_BYTES / 4) {
            let part = &dense[range];
            for (g, sum) in part
                .iter()
                .zip(self.all_reduce_sum_bucketed(part, usize::MAX)?)
            {
                let sum = sum.to_dtype(g.dtype())?;
                if g.rank() == 0 {
                    g.reshape(1)?.slice_set(&sum.reshape(1)?, 0, 0)?;
                } else {
                    g.slice_set(&sum, 0, 0)?;
                }
            }
        }
        *grads = ParamGrads::from_vec(dense.into_iter().map(Some).collect());
        Ok(())
    }
}

/// ZeRO stage 1's partition of the parameters (their element counts, in order) over `world`
/// ranks: the owner of each, largest first to the rank with the fewest elements so far (ties:
/// the lower rank; equal sizes: parameter order). The same on every rank and every run.
pub fn zero_partition(sizes: &[usize], world: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; world.max(1)];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let r = (0..load.len())
            .min_by_key(|&r| (load[r], r))
            .expect("at least one rank");
        owner[i] = r;
        load[r] += sizes[i];
    }
    owner
}

/// Every rank's `tensors` as their owners hold them: each rank contributes the tensors it
/// `owned` and zeros for the others (an entry it does not own only gives the shape and
/// device), summed over the ranks in f32 (`x + 0` is exact) about [`GRAD_BUCKET_BYTES`] at a
/// time; each handed to `each` with its index, in `dtypes` (one per tensor: an owner's master
/// may be wider than the copy the others hold) and its shape, as its bucket arrives — so that
/// no whole gathered copy of the model need exist (ZeRO stage 1: the updated parameters set
/// after a step; the masters and moments for a checkpoint, moved to the host).
pub fn gather_owned<C: Collective + ?Sized>(
    collective: &C,
    tensors: &[Tensor],
    owned: &[bool],
    dtypes: &[candle_core::DType],
    mut each: impl FnMut(usize, Tensor) -> Result<(), TrainError>,
) -> Result<(), TrainError> {
    for std::ops::Range { start, end } in fleet_dist::buckets(tensors, GRAD_BUCKET_BYTES / 4) {
        let mine: Vec<Tensor> = (start..end)
            .map(|i| {
                if owned[i] {
                    Ok(tensors[i].clone())
                } else {
                    Tensor::zeros(tensors[i].shape(), tensors[i].dtype(), tensors[i].device())
                }
            })
            .collect::<candle_core::Result<_>>()?;
        for (i, sum) in (start..end).zip(collective.all_reduce_sum_bucketed(&mine, usize::MAX)?) {
            each(i, sum.to_dtype(dtypes[i])?)?;
        }
    }
    Ok(())
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
        Ok(self.collective.finish()?)
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

#[cfg(test)]
mod tests {

    /// Whole parameters, largest first to the least-loaded rank: balanced, and the same
    /// partition every time.
    #[test]
    fn zero_partition_balances_whole_parameters() {
        let sizes = [10, 100, 30, 30, 5, 70];
        let owners = zero_partition(&sizes, 2);
        // 100 -> 0; 70 -> 1; 30 -> 1 (70 < 100); 30 -> 0 (100 = 100: the lower rank);
        // 10 -> 1 (100 < 130); 5 -> 1 (110 < 130).
        assert_eq!(owners, vec![1, 0, 1, 0, 1, 1]);
        let load = |r: usize| -> usize {
            sizes
                .iter()
                .zip(&owners)
                .filter(|(_, &o)| o == r)
                .map(|(s, _)| s)
                .sum()
        };
        assert_eq!((load(0), load(1)), (130, 115));
        assert_eq!(owners, zero_partition(&sizes, 2));
        assert_eq!(zero_partition(&sizes, 1), vec![0; 6]);
        // More ranks than parameters: some own nothing.
        assert_eq!(zero_partition(&[3, 2], 4), vec![0, 1]);
    }
    use super::*;
    use candle_core::{DType, IndexOp};

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
        let c = LoopbackCollective(single(), false);
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

    /// The sums replace the gradients in place (no second copy of them), each computed once
    /// from a buffer of the collective's own: a bucket of one tensor is not summed where it
    /// lies, and two parameters that backward handed one storage each get the sum, not twice
    /// it.
    #[test]
    fn sums_replace_the_gradients_in_place_each_once() {
        let dev = candle_core::Device::Cpu;
        let g = Tensor::new(&[1f32, 2., 3.], &dev).unwrap();
        // One parameter: a bucket of one tensor, which `cat` would hand back as it is.
        let one = [Var::zeros(3, DType::F32, &dev).unwrap()];
        let mut grads = ParamGrads::from_vec(vec![Some(g.clone())]);
        LoopbackCollective(single(), true)
            .all_reduce_grads(&mut grads, &one)
            .unwrap();
        let summed: Vec<f32> = grads.get(0).unwrap().to_vec1().unwrap();
        assert_eq!(summed, vec![2., 4., 6.]);
        assert_eq!(
            g.to_vec1::<f32>().unwrap(),
            vec![2., 4., 6.],
            "not in place"
        );
        // Two parameters handed the same storage by backward: each summed once.
        let two = [
            Var::zeros(3, DType::F32, &dev).unwrap(),
            Var::zeros(3, DType::F32, &dev).unwrap(),
        ];
        let g = Tensor::new(&[1f32, 2., 3.], &dev).unwrap();
        let mut grads = ParamGrads::from_vec(vec![Some(g.clone()), Some(g.clone())]);
        LoopbackCollective(single(), true)
            .all_reduce_grads(&mut grads, &two)
            .unwrap();
        for s in grads.iter() {
            assert_eq!(s.unwrap().to_vec1::<f32>().unwrap(), vec![2., 4., 6.]);
        }
        // bf16 gradients: summed in f32, written back rounded to bf16.
        let g = Tensor::new(&[1f32, 2., 3.], &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let bf = [Var::zeros(3, DType::BF16, &dev).unwrap()];
        let mut grads = ParamGrads::from_vec(vec![Some(g.clone())]);
        LoopbackCollective(single(), true)
            .all_reduce_grads(&mut grads, &bf)
            .unwrap();
        let s = grads.get(0).unwrap();
        assert_eq!(s.dtype(), DType::BF16);
        assert_eq!(
            s.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
            vec![2., 4., 6.]
        );
    }

    /// One rank alone (a group of one: its metadata collectives are the identity): the tensor
    /// sums are the identity (`false`), or the sum of two ranks with the same gradients,
    /// written in place like NCCL's (`true`).
    struct LoopbackCollective(fleet_dist::Group, bool);

    /// The group of a world of one.
    fn single() -> fleet_dist::Group {
        let opts = fleet_dist::RendezvousOptions::new("loopback", "one rank");
        fleet_dist::rendezvous(&World::single(), &opts, None).unwrap()
    }

    impl Collective for LoopbackCollective {
        fn group(&self) -> &fleet_dist::Group {
            &self.0
        }
        fn all_reduce_sum(&self, t: Tensor) -> fleet_dist::Result<Tensor> {
            if self.1 {
                t.inplace_op1(&DoubleInPlace)?;
            }
            Ok(t)
        }
        fn broadcast_vars(&self, _: &[Var]) -> fleet_dist::Result<()> {
            Ok(())
        }
        fn backend(&self) -> &'static str {
            if self.1 {
                "in-place"
            } else {
                "loopback"
            }
        }
        fn finish(self: Box<Self>) -> fleet_dist::Result<()> {
            Ok(())
        }
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
