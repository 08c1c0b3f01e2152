//! The cost sweep (experiment 1): for each retrieval cost `c_r` on a grid, solve the MDP and
//! run every strategy on the same simulated questions; then the comparison table, the summary
//! JSON, one JSONL record per (c_r, strategy), and the plots (Graph 1.A accuracy vs c_r,
//! Graph 1.B retrieval calls vs c_r, Graph 1.C accuracy vs mean cost).
//!
//! The original swept `c_r` over `linspace(c_p, 10 c_p, n)` with n = 10
//! (`ARGO/experiments/runners/Exp_retrieval_cost_impact.py`); its `--mode` presets were
//! small = 10 questions x 5 points, medium = 100 x 10, full = 1000 x 10
//! (`Exp_7B_optimized_full.py`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::mdp::{self, MdpError, SolutionSummary};
use crate::params::{check_closed, check_non_negative, MdpParams, ParamError, SolverConfig};
use crate::simulate::{SimulatedWorld, SIMULATION};
use crate::strategy::{validate_step_cap, EpisodeError, Strategy, StrategyError, StrategyKind};
use crate::summary::{
    write_atomic, write_json_atomic, write_jsonl_atomic, ModelScore, OutputError, StrategySummary,
    Tally,
};

/// Episode settings shared by all strategies.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EpisodeConfig {
    /// The most Retrieve/Reason steps before the answer is forced, for every strategy.
    pub step_cap: u32,
}

impl Default for EpisodeConfig {
    /// 20 steps, the original's `max_steps` in its cost experiment.
    fn default() -> Self {
        EpisodeConfig { step_cap: 20 }
    }
}

/// The strategy set, kept apart from the world.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StrategiesConfig {
    /// Strategies to compare, in table and legend order.
    pub list: Vec<StrategyKind>,
    /// Always-Retrieve, Always-Reason and Random answer once `U >= stop_progress * u_max`.
    pub stop_progress: f64,
}

impl Default for StrategiesConfig {
    /// The five of [`StrategyKind::default_set`]; baselines stop at 0.9 U_max (the original's
    /// fixed `theta_star = 0.9` for its baselines).
    fn default() -> Self {
        StrategiesConfig {
            list: StrategyKind::default_set(),
            stop_progress: 0.9,
        }
    }
}

/// The sweep's grid of costs and its questions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SweepConfig {
    /// Smallest `c_r`.
    pub c_r_min: f64,
    /// Largest `c_r`.
    pub c_r_max: f64,
    /// Number of `c_r` values, evenly spaced from `c_r_min` to `c_r_max`.
    pub points: usize,
    /// Simulated questions per (c_r, strategy).
    pub n_questions: u64,
    /// Run seed.
    pub seed: u64,
}

impl Default for SweepConfig {
    /// `c_r` from c_p = 0.02 to 10 c_p = 0.2 in 10 points, 1000 questions, seed 42.
    fn default() -> Self {
        SweepConfig {
            c_r_min: 0.02,
            c_r_max: 0.2,
            points: 10,
            n_questions: 1000,
            seed: 42,
        }
    }
}

/// The most sweep points and questions accepted (a guard against typos, not a limit of the
/// method).
pub const MAX_POINTS: usize = 10_000;
/// See [`MAX_POINTS`].
pub const MAX_QUESTIONS: u64 = 100_000_000;

impl SweepConfig {
    /// The `c_r` values.
    pub fn c_r_values(&self) -> Vec<f64> {
        if self.points == 1 {
            return vec![self.c_r_min];
        }
        let span = self.c_r_max - self.c_r_min;
        (0..self.points)
            .map(|i| self.c_r_min + span * i as f64 / (self.points - 1) as f64)
            .collect()
    }

    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), ParamError> {
        check_non_negative("sweep.c_r_min", self.c_r_min)?;
        check_non_negative("sweep.c_r_max", self.c_r_max)?;
        if self.c_r_max < self.c_r_min {
            return Err(ParamError::out_of_range(
                "sweep.c_r_max",
                self.c_r_max,
                format!("[sweep.c_r_min = {}, inf)", self.c_r_min),
            ));
        }
        if !(1..=MAX_POINTS).contains(&self.points) {
            return Err(ParamError::out_of_range(
                "sweep.points",
                self.points,
                format!("[1, {MAX_POINTS}]"),
            ));
        }
        if !(1..=MAX_QUESTIONS).contains(&self.n_questions) {
            return Err(ParamError::out_of_range(
                "sweep.n_questions",
                self.n_questions,
                format!("[1, {MAX_QUESTIONS}]"),
            ));
        }
        Ok(())
    }
}

