//! Reward functions outside fleet, written in any language: a command fleet starts once and
//! talks to over JSON lines ([`CommandReward`]), or an HTTP endpoint that takes the same body
//! ([`HttpReward`]). `examples/rewards/fleet_reward.py` serves an unchanged TRL-style Python
//! reward function either way.
//!
//! # Protocol
//!
//! One request per batch of completions, TRL's reward-function arguments as JSON: the lists
//! `prompts`, `completions` and `completion_ids`, and one list per other column of the dataset
//! rows (TRL's `**kwargs`; `null` where a row lacks the column):
//!
//! ```json
//! {"prompts": ["What is 6 x 7?", "..."], "completions": ["42", "..."], "completion_ids": [[19, 17], [...]], "answer": ["42", "..."], "id": ["q1", "..."]}
//! ```
//!
//! The reply: one reward per completion, a number or `null` (the function does not apply to
//! that completion, TRL's `None`), or an error for the whole batch:
//!
//! ```json
//! {"rewards": [1.0, 0.0, null]}
//! {"error": "KeyError: 'solution'"}
//! ```
//!
//! A command reads requests on its standard input, one line each, and answers each with one
//! line on its standard output; before the first request it prints a greeting,
//! `{"fleet_reward": 1, "name": "<function name>"}`, whose name becomes the metric key
//! `rewards/<name>/mean` unless the TOML gives `label`. Its standard error is its own (fleet
//! keeps the last lines to quote when it fails). An HTTP endpoint takes the request as the body
//! of a POST and answers with the reply as its body.
//!
//! # Failures
//!
//! Nothing is ever scored 0 in place of an answer. A command that does not start, does not
//! greet within the timeout, or greets with anything else is an error before training. During
//! training, a command that dies or does not answer within `timeout_s` is stopped, started again
//! and sent the batch once more (an endpoint that does not answer is asked once more); if that
//! fails too, or the reply is an error, not JSON, or holds another number of rewards than
//! completions, every completion of the batch fails for this function. A reward that is not a
//! number (a string, `NaN` written as text) fails that completion alone. Failed completions have
//! no reward: they are counted per function (`rewards/<name>/failed`) and left out of their
//! group's statistics (TRL's NaN), and a generation batch in which no completion has a reward
//! stops training with the first failure's message.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Map, Value};

use crate::rewards::{Completion, RewardError, RewardFunction};

/// The greeting's protocol version.
pub const PROTOCOL_VERSION: u64 = 1;

/// Lines of a command's standard error kept to quote when it fails.
const STDERR_LINES_KEPT: usize = 20;

