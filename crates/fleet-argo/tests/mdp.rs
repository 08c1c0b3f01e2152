//! The solver: small cases worked by hand, the one-step-lookahead check, monotonicity in c_r,
//! the two-threshold check, and parameter errors.

use fleet_argo::mdp::{one_step_lookahead_threshold, solve, Action, MdpError};
use fleet_argo::params::{MdpParams, ParamError, Quality, SolverConfig};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-7
}

/// Three grid points {0, 0.5, 1}, linear sigma, no discount, mu = 1, p_s = 0.5, delta_r = 1,
/// delta_p = 0.5, c_r = 0.04, c_p = 0.05. By hand:
/// - U = 1: Terminate, V = 1 (a step only costs).
/// - U = 0.5: Reason -0.05 + V(1) = 0.95; Retrieve solves V = -0.04 + 0.5 * 1 + 0.5 V, so
///   0.92; Terminate 0.5. Reason, V = 0.95, Q(Retrieve) = -0.04 + 0.5 + 0.5 * 0.95 = 0.935.
/// - U = 0: Retrieve solves V = -0.04 + 0.5 + 0.5 V, so 0.92; Reason -0.05 + 0.95 = 0.90;
///   Terminate 0. Retrieve, V = 0.92.
fn hand_case() -> (MdpParams, SolverConfig) {
    (
        MdpParams {
            u_max: 1.0,
            delta_r: 1.0,
            delta_p: 0.5,
            p_s: 0.5,
            c_r: 0.04,
            c_p: 0.05,
            mu: 1.0,
            gamma: 1.0,
            quality: Quality::Linear,
        },
        SolverConfig {
            grid_points: 3,
            tolerance: 1e-12,
            max_iterations: 1000,
        },
    )
}

#[test]
fn three_point_case_matches_hand_solution() {
    let (p, s) = hand_case();
    let sol = solve(&p, &s).unwrap();
    assert_eq!(
        sol.actions,
        vec![Action::Retrieve, Action::Reason, Action::Terminate]
    );
    assert!(close(sol.values[2], 1.0));
    assert!(close(sol.values[1], 0.95));
    assert!(close(sol.values[0], 0.92));
    assert!(close(sol.q[1].retrieve, 0.935));
    assert!(close(sol.q[1].reason, 0.95));
    assert!(close(sol.q[1].terminate, 0.5));
    assert!(close(sol.q[0].reason, 0.90));
    assert!(close(sol.q[0].terminate, 0.0));
    assert_eq!(sol.theta_cont, 0.5);
    assert_eq!(sol.theta_star, 1.0);
    assert!(sol.is_two_threshold());
    assert_eq!(sol.policy_string(), "RPT");
}

/// Same case with a discount of 0.5 and mu = 0.2: continuing is rarely worth it.
/// - U = 1: Terminate, V = 1.
/// - U = 0.5: Reason -0.01 + 0.5 = 0.49; Retrieve solves V = -0.008 + 0.5 (0.5 + 0.5 V), so
///   V = 0.242 / 0.75 = 0.32267; Terminate 0.5. Terminate.
/// - U = 0: Retrieve solves V = -0.008 + 0.25 + 0.25 V: 0.32267; Reason -0.01 + 0.5 * 0.5 =
///   0.24; Terminate 0. Retrieve.
#[test]
fn discounted_three_point_case_matches_hand_solution() {
    let (mut p, s) = hand_case();
    p.gamma = 0.5;
    p.mu = 0.2;
    let sol = solve(&p, &s).unwrap();
    assert_eq!(sol.policy_string(), "RTT");
    assert!(close(sol.values[0], 0.242 / 0.75));
    assert!(close(sol.q[0].reason, 0.24));
    assert!(close(sol.q[1].reason, 0.49));
    assert_eq!(sol.theta_star, 0.5);
    // Reason never beats Retrieve below theta*: theta_cont falls back to theta*.
    assert_eq!(sol.theta_cont, 0.5);
    assert!(sol.is_two_threshold());
}

#[test]
fn retrieval_that_never_succeeds_is_never_chosen() {
    let p = MdpParams {
        p_s: 0.0,
        ..MdpParams::default()
    };
    let sol = solve(&p, &SolverConfig::default()).unwrap();
    assert!(sol.actions.iter().all(|&a| a != Action::Retrieve));
}

#[test]
fn terminate_is_optimal_at_u_max() {
    for q in [
        Quality::Linear,
        Quality::Sqrt,
        Quality::Saturating { alpha: 3.0 },
        Quality::Sigmoid { k: 10.0 },
    ] {
        for gamma in [0.9, 1.0] {
            let p = MdpParams {
                quality: q,
                gamma,
                ..MdpParams::default()
            };
            let sol = solve(&p, &SolverConfig::default()).unwrap();
            assert_eq!(*sol.actions.last().unwrap(), Action::Terminate, "{q:?}");
        }
    }
}

