//! Multiple-choice datasets: ORAN-Bench-13K and a generic JSONL format.
//!
//! Every loader reads JSON Lines, one item per line. A line that cannot be used is skipped,
//! counted by [`SkipReason`] and remembered with its file and line number in the [`LoadReport`];
//! the rest of the file goes on. Only problems with the files themselves (missing, unreadable,
//! nothing usable at all) are errors ([`DatasetError`]).
//!
//! # ORAN-Bench-13K
//!
//! [`load_oran`] reads `fin_E.json`, `fin_M.json` and `fin_H.json` (easy, medium, hard) from the
//! `Benchmark/` folder of github.com/prnshv/ORAN-Bench-13K. Each line is a JSON array
//! `["question", ["1. option", "2. option", ...], "3"]`: options carry an `N. ` prefix and the
//! answer is the 1-based option number as a string. [`Difficulty::Mixed`] pools the three files
//! (see [`Dataset::sample`] for how a sample is drawn from the pool).
//!
//! # Generic JSONL
//!
//! [`load_jsonl`] reads one JSON object per line:
//!
//! ```json
//! {"id": "q1", "question": "Which unit hosts the RLC?", "options": ["O-RU", "O-DU", "O-CU-UP"], "answer": 2}
//! ```
//!
//! - `question` (string, required).
//! - `options` or `choices` (required): an array of 3 to 6 strings, or an object whose keys are
//!   exactly the labels `A`, `B`, ... or `1`, `2`, ... (`{"A": "O-RU", "B": "O-DU", ...}`), put
//!   in label order. A label prefix such as `1. `, `A) ` or `(B) ` is stripped when *every* option
//!   carries the prefix of its own position (so `"A. Smith"` alone is left alone).
//! - `answer` (required unless `answer_index` is given), the correct option as
//!   - a **1-based** number, as a JSON integer (`2`) or a string (`"2"`);
//!   - a letter `A` to `F`, either case, optionally written `(B)`, `B.` or `B)`;
//!   - the full text of exactly one option (compared ignoring case and surrounding whitespace).
//!
//!   A number is read as a number even when an option's text is that number.
//! - `answer_index` (optional): the **0-based** index, for files written from Python lists
//!   (MMLU style). If both `answer` and `answer_index` are present they must agree. Note that a
//!   plain numeric `answer` is 1-based: a file whose `answer` holds 0-based indices loads shifted
//!   by one (its `0` answers are skipped as out of range, with a hint to use `answer_index`).
//! - `id` (optional string or integer): must be unique; when absent the id is
//!   `<file stem>-<line number, 6 digits>`.
//! - `difficulty` (optional): `easy`, `medium` or `hard`.
//!
//! Other fields (explanations, subjects, ...) are ignored.
//!
//! # What is skipped
//!
//! Checked in this order, the first failing check names the reason: blank lines are not items
//! (counted separately, not skipped); malformed JSON or invalid UTF-8; wrong shape (missing or
//! mistyped field); empty question text; no options; fewer than 3 or more than 6 options; an
//! empty option; an answer that cannot be read; an answer outside the options; a correct
//! option whose text also appears at another position; an exact duplicate; a repeated id
//! (generic format).
//!
//! **Repeated option texts.** Some ORAN items list the same text twice (compared ignoring case
//! and whitespace). When the repeated text is the *correct* option's, the item is skipped as
//! [`SkipReason::AmbiguousCorrect`]: a model choosing the twin would be marked wrong for the right
//! answer. When a distractor is repeated the item still has one right answer and is kept;
//! [`FileReport::repeated_option_texts`] counts those.
//!
//! **Exact duplicates are dropped**: an item whose trimmed question, label-stripped options and
//! correct option all equal an earlier item's in the same load (all three files for `mixed`) is
//! skipped as [`SkipReason::Duplicate`], keeping the first. Counting it twice would weight it
//! twice in accuracy. Items that repeat only the question text, with different options or a
//! different answer, are kept: they are different questions; [`FileReport::repeated_question_texts`]
//! counts them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use fleet_data::jsonl::JsonlLine;
pub use fleet_data::source::{SourceLocation, MAX_EXAMPLES_PER_REASON};

/// Fewest options an item may have.
pub const MIN_OPTIONS: usize = 3;
/// Most options an item may have (labels 1-6 or A-F).
pub const MAX_OPTIONS: usize = 6;

/// The ORAN-Bench-13K files, in the order they are read for `mixed`.
pub const ORAN_FILES: [(Difficulty, &str); 3] = [
    (Difficulty::Easy, "fin_E.json"),
    (Difficulty::Medium, "fin_M.json"),
    (Difficulty::Hard, "fin_H.json"),
];

/// Where ORAN-Bench-13K comes from, for error messages.
const ORAN_HINT: &str =
    "point the data directory at the folder holding fin_E.json, fin_M.json and \
     fin_H.json (the Benchmark/ folder of github.com/prnshv/ORAN-Bench-13K; in this workspace \
     ../shared/data/oran-bench-13k)";

