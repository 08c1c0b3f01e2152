//! Execution across threads, processes and machines for fleet: where the work runs.
//!
//! This crate sits below the jobs and `fleet-serve`, beside `fleet-models` (model code, which
//! does not depend on it), and never imports model code; `fleet-serve` runs model replicas on
//! its pool. What a run writes (output directories, manifests, records, merges, atomic writes)
//! is `fleet-runs`'s, not this crate's. It holds:
//!
//! - [`ReplicaPool`] — one OS thread per [`Worker`] (one replica per GPU), a shared work queue
//!   (faster workers take more items), results in input order, failed items retried on other
//!   workers and never replaced by a default value, per-worker progress bars.
//! - [`ShardSpec`] — which part of a job this process runs: from `--num-shards/--shard-index`,
//!   SLURM (`SLURM_PROCID`/`SLURM_NTASKS`) or torchrun (`RANK`/`WORLD_SIZE`).
//!
//! Data-parallel processes (one rank per GPU):
//!
//! - [`World`] — this process's rank, from torchrun's variables, fleet's launcher or SLURM
//!   ([`World::from_env`], [`expand_nodelist`] for `gpu[01-03,07]`).
//! - [`launch()`] — starts N ranks of a program on this node, one GPU each
//!   (`CUDA_VISIBLE_DEVICES`, always `NCCL_NVLS_ENABLE=0`), forwards their output as
//!   `[rank K] ...`, and kills the rest a grace period after one fails.
//! - [`rendezvous()`] — the ranks meet rank 0 over TCP: same world size and config fingerprint
//!   everywhere (or every rank fails naming the odd one), absent ranks named after a timeout,
//!   rank 0's payload (the NCCL unique id) delivered to all.
//! - [`Group`] — after the rendezvous: a heartbeat that ends every rank, naming the culprit, when
//!   one dies or stalls ([`PeerFailure`]); and simple deterministic TCP collectives (barrier,
//!   broadcast, all-gather, all-reduce sums of f32/f64) for the CPU path and small metadata.
//! - `Collective` (feature `tensors`) — collectives of candle tensors between the ranks:
//!   `TcpCollective` over the [`Group`] on the CPU, `nccl::NcclCollective` on GPUs (feature
//!   `nccl`), bucketed sums, `bench_all_reduce` in nccl-tests' terms.

#![warn(missing_docs)]

#[cfg(feature = "tensors")]
mod collective;
mod group;
mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
mod pool;
mod rendezvous;
mod shard;
mod wire;
mod world;

#[cfg(feature = "tensors")]
pub use collective::{bench_all_reduce, buckets, AllReducePerf, Collective, TcpCollective};
pub use group::{FailureHandler, Group, PeerFailure, PeerInfo, FAILURE_EXIT_CODE};
pub use launch::{
    launch, launch_with_grace, pick_free_port, strip_launcher_args, LaunchReport, LaunchSpec,
    RankExit, DEFAULT_GRACE_PERIOD,
};
pub use pool::{
    BoxError, FailureRecord, ItemError, ItemResult, PoolOptions, PoolOutput, PoolReport,
    ReplicaPool, StopRun, Worker, WorkerReport,
};
pub use rendezvous::{
    rendezvous, RendezvousFault, RendezvousOptions, DEFAULT_FAILURE_TIMEOUT,
    DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_RENDEZVOUS_TIMEOUT, RENDEZVOUS_TIMEOUT_ENV, TIMEOUT_ENV,
};
pub use shard::{ShardSource, ShardSpec};
pub use world::{
    describe_environment, expand_nodelist, parse_tasks_per_node, rank_gpus, Launcher, World,
    DEFAULT_MASTER_PORT, FLEET_LAUNCHER_ENV,
};