#[test]
fn q_table_is_consistent_with_values() {
    let sol = solve(&MdpParams::default(), &SolverConfig::default()).unwrap();
    for (i, q) in sol.q.iter().enumerate() {
        assert!((q.max() - sol.values[i]).abs() < 1e-8, "point {i}");
        assert_eq!(q.best(), sol.actions[i]);
        assert_eq!(sol.action_at(sol.grid.u(i)), sol.actions[i]);
    }
    assert!(sol.residual < SolverConfig::default().tolerance);
}

/// For concave sigma the one-step-lookahead stopping rule is optimal, so its threshold equals
/// value iteration's theta* within one grid step, across sigma shapes, discounts, cost weights
/// and retrieval costs.
#[test]
fn one_step_lookahead_matches_theta_star_for_concave_sigma() {
    let solver = SolverConfig::default();
    let step = 1.0 / (solver.grid_points - 1) as f64;
    let mut checked = 0;
    for quality in [
        Quality::Linear,
        Quality::Sqrt,
        Quality::Saturating { alpha: 1.0 },
        Quality::Saturating { alpha: 3.0 },
        Quality::Saturating { alpha: 5.0 },
    ] {
        for gamma in [0.9, 0.98, 1.0] {
            for mu in [0.3, 1.0] {
                for c_r in [0.0, 0.02, 0.05, 0.08, 0.12, 0.2, 0.4] {
                    let p = MdpParams {
                        quality,
                        gamma,
                        mu,
                        c_r,
                        ..MdpParams::default()
                    };
                    let sol = solve(&p, &solver).unwrap();
                    let osla = one_step_lookahead_threshold(&p, solver.grid_points);
                    assert!(
                        (osla - sol.theta_star).abs() <= step + 1e-9,
                        "{quality:?} gamma {gamma} mu {mu} c_r {c_r}: OSLA {osla} vs theta* {}",
                        sol.theta_star
                    );
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 210);
}

/// With sigmoid sigma (convex below 0.5) the one-step rule can stop where continuing pays:
/// a case where it says "answer at U = 0" while the optimal policy goes on.
#[test]
fn one_step_lookahead_can_fail_for_sigmoid() {
    let p = MdpParams {
        delta_r: 0.15,
        delta_p: 0.03,
        c_r: 0.1,
        mu: 0.3,
        gamma: 0.9,
        quality: Quality::Sigmoid { k: 10.0 },
        ..MdpParams::default()
    };
    assert!(!p.quality.is_concave());
    let sol = solve(&p, &SolverConfig::default()).unwrap();
    let osla = one_step_lookahead_threshold(&p, 101);
    assert_eq!(osla, 0.0);
    assert!(sol.theta_star > 0.5, "theta* {}", sol.theta_star);
}

/// Raising c_r never raises V(0), never raises theta*, and never adds a grid point where
/// Retrieve is optimal.
#[test]
fn solution_is_monotone_in_retrieval_cost() {
    for quality in [
        Quality::Linear,
        Quality::Saturating { alpha: 3.0 },
        Quality::Sigmoid { k: 10.0 },
    ] {
        for (delta_r, delta_p, p_s) in [(0.25, 0.08, 0.8), (0.15, 0.03, 0.8), (0.2, 0.13, 0.85)] {
            let mut prev: Option<(f64, f64, usize)> = None;
            for i in 0..=30 {
                let p = MdpParams {
                    delta_r,
                    delta_p,
                    p_s,
                    quality,
                    c_r: 0.01 * i as f64,
                    ..MdpParams::default()
                };
                let sol = solve(&p, &SolverConfig::default()).unwrap();
                let retrieves = sol
                    .actions
                    .iter()
                    .filter(|&&a| a == Action::Retrieve)
                    .count();
                let now = (sol.values[0], sol.theta_star, retrieves);
                if let Some((v0, star, r)) = prev {
                    let ctx = format!("{quality:?} {delta_r}/{delta_p}/{p_s} c_r {}", p.c_r);
                    assert!(now.0 <= v0 + 1e-9, "V(0) rose: {ctx}");
                    assert!(now.1 <= star + 1e-9, "theta* rose: {ctx}");
                    assert!(now.2 <= r, "Retrieve region grew: {ctx}");
                }
                prev = Some(now);
            }
            // Costly enough retrieval is never chosen.
            assert_eq!(prev.unwrap().2, 0, "{quality:?}");
        }
    }
}

/// With linear sigma the gain of a step hardly shrinks with U, so the policy keeps going almost
/// to U_max.
#[test]
fn linear_sigma_puts_theta_star_near_u_max() {
    let p = MdpParams {
        quality: Quality::Linear,
        ..MdpParams::default()
    };
    let sol = solve(&p, &SolverConfig::default()).unwrap();
    assert!(sol.theta_star >= 1.0 - p.delta_p, "{}", sol.theta_star);
    let p1 = MdpParams { gamma: 1.0, ..p };
    let sol1 = solve(&p1, &SolverConfig::default()).unwrap();
    assert!(sol1.theta_star > 1.0 - p.delta_p, "{}", sol1.theta_star);
}

/// With the default world and c_r = 4 c_p the optimal action alternates between Retrieve and
/// Reason: the check must say so.
#[test]
fn alternating_policy_is_reported_as_not_two_threshold() {
    let p = MdpParams {
        c_r: 0.08,
        ..MdpParams::default()
    };
    let sol = solve(&p, &SolverConfig::default()).unwrap();
    assert!(!sol.is_two_threshold());
    let why = sol.structure.violation.clone().unwrap();
    assert!(why.contains("alternates"), "{why}");
    assert!(sol.structure.segments.len() > 3);
    // The default cost is two-threshold.
    let sol = solve(&MdpParams::default(), &SolverConfig::default()).unwrap();
    assert!(sol.is_two_threshold(), "{}", sol.structure.describe());
}

#[test]
fn off_grid_states_get_their_own_decision() {
    // delta_p = 0.075 does not land on the 0.01 grid; the policy is still defined there and
    // agrees with the grid at grid points.
    let p = MdpParams {
        delta_p: 0.075,
        ..MdpParams::default()
    };
    let sol = solve(&p, &SolverConfig::default()).unwrap();
    let q = sol.q_at(0.455);
    assert!(q.terminate > 0.0 && q.retrieve.is_finite() && q.reason.is_finite());
    let v = sol.value_at(0.455);
    assert!(v >= sol.values[45].min(sol.values[46]) - 1e-12);
    assert!(v <= sol.values[45].max(sol.values[46]) + 1e-12);
}

#[test]
fn iteration_cap_gives_not_converged() {
    let solver = SolverConfig {
        max_iterations: 2,
        ..SolverConfig::default()
    };
    match solve(&MdpParams::default(), &solver) {
        Err(MdpError::NotConverged { iterations, .. }) => assert_eq!(iterations, 2),
        other => panic!("expected NotConverged, got {other:?}"),
    }
}

fn field_of(err: MdpError) -> (String, String) {
    match err {
        MdpError::Param(p) => (p.field().to_string(), p.to_string()),
        other => panic!("expected a parameter error, got {other:?}"),
    }
}

#[test]
fn bad_parameters_name_field_value_and_range() {
    let d = MdpParams::default();
    let s = SolverConfig::default();
    let cases: Vec<(MdpParams, &str, &str)> = vec![
        (MdpParams { p_s: 1.5, ..d }, "mdp.p_s", "[0, 1]"),
        (MdpParams { p_s: -0.1, ..d }, "mdp.p_s", "[0, 1]"),
        (MdpParams { c_r: -0.01, ..d }, "mdp.c_r", "[0, inf)"),
        (MdpParams { c_p: -1.0, ..d }, "mdp.c_p", "[0, inf)"),
        (MdpParams { mu: -0.5, ..d }, "mdp.mu", "[0, inf)"),
        (MdpParams { gamma: 0.0, ..d }, "mdp.gamma", "(0, 1]"),
        (MdpParams { gamma: 1.01, ..d }, "mdp.gamma", "(0, 1]"),
        (MdpParams { u_max: 0.0, ..d }, "mdp.u_max", "(0, inf)"),
        (MdpParams { delta_r: 1.5, ..d }, "mdp.delta_r", "(0, 1]"),
        (MdpParams { delta_p: 0.0, ..d }, "mdp.delta_p", "(0, 1]"),
        (MdpParams { p_s: f64::NAN, ..d }, "mdp.p_s", "[0, 1]"),
        (
            MdpParams {
                quality: Quality::Saturating { alpha: 0.0 },
                ..d
            },
            "mdp.quality.alpha",
            "(0, inf)",
        ),
        (
            MdpParams {
                quality: Quality::Sigmoid { k: -2.0 },
                ..d
            },
            "mdp.quality.k",
            "(0, inf)",
        ),
    ];
    for (p, field, range) in cases {
        let (f, msg) = field_of(solve(&p, &s).unwrap_err());
        assert_eq!(f, field, "{msg}");
        assert!(msg.contains(field) && msg.contains(range), "{msg}");
    }
}

#[test]
fn bad_solver_settings_are_refused() {
    let p = MdpParams::default();
    let (f, msg) = field_of(
        solve(
            &p,
            &SolverConfig {
                grid_points: 5,
                ..SolverConfig::default()
            },
        )
        .unwrap_err(),
    );
    assert_eq!(f, "solver.grid_points");
    assert!(
        msg.contains("grid too small") && msg.contains("at least 14 points"),
        "{msg}"
    );
    for grid_points in [0, 1] {
        let err = solve(
            &p,
            &SolverConfig {
                grid_points,
                ..SolverConfig::default()
            },
        )
        .unwrap_err();
        assert!(matches!(
            err,
            MdpError::Param(ParamError::OutOfRange { .. })
        ));
    }
    let (f, _) = field_of(
        solve(
            &p,
            &SolverConfig {
                tolerance: 0.0,
                ..SolverConfig::default()
            },
        )
        .unwrap_err(),
    );
    assert_eq!(f, "solver.tolerance");
    let (f, _) = field_of(
        solve(
            &p,
            &SolverConfig {
                max_iterations: 0,
                ..SolverConfig::default()
            },
        )
        .unwrap_err(),
    );
    assert_eq!(f, "solver.max_iterations");
}