/// Size presets, as the original's `--mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// 10 questions, 5 cost points.
    Small,
    /// 100 questions, 10 cost points.
    Medium,
    /// 1000 questions, 10 cost points.
    Full,
}

impl Mode {
    /// `(n_questions, points)`.
    pub fn size(self) -> (u64, usize) {
        match self {
            Mode::Small => (10, 5),
            Mode::Medium => (100, 10),
            Mode::Full => (1000, 10),
        }
    }
}

/// Everything an ARGO experiment is configured by; the TOML file's layout. `Default` is the
/// embedded default the binary runs with no arguments; `configs/argo.toml` writes the same
/// values out (a test keeps the two equal) and documents the alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ExperimentConfig {
    /// The world. `mdp.c_r` is the cost `solve` uses; the sweep replaces it point by point.
    pub mdp: MdpParams,
    /// Value iteration.
    pub solver: SolverConfig,
    /// Step cap.
    pub episode: EpisodeConfig,
    /// Strategies compared.
    pub strategies: StrategiesConfig,
    /// The cost sweep.
    pub sweep: SweepConfig,
}

/// Errors of configuration and of the sweep.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// The TOML does not parse or has unknown fields.
    #[error("config {source_name}: {message}")]
    Toml {
        /// The file (or `<embedded default>`).
        source_name: String,
        /// The parser's message (it names the field).
        message: String,
    },
    /// The config file cannot be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A parameter is out of range.
    #[error(transparent)]
    Param(#[from] ParamError),
    /// The solver failed.
    #[error("at c_r = {c_r}: {source}")]
    Solve {
        /// The sweep point.
        c_r: f64,
        /// The cause.
        source: MdpError,
    },
    /// A strategy could not be built.
    #[error(transparent)]
    Strategy(#[from] StrategyError),
    /// An episode was driven wrongly (a bug in the loop, never user input).
    #[error(transparent)]
    Episode(#[from] EpisodeError),
}

impl ExperimentConfig {
    /// Parses TOML; fields not given keep their defaults; unknown fields are errors.
    pub fn from_toml_str(text: &str, source_name: &str) -> Result<Self, SweepError> {
        toml::from_str(text).map_err(|e| SweepError::Toml {
            source_name: source_name.to_string(),
            message: e.to_string(),
        })
    }

    /// Reads and parses a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, SweepError> {
        let text = std::fs::read_to_string(path).map_err(|source| SweepError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Sets `n_questions` and `points` from a size preset.
    pub fn apply_mode(&mut self, mode: Mode) {
        let (n, points) = mode.size();
        self.sweep.n_questions = n;
        self.sweep.points = points;
    }

    /// Checks every section.
    pub fn validate(&self) -> Result<(), ParamError> {
        self.mdp.validate()?;
        self.solver.validate(&self.mdp)?;
        validate_step_cap(self.episode.step_cap)?;
        if self.strategies.list.is_empty() {
            return Err(ParamError::out_of_range(
                "strategies.list",
                "[]",
                "at least one strategy",
            ));
        }
        for (i, s) in self.strategies.list.iter().enumerate() {
            s.validate()?;
            // The same strategy twice would be run and printed twice under one label.
            if self.strategies.list[..i]
                .iter()
                .any(|t| t.label() == s.label())
            {
                return Err(ParamError::out_of_range(
                    "strategies.list",
                    s.label(),
                    "each strategy once (this one is listed twice)",
                ));
            }
        }
        check_closed(
            "strategies.stop_progress",
            self.strategies.stop_progress,
            0.0,
            1.0,
        )?;
        self.sweep.validate()?;
        // The solver must accept every swept cost (the grid does not depend on c_r).
        for c_r in [self.sweep.c_r_min, self.sweep.c_r_max] {
            self.mdp.with_c_r(c_r).validate()?;
        }
        Ok(())
    }
}

/// One `c_r` of the sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepPoint {
    /// Always [`SIMULATION`].
    pub world: String,
    /// The retrieval cost.
    pub c_r: f64,
    /// `c_r / c_p` (None when c_p is 0).
    pub c_r_over_c_p: Option<f64>,
    /// The solved MDP's thresholds and structure at this cost.
    pub policy: SolutionSummary,
    /// One summary per strategy, in the configured order.
    pub results: Vec<StrategySummary>,
}

/// The whole sweep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepResult {
    /// Always [`SIMULATION`].
    pub world: String,
    /// The points, by increasing `c_r`.
    pub points: Vec<SweepPoint>,
}

/// Runs the simulated cost sweep.
pub fn run_sweep(config: &ExperimentConfig) -> Result<SweepResult, SweepError> {
    config.validate()?;
    let mut points = Vec::with_capacity(config.sweep.points);
    for c_r in config.sweep.c_r_values() {
        let params = config.mdp.with_c_r(c_r);
        let solution = Arc::new(
            mdp::solve(&params, &config.solver)
                .map_err(|source| SweepError::Solve { c_r, source })?,
        );
        let world = SimulatedWorld::new(params, config.sweep.seed)?;
        let stop_u = config.strategies.stop_progress * params.u_max;
        let mut results = Vec::with_capacity(config.strategies.list.len());
        for &kind in &config.strategies.list {
            let strategy = Strategy::new(kind, stop_u, Some(solution.clone()))?;
            let mut tally = Tally::new(kind);
            for i in 0..config.sweep.n_questions {
                let q = world.run_question(&strategy, config.episode.step_cap, i)?;
                tally.add(
                    &q.episode,
                    q.correct,
                    Some(ModelScore {
                        expected_accuracy: q.expected_accuracy,
                        discounted_objective: q.discounted_objective,
                    }),
                );
            }
            // n_questions >= 1 was checked, so the tally is not empty.
            if let Some(summary) = tally.finish() {
                results.push(summary);
            }
        }
        points.push(SweepPoint {
            world: SIMULATION.into(),
            c_r,
            c_r_over_c_p: (params.c_p > 0.0).then(|| c_r / params.c_p),
            policy: solution.summary(),
            results,
        });
    }
    Ok(SweepResult {
        world: SIMULATION.into(),
        points,
    })
}

/// The summary file's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepSummary {
    /// Always [`SIMULATION`].
    pub world: String,
    /// `cost_sweep`.
    pub experiment: String,
    /// The run seed.
    pub seed: u64,
    /// The commit measured ([`crate::summary::commit_id`]).
    pub commit: String,
    /// The full configuration.
    pub config: ExperimentConfig,
    /// Seconds since the Unix epoch when the file was written.
    pub created_unix_s: u64,
    /// Wall time of the sweep, seconds.
    pub elapsed_s: f64,
    /// What the numbers are and are not.
    pub notes: Vec<String>,
    /// The points.
    pub points: Vec<SweepPoint>,
}

