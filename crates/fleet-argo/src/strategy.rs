//! Strategies and the episode they act in.
//!
//! An [`Episode`] is a poll-style state machine, so that a runner can advance many questions
//! in lock-step and batch their model calls:
//!
//! ```text
//! let mut episode = Episode::new(strategy, &params, step_cap, question_seed);
//! while let Some(action) = episode.next_action() {
//!     let outcome = /* do the action: retrieve, reason or answer */;
//!     episode.record(outcome)?;
//! }
//! let record = episode.finish()?;
//! ```
//!
//! The episode keeps the progress estimate `U` (+delta_r on a Retrieve that made progress,
//! +delta_p on a Reason, capped at U_max), the counts and the cost account. What "made
//! progress" means belongs to the caller: a seeded coin with probability p_s in the simulated
//! world ([`crate::simulate`]), new evidence in a real run.
//!
//! Cost accounting follows the original project: the cost of an episode is
//! `c_r * retrievals + c_p * reasons` (`Exp_real_cost_impact*.py`: `C += c_r` per Retrieve,
//! `C += c_p` per Reason; `ARGO_MDP/src/env_argo.py`: `accumulated_cost`), and the objective
//! charges `mu` times that (the solver's step rewards `-mu * c_r` and `-mu * c_p`). Records
//! carry both: `cost` and `weighted_cost = mu * cost`.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

pub use crate::mdp::Action;
use crate::mdp::Solution;
use crate::params::{MdpParams, ParamError};

/// Which strategy, as configured: `argo`, `always-retrieve`, `always-reason`, `random:P`,
/// `fixed-k:K`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum StrategyKind {
    /// The MDP's optimal action at the current `U`.
    Argo,
    /// Retrieve until `U` reaches the stop level, then answer.
    AlwaysRetrieve,
    /// Reason until `U` reaches the stop level, then answer.
    AlwaysReason,
    /// Retrieve with probability `p_retrieve`, else Reason, until `U` reaches the stop level.
    Random {
        /// Probability of Retrieve at each step. In `[0, 1]`.
        p_retrieve: f64,
    },
    /// Retrieve `k` times, then answer (fixed-k RAG).
    FixedK {
        /// Number of retrievals.
        k: u32,
    },
}

impl StrategyKind {
    /// The five strategies of the cost sweep: ARGO, Always-Retrieve, Always-Reason,
    /// Random(0.5), Fixed-K(3).
    pub fn default_set() -> Vec<StrategyKind> {
        vec![
            StrategyKind::Argo,
            StrategyKind::AlwaysRetrieve,
            StrategyKind::AlwaysReason,
            StrategyKind::Random { p_retrieve: 0.5 },
            StrategyKind::FixedK { k: 3 },
        ]
    }

    /// The name used in tables and plots: `ARGO`, `Always-Retrieve`, `Random(p=0.5)`,
    /// `Fixed-K(k=3)`.
    pub fn label(&self) -> String {
        match self {
            StrategyKind::Argo => "ARGO".into(),
            StrategyKind::AlwaysRetrieve => "Always-Retrieve".into(),
            StrategyKind::AlwaysReason => "Always-Reason".into(),
            StrategyKind::Random { p_retrieve } => format!("Random(p={p_retrieve})"),
            StrategyKind::FixedK { k } => format!("Fixed-K(k={k})"),
        }
    }

    /// Checks the strategy's parameter.
    pub fn validate(&self) -> Result<(), ParamError> {
        match *self {
            StrategyKind::Random { p_retrieve } => {
                crate::params::check_closed("strategies.list random:P", p_retrieve, 0.0, 1.0)
            }
            StrategyKind::FixedK { k } if k > MAX_STEP_CAP => Err(ParamError::out_of_range(
                "strategies.list fixed-k:K",
                k,
                format!("[0, {MAX_STEP_CAP}]"),
            )),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StrategyKind::Argo => f.write_str("argo"),
            StrategyKind::AlwaysRetrieve => f.write_str("always-retrieve"),
            StrategyKind::AlwaysReason => f.write_str("always-reason"),
            StrategyKind::Random { p_retrieve } => write!(f, "random:{p_retrieve}"),
            StrategyKind::FixedK { k } => write!(f, "fixed-k:{k}"),
        }
    }
}

/// A strategy name that does not parse.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StrategyParseError {
    /// Not one of the known names.
    #[error(
        "unknown strategy `{0}`: expected argo, always-retrieve, always-reason, random:P \
         (P in [0, 1]) or fixed-k:K"
    )]
    Unknown(String),
    /// A known name with a bad parameter.
    #[error("strategy `{given}`: {source}")]
    Param {
        /// The text given.
        given: String,
        /// What is wrong with the parameter.
        source: ParamError,
    },
}

