//! The edit-score judge for fleet.
//!
//! - [`benchmark`] — the benchmark loaders: the original scorer's JSON, GEdit-Bench's layout and
//!   a plain JSONL, all validated up front into [`benchmark::Loaded`].

pub mod benchmark;