/// Errors of the dataset loaders. Each names the file at fault and what to do.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// The ORAN-Bench directory does not exist or is not a directory.
    #[error("ORAN-Bench-13K directory {} not found or not a directory; {hint}", dir.display())]
    MissingDir {
        /// The directory that was looked for.
        dir: PathBuf,
        /// What to do.
        hint: String,
    },
    /// A dataset file does not exist.
    #[error("dataset file {} not found; {hint}", path.display())]
    MissingFile {
        /// The path that was looked for.
        path: PathBuf,
        /// What to do.
        hint: String,
    },
    /// A dataset file exists but cannot be read.
    #[error("cannot read dataset file {}: {source}; check its permissions", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Every line of a file was blank or skipped.
    #[error(
        "no usable questions in {}: {summary}; expected {expected}",
        path.display()
    )]
    NoQuestions {
        /// The file.
        path: PathBuf,
        /// What was skipped, with line numbers.
        summary: String,
        /// The format the loader expected.
        expected: &'static str,
    },
    /// A difficulty name that is not one of easy, medium, hard, mixed.
    #[error("unknown difficulty {value:?}: expected one of easy, medium, hard, mixed")]
    UnknownDifficulty {
        /// The value given.
        value: String,
    },
    /// A sample of zero questions was asked for.
    #[error("n_questions must be at least 1 (got 0); leave it unset to use every question")]
    ZeroQuestions,
}

/// ORAN-Bench difficulty, or `Mixed` for all three files pooled.
///
/// Parses from `easy`, `medium`, `hard`, `mixed` (any case); serialises lowercase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Difficulty {
    /// `fin_E.json`.
    Easy,
    /// `fin_M.json`.
    Medium,
    /// `fin_H.json`.
    Hard,
    /// All three files, pooled.
    Mixed,
}

impl Difficulty {
    /// The lowercase name (`easy`, ...), as the CLI spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Difficulty::Easy => "easy",
            Difficulty::Medium => "medium",
            Difficulty::Hard => "hard",
            Difficulty::Mixed => "mixed",
        }
    }

    /// The single levels this selection covers: itself, or all three for `Mixed`.
    pub fn levels(self) -> &'static [Difficulty] {
        match self {
            Difficulty::Easy => &[Difficulty::Easy],
            Difficulty::Medium => &[Difficulty::Medium],
            Difficulty::Hard => &[Difficulty::Hard],
            Difficulty::Mixed => &[Difficulty::Easy, Difficulty::Medium, Difficulty::Hard],
        }
    }

    /// The ORAN-Bench file of a single level; `None` for `Mixed`.
    pub fn oran_file(self) -> Option<&'static str> {
        ORAN_FILES
            .iter()
            .find(|(d, _)| *d == self)
            .map(|(_, file)| *file)
    }

    /// The letter used in ORAN question ids (`E`, `M`, `H`); `X` for `Mixed`, which no item has.
    fn code(self) -> char {
        match self {
            Difficulty::Easy => 'E',
            Difficulty::Medium => 'M',
            Difficulty::Hard => 'H',
            Difficulty::Mixed => 'X',
        }
    }
}

impl fmt::Display for Difficulty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Difficulty {
    type Err = DatasetError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "easy" => Ok(Difficulty::Easy),
            "medium" => Ok(Difficulty::Medium),
            "hard" => Ok(Difficulty::Hard),
            "mixed" => Ok(Difficulty::Mixed),
            _ => Err(DatasetError::UnknownDifficulty {
                value: s.to_string(),
            }),
        }
    }
}

/// How option labels are written when a question is shown to a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LabelStyle {
    /// `1`, `2`, ... as ORAN-Bench writes them.
    #[default]
    Number,
    /// `A`, `B`, ...
    Letter,
}

impl LabelStyle {
    /// The label of the 0-based option `index` (`"3"` or `"C"`).
    pub fn label(self, index: usize) -> String {
        match self {
            LabelStyle::Number => (index + 1).to_string(),
            LabelStyle::Letter => match u8::try_from(index) {
                Ok(i) if i < 26 => char::from(b'A' + i).to_string(),
                // Past Z there is no letter; fall back to the number rather than panic.
                _ => (index + 1).to_string(),
            },
        }
    }
}

/// One multiple-choice question.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Question {
    /// Stable id: `oran-H-000123` for line 123 of `fin_H.json`; the file's `id` or
    /// `<stem>-<line>` for the generic format. Sampling orders by it.
    pub id: String,
    /// The question text, trimmed.
    pub question: String,
    /// Option texts, trimmed, with the `N. ` label prefix stripped (see [`Question::display_option`]).
    pub options: Vec<String>,
    /// The correct option, 0-based.
    pub correct: usize,
    /// The difficulty level (ORAN: always set; generic: the optional `difficulty` field).
    pub difficulty: Option<Difficulty>,
    /// File and line it was read from.
    pub source: SourceLocation,
}

impl Question {
    /// Number of options.
    pub fn num_options(&self) -> usize {
        self.options.len()
    }

    /// Option `index` (0-based) with its label, as ORAN writes it: `"3. O-RU"` or `"C. O-RU"`.
    /// `None` if there is no such option.
    pub fn display_option(&self, index: usize, style: LabelStyle) -> Option<String> {
        self.options
            .get(index)
            .map(|text| format!("{}. {text}", style.label(index)))
    }

    /// All options with labels, one string each, in order.
    pub fn display_options(&self, style: LabelStyle) -> Vec<String> {
        self.options
            .iter()
            .enumerate()
            .map(|(i, text)| format!("{}. {text}", style.label(i)))
            .collect()
    }

    /// The label of the correct option (`"3"` or `"C"`).
    pub fn correct_label(&self, style: LabelStyle) -> String {
        style.label(self.correct)
    }
}

