//! Reward functions: the [`RewardFunction`] trait, the built-in functions, their weighted sum
//! (TRL's `reward_funcs` + `reward_weights`) and per-function statistics.
//!
//! # Outcomes
//!
//! A function returns `Ok(Some(score))`, `Ok(None)` (it does not apply to this sample, TRL's
//! `None`) or `Err` (it failed on this sample). Both of the latter make the sample's reward
//! `None` in [`BatchRewards::totals`]: the trainer counts it and leaves it out of its group's
//! statistics ([`crate::advantage`]); nothing is ever replaced by a default reward.
//!
//! **Where this differs from TRL.** TRL's `sum_then_normalize` takes `nansum` over the
//! functions, so a sample for which *one* function returned `None` gets the weighted sum of the
//! others, silently scoring the missing one as 0. Here any missing component makes the total
//! `None` (fleet's rule: no silent defaults). A wrong or unparseable *completion* is not a
//! failure: it is a wrong answer and scores 0, counted as unparsed.
//!
//! # Built-in functions (names as declared in TOML)
//!
//! - `gsm8k_exact` ([`Gsm8kExact`]): 1.0 when the completion's number equals the reference
//!   number exactly, else 0.0.
//! - `multiple_choice` ([`MultipleChoice`]): 1.0 when fleet-data's answer parser (the one ARGO uses) reads the
//!   correct option, else 0.0.
//! - `format` ([`FormatReward`]): 1.0 when the completion has the required tag pairs and/or
//!   final-line prefix, else 0.0.
//! - `length` ([`LengthPenalty`]): DAPO's soft over-length punishment, 0 down to −1.
//! - `reward_model` ([`crate::reward_model::RewardModel`]): a sequence-classification
//!   checkpoint's score.
//! - `command` and `http` ([`crate::external`]): the user's own function, in any language, with
//!   TRL's arguments (prompts, completions, completion ids and the rows' other columns).
//!
//! ```toml
//! [[reward_funcs]]
//! name = "gsm8k_exact"
//! weight = 1.0
//!
//! [[reward_funcs]]
//! name = "format"
//! weight = 0.1
//! tags = [["<think>", "</think>"]]
//! final_line_prefix = "####"
//!
//! [[reward_funcs]]
//! name = "length"
//! weight = 1.0
//! max_length = 256
//! cache_length = 64
//! unit = "tokens"
//! ```
//!
//! `weight` defaults to 1.0, as TRL's `reward_weights = None` does. An unknown `name` is
//! rejected when the config loads, with the list of known names.
//!
//! # Numbers (GSM8K)
//!
//! The reference is the number after the last `####` of the dataset's answer (or the whole
//! answer when it is just a number); a reference without a number is an error for that sample
//! (reward `None`). The completion's answer is read, after removing a `<think>` block (text up to
//! the last `</think>`; an unclosed `<think>` is unparsed), from the first of these that is
//! present:
//! 1. the last `\boxed{...}` (`\fbox{...}` too): its content must hold exactly one number, or a
//!    `\frac{a}{b}` (`\dfrac`, `\tfrac`);
//! 2. the last `####`: the first number after it;
//! 3. the last `answer is` / `answer:` (any case): the first number on the rest of that line,
//!    or on the next non-blank line when the rest is blank;
//! 4. otherwise the last number in the text.
//!
//! An explicit marker (1-3) without a number is unparsed: no fallback to an earlier number.
//! Numbers: an optional sign (`-` or `−` not preceded by a letter, digit or `)`), digits with
//! optional thousands commas (`1,000`, `1,234,567`: groups of exactly three digits), an optional
//! decimal part (`3.50`, `.5`), an optional `/integer` for fractions of integers (`3/4`);
//! whatever follows (`%`, units such as `kg` or `dollars`, a full stop) is ignored, and so is a
//! leading `$`. Values are compared exactly as fractions, so `3.0` == `3`, `1,000` == `1000`,
//! `0.5` == `1/2`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use fleet_data::answer::parse_answer_with_options;
use serde::{Deserialize, Serialize};

use crate::advantage::nan_mean_std;
use crate::dataset::Sample;

/// Errors of reward functions: a failure on one sample (the sample's reward becomes `None`), or
/// a problem building the functions.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RewardError {
    /// The sample lacks a field the function needs.
    #[error("{function}: sample {id} has no {field}: {hint}")]
    MissingField {
        /// The function.
        function: String,
        /// The sample id.
        id: String,
        /// The field.
        field: &'static str,
        /// What to do.
        hint: &'static str,
    },
    /// The dataset's reference answer has no number to compare with.
    #[error(
        "{function}: the reference answer of sample {id} has no number ({reason}): {answer:?}; \
         the dataset's answer must end with `#### <number>` or be a number"
    )]
    BadReference {
        /// The function.
        function: String,
        /// The sample id.
        id: String,
        /// The reference as written (truncated to 200 characters).
        answer: String,
        /// Why it was not read.
        reason: String,
    },
    /// A score that is NaN or infinite.
    #[error("{function}: sample {id} scored {value}, not a finite number; a function must return None for a sample it cannot score")]
    NonFinite {
        /// The function.
        function: String,
        /// The sample id.
        id: String,
        /// The value.
        value: f64,
    },
    /// Counting tokens failed.
    #[error("{function}: cannot count the tokens of the completion of sample {id}: {message}")]
    TokenCount {
        /// The function.
        function: String,
        /// The sample id.
        id: String,
        /// The tokenizer's message.
        message: String,
    },
    /// A `length` function with `unit = "tokens"` built without a token counter.
    #[error("reward function `{function}` counts tokens (unit = \"tokens\") but no tokenizer was given: pass a token counter when building the reward functions, or use unit = \"chars\"")]
    NeedsTokenCounter {
        /// The function.
        function: String,
    },
    /// Bad settings of a reward function.
    #[error("reward function `{function}`: {message}")]
    Config {
        /// The function.
        function: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// A reward model failed (loading, scoring).
    #[error("reward model {model}: {message}")]
    Model {
        /// The reward model as given.
        model: String,
        /// What went wrong and what to do.
        message: String,
    },
    /// Batch inputs of different lengths.
    #[error("score_batch got {prompts} prompts, {completions} completions, {completion_ids} completion id lists and {samples} samples: pass one of each per completion")]
    LengthMismatch {
        /// Prompts given.
        prompts: usize,
        /// Completions given.
        completions: usize,
        /// Completion token id lists given.
        completion_ids: usize,
        /// Samples given.
        samples: usize,
    },
    /// No completion of a generation batch has a reward: nothing to train on.
    #[error(
        "generation batch {batch}: none of its {completions} completions has a reward ({detail}); \
         fix the reward function or the dataset rows it cannot score"
    )]
    BatchUnscored {
        /// The generation batch (1-based).
        batch: u64,
        /// Its completions.
        completions: usize,
        /// Per function: its failures and first error, or that it returned null.
        detail: String,
    },
    /// An external reward function (a command or an HTTP endpoint, [`crate::external`]) failed
    /// on a batch or on one completion of it.
    #[error("reward function {function} ({source_desc}): {message}")]
    External {
        /// The function's name.
        function: String,
        /// The command line or URL.
        source_desc: String,
        /// What went wrong and what to do.
        message: String,
    },
}

/// A reward function. Implementations must be usable from several threads.
pub trait RewardFunction: Send + Sync {
    /// The name: the metric key `rewards/<name>/mean` and the TOML `name`.
    fn name(&self) -> &str;

    /// Scores one completion of `prompt` (the text shown to the model) for the dataset row
    /// `sample`. `Ok(None)`: not applicable; `Err`: failed. Neither is ever turned into a score.
    fn score(
        &self,
        prompt: &str,
        completion: &str,
        sample: &Sample,
    ) -> Result<Option<f64>, RewardError>;

