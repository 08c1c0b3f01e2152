//! The MDP's parameters (the world) and the solver's settings, with their allowed ranges.
//!
//! Field names are the ones `configs/argo.toml` uses; errors name the field as it is written
//! there (`mdp.p_s`, `solver.grid_points`, ...), the value and the allowed range.

use serde::{Deserialize, Serialize};

/// A parameter outside its allowed range, or a combination of parameters that cannot work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamError {
    /// One value outside its range.
    #[error("{field} = {value} is out of range: allowed {allowed}")]
    OutOfRange {
        /// The field as written in the TOML config (`mdp.p_s`).
        field: String,
        /// The value given.
        value: String,
        /// The allowed range, e.g. `[0, 1]`.
        allowed: String,
    },
    /// A value that is in range by itself but does not fit the others.
    #[error("{field} = {value}: {reason}")]
    Inconsistent {
        /// The field as written in the TOML config.
        field: String,
        /// The value given.
        value: String,
        /// What is wrong and what to do.
        reason: String,
    },
}

impl ParamError {
    /// An [`ParamError::OutOfRange`] for `field`.
    pub fn out_of_range(
        field: impl Into<String>,
        value: impl ToString,
        allowed: impl Into<String>,
    ) -> Self {
        ParamError::OutOfRange {
            field: field.into(),
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }

    /// The field at fault.
    pub fn field(&self) -> &str {
        match self {
            ParamError::OutOfRange { field, .. } | ParamError::Inconsistent { field, .. } => field,
        }
    }
}

/// Checks `lo <= value <= hi` (and that `value` is finite).
pub(crate) fn check_closed(field: &str, value: f64, lo: f64, hi: f64) -> Result<(), ParamError> {
    if value.is_finite() && value >= lo && value <= hi {
        Ok(())
    } else {
        Err(ParamError::out_of_range(
            field,
            value,
            format!("[{lo}, {hi}]"),
        ))
    }
}

/// Checks `value > 0` and finite.
pub(crate) fn check_positive(field: &str, value: f64) -> Result<(), ParamError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ParamError::out_of_range(field, value, "(0, inf)"))
    }
}

/// Checks `value >= 0` and finite.
pub(crate) fn check_non_negative(field: &str, value: f64) -> Result<(), ParamError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(ParamError::out_of_range(field, value, "[0, inf)"))
    }
}

/// The quality function sigma: how likely an answer given at progress `x = U / U_max` is right.
///
/// The four shapes are the ones the original project's solver offered
/// (`ARGO_MDP/src/mdp_solver.py`, `quality_function`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Quality {
    /// `sigma(x) = x`.
    Linear,
    /// `sigma(x) = sqrt(x)`.
    Sqrt,
    /// `sigma(x) = 1 - exp(-alpha x)`.
    Saturating {
        /// Rate; larger saturates sooner. Must be > 0.
        alpha: f64,
    },
    /// `sigma(x) = 1 / (1 + exp(-k (x - 0.5)))`.
    Sigmoid {
        /// Steepness. Must be > 0.
        k: f64,
    },
}

impl Quality {
    /// sigma at `x`, with `x` clamped to `[0, 1]`.
    pub fn eval(&self, x: f64) -> f64 {
        let x = x.clamp(0.0, 1.0);
        match *self {
            Quality::Linear => x,
            Quality::Sqrt => x.sqrt(),
            Quality::Saturating { alpha } => 1.0 - (-alpha * x).exp(),
            Quality::Sigmoid { k } => 1.0 / (1.0 + (-k * (x - 0.5)).exp()),
        }
    }

    /// Whether sigma is concave on `[0, 1]` (linear counts: it is weakly concave). Sigmoid is
    /// convex below 0.5, so it is not.
    pub fn is_concave(&self) -> bool {
        !matches!(self, Quality::Sigmoid { .. })
    }

    /// A short formula, for tables and plot titles.
    pub fn describe(&self) -> String {
        match *self {
            Quality::Linear => "linear sigma(x)=x".into(),
            Quality::Sqrt => "sqrt sigma(x)=sqrt(x)".into(),
            Quality::Saturating { alpha } => format!("saturating sigma(x)=1-exp(-{alpha}x)"),
            Quality::Sigmoid { k } => format!("sigmoid sigma(x)=1/(1+exp(-{k}(x-0.5)))"),
        }
    }

    /// Checks the shape parameter.
    pub fn validate(&self) -> Result<(), ParamError> {
        match *self {
            Quality::Linear | Quality::Sqrt => Ok(()),
            Quality::Saturating { alpha } => check_positive("mdp.quality.alpha", alpha),
            Quality::Sigmoid { k } => check_positive("mdp.quality.k", k),
        }
    }
}

