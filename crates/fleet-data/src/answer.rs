//! Reads the chosen option out of a model's reply to a multiple-choice question.
//!
//! The parser never guesses: a reply it cannot read with confidence is
//! [`ParsedAnswer::Unparsed`] with an [`UnparsedReason`], which the runner records, counts as
//! wrong and reports. Falling back to a fixed option would inflate accuracy, because the correct
//! option of ORAN-Bench is skewed (hard: option 2 is right 39.6% of the time).
//!
//! # Rules
//!
//! 1. `<think>...</think>` blocks (Qwen3) are removed first. A `</think>` with no opening tag
//!    means the chat template put `<think>` in the prompt, so everything before it is thinking.
//!    A `<think>` that is never closed leaves nothing to parse: `unterminated_think`.
//! 2. **Explicit statements** are looked for everywhere in what is left:
//!    `answer` followed by a connector (`The answer is 3`, `Answer: (B)`, `**Answer:** 2`,
//!    `Final answer: option 4`, `The correct answer would be C`, a `### Final Answer` heading
//!    with the label alone on a following line); `correct/right/best/final option|choice` with a
//!    connector (`The correct option is 2`); `I choose option 2`; `\boxed{2}` (also
//!    `\boxed{\text{B}}`). Weaker, and used only when none of those is present: a label at the
//!    start of a clause followed by `is correct` / `is the answer` (`Option 3 is correct`,
//!    `(B) is the right answer`), since explanations say such things about other options.
//!    The **last line** holding a statement decides; if that line names two different
//!    options, the reply is `ambiguous`. Within a statement, another option joined by `or`,
//!    `and`, `,`, `/`, `but` ... (`2 or 3`, `B/C`, `2 (or maybe 3)`) makes it `ambiguous`; a
//!    statement ending in `?` does not count.
//! 3. Otherwise a reply that is **only a label** counts: `3`, `(C)`, `C.`, `**2**`, `Option 3`.
//! 4. [`parse_answer_with_options`] also accepts a reply (or the part after an explicit
//!    `answer is`) that is exactly one option's text, or a label followed by its own option's
//!    text (`2. O-DU`). A label followed by *another* option's text is `ambiguous`, and so is a
//!    bare number that is also the text of a different option (options `0, 1, 2, 3` and reply
//!    `2`) unless it is written `option 2` or followed by its text.
//!
//! Labels are numbers `1`..`N` (ORAN style) or letters `A`..`F` (either style is accepted
//! whatever the prompt used). A label must stand alone: `3GPP`, `Release 15`, `O-RAN.WG4`,
//! `2.5`, `Rel-15`, `A's` are not labels, and `step 1` is not a statement. A label of an option
//! that does not exist (`7` with 4 options, `E` with 4) is `out_of_range`, never clipped.
//! Lowercase letters count only when wrapped (`(b)`, `**b**`) or as the whole reply, and a bare
//! capital letter followed by a word counts only before words such as `because`, so that
//! `Answer: A good choice is ...` is not read as option A.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Fewest options the parser accepts.
pub const MIN_OPTIONS: usize = 2;
/// Most options the parser accepts (labels 1-6, A-F).
pub const MAX_OPTIONS: usize = 6;

/// Why a reply was not read as an option.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnparsedReason {
    /// The parser was called with fewer than [`MIN_OPTIONS`] or more than [`MAX_OPTIONS`]
    /// options: a caller bug, reported rather than panicking.
    InvalidOptionCount,
    /// Nothing but whitespace outside think blocks.
    Empty,
    /// A `<think>` block that never ends: the model ran out of tokens while thinking.
    UnterminatedThink,
    /// No explicit statement, bare label or option text was found.
    NoAnswer,
    /// The deciding statement names more than one option.
    Ambiguous,
    /// The deciding statement names an option that does not exist.
    OutOfRange,
}

impl UnparsedReason {
    /// Every reason, for reports.
    pub const ALL: [UnparsedReason; 6] = [
        UnparsedReason::InvalidOptionCount,
        UnparsedReason::Empty,
        UnparsedReason::UnterminatedThink,
        UnparsedReason::NoAnswer,
        UnparsedReason::Ambiguous,
        UnparsedReason::OutOfRange,
    ];

    /// The stable snake_case name, as serialised (`"no_answer"`).
    pub fn as_str(self) -> &'static str {
        match self {
            UnparsedReason::InvalidOptionCount => "invalid_option_count",
            UnparsedReason::Empty => "empty",
            UnparsedReason::UnterminatedThink => "unterminated_think",
            UnparsedReason::NoAnswer => "no_answer",
            UnparsedReason::Ambiguous => "ambiguous",
            UnparsedReason::OutOfRange => "out_of_range",
        }
    }
}