    /// Scores several completions at once (one result per item, in order). The default scores
    /// them one by one; a reward model overrides it to run them as one batch, an external
    /// function to send them in one message.
    fn score_many(&self, items: &[Completion<'_>]) -> Vec<Result<Option<f64>, RewardError>> {
        items
            .iter()
            .map(|c| self.score(c.prompt, c.text, c.sample))
            .collect()
    }

    /// Completions scored 0 because their answer could not be read, since the last call (the
    /// counter is reset). Functions that parse nothing return 0.
    fn take_unparsed(&self) -> u64 {
        0
    }

    /// Checks that `sample` can be scored at all (its reference parses, it has options, ...),
    /// so that a trainer can report unusable rows before training.
    fn check_sample(&self, _sample: &Sample) -> Result<(), RewardError> {
        Ok(())
    }
}

/// One completion to score: the prompt shown to the model, the completion's text and token
/// ids, and the dataset row it answers (TRL's `prompts`, `completions`, `completion_ids` and
/// the row's other columns).
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a> {
    /// The prompt as shown to the model (the chat template applied).
    pub prompt: &'a str,
    /// The completion's text.
    pub text: &'a str,
    /// The completion's token ids.
    pub ids: &'a [u32],
    /// The dataset row.
    pub sample: &'a Sample,
}

/// One completion through `f`'s batched path ([`RewardFunction::score_many`]): the `score` of
/// functions that score whole batches (reward models, external functions), with no token ids.
pub fn score_one_via_batch(
    f: &dyn RewardFunction,
    prompt: &str,
    completion: &str,
    sample: &Sample,
) -> Result<Option<f64>, RewardError> {
    let item = Completion {
        prompt,
        text: completion,
        ids: &[],
        sample,
    };
    f.score_many(&[item]).pop().unwrap_or(Ok(None))
}

/// A number as an exact fraction `num / den` (den > 0, lowest terms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rational {
    /// Numerator.
    pub num: i128,
    /// Denominator, positive.
    pub den: i128,
}

impl Rational {
    /// `num / den` in lowest terms; `None` when `den` is 0.
    pub fn new(num: i128, den: i128) -> Option<Rational> {
        if den == 0 {
            return None;
        }
        let g = gcd(num.unsigned_abs(), den.unsigned_abs()).max(1) as i128;
        let sign = if den < 0 { -1 } else { 1 };
        Some(Rational {
            num: sign * num / g,
            den: sign * den / g,
        })
    }
}

impl fmt::Display for Rational {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.den == 1 {
            write!(f, "{}", self.num)
        } else {
            write!(f, "{}/{}", self.num, self.den)
        }
    }
}

fn gcd(a: u128, b: u128) -> u128 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Why a completion's answer was not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NumberUnparsed {
    /// A `<think>` that is never closed.
    UnterminatedThink,
    /// `\boxed{` without its closing brace.
    UnbalancedBox,
    /// A marker (`\boxed{}`, `####`, `answer is`) with no number after it.
    MarkerWithoutNumber,
    /// `\boxed{}` holding several numbers.
    Ambiguous,
    /// No number anywhere.
    NoNumber,
    /// A number with more digits than an exact comparison can hold (38).
    TooLong,
}

impl fmt::Display for NumberUnparsed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NumberUnparsed::UnterminatedThink => "unterminated <think>",
            NumberUnparsed::UnbalancedBox => "\\boxed{ without its closing brace",
            NumberUnparsed::MarkerWithoutNumber => "answer marker without a number",
            NumberUnparsed::Ambiguous => "several numbers in \\boxed{}",
            NumberUnparsed::NoNumber => "no number",
            NumberUnparsed::TooLong => "number too long",
        })
    }
}

/// One number found in a text: its value (`None` when too long) and byte span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NumberToken {
    value: Option<Rational>,
    start: usize,
    end: usize,
}

fn is_alnum_before(bytes: &[u8], i: usize) -> bool {
    i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b')' || bytes[i - 1] >= 0x80)
}

fn digits_end(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() && bytes[i].is_ascii_digit() {
        i += 1;
    }
    i
}

/// Every number in `text`, in order (rules in the module docs).
fn scan_numbers(text: &str) -> Vec<NumberToken> {
    const MINUS: &[u8] = "\u{2212}".as_bytes();
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        // Sign.
        let (negative, body) = if b[i] == b'-' && !is_alnum_before(b, i) {
            (true, i + 1)
        } else if b[i..].starts_with(MINUS) && !is_alnum_before(b, i) {
            (true, i + MINUS.len())
        } else {
            (false, i)
        };
        let starts_digit = body < b.len() && b[body].is_ascii_digit();
        let starts_dot = body + 1 < b.len()
            && b[body] == b'.'
            && b[body + 1].is_ascii_digit()
            && !(body > 0 && (b[body - 1].is_ascii_digit() || b[body - 1] == b'.'));
        if !(starts_digit || starts_dot) {
            i += if b[i] >= 0x80 {
                // Skip a whole UTF-8 character.
                text[i..].chars().next().map_or(1, char::len_utf8)
            } else {
                1
            };
            continue;
        }
        let start = i;
        let mut digits = String::new();
        let mut j = body;
        let int_end = digits_end(b, j);
        digits.push_str(&text[j..int_end]);
        let mut grouped = false;
        j = int_end;
        // Thousands groups: only after a first group of 1-3 digits.
        if (1..=3).contains(&(int_end - body)) {
            while j < b.len() && b[j] == b',' && digits_end(b, j + 1) == j + 4 {
                digits.push_str(&text[j + 1..j + 4]);
                j += 4;
                grouped = true;
            }
        }
        let mut scale = 0u32;
        if j + 1 < b.len() && b[j] == b'.' && b[j + 1].is_ascii_digit() {
            let frac_end = digits_end(b, j + 1);
            digits.push_str(&text[j + 1..frac_end]);
            scale = (frac_end - j - 1) as u32;
            j = frac_end;
        }
        let mut value = parse_decimal(&digits, scale, negative);
        // A fraction of plain integers: `3/4`.
        if !grouped && scale == 0 && j + 1 < b.len() && b[j] == b'/' && b[j + 1].is_ascii_digit() {
            let den_end = digits_end(b, j + 1);
            let den = text[j + 1..den_end].parse::<i128>().ok();
            value = match (value, den) {
                (Some(v), Some(d)) if d != 0 => Rational::new(v.num, d),
                (Some(v), Some(_)) => Some(v), // `x/0`: keep the numerator, the `/0` is not a number.
                _ => None,
            };
            if den.is_some_and(|d| d != 0) {
                j = den_end;
            }
        }
        out.push(NumberToken {
            value,
            start,
            end: j,
        });
        i = j.max(i + 1);
    }
    out
}

fn parse_decimal(digits: &str, scale: u32, negative: bool) -> Option<Rational> {
    let mantissa: i128 = digits.parse().ok()?;
    let den = 10i128.checked_pow(scale)?;
    Rational::new(if negative { -mantissa } else { mantissa }, den)
}

fn token_value(t: &NumberToken) -> Result<Rational, NumberUnparsed> {
    t.value.ok_or(NumberUnparsed::TooLong)
}

/// Finds the last case-insensitive occurrence of `needle` (ASCII) in `text`.
fn rfind_ci(text: &str, needle: &str) -> Option<usize> {
    let lower = text.to_ascii_lowercase();
    lower.rfind(needle)
}