/// The request body for `items` (module docs): TRL's reward-function arguments.
pub fn request_body(items: &[Completion<'_>]) -> Value {
    let mut body = Map::new();
    let list = |f: &dyn Fn(&Completion<'_>) -> Value| Value::Array(items.iter().map(f).collect());
    body.insert("prompts".into(), list(&|c| Value::from(c.prompt)));
    body.insert("completions".into(), list(&|c| Value::from(c.text)));
    body.insert(
        "completion_ids".into(),
        list(&|c| Value::from(c.ids.to_vec())),
    );
    // The rows' other columns, in the order they first appear; null where a row lacks one.
    let mut columns: Vec<&str> = Vec::new();
    for c in items {
        for key in c.sample.extra.keys() {
            if !columns.contains(&key.as_str()) && !body.contains_key(key.as_str()) {
                columns.push(key);
            }
        }
    }
    for key in columns {
        let values = list(&|c| c.sample.extra.get(key).cloned().unwrap_or(Value::Null));
        body.insert(key.to_string(), values);
    }
    Value::Object(body)
}

/// Reads a reply (module docs) for `n` completions: one outcome per completion, or the
/// batch's failure message.
fn read_reply(reply: &Value, n: usize) -> Result<Vec<Result<Option<f64>, String>>, String> {
    let Value::Object(obj) = reply else {
        return Err(format!(
            "replied {}, not an object with `rewards` or `error`",
            short(reply)
        ));
    };
    if let Some(e) = obj.get("error") {
        return Err(format!(
            "reported an error: {}",
            e.as_str().map_or_else(|| short(e), str::to_string)
        ));
    }
    let Some(Value::Array(rewards)) = obj.get("rewards") else {
        return Err(format!("replied {} without a `rewards` list", short(reply)));
    };
    if rewards.len() != n {
        return Err(format!(
            "returned {} rewards for {n} completions (one per completion, in order)",
            rewards.len()
        ));
    }
    Ok(rewards
        .iter()
        .map(|r| match r {
            Value::Null => Ok(None),
            Value::Number(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| format!("returned {x}, not a number")),
            other => Err(format!(
                "returned {}, not a number (null when the function does not apply)",
                short(other)
            )),
        })
        .collect())
}

/// `v` as JSON, cut at 200 characters.
fn short(v: &Value) -> String {
    cut(&v.to_string())
}

/// A reward function run as a command that fleet starts once (module docs).
pub struct CommandReward {
    name: String,
    argv: Vec<String>,
    timeout: Duration,
    process: Mutex<Option<RewardProcess>>,
}

/// A running reward command: its input, its output lines (read by a thread) and its last
/// lines of standard error.
struct RewardProcess {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    stderr: Arc<Mutex<VecDeque<String>>>,
}

impl Drop for RewardProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl RewardProcess {
    /// Starts `argv` and reads its greeting: the function's name.
    fn start(argv: &[String], timeout: Duration) -> Result<(RewardProcess, String), String> {
        let (program, args) = argv
            .split_first()
            .ok_or("`command` is empty: give the program and its arguments")?;
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                format!(
                    "could not start {program:?}: {e}; check the path and that it is executable"
                )
            })?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let stderr_pipe = child.stderr.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let kept = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr_pipe).lines().map_while(Result::ok) {
                tracing::debug!(target: "fleet_gspo::external", "{line}");
                let mut k = kept.lock().unwrap_or_else(|e| e.into_inner());
                if k.len() == STDERR_LINES_KEPT {
                    k.pop_front();
                }
                k.push_back(line);
            }
        });
        let mut process = RewardProcess {
            child,
            stdin,
            lines,
            stderr,
        };
        let greeting = process.line(timeout).map_err(|e| {
            format!("{e} instead of its greeting {{\"fleet_reward\": {PROTOCOL_VERSION}, \"name\": ...}}")
        })?;
        let name = match serde_json::from_str::<Value>(&greeting) {
            Ok(Value::Object(g)) if g.get("fleet_reward") == Some(&Value::from(PROTOCOL_VERSION)) => {
                match g.get("name").and_then(Value::as_str) {
                    Some(n) if !n.trim().is_empty() => n.trim().to_string(),
                    _ => return Err(format!("greeted with {greeting:?}: `name` must be a non-empty string")),
                }
            }
            _ => {
                return Err(format!(
                    "printed {:?} instead of its greeting {{\"fleet_reward\": {PROTOCOL_VERSION}, \"name\": ...}} \
                     (the protocol owns standard output: print logs to standard error)",
                    cut(&greeting)
                ))
            }
        };
        Ok((process, name))
    }

    /// The next line of its output within `timeout`.
    fn line(&mut self, timeout: Duration) -> Result<String, String> {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => Ok(l),
            Err(RecvTimeoutError::Timeout) => Err(format!(
                "did not answer within {} s (timeout_s){}",
                timeout.as_secs_f64(),
                self.stderr_tail()
            )),
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                Err(format!("ended ({status}){}", self.stderr_tail()))
            }
        }
    }

    /// One request and its reply.
    fn exchange(&mut self, body: &str, timeout: Duration) -> Result<Value, String> {
        writeln!(self.stdin, "{body}")
            .and_then(|_| self.stdin.flush())
            .map_err(|e| format!("could not be written to ({e}){}", self.stderr_tail()))?;
        let line = self.line(timeout)?;
        serde_json::from_str(&line).map_err(|e| {
            format!(
                "answered {:?}, not JSON ({e}; the protocol owns standard output: print logs to \
                 standard error)",
                cut(&line)
            )
        })
    }

    fn stderr_tail(&self) -> String {
        let k = self.stderr.lock().unwrap_or_else(|e| e.into_inner());
        if k.is_empty() {
            String::new()
        } else {
            let lines: Vec<&str> = k.iter().map(String::as_str).collect();
            format!("; its last standard error lines:\n{}", lines.join("\n"))
        }
    }
}

