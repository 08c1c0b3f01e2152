//! The poll-style episode and the strategies: one step cap and one cost account for all.

use std::sync::Arc;

use fleet_argo::mdp::{solve, Action};
use fleet_argo::params::{MdpParams, SolverConfig};
use fleet_argo::strategy::{Episode, EpisodeError, Outcome, Strategy, StrategyError, StrategyKind};

fn params() -> MdpParams {
    MdpParams::default()
}

fn baseline(kind: StrategyKind) -> Strategy {
    Strategy::new(kind, 0.9, None).unwrap()
}

/// Drives an episode to the end with a fixed answer for every Retrieve's progress.
fn drive(mut episode: Episode, progress: bool) -> Vec<Action> {
    let mut actions = Vec::new();
    while let Some(a) = episode.next_action() {
        actions.push(a);
        let outcome = match a {
            Action::Retrieve => Outcome::Retrieved { progress },
            Action::Reason => Outcome::Reasoned,
            Action::Terminate => Outcome::Terminated,
        };
        episode.record(outcome).unwrap();
    }
    actions
}

#[test]
fn next_action_is_stable_until_recorded() {
    let mut e = Episode::new(
        baseline(StrategyKind::Random { p_retrieve: 0.5 }),
        &params(),
        20,
        7,
    );
    let first = e.next_action().unwrap();
    for _ in 0..10 {
        assert_eq!(e.next_action(), Some(first));
    }
    assert_eq!(e.state().steps, 0);
}

#[test]
fn misuse_is_reported_not_panicked() {
    let mut e = Episode::new(baseline(StrategyKind::AlwaysRetrieve), &params(), 20, 0);
    assert_eq!(
        e.record(Outcome::Reasoned),
        Err(EpisodeError::NoPendingAction)
    );
    assert_eq!(e.next_action(), Some(Action::Retrieve));
    assert_eq!(
        e.record(Outcome::Reasoned),
        Err(EpisodeError::OutcomeMismatch {
            expected: Action::Retrieve,
            got: Action::Reason
        })
    );
    let unfinished = e.clone();
    assert!(matches!(
        unfinished.finish(),
        Err(EpisodeError::NotTerminated { steps: 0 })
    ));
    e.record(Outcome::Retrieved { progress: true }).unwrap();
    // Run to the end, then any further record is refused.
    drive_to_end(&mut e);
    assert_eq!(e.next_action(), None);
    assert_eq!(
        e.record(Outcome::Terminated),
        Err(EpisodeError::AlreadyTerminated)
    );
}

fn drive_to_end(e: &mut Episode) {
    while let Some(a) = e.next_action() {
        let o = match a {
            Action::Retrieve => Outcome::Retrieved { progress: true },
            Action::Reason => Outcome::Reasoned,
            Action::Terminate => Outcome::Terminated,
        };
        e.record(o).unwrap();
    }
}

#[test]
fn progress_and_cost_are_accounted() {
    let p = params();
    let mut e = Episode::new(baseline(StrategyKind::AlwaysRetrieve), &p, 20, 0);
    // Success, failure, success, success: U = 0.25, 0.25, 0.5, 0.75.
    for progress in [true, false, true, true] {
        assert_eq!(e.next_action(), Some(Action::Retrieve));
        e.record(Outcome::Retrieved { progress }).unwrap();
    }
    assert!((e.state().u - 0.75).abs() < 1e-12);
    assert_eq!(e.state().retrievals, 4);
    assert_eq!(e.state().successful_retrievals, 3);
    // 0.75 < 0.9: still retrieving; a success reaches 1.0 (capped), then it answers.
    assert_eq!(e.next_action(), Some(Action::Retrieve));
    e.record(Outcome::Retrieved { progress: true }).unwrap();
    assert_eq!(e.state().u, 1.0);
    assert_eq!(e.next_action(), Some(Action::Terminate));
    e.record(Outcome::Terminated).unwrap();
    let r = e.finish().unwrap();
    assert_eq!(r.retrievals, 5);
    assert_eq!(r.reasons, 0);
    assert_eq!(r.steps, 5);
    assert!((r.cost - 5.0 * p.c_r).abs() < 1e-12);
    assert!((r.weighted_cost - p.mu * 5.0 * p.c_r).abs() < 1e-12);
    assert!(!r.forced_termination);
    assert_eq!(r.trace.len(), 6);
    assert_eq!(r.trace[1].progress, Some(false));
    assert_eq!(r.trace[1].u_before, r.trace[1].u_after);
}