/// The MDP: the world's dynamics, the step costs and the objective. Kept apart from the
/// strategies that act in it.
///
/// State `U` in `[0, u_max]`. Retrieve moves `U` by `delta_r` with probability `p_s` (else
/// leaves it), Reason moves it by `delta_p`, both capped at `u_max`; Terminate ends the episode
/// with reward `sigma(U / u_max)`. Each Retrieve costs `mu * c_r` of reward and each Reason
/// `mu * c_p`; future rewards are discounted by `gamma`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MdpParams {
    /// Largest progress. > 0.
    pub u_max: f64,
    /// Progress of a successful Retrieve. In `(0, u_max]`.
    pub delta_r: f64,
    /// Progress of a Reason. In `(0, u_max]`.
    pub delta_p: f64,
    /// Probability that a Retrieve makes progress. In `[0, 1]`.
    pub p_s: f64,
    /// Cost of one Retrieve. >= 0.
    pub c_r: f64,
    /// Cost of one Reason. >= 0.
    pub c_p: f64,
    /// Weight of cost against quality in the objective. >= 0.
    pub mu: f64,
    /// Discount. In `(0, 1]`.
    pub gamma: f64,
    /// The quality function sigma.
    pub quality: Quality,
}

impl Default for MdpParams {
    /// The defaults the issue fixes from the original's configs: delta_r 0.25 and delta_p 0.08
    /// (`ARGO/configs/theory_aligned_policy.yaml`, "paper default"), p_s 0.8, c_r 0.05,
    /// c_p 0.02 (`Exp0_threshold_structure_validation.py`, "Baseline"), mu 0.6, gamma 0.98
    /// (`ARGO/configs/multi_gpu*.yaml`), saturating sigma with alpha 3.
    fn default() -> Self {
        MdpParams {
            u_max: 1.0,
            delta_r: 0.25,
            delta_p: 0.08,
            p_s: 0.8,
            c_r: 0.05,
            c_p: 0.02,
            mu: 0.6,
            gamma: 0.98,
            quality: Quality::Saturating { alpha: 3.0 },
        }
    }
}

impl MdpParams {
    /// Checks every field against its range.
    pub fn validate(&self) -> Result<(), ParamError> {
        check_positive("mdp.u_max", self.u_max)?;
        let upto_umax = format!("(0, {}] (mdp.u_max)", self.u_max);
        for (field, value) in [("mdp.delta_r", self.delta_r), ("mdp.delta_p", self.delta_p)] {
            if !(value.is_finite() && value > 0.0 && value <= self.u_max) {
                return Err(ParamError::out_of_range(field, value, upto_umax.clone()));
            }
        }
        check_closed("mdp.p_s", self.p_s, 0.0, 1.0)?;
        check_non_negative("mdp.c_r", self.c_r)?;
        check_non_negative("mdp.c_p", self.c_p)?;
        check_non_negative("mdp.mu", self.mu)?;
        if !(self.gamma.is_finite() && self.gamma > 0.0 && self.gamma <= 1.0) {
            return Err(ParamError::out_of_range("mdp.gamma", self.gamma, "(0, 1]"));
        }
        self.quality.validate()
    }

    /// sigma(U / u_max): the terminal reward, and in the simulated world the probability that
    /// an answer given at progress `u` is right.
    pub fn sigma(&self, u: f64) -> f64 {
        self.quality.eval(u / self.u_max)
    }

    /// The same parameters with another retrieval cost.
    pub fn with_c_r(mut self, c_r: f64) -> Self {
        self.c_r = c_r;
        self
    }
}

/// How value iteration runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SolverConfig {
    /// Points of the uniform grid over `[0, u_max]`, both ends included. Its step must not be
    /// coarser than the smaller of delta_r and delta_p.
    pub grid_points: usize,
    /// Stop when the largest change of V in one sweep is below this.
    pub tolerance: f64,
    /// Give up (with an error) after this many sweeps.
    pub max_iterations: usize,
}

impl Default for SolverConfig {
    /// 101 points (the original's `grid_size`, step 0.01, so the default deltas land on grid
    /// points), tolerance 1e-9, at most 10,000 sweeps (the original's `max_iterations`).
    fn default() -> Self {
        SolverConfig {
            grid_points: 101,
            tolerance: 1e-9,
            max_iterations: 10_000,
        }
    }
}

/// The most grid points accepted: far more than any use needs, small enough to stay in memory.
pub const MAX_GRID_POINTS: usize = 1_000_001;

impl SolverConfig {
    /// Checks the settings, and that the grid resolves the smaller progress step of `mdp`.
    pub fn validate(&self, mdp: &MdpParams) -> Result<(), ParamError> {
        if self.grid_points < 2 || self.grid_points > MAX_GRID_POINTS {
            return Err(ParamError::out_of_range(
                "solver.grid_points",
                self.grid_points,
                format!("[2, {MAX_GRID_POINTS}]"),
            ));
        }
        check_positive("solver.tolerance", self.tolerance)?;
        if self.max_iterations == 0 {
            return Err(ParamError::out_of_range(
                "solver.max_iterations",
                0,
                "[1, inf)",
            ));
        }
        let step = mdp.u_max / (self.grid_points - 1) as f64;
        let smallest = mdp.delta_r.min(mdp.delta_p);
        // A grid coarser than a move would blur that move into its neighbours.
        if step > smallest * (1.0 + 1e-9) {
            let needed = (mdp.u_max / smallest).ceil() as usize + 1;
            return Err(ParamError::Inconsistent {
                field: "solver.grid_points".into(),
                value: self.grid_points.to_string(),
                reason: format!(
                    "grid too small: its step {step} is coarser than the smaller progress step \
                     {smallest} (min of mdp.delta_r, mdp.delta_p); use at least {needed} points"
                ),
            });
        }
        Ok(())
    }
}
