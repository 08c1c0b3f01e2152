//! Prompt datasets from JSON Lines, the per-epoch order, and the data cursor a checkpoint saves.
//!
//! # Format
//!
//! One JSON object per line:
//!
//! ```json
//! {"id": "q1", "prompt": "What is 6 x 7?", "answer": "42"}
//! {"prompt": [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "6 x 7?"}], "answer": 42}
//! {"question": "Natalia sold clips to 48 friends ...", "answer": "Natalia sold 48/2 = 24 ... #### 72"}
//! {"prompt": "Which unit hosts the RLC?", "options": ["O-RU", "O-DU", "O-CU"], "answer": "B"}
//! ```
//!
//! - `prompt`: a string, or a list of chat messages `{role, content}` (other message fields are
//!   kept for the chat template). Without `prompt`, GSM8K's `question` is the prompt (a line with
//!   both uses `prompt`).
//! - `answer`: a string or a number (kept as its JSON text). For GSM8K it is the whole
//!   solution ending in `#### <number>`; the reward function reads the number
//!   ([`crate::rewards`]). Required (a row without it is skipped) unless the dataset is loaded
//!   for reward functions that read none ([`load_prompts_with`]: gspo-train does so when no
//!   `gsm8k_exact` or `multiple_choice` is configured).
//! - `options` (optional, multiple choice): 2 to 6 non-empty strings. The answer must then name
//!   exactly one option, read by fleet-data's answer parser: a 1-based number, a letter, or the
//!   option's text ([`Sample::correct_option`]).
//! - `id` (optional, string or integer, unique): default `<file stem>-<line, 6 digits>`.
//!
//! Other fields are kept as written in [`Sample::extra`] (with `answer`, `options` and `id`):
//! external reward functions receive them, as TRL passes a dataset's columns.
//!
//! # What is skipped
//!
//! As in ARGO's loaders, a line that cannot be used is skipped, counted by
//! [`SkipReason`] and remembered with its line number (at most
//! [`MAX_EXAMPLES_PER_REASON`] per reason, counts exact) in the [`LoadReport`]. Checked in this
//! order: blank lines are not items (counted apart); malformed JSON or invalid UTF-8; not an
//! object or a field of the wrong type; no prompt; an empty prompt; no answer; an empty answer;
//! bad options; an answer that names no single option; a repeated id. A file with no usable
//! line is an error.
//!
//! # Order and cursor
//!
//! [`PromptSampler`] hands out the prompts of each generation batch. Each epoch is a permutation
//! of the dataset ([`epoch_order`]: Fisher-Yates driven by ChaCha20 seeded from `(seed, epoch)`,
//! with our own bounded sampling, so the order is the same on every machine and every `rand`
//! version); a last batch that would not be full is dropped, as TRL's `RepeatSampler` does, and
//! the next epoch starts. [`DataCursor`] (epoch, position) is all a checkpoint needs to resume
//! the exact same sequence of batches.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use fleet_data::answer::{parse_answer_with_options, MAX_OPTIONS, MIN_OPTIONS};
use fleet_data::jsonl::{json_kind, JsonlLine};
pub use fleet_data::{SourceLocation, MAX_EXAMPLES_PER_REASON};
use fleet_models::ChatMessage;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Errors of loading a prompt dataset and of the sampler. Each names the file or value at
/// fault and what to do.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The file does not exist.
    #[error("prompt dataset {} not found: check the path (relative paths start at the current directory)", path.display())]
    MissingFile {
        /// The path.
        path: PathBuf,
    },
    /// The file exists but cannot be read.
    #[error("cannot read prompt dataset {}: {source}; check its permissions", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Every line was blank or skipped.
    #[error("no usable prompts in {}: {summary}; expected {EXPECTED}", path.display())]
    NoPrompts {
        /// The file.
        path: PathBuf,
        /// What was skipped, with line numbers.
        summary: String,
    },
    /// A batch size of zero was asked for.
    #[error("a batch of 0 prompts was asked for: prompts per generation batch must be at least 1")]
    ZeroBatch,
    /// A batch larger than the dataset.
    #[error(
        "a generation batch needs {batch} distinct prompts but the dataset has {len}: lower \
         per_device_train_batch_size x steps_per_generation / num_generations, or use more prompts"
    )]
    BatchLargerThanDataset {
        /// Prompts per batch.
        batch: usize,
        /// Prompts in the dataset.
        len: usize,
    },
    /// A saved cursor that does not fit this dataset.
    #[error(
        "data cursor position {position} is past the end of the dataset ({len} prompts): the \
         checkpoint was made with another dataset; resume with the same dataset or start over"
    )]
    CursorOutOfRange {
        /// The saved position.
        position: usize,
        /// Prompts in the dataset.
        len: usize,
    },
    /// An empty dataset given to the sampler.
    #[error("the sampler got an empty dataset: load at least one prompt")]
    EmptyDataset,
}

