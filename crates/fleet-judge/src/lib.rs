//! The edit-score judge for fleet: everything but the model.
//!
//! - [`benchmark`] — the benchmark loaders: the original scorer's JSON, GEdit-Bench's layout and
//!   a plain JSONL, all validated up front into [`benchmark::Loaded`].
//! - [`job`] — the scoring job assembled: checkpoint checked, calls too long skipped, the
//!   output directory opened, replicas loaded by plan, the report written ([`job::run`]).
//! - [`judge`] — the boundary to the model: [`judge::Judge`] judges a batch of
//!   [`judge::JudgeRequest`]s (system text, images and text) with a [`judge::Decoding`]
//!   (greedy by default, or sampled with a recorded seed).
//! - [`prompts`] — prompt sets from TOML (`configs/judge/`): scheme `single` (the original
//!   scorer's per-category rubrics, `Score: X`) or `viescore` (SC and PQ calls), which images
//!   the judge sees, templates with placeholders checked at load; a content hash.
//! - [`qwen`] — the Qwen3-VL judge: [`qwen::Qwen3VlJudge`] over fleet-serve's Qwen3-VL
//!   replicas (one per GPU or GPU group, the first here and the others in child processes),
//!   requests rendered with the checkpoint's chat template, greedy by default; the model id
//!   that keys the records ([`qwen::judge_model_id`]).
//! - [`parse`] — strict score parsing: a reply that does not parse is a
//!   [`parse::ParseFailed`] with its raw text, never a substitute score.
//! - [`records`] — append-only JSONL records keyed by content (resume, rescoring of changed
//!   images), the run summary, and the merge of shards (fleet-runs' `RunDir`, `JsonlLog`,
//!   `merge_jsonl`).
//! - [`run`] — the scoring loop over a pool of judges ([`run::Session`]: open, plan, run).
//! - [`report`] — per-category statistics, overall figures, `report.json`, `report.md` and a
//!   chart (PNG and SVG).

#![warn(missing_docs)]

pub mod benchmark;
mod chart;
pub mod job;
pub mod judge;
pub mod parse;
pub mod prompts;
pub mod qwen;
pub mod records;
pub mod report;
pub mod run;