#[test]
fn reason_progress_is_capped_at_u_max() {
    let p = MdpParams {
        delta_p: 0.3,
        ..params()
    };
    let strategy = Strategy::new(StrategyKind::AlwaysReason, 1.0, None).unwrap();
    let mut e = Episode::new(strategy, &p, 20, 0);
    let actions = drive(e.clone(), true);
    // 0.3, 0.6, 0.9, 1.0 (capped), then answer.
    assert_eq!(actions.len(), 5);
    drive_to_end(&mut e);
    let r = e.finish().unwrap();
    assert_eq!(r.final_u, 1.0);
    assert_eq!(r.reasons, 4);
    assert!((r.cost - 4.0 * p.c_p).abs() < 1e-12);
}

#[test]
fn step_cap_forces_the_answer_and_says_so() {
    let mut e = Episode::new(baseline(StrategyKind::AlwaysReason), &params(), 3, 0);
    let mut seen = Vec::new();
    while let Some(a) = e.next_action() {
        seen.push(a);
        let o = if a == Action::Reason {
            Outcome::Reasoned
        } else {
            Outcome::Terminated
        };
        e.record(o).unwrap();
    }
    assert_eq!(
        seen,
        vec![
            Action::Reason,
            Action::Reason,
            Action::Reason,
            Action::Terminate
        ]
    );
    let r = e.finish().unwrap();
    assert!(r.forced_termination);
    assert!(r.trace.last().unwrap().forced);
    assert_eq!(r.steps, 3);
}

#[test]
fn a_strategy_that_stops_at_the_cap_is_not_forced() {
    // Fixed-K(2) with cap 2 answers by itself after its two retrievals.
    let e = Episode::new(baseline(StrategyKind::FixedK { k: 2 }), &params(), 2, 0);
    let mut e2 = e.clone();
    assert_eq!(
        drive(e, false),
        vec![Action::Retrieve, Action::Retrieve, Action::Terminate]
    );
    drive_to_end(&mut e2);
    assert!(!e2.finish().unwrap().forced_termination);
}

#[test]
fn fixed_k_retrieves_exactly_k_times_whatever_the_progress() {
    for k in [0u32, 1, 3, 6] {
        for progress in [true, false] {
            let e = Episode::new(baseline(StrategyKind::FixedK { k }), &params(), 20, 0);
            let actions = drive(e, progress);
            assert_eq!(actions.len() as u32, k + 1, "k {k}");
            assert!(actions[..k as usize].iter().all(|&a| a == Action::Retrieve));
            assert_eq!(*actions.last().unwrap(), Action::Terminate);
        }
    }
}

#[test]
fn always_strategies_stop_at_their_level() {
    // Always-Reason: 0.08 per step, stop level 0.9: 12 steps reach 0.96.
    let e = Episode::new(baseline(StrategyKind::AlwaysReason), &params(), 50, 0);
    let actions = drive(e, true);
    assert_eq!(actions.len(), 13);
    // Always-Retrieve with every retrieval failing runs into the cap.
    let e = Episode::new(baseline(StrategyKind::AlwaysRetrieve), &params(), 7, 0);
    let actions = drive(e, false);
    assert_eq!(actions.len(), 8);
}

#[test]
fn random_extremes_and_reproducibility() {
    let p = params();
    let only = |p_retrieve: f64, seed: u64| {
        let e = Episode::new(baseline(StrategyKind::Random { p_retrieve }), &p, 20, seed);
        drive(e, true)
    };
    assert!(only(1.0, 3)[..4].iter().all(|&a| a == Action::Retrieve));
    assert!(only(0.0, 3).iter().all(|&a| a != Action::Retrieve));
    // Same seed, same choices; over many seeds the choices differ.
    assert_eq!(only(0.5, 11), only(0.5, 11));
    let distinct: std::collections::HashSet<Vec<Action>> = (0..20).map(|s| only(0.5, s)).collect();
    assert!(distinct.len() > 5, "{}", distinct.len());
}

