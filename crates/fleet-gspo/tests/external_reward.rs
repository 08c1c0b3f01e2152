//! The user's own reward functions (issue 28, item 1): TRL-style Python functions, unchanged,
//! served by `examples/rewards/fleet_reward.py` as a command over JSON lines and as an HTTP
//! endpoint; each way a function can misbehave is a recorded failure, never a 0. Needs
//! `python3` (the standard library only).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fleet_gspo::dataset::Sample;
use fleet_gspo::rewards::{RewardError, RewardSpec, WeightedSum};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn server() -> String {
    repo()
        .join("examples/rewards/fleet_reward.py")
        .display()
        .to_string()
}

fn function(file: &str, name: &str) -> String {
    let path = match file {
        "examples" => repo().join("examples/rewards/trl_style_rewards.py"),
        _ => {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/misbehaving_rewards.py")
        }
    };
    format!("{}:{name}", path.display())
}

fn command_spec(file: &str, name: &str, timeout_s: f64) -> RewardSpec {
    RewardSpec::Command {
        weight: 1.0,
        command: vec!["python3".into(), server(), function(file, name)],
        label: None,
        timeout_s,
    }
}

fn sum_of(specs: &[RewardSpec]) -> WeightedSum {
    WeightedSum::from_specs(specs, None).unwrap()
}

fn sample(id: &str, answer: &str, extra: &[(&str, Value)]) -> Sample {
    let mut s = Sample::text(id, &format!("prompt {id}"), answer);
    s.extra.insert("answer".into(), Value::from(answer));
    for (k, v) in extra {
        s.extra.insert((*k).into(), v.clone());
    }
    s
}

/// Scores `completions` (token ids: one per character) against `samples`.
fn score(
    sum: &WeightedSum,
    completions: &[&str],
    samples: &[&Sample],
) -> fleet_gspo::rewards::BatchRewards {
    let prompts: Vec<String> = samples
        .iter()
        .map(|s| s.prompt.question_text().to_string())
        .collect();
    let ids: Vec<Vec<u32>> = completions
        .iter()
        .map(|c| (0..c.len() as u32).collect())
        .collect();
    sum.score_batch(&prompts, completions, &ids, samples)
        .unwrap()
}

#[test]
fn a_trl_reward_function_runs_unchanged_as_a_command() {
    // TRL's documentation example, mixed by weight with a built-in function.
    let specs = [
        command_spec("examples", "reward_len", 30.0),
        RewardSpec::Gsm8kExact { weight: 0.5 },
    ];
    let sum = sum_of(&specs);
    assert_eq!(sum.names(), vec!["reward_len", "gsm8k_exact"]);
    let s = sample("a", "#### 7", &[]);
    let completions = ["7", "the answer is 7 and that is all"];
    let b = score(&sum, &completions, &[&s, &s]);
    let len = |c: &str| -(20.0 - c.len() as f64).abs();
    assert_eq!(
        b.totals,
        vec![
            Some(len(completions[0]) + 0.5),
            Some(len(completions[1]) + 0.5)
        ]
    );
    let m = b.metrics();
    assert_eq!(m["rewards/reward_len/failed"], Some(0.0));
    // A second batch through the same process.
    let b = score(&sum, &["x"], &[&s]);
    assert_eq!(b.totals, vec![Some(len("x"))]);
}

#[test]
fn ids_and_every_column_arrive_and_prints_do_not_break_the_protocol() {
    let sum = sum_of(&[command_spec("fixtures", "echo_columns", 30.0)]);
    let a = sample("a", "10", &[("extra", Value::from("keep"))]);
    let b = sample("b", "20", &[("extra", Value::from("skip"))]);
    let c = sample("c", "30", &[]);
    let got = score(&sum, &["abc", "de", "f"], &[&a, &b, &c]);
    // len(ids) + answer; the row marked "skip" is not applicable (None), not failed; the row
    // without the column gets null for it.
    assert_eq!(got.totals, vec![Some(13.0), None, Some(31.0)]);
    assert_eq!(got.per_func[0].failed, 0, "null is not a failure");
}