impl fmt::Display for UnparsedReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome of parsing one reply.
///
/// Serialises as `{"status": "option", "index": 2}` or
/// `{"status": "unparsed", "reason": "ambiguous"}`; [`ParsedAnswer::status`] gives the stable
/// strings `"option"` and `"unparsed"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "ParsedRepr", try_from = "ParsedRepr")]
pub enum ParsedAnswer {
    /// The chosen option, 0-based.
    Option(usize),
    /// Not read; counted as wrong and reported.
    Unparsed {
        /// Why.
        reason: UnparsedReason,
    },
}

impl ParsedAnswer {
    /// The 0-based option, if parsed.
    pub fn index(self) -> Option<usize> {
        match self {
            ParsedAnswer::Option(i) => Some(i),
            ParsedAnswer::Unparsed { .. } => None,
        }
    }

    /// True for [`ParsedAnswer::Unparsed`].
    pub fn is_unparsed(self) -> bool {
        matches!(self, ParsedAnswer::Unparsed { .. })
    }

    /// True only when an option was parsed and it is `correct` (0-based): unparsed is wrong.
    pub fn is_correct(self, correct: usize) -> bool {
        self.index() == Some(correct)
    }

    /// `"option"` or `"unparsed"`.
    pub fn status(self) -> &'static str {
        match self {
            ParsedAnswer::Option(_) => "option",
            ParsedAnswer::Unparsed { .. } => "unparsed",
        }
    }

    fn unparsed(reason: UnparsedReason) -> Self {
        ParsedAnswer::Unparsed { reason }
    }
}

impl fmt::Display for ParsedAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParsedAnswer::Option(i) => write!(f, "option index {i}"),
            ParsedAnswer::Unparsed { reason } => write!(f, "unparsed ({reason})"),
        }
    }
}

/// The serialised form of [`ParsedAnswer`].
#[derive(Clone, Serialize, Deserialize)]
struct ParsedRepr {
    status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    index: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reason: Option<UnparsedReason>,
}

impl From<ParsedAnswer> for ParsedRepr {
    fn from(p: ParsedAnswer) -> Self {
        match p {
            ParsedAnswer::Option(i) => ParsedRepr {
                status: "option".into(),
                index: Some(i),
                reason: None,
            },
            ParsedAnswer::Unparsed { reason } => ParsedRepr {
                status: "unparsed".into(),
                index: None,
                reason: Some(reason),
            },
        }
    }
}

impl TryFrom<ParsedRepr> for ParsedAnswer {
    type Error = String;

    fn try_from(r: ParsedRepr) -> Result<Self, Self::Error> {
        match (r.status.as_str(), r.index, r.reason) {
            ("option", Some(i), None) => Ok(ParsedAnswer::Option(i)),
            ("unparsed", None, Some(reason)) => Ok(ParsedAnswer::Unparsed { reason }),
            (s, _, _) => Err(format!(
                "expected {{\"status\": \"option\", \"index\": N}} or {{\"status\": \"unparsed\", \
                 \"reason\": ...}}, got status {s:?}"
            )),
        }
    }
}

/// Parses `text`, a reply to a question with `num_options` options (2 to 6), without knowing
/// the option texts. See the module docs for the rules.
pub fn parse_answer(text: &str, num_options: usize) -> ParsedAnswer {
    parse(text, num_options, None)
}

/// Like [`parse_answer`], knowing the option texts (without labels): also accepts a reply that is
/// one option's text, and rejects a label that contradicts the text written after it. Prefer it
/// when the options are at hand.
pub fn parse_answer_with_options<S: AsRef<str>>(text: &str, options: &[S]) -> ParsedAnswer {
    let normalized: Vec<String> = options.iter().map(|o| normalize(o.as_ref())).collect();
    parse(text, options.len(), Some(&normalized))
}

fn parse(text: &str, n: usize, options: Option<&[String]>) -> ParsedAnswer {
    if !(MIN_OPTIONS..=MAX_OPTIONS).contains(&n) {
        return ParsedAnswer::unparsed(UnparsedReason::InvalidOptionCount);
    }
    let visible = match strip_think(text) {
        Ok(v) => v,
        Err(reason) => return ParsedAnswer::unparsed(reason),
    };
    if visible.trim().is_empty() {
        return ParsedAnswer::unparsed(UnparsedReason::Empty);
    }
    let ctx = Ctx {
        toks: tokenize(&visible),
        text: &visible,
        n,
        options,
    };
    let outcome = ctx
        .explicit()
        .or_else(|| ctx.whole_reply())
        .unwrap_or(Outcome::NoAnswer);
    match outcome {
        Outcome::Index(i) => ParsedAnswer::Option(i),
        Outcome::OutOfRange => ParsedAnswer::unparsed(UnparsedReason::OutOfRange),
        Outcome::Ambiguous => ParsedAnswer::unparsed(UnparsedReason::Ambiguous),
        Outcome::NoAnswer => ParsedAnswer::unparsed(UnparsedReason::NoAnswer),
    }
}

