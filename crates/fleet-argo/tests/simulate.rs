//! The simulated world, the cost sweep and its result files.

use std::sync::Arc;

use fleet_argo::mdp::solve;
use fleet_argo::params::{MdpParams, SolverConfig};
use fleet_argo::simulate::{derive_seed, SimulatedWorld, Stream, SIMULATION};
use fleet_argo::strategy::{Strategy, StrategyKind};
use fleet_argo::summary::{commit_id, write_json_atomic};
use fleet_argo::sweep::{
    files, point_records, render_table, run_sweep, write_outputs, ExperimentConfig, Mode,
    SweepError, SweepSummary,
};

fn strategy(kind: StrategyKind, params: &MdpParams) -> Strategy {
    let sol = Arc::new(solve(params, &SolverConfig::default()).unwrap());
    Strategy::new(kind, 0.9 * params.u_max, Some(sol)).unwrap()
}

fn mean(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let v: Vec<f64> = v.collect();
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0);
    (m, (var / n).sqrt())
}

#[test]
fn questions_are_reproducible_and_independent_of_the_batch() {
    let p = MdpParams::default();
    let world = SimulatedWorld::new(p, 42).unwrap();
    let s = strategy(StrategyKind::Random { p_retrieve: 0.5 }, &p);
    let batch = world.run(&s, 20, 50).unwrap();
    for i in [0u64, 17, 49] {
        assert_eq!(batch[i as usize], world.run_question(&s, 20, i).unwrap());
    }
    assert_eq!(batch, world.run(&s, 20, 50).unwrap());
    let other = SimulatedWorld::new(p, 43).unwrap().run(&s, 20, 50).unwrap();
    assert_ne!(batch, other);
    assert!(batch.iter().all(|q| q.world == SIMULATION));
    assert_ne!(
        derive_seed(42, 0, Stream::Retrieval),
        derive_seed(42, 1, Stream::Retrieval)
    );
    assert_ne!(
        derive_seed(42, 0, Stream::Retrieval),
        derive_seed(42, 0, Stream::Answer)
    );
}

#[test]
fn retrieval_succeeds_with_probability_p_s() {
    let p = MdpParams {
        p_s: 0.3,
        ..MdpParams::default()
    };
    let world = SimulatedWorld::new(p, 5).unwrap();
    let s = strategy(StrategyKind::FixedK { k: 10 }, &p);
    let qs = world.run(&s, 20, 2000).unwrap();
    let tries: u32 = qs.iter().map(|q| q.episode.retrievals).sum();
    let hits: u32 = qs.iter().map(|q| q.episode.successful_retrievals).sum();
    let rate = hits as f64 / tries as f64;
    let se = (0.3 * 0.7 / tries as f64).sqrt();
    assert!((rate - 0.3).abs() < 4.0 * se, "rate {rate}");
}

#[test]
fn accuracy_agrees_with_expected_accuracy() {
    let p = MdpParams::default();
    let world = SimulatedWorld::new(p, 9).unwrap();
    let s = strategy(StrategyKind::FixedK { k: 2 }, &p);
    let qs = world.run(&s, 20, 4000).unwrap();
    let acc = qs.iter().filter(|q| q.correct).count() as f64 / qs.len() as f64;
    let (expected, _) = mean(qs.iter().map(|q| q.expected_accuracy));
    let se = (expected * (1.0 - expected) / qs.len() as f64).sqrt();
    assert!((acc - expected).abs() < 4.0 * se, "{acc} vs {expected}");
    for q in &qs {
        assert_eq!(q.expected_accuracy, p.sigma(q.episode.final_u));
    }
}