impl SweepSummary {
    /// Wraps a result with its configuration and provenance.
    pub fn new(
        result: &SweepResult,
        config: &ExperimentConfig,
        commit: String,
        elapsed_s: f64,
    ) -> Self {
        let mut notes = vec![
            "simulation: the MDP's own model of the world (retrieval progress is a coin with \
             probability p_s; an answer is right with probability sigma(U/U_max)); these \
             numbers show what the MDP predicts, not what a model does on real questions"
                .to_string(),
            "cost = c_r * retrievals + c_p * reasons per question, as the original reported \
             it; weighted_cost = mu * cost is what the MDP's objective charges"
                .to_string(),
        ];
        for p in &result.points {
            if let Some(v) = &p.policy.violation {
                notes.push(format!(
                    "c_r = {:.4}: the optimal policy is not two-threshold: {v}",
                    p.c_r
                ));
            }
        }
        SweepSummary {
            world: SIMULATION.into(),
            experiment: "cost_sweep".into(),
            seed: config.sweep.seed,
            commit,
            config: config.clone(),
            created_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            elapsed_s,
            notes,
            points: result.points.clone(),
        }
    }
}

/// One JSONL line: a (c_r, strategy) pair.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PointRecord {
    /// Always [`SIMULATION`].
    pub world: String,
    /// The retrieval cost.
    pub c_r: f64,
    /// theta* at this cost.
    pub theta_star: f64,
    /// theta_cont at this cost.
    pub theta_cont: f64,
    /// Whether the optimal policy is two-threshold at this cost.
    pub two_threshold: bool,
    /// The strategy's results.
    #[serde(flatten)]
    pub summary: StrategySummary,
}