/// The content of the last `\boxed{...}` / `\fbox{...}`: `Some(Ok(content))`, `Some(Err)` when
/// its braces do not close, `None` when there is no box.
fn last_box(text: &str) -> Option<Result<&str, NumberUnparsed>> {
    let pos = ["\\boxed{", "\\boxed {", "\\fbox{"]
        .iter()
        .filter_map(|m| text.rfind(m).map(|p| p + m.len()))
        .max()?;
    let mut depth = 1usize;
    for (k, c) in text[pos..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(Ok(&text[pos..pos + k]));
                }
            }
            _ => {}
        }
    }
    Some(Err(NumberUnparsed::UnbalancedBox))
}

/// `\frac{a}{b}` (or `\dfrac`, `\tfrac`) with integer a and b, optionally preceded by `-`.
fn latex_fraction(content: &str) -> Option<Rational> {
    let trimmed = content.trim();
    let (negative, rest) = match trimmed.strip_prefix('-') {
        Some(r) => (true, r.trim_start()),
        None => (false, trimmed),
    };
    let rest = ["\\frac", "\\dfrac", "\\tfrac"]
        .iter()
        .find_map(|m| rest.strip_prefix(m))?;
    let rest = rest.trim_start().strip_prefix('{')?;
    let (a, rest) = rest.split_once('}')?;
    let rest = rest.trim_start().strip_prefix('{')?;
    let (b, tail) = rest.split_once('}')?;
    if !tail.trim().is_empty() {
        return None;
    }
    let a: i128 = a.trim().parse().ok()?;
    let b: i128 = b.trim().parse().ok()?;
    Rational::new(if negative { -a } else { a }, b)
}

/// Reads the final numeric answer of a completion (rules in the module docs).
pub fn extract_completion_number(completion: &str) -> Result<Rational, NumberUnparsed> {
    let text = if let Some(p) = completion.rfind("</think>") {
        &completion[p + "</think>".len()..]
    } else if completion.contains("<think>") {
        return Err(NumberUnparsed::UnterminatedThink);
    } else {
        completion
    };
    if let Some(content) = last_box(text) {
        let content = content?;
        if let Some(r) = latex_fraction(content) {
            return Ok(r);
        }
        let nums = scan_numbers(content);
        return match nums.as_slice() {
            [] => Err(NumberUnparsed::MarkerWithoutNumber),
            [one] => token_value(one),
            _ => Err(NumberUnparsed::Ambiguous),
        };
    }
    if let Some(p) = text.rfind("####") {
        return scan_numbers(&text[p + 4..])
            .first()
            .map_or(Err(NumberUnparsed::MarkerWithoutNumber), token_value);
    }
    let marker = ["answer is", "answer:"]
        .iter()
        .filter_map(|m| rfind_ci(text, m).map(|p| p + m.len()))
        .max();
    if let Some(p) = marker {
        let rest = &text[p..];
        let mut segment = "";
        for line in rest.split('\n') {
            if line.chars().any(|c| c.is_alphanumeric()) {
                segment = line;
                break;
            }
        }
        return scan_numbers(segment)
            .first()
            .map_or(Err(NumberUnparsed::MarkerWithoutNumber), token_value);
    }
    scan_numbers(text)
        .last()
        .map_or(Err(NumberUnparsed::NoNumber), token_value)
}

/// Reads a dataset's reference number: after the last `####`, or the whole answer when it is a
/// single number.
pub fn extract_reference_number(answer: &str) -> Result<Rational, String> {
    if let Some(p) = answer.rfind("####") {
        return match scan_numbers(&answer[p + 4..]).first() {
            Some(t) => t.value.ok_or_else(|| "number too long".to_string()),
            None => Err("no number after ####".to_string()),
        };
    }
    let trimmed = answer.trim();
    let trimmed = trimmed.strip_prefix('$').unwrap_or(trimmed);
    match scan_numbers(trimmed).as_slice() {
        [t] if t.start == 0 && t.end == trimmed.len() => {
            t.value.ok_or_else(|| "number too long".to_string())
        }
        _ => Err("no `####` and the answer is not a single number".to_string()),
    }
}

fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// `gsm8k_exact`: exact numeric match against the number after `####` (module docs).
#[derive(Debug, Default)]
pub struct Gsm8kExact {
    unparsed: AtomicU64,
}

impl Gsm8kExact {
    /// The TOML name.
    pub const NAME: &'static str = "gsm8k_exact";

    /// A new function with its unparsed counter at 0.
    pub fn new() -> Self {
        Self::default()
    }

    fn reference(&self, sample: &Sample) -> Result<Rational, RewardError> {
        let Some(answer) = &sample.answer else {
            return Err(RewardError::MissingField {
                function: Self::NAME.to_string(),
                id: sample.id.clone(),
                field: "answer",
                hint: "gsm8k_exact needs rows with an `answer` ending in `#### <number>`",
            });
        };
        extract_reference_number(answer).map_err(|reason| RewardError::BadReference {
            function: Self::NAME.to_string(),
            id: sample.id.clone(),
            answer: truncate(answer, 200),
            reason,
        })
    }
}

impl RewardFunction for Gsm8kExact {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn score(
        &self,
        _prompt: &str,
        completion: &str,
        sample: &Sample,
    ) -> Result<Option<f64>, RewardError> {
        let reference = self.reference(sample)?;
        match extract_completion_number(completion) {
            Ok(v) => Ok(Some(if v == reference { 1.0 } else { 0.0 })),
            Err(_) => {
                self.unparsed.fetch_add(1, Ordering::Relaxed);
                Ok(Some(0.0))
            }
        }
    }

    fn take_unparsed(&self) -> u64 {
        self.unparsed.swap(0, Ordering::Relaxed)
    }

    fn check_sample(&self, sample: &Sample) -> Result<(), RewardError> {
        self.reference(sample).map(|_| ())
    }
}

/// `multiple_choice`: the option fleet-data's answer parser (ARGO's) reads from the completion
/// ([`fleet_data::answer::parse_answer_with_options`]) against [`Sample::correct_option`].
#[derive(Debug, Default)]
pub struct MultipleChoice {
    unparsed: AtomicU64,
}

impl MultipleChoice {
    /// The TOML name.
    pub const NAME: &'static str = "multiple_choice";

    /// A new function with its unparsed counter at 0.
    pub fn new() -> Self {
        Self::default()
    }

    fn options<'a>(&self, sample: &'a Sample) -> Result<(&'a [String], usize), RewardError> {
        match (&sample.options, sample.correct_option) {
            (Some(o), Some(c)) => Ok((o, c)),
            _ => Err(RewardError::MissingField {
                function: Self::NAME.to_string(),
                id: sample.id.clone(),
                field: "options",
                hint: "multiple_choice needs rows with an `options` list and an answer naming one",
            }),
        }
    }
}

impl RewardFunction for MultipleChoice {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn score(
        &self,
        _prompt: &str,
        completion: &str,
        sample: &Sample,
    ) -> Result<Option<f64>, RewardError> {
        let (options, correct) = self.options(sample)?;
        let parsed = parse_answer_with_options(completion, options);
        if parsed.is_unparsed() {
            self.unparsed.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Some(if parsed.is_correct(correct) { 1.0 } else { 0.0 }))
    }

    fn take_unparsed(&self) -> u64 {
        self.unparsed.swap(0, Ordering::Relaxed)
    }

    fn check_sample(&self, sample: &Sample) -> Result<(), RewardError> {
        self.options(sample).map(|_| ())
    }
}

/// `format`: 1.0 when every configured check passes, else 0.0.
///
/// - `tags`: each `[open, close]` pair appears exactly once, open before close, and each pair
///   after the previous pair's close.
/// - `final_line_prefix`: the last non-blank line, trimmed, starts with the prefix.
#[derive(Debug, Clone, PartialEq)]
pub struct FormatReward {
    tags: Vec<[String; 2]>,
    final_line_prefix: Option<String>,
}

impl FormatReward {
    /// The TOML name.
    pub const NAME: &'static str = "format";