/// Why a line was skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// Not valid JSON, or not valid UTF-8.
    MalformedJson,
    /// Valid JSON of the wrong shape: a field missing or of the wrong type.
    BadFormat,
    /// The question text is empty (ORAN-Bench medium has such items).
    EmptyQuestion,
    /// The option list is empty.
    NoOptions,
    /// One or two options (fewer than [`MIN_OPTIONS`]).
    TooFewOptions,
    /// More than [`MAX_OPTIONS`] options.
    TooManyOptions,
    /// An option whose text is empty once its label is stripped.
    EmptyOption,
    /// An answer that is neither a number, a letter nor an option's text.
    BadAnswer,
    /// An answer that names no option (e.g. 5 with 4 options, or 0).
    AnswerOutOfRange,
    /// The correct option's text also appears at another position, so choosing the twin would
    /// be marked wrong (or a text answer matches several options).
    AmbiguousCorrect,
    /// The same question, options and answer as an earlier item; the first is kept.
    Duplicate,
    /// An id already used by an earlier, different item (generic format).
    DuplicateId,
}

impl SkipReason {
    /// Every reason, in report order.
    pub const ALL: [SkipReason; 12] = [
        SkipReason::MalformedJson,
        SkipReason::BadFormat,
        SkipReason::EmptyQuestion,
        SkipReason::NoOptions,
        SkipReason::TooFewOptions,
        SkipReason::TooManyOptions,
        SkipReason::EmptyOption,
        SkipReason::BadAnswer,
        SkipReason::AnswerOutOfRange,
        SkipReason::AmbiguousCorrect,
        SkipReason::Duplicate,
        SkipReason::DuplicateId,
    ];

    /// Short human name, as used in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::MalformedJson => "malformed JSON",
            SkipReason::BadFormat => "wrong format",
            SkipReason::EmptyQuestion => "empty question",
            SkipReason::NoOptions => "no options",
            SkipReason::TooFewOptions => "too few options",
            SkipReason::TooManyOptions => "too many options",
            SkipReason::EmptyOption => "empty option",
            SkipReason::BadAnswer => "unreadable answer",
            SkipReason::AnswerOutOfRange => "answer out of range",
            SkipReason::AmbiguousCorrect => "correct option text repeated",
            SkipReason::DuplicateId => "duplicate id",
            SkipReason::Duplicate => "exact duplicate",
        }
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One skipped line of [`FileReport::path`].
pub type SkippedLine = fleet_data::jsonl::SkippedLine<SkipReason>;

/// What one file contributed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileReport {
    /// The file.
    pub path: PathBuf,
    /// The ORAN difficulty of the file; `None` for generic files.
    pub difficulty: Option<Difficulty>,
    /// Lines in the file (a final line without a newline counts; the empty rest after the last
    /// newline does not).
    pub lines: usize,
    /// Blank lines, ignored (not items, not skipped).
    pub blank_lines: usize,
    /// Items loaded.
    pub loaded: usize,
    /// Skipped items by reason (reasons with a zero count are absent).
    pub skipped: BTreeMap<SkipReason, usize>,
    /// The skipped lines, in file order, at most [`MAX_EXAMPLES_PER_REASON`] per reason.
    pub skipped_lines: Vec<SkippedLine>,
    /// Loaded items whose question text equals an earlier loaded item's in this file, with
    /// different options or answer (kept; reported so that readers know).
    pub repeated_question_texts: usize,
    /// Loaded items in which a wrong option's text appears twice (kept: the right answer is
    /// still unique).
    pub repeated_option_texts: usize,
    /// How often each option position is the correct one among loaded items (index 0 = first
    /// option): ORAN-Bench is skewed, so this gives the accuracy of always answering one option.
    pub correct_positions: Vec<usize>,
}

impl FileReport {
    fn new(path: &Path, difficulty: Option<Difficulty>) -> Self {
        FileReport {
            path: path.to_path_buf(),
            difficulty,
            lines: 0,
            blank_lines: 0,
            loaded: 0,
            skipped: BTreeMap::new(),
            skipped_lines: Vec::new(),
            repeated_question_texts: 0,
            repeated_option_texts: 0,
            correct_positions: vec![0; MAX_OPTIONS],
        }
    }

    /// Total items skipped.
    pub fn skipped_total(&self) -> usize {
        self.skipped.values().sum()
    }

    /// Count of one reason (0 if none).
    pub fn skipped_for(&self, reason: SkipReason) -> usize {
        self.skipped.get(&reason).copied().unwrap_or(0)
    }