/// Errors of this crate. Each message names the value at fault and what to change.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The pool was given items but no worker to run them.
    #[error("the replica pool got {items} items but no workers: pass at least one worker (one per GPU or replica)")]
    NoWorkers {
        /// Number of items that would have run.
        items: usize,
    },
    /// A worker ended the whole run with a [`StopRun`] error (e.g. its results file cannot be
    /// written); the items not yet run were not run.
    #[error("the run stopped: {worker} failed on item {item} with an error that ends the run: {message}")]
    RunStopped {
        /// The worker's name.
        worker: String,
        /// The item it failed on (input index).
        item: usize,
        /// The cause.
        message: String,
    },
    /// `PoolOptions::max_attempts` was zero.
    #[error("max_attempts = 0 would never run an item: use at least 1, or None for one attempt per worker")]
    ZeroAttempts,
    /// A shard count of zero.
    #[error("{source_name} gives a shard count of 0: the number of shards must be at least 1")]
    ZeroShards {
        /// Where the count came from (`--num-shards`, `SLURM_NTASKS`, `WORLD_SIZE`).
        source_name: String,
    },
    /// A shard index not below the shard count.
    #[error("shard index {index} (from {source_name}) is out of range for {count} shards: use an index in 0..{count}")]
    ShardIndexOutOfRange {
        /// The index as given.
        index: usize,
        /// The shard count.
        count: usize,
        /// Where the values came from.
        source_name: String,
    },
    /// One value of a pair was given without the other.
    #[error("{given} is set but {missing} is not: set both, or neither")]
    IncompletePair {
        /// The flag or variable that was given.
        given: String,
        /// The flag or variable that is missing.
        missing: String,
    },
    /// An environment variable that must hold a non-negative integer does not.
    #[error("environment variable {var}=`{value}` is not a non-negative integer: fix or unset it")]
    BadEnvNumber {
        /// Variable name.
        var: String,
        /// Its value.
        value: String,
    },
    /// An environment variable holds a value of the wrong form.
    #[error("environment variable {var}=`{value}` is not {expected}: fix or unset it")]
    BadEnvValue {
        /// Variable name.
        var: String,
        /// Its value.
        value: String,
        /// What it should be.
        expected: String,
    },
    /// Rank numbers that contradict each other (from the environment or built by hand).
    #[error("invalid world: {problem}")]
    BadWorld {
        /// What is wrong, naming the value and where it came from.
        problem: String,
    },
    /// A SLURM host list that does not parse.
    #[error("cannot expand SLURM node list `{list}`: {reason}; expected names such as `gpu[01-03,07],login1`")]
    BadNodelist {
        /// The list (with its variable, when it came from one).
        list: String,
        /// What is wrong.
        reason: String,
    },
    /// A launch spec that cannot run.
    #[error("cannot launch: {field} {problem}")]
    BadLaunch {
        /// The `LaunchSpec` field at fault.
        field: &'static str,
        /// What is wrong and what to change.
        problem: String,
    },
    /// A rank's process could not be started.
    #[error("cannot start rank {rank} (`{program}`): {source}; check that the program exists and is executable")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program.
        program: std::path::PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Ranks started by the launcher failed.
    #[error("ranks failed on this node ({report}); their own messages, the `[rank K]` lines above, say why")]
    RanksFailed {
        /// How every rank ended.
        report: Box<LaunchReport>,
    },
    /// An option of the rendezvous or the failure detection that cannot work.
    #[error("{field} {problem}")]
    BadOption {
        /// The option.
        field: &'static str,
        /// What is wrong and what to change.
        problem: String,
    },
    /// Rank 0 cannot listen for the other ranks.
    #[error("rank 0 cannot listen on {addr} (port {port}): {source}; another job may use the port: pick another with --master-port or MASTER_PORT")]
    Listen {
        /// The address it tried to bind.
        addr: String,
        /// The port.
        port: u16,
        /// The cause.
        source: std::io::Error,
    },
    /// A rank could not reach rank 0 within the rendezvous timeout.
    #[error("rank {rank} could not reach rank 0 at {addr}:{port} within {waited_secs:.1} s (last error: {last_error}): check that rank 0 started, that MASTER_ADDR/MASTER_PORT (--master-addr/--master-port) name it, and that the port is open between the nodes")]
    Connect {
        /// The rank that tried.
        rank: usize,
        /// Rank 0's address.
        addr: String,
        /// Rank 0's port.
        port: u16,
        /// How long it tried.
        waited_secs: f64,
        /// The last connection error.
        last_error: String,
    },
    /// The rendezvous was refused or timed out; every rank that arrived gets the same fault.
    #[error("rendezvous failed: {0}")]
    Rendezvous(Box<RendezvousFault>),
    /// A connection broke during the rendezvous.
    #[error("rank {rank}: rendezvous with {peer} failed: {problem}")]
    RendezvousLost {
        /// The rank reporting.
        rank: usize,
        /// The other side.
        peer: String,
        /// What happened.
        problem: String,
    },
    /// A rank died, stalled or broke the protocol (after the failure handler returned).
    #[error("{0}")]
    PeerFailed(PeerFailure),
    /// This rank and rank 0 disagree about the sequence of collectives.
    #[error("collective out of step on rank {rank}: {problem}")]
    CollectiveMismatch {
        /// The rank reporting.
        rank: usize,
        /// What differs.
        problem: String,
    },
    /// A collective after an earlier one failed.
    #[error("rank {rank}'s group is unusable after an earlier error ({why}): end the run")]
    GroupBroken {
        /// The rank.
        rank: usize,
        /// The earlier error.
        why: String,
    },
    /// A collective called with arguments it cannot use.
    #[error("rank {rank}: {problem}")]
    BadCall {
        /// The rank.
        rank: usize,
        /// What is wrong.
        problem: String,
    },
    /// The node's GPUs cannot be shared equally among its ranks ([`rank_gpus`]).
    #[error("this rank sees {} GPUs ({visible:?}) and its node runs {local_world_size} ranks (LOCAL_WORLD_SIZE): the GPUs cannot be shared equally; start one rank per GPU, give --gpu-ids, or set CUDA_VISIBLE_DEVICES for each rank", visible.len())]
    UnevenGpus {
        /// The GPUs this rank sees.
        visible: Vec<usize>,
        /// Ranks on this node.
        local_world_size: usize,
    },
    /// Rank 0 broadcast another number of values than this rank's variables hold.
    #[error("rank 0 sent {sent} weights, this rank's model has {here}: the ranks do not run the same model")]
    WeightsMismatch {
        /// Values rank 0 sent.
        sent: usize,
        /// Values this rank's variables hold.
        here: usize,
    },
    /// NCCL could not be set up or called (its id, the device, a dtype it does not take).
    #[error("{problem}")]
    Nccl {
        /// What failed, with NCCL's own words where it gave some.
        problem: String,
    },
    /// A tensor operation of a collective failed.
    #[cfg(feature = "tensors")]
    #[error("tensor error: {0}")]
    Tensor(#[from] candle_core::Error),
}

impl From<RendezvousFault> for DistError {
    fn from(f: RendezvousFault) -> Self {
        DistError::Rendezvous(Box::new(f))
    }
}

/// Result type of this crate.
pub type Result<T, E = DistError> = std::result::Result<T, E>;