impl FromStr for StrategyKind {
    type Err = StrategyParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let given = s.trim();
        let lower = given.to_ascii_lowercase().replace('_', "-");
        let (name, arg) = match lower.split_once(':') {
            Some((n, a)) => (n.trim().to_string(), Some(a.trim().to_string())),
            None => (lower.clone(), None),
        };
        let bad_param = |field: &str, allowed: &str| StrategyParseError::Param {
            given: given.to_string(),
            source: ParamError::out_of_range(
                field,
                arg.clone().unwrap_or_default(),
                allowed.to_string(),
            ),
        };
        let kind = match (name.as_str(), &arg) {
            ("argo", None) => StrategyKind::Argo,
            ("always-retrieve", None) => StrategyKind::AlwaysRetrieve,
            ("always-reason", None) => StrategyKind::AlwaysReason,
            ("random", None) => StrategyKind::Random { p_retrieve: 0.5 },
            ("random", Some(a)) => StrategyKind::Random {
                p_retrieve: a
                    .parse()
                    .map_err(|_| bad_param("random:P", "a number in [0, 1]"))?,
            },
            ("fixed-k", Some(a)) => StrategyKind::FixedK {
                k: a.parse()
                    .map_err(|_| bad_param("fixed-k:K", "a whole number >= 0"))?,
            },
            _ => return Err(StrategyParseError::Unknown(given.to_string())),
        };
        kind.validate()
            .map_err(|source| StrategyParseError::Param {
                given: given.to_string(),
                source,
            })?;
        Ok(kind)
    }
}

impl TryFrom<String> for StrategyKind {
    type Error = StrategyParseError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<StrategyKind> for String {
    fn from(k: StrategyKind) -> String {
        k.to_string()
    }
}

/// The largest step cap accepted.
pub const MAX_STEP_CAP: u32 = 10_000;

/// Checks a step cap: at least one step, at most [`MAX_STEP_CAP`].
pub fn validate_step_cap(step_cap: u32) -> Result<(), ParamError> {
    if (1..=MAX_STEP_CAP).contains(&step_cap) {
        Ok(())
    } else {
        Err(ParamError::out_of_range(
            "episode.step_cap",
            step_cap,
            format!("[1, {MAX_STEP_CAP}]"),
        ))
    }
}

/// Errors building a strategy.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StrategyError {
    /// ARGO needs the solved MDP.
    #[error("strategy argo needs a solved MDP (mdp::solve) and none was given")]
    MissingSolution,
    /// A parameter is out of range.
    #[error(transparent)]
    Param(#[from] ParamError),
}

/// A strategy ready to act: its kind, the level of `U` at which the baselines that do not
/// choose when to stop answer, and for ARGO the solved MDP. Cheap to clone (the solution is
/// shared).
#[derive(Debug, Clone)]
pub struct Strategy {
    kind: StrategyKind,
    stop_u: f64,
    solution: Option<Arc<Solution>>,
}

impl Strategy {
    /// Builds `kind`. `stop_u` is the progress at which Always-Retrieve, Always-Reason and
    /// Random answer (an absolute `U`, e.g. `0.9 * u_max`); `solution` is needed for ARGO and
    /// ignored by the others.
    pub fn new(
        kind: StrategyKind,
        stop_u: f64,
        solution: Option<Arc<Solution>>,
    ) -> Result<Self, StrategyError> {
        kind.validate()?;
        crate::params::check_non_negative("strategies.stop_progress", stop_u)?;
        if kind == StrategyKind::Argo && solution.is_none() {
            return Err(StrategyError::MissingSolution);
        }
        Ok(Strategy {
            kind,
            stop_u,
            solution: if kind == StrategyKind::Argo {
                solution
            } else {
                None
            },
        })
    }

    /// ARGO with `solution`'s optimal policy.
    pub fn argo(solution: Arc<Solution>) -> Self {
        Strategy {
            kind: StrategyKind::Argo,
            stop_u: solution.params.u_max,
            solution: Some(solution),
        }
    }

    /// The kind.
    pub fn kind(&self) -> StrategyKind {
        self.kind
    }

    /// The name used in tables and plots.
    pub fn label(&self) -> String {
        self.kind.label()
    }

    /// The solved MDP ARGO follows (None for the others).
    pub fn solution(&self) -> Option<&Arc<Solution>> {
        self.solution.as_ref()
    }