#[test]
fn lock_step_batches_give_the_same_records_as_one_by_one() {
    let p = params();
    let strategy = baseline(StrategyKind::Random { p_retrieve: 0.4 });
    let coin = |q: u64, step: usize| !(q * 31 + step as u64 * 7).is_multiple_of(3);
    // One by one.
    let mut sequential = Vec::new();
    for q in 0..16u64 {
        let mut e = Episode::new(strategy.clone(), &p, 20, 1000 + q);
        let mut step = 0;
        while let Some(a) = e.next_action() {
            let o = match a {
                Action::Retrieve => Outcome::Retrieved {
                    progress: coin(q, step),
                },
                Action::Reason => Outcome::Reasoned,
                Action::Terminate => Outcome::Terminated,
            };
            e.record(o).unwrap();
            step += 1;
        }
        sequential.push(e.finish().unwrap());
    }
    // All sixteen in lock-step, polled in reverse order each round.
    let mut episodes: Vec<Episode> = (0..16u64)
        .map(|q| Episode::new(strategy.clone(), &p, 20, 1000 + q))
        .collect();
    let mut steps = [0usize; 16];
    loop {
        let mut any = false;
        for q in (0..16).rev() {
            if let Some(a) = episodes[q].next_action() {
                any = true;
                let o = match a {
                    Action::Retrieve => Outcome::Retrieved {
                        progress: coin(q as u64, steps[q]),
                    },
                    Action::Reason => Outcome::Reasoned,
                    Action::Terminate => Outcome::Terminated,
                };
                episodes[q].record(o).unwrap();
                steps[q] += 1;
            }
        }
        if !any {
            break;
        }
    }
    let batched: Vec<_> = episodes.into_iter().map(|e| e.finish().unwrap()).collect();
    assert_eq!(sequential, batched);
}

#[test]
fn argo_follows_the_solved_policy() {
    let p = params();
    let sol = Arc::new(solve(&p, &SolverConfig::default()).unwrap());
    let strategy = Strategy::argo(sol.clone());
    let mut e = Episode::new(strategy, &p, 20, 0);
    while let Some(a) = e.next_action() {
        assert_eq!(a, sol.action_at(e.state().u));
        let o = match a {
            Action::Retrieve => Outcome::Retrieved { progress: true },
            Action::Reason => Outcome::Reasoned,
            Action::Terminate => Outcome::Terminated,
        };
        e.record(o).unwrap();
    }
    let r = e.finish().unwrap();
    // Defaults (c_r = 0.05): two-threshold with Retrieve all the way up to theta*; with every
    // retrieval succeeding, U climbs by 0.25 until it passes theta*.
    assert!(sol.is_two_threshold());
    assert_eq!(sol.theta_cont, sol.theta_star);
    assert_eq!(r.retrievals, (sol.theta_star / 0.25).ceil() as u32);
    assert!(r.final_u >= sol.theta_star);
}

#[test]
fn argo_needs_a_solution() {
    assert_eq!(
        Strategy::new(StrategyKind::Argo, 0.9, None).unwrap_err(),
        StrategyError::MissingSolution
    );
}

#[test]
fn strategy_names_parse_and_print() {
    for text in [
        "argo",
        "always-retrieve",
        "always-reason",
        "random:0.3",
        "fixed-k:4",
    ] {
        let k: StrategyKind = text.parse().unwrap();
        assert_eq!(k.to_string(), text);
    }
    assert_eq!(
        "Fixed_K:2".parse::<StrategyKind>().unwrap(),
        StrategyKind::FixedK { k: 2 }
    );
    assert_eq!(
        "random".parse::<StrategyKind>().unwrap(),
        StrategyKind::Random { p_retrieve: 0.5 }
    );
    assert_eq!(StrategyKind::FixedK { k: 3 }.label(), "Fixed-K(k=3)");
    for bad in ["random:1.5", "random:x", "fixed-k", "fixed-k:-1", "greedy"] {
        let err = bad.parse::<StrategyKind>().unwrap_err().to_string();
        assert!(err.contains(bad), "{err}");
    }
    let err = "random:1.5"
        .parse::<StrategyKind>()
        .unwrap_err()
        .to_string();
    assert!(err.contains("[0, 1]"), "{err}");
}