/// Removes think blocks (see rule 1). Removed blocks become a newline so that the text on either
/// side does not run together.
fn strip_think(text: &str) -> Result<String, UnparsedReason> {
    const OPEN: &str = "<think>";
    const CLOSE: &str = "</think>";
    // ASCII lowercasing keeps byte offsets, so positions found in `lower` index `text`.
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut pos = 0;
    let mut in_think = false;
    loop {
        let open = lower[pos..].find(OPEN).map(|p| p + pos);
        let close = lower[pos..].find(CLOSE).map(|p| p + pos);
        if in_think {
            // A nested <think> inside a block is just text of the block.
            let Some(c) = close else {
                return Err(UnparsedReason::UnterminatedThink);
            };
            pos = c + CLOSE.len();
            in_think = false;
            out.push('\n');
            continue;
        }
        match (open, close) {
            (Some(o), c) if c.is_none_or(|c| o < c) => {
                out.push_str(&text[pos..o]);
                pos = o + OPEN.len();
                in_think = true;
            }
            (_, Some(c)) => {
                // A close with no open: the generation began inside a think block.
                out.clear();
                pos = c + CLOSE.len();
            }
            _ => {
                out.push_str(&text[pos..]);
                return Ok(out);
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Word,
    Punct(char),
    Newline,
}

/// A token: a run of alphanumerics, one other character, or a newline.
#[derive(Debug, Clone)]
struct Tok<'a> {
    kind: Kind,
    text: &'a str,
    start: usize,
    /// Whitespace (not a newline) right before it.
    space_before: bool,
    /// 0-based line number.
    line: usize,
}

fn tokenize(s: &str) -> Vec<Tok<'_>> {
    let mut toks = Vec::new();
    let mut chars = s.char_indices().peekable();
    let mut space = false;
    let mut line = 0;
    while let Some((start, c)) = chars.next() {
        if c == '\n' {
            toks.push(Tok {
                kind: Kind::Newline,
                text: &s[start..start + 1],
                start,
                space_before: space,
                line,
            });
            line += 1;
            space = false;
        } else if c.is_whitespace() {
            space = true;
        } else if c.is_alphanumeric() {
            let mut end = start + c.len_utf8();
            while let Some(&(i, d)) = chars.peek() {
                if !d.is_alphanumeric() {
                    break;
                }
                end = i + d.len_utf8();
                chars.next();
            }
            toks.push(Tok {
                kind: Kind::Word,
                text: &s[start..end],
                start,
                space_before: space,
                line,
            });
            space = false;
        } else {
            toks.push(Tok {
                kind: Kind::Punct(c),
                text: &s[start..start + c.len_utf8()],
                start,
                space_before: space,
                line,
            });
            space = false;
        }
    }
    toks
}

/// An option label as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Label {
    /// 1-based number.
    Number(u64),
    /// 0-based letter index (A = 0).
    Letter(usize),
}

impl Label {
    /// How it would appear as an option's text (for the number-as-value check).
    fn as_text(self) -> String {
        match self {
            Label::Number(k) => k.to_string(),
            Label::Letter(i) => char::from(b'a' + i as u8).to_string(),
        }
    }
}

/// What a statement, or the reply, says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Index(usize),
    OutOfRange,
    Ambiguous,
    NoAnswer,
}

/// A label found at a position.
#[derive(Debug, Clone, Copy)]
struct Hit {
    label: Label,
    /// Token after the label and its closing marks.
    next: usize,
    /// The closing marks ended the sentence (`.`, `!`, `?` or `;` then space or end); its char.
    ended: Option<char>,
}

enum LabelAt {
    None,
    Ambiguous,
    Hit(Hit),
}

/// Opening marks skipped before a label; the `bool` says whether they make it "wrapped".
fn opening(c: char) -> Option<bool> {
    match c {
        '(' | '[' | '{' | '*' | '`' | '_' => Some(true),
        '"' | '\'' | '“' | '‘' | '$' => Some(false),
        _ => None,
    }
}

fn closing(c: char) -> bool {
    matches!(
        c,
        ')' | ']' | '}' | '*' | '`' | '_' | '"' | '\'' | '”' | '’' | '$'
    )
}