    /// Checks the settings: at least one check, no empty tag or prefix.
    pub fn new(
        tags: Vec<[String; 2]>,
        final_line_prefix: Option<String>,
    ) -> Result<Self, RewardError> {
        let err = |message: String| RewardError::Config {
            function: Self::NAME.to_string(),
            message,
        };
        if tags.is_empty() && final_line_prefix.is_none() {
            return Err(err(
                "nothing to check: set tags = [[\"<think>\", \"</think>\"]] and/or \
                 final_line_prefix = \"####\""
                    .into(),
            ));
        }
        if let Some(i) = tags.iter().position(|[o, c]| o.is_empty() || c.is_empty()) {
            return Err(err(format!(
                "tags[{i}] has an empty tag: give both the opening and the closing tag"
            )));
        }
        if final_line_prefix
            .as_deref()
            .is_some_and(|p| p.trim().is_empty())
        {
            return Err(err("final_line_prefix is empty: give the text the last line must start with, or remove it".into()));
        }
        Ok(FormatReward {
            tags,
            final_line_prefix,
        })
    }

    /// Whether `completion` passes every check.
    pub fn passes(&self, completion: &str) -> bool {
        let mut from = 0;
        for [open, close] in &self.tags {
            if completion.matches(open.as_str()).count() != 1
                || completion.matches(close.as_str()).count() != 1
            {
                return false;
            }
            let Some(o) = completion[from..].find(open.as_str()).map(|p| p + from) else {
                return false;
            };
            let after_open = o + open.len();
            let Some(c) = completion[after_open..]
                .find(close.as_str())
                .map(|p| p + after_open)
            else {
                return false;
            };
            from = c + close.len();
        }
        if let Some(prefix) = &self.final_line_prefix {
            let last = completion.lines().rev().find(|l| !l.trim().is_empty());
            if !last.is_some_and(|l| l.trim().starts_with(prefix.as_str())) {
                return false;
            }
        }
        true
    }
}

impl RewardFunction for FormatReward {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn score(
        &self,
        _prompt: &str,
        completion: &str,
        _sample: &Sample,
    ) -> Result<Option<f64>, RewardError> {
        Ok(Some(if self.passes(completion) { 1.0 } else { 0.0 }))
    }
}

/// What a [`LengthPenalty`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LengthUnit {
    /// Unicode characters of the completion text.
    Chars,
    /// Tokens, counted by the token counter given to [`WeightedSum::from_specs`].
    Tokens,
}

/// Counts the tokens of a completion text (the trainer passes its tokenizer).
pub type TokenCounter = Arc<dyn Fn(&str) -> Result<usize, String> + Send + Sync>;

/// `length`: DAPO's soft over-length punishment. With `L` the completion length, `max` and
/// `cache`: 0 when `L <= max − cache`; `((max − cache) − L) / cache` (0 to −1) when
/// `max − cache < L <= max`; −1 beyond `max`.
pub struct LengthPenalty {
    max_length: usize,
    cache_length: usize,
    unit: LengthUnit,
    counter: Option<TokenCounter>,
}

impl fmt::Debug for LengthPenalty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LengthPenalty")
            .field("max_length", &self.max_length)
            .field("cache_length", &self.cache_length)
            .field("unit", &self.unit)
            .finish()
    }
}

impl LengthPenalty {
    /// The TOML name.
    pub const NAME: &'static str = "length";

    /// Checks `1 <= cache_length <= max_length`; `unit = tokens` needs `counter`.
    pub fn new(
        max_length: usize,
        cache_length: usize,
        unit: LengthUnit,
        counter: Option<TokenCounter>,
    ) -> Result<Self, RewardError> {
        if max_length == 0 || cache_length == 0 || cache_length > max_length {
            return Err(RewardError::Config {
                function: Self::NAME.to_string(),
                message: format!(
                    "max_length = {max_length}, cache_length = {cache_length}: need \
                     1 <= cache_length <= max_length (DAPO: max_length = the completion limit, \
                     cache_length = the soft zone before it)"
                ),
            });
        }
        if unit == LengthUnit::Tokens && counter.is_none() {
            return Err(RewardError::NeedsTokenCounter {
                function: Self::NAME.to_string(),
            });
        }
        Ok(LengthPenalty {
            max_length,
            cache_length,
            unit,
            counter,
        })
    }

    /// The penalty for a completion of `len` units.
    pub fn penalty(&self, len: usize) -> f64 {
        let soft = self.max_length - self.cache_length;
        if len <= soft {
            0.0
        } else if len <= self.max_length {
            (soft as f64 - len as f64) / self.cache_length as f64
        } else {
            -1.0
        }
    }
}

impl RewardFunction for LengthPenalty {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn score(
        &self,
        _prompt: &str,
        completion: &str,
        sample: &Sample,
    ) -> Result<Option<f64>, RewardError> {
        let len = match (self.unit, &self.counter) {
            (LengthUnit::Chars, _) => completion.chars().count(),
            (LengthUnit::Tokens, Some(count)) => {
                count(completion).map_err(|message| RewardError::TokenCount {
                    function: Self::NAME.to_string(),
                    id: sample.id.clone(),
                    message,
                })?
            }
            (LengthUnit::Tokens, None) => {
                return Err(RewardError::NeedsTokenCounter {
                    function: Self::NAME.to_string(),
                })
            }
        };
        Ok(Some(self.penalty(len)))
    }
}

fn one() -> f64 {
    1.0
}

/// A reward function as declared in the TOML config (`[[reward_funcs]]`), tagged by `name`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "snake_case", deny_unknown_fields)]
pub enum RewardSpec {
    /// [`Gsm8kExact`].
    Gsm8kExact {
        /// Weight in the sum (default 1.0).
        #[serde(default = "one")]
        weight: f64,
    },
    /// [`MultipleChoice`].
    MultipleChoice {
        /// Weight in the sum (default 1.0).
        #[serde(default = "one")]
        weight: f64,
    },
    /// [`FormatReward`].
    Format {
        /// Weight in the sum (default 1.0).
        #[serde(default = "one")]
        weight: f64,
        /// `[open, close]` tag pairs, in order.
        #[serde(default)]
        tags: Vec<[String; 2]>,
        /// The last non-blank line must start with this.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        final_line_prefix: Option<String>,
    },
    /// A reward model (`*ForSequenceClassification` with one label, e.g. a Qwen2 reward model):
    /// the score of prompt + completion ([`crate::reward_model::RewardModel`]).
    RewardModel {
        /// Weight in the sum (default 1.0).
        #[serde(default = "one")]
        weight: f64,
        /// Its checkpoint: a local directory or a hub id.
        model: String,
        /// Hub revision.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        revision: Option<String>,
    },
    /// [`LengthPenalty`].
    Length {
        /// Weight in the sum (default 1.0).
        #[serde(default = "one")]
        weight: f64,
        /// The hard limit (−1 beyond it).
        max_length: usize,
        /// The soft zone before the limit.
        cache_length: usize,
        /// `chars` or `tokens`.
        unit: LengthUnit,
    },
    /// The user's own function as a command fleet starts once and talks to over JSON lines
    /// ([`crate::external::CommandReward`]).
    Command {
        /// Weight in the sum (default 1.0).
        #[serde(default = "one")]
        weight: f64,
        /// The program and its arguments, e.g. `["python3", "examples/rewards/fleet_reward.py",
        /// "my_rewards.py:reward_len"]`.
        command: Vec<String>,
        /// The metric name (`rewards/<label>/mean`); default: the name the command greets with.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        label: Option<String>,
        /// Seconds to wait for the greeting and for each batch's answer (default 60).
        #[serde(default = "default_timeout_s")]
        timeout_s: f64,
    },
    /// The user's own function behind an HTTP endpoint that takes each batch as a POST
    /// ([`crate::external::HttpReward`]).
    Http {
        /// Weight in the sum (default 1.0).
        #[serde(default = "one")]
        weight: f64,
        /// The endpoint, `http://...` or `https://...`.
        url: String,
        /// The metric name (`rewards/<label>/mean`); default `http`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        label: Option<String>,
        /// Seconds to wait for each batch's answer (default 60).
        #[serde(default = "default_timeout_s")]
        timeout_s: f64,
    },
}

