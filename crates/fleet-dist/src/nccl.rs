//! NCCL collectives on the device candle computes on (feature `nccl`): cudarc's communicator,
//! created in the thread that uses it, on candle's stream, with this crate's TCP [`Group`] for
//! the small metadata and the communicator's unique id (rank 0's rendezvous payload).

use std::rc::Rc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};
use candle_core::{CpuStorage, CudaStorage, Device, InplaceOp1, Layout, Tensor, Var};

use crate::{Collective, DistError, Group, Result};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// A new NCCL unique id (rank 0), as the bytes the rendezvous hands to every rank.
pub fn new_id() -> Result<Vec<u8>> {
    let id = Id::new().map_err(|e| DistError::Nccl {
        problem: format!("ncclGetUniqueId: {e:?}"),
    })?;
    Ok(id.internal().iter().map(|&c| c as u8).collect())
}

/// NCCL for the tensors, the TCP group for the rest.
pub struct NcclCollective {
    group: Group,
    comm: Rc<Comm>,
}

impl NcclCollective {
    /// Joins the communicator (blocks until every rank has joined).
    pub fn new(group: Group, device: &Device) -> Result<Self> {
        let Device::Cuda(cuda) = device else {
            return Err(DistError::Nccl {
                problem: format!("NCCL needs a CUDA device; this rank computes on {device:?}"),
            });
        };
        let bytes = group.root_payload().to_vec();
        if bytes.len() != ID_BYTES {
            return Err(DistError::Nccl {
                problem: format!(
                    "rank 0 sent an NCCL id of {} bytes, expected {ID_BYTES}",
                    bytes.len()
                ),
            });
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
        .map_err(|e| DistError::Nccl {
            problem: format!("ncclCommInitRank: {e:?}"),
        })?;
        Ok(Self {
            group,
            comm: Rc::new(comm),
        })
    }

    fn in_place(&self, t: &Tensor, op: Op) -> Result<()> {
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
        // A contiguous view anywhere in its storage (a parameter inside a flat buffer): the
        // collective runs on its elements alone.
        if !l.is_contiguous() {
            candle_core::bail!("NCCL needs a contiguous tensor")
        }
        let range = l.start_offset()..l.start_offset() + l.shape().elem_count();
        match s.dtype() {
            candle_core::DType::F32 => call::<f32>(&self.comm, self.op, s, range),
            candle_core::DType::BF16 => call::<half::bf16>(&self.comm, self.op, s, range),
            other => {
                candle_core::bail!("NCCL collectives here take f32 or bf16, not {other:?}")
            }
        }
    }
}

/// One collective in place on the values `range` of `s`.
fn call<T: candle_core::cuda_backend::CudaDType + NcclType>(
    comm: &Comm,
    op: Op,
    s: &mut CudaStorage,
    range: std::ops::Range<usize>,
) -> candle_core::Result<()> {
    let mut view = s.as_cuda_slice_mut::<T>()?.slice_mut(range);
    let done = match op {
        Op::Sum => comm.all_reduce_in_place(&mut view, &ReduceOp::Sum),
        Op::BroadcastFromRoot => comm.broadcast_in_place(&mut view, 0),
    };
    done.map(|_| ())
        .map_err(|e| candle_core::Error::Msg(format!("NCCL: {e:?}")))
}

impl Collective for NcclCollective {
    fn group(&self) -> &Group {
        &self.group
    }

    fn all_reduce_sum(&self, t: Tensor) -> Result<Tensor> {
        // Summed in place (see the trait); a view elsewhere in a larger buffer is copied first,
        // the view alone (`copy()` would clone the whole buffer and keep the offset).
        let t = if t.is_contiguous() && t.layout().start_offset() == 0 {
            t
        } else {
            t.force_contiguous()?
        };
        self.in_place(&t, Op::Sum)?;
        Ok(t)
    }

    fn broadcast_vars(&self, vars: &[Var]) -> Result<()> {
        for v in vars {
            if !matches!(
                v.dtype(),
                candle_core::DType::F32 | candle_core::DType::BF16
            ) {
                return Err(DistError::Nccl {
                    problem: format!(
                        "broadcast of {:?} weights: master weights are f32 or bf16",
                        v.dtype()
                    ),
                });
            }
            self.in_place(v.as_tensor(), Op::BroadcastFromRoot)?;
        }
        Ok(())
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn finish(self: Box<Self>) -> Result<()> {
        // Every rank's NCCL work is done once the TCP group has said goodbye.
        self.group.finish()
    }
}