/// The accepted format, for error messages.
const EXPECTED: &str = "JSON Lines, one object per line: {\"prompt\": \"...\" or [{\"role\": \
                        \"user\", \"content\": \"...\"}], \"answer\": \"...\"} (or GSM8K's \
                        {\"question\": ..., \"answer\": \"... #### 42\"}), optional \"options\" \
                        and \"id\"";

/// A prompt: plain text, or chat messages for the chat template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Plain text (rendered as one user message when a chat template is used).
    Text(String),
    /// Chat messages in order.
    Chat(Vec<ChatMessage>),
}

impl Prompt {
    /// The messages for a chat template: a text prompt becomes one `user` message.
    pub fn messages(&self) -> Vec<ChatMessage> {
        match self {
            Prompt::Text(t) => vec![ChatMessage::new("user", t.clone())],
            Prompt::Chat(m) => m.clone(),
        }
    }

    /// The text of the prompt's last user message (the whole text for a text prompt): what a
    /// reward function that needs "the question" reads.
    pub fn question_text(&self) -> &str {
        match self {
            Prompt::Text(t) => t,
            Prompt::Chat(m) => m
                .iter()
                .rev()
                .find(|m| m.role == "user")
                .or(m.last())
                .map_or("", |m| m.content.as_str()),
        }
    }
}

/// One prompt of the dataset with what the reward functions need.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Unique id (the file's `id`, or `<stem>-<line>`).
    pub id: String,
    /// The prompt.
    pub prompt: Prompt,
    /// The reference answer as written (a JSON number is kept as its text); `None` for a row
    /// without one, which only a dataset loaded for reward functions that need no answer keeps
    /// ([`load_prompts_with`]).
    pub answer: Option<String>,
    /// Multiple-choice options, without labels, when the line has them.
    pub options: Option<Vec<String>>,
    /// The correct option (0-based) when `options` is set.
    pub correct_option: Option<usize>,
    /// File and line.
    pub source: SourceLocation,
    /// Every field of the line but the prompt (`prompt`, or `question` when it is the prompt),
    /// as written: what an external reward function receives beside the prompts and
    /// completions, as TRL passes a dataset's other columns to its reward functions.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, Value>,
}

impl Sample {
    /// A text-prompt sample with no options (tests, programmatic datasets).
    pub fn text(id: &str, prompt: &str, answer: &str) -> Sample {
        Sample {
            id: id.to_string(),
            prompt: Prompt::Text(prompt.to_string()),
            answer: Some(answer.to_string()),
            options: None,
            correct_option: None,
            source: SourceLocation {
                file: PathBuf::from("<memory>"),
                line: 0,
            },
            extra: serde_json::Map::new(),
        }
    }
}

/// Why a line was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// Not valid JSON, or not valid UTF-8.
    MalformedJson,
    /// Valid JSON of the wrong shape: not an object, or a field of the wrong type.
    BadFormat,
    /// Neither `prompt` nor `question`.
    MissingPrompt,
    /// An empty prompt text or message list.
    EmptyPrompt,
    /// No `answer`.
    MissingAnswer,
    /// An empty answer.
    EmptyAnswer,
    /// `options` that are not 2 to 6 non-empty strings.
    BadOptions,
    /// With options: an answer that names no single option.
    AnswerNotAnOption,
    /// An id used by an earlier line.
    DuplicateId,
}