fn default_timeout_s() -> f64 {
    60.0
}

impl RewardSpec {
    /// The known names.
    pub const NAMES: &'static [&'static str] = &[
        Gsm8kExact::NAME,
        MultipleChoice::NAME,
        FormatReward::NAME,
        LengthPenalty::NAME,
        crate::reward_model::RewardModel::NAME,
        "command",
        "http",
    ];

    /// The function's name.
    pub fn name(&self) -> &'static str {
        match self {
            RewardSpec::Gsm8kExact { .. } => Gsm8kExact::NAME,
            RewardSpec::MultipleChoice { .. } => MultipleChoice::NAME,
            RewardSpec::Format { .. } => FormatReward::NAME,
            RewardSpec::Length { .. } => LengthPenalty::NAME,
            RewardSpec::RewardModel { .. } => crate::reward_model::RewardModel::NAME,
            RewardSpec::Command { .. } => "command",
            RewardSpec::Http { .. } => "http",
        }
    }

    /// The function's metric name as far as the config says it: the built-in name, or a
    /// command's or endpoint's `label` (`None` when the command names itself when it greets;
    /// an endpoint without one is `http`).
    pub fn config_name(&self) -> Option<String> {
        match self {
            RewardSpec::Command { label, .. } => label.clone(),
            RewardSpec::Http { label, .. } => Some(label.clone().unwrap_or_else(|| "http".into())),
            other => Some(other.name().to_string()),
        }
    }

    /// Whether the function reads the rows' `answer` (a dataset for functions that do not may
    /// lack it).
    pub fn reads_answer(&self) -> bool {
        matches!(
            self,
            RewardSpec::Gsm8kExact { .. } | RewardSpec::MultipleChoice { .. }
        )
    }

    /// Its weight.
    pub fn weight(&self) -> f64 {
        match self {
            RewardSpec::Gsm8kExact { weight }
            | RewardSpec::MultipleChoice { weight }
            | RewardSpec::Format { weight, .. }
            | RewardSpec::Length { weight, .. }
            | RewardSpec::RewardModel { weight, .. }
            | RewardSpec::Command { weight, .. }
            | RewardSpec::Http { weight, .. } => *weight,
        }
    }

    /// Checks the settings (the weight is finite, the function's own checks); the message says
    /// what to change.
    pub fn validate(&self) -> Result<(), String> {
        if !self.weight().is_finite() {
            return Err(format!("weight = {} is not a finite number", self.weight()));
        }
        match self {
            RewardSpec::Format {
                tags,
                final_line_prefix,
                ..
            } => FormatReward::new(tags.clone(), final_line_prefix.clone())
                .map(|_| ())
                .map_err(|e| message_of(&e)),
            RewardSpec::Length {
                max_length,
                cache_length,
                ..
            } => {
                let dummy: TokenCounter = Arc::new(|s: &str| Ok(s.len()));
                LengthPenalty::new(*max_length, *cache_length, LengthUnit::Tokens, Some(dummy))
                    .map(|_| ())
                    .map_err(|e| message_of(&e))
            }
            RewardSpec::Command {
                command, timeout_s, ..
            } => {
                if command.is_empty() || command[0].trim().is_empty() {
                    return Err("command = [] names no program: give the program and its \
                                arguments, e.g. [\"python3\", \"examples/rewards/fleet_reward.py\", \
                                \"my_rewards.py:reward_len\"]"
                        .into());
                }
                check_timeout(*timeout_s)
            }
            RewardSpec::Http { url, timeout_s, .. } => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(format!("url = {url:?} must start with http:// or https://"));
                }
                check_timeout(*timeout_s)
            }
            _ => Ok(()),
        }
    }

    /// Builds the function. `counter` is needed by `length` with `unit = "tokens"`; a reward
    /// model is loaded on `placement` (its device map and dtype; the CPU in f32 when `None`).
    pub fn build(
        &self,
        counter: Option<TokenCounter>,
    ) -> Result<Box<dyn RewardFunction>, RewardError> {
        self.build_on(counter, None)
    }

    /// [`RewardSpec::build`] with the reward model's placement.
    pub fn build_on(
        &self,
        counter: Option<TokenCounter>,
        placement: Option<(&fleet_models::DeviceMap, candle_core::DType)>,
    ) -> Result<Box<dyn RewardFunction>, RewardError> {
        Ok(match self {
            RewardSpec::RewardModel {
                model, revision, ..
            } => Box::new(crate::reward_model::RewardModel::load(
                model,
                revision.as_deref(),
                placement,
            )?),
            RewardSpec::Gsm8kExact { .. } => Box::new(Gsm8kExact::new()),
            RewardSpec::MultipleChoice { .. } => Box::new(MultipleChoice::new()),
            RewardSpec::Format {
                tags,
                final_line_prefix,
                ..
            } => Box::new(FormatReward::new(tags.clone(), final_line_prefix.clone())?),
            RewardSpec::Length {
                max_length,
                cache_length,
                unit,
                ..
            } => Box::new(LengthPenalty::new(
                *max_length,
                *cache_length,
                *unit,
                counter,
            )?),
            RewardSpec::Command {
                command,
                label,
                timeout_s,
                ..
            } => Box::new(crate::external::CommandReward::start(
                command.clone(),
                label.clone(),
                std::time::Duration::from_secs_f64(*timeout_s),
            )?),
            RewardSpec::Http {
                url,
                label,
                timeout_s,
                ..
            } => Box::new(crate::external::HttpReward::new(
                url.clone(),
                label.clone(),
                std::time::Duration::from_secs_f64(*timeout_s),
            )?),
        })
    }
}

fn check_timeout(timeout_s: f64) -> Result<(), String> {
    if timeout_s.is_finite() && timeout_s > 0.0 {
        Ok(())
    } else {
        Err(format!(
            "timeout_s = {timeout_s}: give the seconds to wait for an answer, a positive number"
        ))
    }
}

fn message_of(e: &RewardError) -> String {
    match e {
        RewardError::Config { message, .. } => message.clone(),
        other => other.to_string(),
    }
}

/// How many failures of each function [`BatchRewards`] keeps the messages of.
pub const MAX_ERRORS_KEPT: usize = 5;

/// One function's scores over a batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FuncScores {
    /// The function's name.
    pub name: String,
    /// Its weight.
    pub weight: f64,
    /// One value per completion; `None` for not applicable or failed.
    pub values: Vec<Option<f64>>,
    /// Completions on which it failed (`Err`).
    pub failed: usize,
    /// The first [`MAX_ERRORS_KEPT`] failures: completion index and message.
    pub errors: Vec<(usize, String)>,
    /// Completions scored 0 because their answer could not be read.
    pub unparsed: u64,
}

impl FuncScores {
    /// Mean over the completions it scored (TRL `rewards/<name>/mean`, a nanmean); `None`
    /// when it scored none.
    pub fn mean(&self) -> Option<f64> {
        nan_mean_std(&self.values).0
    }

    /// Unbiased std over the completions it scored (TRL `rewards/<name>/std`); `None` with
    /// fewer than 2.
    pub fn std(&self) -> Option<f64> {
        nan_mean_std(&self.values).1
    }
}

