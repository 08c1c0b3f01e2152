//! Real experiments: the jobs of `run`, `compare` and a real `sweep`, and their summary file.
//!
//! Strategies, c_r points, step cap and MDP come from the same [`ExperimentConfig`] as the
//! simulation; ARGO's policy is solved once per c_r point. The summary says `"world": "real"`
//! and carries the model, the dataset, the config, the seed and the commit.

use std::sync::Arc;

use serde::Serialize;

use crate::dataset::{Dataset, Question};
use crate::llm::LlmStats;
use crate::prompts::Prompts;
use crate::runner::RunProgress;
use crate::runner::{Job, RealSummary};
use crate::simulate::{derive_seed, Stream};
use crate::strategy::{Strategy, StrategyError};
use crate::{ExperimentConfig, MdpError, MdpParams, StrategyKind};
use fleet_models::embedder::EmbedderId;
use fleet_models::CheckpointIdentity;
use fleet_runs::Manifest;

/// Errors of building an experiment.
#[derive(Debug, thiserror::Error)]
pub enum ExperimentError {
    /// The MDP could not be solved for a c_r point.
    #[error("solving the MDP at c_r = {c_r}: {source}")]
    Solve {
        /// The point.
        c_r: f64,
        /// The solver's error.
        source: MdpError,
    },
    /// A strategy could not be built.
    #[error(transparent)]
    Strategy(#[from] StrategyError),
}

/// Retrieval settings of a real run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct RetrievalConfig {
    /// Chunks per query.
    pub top_k: usize,
    /// Cosine similarity a new chunk needs to count as progress.
    pub threshold: f32,
    /// Similarity alone, or an LLM judgement of the new chunks.
    pub progress: crate::runner::ProgressRule,
}

impl Default for RetrievalConfig {
    /// 3 chunks; 0.3 cosine (all-MiniLM-L6-v2 scores unrelated text near 0 and on-topic
    /// passages above 0.4).
    fn default() -> Self {
        RetrievalConfig {
            top_k: 3,
            threshold: 0.3,
            progress: crate::runner::ProgressRule::Similarity,
        }
    }
}

/// One job per (c_r, strategy, question), ARGO solved per c_r. The step cap, stop level and
/// seeds follow `cfg`; each question's seed comes from the run seed and its position, so every
/// strategy and c_r point sees the same random stream for a question.
pub fn build_jobs(
    questions: &[Arc<Question>],
    cfg: &ExperimentConfig,
    strategies: &[StrategyKind],
    c_r_values: &[f64],
) -> Result<Vec<Job>, ExperimentError> {
    let mut jobs = Vec::with_capacity(questions.len() * strategies.len() * c_r_values.len());
    for &c_r in c_r_values {
        let params = MdpParams { c_r, ..cfg.mdp };
        let solution = if strategies.contains(&StrategyKind::Argo) {
            Some(Arc::new(
                crate::mdp::solve(&params, &cfg.solver)
                    .map_err(|source| ExperimentError::Solve { c_r, source })?,
            ))
        } else {
            None
        };
        let stop_u = cfg.strategies.stop_progress * params.u_max;
        for &kind in strategies {
            let strategy = Strategy::new(kind, stop_u, solution.clone())?;
            for (i, q) in questions.iter().enumerate() {
                jobs.push(Job {
                    question: q.clone(),
                    strategy: strategy.clone(),
                    params,
                    step_cap: cfg.episode.step_cap,
                    seed: derive_seed(cfg.sweep.seed, i as u64, Stream::Strategy),
                });
            }
        }
    }
    Ok(jobs)
}

/// Everything that determines a real run's records, for its output directory's manifest
/// ([`fleet_runs::RunDir`]).
pub struct RealRunInputs<'a> {
    /// The LLM's weights, config and tokenizer, by content.
    pub model: &'a CheckpointIdentity,
    /// The LLM's dtype (`bf16`, `f16`, `f32`).
    pub dtype: &'a str,
    /// The embedder that searches the index.
    pub embedder: &'a EmbedderId,
    /// Digest of the index's files ([`crate::index::VectorIndex::content_digest`]).
    pub index_digest: &'a str,
    /// The dataset as loaded (the pool questions are sampled from).
    pub dataset: &'a Dataset,
    /// ORAN-Bench difficulty (`None` for a JSONL dataset).
    pub difficulty: Option<crate::dataset::Difficulty>,
    /// The experiment config.
    pub config: &'a ExperimentConfig,
    /// Retrieval settings.
    pub retrieval: &'a RetrievalConfig,
    /// The components' prompts.
    pub prompts: &'a Prompts,
}

/// The job name in a real run's manifest.
pub const REAL_RUN_JOB: &str = "argo-exp real run";

