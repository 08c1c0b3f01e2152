//! Per-strategy summaries (accuracy with its Wilson 95% interval, cost, steps, retrievals),
//! and the result files: JSON written atomically, JSONL records, the commit being measured.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::stats::{wilson_interval, Z_95};
use crate::strategy::{EpisodeRecord, StrategyKind};

/// Errors writing result files.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// A file or directory could not be written.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A value could not be serialized.
    #[error("cannot serialize {what}: {source}")]
    Json {
        /// What was being written.
        what: String,
        /// The cause.
        source: serde_json::Error,
    },
    /// A result file could not be written (fleet-runs' atomic writes).
    #[error(transparent)]
    Runs(#[from] fleet_runs::RunsError),
    /// A plot could not be drawn.
    #[error("cannot draw {path}: {message}")]
    Plot {
        /// The plot file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

impl From<fleet_plot::PlotError> for OutputError {
    fn from(e: fleet_plot::PlotError) -> Self {
        match e {
            fleet_plot::PlotError::Draw { path, message } => OutputError::Plot { path, message },
            fleet_plot::PlotError::Io { path, source } => OutputError::Io { path, source },
        }
    }
}

impl OutputError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        OutputError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// One strategy's results over a set of questions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StrategySummary {
    /// The strategy (`argo`, `fixed-k:3`, ...).
    pub strategy: StrategyKind,
    /// Its name in tables and plots.
    pub label: String,
    /// Questions.
    pub n_questions: u64,
    /// Right answers.
    pub correct: u64,
    /// `correct / n_questions`.
    pub accuracy: f64,
    /// Wilson score 95% interval of the accuracy, `[low, high]`.
    pub accuracy_ci95: [f64; 2],
    /// Mean probability of being right given where each episode ended (simulation:
    /// sigma(U / U_max); None where no such model exists).
    pub expected_accuracy: Option<f64>,
    /// Mean `c_r * retrievals + c_p * reasons` per question.
    pub mean_cost: f64,
    /// Mean `mu * cost`.
    pub mean_weighted_cost: f64,
    /// Mean of (expected accuracy - mu * cost): quality net of the objective's cost charge,
    /// undiscounted.
    pub mean_net: Option<f64>,
    /// Mean discounted objective (simulation: [`crate::simulate::discounted_return`] with the
    /// expected terminal reward): what ARGO maximises in expectation; V(0) predicts it when the
    /// step cap does not bind.
    pub mean_discounted_objective: Option<f64>,
    /// Mean Retrieve + Reason steps.
    pub mean_steps: f64,
    /// Mean Retrieve steps.
    pub mean_retrievals: f64,
    /// Mean Retrieve steps that made progress.
    pub mean_successful_retrievals: f64,
    /// Mean Reason steps.
    pub mean_reasons: f64,
    /// Mean `U` at the answer.
    pub mean_final_u: f64,
    /// Episodes whose answer the step cap forced.
    pub forced_terminations: u64,
}

/// What a model of the world says about one finished question (the simulated world has one;
/// a real run has none).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelScore {
    /// Probability of being right at the final `U`: sigma(U / U_max).
    pub expected_accuracy: f64,
    /// The MDP's discounted objective of the episode.
    pub discounted_objective: f64,
}

/// Accumulates episodes into a [`StrategySummary`].
#[derive(Debug, Clone)]
pub struct Tally {
    strategy: StrategyKind,
    n: u64,
    correct: u64,
    expected_sum: f64,
    expected_n: u64,
    objective_sum: f64,
    objective_n: u64,
    cost: f64,
    weighted_cost: f64,
    steps: u64,
    retrievals: u64,
    successful: u64,
    reasons: u64,
    final_u: f64,
    forced: u64,
}

impl Tally {
    /// An empty tally for `strategy`.
    pub fn new(strategy: StrategyKind) -> Self {
        Tally {
            strategy,
            n: 0,
            correct: 0,
            expected_sum: 0.0,
            expected_n: 0,
            objective_sum: 0.0,
            objective_n: 0,
            cost: 0.0,
            weighted_cost: 0.0,
            steps: 0,
            retrievals: 0,
            successful: 0,
            reasons: 0,
            final_u: 0.0,
            forced: 0,
        }
    }

    /// Adds one question: its episode, whether the answer was right (an unparsed answer counts
    /// as not right; count those separately), and the model's figures if there is a model.
    pub fn add(&mut self, episode: &EpisodeRecord, correct: bool, model: Option<ModelScore>) {
        self.n += 1;
        self.correct += u64::from(correct);
        if let Some(m) = model {
            self.expected_sum += m.expected_accuracy;
            self.expected_n += 1;
            self.objective_sum += m.discounted_objective;
            self.objective_n += 1;
        }
        self.cost += episode.cost;
        self.weighted_cost += episode.weighted_cost;
        self.steps += u64::from(episode.steps);
        self.retrievals += u64::from(episode.retrievals);
        self.successful += u64::from(episode.successful_retrievals);
        self.reasons += u64::from(episode.reasons);
        self.final_u += episode.final_u;
        self.forced += u64::from(episode.forced_termination);
    }

    /// The summary; None when nothing was added.
    pub fn finish(&self) -> Option<StrategySummary> {
        if self.n == 0 {
            return None;
        }
        let n = self.n as f64;
        let (lo, hi) = wilson_interval(self.correct, self.n, Z_95)?;
        // Expected accuracy only when every question had one, so the mean is over all.
        let expected = (self.expected_n == self.n).then(|| self.expected_sum / n);
        let objective = (self.objective_n == self.n).then(|| self.objective_sum / n);
        Some(StrategySummary {
            strategy: self.strategy,
            label: self.strategy.label(),
            n_questions: self.n,
            correct: self.correct,
            accuracy: self.correct as f64 / n,
            accuracy_ci95: [lo, hi],
            expected_accuracy: expected,
            mean_cost: self.cost / n,
            mean_weighted_cost: self.weighted_cost / n,
            mean_net: expected.map(|e| e - self.weighted_cost / n),
            mean_discounted_objective: objective,
            mean_steps: self.steps as f64 / n,
            mean_retrievals: self.retrievals as f64 / n,
            mean_successful_retrievals: self.successful as f64 / n,
            mean_reasons: self.reasons as f64 / n,
            mean_final_u: self.final_u / n,
            forced_terminations: self.forced,
        })
    }
}

pub use fleet_runs::commit_id;

/// Writes `bytes` to `path` atomically ([`fleet_runs::write_atomic`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), OutputError> {
    Ok(fleet_runs::write_atomic(path, bytes)?)
}

/// Serializes `value` as pretty JSON and writes it atomically.
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<(), OutputError> {
    Ok(fleet_runs::write_json_atomic(path, value)?)
}

/// Writes `records` as JSON Lines, one record a line (atomically: the file is complete or
/// absent).
pub fn write_jsonl_atomic<T: Serialize>(path: &Path, records: &[T]) -> Result<(), OutputError> {
    let mut text = String::new();
    for r in records {
        let line = serde_json::to_string(r).map_err(|source| OutputError::Json {
            what: path.display().to_string(),
            source,
        })?;
        text.push_str(&line);
        text.push('\n');
    }
    write_atomic(path, text.as_bytes())
}