    /// The next action, from the episode's state only. `rng` is the episode's own stream
    /// (only Random draws from it).
    pub fn decide(&self, state: &EpisodeState, rng: &mut impl Rng) -> Action {
        match self.kind {
            StrategyKind::Argo => match &self.solution {
                Some(s) => s.action_at(state.u),
                // `new` refuses ARGO without a solution; answering is the safe fallback.
                None => Action::Terminate,
            },
            StrategyKind::AlwaysRetrieve => self.until_stop(state, Action::Retrieve),
            StrategyKind::AlwaysReason => self.until_stop(state, Action::Reason),
            StrategyKind::Random { p_retrieve } => {
                if self.reached_stop(state) {
                    Action::Terminate
                } else if rng.random::<f64>() < p_retrieve {
                    Action::Retrieve
                } else {
                    Action::Reason
                }
            }
            StrategyKind::FixedK { k } => {
                if state.retrievals < k {
                    Action::Retrieve
                } else {
                    Action::Terminate
                }
            }
        }
    }

    fn reached_stop(&self, state: &EpisodeState) -> bool {
        state.u >= self.stop_u - 1e-9
    }

    fn until_stop(&self, state: &EpisodeState, action: Action) -> Action {
        if self.reached_stop(state) {
            Action::Terminate
        } else {
            action
        }
    }
}

/// What happened when the pending action was carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// A Retrieve was done; `progress` says whether it brought new evidence (simulation: a
    /// coin with probability p_s).
    Retrieved {
        /// Whether `U` moves by delta_r.
        progress: bool,
    },
    /// A Reason step was done.
    Reasoned,
    /// The answer was given.
    Terminated,
}

impl Outcome {
    /// The action this outcome belongs to.
    pub fn action(&self) -> Action {
        match self {
            Outcome::Retrieved { .. } => Action::Retrieve,
            Outcome::Reasoned => Action::Reason,
            Outcome::Terminated => Action::Terminate,
        }
    }
}

/// Misuse of an [`Episode`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EpisodeError {
    /// `record` was called without a pending action (call `next_action` first).
    #[error("no pending action to record: call next_action first")]
    NoPendingAction,
    /// The outcome is for another action than the pending one.
    #[error("outcome for {got} recorded while {expected} is pending")]
    OutcomeMismatch {
        /// The pending action.
        expected: Action,
        /// The action of the outcome given.
        got: Action,
    },
    /// The episode has already ended.
    #[error("the episode has already terminated")]
    AlreadyTerminated,
    /// `finish` was called before the episode terminated.
    #[error("the episode has not terminated yet ({steps} steps taken)")]
    NotTerminated {
        /// Steps taken so far.
        steps: u32,
    },
}

/// What a strategy may look at.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct EpisodeState {
    /// Progress estimate `U`.
    pub u: f64,
    /// Retrieve and Reason steps taken (Terminate is not counted).
    pub steps: u32,
    /// Retrieve steps taken.
    pub retrievals: u32,
    /// Retrieve steps that made progress.
    pub successful_retrievals: u32,
    /// Reason steps taken.
    pub reasons: u32,
}

/// Costs run up so far, unweighted (multiply by mu for the objective's charge).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct CostAccount {
    /// `c_r` times the retrievals.
    pub retrieval: f64,
    /// `c_p` times the reasons.
    pub reasoning: f64,
}

impl CostAccount {
    /// Retrieval plus reasoning cost.
    pub fn total(&self) -> f64 {
        self.retrieval + self.reasoning
    }

    /// `mu` times the total: what the objective charges.
    pub fn weighted(&self, mu: f64) -> f64 {
        mu * self.total()
    }
}

/// One step of an episode.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// The action taken.
    pub action: Action,
    /// `U` before it.
    pub u_before: f64,
    /// `U` after it.
    pub u_after: f64,
    /// For Retrieve, whether it made progress.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub progress: Option<bool>,
    /// For Terminate, whether the step cap forced it.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub forced: bool,
}

/// A finished episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeRecord {
    /// The strategy's kind (`argo`, `fixed-k:3`, ...).
    pub strategy: StrategyKind,
    /// `U` when the answer was given.
    pub final_u: f64,
    /// Retrieve and Reason steps.
    pub steps: u32,
    /// Retrieve steps.
    pub retrievals: u32,
    /// Retrieve steps that made progress.
    pub successful_retrievals: u32,
    /// Reason steps.
    pub reasons: u32,
    /// `c_r * retrievals + c_p * reasons`.
    pub cost: f64,
    /// `mu * cost`.
    pub weighted_cost: f64,
    /// True when the step cap forced the answer.
    pub forced_termination: bool,
    /// Every step, Terminate included.
    pub trace: Vec<StepRecord>,
}

