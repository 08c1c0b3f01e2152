//! The ARGO MDP and its solver: value iteration on a uniform grid over `U`, the Q-table, the
//! optimal action per grid point, the thresholds theta* and theta_cont, and a check whether
//! the optimal policy really has the two-threshold form the paper assumes.
//!
//! Bellman equation (reward convention of the original solver, `ARGO_MDP/src/mdp_solver.py`:
//! a step's cost is `mu * c` of reward, Terminate pays `sigma(U / U_max)`):
//!
//! ```text
//! Q(U, Retrieve)  = -mu c_r + gamma [ p_s V(min(U + delta_r, U_max)) + (1 - p_s) V(U) ]
//! Q(U, Reason)    = -mu c_p + gamma V(min(U + delta_p, U_max))
//! Q(U, Terminate) = sigma(U / U_max)
//! V(U)            = max_a Q(U, a)
//! ```
//!
//! Next states off the grid take V by linear interpolation between the two grid points around
//! them (the original snapped to the nearest point, which turns a move shorter than half a
//! grid step into no move at all). With the default grid (step 0.01) and deltas (0.25, 0.08)
//! every reachable state is a grid point and the interpolation is exact.

use serde::{Deserialize, Serialize};

use crate::params::{MdpParams, ParamError, SolverConfig};

/// What the agent does at a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Fetch evidence: progress `delta_r` with probability `p_s`.
    Retrieve,
    /// Think without new evidence: progress `delta_p`.
    Reason,
    /// Answer now.
    Terminate,
}

impl Action {
    /// All actions, in Q-table order.
    pub const ALL: [Action; 3] = [Action::Retrieve, Action::Reason, Action::Terminate];

    /// One letter, for compact policy strings: `R`, `P` (reason) and `T`.
    pub fn letter(self) -> char {
        match self {
            Action::Retrieve => 'R',
            Action::Reason => 'P',
            Action::Terminate => 'T',
        }
    }

    /// The name as printed.
    pub fn name(self) -> &'static str {
        match self {
            Action::Retrieve => "Retrieve",
            Action::Reason => "Reason",
            Action::Terminate => "Terminate",
        }
    }
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Errors of the solver.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MdpError {
    /// A parameter is out of range.
    #[error(transparent)]
    Param(#[from] ParamError),
    /// Value iteration did not reach the tolerance within the iteration cap.
    #[error(
        "value iteration did not converge: largest change {residual:e} after {iterations} \
         iterations is above solver.tolerance = {tolerance:e}; raise solver.max_iterations or \
         the tolerance"
    )]
    NotConverged {
        /// Sweeps done.
        iterations: usize,
        /// Largest change of V in the last sweep.
        residual: f64,
        /// The tolerance asked for.
        tolerance: f64,
    },
}

/// Q-values of the three actions at one state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct QValues {
    /// Q(U, Retrieve).
    pub retrieve: f64,
    /// Q(U, Reason).
    pub reason: f64,
    /// Q(U, Terminate) = sigma(U / U_max).
    pub terminate: f64,
}

/// Q-values closer than this count as equal, so that rounding cannot flip a tie.
pub const TIE_EPSILON: f64 = 1e-12;

impl QValues {
    /// The optimal action. Ties go to Terminate (as in the original: Terminate is optimal when
    /// its Q is at least the others'), and between Retrieve and Reason to Retrieve unless
    /// Reason is strictly better.
    pub fn best(&self) -> Action {
        if self.terminate >= self.retrieve.max(self.reason) - TIE_EPSILON {
            Action::Terminate
        } else if self.reason > self.retrieve + TIE_EPSILON {
            Action::Reason
        } else {
            Action::Retrieve
        }
    }

    /// The largest Q-value, V.
    pub fn max(&self) -> f64 {
        self.retrieve.max(self.reason).max(self.terminate)
    }

    /// Q of one action.
    pub fn get(&self, action: Action) -> f64 {
        match action {
            Action::Retrieve => self.retrieve,
            Action::Reason => self.reason,
            Action::Terminate => self.terminate,
        }
    }
}

/// A uniform grid over `[0, u_max]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grid {
    /// Number of points, both ends included.
    pub points: usize,
    /// Upper end.
    pub u_max: f64,
}

