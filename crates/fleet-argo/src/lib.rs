//! ARGO: adaptive retrieval-augmented question answering.
//!
//! An MDP over a progress state `U` decides at every step whether to Retrieve, Reason or
//! Terminate. This crate holds the MDP and its solver, the strategies compared against it, the
//! simulated world, the datasets (ORAN-Bench-13K and a generic multiple-choice JSONL format),
//! the answer parser, and the experiment runner.

pub mod answer;
pub mod dataset;
pub mod mdp;
pub mod simulate;
pub mod strategy;