/// One question's control loop: progress, counts, cost, step cap. See the module docs.
#[derive(Debug, Clone)]
pub struct Episode {
    strategy: Strategy,
    params: MdpParams,
    step_cap: u32,
    state: EpisodeState,
    cost: CostAccount,
    pending: Option<(Action, bool)>,
    terminated: bool,
    forced: bool,
    rng: ChaCha8Rng,
    trace: Vec<StepRecord>,
}

impl Episode {
    /// A new episode at `U = 0`. `params` gives the progress steps, `u_max` and the costs;
    /// `step_cap` is the most Retrieve/Reason steps before the answer is forced (the caller
    /// checks it with [`validate_step_cap`]; 0 forces an answer at once); `seed` seeds the
    /// strategy's own random stream (derive it from the run seed and the question, not from
    /// the batch, so results do not depend on batch order: [`crate::simulate::derive_seed`]).
    pub fn new(strategy: Strategy, params: &MdpParams, step_cap: u32, seed: u64) -> Self {
        Episode {
            strategy,
            params: *params,
            step_cap,
            state: EpisodeState::default(),
            cost: CostAccount::default(),
            pending: None,
            terminated: false,
            forced: false,
            rng: ChaCha8Rng::seed_from_u64(seed),
            trace: Vec::new(),
        }
    }

    /// The action to carry out next, or None once the episode has terminated. Asking again
    /// before [`Episode::record`] returns the same action (the strategy decides once per step).
    /// At the step cap the answer is forced: Terminate is returned and recorded as forced.
    pub fn next_action(&mut self) -> Option<Action> {
        if self.terminated {
            return None;
        }
        if let Some((action, _)) = self.pending {
            return Some(action);
        }
        let wanted = self.strategy.decide(&self.state, &mut self.rng);
        let pending = if wanted != Action::Terminate && self.state.steps >= self.step_cap {
            (Action::Terminate, true)
        } else {
            (wanted, false)
        };
        self.pending = Some(pending);
        Some(pending.0)
    }

    /// Applies the outcome of the pending action.
    pub fn record(&mut self, outcome: Outcome) -> Result<(), EpisodeError> {
        if self.terminated {
            return Err(EpisodeError::AlreadyTerminated);
        }
        let (expected, forced) = self.pending.ok_or(EpisodeError::NoPendingAction)?;
        if outcome.action() != expected {
            return Err(EpisodeError::OutcomeMismatch {
                expected,
                got: outcome.action(),
            });
        }
        self.pending = None;
        let u_before = self.state.u;
        let mut progress = None;
        match outcome {
            Outcome::Retrieved { progress: p } => {
                self.state.steps += 1;
                self.state.retrievals += 1;
                self.cost.retrieval += self.params.c_r;
                if p {
                    self.state.successful_retrievals += 1;
                    self.state.u = (self.state.u + self.params.delta_r).min(self.params.u_max);
                }
                progress = Some(p);
            }
            Outcome::Reasoned => {
                self.state.steps += 1;
                self.state.reasons += 1;
                self.cost.reasoning += self.params.c_p;
                self.state.u = (self.state.u + self.params.delta_p).min(self.params.u_max);
            }
            Outcome::Terminated => {
                self.terminated = true;
                self.forced = forced;
            }
        }
        self.trace.push(StepRecord {
            action: expected,
            u_before,
            u_after: self.state.u,
            progress,
            forced,
        });
        Ok(())
    }

    /// The state strategies see.
    pub fn state(&self) -> &EpisodeState {
        &self.state
    }

    /// The cost account so far.
    pub fn cost(&self) -> &CostAccount {
        &self.cost
    }

    /// The strategy acting.
    pub fn strategy(&self) -> &Strategy {
        &self.strategy
    }

    /// Whether the answer has been recorded.
    pub fn is_terminated(&self) -> bool {
        self.terminated
    }

    /// The steps so far.
    pub fn trace(&self) -> &[StepRecord] {
        &self.trace
    }

    /// The record of a terminated episode.
    pub fn finish(self) -> Result<EpisodeRecord, EpisodeError> {
        if !self.terminated {
            return Err(EpisodeError::NotTerminated {
                steps: self.state.steps,
            });
        }
        Ok(EpisodeRecord {
            strategy: self.strategy.kind,
            final_u: self.state.u,
            steps: self.state.steps,
            retrievals: self.state.retrievals,
            successful_retrievals: self.state.successful_retrievals,
            reasons: self.state.reasons,
            cost: self.cost.total(),
            weighted_cost: self.cost.weighted(self.params.mu),
            forced_termination: self.forced,
            trace: self.trace,
        })
    }
}