    /// The remembered skipped lines of one reason.
    pub fn lines_for(&self, reason: SkipReason) -> impl Iterator<Item = &SkippedLine> {
        self.skipped_lines
            .iter()
            .filter(move |s| s.reason == reason)
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

    /// One line per reason: `3 no options (lines 12, 40, 41, ...)`.
    fn summary(&self) -> String {
        if self.skipped.is_empty() {
            return format!("{} blank lines, nothing else", self.blank_lines);
        }
        let parts: Vec<String> = self
            .skipped
            .iter()
            .map(|(reason, n)| {
                let mut lines: Vec<String> = self
                    .lines_for(*reason)
                    .take(3)
                    .map(|s| s.line.to_string())
                    .collect();
                if *n > 3 {
                    lines.push("...".into());
                }
                let first = self.lines_for(*reason).next();
                let detail = first.filter(|s| !s.detail.is_empty());
                match (*n, detail) {
                    // One line: `1 wrong format (line 2: missing field ...)`.
                    (1, Some(d)) => format!("1 {reason} (line {}: {})", d.line, d.detail),
                    (1, None) => format!("1 {reason} (line {})", lines.join(", ")),
                    (_, Some(d)) => format!(
                        "{n} {reason} (lines {}; line {}: {})",
                        lines.join(", "),
                        d.line,
                        d.detail
                    ),
                    (_, None) => format!("{n} {reason} (lines {})", lines.join(", ")),
                }
            })
            .collect();
        parts.join(", ")
    }
}

impl fmt::Display for FileReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let level = self
            .difficulty
            .map(|d| format!(" ({d})"))
            .unwrap_or_default();
        write!(
            f,
            "{}{level}: {} lines, {} loaded, {} skipped",
            self.path.display(),
            self.lines,
            self.loaded,
            self.skipped_total()
        )?;
        if self.blank_lines > 0 {
            write!(f, ", {} blank", self.blank_lines)?;
        }
        for (reason, n) in &self.skipped {
            write!(f, "\n  {n:>6} {reason}")?;
            let examples: Vec<&SkippedLine> = self.lines_for(*reason).take(3).collect();
            for (i, ex) in examples.iter().enumerate() {
                let sep = if i == 0 { ": " } else { "; " };
                write!(f, "{sep}line {}", ex.line)?;
                if !ex.detail.is_empty() {
                    write!(f, " ({})", ex.detail)?;
                }
            }
            if *n > examples.len() {
                write!(f, "; ...")?;
            }
        }
        if self.repeated_question_texts > 0 {
            write!(
                f,
                "\n  kept {} whose question text repeats an earlier one with other options or answer",
                items(self.repeated_question_texts)
            )?;
        }
        if self.repeated_option_texts > 0 {
            write!(
                f,
                "\n  kept {} in which a wrong option's text appears twice",
                items(self.repeated_option_texts)
            )?;
        }
        if self.loaded > 0 {
            let shares: Vec<String> = self
                .correct_positions
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(i, n)| format!("{}: {:.1}%", i + 1, 100.0 * *n as f64 / self.loaded as f64))
                .collect();
            write!(f, "\n  correct option: {}", shares.join(", "))?;
        }
        Ok(())
    }
}

/// `1 item`, `2 items`.
fn items(n: usize) -> String {
    if n == 1 {
        "1 item".to_string()
    } else {
        format!("{n} items")
    }
}

/// What a load read and skipped, file by file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReport {
    /// One entry per file, in reading order.
    pub files: Vec<FileReport>,
}

impl LoadReport {
    /// Items loaded over all files.
    pub fn loaded(&self) -> usize {
        self.files.iter().map(|f| f.loaded).sum()
    }

    /// Items skipped over all files.
    pub fn skipped(&self) -> usize {
        self.files.iter().map(FileReport::skipped_total).sum()
    }

    /// Skipped items by reason over all files.
    pub fn skipped_by_reason(&self) -> BTreeMap<SkipReason, usize> {
        let mut out = BTreeMap::new();
        for file in &self.files {
            for (reason, n) in &file.skipped {
                *out.entry(*reason).or_insert(0) += n;
            }
        }
        out
    }

    /// The report of the file whose name (last path component) is `name`.
    pub fn file(&self, name: &str) -> Option<&FileReport> {
        self.files
            .iter()
            .find(|f| f.path.file_name().is_some_and(|n| n == name))
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "loaded {} questions, skipped {}",
            self.loaded(),
            self.skipped()
        )?;
        let by_reason = self.skipped_by_reason();
        if !by_reason.is_empty() {
            let parts: Vec<String> = by_reason
                .iter()
                .map(|(reason, n)| format!("{n} {reason}"))
                .collect();
            write!(f, " ({})", parts.join(", "))?;
        }
        for file in &self.files {
            write!(f, "\n{file}")?;
        }
        Ok(())
    }
}

/// Loaded questions and the report of what was skipped.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Questions in file order (files in [`ORAN_FILES`] order for `mixed`).
    pub questions: Vec<Question>,
    /// What was loaded and skipped.
    pub report: LoadReport,
}

/// A sample drawn by [`Dataset::sample`].
#[derive(Debug, Clone)]
pub struct Sample {
    /// The chosen questions, in sampling order.
    pub questions: Vec<Question>,
    /// `n_questions` as asked (`None`: all).
    pub requested: Option<usize>,
    /// Questions there were to choose from.
    pub available: usize,
    /// The seed.
    pub seed: u64,
}

impl Sample {
    /// True when more questions were asked for than there are (all were taken).
    pub fn is_short(&self) -> bool {
        self.requested.is_some_and(|n| n > self.available)
    }
}

impl fmt::Display for Sample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.requested {
            Some(n) if n > self.available => write!(
                f,
                "asked for {n} questions but only {} are available: using all {} (seed {})",
                self.available,
                self.questions.len(),
                self.seed
            ),
            Some(_) => write!(
                f,
                "sampled {} of {} questions (seed {})",
                self.questions.len(),
                self.available,
                self.seed
            ),
            None => write!(
                f,
                "using all {} questions, in seed-{} order",
                self.questions.len(),
                self.seed
            ),
        }
    }
}