/// Rewards of a batch of completions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchRewards {
    /// The weighted sum per completion; `None` when any function gave `None` or failed.
    pub totals: Vec<Option<f64>>,
    /// Each function's scores, in declaration order.
    pub per_func: Vec<FuncScores>,
}

impl BatchRewards {
    /// The rewards of consecutive parts of one batch (the ranks' shares, in rank order) as
    /// one: values concatenated, counts summed, error indices moved to the whole batch's rows.
    pub fn concat(parts: Vec<BatchRewards>) -> BatchRewards {
        let mut out = BatchRewards {
            totals: Vec::new(),
            per_func: Vec::new(),
        };
        for part in parts {
            let offset = out.totals.len();
            out.totals.extend(part.totals);
            for (k, f) in part.per_func.into_iter().enumerate() {
                if k == out.per_func.len() {
                    out.per_func.push(FuncScores {
                        name: f.name.clone(),
                        weight: f.weight,
                        values: Vec::new(),
                        failed: 0,
                        errors: Vec::new(),
                        unparsed: 0,
                    });
                }
                let o = &mut out.per_func[k];
                o.values.extend(f.values);
                o.failed += f.failed;
                o.unparsed += f.unparsed;
                for (i, e) in f.errors {
                    if o.errors.len() < MAX_ERRORS_KEPT {
                        o.errors.push((i + offset, e));
                    }
                }
            }
        }
        out
    }

    /// When no completion has a total reward, why, per function (for
    /// [`RewardError::BatchUnscored`]); `None` when some completion has one.
    pub fn unscored(&self) -> Option<String> {
        if self.totals.is_empty() || self.totals.iter().any(Option::is_some) {
            return None;
        }
        let parts: Vec<String> = self
            .per_func
            .iter()
            .map(|f| {
                let absent = f.values.iter().filter(|v| v.is_none()).count() - f.failed;
                let mut part = format!("{}: {} failed, {absent} null", f.name, f.failed);
                if let Some((i, e)) = f.errors.first() {
                    part.push_str(&format!(" (first, completion {i}: {e})"));
                }
                part
            })
            .collect();
        Some(parts.join("; "))
    }

    /// Completions without a total reward.
    pub fn failed(&self) -> usize {
        self.totals.iter().filter(|t| t.is_none()).count()
    }

    /// Unparsed answers over all functions.
    pub fn unparsed(&self) -> u64 {
        self.per_func.iter().map(|f| f.unparsed).sum()
    }

    /// TRL's per-function metrics: `rewards/<name>/mean` and `rewards/<name>/std`.
    pub fn metrics(&self) -> BTreeMap<String, Option<f64>> {
        let mut out = BTreeMap::new();
        for f in &self.per_func {
            let (mean, std) = nan_mean_std(&f.values);
            out.insert(format!("rewards/{}/mean", f.name), mean);
            out.insert(format!("rewards/{}/std", f.name), std);
            out.insert(format!("rewards/{}/failed", f.name), Some(f.failed as f64));
        }
        out
    }
}

/// A sample that a function cannot score (from [`WeightedSum::check_samples`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SampleProblem {
    /// The sample id.
    pub id: String,
    /// The function's error.
    pub error: RewardError,
}

/// The weighted sum of several reward functions (TRL `reward_funcs` with `reward_weights`).
pub struct WeightedSum {
    funcs: Vec<(Box<dyn RewardFunction>, f64)>,
}

impl fmt::Debug for WeightedSum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .funcs
            .iter()
            .map(|(func, w)| format!("{} x {w}", func.name()))
            .collect();
        write!(f, "WeightedSum({})", parts.join(" + "))
    }
}

impl WeightedSum {
    /// The name of the sum as a function.
    pub const NAME: &'static str = "weighted_sum";

    /// Combines `funcs` with their weights: at least one, finite weights, distinct names.
    pub fn new(funcs: Vec<(Box<dyn RewardFunction>, f64)>) -> Result<Self, RewardError> {
        let err = |message: String| RewardError::Config {
            function: Self::NAME.to_string(),
            message,
        };
        if funcs.is_empty() {
            return Err(err(format!(
                "no reward functions: declare at least one (known: {})",
                RewardSpec::NAMES.join(", ")
            )));
        }
        for (i, (f, w)) in funcs.iter().enumerate() {
            if !w.is_finite() {
                return Err(err(format!(
                    "weight of `{}` is {w}: give a finite number",
                    f.name()
                )));
            }
            if funcs[..i].iter().any(|(g, _)| g.name() == f.name()) {
                return Err(err(format!(
                    "`{}` appears twice: each function may appear once",
                    f.name()
                )));
            }
        }
        Ok(WeightedSum { funcs })
    }

    /// Builds the functions declared in the config. `counter` is needed by `length` with
    /// `unit = "tokens"`; a reward model goes to the CPU (see [`WeightedSum::from_specs_on`]).
    pub fn from_specs(
        specs: &[RewardSpec],
        counter: Option<TokenCounter>,
    ) -> Result<Self, RewardError> {
        Self::from_specs_on(specs, counter, None)
    }

    /// [`WeightedSum::from_specs`] with the reward model placed on `placement` (its device
    /// map and dtype).
    pub fn from_specs_on(
        specs: &[RewardSpec],
        counter: Option<TokenCounter>,
        placement: Option<(&fleet_models::DeviceMap, candle_core::DType)>,
    ) -> Result<Self, RewardError> {
        let funcs = specs
            .iter()
            .map(|s| Ok((s.build_on(counter.clone(), placement)?, s.weight())))
            .collect::<Result<Vec<_>, RewardError>>()?;
        Self::new(funcs)
    }

    /// The functions' names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.funcs.iter().map(|(f, _)| f.name()).collect()
    }

    /// Scores a batch: completion `i` (text `completions[i]`, tokens `completion_ids[i]`)
    /// answers `prompts[i]` for `samples[i]` (a prompt's sample repeated for each of its G
    /// completions).
    pub fn score_batch<P: AsRef<str>, C: AsRef<str>>(
        &self,
        prompts: &[P],
        completions: &[C],
        completion_ids: &[Vec<u32>],
        samples: &[&Sample],
    ) -> Result<BatchRewards, RewardError> {
        let n = completions.len();
        if prompts.len() != n || samples.len() != n || completion_ids.len() != n {
            return Err(RewardError::LengthMismatch {
                prompts: prompts.len(),
                completions: n,
                completion_ids: completion_ids.len(),
                samples: samples.len(),
            });
        }
        let mut per_func = Vec::with_capacity(self.funcs.len());
        for (func, weight) in &self.funcs {
            func.take_unparsed();
            let mut scores = FuncScores {
                name: func.name().to_string(),
                weight: *weight,
                values: Vec::with_capacity(n),
                failed: 0,
                errors: Vec::new(),
                unparsed: 0,
            };
            let items: Vec<Completion<'_>> = (0..n)
                .map(|i| Completion {
                    prompt: prompts[i].as_ref(),
                    text: completions[i].as_ref(),
                    ids: &completion_ids[i],
                    sample: samples[i],
                })
                .collect();
            for (i, outcome) in func.score_many(&items).into_iter().enumerate() {
                match finite(func.as_ref(), samples[i], outcome) {
                    Ok(v) => scores.values.push(v),
                    Err(e) => {
                        scores.values.push(None);
                        scores.failed += 1;
                        if scores.errors.len() < MAX_ERRORS_KEPT {
                            scores.errors.push((i, e.to_string()));
                        }
                    }
                }
            }
            scores.unparsed = func.take_unparsed();
            per_func.push(scores);
        }
        let totals = (0..n)
            .map(|i| {
                per_func
                    .iter()
                    .try_fold(0.0, |acc, f| f.values[i].map(|v| acc + f.weight * v))
            })
            .collect();
        Ok(BatchRewards { totals, per_func })
    }

    /// The samples some function cannot score at all (bad reference, missing options), so that
    /// they can be reported before training.
    pub fn check_samples(&self, samples: &[Sample]) -> Vec<SampleProblem> {
        let mut out = Vec::new();
        for s in samples {
            for (f, _) in &self.funcs {
                if let Err(error) = f.check_sample(s) {
                    out.push(SampleProblem {
                        id: s.id.clone(),
                        error,
                    });
                    break;
                }
            }
        }
        out
    }
}

