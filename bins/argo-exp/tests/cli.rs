//! Runs the argo-exp binary: the default simulation sweep, solve, and bad input.

use std::process::Output;

mod common;
use common::argo_exp;

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn default_run_prints_the_table_and_writes_plots_and_summary() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("results");
    let out = argo_exp(&["--out", out_dir.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.starts_with("[simulation]"), "{stdout}");
    for needle in [
        "ARGO",
        "Always-Retrieve",
        "Always-Reason",
        "Random(p=0.5)",
        "Fixed-K(k=3)",
        "theta*",
        "10 cost points x 5 strategies x 1000 questions",
    ] {
        assert!(stdout.contains(needle), "missing {needle}:\n{stdout}");
    }
    for name in [
        "simulation_summary.json",
        "simulation_points.jsonl",
        "simulation_table.txt",
        "simulation_graph1a_accuracy_vs_c_r.png",
        "simulation_graph1a_accuracy_vs_c_r.svg",
        "simulation_graph1b_retrievals_vs_c_r.png",
        "simulation_graph1b_retrievals_vs_c_r.svg",
        "simulation_graph1c_accuracy_vs_cost.png",
        "simulation_graph1c_accuracy_vs_cost.svg",
    ] {
        let path = out_dir.join(name);
        assert!(path.is_file(), "missing {name}");
    }
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out_dir.join("simulation_summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["world"], "simulation");
    assert_eq!(summary["commit"], common::built_commit().as_str());
    assert_eq!(summary["seed"], 42);
    assert_eq!(summary["config"]["sweep"]["n_questions"], 1000);
    assert_eq!(summary["points"].as_array().unwrap().len(), 10);
}

/// Results never depend on stdout: with its reader gone at once (`argo-exp | true`), the run
/// still writes every file and exits 0; and the commit it records is the one fleet was built
/// from, not that of the repository it runs in.
#[test]
fn a_closed_stdout_and_another_repository_change_no_result() {
    let dir = tempfile::tempdir().unwrap();
    let other_repo = dir.path().join("elsewhere");
    std::fs::create_dir_all(&other_repo).unwrap();
    let git = |args: &[&str]| {
        let ok = std::process::Command::new("git")
            .args(args)
            .current_dir(&other_repo)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@t")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@t")
            .output()
            .unwrap();
        assert!(ok.status.success(), "{ok:?}");
        String::from_utf8_lossy(&ok.stdout).trim().to_string()
    };
    git(&["init", "-q"]);
    git(&["commit", "-q", "--allow-empty", "-m", "another project"]);
    let other_head = git(&["rev-parse", "HEAD"]);

    let out_dir = dir.path().join("results");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_argo-exp"))
        .args(["--out", out_dir.to_str().unwrap()])
        .current_dir(&other_repo)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes away before the first line is written.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in [
        "simulation_summary.json",
        "simulation_points.jsonl",
        "simulation_table.txt",
        "simulation_graph1c_accuracy_vs_cost.png",
    ] {
        assert!(out_dir.join(name).is_file(), "missing {name}");
    }
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out_dir.join("simulation_summary.json")).unwrap(),
    )
    .unwrap();
    let commit = summary["commit"].as_str().unwrap();
    assert_ne!(commit, other_head);
    assert_eq!(commit, common::built_commit());
    assert!(!commit.starts_with("unknown"), "{commit}");
}