impl Dataset {
    /// Draws `n_questions` questions (all when `None`) with `seed`.
    ///
    /// Every question gets the key [`sample_key`]`(seed, id)`; questions are ordered by key
    /// (ties, which need a 64-bit collision, by id) and the first `n` are taken. Hence the same
    /// seed and n give the same questions on every machine and thread count, a smaller n is a
    /// prefix of a larger n's selection, and the choice does not depend on file order or on any
    /// hash map. `rand`'s `StdRng` is not used because its algorithm may change between `rand`
    /// versions, which would silently change the questions of a published seed.
    ///
    /// `mixed` draws from the pool of all three files, so each level's share follows its size
    /// in expectation (about 8% easy, 68% medium, 23% hard), not exactly.
    ///
    /// Asking for more questions than there are takes all of them; [`Sample::is_short`] and the
    /// sample's `Display` say so. Asking for 0 is an error.
    pub fn sample(&self, n_questions: Option<usize>, seed: u64) -> Result<Sample, DatasetError> {
        if n_questions == Some(0) {
            return Err(DatasetError::ZeroQuestions);
        }
        let order = sample_order(&self.questions, seed);
        let take = n_questions.unwrap_or(order.len()).min(order.len());
        Ok(Sample {
            questions: order[..take]
                .iter()
                .map(|&i| self.questions[i].clone())
                .collect(),
            requested: n_questions,
            available: self.questions.len(),
            seed,
        })
    }
}

/// FNV-1a, 64-bit: a fixed, documented hash of the id bytes.
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// SplitMix64's finaliser: spreads the bits so that nearby seeds give unrelated orders.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The sampling key of question `id` under `seed`:
/// `splitmix64(fnv1a64(id) ^ splitmix64(seed))`. Fixed forever: changing it changes which
/// questions every published seed selects.
pub fn sample_key(seed: u64, id: &str) -> u64 {
    splitmix64(fnv1a64(id.as_bytes()) ^ splitmix64(seed))
}

/// Indices into `questions` in sampling order for `seed` (see [`Dataset::sample`]).
pub fn sample_order(questions: &[Question], seed: u64) -> Vec<usize> {
    let mut keyed: Vec<(u64, &str, usize)> = questions
        .iter()
        .enumerate()
        .map(|(i, q)| (sample_key(seed, &q.id), q.id.as_str(), i))
        .collect();
    keyed.sort_unstable();
    keyed.into_iter().map(|(_, _, i)| i).collect()
}

/// Which dataset to load; what the experiment config names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "format", rename_all = "snake_case")]
pub enum DatasetSource {
    /// ORAN-Bench-13K from a directory, one level or `mixed`.
    OranBench {
        /// The folder holding `fin_E.json`, `fin_M.json`, `fin_H.json`.
        dir: PathBuf,
        /// Which file(s).
        difficulty: Difficulty,
    },
    /// A generic multiple-choice JSONL file (see the module docs).
    Jsonl {
        /// The file.
        path: PathBuf,
    },
}

impl DatasetSource {
    /// Loads the questions.
    pub fn load(&self) -> Result<Dataset, DatasetError> {
        match self {
            DatasetSource::OranBench { dir, difficulty } => load_oran(dir, *difficulty),
            DatasetSource::Jsonl { path } => load_jsonl(path),
        }
    }
}

/// The key that makes two items exact duplicates.
type DedupKey = (String, Vec<String>, usize);

/// State shared by the files of one load: duplicates are found across all of them.
#[derive(Default)]
struct LoadState {
    /// Exact-duplicate key → where it was first seen.
    seen: HashMap<DedupKey, SourceLocation>,
    /// Ids in use → where.
    ids: HashMap<String, SourceLocation>,
}

/// An item parsed from a line, before the checks shared by both formats.
struct RawItem {
    id: String,
    question: String,
    options: Vec<String>,
    answer: RawAnswer,
    difficulty: Option<Difficulty>,
}

/// The answer as written, resolved once the options are known.
enum RawAnswer {
    /// 1-based number.
    Number(i64),
    /// 0-based index (`answer_index`), possibly with a 1-based `answer` that must agree.
    Index(i64, Option<Box<RawAnswer>>),
    /// Letter (`A`...).
    Letter(char),
    /// Option text.
    Text(String),
}

/// Loads ORAN-Bench-13K from `dir`: one level's file, or all three for `mixed`.
///
/// Fails if the directory or a needed file is missing, a file cannot be read, or a file has no
/// usable line; bad lines are skipped and reported (see the module docs for the checks).
pub fn load_oran(dir: &Path, difficulty: Difficulty) -> Result<Dataset, DatasetError> {
    if !dir.is_dir() {
        return Err(DatasetError::MissingDir {
            dir: dir.to_path_buf(),
            hint: ORAN_HINT.to_string(),
        });
    }
    // Check every needed file before reading any, so that a missing file is reported at once.
    let files: Vec<(Difficulty, PathBuf)> = difficulty
        .levels()
        .iter()
        .filter_map(|level| level.oran_file().map(|name| (*level, dir.join(name))))
        .collect();
    for (_, path) in &files {
        if !path.exists() {
            return Err(DatasetError::MissingFile {
                path: path.clone(),
                hint: ORAN_HINT.to_string(),
            });
        }
    }
    let mut state = LoadState::default();
    let mut dataset = Dataset {
        questions: Vec::new(),
        report: LoadReport::default(),
    };
    for (level, path) in files {
        let file = read_lines(
            &path,
            Some(level),
            &mut state,
            &mut dataset.questions,
            |n, v| oran_item(level, n, v),
        )?;
        if file.loaded == 0 {
            return Err(DatasetError::NoQuestions {
                path,
                summary: file.summary(),
                expected: "JSON Lines of [\"question\", [\"1. option\", ...], \"answer number\"]",
            });
        }
        dataset.report.files.push(file);
    }
    Ok(dataset)
}