/// Calls `func` and turns a non-finite score into an error.
fn checked(
    func: &dyn RewardFunction,
    prompt: &str,
    completion: &str,
    sample: &Sample,
) -> Result<Option<f64>, RewardError> {
    finite(func, sample, func.score(prompt, completion, sample))
}

/// A score that is NaN or infinite is the function's failure, not a reward.
fn finite(
    func: &dyn RewardFunction,
    sample: &Sample,
    outcome: Result<Option<f64>, RewardError>,
) -> Result<Option<f64>, RewardError> {
    match outcome? {
        Some(v) if !v.is_finite() => Err(RewardError::NonFinite {
            function: func.name().to_string(),
            id: sample.id.clone(),
            value: v,
        }),
        other => Ok(other),
    }
}

impl RewardFunction for WeightedSum {
    fn name(&self) -> &str {
        Self::NAME
    }

    /// The weighted sum; `Ok(None)` when a function gives `None`, `Err` on the first failure.
    fn score(
        &self,
        prompt: &str,
        completion: &str,
        sample: &Sample,
    ) -> Result<Option<f64>, RewardError> {
        let mut total = 0.0;
        for (f, w) in &self.funcs {
            match checked(f.as_ref(), prompt, completion, sample)? {
                Some(v) => total += w * v,
                None => return Ok(None),
            }
        }
        Ok(Some(total))
    }

    fn take_unparsed(&self) -> u64 {
        self.funcs.iter().map(|(f, _)| f.take_unparsed()).sum()
    }