/// Words that may follow `answer` before the label.
const CONNECTOR_WORDS: &[&str] = &[
    "is", "was", "would", "should", "will", "must", "be", "shall",
];
/// Words skipped between the connector and the label.
const FILLER_WORDS: &[&str] = &[
    "then",
    "therefore",
    "thus",
    "clearly",
    "definitely",
    "likely",
    "probably",
    "most",
    "either",
    "simply",
    "indeed",
    "option",
    "choice",
    "number",
    "letter",
    "no",
];
/// Adjectives that turn `option` / `choice` into an anchor (`the correct option is 3`).
const OPTION_ADJECTIVES: &[&str] = &["correct", "right", "best", "final", "chosen", "selected"];
/// Words after a bare capital letter that still leave it a label (`The answer is B because`).
const LETTER_FOLLOWERS: &[&str] = &[
    "because",
    "since",
    "as",
    "is",
    "which",
    "and",
    "or",
    "based",
    "per",
    "according",
    "given",
];
/// Units after a number that make it a quantity, not a label (`2 GHz`).
const UNITS: &[&str] = &[
    "ms", "s", "us", "ns", "sec", "seconds", "hz", "khz", "mhz", "ghz", "db", "dbm", "bit", "bits",
    "byte", "bytes", "kb", "mb", "gb", "km", "m", "percent", "times",
];
/// Words joining a second option to the first in one statement.
const LIST_WORDS: &[&str] = &[
    "or", "and", "nor", "vs", "versus", "but", "though", "although", "either",
];
/// Words skipped after a list word before a second label (`2 or possibly 3`).
const HEDGE_WORDS: &[&str] = &[
    "option",
    "options",
    "choice",
    "possibly",
    "maybe",
    "perhaps",
    "also",
    "even",
    "potentially",
    "alternatively",
];
/// Words before a label that start a clause, for `<label> is correct`.
const CLAUSE_WORDS: &[&str] = &[
    "option",
    "choice",
    "so",
    "thus",
    "therefore",
    "hence",
    "then",
    "answer",
];

fn word_in(tok: &Tok<'_>, list: &[&str]) -> bool {
    tok.kind == Kind::Word && list.iter().any(|w| tok.text.eq_ignore_ascii_case(w))
}

/// The label a word spells, if any. Lowercase letters only when `allow_lower`.
fn word_label(text: &str, allow_lower: bool) -> Option<Label> {
    let bytes = text.as_bytes();
    if !bytes.is_empty() && bytes.len() <= 4 && bytes.iter().all(u8::is_ascii_digit) {
        return text.parse().ok().map(Label::Number);
    }
    match bytes {
        [c @ b'A'..=b'F'] => Some(Label::Letter(usize::from(c - b'A'))),
        [c @ b'a'..=b'f'] if allow_lower => Some(Label::Letter(usize::from(c - b'a'))),
        _ => None,
    }
}

struct Ctx<'a> {
    toks: Vec<Tok<'a>>,
    text: &'a str,
    n: usize,
    /// Normalised option texts, when known.
    options: Option<&'a [String]>,
}

impl<'a> Ctx<'a> {
    fn punct(&self, i: usize) -> Option<char> {
        match self.toks.get(i)?.kind {
            Kind::Punct(c) => Some(c),
            _ => None,
        }
    }

    fn is_word(&self, i: usize, list: &[&str]) -> bool {
        self.toks.get(i).is_some_and(|t| word_in(t, list))
    }

    /// True if token `i` is absent, a newline, or preceded by whitespace: a boundary.
    fn boundary_at(&self, i: usize) -> bool {
        self.toks
            .get(i)
            .is_none_or(|t| t.space_before || t.kind == Kind::Newline)
    }

    /// Byte offset where token `i` starts (end of text past the last token).
    fn offset(&self, i: usize) -> usize {
        self.toks.get(i).map_or(self.text.len(), |t| t.start)
    }

    /// Index of the newline ending the line of token `i` (or the token count).
    fn line_end(&self, i: usize) -> usize {
        (i..self.toks.len())
            .find(|&k| self.toks[k].kind == Kind::Newline)
            .unwrap_or(self.toks.len())
    }

    fn resolve(&self, label: Label) -> Outcome {
        let index = match label {
            Label::Number(k) => usize::try_from(k).ok().and_then(|k| k.checked_sub(1)),
            Label::Letter(i) => Some(i),
        };
        match index {
            Some(i) if i < self.n => Outcome::Index(i),
            _ => Outcome::OutOfRange,
        }
    }