/// `s` cut at 200 characters.
fn cut(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

impl CommandReward {
    /// Starts `argv` and reads its greeting; `label` (else the greeting's name) is the metric
    /// name. Fails, naming the command, when it does not start or greet within `timeout`.
    pub fn start(
        argv: Vec<String>,
        label: Option<String>,
        timeout: Duration,
    ) -> Result<Self, RewardError> {
        let (process, greeted) =
            RewardProcess::start(&argv, timeout).map_err(|message| RewardError::External {
                function: label.clone().unwrap_or_else(|| "command".into()),
                source_desc: argv.join(" "),
                message,
            })?;
        Ok(CommandReward {
            name: label.unwrap_or(greeted),
            argv,
            timeout,
            process: Mutex::new(Some(process)),
        })
    }

    fn error(&self, message: String) -> RewardError {
        RewardError::External {
            function: self.name.clone(),
            source_desc: self.argv.join(" "),
            message,
        }
    }

    /// Sends `body`, starting the command again first when it is not running.
    fn attempt(&self, slot: &mut Option<RewardProcess>, body: &str) -> Result<Value, String> {
        if slot.is_none() {
            let (p, _) = RewardProcess::start(&self.argv, self.timeout)
                .map_err(|e| format!("could not be started again: {e}"))?;
            *slot = Some(p);
        }
        let process = slot.as_mut().expect("started above");
        let reply = process.exchange(body, self.timeout);
        if reply.is_err() {
            // Dead or stuck: stopped now, started again on the next attempt.
            *slot = None;
        }
        reply
    }
}

impl RewardFunction for CommandReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(
        &self,
        prompt: &str,
        completion: &str,
        sample: &crate::dataset::Sample,
    ) -> Result<Option<f64>, RewardError> {
        crate::rewards::score_one_via_batch(self, prompt, completion, sample)
    }

    fn score_many(&self, items: &[Completion<'_>]) -> Vec<Result<Option<f64>, RewardError>> {
        let body = request_body(items).to_string();
        let mut slot = self.process.lock().unwrap_or_else(|e| e.into_inner());
        let reply = twice(
            || self.attempt(&mut slot, &body),
            |first| {
                tracing::warn!(
                    "reward function {} {first}; starting it again and sending the batch once \
                     more",
                    self.name
                )
            },
        );
        outcomes(reply, items.len(), |m| self.error(m))
    }
}

/// `attempt`, and once more when it fails (`again` hears the first failure): a failed second
/// try's message quotes the first.
fn twice(
    mut attempt: impl FnMut() -> Result<Value, String>,
    again: impl FnOnce(&str),
) -> Result<Value, String> {
    attempt().or_else(|first| {
        again(&first);
        attempt().map_err(|second| format!("{second} (and the first time: {first})"))
    })
}

/// One outcome per completion from a reply, or the batch's failure for every completion.
fn outcomes(
    reply: Result<Value, String>,
    n: usize,
    error: impl Fn(String) -> RewardError,
) -> Vec<Result<Option<f64>, RewardError>> {
    match reply.and_then(|r| read_reply(&r, n)) {
        Ok(values) => values
            .into_iter()
            .enumerate()
            .map(|(i, v)| v.map_err(|m| error(format!("completion {i} of the batch: {m}"))))
            .collect(),
        Err(m) => (0..n).map(|_| Err(error(m.clone()))).collect(),
    }
}

/// A reward function behind an HTTP endpoint: each batch is POSTed as the request body (module
/// docs).
pub struct HttpReward {
    name: String,
    url: String,
    agent: ureq::Agent,
}

impl HttpReward {
    /// A function named `label` (default `http`) that POSTs to `url`, waiting at most
    /// `timeout` for each answer.
    pub fn new(url: String, label: Option<String>, timeout: Duration) -> Result<Self, RewardError> {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(RewardError::External {
                function: label.unwrap_or_else(|| "http".into()),
                source_desc: url.clone(),
                message: format!("url = {url:?} must start with http:// or https://"),
            });
        }
        Ok(HttpReward {
            name: label.unwrap_or_else(|| "http".into()),
            url,
            agent: ureq::AgentBuilder::new().timeout(timeout).build(),
        })
    }

    fn post(&self, body: &Value) -> Result<Value, String> {
        match self.agent.post(&self.url).send_json(body) {
            Ok(response) => response
                .into_json::<Value>()
                .map_err(|e| format!("answered with a body that is not JSON ({e})")),
            Err(ureq::Error::Status(code, response)) => Err(format!(
                "answered HTTP {code}: {}",
                cut(&response.into_string().unwrap_or_default())
            )),
            Err(e) => Err(format!("could not be reached: {e}")),
        }
    }
}