/// In its own world ARGO earns what V(0) predicts, and no other strategy earns more (the
/// answer draws and retrieval coins are shared, so the comparison is tight).
#[test]
fn argo_earns_v0_and_beats_the_baselines_on_the_mdp_objective() {
    for c_r in [0.02, 0.05, 0.08, 0.14] {
        let p = MdpParams {
            c_r,
            ..MdpParams::default()
        };
        let sol = solve(&p, &SolverConfig::default()).unwrap();
        let world = SimulatedWorld::new(p, 1).unwrap();
        let n = 2000;
        let argo = world.run(&strategy(StrategyKind::Argo, &p), 50, n).unwrap();
        let (argo_obj, se) = mean(argo.iter().map(|q| q.discounted_objective));
        assert!(
            (argo_obj - sol.values[0]).abs() < 4.0 * se + 1e-9,
            "c_r {c_r}: ARGO {argo_obj} vs V(0) {}",
            sol.values[0]
        );
        for kind in StrategyKind::default_set().into_iter().skip(1) {
            let qs = world.run(&strategy(kind, &p), 50, n).unwrap();
            let (obj, _) = mean(qs.iter().map(|q| q.discounted_objective));
            assert!(
                obj <= sol.values[0] + 4.0 * se + 1e-9,
                "c_r {c_r}: {} earns {obj} > V(0) {}",
                kind.label(),
                sol.values[0]
            );
        }
    }
}

fn small_config() -> ExperimentConfig {
    let mut cfg = ExperimentConfig::default();
    cfg.sweep.n_questions = 300;
    cfg.sweep.points = 6;
    cfg
}

#[test]
fn sweep_covers_every_point_and_strategy() {
    let cfg = small_config();
    let result = run_sweep(&cfg).unwrap();
    assert_eq!(result.world, SIMULATION);
    assert_eq!(result.points.len(), 6);
    let costs: Vec<f64> = result.points.iter().map(|p| p.c_r).collect();
    assert!((costs[0] - 0.02).abs() < 1e-12 && (costs[5] - 0.2).abs() < 1e-12);
    for p in &result.points {
        assert_eq!(p.world, SIMULATION);
        assert_eq!(p.results.len(), 5);
        for s in &p.results {
            assert_eq!(s.n_questions, 300);
            assert!(s.accuracy_ci95[0] <= s.accuracy && s.accuracy <= s.accuracy_ci95[1]);
        }
        // Baselines do not depend on c_r for their choices.
        let fixed = p
            .results
            .iter()
            .find(|s| s.strategy == StrategyKind::FixedK { k: 3 })
            .unwrap();
        assert_eq!(fixed.mean_retrievals, 3.0);
        assert!((fixed.mean_cost - 3.0 * p.c_r).abs() < 1e-12);
    }
    // ARGO retrieves less as retrieval gets dearer (common random numbers make this exact).
    let argo: Vec<f64> = result
        .points
        .iter()
        .map(|p| p.results[0].mean_retrievals)
        .collect();
    assert!(argo.windows(2).all(|w| w[1] <= w[0] + 1e-12), "{argo:?}");
    assert!(argo[0] > argo[5]);
    // The sweep is a pure function of its config.
    assert_eq!(result, run_sweep(&cfg).unwrap());
}

#[test]
fn table_is_labelled_simulation() {
    let mut cfg = small_config();
    cfg.sweep.points = 2;
    let table = render_table(&run_sweep(&cfg).unwrap());
    for line in table.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            line.starts_with("[simulation]") || line.starts_with("  "),
            "{line}"
        );
    }
    assert!(table.contains("ARGO") && table.contains("Fixed-K(k=3)"));
}