    /// Reads a label starting at token `j` (after opening marks).
    fn label_at(&self, j: usize, allow_lower: bool) -> LabelAt {
        let mut k = j;
        let mut wrapped = false;
        while let Some(w) = self.punct(k).and_then(opening) {
            wrapped |= w;
            k += 1;
        }
        let Some(tok) = self.toks.get(k) else {
            return LabelAt::None;
        };
        if tok.kind != Kind::Word {
            return LabelAt::None;
        }
        let Some(label) = word_label(tok.text, allow_lower || wrapped) else {
            return LabelAt::None;
        };
        // Glued to what follows: `2.5`, `1,000`, `10:30`, `2/3`, `Rel-15`, `A's`, `3%`.
        if let Some(c) = self.punct(k + 1).filter(|_| !self.boundary_at(k + 1)) {
            let glued_word = self
                .toks
                .get(k + 2)
                .filter(|t| t.kind == Kind::Word && !t.space_before);
            match (c, glued_word) {
                ('.' | ',' | ':', Some(w)) if w.text.starts_with(|d: char| d.is_ascii_digit()) => {
                    return LabelAt::None;
                }
                ('-' | '/' | '–' | '|' | '&', Some(w)) => {
                    return if word_label(w.text, true).is_some() {
                        LabelAt::Ambiguous
                    } else {
                        LabelAt::None
                    };
                }
                ('\'' | '’', Some(_)) => return LabelAt::None,
                ('%' | '+' | '@' | '^' | '=' | '#' | '~' | '<' | '>', _) => return LabelAt::None,
                _ => {}
            }
        }
        if let Label::Number(_) = label {
            if self.toks.get(k + 1).is_some_and(|t| word_in(t, UNITS)) {
                return LabelAt::None;
            }
        }
        let mut m = k + 1;
        while self.punct(m).is_some_and(closing) {
            wrapped |= self.punct(m) != Some('"') && self.punct(m) != Some('\'');
            m += 1;
        }
        let mut ended = None;
        if let Some(c @ ('.' | '!' | '?' | ';' | ':')) = self.punct(m) {
            m += 1;
            while self.punct(m).is_some_and(closing) {
                m += 1;
            }
            if c != ':' && self.boundary_at(m) {
                ended = Some(c);
            }
        }
        // `Answer: A good choice is 2`: a bare capital followed by a word is an article unless
        // the word is one that follows a label.
        if let Label::Letter(_) = label {
            let next = self.toks.get(m);
            if !wrapped
                && ended.is_none()
                && m == k + 1
                && next.is_some_and(|t| t.kind == Kind::Word && !word_in(t, LETTER_FOLLOWERS))
            {
                return LabelAt::None;
            }
        }
        LabelAt::Hit(Hit {
            label,
            next: m,
            ended,
        })
    }

    /// Checks the rest of the statement after a label: another option joined by a list word
    /// makes it ambiguous; a `?` at its end withdraws it. Returns the verdict and where the
    /// statement ends.
    fn rest_of_statement(&self, hit: &Hit, chosen: Outcome) -> Option<Outcome> {
        match hit.ended {
            Some('?') => return None,
            Some(_) => return Some(chosen),
            None => {}
        }
        // `The answer is 1 2`: a second label right after the first.
        if let Some(o) = self.second_label(hit.next, chosen) {
            return Some(o);
        }
        let mut k = hit.next;
        while let Some(tok) = self.toks.get(k) {
            match tok.kind {
                Kind::Newline => break,
                Kind::Punct(c @ ('.' | '!' | '?' | ';')) if self.boundary_at(k + 1) => {
                    return if c == '?' { None } else { Some(chosen) };
                }
                Kind::Punct(',' | '/' | '&' | '|' | '+') => {
                    if let Some(o) = self.second_label(k + 1, chosen) {
                        return Some(o);
                    }
                }
                Kind::Word if word_in(tok, LIST_WORDS) => {
                    if let Some(o) = self.second_label(k + 1, chosen) {
                        return Some(o);
                    }
                }
                _ => {}
            }
            k += 1;
        }
        Some(chosen)
    }

    /// `Some(Ambiguous)` if a label naming another option starts at `k` (after hedges).
    fn second_label(&self, mut k: usize, chosen: Outcome) -> Option<Outcome> {
        while self.is_word(k, HEDGE_WORDS) || self.is_word(k, LIST_WORDS) {
            k += 1;
        }
        match self.label_at(k, false) {
            LabelAt::Hit(h) if self.resolve(h.label) != chosen => Some(Outcome::Ambiguous),
            LabelAt::Ambiguous => Some(Outcome::Ambiguous),
            _ => None,
        }
    }