/// The per-(c_r, strategy) records, in sweep order.
pub fn point_records(result: &SweepResult) -> Vec<PointRecord> {
    result
        .points
        .iter()
        .flat_map(|p| {
            p.results.iter().map(move |s| PointRecord {
                world: SIMULATION.into(),
                c_r: p.c_r,
                theta_star: p.policy.theta_star,
                theta_cont: p.policy.theta_cont,
                two_threshold: p.policy.two_threshold,
                summary: s.clone(),
            })
        })
        .collect()
}

/// The comparison table: one line per (c_r, strategy), a header line per c_r with the
/// thresholds. Labelled as simulation.
pub fn render_table(result: &SweepResult) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "[{SIMULATION}] ARGO cost sweep. acc: accuracy with Wilson 95% CI; E[acc]: mean \
         sigma(U/U_max); cost: mean c_r*retrievals + c_p*reasons; net: E[acc] - mu*cost; \
         obj: mean discounted objective (what ARGO maximises; V(0) predicts ARGO's); retr, \
         reason, steps: means; forced: answers forced by the step cap\n"
    ));
    let label_width = result
        .points
        .iter()
        .flat_map(|p| p.results.iter().map(|s| s.label.len()))
        .max()
        .unwrap_or(8)
        .max(8);
    for p in &result.points {
        let ratio = p
            .c_r_over_c_p
            .map(|r| format!(" ({r:.1} c_p)"))
            .unwrap_or_default();
        let form = if p.policy.two_threshold {
            "two-threshold".to_string()
        } else {
            "NOT two-threshold".to_string()
        };
        out.push_str(&format!(
            "\n[{SIMULATION}] c_r = {:.4}{ratio}   theta_cont = {:.2}   theta* = {:.2}   V(0) = {:.3}   {form}: {}\n",
            p.c_r, p.policy.theta_cont, p.policy.theta_star, p.policy.value_at_zero, p.policy.policy
        ));
        out.push_str(&format!(
            "  {:<label_width$}  {:>6}  {:>15}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>6}  {:>5}  {:>6}\n",
            "strategy", "acc", "95% CI", "E[acc]", "cost", "net", "obj", "retr", "reason", "steps", "forced"
        ));
        for s in &p.results {
            let opt = |v: Option<f64>| v.map(|e| format!("{e:.3}")).unwrap_or_else(|| "-".into());
            out.push_str(&format!(
                "  {:<label_width$}  {:>6.3}  [{:.3}, {:.3}]  {:>6}  {:>7.4}  {:>6}  {:>6}  {:>6.2}  {:>6.2}  {:>5.2}  {:>6}\n",
                s.label,
                s.accuracy,
                s.accuracy_ci95[0],
                s.accuracy_ci95[1],
                opt(s.expected_accuracy),
                s.mean_cost,
                opt(s.mean_net),
                opt(s.mean_discounted_objective),
                s.mean_retrievals,
                s.mean_reasons,
                s.mean_steps,
                s.forced_terminations
            ));
        }
    }
    out
}

/// File names the sweep writes (each starts with `simulation_`).
pub mod files {
    /// The summary JSON.
    pub const SUMMARY: &str = "simulation_summary.json";
    /// One JSONL line per (c_r, strategy).
    pub const POINTS: &str = "simulation_points.jsonl";
    /// The printed table.
    pub const TABLE: &str = "simulation_table.txt";
}

/// Writes the summary, the JSONL records, the table and the plots (PNG and SVG) into
/// `out_dir`; returns the paths written.
pub fn write_outputs(
    out_dir: &Path,
    result: &SweepResult,
    summary: &SweepSummary,
) -> Result<Vec<PathBuf>, OutputError> {
    std::fs::create_dir_all(out_dir).map_err(|e| OutputError::io(out_dir, e))?;
    let mut written = Vec::new();
    let summary_path = out_dir.join(files::SUMMARY);
    write_json_atomic(&summary_path, summary)?;
    written.push(summary_path);
    let points_path = out_dir.join(files::POINTS);
    write_jsonl_atomic(&points_path, &point_records(result))?;
    written.push(points_path);
    let table_path = out_dir.join(files::TABLE);
    write_atomic(&table_path, render_table(result).as_bytes())?;
    written.push(table_path);
    written.extend(crate::plot::plot_sweep(out_dir, result, &summary.config)?);
    Ok(written)
}
