//! gspo-train's output directory keeps one run's files in agreement with its checkpoints
//! (issue 23, data safety): a restart never appends to an old run's metrics, a resume cuts
//! them back to its checkpoint byte for byte, a damaged checkpoint names the intact one to
//! resume from, checkpoints follow the umask, and a closed stdout costs no file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn gspo_train() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gspo-train"))
}

fn run(args: &[&str]) -> Output {
    gspo_train().args(args).output().expect("gspo-train runs")
}

fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn fails(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "expected a failure; stdout:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

fn steps(dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

fn args(out: &Path, max_steps: &str, save_steps: &str) -> Vec<String> {
    [
        "--output-dir",
        out.to_str().unwrap(),
        "--max-steps",
        max_steps,
        "--set",
        &format!("save_steps={save_steps}"),
        "--set",
        "save_total_limit=5",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// A run killed before its first checkpoint: started again it is refused (with --resume too:
/// there is nothing to resume), its metrics untouched; --overwrite starts over and the
/// metrics hold each step once, in order. Before the fix the restart appended to the old lines.
#[test]
fn a_run_killed_before_its_first_checkpoint_is_never_appended_to() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let a = args(&out, "300", "1000");
    let mut child = gspo_train()
        .args(&a)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let metrics = out.join("metrics.jsonl");
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 3 {
        assert!(started.elapsed() < Duration::from_secs(300), "no metrics");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!out.join("latest").exists(), "a checkpoint was written");
    let before = std::fs::read(&metrics).unwrap();

    let err = fails(&run(&strs(&a)));
    assert!(err.contains("--overwrite"), "{err}");
    let mut resume = a.clone();
    resume.push("--resume".into());
    let err = fails(&run(&strs(&resume)));
    assert!(err.contains("holds no checkpoint"), "{err}");
    assert!(err.contains("--overwrite"), "{err}");
    assert_eq!(std::fs::read(&metrics).unwrap(), before);

    let mut again = args(&out, "6", "1000");
    again.push("--overwrite".into());
    ok(&run(&strs(&again)));
    assert_eq!(steps(&out), (1..=6).collect::<Vec<u64>>());
}

/// --resume on a directory that does not exist is an error (TRL's resume_from_checkpoint),
/// and the directory is not created.
#[test]
fn resume_of_a_missing_directory_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("typo");
    let mut a = args(&out, "4", "2");
    a.push("--resume".into());
    let err = fails(&run(&strs(&a)));
    assert!(err.contains("does not exist"), "{err}");
    assert!(err.contains(out.to_str().unwrap()), "{err}");
    assert!(!out.exists());
}

/// A resume cuts metrics.jsonl back to its checkpoint's step, keeping those lines' bytes
/// (and dropping a torn line); the redone steps appear once. A damaged newest checkpoint is
/// refused with the intact earlier one, from which --resume-from-checkpoint ends bit-exact.
/// Checkpoint files get the umask's mode, not the safetensors writer's 0600.
#[test]
fn resumes_cut_metrics_back_and_name_the_intact_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let straight = tmp.path().join("straight");
    ok(&run(&strs(&args(&straight, "8", "4"))));
    let whole_metrics = std::fs::read_to_string(straight.join("metrics.jsonl")).unwrap();
    let final_weights = std::fs::read(straight.join("checkpoint-8/model.safetensors")).unwrap();

    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let probe = tmp.path().join("probe");
        std::fs::write(&probe, b"").unwrap();
        let want = std::fs::metadata(&probe).unwrap().permissions().mode() & 0o777;
        for f in ["model.safetensors", "optimizer.safetensors", "config.json"] {
            let mode = std::fs::metadata(straight.join("checkpoint-8").join(f))
                .unwrap()
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(mode, want, "{f}: {mode:o}");
        }
    }

    // As a kill after step 6 leaves it: checkpoint-4 the newest, two more steps logged, the
    // last line torn, and a hidden temporary of the interrupted save.
    let killed = tmp.path().join("killed");
    copy_dir(&straight, &killed);
    std::fs::remove_dir_all(killed.join("checkpoint-8")).unwrap();
    std::fs::write(killed.join("latest"), "checkpoint-4\n").unwrap();
    let lines: Vec<&str> = whole_metrics.lines().collect();
    let mut logged = lines[..6].join("\n");
    logged.push('\n');
    logged.push_str(&lines[6][..20]);
    std::fs::write(killed.join("metrics.jsonl"), &logged).unwrap();
    std::fs::create_dir_all(killed.join(".checkpoint-8.tmp-4242")).unwrap();
    let mut resume = args(&killed, "8", "4");
    resume.push("--resume".into());
    ok(&run(&strs(&resume)));
    let after = std::fs::read_to_string(killed.join("metrics.jsonl")).unwrap();
    let kept: String = lines[..4].iter().map(|l| format!("{l}\n")).collect();
    assert!(after.starts_with(&kept), "the kept lines changed");
    assert_eq!(steps(&killed), (1..=8).collect::<Vec<u64>>());
    assert!(!killed.join(".checkpoint-8.tmp-4242").exists());
    assert_eq!(
        std::fs::read(killed.join("checkpoint-8/model.safetensors")).unwrap(),
        final_weights
    );

    // The newest checkpoint cut short: refused, naming the intact one and the flag.
    let damaged = tmp.path().join("damaged");
    copy_dir(&straight, &damaged);
    let weights = damaged.join("checkpoint-8/model.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&weights)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let mut resume = args(&damaged, "8", "4");
    resume.push("--resume".into());
    let err = fails(&run(&strs(&resume)));
    let intact = damaged.join("checkpoint-4");
    assert!(err.contains("damaged"), "{err}");
    assert!(
        err.contains(&format!("--resume-from-checkpoint {}", intact.display())),
        "{err}"
    );
    let mut from = args(&damaged, "8", "4");
    from.extend([
        "--resume-from-checkpoint".to_string(),
        intact.display().to_string(),
    ]);
    ok(&run(&strs(&from)));
    assert_eq!(std::fs::read(&weights).unwrap(), final_weights);
    assert_eq!(steps(&damaged), (1..=8).collect::<Vec<u64>>());
}

/// With stdout closed at once (`gspo-train | true`) the run still writes its metrics, plots
/// and checkpoints and exits 0.
#[test]
fn a_closed_stdout_costs_no_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut child = gspo_train()
        .args(strs(&args(&out, "4", "4")))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let done = child.wait_with_output().unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    for f in [
        "metrics.jsonl",
        "reward.png",
        "loss.svg",
        "checkpoint-4/model.safetensors",
    ] {
        assert!(out.join(f).exists(), "{f} missing");
    }
}

fn copy_dir(from: &Path, to: &PathBuf) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else if entry.file_name() != ".fleet-lock" {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Checkpoints fall after the generation batch in which a multiple of save_steps falls, so
/// they do not drift away from TRL's steps (4 optimizer steps per generation batch here,
/// save_steps 6: 8, 12, then 16 as the last; it used to count from the last checkpoint and
/// give 8, 16). --help lists the keys --set takes and says where checkpoints fall.
#[test]
fn checkpoints_follow_multiples_of_save_steps_and_help_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut a = args(&out, "16", "6");
    a.extend(["--set".to_string(), "save_total_limit=10".to_string()]);
    ok(&run(&strs(&a)));
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    names.sort_by_key(|n| n["checkpoint-".len()..].parse::<u64>().unwrap());
    assert_eq!(names, ["checkpoint-8", "checkpoint-12", "checkpoint-16"]);

    let help = ok(&run(&["--help"]));
    for key in [
        "save_steps",
        "save_total_limit",
        "logging_steps",
        "max_grad_norm",
        "warmup_ratio",
        "checkpoint-252",
    ] {
        assert!(help.contains(key), "--help lacks {key}");
    }
}
