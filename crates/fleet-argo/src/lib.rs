//! ARGO: adaptive retrieval-augmented question answering.
//!
//! An MDP over a progress state `U` decides at every step whether to Retrieve, Reason or
//! Terminate. This crate holds the MDP and its solver, the strategies compared against it, the
//! simulated world, the datasets (ORAN-Bench-13K and a generic multiple-choice JSONL format),
//! the answer parser, and the experiment runner.
//!
//! - [`params`]: the MDP's parameters (the world) and the solver's settings, with ranges.
//! - [`mdp`]: value iteration, Q-table, thresholds, the two-threshold check.
//! - [`strategy`]: the strategies and the poll-style [`Episode`] they act in.
//! - [`simulate`]: the simulated world (the MDP's own model), seeded per question.
//! - [`sweep`]: the cost sweep, its config, table and result files; [`plot`]: its graphs.
//! - [`summary`], [`stats`]: per-strategy summaries, Wilson intervals, atomic result files.
//! - [`dataset`]: ORAN-Bench-13K and generic multiple-choice JSONL, stable sampling;
//!   [`answer`]: the answer parser (unparsed answers are recorded, never defaulted).
//! - Real runs: [`llm`] (a fleet-models checkpoint on any placement, exact cache),
//!   [`prompts`] (the components' templates, from `configs/argo_prompts.toml`), [`index`] (the
//!   on-disk vector index), [`runner`] (jobs that ask their next call as soon as their last
//!   one returns, records with resume).

/// The answer parser, from fleet-data (shared with gspo-train's multiple-choice reward).
pub use fleet_data::answer;
pub mod dataset;
pub mod experiment;
pub mod index;
pub mod llm;
pub mod mdp;
pub mod params;
pub mod plot;
pub mod prompts;
pub mod real_run;
pub mod runner;
pub mod simulate;
pub mod stats;
pub mod strategy;
pub mod summary;
pub mod sweep;

pub use mdp::{solve, Action, MdpError, QValues, Solution};
pub use params::{MdpParams, ParamError, Quality, SolverConfig};
pub use simulate::{SimulatedQuestion, SimulatedWorld, SIMULATION};
pub use strategy::{
    Episode, EpisodeError, EpisodeRecord, EpisodeState, Outcome, Strategy, StrategyKind,
};
pub use summary::{StrategySummary, Tally};
pub use sweep::{run_sweep, ExperimentConfig, Mode, SweepError, SweepResult};