#[test]
fn a_wrong_count_an_exception_and_non_numbers_are_failures_not_zeros() {
    let s = sample("a", "1", &[]);
    let wrong = sum_of(&[command_spec("fixtures", "wrong_count", 30.0)]);
    let b = score(&wrong, &["x", "y"], &[&s, &s]);
    assert_eq!(b.totals, vec![None, None]);
    assert_eq!(b.failed(), 2);
    let e = &b.per_func[0].errors[0].1;
    assert!(e.contains("1 rewards for 2 completions"), "{e}");
    assert_eq!(b.metrics()["rewards/wrong_count/failed"], Some(2.0));
    let detail = b.unscored().expect("no completion has a reward");
    assert!(detail.contains("wrong_count: 2 failed"), "{detail}");

    let raises = sum_of(&[command_spec("fixtures", "raises", 30.0)]);
    let b = score(&raises, &["x"], &[&s]);
    assert_eq!(b.failed(), 1);
    let e = &b.per_func[0].errors[0].1;
    assert!(e.contains("KeyError: 'solution'"), "{e}");

    let numbers = sum_of(&[command_spec("fixtures", "not_numbers", 30.0)]);
    let b = score(&numbers, &["text", "ok", "nan"], &[&s, &s, &s]);
    assert_eq!(b.totals, vec![None, Some(1.0), None]);
    assert_eq!(b.failed(), 2);
    let errors: Vec<&str> = b.per_func[0].errors.iter().map(|e| e.1.as_str()).collect();
    assert!(errors[0].contains("\"'high'\", not a number"), "{errors:?}");
    assert!(errors[1].contains("\"nan\", not a number"), "{errors:?}");
    assert!(b.unscored().is_none(), "one completion has a reward");
}

#[test]
fn a_process_that_dies_is_started_again_and_the_batch_sent_once_more() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("crashed").display().to_string();
    let s = sample("a", "1", &[("marker", Value::from(marker.clone()))]);
    let sum = sum_of(&[command_spec("fixtures", "crash_once", 30.0)]);
    let b = score(&sum, &["x", "y"], &[&s, &s]);
    assert!(
        std::path::Path::new(&marker).exists(),
        "the first process ran"
    );
    assert_eq!(
        b.totals,
        vec![Some(2.0), Some(2.0)],
        "{:?}",
        b.per_func[0].errors
    );
}

#[test]
fn a_process_that_hangs_is_stopped_and_its_batch_failed_after_one_more_try() {
    let sum = sum_of(&[command_spec("fixtures", "hang", 1.0)]);
    let s = sample("a", "1", &[]);
    let started = Instant::now();
    let b = score(&sum, &["ok", "hang"], &[&s, &s]);
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(b.totals, vec![None, None]);
    let e = &b.per_func[0].errors[0].1;
    assert!(e.contains("did not answer within 1 s"), "{e}");
    assert!(e.contains("and the first time"), "tried twice: {e}");
    // The function is started again for the next batch, which it answers.
    let b = score(&sum, &["ok"], &[&s]);
    assert_eq!(b.totals, vec![Some(0.5)]);
}

#[test]
fn commands_that_do_not_start_or_do_not_greet_are_errors_before_training() {
    let missing = RewardSpec::Command {
        weight: 1.0,
        command: vec!["/nonexistent/reward-server".into()],
        label: None,
        timeout_s: 5.0,
    };
    let err = WeightedSum::from_specs(&[missing], None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("could not start \"/nonexistent/reward-server\""),
        "{err}"
    );
    let garbage = RewardSpec::Command {
        weight: 1.0,
        command: vec!["echo".into(), "hello".into()],
        label: None,
        timeout_s: 5.0,
    };
    let err = WeightedSum::from_specs(&[garbage], None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("printed \"hello\" instead of its greeting"),
        "{err}"
    );
    let silent = RewardSpec::Command {
        weight: 1.0,
        command: vec!["sleep".into(), "30".into()],
        label: None,
        timeout_s: 0.5,
    };
    let err = WeightedSum::from_specs(&[silent], None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("did not answer within 0.5 s"), "{err}");
    let empty = RewardSpec::Command {
        weight: 1.0,
        command: vec![],
        label: None,
        timeout_s: 5.0,
    };
    assert!(empty.validate().unwrap_err().contains("names no program"));
}

#[test]
fn the_same_function_behind_an_http_endpoint() {
    let mut child = Command::new("python3")
        .args([
            server(),
            function("examples", "short_in_tokens"),
            "--http".into(),
            "0".into(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs the example server");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    let spec = RewardSpec::Http {
        weight: 2.0,
        url,
        label: Some("short".into()),
        timeout_s: 30.0,
    };
    let sum = sum_of(&[spec]);
    let s = sample("a", "1", &[]);
    let b = score(&sum, &["abc", "a"], &[&s, &s]);
    assert_eq!(b.totals, vec![Some(2.0 / 4.0), Some(2.0 / 2.0)]);
    assert_eq!(sum.names(), vec!["short"]);
    let _ = child.kill();
    let _ = child.wait();
    // A dead endpoint: every completion fails, after one more try.
    let b = score(&sum, &["abc"], &[&s]);
    assert_eq!(b.totals, vec![None]);
    assert!(matches!(
        WeightedSum::from_specs(
            &[RewardSpec::Http {
                weight: 1.0,
                url: "localhost:80".into(),
                label: None,
                timeout_s: 1.0
            }],
            None
        ),
        Err(RewardError::External { .. })
    ));
}