    fn check_sample(&self, sample: &Sample) -> Result<(), RewardError> {
        self.funcs
            .iter()
            .try_for_each(|(f, _)| f.check_sample(sample))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(num: i128, den: i128) -> Rational {
        Rational::new(num, den).unwrap()
    }

    fn num(text: &str) -> Result<Rational, NumberUnparsed> {
        extract_completion_number(text)
    }

    #[test]
    fn completion_numbers_follow_the_documented_rules() {
        assert_eq!(num("so the total is 1,000 dollars."), Ok(r(1000, 1)));
        assert_eq!(num("It costs $1,234,567.50"), Ok(r(123456750, 100)));
        assert_eq!(num("The temperature is -5 degrees"), Ok(r(-5, 1)));
        assert_eq!(num("x = \u{2212}7"), Ok(r(-7, 1)));
        assert_eq!(
            num("pages 3-5"),
            Ok(r(5, 1)),
            "a range's dash is not a sign"
        );
        assert_eq!(num("3.0"), Ok(r(3, 1)));
        assert_eq!(num("It weighs 18kg."), Ok(r(18, 1)));
        assert_eq!(num("about 50% of them"), Ok(r(50, 1)));
        assert_eq!(num("half is .5"), Ok(r(1, 2)));
        assert_eq!(num("she ate 3/4 of it"), Ok(r(3, 4)));
        assert_eq!(
            num("1,00 items"),
            Ok(r(0, 1)),
            "not a thousands group: 1 and 00"
        );
        assert_eq!(num("list: 3,4,5"), Ok(r(5, 1)));
        // Markers beat the last number.
        assert_eq!(num("#### 72\nI checked 3 times"), Ok(r(72, 1)));
        assert_eq!(num("The answer is 42. Then 7 more steps."), Ok(r(42, 1)));
        assert_eq!(num("Final Answer:\n\n**18**\n(3 eggs)"), Ok(r(18, 1)));
        assert_eq!(num("So \\boxed{18} and later 5"), Ok(r(18, 1)));
        assert_eq!(num("\\boxed{\\$1,000}"), Ok(r(1000, 1)));
        assert_eq!(num("\\boxed{\\frac{3}{4}}"), Ok(r(3, 4)));
        assert_eq!(num("\\boxed{-\\dfrac{1}{2}}"), Ok(r(-1, 2)));
        assert_eq!(num("\\boxed{18 \\text{ dollars}}"), Ok(r(18, 1)));
        // Think blocks.
        assert_eq!(num("<think>maybe 5</think>The answer is 6"), Ok(r(6, 1)));
        assert_eq!(num("reasoning 5</think> 7"), Ok(r(7, 1)));
        // Unparsed.
        assert_eq!(
            num("<think>5 and 6"),
            Err(NumberUnparsed::UnterminatedThink)
        );
        assert_eq!(num("no digits here"), Err(NumberUnparsed::NoNumber));
        assert_eq!(
            num("I got 5. The answer is unknown."),
            Err(NumberUnparsed::MarkerWithoutNumber)
        );
        assert_eq!(num("#### none"), Err(NumberUnparsed::MarkerWithoutNumber));
        assert_eq!(num("\\boxed{3, 5}"), Err(NumberUnparsed::Ambiguous));
        assert_eq!(num("\\boxed{5"), Err(NumberUnparsed::UnbalancedBox));
        assert_eq!(
            num("123456789012345678901234567890123456789012"),
            Err(NumberUnparsed::TooLong)
        );
    }

    #[test]
    fn reference_numbers() {
        assert_eq!(extract_reference_number("48/2 = 24\n#### 72"), Ok(r(72, 1)));
        assert_eq!(extract_reference_number("#### 1,000"), Ok(r(1000, 1)));
        assert_eq!(extract_reference_number("-3.50"), Ok(r(-7, 2)));
        assert_eq!(extract_reference_number("$18"), Ok(r(18, 1)));
        assert!(extract_reference_number("#### ").is_err());
        assert!(extract_reference_number("seventy-two").is_err());
        assert!(extract_reference_number("72 apples").is_err());
    }

    #[test]
    fn gsm8k_exact_scores_and_counts_unparsed() {
        let f = Gsm8kExact::new();
        let s = Sample::text("q", "...", "She has 3 + 4 = 7\n#### 7");
        assert_eq!(f.score("", "so she has 7.0 apples", &s), Ok(Some(1.0)));
        assert_eq!(f.score("", "#### 8", &s), Ok(Some(0.0)));
        assert_eq!(f.take_unparsed(), 0);
        assert_eq!(f.score("", "I don't know", &s), Ok(Some(0.0)));
        assert_eq!(f.take_unparsed(), 1);
        assert_eq!(f.take_unparsed(), 0, "the counter resets");
        let bad = Sample::text("b", "...", "no number here");
        let err = f.score("", "7", &bad).unwrap_err();
        assert!(matches!(err, RewardError::BadReference { .. }));
        assert!(err.to_string().contains("sample b"), "{err}");
        assert!(f.check_sample(&bad).is_err() && f.check_sample(&s).is_ok());
    }

    fn mc_sample() -> Sample {
        let mut s = Sample::text("m", "Which?", "B");
        s.options = Some(vec!["O-RU".into(), "O-DU".into(), "O-CU".into()]);
        s.correct_option = Some(1);
        s
    }

    #[test]
    fn multiple_choice_uses_the_answer_parser_argo_uses() {
        let f = MultipleChoice::new();
        let s = mc_sample();
        assert_eq!(f.score("", "The answer is 2", &s), Ok(Some(1.0)));
        assert_eq!(f.score("", "Answer: (B)", &s), Ok(Some(1.0)));
        assert_eq!(f.score("", "O-CU", &s), Ok(Some(0.0)));
        assert_eq!(f.take_unparsed(), 0);
        assert_eq!(f.score("", "2 or 3", &s), Ok(Some(0.0)));
        assert_eq!(f.score("", "", &s), Ok(Some(0.0)));
        assert_eq!(f.take_unparsed(), 2);
        let plain = Sample::text("p", "q", "4");
        assert!(matches!(
            f.score("", "4", &plain),
            Err(RewardError::MissingField {
                field: "options",
                ..
            })
        ));
    }

    #[test]
    fn format_reward_checks_tags_and_final_line() {
        let f = FormatReward::new(
            vec![
                ["<think>".into(), "</think>".into()],
                ["<answer>".into(), "</answer>".into()],
            ],
            None,
        )
        .unwrap();
        assert!(f.passes("<think>a</think>\n<answer>5</answer>"));
        assert!(
            !f.passes("<answer>5</answer><think>a</think>"),
            "order matters"
        );
        assert!(!f.passes("<think>a</think><think>b</think><answer>5</answer>"));
        assert!(!f.passes("<think>a</think>"));
        let g = FormatReward::new(vec![], Some("####".into())).unwrap();
        assert!(g.passes("work\n#### 42\n\n"));
        assert!(!g.passes("#### 42\nmore"));
        let s = Sample::text("x", "", "1");
        assert_eq!(g.score("", "#### 1", &s), Ok(Some(1.0)));
        assert!(FormatReward::new(vec![], None).is_err());
        assert!(FormatReward::new(vec![["".into(), "x".into()]], None).is_err());
    }

    #[test]
    fn length_penalty_is_dapos_soft_punishment() {
        let f = LengthPenalty::new(10, 4, LengthUnit::Chars, None).unwrap();
        assert_eq!(f.penalty(6), 0.0);
        assert_eq!(f.penalty(8), -0.5);
        assert_eq!(f.penalty(10), -1.0);
        assert_eq!(f.penalty(11), -1.0);
        let s = Sample::text("x", "", "1");
        assert_eq!(f.score("", "abcdefgh", &s), Ok(Some(-0.5)));
        assert!(matches!(
            LengthPenalty::new(10, 4, LengthUnit::Tokens, None),
            Err(RewardError::NeedsTokenCounter { .. })
        ));
        assert!(LengthPenalty::new(4, 10, LengthUnit::Chars, None).is_err());
        let words: TokenCounter = Arc::new(|t: &str| Ok(t.split_whitespace().count()));
        let t = LengthPenalty::new(10, 4, LengthUnit::Tokens, Some(words)).unwrap();
        assert_eq!(t.score("", "a b c d e f g h", &s), Ok(Some(-0.5)));
        let failing: TokenCounter = Arc::new(|_: &str| Err("bad text".into()));
        let t = LengthPenalty::new(10, 4, LengthUnit::Tokens, Some(failing)).unwrap();
        assert!(matches!(
            t.score("", "a", &s),
            Err(RewardError::TokenCount { .. })
        ));
    }

    /// Fails on samples whose id starts with `fail`, returns None on `skip`.
    struct Flaky;
    impl RewardFunction for Flaky {
        fn name(&self) -> &str {
            "flaky"
        }
        fn score(&self, _p: &str, _c: &str, s: &Sample) -> Result<Option<f64>, RewardError> {
            if s.id.starts_with("fail") {
                Err(RewardError::Config {
                    function: "flaky".into(),
                    message: "boom".into(),
                })
            } else if s.id.starts_with("skip") {
                Ok(None)
            } else if s.id.starts_with("nan") {
                Ok(Some(f64::NAN))
            } else {
                Ok(Some(0.5))
            }
        }
    }

    #[test]
    fn weighted_sum_never_defaults_a_missing_component() {
        let sum = WeightedSum::new(vec![
            (Box::new(Gsm8kExact::new()), 1.0),
            (Box::new(Flaky), 2.0),
        ])
        .unwrap();
        let ok = Sample::text("ok", "", "#### 3");
        let fail = Sample::text("fail1", "", "#### 3");
        let skip = Sample::text("skip1", "", "#### 3");
        let nan = Sample::text("nan1", "", "#### 3");
        let samples = [&ok, &ok, &fail, &skip, &nan];
        let completions = ["3", "what?", "3", "3", "3"];
        let prompts = [""; 5];
        let ids = vec![Vec::new(); 5];
        let b = sum
            .score_batch(&prompts, &completions, &ids, &samples)
            .unwrap();
        assert_eq!(b.totals, vec![Some(2.0), Some(1.0), None, None, None]);
        assert_eq!(b.failed(), 3);
        assert_eq!(b.unparsed(), 1);
        let flaky = &b.per_func[1];
        assert_eq!(flaky.failed, 2, "an error and a NaN");
        assert_eq!(flaky.errors.len(), 2);
        assert_eq!(flaky.values, vec![Some(0.5), Some(0.5), None, None, None]);
        let m = b.metrics();
        assert_eq!(m["rewards/gsm8k_exact/mean"], Some(0.8));
        assert_eq!(m["rewards/flaky/mean"], Some(0.5));
        assert_eq!(m["rewards/flaky/std"], Some(0.0));
        // As a function.
        assert_eq!(sum.score("", "3", &ok), Ok(Some(2.0)));
        assert_eq!(sum.score("", "3", &skip), Ok(None));
        assert!(sum.score("", "3", &fail).is_err());
        assert!(matches!(
            sum.score_batch(&prompts[..2], &completions, &ids, &samples)
                .unwrap_err(),
            RewardError::LengthMismatch { .. }
        ));
        assert!(WeightedSum::new(vec![(Box::new(Flaky), 1.0), (Box::new(Flaky), 1.0)]).is_err());
        assert!(WeightedSum::new(vec![(Box::new(Flaky), f64::NAN)]).is_err());
    }

    #[test]
    fn specs_parse_from_toml_and_build() {
        #[derive(Debug, Deserialize)]
        struct Wrap {
            reward_funcs: Vec<RewardSpec>,
        }
        let text = r#"
[[reward_funcs]]
name = "gsm8k_exact"

[[reward_funcs]]
name = "format"
weight = 0.1
tags = [["<think>", "</think>"]]

[[reward_funcs]]
name = "length"
max_length = 256
cache_length = 64
unit = "chars"
"#;
        let w: Wrap = toml::from_str(text).unwrap();
        assert_eq!(w.reward_funcs[0].weight(), 1.0);
        assert_eq!(w.reward_funcs[1].weight(), 0.1);
        for s in &w.reward_funcs {
            s.validate().unwrap();
        }
        let sum = WeightedSum::from_specs(&w.reward_funcs, None).unwrap();
        assert_eq!(sum.names(), vec!["gsm8k_exact", "format", "length"]);
        let problems = sum.check_samples(&[Sample::text("bad", "", "n/a"), mc_sample()]);
        assert_eq!(problems.len(), 2, "{problems:?}");

        let unknown = toml::from_str::<Wrap>("[[reward_funcs]]\nname = \"exact\"\n").unwrap_err();
        assert!(unknown.to_string().contains("gsm8k_exact"), "{unknown}");
        let extra = toml::from_str::<Wrap>("[[reward_funcs]]\nname = \"gsm8k_exact\"\ntags = []\n")
            .unwrap_err();
        assert!(extra.to_string().contains("tags"), "{extra}");
        let tokens = RewardSpec::Length {
            weight: 1.0,
            max_length: 8,
            cache_length: 2,
            unit: LengthUnit::Tokens,
        };
        assert!(tokens.build(None).is_err());
        let bad = RewardSpec::Format {
            weight: 1.0,
            tags: vec![],
            final_line_prefix: None,
        };
        assert!(bad.validate().unwrap_err().contains("nothing to check"));
    }
}