/// Loads a generic multiple-choice JSONL file (format in the module docs).
///
/// Fails if the file is missing or unreadable or has no usable line; bad lines are skipped and
/// reported.
pub fn load_jsonl(path: &Path) -> Result<Dataset, DatasetError> {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "item".to_string());
    let mut state = LoadState::default();
    let mut questions = Vec::new();
    let file = read_lines(path, None, &mut state, &mut questions, |n, v| {
        generic_item(&stem, n, v)
    })?;
    if file.loaded == 0 {
        return Err(DatasetError::NoQuestions {
            path: path.to_path_buf(),
            summary: file.summary(),
            expected: "JSON Lines, one object per line: {\"question\": ..., \"options\": [...], \
                       \"answer\": <1-based number, letter or option text>}",
        });
    }
    Ok(Dataset {
        questions,
        report: LoadReport { files: vec![file] },
    })
}

/// Reads `path` line by line, turning each non-blank line into a question with `parse` and the
/// shared checks, and returns the file's report. Only file-level failures are errors.
fn read_lines(
    path: &Path,
    difficulty: Option<Difficulty>,
    state: &mut LoadState,
    out: &mut Vec<Question>,
    parse: impl Fn(usize, Value) -> Result<RawItem, (SkipReason, String)>,
) -> Result<FileReport, DatasetError> {
    let bytes = std::fs::read(path).map_err(|source| {
        if source.kind() == io::ErrorKind::NotFound {
            DatasetError::MissingFile {
                path: path.to_path_buf(),
                hint: "check the path; it is resolved from the current directory when relative"
                    .to_string(),
            }
        } else {
            DatasetError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    let mut report = FileReport::new(path, difficulty);
    let mut question_texts: HashSet<String> = HashSet::new();
    let raw_lines = fleet_data::jsonl::split_lines(&bytes);
    report.lines = raw_lines.len();
    for (i, raw) in raw_lines.into_iter().enumerate() {
        let line_no = i + 1;
        let value: Value = match fleet_data::jsonl::parse_line(line_no, raw) {
            JsonlLine::Value(v) => v,
            JsonlLine::Blank => {
                report.blank_lines += 1;
                continue;
            }
            JsonlLine::Malformed(why) => {
                report.skip(line_no, SkipReason::MalformedJson, why);
                continue;
            }
        };
        let location = SourceLocation {
            file: path.to_path_buf(),
            line: line_no,
        };
        match parse(line_no, value).and_then(|raw| check_item(raw, location, state)) {
            Ok((question, repeated_option)) => {
                if !question_texts.insert(question.question.clone()) {
                    report.repeated_question_texts += 1;
                }
                if repeated_option {
                    report.repeated_option_texts += 1;
                }
                report.loaded += 1;
                if let Some(slot) = report.correct_positions.get_mut(question.correct) {
                    *slot += 1;
                }
                out.push(question);
            }
            Err((reason, detail)) => report.skip(line_no, reason, detail),
        }
    }
    Ok(report)
}

/// The checks both formats share, in the documented order after the shape check.
/// Returns the question and whether a (wrong) option text is repeated.
fn check_item(
    raw: RawItem,
    source: SourceLocation,
    state: &mut LoadState,
) -> Result<(Question, bool), (SkipReason, String)> {
    let question = raw.question.trim().to_string();
    if question.is_empty() {
        return Err((SkipReason::EmptyQuestion, String::new()));
    }
    let n = raw.options.len();
    if n == 0 {
        return Err((SkipReason::NoOptions, String::new()));
    }
    if n < MIN_OPTIONS {
        return Err((
            SkipReason::TooFewOptions,
            format!("{n} options, need {MIN_OPTIONS} to {MAX_OPTIONS}"),
        ));
    }
    if n > MAX_OPTIONS {
        return Err((
            SkipReason::TooManyOptions,
            format!("{n} options, need {MIN_OPTIONS} to {MAX_OPTIONS}"),
        ));
    }
    let options = strip_labels(&raw.options);
    if let Some(i) = options.iter().position(|o| o.is_empty()) {
        return Err((
            SkipReason::EmptyOption,
            format!("option {} is empty", i + 1),
        ));
    }
    let correct = resolve_answer(&raw.answer, &options)?;
    let normalized: Vec<String> = options.iter().map(|o| normalize(o)).collect();
    let twins: Vec<usize> = (0..n)
        .filter(|&i| i != correct && normalized[i] == normalized[correct])
        .collect();
    if let Some(twin) = twins.first() {
        return Err((
            SkipReason::AmbiguousCorrect,
            format!(
                "correct option {} has the same text as option {}",
                correct + 1,
                twin + 1
            ),
        ));
    }
    // Exact duplicates first: a line repeated verbatim, id included, is a duplicate item
    // rather than an id clash.
    let key: DedupKey = (question.clone(), options.clone(), correct);
    if let Some(first) = state.seen.get(&key) {
        return Err((
            SkipReason::Duplicate,
            format!("same as {}", first.relative_to(&source)),
        ));
    }
    if let Some(first) = state.ids.get(&raw.id) {
        return Err((
            SkipReason::DuplicateId,
            format!(
                "id {:?} already used at {}",
                raw.id,
                first.relative_to(&source)
            ),
        ));
    }
    state.seen.insert(key, source.clone());
    state.ids.insert(raw.id.clone(), source.clone());
    let distinct: HashSet<&String> = normalized.iter().collect();
    Ok((
        Question {
            id: raw.id,
            question,
            options,
            correct,
            difficulty: raw.difficulty,
            source,
        },
        distinct.len() < n,
    ))
}

/// Strips label prefixes when every option carries the prefix of its own position, in one
/// style (`1. `/`1) `/`(1) ` or `A. `/`A) `/`(A) `); otherwise only trims. Requiring all of them
/// keeps option texts that merely start like a label (`"A. Smith"`).
fn strip_labels(options: &[String]) -> Vec<String> {
    for style in [LabelStyle::Number, LabelStyle::Letter] {
        let stripped: Option<Vec<String>> = options
            .iter()
            .enumerate()
            .map(|(i, o)| strip_label(o.trim_start(), &style.label(i)))
            .collect();
        if let Some(s) = stripped {
            return s;
        }
    }
    options.iter().map(|o| o.trim().to_string()).collect()
}

/// `text` without the prefix `label.`/`label)`/`(label)` and the whitespace after it, trimmed;
/// `None` if it has no such prefix. The prefix must be followed by whitespace or end the text,
/// so that `"1.5 ms"` is not read as label 1.
fn strip_label(text: &str, label: &str) -> Option<String> {
    let rest = if let Some(inner) = text.strip_prefix('(') {
        inner.strip_prefix(label)?.strip_prefix(')')?
    } else {
        let after = text.strip_prefix(label)?;
        after
            .strip_prefix('.')
            .or_else(|| after.strip_prefix(')'))?
    };
    if rest.is_empty() || rest.starts_with(char::is_whitespace) {
        Some(rest.trim().to_string())
    } else {
        None
    }
}

/// The 0-based correct index, or why the answer is unusable.
fn resolve_answer(answer: &RawAnswer, options: &[String]) -> Result<usize, (SkipReason, String)> {
    let n = options.len();
    match answer {
        RawAnswer::Number(k) => {
            if (1..=n as i64).contains(k) {
                Ok(*k as usize - 1)
            } else if *k == 0 {
                Err((
                    SkipReason::AnswerOutOfRange,
                    format!("answer 0 with {n} options: answer is 1-based (use answer_index for 0-based)"),
                ))
            } else {
                Err((
                    SkipReason::AnswerOutOfRange,
                    format!("answer {k} with {n} options"),
                ))
            }
        }
        RawAnswer::Index(k, also) => {
            if !(0..n as i64).contains(k) {
                return Err((
                    SkipReason::AnswerOutOfRange,
                    format!("answer_index {k} with {n} options (0-based)"),
                ));
            }
            let index = *k as usize;
            if let Some(other) = also {
                let other = resolve_answer(other, options)?;
                if other != index {
                    return Err((
                        SkipReason::BadAnswer,
                        format!(
                            "answer (option {}) and answer_index {k} (option {}) disagree",
                            other + 1,
                            index + 1
                        ),
                    ));
                }
            }
            Ok(index)
        }
        RawAnswer::Letter(c) => {
            let index = (*c as usize).wrapping_sub('A' as usize);
            if index < n {
                Ok(index)
            } else {
                Err((
                    SkipReason::AnswerOutOfRange,
                    format!("answer {c} with {n} options"),
                ))
            }
        }
        RawAnswer::Text(text) => {
            let want = normalize(text);
            let hits: Vec<usize> = options
                .iter()
                .enumerate()
                .filter(|(_, o)| normalize(o) == want)
                .map(|(i, _)| i)
                .collect();
            match hits.as_slice() {
                [i] => Ok(*i),
                [] => Err((
                    SkipReason::BadAnswer,
                    format!("answer {text:?} is not a number, a letter A-F or an option's text"),
                )),
                _ => Err((
                    SkipReason::AmbiguousCorrect,
                    format!("answer {text:?} matches several options"),
                )),
            }
        }
    }
}

/// Lowercase with whitespace runs collapsed, for comparing answer texts with options.
fn normalize(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// A short description of a JSON value's type, for error details.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A line of ORAN-Bench: `["question", ["1. a", ...], "answer"]`.
fn oran_item(level: Difficulty, line: usize, v: Value) -> Result<RawItem, (SkipReason, String)> {
    let bad = |what: String| Err((SkipReason::BadFormat, what));
    let Value::Array(parts) = v else {
        return bad(format!(
            "expected an array [question, options, answer], got {}",
            kind(&v)
        ));
    };
    let [q, opts, ans] = parts.as_slice() else {
        return bad(format!(
            "expected 3 elements [question, options, answer], got {}",
            parts.len()
        ));
    };
    let Value::String(question) = q else {
        return bad(format!("question is {}, expected a string", kind(q)));
    };
    let Value::Array(opts) = opts else {
        return bad(format!("options are {}, expected an array", kind(opts)));
    };
    let mut options = Vec::with_capacity(opts.len());
    for (i, o) in opts.iter().enumerate() {
        match o {
            Value::String(s) => options.push(s.clone()),
            other => {
                return bad(format!(
                    "option {} is {}, expected a string",
                    i + 1,
                    kind(other)
                ))
            }
        }
    }
    let answer = match ans {
        Value::String(s) => match s.trim().parse::<i64>() {
            Ok(k) => RawAnswer::Number(k),
            Err(_) => {
                return Err((
                    SkipReason::BadAnswer,
                    format!("answer {s:?} is not an option number"),
                ))
            }
        },
        Value::Number(num) => match num.as_i64() {
            Some(k) => RawAnswer::Number(k),
            None => {
                return Err((
                    SkipReason::BadAnswer,
                    format!("answer {num} is not an option number"),
                ))
            }
        },
        other => return bad(format!("answer is {}, expected a string", kind(other))),
    };
    Ok(RawItem {
        id: format!("oran-{}-{line:06}", level.code()),
        question: question.clone(),
        options,
        answer,
        difficulty: Some(level),
    })
}

/// A line of the generic format (see the module docs).
fn generic_item(stem: &str, line: usize, v: Value) -> Result<RawItem, (SkipReason, String)> {
    let bad = |what: String| Err((SkipReason::BadFormat, what));
    let Value::Object(obj) = v else {
        return bad(format!(
            "expected an object {{\"question\", \"options\", \"answer\"}}, got {}",
            kind(&v)
        ));
    };
    let id = match obj.get("id") {
        None | Some(Value::Null) => format!("{stem}-{line:06}"),
        Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_string(),
        Some(Value::Number(n)) => n.to_string(),
        Some(other) => {
            return bad(format!(
                "id is {}, expected a non-empty string or a number",
                kind(other)
            ))
        }
    };
    let question = match obj.get("question") {
        Some(Value::String(s)) => s.clone(),
        None => return bad("missing field \"question\"".into()),
        Some(other) => return bad(format!("question is {}, expected a string", kind(other))),
    };
    let options = match (obj.get("options"), obj.get("choices")) {
        (Some(_), Some(_)) => {
            return bad("both \"options\" and \"choices\" given; keep one".into());
        }
        (Some(v), None) | (None, Some(v)) => generic_options(v)?,
        (None, None) => return bad("missing field \"options\" (or \"choices\")".into()),
    };
    let answer = generic_answer(obj.get("answer"))?;
    let answer = match obj.get("answer_index") {
        None | Some(Value::Null) => match answer {
            Some(a) => a,
            None => return bad("missing field \"answer\" (or \"answer_index\")".into()),
        },
        Some(Value::Number(n)) => match n.as_i64() {
            Some(k) => RawAnswer::Index(k, answer.map(Box::new)),
            None => {
                return Err((
                    SkipReason::BadAnswer,
                    format!("answer_index {n} is not an integer"),
                ))
            }
        },
        Some(other) => {
            return bad(format!(
                "answer_index is {}, expected an integer",
                kind(other)
            ))
        }
    };
    let difficulty = match obj.get("difficulty") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match s.parse::<Difficulty>() {
            Ok(Difficulty::Mixed) | Err(_) => {
                return bad(format!("difficulty {s:?} is not one of easy, medium, hard"))
            }
            Ok(d) => Some(d),
        },
        Some(other) => return bad(format!("difficulty is {}, expected a string", kind(other))),
    };
    Ok(RawItem {
        id,
        question,
        options,
        answer,
        difficulty,
    })
}

/// Options as an array of strings or an object keyed by labels `A`.. or `1`...
fn generic_options(v: &Value) -> Result<Vec<String>, (SkipReason, String)> {
    let bad = |what: String| Err((SkipReason::BadFormat, what));
    match v {
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, o)| match o {
                Value::String(s) => Ok(s.clone()),
                other => Err((
                    SkipReason::BadFormat,
                    format!("option {} is {}, expected a string", i + 1, kind(other)),
                )),
            })
            .collect(),
        Value::Object(map) => {
            let n = map.len();
            let mut by_index: Vec<Option<String>> = vec![None; n];
            for (key, val) in map {
                let k = key.trim();
                let index = if let Ok(num) = k.parse::<usize>() {
                    num.checked_sub(1)
                } else if k.len() == 1 && k.as_bytes()[0].is_ascii_alphabetic() {
                    Some(usize::from(k.as_bytes()[0].to_ascii_uppercase() - b'A'))
                } else {
                    None
                };
                let Some(slot) = index.and_then(|i| by_index.get_mut(i)) else {
                    return bad(format!(
                        "option key {key:?}: keys must be A, B, ... or 1, 2, ... without gaps"
                    ));
                };
                let Value::String(s) = val else {
                    return bad(format!(
                        "option {key:?} is {}, expected a string",
                        kind(val)
                    ));
                };
                if slot.is_some() {
                    return bad(format!("option key {key:?} given twice"));
                }
                *slot = Some(s.clone());
            }
            // n distinct keys each below n fill every slot, so none is missing.
            Ok(by_index.into_iter().flatten().collect())
        }
        other => bad(format!(
            "options are {}, expected an array of strings or an object of labelled strings",
            kind(other)
        )),
    }
}

/// The `answer` field, if present.
fn generic_answer(v: Option<&Value>) -> Result<Option<RawAnswer>, (SkipReason, String)> {
    let v = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    match v {
        Value::Number(n) => match n.as_i64() {
            Some(k) => Ok(Some(RawAnswer::Number(k))),
            None => Err((
                SkipReason::BadAnswer,
                format!("answer {n} is not a whole number"),
            )),
        },
        Value::String(s) => {
            let t = s.trim();
            if let Ok(k) = t.parse::<i64>() {
                return Ok(Some(RawAnswer::Number(k)));
            }
            // "(B)", "B.", "B)", "b": a single letter A-F with optional decoration.
            let core = t
                .strip_prefix('(')
                .and_then(|x| x.strip_suffix(')'))
                .or_else(|| t.strip_suffix('.'))
                .or_else(|| t.strip_suffix(')'))
                .unwrap_or(t);
            let mut chars = core.chars();
            if let (Some(c), None) = (chars.next(), chars.next()) {
                let up = c.to_ascii_uppercase();
                if ('A'..='F').contains(&up) {
                    return Ok(Some(RawAnswer::Letter(up)));
                }
            }
            Ok(Some(RawAnswer::Text(s.clone())))
        }
        other => Err((
            SkipReason::BadFormat,
            format!(
                "answer is {}, expected a number, a letter or an option's text",
                kind(other)
            ),
        )),
    }
}