    /// The outcome of a label in a statement, with the checks that need the option texts:
    /// a label followed by another option's text, or a bare number that is another option's
    /// text, is ambiguous.
    fn label_outcome(&self, hit: &Hit, said_option: bool) -> Outcome {
        let outcome = self.resolve(hit.label);
        let (Some(options), Outcome::Index(i)) = (self.options, outcome) else {
            return outcome;
        };
        // Text written right after the label (`2. O-DU`, `(B) O-DU`, `3 - O-RU`).
        let mut k = hit.next;
        while matches!(self.punct(k), Some('-' | '–' | '—' | ':' | '.' | ')')) {
            k += 1;
        }
        let follow = &self.text[self.offset(k)..self.offset(self.line_end(k))];
        let follow_match = match_option_prefix(options, follow);
        match follow_match {
            TextMatch::One(j) if j == i => return outcome,
            TextMatch::One(_) | TextMatch::Many => return Outcome::Ambiguous,
            TextMatch::None => {}
        }
        if !said_option {
            let as_text = hit.label.as_text();
            if options
                .iter()
                .enumerate()
                .any(|(j, o)| j != i && *o == as_text)
            {
                return Outcome::Ambiguous;
            }
        }
        outcome
    }

    /// All explicit statements; the last line with one decides. Statements that name the
    /// answer (`answer is`, `correct option is`, `\boxed`, `I choose`) outrank the weaker
    /// `<label> is correct`, which explanations also use (`option 3 is the best for Release 16`).
    fn explicit(&self) -> Option<Outcome> {
        let mut strong: Vec<(usize, Outcome)> = Vec::new();
        let mut weak: Vec<(usize, Outcome)> = Vec::new();
        for i in 0..self.toks.len() {
            let tok = &self.toks[i];
            let is_anchor = word_in(tok, &["answer"])
                || (word_in(tok, &["option", "choice"]) && self.adjective_before(i));
            let (candidate, list) = if is_anchor {
                (self.after_anchor(i + 1), &mut strong)
            } else if word_in(tok, &["choose", "select", "pick"])
                && i > 0
                && self.is_word(i - 1, &["i", "we", "ll", "d", "would", "will"])
            {
                (self.after_verb(i + 1), &mut strong)
            } else if self.punct(i) == Some('\\') && self.is_word(i + 1, &["boxed"]) {
                (self.boxed(i + 2), &mut strong)
            } else {
                (self.postfix(i), &mut weak)
            };
            if let Some(outcome) = candidate {
                list.push((tok.line, outcome));
            }
        }
        let found = if strong.is_empty() { weak } else { strong };
        let last_line = found.last()?.0;
        let on_line: Vec<Outcome> = found
            .iter()
            .filter(|(line, _)| *line == last_line)
            .map(|(_, o)| *o)
            .collect();
        let first = on_line[0];
        if on_line.iter().any(|o| *o != first) || first == Outcome::Ambiguous {
            return Some(Outcome::Ambiguous);
        }
        Some(first)
    }

    /// True if the words before the anchor `i` on its line are only `final`, `correct`, ...
    fn heading_like(&self, i: usize) -> bool {
        let line = self.toks.get(i).map_or(0, |t| t.line);
        (0..i)
            .rev()
            .take_while(|&k| self.toks[k].line == line && self.toks[k].kind != Kind::Newline)
            .all(|k| {
                self.toks[k].kind != Kind::Word
                    || self.is_word(k, &["final", "correct", "the", "my", "right", "best"])
            })
    }

    fn adjective_before(&self, i: usize) -> bool {
        let mut k = i;
        while k > 0 && self.punct(k - 1) == Some('*') {
            k -= 1;
        }
        k > 0 && self.is_word(k - 1, OPTION_ADJECTIVES)
    }

    /// After `answer` / `correct option`: connectors, then a label (or, crossing a line break,
    /// a line that is only a label), or with options an option's text.
    fn after_anchor(&self, j: usize) -> Option<Outcome> {
        let mut k = j;
        let mut connector = false;
        let mut crossed = false;
        while let Some(tok) = self.toks.get(k) {
            match tok.kind {
                Kind::Punct(':' | '=' | '-' | '–' | '—') => connector = true,
                Kind::Punct('*' | '#' | '_') => {}
                Kind::Word if word_in(tok, CONNECTOR_WORDS) => connector = true,
                Kind::Word if connector && word_in(tok, FILLER_WORDS) => {}
                Kind::Newline => crossed = true,
                _ => break,
            }
            k += 1;
        }
        if crossed {
            // Only a heading (`### Final Answer`, `**Answer:**`) may put the label on the next
            // line; `... to find the answer` followed by a numbered list must not.
            if !connector && !self.heading_like(j.saturating_sub(1)) {
                return None;
            }
            let end = self.line_end(k);
            return self.line_as_answer(k, end);
        }
        if !connector {
            return None;
        }
        let said_option = k > j && self.is_word(k - 1, &["option", "choice"]);
        match self.label_at(k, false) {
            LabelAt::Hit(hit) => {
                let outcome = self.label_outcome(&hit, said_option);
                self.rest_of_statement(&hit, outcome)
            }
            LabelAt::Ambiguous => Some(Outcome::Ambiguous),
            LabelAt::None => {
                let options = self.options?;
                let rest = &self.text[self.offset(k)..self.offset(self.line_end(k))];
                match match_option_prefix(options, rest) {
                    TextMatch::One(i) => Some(Outcome::Index(i)),
                    TextMatch::Many => Some(Outcome::Ambiguous),
                    TextMatch::None => None,
                }
            }
        }
    }