impl Grid {
    /// Distance between neighbouring points.
    pub fn step(&self) -> f64 {
        self.u_max / (self.points - 1) as f64
    }

    /// The `i`-th point.
    pub fn u(&self, i: usize) -> f64 {
        if i + 1 == self.points {
            self.u_max
        } else {
            i as f64 * self.step()
        }
    }

    /// The grid interval holding `u` (clamped to the grid) and the weight of its upper end.
    fn locate(&self, u: f64) -> (usize, f64) {
        let pos = (u / self.step()).clamp(0.0, (self.points - 1) as f64);
        let lower = (pos.floor() as usize).min(self.points - 2);
        let frac = pos - lower as f64;
        // Snap rounding noise (0.41 / 0.01 = 41.000000000000007) onto the point.
        if frac < 1e-9 {
            (lower, 0.0)
        } else if frac > 1.0 - 1e-9 {
            (lower + 1, 0.0)
        } else {
            (lower, frac)
        }
    }

    /// Linear interpolation of grid values `v` at `u`.
    pub fn interpolate(&self, v: &[f64], u: f64) -> f64 {
        let (i, w) = self.locate(u);
        if w == 0.0 {
            v[i]
        } else {
            v[i] * (1.0 - w) + v[i + 1] * w
        }
    }
}

/// One run of equal optimal actions over consecutive grid points.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    /// The optimal action on the run.
    pub action: Action,
    /// First grid point of the run.
    pub from: f64,
    /// Last grid point of the run.
    pub to: f64,
}

/// Whether the optimal policy has the two-threshold form
/// `Retrieve on [0, theta_cont), Reason on [theta_cont, theta*), Terminate on [theta*, U_max]`
/// (either of the first two runs may be empty).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyStructure {
    /// True when the runs of optimal actions are, in order, at most one Retrieve run, at most
    /// one Reason run and one Terminate run reaching `U_max`.
    pub two_threshold: bool,
    /// The runs of optimal actions from `U = 0` up.
    pub segments: Vec<Segment>,
    /// Why the form fails, when it does.
    pub violation: Option<String>,
}

impl PolicyStructure {
    fn from_actions(grid: &Grid, actions: &[Action]) -> Self {
        let mut segments: Vec<Segment> = Vec::new();
        for (i, &a) in actions.iter().enumerate() {
            let u = grid.u(i);
            match segments.last_mut() {
                Some(s) if s.action == a => s.to = u,
                _ => segments.push(Segment {
                    action: a,
                    from: u,
                    to: u,
                }),
            }
        }
        let rank = |a: Action| match a {
            Action::Retrieve => 0,
            Action::Reason => 1,
            Action::Terminate => 2,
        };
        let mut violation = None;
        for pair in segments.windows(2) {
            if rank(pair[1].action) <= rank(pair[0].action) {
                violation = Some(format!(
                    "{} at U = {:.4} follows {} (on [{:.4}, {:.4}]): the optimal action \
                     alternates, so no pair of thresholds describes this policy",
                    pair[1].action, pair[1].from, pair[0].action, pair[0].from, pair[0].to
                ));
                break;
            }
        }
        if violation.is_none() && segments.last().map(|s| s.action) != Some(Action::Terminate) {
            violation = Some("Terminate is not optimal at U_max".into());
        }
        PolicyStructure {
            two_threshold: violation.is_none(),
            segments,
            violation,
        }
    }

    /// The runs as text: `Retrieve [0.00, 0.41] | Reason [0.42, 0.66] | Terminate [0.67, 1.00]`.
    pub fn describe(&self) -> String {
        self.segments
            .iter()
            .map(|s| format!("{} [{:.2}, {:.2}]", s.action, s.from, s.to))
            .collect::<Vec<_>>()
            .join(" | ")
    }
}