#[test]
fn outputs_are_written_and_labelled() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small_config();
    cfg.sweep.points = 3;
    let result = run_sweep(&cfg).unwrap();
    let summary = SweepSummary::new(&result, &cfg, "abc123".into(), 0.5);
    let written = write_outputs(dir.path(), &result, &summary).unwrap();
    assert_eq!(written.len(), 3 + 6);
    for path in &written {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        assert!(name.starts_with("simulation_"), "{name}");
        assert!(std::fs::metadata(path).unwrap().len() > 100, "{name}");
    }
    let png = std::fs::read(dir.path().join("simulation_graph1a_accuracy_vs_c_r.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let svg = std::fs::read_to_string(dir.path().join("simulation_graph1b_retrievals_vs_c_r.svg"))
        .unwrap();
    assert!(svg.contains("<svg") && svg.contains("simulation"));

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(files::SUMMARY)).unwrap())
            .unwrap();
    assert_eq!(json["world"], "simulation");
    assert_eq!(json["seed"], 42);
    assert_eq!(json["commit"], "abc123");
    assert_eq!(json["config"]["mdp"]["p_s"], 0.8);
    assert_eq!(json["config"]["strategies"]["list"][4], "fixed-k:3");
    assert_eq!(json["points"].as_array().unwrap().len(), 3);
    let back: SweepSummary = serde_json::from_value(json).unwrap();
    assert_eq!(back.config, cfg);

    let lines = std::fs::read_to_string(dir.path().join(files::POINTS)).unwrap();
    assert_eq!(lines.lines().count(), 15);
    for line in lines.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["world"], "simulation");
        assert!(v["accuracy_ci95"].is_array() && v["c_r"].is_number());
    }
    assert_eq!(point_records(&result).len(), 15);
    // No temporary files left behind.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn atomic_json_replaces_whole_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested/out.json");
    write_json_atomic(&path, &vec![1, 2, 3]).unwrap();
    write_json_atomic(&path, &vec![4]).unwrap();
    let v: Vec<i32> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(v, vec![4]);
}

#[test]
fn commit_id_is_never_empty() {
    // A library build names no commit; binaries register theirs (argo-exp's CLI test).
    assert!(!commit_id().is_empty());
}

#[test]
fn shipped_config_equals_the_embedded_default() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/argo.toml");
    let cfg = ExperimentConfig::from_file(std::path::Path::new(path)).unwrap();
    assert_eq!(cfg, ExperimentConfig::default());
    cfg.validate().unwrap();
}

#[test]
fn partial_config_keeps_defaults_and_unknown_fields_are_errors() {
    let cfg = ExperimentConfig::from_toml_str("[mdp]\np_s = 0.5\n", "test").unwrap();
    assert_eq!(cfg.mdp.p_s, 0.5);
    assert_eq!(cfg.mdp.delta_r, 0.25);
    assert_eq!(cfg.sweep, ExperimentConfig::default().sweep);
    let err = ExperimentConfig::from_toml_str("[mdp]\np_success = 0.5\n", "test")
        .unwrap_err()
        .to_string();
    assert!(err.contains("p_success"), "{err}");
    let err = ExperimentConfig::from_toml_str("[mdp.quality]\nkind = \"cubic\"\n", "test")
        .unwrap_err()
        .to_string();
    assert!(err.contains("cubic"), "{err}");
    let err = ExperimentConfig::from_toml_str("[strategies]\nlist = [\"greedy\"]\n", "test")
        .unwrap_err()
        .to_string();
    assert!(err.contains("greedy"), "{err}");
}

#[test]
fn sweep_settings_are_checked() {
    let mut cfg = ExperimentConfig::default();
    cfg.sweep.c_r_min = 0.3;
    let err = run_sweep(&cfg).unwrap_err();
    assert!(matches!(err, SweepError::Param(_)));
    assert!(err.to_string().contains("sweep.c_r_max"), "{err}");
    let mut cfg = ExperimentConfig::default();
    cfg.episode.step_cap = 0;
    assert!(run_sweep(&cfg)
        .unwrap_err()
        .to_string()
        .contains("episode.step_cap = 0"));
    let mut cfg = ExperimentConfig::default();
    cfg.strategies.stop_progress = 1.2;
    assert!(run_sweep(&cfg)
        .unwrap_err()
        .to_string()
        .contains("strategies.stop_progress"));
    let mut cfg = ExperimentConfig::default();
    cfg.sweep.n_questions = 0;
    assert!(run_sweep(&cfg)
        .unwrap_err()
        .to_string()
        .contains("sweep.n_questions"));
}

#[test]
fn modes_set_the_size() {
    let mut cfg = ExperimentConfig::default();
    cfg.apply_mode(Mode::Small);
    assert_eq!((cfg.sweep.n_questions, cfg.sweep.points), (10, 5));
    cfg.apply_mode(Mode::Medium);
    assert_eq!((cfg.sweep.n_questions, cfg.sweep.points), (100, 10));
    cfg.apply_mode(Mode::Full);
    assert_eq!((cfg.sweep.n_questions, cfg.sweep.points), (1000, 10));
}