#[test]
fn flags_override_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let out = argo_exp(&[
        "sweep",
        "--mode",
        "small",
        "--seed",
        "7",
        "--strategies",
        "argo,fixed-k:1",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("5 cost points x 2 strategies x 10 questions"),
        "{stdout}"
    );
    assert!(stdout.contains("Fixed-K(k=1)") && !stdout.contains("Always-Reason"));
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("simulation_summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["seed"], 7);

    let out = argo_exp(&[
        "simulate",
        "--c-r",
        "0.1",
        "--n-questions",
        "50",
        "--no-write",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("c_r = 0.1000"), "{stdout}");
    assert!(
        stdout.contains("1 cost points x 5 strategies x 50 questions"),
        "{stdout}"
    );
}

#[test]
fn config_file_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("argo.toml");
    std::fs::write(
        &cfg,
        "[mdp]\nc_r = 0.1\n[mdp.quality]\nkind = \"linear\"\n[sweep]\nn_questions = 20\n",
    )
    .unwrap();
    let out = argo_exp(&["solve", "--config", cfg.to_str().unwrap(), "--every", "0"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("c_r 0.1") && stdout.contains("linear"),
        "{stdout}"
    );
}

#[test]
fn solve_prints_policy_and_thresholds() {
    let out = argo_exp(&["solve"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    for needle in [
        "Q(Retrieve)",
        "theta_cont = ",
        "theta*     = ",
        "one-step-lookahead",
        "two-threshold form: yes",
        "policy: Retrieve [0.00,",
    ] {
        assert!(stdout.contains(needle), "missing {needle}:\n{stdout}");
    }
    let out = argo_exp(&["solve", "--c-r", "0.08", "--every", "0"]);
    let (stdout, _) = text(&out);
    assert!(stdout.contains("two-threshold form: NO"), "{stdout}");

    let out = argo_exp(&["solve", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["actions"].as_array().unwrap().len(), 101);
    assert!(v["summary"]["theta_star"].is_number());
}

#[test]
fn bad_parameters_give_clear_errors() {
    let cases: [(&[&str], &str); 6] = [
        (
            &["solve", "--p-s", "1.5"],
            "mdp.p_s = 1.5 is out of range: allowed [0, 1]",
        ),
        (
            &["solve", "--gamma", "0"],
            "mdp.gamma = 0 is out of range: allowed (0, 1]",
        ),
        (
            &["solve", "--c-p", "-0.1"],
            "mdp.c_p = -0.1 is out of range",
        ),
        (
            &["solve", "--grid-points", "4"],
            "solver.grid_points = 4: grid too small",
        ),
        (
            &["--n-questions", "0", "--no-write"],
            "sweep.n_questions = 0",
        ),
        (
            &["sweep", "--c-r-min", "-1", "--no-write"],
            "sweep.c_r_min = -1",
        ),
    ];
    for (args, needle) in cases {
        let out = argo_exp(args);
        let (_, stderr) = text(&out);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    let out = argo_exp(&["--strategies", "greedy", "--no-write"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("unknown strategy `greedy`"), "{stderr}");
    let out = argo_exp(&["solve", "--quality", "cubic"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("unknown quality `cubic`"), "{stderr}");
}

/// Issue 14, item 4: `argo-exp | head` ends quietly: no "Broken pipe" panic, no exit 101.
#[test]
fn a_closed_stdout_ends_quietly() {
    let runs: [&[&str]; 3] = [&["--no-write"], &["solve"], &["solve", "--json"]];
    for args in runs {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_argo-exp"))
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(101), "{args:?}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("Broken pipe"),
            "{args:?}: {err}"
        );
        assert!(out.status.success(), "{args:?}: {:?} {err}", out.status);
    }
}

/// `--logical-gpus` (a global flag) may stand before a subcommand; a flag of the default
/// command may not, and the error names it.
#[test]
fn a_global_flag_may_precede_a_subcommand_and_a_default_command_flag_may_not() {
    let out = argo_exp(&["--points", "5", "solve"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--points") && stderr.contains("default command"),
        "{stderr}"
    );
    // On this CPU machine the logical devices themselves are refused (no GPU), by fleet, not
    // by the argument parser.
    let out = argo_exp(&["--logical-gpus", "2", "solve"]);
    let (_, stderr) = text(&out);
    assert!(!stderr.contains("cannot be used with"), "{stderr}");
    assert!(stderr.contains("--logical-gpus 2"), "{stderr}");
}