    /// After `I choose`: `option`/`choice`, then a label.
    fn after_verb(&self, j: usize) -> Option<Outcome> {
        let mut k = j;
        while self.is_word(k, &["option", "choice", "answer"]) {
            k += 1;
        }
        let said_option = k > j;
        match self.label_at(k, false) {
            LabelAt::Hit(hit) => {
                let outcome = self.label_outcome(&hit, said_option);
                self.rest_of_statement(&hit, outcome)
            }
            LabelAt::Ambiguous => Some(Outcome::Ambiguous),
            LabelAt::None => None,
        }
    }

    /// `\boxed{...}` starting at the `{` token `j`: its content must be one label (or with
    /// options one option's text).
    fn boxed(&self, j: usize) -> Option<Outcome> {
        if self.punct(j) != Some('{') {
            return None;
        }
        let mut depth = 0usize;
        let mut end = None;
        for k in j..self.toks.len() {
            match self.punct(k) {
                Some('{') => depth += 1,
                Some('}') => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(k);
                        break;
                    }
                }
                _ => {}
            }
        }
        let end = end?;
        // Drop LaTeX commands (`\text`, `\mathrm`, ...) and braces; what is left is the content.
        let inner: Vec<usize> = (j + 1..end)
            .filter(|&k| {
                let is_command = k > 0 && self.punct(k - 1) == Some('\\');
                !is_command && !matches!(self.punct(k), Some('\\' | '{' | '}'))
            })
            .collect();
        if let Some(o) = self.lone_label(&inner) {
            return Some(o);
        }
        let options = self.options?;
        let raw: String = inner
            .iter()
            .map(|&k| {
                let t = &self.toks[k];
                if t.space_before {
                    format!(" {}", t.text)
                } else {
                    t.text.to_string()
                }
            })
            .collect();
        match match_option_exact(options, &raw) {
            TextMatch::One(i) => Some(Outcome::Index(i)),
            TextMatch::Many => Some(Outcome::Ambiguous),
            TextMatch::None => None,
        }
    }

    /// `<label> is correct`, `option 3 is the right answer`, `(B) is the answer` at the start of
    /// a clause, so that `step 3 is correct` does not count.
    fn postfix(&self, i: usize) -> Option<Outcome> {
        let starts_clause = i == 0
            || match self.toks[i - 1].kind {
                Kind::Newline => true,
                Kind::Punct(c) => matches!(c, '.' | ':' | ',' | ';' | '!' | '-' | '>' | '#'),
                Kind::Word => word_in(&self.toks[i - 1], CLAUSE_WORDS),
            };
        if !starts_clause || self.toks[i].kind == Kind::Newline {
            return None;
        }
        let LabelAt::Hit(hit) = self.label_at(i, false) else {
            return None;
        };
        if hit.ended.is_some() || !self.is_word(hit.next, &["is"]) {
            return None;
        }
        let mut k = hit.next + 1;
        while self.is_word(k, &["the", "a", "most", "clearly", "definitely"]) {
            k += 1;
        }
        if !self.is_word(k, &["correct", "right", "answer", "best"]) {
            return None;
        }
        let said_option = i > 0 && self.is_word(i - 1, &["option", "choice"]);
        let outcome = self.label_outcome(&hit, said_option);
        let tail = Hit {
            next: k + 1,
            ended: None,
            ..hit
        };
        self.rest_of_statement(&tail, outcome)
    }

    /// Tokens `idx` (possibly not contiguous) hold only one label, with marks and the words
    /// `option`/`choice` around it. Several labels joined by list words are ambiguous.
    fn lone_label(&self, idx: &[usize]) -> Option<Outcome> {
        let mut labels: Vec<Label> = Vec::new();
        let mut prev_word: Option<usize> = None;
        for &k in idx {
            let tok = &self.toks[k];
            match tok.kind {
                Kind::Newline => {}
                Kind::Punct(c) => {
                    if !(closing(c) || opening(c).is_some() || ".:,;!-–/&#>".contains(c)) {
                        return None;
                    }
                }
                Kind::Word => {
                    if word_in(tok, &["option", "choice"]) || word_in(tok, LIST_WORDS) {
                        continue;
                    }
                    let label = word_label(tok.text, true)?;
                    // `2.5`, `10:30`: digits glued by a dot or colon are a number, not labels.
                    if let Some(p) = prev_word {
                        if p + 2 == k
                            && matches!(self.punct(p + 1), Some('.' | ':'))
                            && !self.toks[p + 1].space_before
                            && !tok.space_before
                        {
                            return None;
                        }
                    }
                    prev_word = Some(k);
                    labels.push(label);
                }
            }
        }
        let first = *labels.first()?;
        let outcome = self.resolve(first);
        if labels.iter().any(|l| self.resolve(*l) != outcome) {
            return Some(Outcome::Ambiguous);
        }
        Some(outcome)
    }

    /// A line (tokens `from..to`) read as a whole answer: a lone label, or with options a label
    /// followed by option text, or an option's text.
    fn line_as_answer(&self, from: usize, to: usize) -> Option<Outcome> {
        let idx: Vec<usize> = (from..to).collect();
        if let Some(o) = self.lone_label(&idx) {
            let said_option = idx.iter().any(|&k| self.is_word(k, &["option", "choice"]));
            // The number-as-value check needs the hit; find the label token again.
            if let (Outcome::Index(_), Some(_)) = (o, self.options) {
                if let Some(h) = (from..to).find_map(|k| match self.label_at(k, true) {
                    LabelAt::Hit(h) => Some(h),
                    _ => None,
                }) {
                    return Some(self.label_outcome(&h, said_option));
                }
            }
            return Some(o);
        }
        let options = self.options?;
        let line = &self.text[self.offset(from)..self.offset(to)];
        if let LabelAt::Hit(hit) = self.label_at(from, false) {
            // `2. O-DU`: only a label followed by an option's text counts here.
            let outcome = self.label_outcome(&hit, false);
            let mut k = hit.next;
            while matches!(self.punct(k), Some('-' | '–' | '—' | ':' | '.' | ')')) {
                k += 1;
            }
            let follow = &self.text[self.offset(k)..self.offset(to)];
            if !matches!(match_option_exact(options, follow), TextMatch::None) {
                return Some(outcome);
            }
        }
        match match_option_exact(options, line) {
            TextMatch::One(i) => Some(Outcome::Index(i)),
            TextMatch::Many => Some(Outcome::Ambiguous),
            TextMatch::None => None,
        }
    }

    /// The reply as a whole (when there is no explicit statement).
    fn whole_reply(&self) -> Option<Outcome> {
        self.line_as_answer(0, self.toks.len())
    }
}

