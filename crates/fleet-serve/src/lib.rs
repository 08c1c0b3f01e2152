//! Serving fleet's models: the layer between the model code (fleet-models) and the jobs.
//!
//! - [`placement`] — where a job's replicas go on this machine: the placement flags
//!   ([`PlacementRequest`]), the planner run on the live topology ([`plan_on_this_machine`]),
//!   and the device map of each replica ([`device_maps`]; one CPU replica without GPUs).
//! - [`Replicas`] / [`Replica`] — one replica layer for every kind of model ([`ModelKind`]:
//!   [`Text`], [`VisionLanguage`]): the first replica in this process, the others in child
//!   processes of their own when they use GPUs ([`process`]); batches spread over them by
//!   fleet-dist's pool ([`Replicas::generate`]), or one replica per caller thread
//!   ([`Replicas::into_replicas`]).
//! - [`ReplicaStream`] — continuous batching over the replicas: requests one by one, replies as
//!   they finish, every replica (in a process of its own too) stepping its own paged session
//!   ([`Replicas::streams`]).
//! - [`ChatRequest`] — the one request a job sends to a vision-language model: a chat
//!   (transformers' messages), its images as `Arc`s, the token limit, sampling and stop
//!   strings. It reaches the model's generate call as it was made ([`generate_chats`]); its
//!   images are never copied in this process, and only a child process's wire serialises their
//!   pixels.
//!
//! ```no_run
//! use fleet_models::{GenerationRequest, LoadOptions};
//! use fleet_serve::{PlacementRequest, Replicas, Text};
//!
//! # fn main() -> fleet_models::Result<()> {
//! let opts = LoadOptions::default();
//! let request = PlacementRequest::new("data-parallel".parse()?);
//! let replicas = Replicas::<Text>::load_planned("Qwen/Qwen2.5-7B-Instruct", &opts, &request)?;
//! let requests = vec![GenerationRequest::greedy(vec![1, 2, 3], 16); 64];
//! let outputs = replicas.generate(&requests, 32, false)?;
//! # Ok(()) }
//! ```
//!
//! A program whose replicas may run in child processes calls
//! [`serve_if_replica_worker`] first thing in `main`.

#![warn(missing_docs)]

pub mod chat;
pub mod kind;
pub mod placement;
pub mod process;
pub mod replica;
pub mod stream;
mod wire;

pub use chat::{generate_chats, ChatOutcome, ChatRequest};
pub use kind::{ModelKind, Text, VisionLanguage};
pub use placement::{
    default_workload, device_maps, paged_workload, plan_on_this_machine, MaxMemory,
    PlacementRequest, PlanMode, Workload,
};
pub use process::{serve_if_replica_worker, EXIT_AFTER_ENV, PROCESSES_ENV, WORKER_ENV};
pub use replica::{Replica, Replicas};
pub use stream::{step_all, stream_options, ReplicaStream, StreamConfig};
pub use wire::Spool;