/// The manifest of a real run's output directory: model (weights, config and tokenizer by
/// content, dtype), embedder, index, dataset (content and difficulty), the MDP and solver, the
/// step cap, the baselines' stop level, the seed, retrieval and prompts.
///
/// Left out, because a record's key already carries them or they do not change an answer:
/// strategies and c_r points (in each record's key), how many questions are sampled (a
/// smaller sample is a prefix of a larger one, so a run can be extended), batch sizes and
/// placement.
pub fn real_run_manifest(inputs: &RealRunInputs<'_>) -> Manifest {
    let mut mdp = serde_json::to_value(inputs.config.mdp).unwrap_or_default();
    if let Some(obj) = mdp.as_object_mut() {
        // Each record's key carries its c_r.
        obj.remove("c_r");
    }
    Manifest::new(REAL_RUN_JOB)
        .with("model", inputs.model)
        .with("dtype", inputs.dtype)
        .with("embedder", inputs.embedder)
        .with("index_digest", inputs.index_digest)
        .with(
            "dataset",
            serde_json::json!({
                "questions_digest": json_digest(&inputs.dataset.questions),
                "questions": inputs.dataset.questions.len(),
                "difficulty": inputs.difficulty,
            }),
        )
        .with("mdp", mdp)
        .with("solver", inputs.config.solver)
        .with("step_cap", inputs.config.episode.step_cap)
        .with("stop_progress", inputs.config.strategies.stop_progress)
        .with("seed", inputs.config.sweep.seed)
        .with("retrieval", inputs.retrieval)
        .with("prompts_digest", json_digest(inputs.prompts))
}

/// Digest of a value's JSON form.
fn json_digest<T: serde::Serialize + ?Sized>(value: &T) -> String {
    fleet_data::digest::bytes_digest(&serde_json::to_vec(value).unwrap_or_default())
}

/// The summary file of a real run.
#[derive(Debug, Clone, Serialize)]
pub struct RealRunSummary {
    /// Always `"real"`: these numbers come from a model answering questions.
    pub world: &'static str,
    /// The LLM (path or hub id, `@revision` when given) and its dtype.
    pub model: String,
    /// The embedder's identity.
    pub embedder: serde_json::Value,
    /// The index directory.
    pub index: String,
    /// The dataset and how it was sampled.
    pub dataset: serde_json::Value,
    /// Questions per (strategy, c_r).
    pub n_questions: usize,
    /// Per (strategy, c_r): accuracy with its 95% interval, cost, steps, retrievals,
    /// unparsed answers, LLM calls and tokens.
    pub results: Vec<RealSummary>,
    /// The LLM's totals (calls, cache hits, tokens, batches).
    pub llm: LlmStats,
    /// Wall time of the run, loading excluded.
    pub wall_s: f64,
    /// Jobs taken from an earlier run's records.
    pub resumed_jobs: usize,
    /// Where the wall time went: rounds, milliseconds in LLM calls and in retrieval.
    pub progress: RunProgress,
    /// The whole experiment config.
    pub config: ExperimentConfig,
    /// Retrieval settings.
    pub retrieval: RetrievalConfig,
    /// Where the GPU work ran (placement mode and replicas).
    pub placement: String,
    /// How the LLM's calls were batched.
    pub batching: BatchingSummary,
    /// The commit measured.
    pub commit: String,
}

/// How a real run batched its LLM calls (the settings its speed depends on; its records do
/// not).
#[derive(Debug, Clone, Serialize)]
pub struct BatchingSummary {
    /// `continuous` or `static`.
    pub mode: &'static str,
    /// Per replica: decode slots (continuous) or prompts per batch (static).
    pub max_batch: usize,
    /// Questions advancing together.
    pub max_in_flight: usize,
    /// Each replica's paged KV cache in bytes (continuous only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_bytes: Option<u64>,
    /// Decode steps queued before a read of their tokens (continuous only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_scheduler_steps: Option<usize>,
}

/// A table of the results, one row per (c_r, strategy).
pub fn render_real_table(results: &[RealSummary]) -> String {
    let mut out = format!(
        "[real] {:<8} {:<18} {:>6} {:>17} {:>8} {:>6} {:>6} {:>8} {:>9} {:>6}\n",
        "c_r",
        "strategy",
        "acc",
        "95% CI",
        "cost",
        "retr",
        "steps",
        "unparsed",
        "llm calls",
        "hits"
    );
    for r in results {
        let s = &r.summary;
        out.push_str(&format!(
            "[real] {:<8.4} {:<18} {:>6.3} [{:>6.3}, {:>6.3}] {:>8.4} {:>6.2} {:>6.2} {:>8} {:>9} {:>6}\n",
            r.c_r,
            s.label,
            s.accuracy,
            s.accuracy_ci95[0],
            s.accuracy_ci95[1],
            s.mean_cost,
            s.mean_retrievals,
            s.mean_steps,
            r.unparsed,
            r.llm_calls,
            r.cache_hits
        ));
    }
    out
}