impl RewardFunction for HttpReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(
        &self,
        prompt: &str,
        completion: &str,
        sample: &crate::dataset::Sample,
    ) -> Result<Option<f64>, RewardError> {
        crate::rewards::score_one_via_batch(self, prompt, completion, sample)
    }

    fn score_many(&self, items: &[Completion<'_>]) -> Vec<Result<Option<f64>, RewardError>> {
        let body = request_body(items);
        let reply = twice(
            || self.post(&body),
            |first| tracing::warn!("reward endpoint {} {first}; asking once more", self.url),
        );
        outcomes(reply, items.len(), |message| RewardError::External {
            function: self.name.clone(),
            source_desc: self.url.clone(),
            message,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::Sample;

    #[test]
    fn the_request_holds_trls_arguments_and_every_column() {
        let mut a = Sample::text("a", "Q1", "1");
        a.extra.insert("answer".into(), Value::from("1"));
        a.extra.insert("solution".into(), Value::from("x = 1"));
        let mut b = Sample::text("b", "Q2", "2");
        b.extra.insert("answer".into(), Value::from(2));
        let items = [
            Completion {
                prompt: "Q1",
                text: "one",
                ids: &[5, 6],
                sample: &a,
            },
            Completion {
                prompt: "Q2",
                text: "two",
                ids: &[7],
                sample: &b,
            },
        ];
        let body = request_body(&items);
        assert_eq!(
            body.to_string(),
            r#"{"prompts":["Q1","Q2"],"completions":["one","two"],"completion_ids":[[5,6],[7]],"answer":["1",2],"solution":["x = 1",null]}"#
        );
    }

    #[test]
    fn replies_are_read_strictly() {
        let ok = serde_json::json!({"rewards": [1.0, null, 0]});
        let got = read_reply(&ok, 3).unwrap();
        assert_eq!(got, vec![Ok(Some(1.0)), Ok(None), Ok(Some(0.0))]);
        let text = serde_json::json!({"rewards": [1.0, "nan"]});
        let got = read_reply(&text, 2).unwrap();
        assert!(got[1]
            .as_ref()
            .unwrap_err()
            .contains("\"nan\", not a number"));
        let count = read_reply(&serde_json::json!({"rewards": [1.0]}), 2).unwrap_err();
        assert!(count.contains("1 rewards for 2 completions"), "{count}");
        let err = read_reply(&serde_json::json!({"error": "KeyError: 'x'"}), 2).unwrap_err();
        assert!(err.contains("KeyError: 'x'"), "{err}");
        assert!(read_reply(&serde_json::json!([1.0]), 1).is_err());
    }
}