/// Lowercase, whitespace collapsed, surrounding marks and a final full stop removed.
fn normalize(text: &str) -> String {
    let joined = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let trimmed = joined
        .trim_matches(|c: char| matches!(c, '*' | '"' | '\'' | '`' | '“' | '”'))
        .trim_end_matches(['.', '!'])
        .trim_matches(|c: char| matches!(c, '*' | '"' | '\'' | '`' | '“' | '”'))
        .trim();
    trimmed.to_lowercase()
}

enum TextMatch {
    None,
    One(usize),
    Many,
}

fn collect_matches(options: &[String], pred: impl Fn(&str) -> bool) -> TextMatch {
    let hits: Vec<usize> = options
        .iter()
        .enumerate()
        .filter(|(_, o)| !o.is_empty() && pred(o))
        .map(|(i, _)| i)
        .collect();
    match hits.as_slice() {
        [] => TextMatch::None,
        [i] => TextMatch::One(*i),
        _ => TextMatch::Many,
    }
}

/// `text` is exactly one option's text.
fn match_option_exact(options: &[String], text: &str) -> TextMatch {
    let want = normalize(text);
    collect_matches(options, |o| o == want)
}

/// `text` starts with an option's text that ends its sentence there: followed by nothing, or by
/// `.`/`!`/closing marks and then a space. `O-DU handles ...` or `O-RU, O-DU` do not match.
fn match_option_prefix(options: &[String], text: &str) -> TextMatch {
    let lead = text.trim_start_matches(|c: char| {
        c.is_whitespace() || matches!(c, '*' | '"' | '\'' | '`' | '“' | '(')
    });
    let line = lead.split_whitespace().collect::<Vec<_>>().join(" ");
    let lower = line.to_lowercase();
    collect_matches(options, |o| {
        let Some(rest) = lower.strip_prefix(o) else {
            return false;
        };
        let after = rest.trim_start_matches(|c: char| {
            matches!(c, '.' | '!' | ')' | '*' | '"' | '\'' | '`' | '”' | ']')
        });
        after.trim().is_empty() || (after.len() < rest.len() && after.starts_with(' '))
    })
}