/// The solved MDP.
#[derive(Debug, Clone, PartialEq)]
pub struct Solution {
    /// The MDP that was solved.
    pub params: MdpParams,
    /// The solver settings used.
    pub solver: SolverConfig,
    /// The grid.
    pub grid: Grid,
    /// V at each grid point.
    pub values: Vec<f64>,
    /// Q at each grid point, computed from the converged V.
    pub q: Vec<QValues>,
    /// The optimal action at each grid point ([`QValues::best`]).
    pub actions: Vec<Action>,
    /// theta*: the first grid `U` where Terminate is optimal.
    pub theta_star: f64,
    /// theta_cont: the first grid `U` below theta* where Reason beats Retrieve; theta* when
    /// Retrieve is preferred all the way (the original's convention).
    pub theta_cont: f64,
    /// Whether the policy has the two-threshold form, and its runs of actions.
    pub structure: PolicyStructure,
    /// Value-iteration sweeps done.
    pub iterations: usize,
    /// Largest change of V in the last sweep.
    pub residual: f64,
}

/// Where a move from grid point lands: interpolation interval and weight.
#[derive(Clone, Copy)]
struct Landing {
    lower: usize,
    weight: f64,
}

impl Landing {
    fn new(grid: &Grid, u: f64) -> Self {
        let (lower, weight) = grid.locate(u);
        Landing { lower, weight }
    }

    fn value(&self, v: &[f64]) -> f64 {
        if self.weight == 0.0 {
            v[self.lower]
        } else {
            v[self.lower] * (1.0 - self.weight) + v[self.lower + 1] * self.weight
        }
    }
}

/// One Bellman backup at `u` given V on the grid.
fn backup(params: &MdpParams, grid: &Grid, v: &[f64], u: f64) -> QValues {
    let up_r = (u + params.delta_r).min(params.u_max);
    let up_p = (u + params.delta_p).min(params.u_max);
    let stay = grid.interpolate(v, u);
    QValues {
        retrieve: -params.mu * params.c_r
            + params.gamma * (params.p_s * grid.interpolate(v, up_r) + (1.0 - params.p_s) * stay),
        reason: -params.mu * params.c_p + params.gamma * grid.interpolate(v, up_p),
        terminate: params.sigma(u),
    }
}

/// Solves the MDP by value iteration.
///
/// V starts at sigma (the value of answering at once, a lower bound of V*), and each sweep
/// applies the Bellman operator to all grid points from the previous sweep's V (Jacobi
/// updates, as the original). Stops when the largest change falls below
/// `solver.tolerance`; returns [`MdpError::NotConverged`] if `solver.max_iterations` sweeps do
/// not get there.
pub fn solve(params: &MdpParams, solver: &SolverConfig) -> Result<Solution, MdpError> {
    params.validate()?;
    solver.validate(params)?;
    let grid = Grid {
        points: solver.grid_points,
        u_max: params.u_max,
    };
    let n = grid.points;
    let us: Vec<f64> = (0..n).map(|i| grid.u(i)).collect();
    // The landing points of each move never change: locate them once.
    let stay: Vec<Landing> = us.iter().map(|&u| Landing::new(&grid, u)).collect();
    let up_r: Vec<Landing> = us
        .iter()
        .map(|&u| Landing::new(&grid, (u + params.delta_r).min(params.u_max)))
        .collect();
    let up_p: Vec<Landing> = us
        .iter()
        .map(|&u| Landing::new(&grid, (u + params.delta_p).min(params.u_max)))
        .collect();
    let sigma: Vec<f64> = us.iter().map(|&u| params.sigma(u)).collect();
    let cost_r = params.mu * params.c_r;
    let cost_p = params.mu * params.c_p;

    let mut v = sigma.clone();
    let mut next = vec![0.0; n];
    let mut iterations = 0;
    let mut residual = f64::INFINITY;
    while iterations < solver.max_iterations {
        iterations += 1;
        residual = 0.0;
        for i in 0..n {
            let retrieve = -cost_r
                + params.gamma
                    * (params.p_s * up_r[i].value(&v) + (1.0 - params.p_s) * stay[i].value(&v));
            let reason = -cost_p + params.gamma * up_p[i].value(&v);
            let best = sigma[i].max(retrieve).max(reason);
            residual = f64::max(residual, (best - v[i]).abs());
            next[i] = best;
        }
        std::mem::swap(&mut v, &mut next);
        if residual < solver.tolerance {
            break;
        }
    }
    if residual >= solver.tolerance {
        return Err(MdpError::NotConverged {
            iterations,
            residual,
            tolerance: solver.tolerance,
        });
    }

    let q: Vec<QValues> = us.iter().map(|&u| backup(params, &grid, &v, u)).collect();
    let actions: Vec<Action> = q.iter().map(QValues::best).collect();
    let star_index = actions
        .iter()
        .position(|&a| a == Action::Terminate)
        .unwrap_or(n - 1);
    let theta_star = grid.u(star_index);
    let theta_cont = (0..star_index)
        .find(|&i| q[i].reason > q[i].retrieve + TIE_EPSILON)
        .map(|i| grid.u(i))
        .unwrap_or(theta_star);
    let structure = PolicyStructure::from_actions(&grid, &actions);
    Ok(Solution {
        params: *params,
        solver: *solver,
        grid,
        values: v,
        q,
        actions,
        theta_star,
        theta_cont,
        structure,
        iterations,
        residual,
    })
}