impl SkipReason {
    /// Short human name, as used in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::MalformedJson => "malformed JSON",
            SkipReason::BadFormat => "wrong format",
            SkipReason::MissingPrompt => "no prompt",
            SkipReason::EmptyPrompt => "empty prompt",
            SkipReason::MissingAnswer => "no answer",
            SkipReason::EmptyAnswer => "empty answer",
            SkipReason::BadOptions => "bad options",
            SkipReason::AnswerNotAnOption => "answer names no option",
            SkipReason::DuplicateId => "duplicate id",
        }
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One skipped line of the dataset.
pub type SkippedLine = fleet_data::jsonl::SkippedLine<SkipReason>;

/// What a load read and skipped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReport {
    /// The file.
    pub path: PathBuf,
    /// Lines in the file (a final line without a newline counts).
    pub lines: usize,
    /// Blank lines (not items, not skipped).
    pub blank_lines: usize,
    /// Prompts loaded.
    pub loaded: usize,
    /// Loaded prompts that are chat messages.
    pub chat_prompts: usize,
    /// Loaded prompts with multiple-choice options.
    pub with_options: usize,
    /// Skipped lines by reason (zero counts absent).
    pub skipped: BTreeMap<SkipReason, usize>,
    /// Skipped lines in file order, at most [`MAX_EXAMPLES_PER_REASON`] per reason.
    pub skipped_lines: Vec<SkippedLine>,
}

impl LoadReport {
    fn new(path: &Path) -> Self {
        LoadReport {
            path: path.to_path_buf(),
            lines: 0,
            blank_lines: 0,
            loaded: 0,
            chat_prompts: 0,
            with_options: 0,
            skipped: BTreeMap::new(),
            skipped_lines: Vec::new(),
        }
    }

    /// Total lines skipped.
    pub fn skipped_total(&self) -> usize {
        self.skipped.values().sum()
    }

    /// Count of one reason (0 if none).
    pub fn skipped_for(&self, reason: SkipReason) -> usize {
        self.skipped.get(&reason).copied().unwrap_or(0)
    }

    fn skip(&mut self, line: usize, reason: SkipReason, detail: String) {
        let count = self.skipped.entry(reason).or_insert(0);
        *count += 1;
        if *count <= MAX_EXAMPLES_PER_REASON {
            self.skipped_lines.push(SkippedLine {
                line,
                reason,
                detail,
            });
        }
    }

    /// One clause per reason: `2 no answer (lines 3, 9; line 3: ...)`.
    fn summary(&self) -> String {
        if self.skipped.is_empty() {
            return format!("{} blank lines, nothing else", self.blank_lines);
        }
        self.skipped
            .iter()
            .map(|(reason, n)| {
                let of_reason: Vec<&SkippedLine> = self
                    .skipped_lines
                    .iter()
                    .filter(|s| s.reason == *reason)
                    .collect();
                let mut lines: Vec<String> = of_reason
                    .iter()
                    .take(3)
                    .map(|s| s.line.to_string())
                    .collect();
                if *n > 3 {
                    lines.push("...".into());
                }
                match of_reason.first() {
                    Some(first) if !first.detail.is_empty() => format!(
                        "{n} {reason} (line{} {}; line {}: {})",
                        if *n == 1 { "" } else { "s" },
                        lines.join(", "),
                        first.line,
                        first.detail
                    ),
                    _ => format!(
                        "{n} {reason} (line{} {})",
                        if *n == 1 { "" } else { "s" },
                        lines.join(", ")
                    ),
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} lines, {} prompts loaded ({} chat, {} multiple choice), {} skipped",
            self.path.display(),
            self.lines,
            self.loaded,
            self.chat_prompts,
            self.with_options,
            self.skipped_total()
        )?;
        if self.blank_lines > 0 {
            write!(f, ", {} blank", self.blank_lines)?;
        }
        if !self.skipped.is_empty() {
            write!(f, ": {}", self.summary())?;
        }
        Ok(())
    }
}

/// Loaded prompts and the report of what was skipped.
#[derive(Debug, Clone)]
pub struct PromptDataset {
    /// Prompts in file order.
    pub samples: Vec<Sample>,
    /// What was loaded and skipped.
    pub report: LoadReport,
}

impl PromptDataset {
    /// Number of prompts.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// True when there are no prompts (a loaded dataset never is).
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// Loads a prompt dataset (format in the module docs). Fails if the file is missing or
/// unreadable or has no usable line; bad lines are skipped and reported.
pub fn load_prompts(path: &Path) -> Result<PromptDataset, DatasetError> {
    load_prompts_with(path, true)
}

/// [`load_prompts`], with `require_answer` false for reward functions that read no `answer`
/// (a row without one is then kept, [`Sample::answer`] `None`, instead of skipped as
/// [`SkipReason::MissingAnswer`]).
pub fn load_prompts_with(path: &Path, require_answer: bool) -> Result<PromptDataset, DatasetError> {
    let bytes = std::fs::read(path).map_err(|source| {
        if source.kind() == io::ErrorKind::NotFound {
            DatasetError::MissingFile {
                path: path.to_path_buf(),
            }
        } else {
            DatasetError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "prompt".to_string());
    let mut report = LoadReport::new(path);
    let mut samples = Vec::new();
    let mut ids: HashMap<String, usize> = HashMap::new();
    let raw_lines = fleet_data::jsonl::split_lines(&bytes);
    report.lines = raw_lines.len();
    for (i, raw) in raw_lines.into_iter().enumerate() {
        let line = i + 1;
        let value: Value = match fleet_data::jsonl::parse_line(line, raw) {
            JsonlLine::Value(v) => v,
            JsonlLine::Blank => {
                report.blank_lines += 1;
                continue;
            }
            JsonlLine::Malformed(why) => {
                report.skip(line, SkipReason::MalformedJson, why);
                continue;
            }
        };
        let source = SourceLocation {
            file: path.to_path_buf(),
            line,
        };
        match parse_line(&stem, value, source, require_answer) {
            Ok(sample) => {
                if let Some(first) = ids.get(&sample.id) {
                    report.skip(
                        line,
                        SkipReason::DuplicateId,
                        format!("id {:?} already used at line {first}", sample.id),
                    );
                    continue;
                }
                ids.insert(sample.id.clone(), line);
                report.loaded += 1;
                if matches!(sample.prompt, Prompt::Chat(_)) {
                    report.chat_prompts += 1;
                }
                if sample.options.is_some() {
                    report.with_options += 1;
                }
                samples.push(sample);
            }
            Err((reason, detail)) => report.skip(line, reason, detail),
        }
    }
    if samples.is_empty() {
        return Err(DatasetError::NoPrompts {
            path: path.to_path_buf(),
            summary: report.summary(),
        });
    }
    Ok(PromptDataset { samples, report })
}

type Skip = (SkipReason, String);

fn bad_format(detail: impl Into<String>) -> Skip {
    (SkipReason::BadFormat, detail.into())
}

fn parse_line(
    stem: &str,
    value: Value,
    source: SourceLocation,
    require_answer: bool,
) -> Result<Sample, Skip> {
    let Value::Object(mut obj) = value else {
        return Err(bad_format("expected a JSON object"));
    };
    // The row as written, for external reward functions (the prompt taken out below).
    let mut extra = obj.clone();
    let id = match obj.remove("id") {
        None | Some(Value::Null) => format!("{stem}-{:06}", source.line),
        Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_string(),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
        Some(other) => {
            return Err(bad_format(format!(
                "`id` must be a non-empty string or an integer, got {other}"
            )))
        }
    };
    let prompt_field = if obj.contains_key("prompt") {
        "prompt"
    } else {
        "question"
    };
    // shift_remove keeps the other fields in the file's order.
    extra.shift_remove(prompt_field);
    let prompt = match obj.remove(prompt_field) {
        None | Some(Value::Null) => {
            return Err((
                SkipReason::MissingPrompt,
                "needs `prompt` (or GSM8K's `question`)".to_string(),
            ))
        }
        Some(Value::String(s)) => {
            if s.trim().is_empty() {
                return Err((
                    SkipReason::EmptyPrompt,
                    format!("`{prompt_field}` is empty"),
                ));
            }
            Prompt::Text(s)
        }
        Some(v @ Value::Array(_)) if prompt_field == "prompt" => {
            let messages: Vec<ChatMessage> = serde_json::from_value(v).map_err(|e| {
                bad_format(format!(
                    "`prompt` list must hold {{\"role\": ..., \"content\": \"...\"}} messages: {e}"
                ))
            })?;
            if messages.is_empty() || messages.iter().all(|m| m.content.trim().is_empty()) {
                return Err((
                    SkipReason::EmptyPrompt,
                    "no message has content".to_string(),
                ));
            }
            Prompt::Chat(messages)
        }
        Some(other) => {
            return Err(bad_format(format!(
                "`{prompt_field}` must be a string{}, got {}",
                if prompt_field == "prompt" {
                    " or a list of chat messages"
                } else {
                    ""
                },
                json_kind(&other)
            )))
        }
    };
    let answer = match obj.remove("answer") {
        None | Some(Value::Null) if !require_answer => None,
        None | Some(Value::Null) => {
            return Err((SkipReason::MissingAnswer, "needs `answer`".to_string()))
        }
        Some(Value::String(s)) => Some(s),
        Some(Value::Number(n)) => Some(n.to_string()),
        Some(other) => {
            return Err(bad_format(format!(
                "`answer` must be a string or a number, got {}",
                json_kind(&other)
            )))
        }
    };
    if answer.as_ref().is_some_and(|a| a.trim().is_empty()) {
        return Err((SkipReason::EmptyAnswer, String::new()));
    }
    let (options, correct_option) = match obj.remove("options") {
        None | Some(Value::Null) => (None, None),
        Some(Value::Array(items)) => {
            let n = items.len();
            if !(MIN_OPTIONS..=MAX_OPTIONS).contains(&n) {
                return Err((
                    SkipReason::BadOptions,
                    format!("{n} options, need {MIN_OPTIONS} to {MAX_OPTIONS}"),
                ));
            }
            let mut options = Vec::with_capacity(n);
            for (i, item) in items.into_iter().enumerate() {
                match item {
                    Value::String(s) if !s.trim().is_empty() => options.push(s.trim().to_string()),
                    other => {
                        return Err((
                            SkipReason::BadOptions,
                            format!(
                                "option {} must be a non-empty string, got {}",
                                i + 1,
                                json_kind(&other)
                            ),
                        ))
                    }
                }
            }
            // Without an answer (allowed only when no reward function reads one) the options
            // are kept with no correct one.
            let Some(answer) = &answer else {
                return Ok(Sample {
                    id,
                    prompt,
                    answer: None,
                    options: Some(options),
                    correct_option: None,
                    source,
                    extra,
                });
            };
            let parsed = parse_answer_with_options(answer.trim(), &options);
            match parsed.index() {
                Some(i) => (Some(options), Some(i)),
                None => {
                    return Err((
                        SkipReason::AnswerNotAnOption,
                        format!(
                            "answer {:?} is not a 1-based number, a letter or one option's text \
                             ({parsed})",
                            answer
                        ),
                    ))
                }
            }
        }
        Some(other) => {
            return Err((
                SkipReason::BadOptions,
                format!(
                    "`options` must be a list of strings, got {}",
                    json_kind(&other)
                ),
            ))
        }
    };
    Ok(Sample {
        id,
        prompt,
        answer,
        options,
        correct_option,
        source,
        extra,
    })
}

/// The order of `len` prompts in `epoch` under `seed`: a Fisher-Yates shuffle driven by
/// ChaCha20 keyed by `(seed, epoch)`. Fixed forever (changing it changes every seeded run).
pub fn epoch_order(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    key[16..32].copy_from_slice(b"fleet-gspo/order");
    let mut rng = ChaCha20Rng::from_seed(key);
    let mut order: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        let j = below(&mut rng, i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// Uniform in `0..n` (n >= 1) by rejection: no modulo bias, no dependence on `rand`'s
/// range-sampling algorithm.
fn below(rng: &mut ChaCha20Rng, n: u64) -> u64 {
    let limit = (u64::MAX / n) * n;
    loop {
        let x = rng.next_u64();
        if x < limit {
            return x % n;
        }
    }
}

/// Where the sampler is: the epoch and the next position in that epoch's order. Saved in
/// checkpoints; [`PromptSampler::resume`] continues from it exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DataCursor {
    /// 0-based epoch.
    pub epoch: u64,
    /// Prompts of this epoch already handed out.
    pub position: usize,
}

/// One generation batch of prompts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptBatch {
    /// The epoch the batch belongs to.
    pub epoch: u64,
    /// Indices into the dataset's samples, in order.
    pub indices: Vec<usize>,
}

/// Hands out generation batches of prompt indices, epoch after epoch (see the module docs).
#[derive(Debug, Clone)]
pub struct PromptSampler {
    len: usize,
    seed: u64,
    shuffle: bool,
    cursor: DataCursor,
    order: Vec<usize>,
}

impl PromptSampler {
    /// A sampler over `len` prompts at the start of epoch 0. `shuffle` false keeps file order
    /// (TRL `shuffle_dataset`).
    pub fn new(len: usize, seed: u64, shuffle: bool) -> Result<Self, DatasetError> {
        Self::resume(len, seed, shuffle, DataCursor::default())
    }

    /// A sampler continuing from a saved cursor (same `len`, `seed` and `shuffle` as the run
    /// that saved it).
    pub fn resume(
        len: usize,
        seed: u64,
        shuffle: bool,
        cursor: DataCursor,
    ) -> Result<Self, DatasetError> {
        if len == 0 {
            return Err(DatasetError::EmptyDataset);
        }
        if cursor.position > len {
            return Err(DatasetError::CursorOutOfRange {
                position: cursor.position,
                len,
            });
        }
        let order = Self::order_for(len, seed, shuffle, cursor.epoch);
        Ok(PromptSampler {
            len,
            seed,
            shuffle,
            cursor,
            order,
        })
    }

    fn order_for(len: usize, seed: u64, shuffle: bool, epoch: u64) -> Vec<usize> {
        if shuffle {
            epoch_order(len, seed, epoch)
        } else {
            (0..len).collect()
        }
    }

    /// The next `n` prompts. When fewer than `n` are left in this epoch they are dropped and
    /// the batch comes from the next epoch.
    pub fn next_batch(&mut self, n: usize) -> Result<PromptBatch, DatasetError> {
        if n == 0 {
            return Err(DatasetError::ZeroBatch);
        }
        if n > self.len {
            return Err(DatasetError::BatchLargerThanDataset {
                batch: n,
                len: self.len,
            });
        }
        if self.cursor.position + n > self.len {
            self.cursor = DataCursor {
                epoch: self.cursor.epoch + 1,
                position: 0,
            };
            self.order = Self::order_for(self.len, self.seed, self.shuffle, self.cursor.epoch);
        }
        let start = self.cursor.position;
        self.cursor.position += n;
        Ok(PromptBatch {
            epoch: self.cursor.epoch,
            indices: self.order[start..start + n].to_vec(),
        })
    }

    /// The cursor to save.
    pub fn cursor(&self) -> DataCursor {
        self.cursor
    }

    /// Fractional epoch for metrics: `epoch + position / len`.
    pub fn epoch_progress(&self) -> f64 {
        self.cursor.epoch as f64 + self.cursor.position as f64 / self.len as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("prompts.jsonl");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn reads_text_chat_gsm8k_and_multiple_choice_lines() {
        let text = concat!(
            "{\"id\": \"a\", \"prompt\": \"6 x 7?\", \"answer\": \"42\"}\n",
            "{\"prompt\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"2+2?\"}], \"answer\": 4}\n",
            "{\"question\": \"Natalia sold 48 clips ...\", \"answer\": \"48/2 = 24 ... #### 72\"}\n",
            "{\"id\": 7, \"prompt\": \"Which?\", \"options\": [\"O-RU\", \"O-DU\", \"O-CU\"], \"answer\": \"B\"}\n",
            "\n",
        );
        let (_d, path) = write(text);
        let ds = load_prompts(&path).unwrap();
        assert_eq!(ds.len(), 4);
        assert_eq!(ds.report.blank_lines, 1);
        assert_eq!(ds.report.chat_prompts, 1);
        assert_eq!(ds.report.with_options, 1);
        let s = &ds.samples;
        assert_eq!(s[0].id, "a");
        assert_eq!(s[1].id, "prompts-000002");
        assert_eq!(s[1].answer.as_deref(), Some("4"));
        assert_eq!(s[1].prompt.question_text(), "2+2?");
        assert_eq!(s[1].prompt.messages().len(), 2);
        assert_eq!(
            s[2].prompt,
            Prompt::Text("Natalia sold 48 clips ...".into())
        );
        assert!(s[2].answer.as_ref().unwrap().ends_with("#### 72"));
        assert_eq!(s[3].id, "7");
        assert_eq!(s[3].correct_option, Some(1));
        assert_eq!(s[3].source.line, 4);
    }

    /// For functions that read no answer, rows without one are kept, and every field but the
    /// prompt reaches [`Sample::extra`] as written; with the answer required they are skipped.
    #[test]
    fn rows_without_an_answer_are_kept_when_no_function_reads_one() {
        let text = concat!(
            "{\"prompt\": \"q1\", \"solution\": \"x = 1\", \"level\": 3}\n",
            "{\"id\": \"b\", \"prompt\": \"q2\", \"answer\": 2, \"options\": [\"a\", \"b\"]}\n",
            "{\"prompt\": \"q3\", \"options\": [\"a\", \"b\"]}\n",
        );
        let (_d, path) = write(text);
        let ds = load_prompts_with(&path, false).unwrap();
        assert_eq!(ds.len(), 3);
        let s = &ds.samples;
        assert_eq!(s[0].answer, None);
        assert_eq!(
            serde_json::Value::Object(s[0].extra.clone()).to_string(),
            r#"{"solution":"x = 1","level":3}"#
        );
        assert_eq!(
            serde_json::Value::Object(s[1].extra.clone()).to_string(),
            r#"{"id":"b","answer":2,"options":["a","b"]}"#
        );
        assert_eq!(s[1].correct_option, Some(1));
        assert_eq!((s[2].options.is_some(), s[2].correct_option), (true, None));
        let required = load_prompts(&path).unwrap();
        assert_eq!(required.len(), 1);
        assert_eq!(required.report.skipped_for(SkipReason::MissingAnswer), 2);
    }

    #[test]
    fn bad_lines_are_skipped_counted_and_reported_with_line_numbers() {
        let text = concat!(
            "{\"prompt\": \"ok\", \"answer\": \"1\"}\n",
            "not json\n",
            "[1, 2]\n",
            "{\"answer\": \"1\"}\n",
            "{\"prompt\": \"  \", \"answer\": \"1\"}\n",
            "{\"prompt\": \"q\"}\n",
            "{\"prompt\": \"q\", \"answer\": \"\"}\n",
            "{\"prompt\": \"q\", \"answer\": \"A\", \"options\": [\"only one\"]}\n",
            "{\"prompt\": \"q\", \"answer\": \"E\", \"options\": [\"x\", \"y\"]}\n",
            "{\"id\": \"d\", \"prompt\": \"q\", \"answer\": \"1\"}\n",
            "{\"id\": \"d\", \"prompt\": \"q2\", \"answer\": \"2\"}\n",
            "{\"prompt\": 5, \"answer\": \"1\"}\n",
        );
        let (_d, path) = write(text);
        let ds = load_prompts(&path).unwrap();
        assert_eq!(ds.len(), 2);
        let r = &ds.report;
        assert_eq!(r.skipped_for(SkipReason::MalformedJson), 1);
        assert_eq!(r.skipped_for(SkipReason::BadFormat), 2);
        assert_eq!(r.skipped_for(SkipReason::MissingPrompt), 1);
        assert_eq!(r.skipped_for(SkipReason::EmptyPrompt), 1);
        assert_eq!(r.skipped_for(SkipReason::MissingAnswer), 1);
        assert_eq!(r.skipped_for(SkipReason::EmptyAnswer), 1);
        assert_eq!(r.skipped_for(SkipReason::BadOptions), 1);
        assert_eq!(r.skipped_for(SkipReason::AnswerNotAnOption), 1);
        assert_eq!(r.skipped_for(SkipReason::DuplicateId), 1);
        let dup = r
            .skipped_lines
            .iter()
            .find(|s| s.reason == SkipReason::DuplicateId)
            .unwrap();
        assert_eq!(dup.line, 11);
        assert!(dup.detail.contains("line 10"), "{}", dup.detail);
        let shown = r.to_string();
        assert!(shown.contains("no answer (line 6"), "{shown}");
    }

    #[test]
    fn a_file_without_prompts_is_an_error() {
        let (_d, path) = write("{\"prompt\": \"q\"}\n\n");
        let err = load_prompts(&path).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("no usable prompts") && msg.contains("line 1"),
            "{msg}"
        );
        let err = load_prompts(Path::new("/nonexistent/x.jsonl")).unwrap_err();
        assert!(matches!(err, DatasetError::MissingFile { .. }));
    }

    #[test]
    fn epoch_orders_are_permutations_fixed_by_seed_and_epoch() {
        let a = epoch_order(50, 7, 0);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_eq!(a, epoch_order(50, 7, 0));
        assert_ne!(a, epoch_order(50, 7, 1));
        assert_ne!(a, epoch_order(50, 8, 0));
        // Pinned: the order of a published seed must never change.
        assert_eq!(epoch_order(6, 42, 0), vec![3, 5, 4, 1, 2, 0]);
        assert_eq!(epoch_order(1, 1, 1), vec![0]);
        assert!(epoch_order(0, 1, 1).is_empty());
    }

    #[test]
    fn sampler_drops_the_incomplete_tail_and_resumes_exactly() {
        let mut s = PromptSampler::new(10, 3, true).unwrap();
        let b1 = s.next_batch(4).unwrap();
        let b2 = s.next_batch(4).unwrap();
        assert_eq!((b1.epoch, b2.epoch), (0, 0));
        let order0 = epoch_order(10, 3, 0);
        assert_eq!(b1.indices, order0[..4]);
        assert_eq!(b2.indices, order0[4..8]);
        let saved = s.cursor();
        assert_eq!(
            saved,
            DataCursor {
                epoch: 0,
                position: 8
            }
        );
        let b3 = s.next_batch(4).unwrap();
        assert_eq!(b3.epoch, 1);
        assert_eq!(b3.indices, epoch_order(10, 3, 1)[..4]);
        let b4 = s.next_batch(4).unwrap();

        let mut resumed = PromptSampler::resume(10, 3, true, saved).unwrap();
        assert_eq!(resumed.next_batch(4).unwrap(), b3);
        assert_eq!(resumed.next_batch(4).unwrap(), b4);
        assert_eq!(resumed.cursor(), s.cursor());
        assert!((resumed.epoch_progress() - 1.8).abs() < 1e-12);

        let mut plain = PromptSampler::new(5, 3, false).unwrap();
        assert_eq!(plain.next_batch(2).unwrap().indices, vec![0, 1]);
        assert!(matches!(
            plain.next_batch(6).unwrap_err(),
            DatasetError::BatchLargerThanDataset { batch: 6, len: 5 }
        ));
        assert!(matches!(
            plain.next_batch(0).unwrap_err(),
            DatasetError::ZeroBatch
        ));
        assert!(matches!(
            PromptSampler::resume(
                5,
                3,
                false,
                DataCursor {
                    epoch: 0,
                    position: 6
                }
            )
            .unwrap_err(),
            DatasetError::CursorOutOfRange { .. }
        ));
    }
}