impl Solution {
    /// V at any `u` (linear interpolation between grid points).
    pub fn value_at(&self, u: f64) -> f64 {
        self.grid.interpolate(&self.values, u)
    }

    /// Q at any `u`: one Bellman backup from the converged V. At grid points this is the
    /// Q-table; between them it is the backup of the interpolated V, so a state reached by
    /// moves that do not land on the grid still gets its own decision.
    pub fn q_at(&self, u: f64) -> QValues {
        backup(
            &self.params,
            &self.grid,
            &self.values,
            u.clamp(0.0, self.params.u_max),
        )
    }

    /// The optimal action at any `u`.
    pub fn action_at(&self, u: f64) -> Action {
        self.q_at(u).best()
    }

    /// Whether the optimal policy has the two-threshold form.
    pub fn is_two_threshold(&self) -> bool {
        self.structure.two_threshold
    }

    /// The policy as one letter per grid point (`R` Retrieve, `P` Reason, `T` Terminate).
    pub fn policy_string(&self) -> String {
        self.actions.iter().map(|a| a.letter()).collect()
    }

    /// The figures a summary needs, without the tables.
    pub fn summary(&self) -> SolutionSummary {
        SolutionSummary {
            theta_star: self.theta_star,
            theta_cont: self.theta_cont,
            two_threshold: self.structure.two_threshold,
            policy: self.structure.describe(),
            violation: self.structure.violation.clone(),
            iterations: self.iterations,
            residual: self.residual,
            value_at_zero: self.values[0],
        }
    }
}

/// The thresholds and structure of a [`Solution`], for result files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SolutionSummary {
    /// theta*.
    pub theta_star: f64,
    /// theta_cont.
    pub theta_cont: f64,
    /// Whether the optimal policy has the two-threshold form.
    pub two_threshold: bool,
    /// The runs of optimal actions, as text.
    pub policy: String,
    /// Why it is not two-threshold, when it is not.
    pub violation: Option<String>,
    /// Value-iteration sweeps.
    pub iterations: usize,
    /// Largest change of V in the last sweep.
    pub residual: f64,
    /// V(0): the optimal expected objective from the start.
    pub value_at_zero: f64,
}

/// The one-step-lookahead stopping threshold: the first grid `U` where answering now is at
/// least as good as taking one more Retrieve or Reason and then answering,
///
/// ```text
/// sigma(U) >= max( -mu c_r + gamma [p_s sigma(U + delta_r) + (1 - p_s) sigma(U)],
///                  -mu c_p + gamma sigma(U + delta_p) )
/// ```
///
/// For concave sigma the gain of one more step falls as `U` grows, so the stopping set is
/// closed (once there, every reachable state is in it) and this rule is optimal: it then
/// matches value iteration's theta* to within one grid step.
pub fn one_step_lookahead_threshold(params: &MdpParams, grid_points: usize) -> f64 {
    let grid = Grid {
        points: grid_points.max(2),
        u_max: params.u_max,
    };
    for i in 0..grid.points {
        let u = grid.u(i);
        let now = params.sigma(u);
        let up_r = params.sigma((u + params.delta_r).min(params.u_max));
        let up_p = params.sigma((u + params.delta_p).min(params.u_max));
        let retrieve =
            -params.mu * params.c_r + params.gamma * (params.p_s * up_r + (1.0 - params.p_s) * now);
        let reason = -params.mu * params.c_p + params.gamma * up_p;
        if now >= retrieve.max(reason) - TIE_EPSILON {
            return u;
        }
    }
    params.u_max
}
