//! Score parsing: strict, and a reply that does not parse is a [`ParseFailed`] with its raw
//! text — never a substitute score, never a guess, never a silently clamped value.
//!
//! Two formats ([`ReplyFormat`]):
//!
//! - **`Score: X`** (scheme `single`, [`parse_score_line`]). The reply must contain a label
//!   (`Score` by default, matched case-insensitively as a word), optional markdown emphasis, a
//!   colon (`:` or `：`), optional emphasis and spaces, then a number `D+` or `D+.D+` (a sign is
//!   read so that `-1` is reported as out of range). The number may be followed by `/10`
//!   (`Score: 7/10` is 7); another denominator or `%` is a failure. X must lie in [0, 10]: an
//!   out-of-range value is a failure that says so. Text before and after is allowed
//!   (`**Score: 7.5**`, `Score: 8\nThe edit...`). When the label appears several times, all
//!   values must agree; differing values are a failure listing them. Other numbers in the
//!   reply are ignored.
//! - **a list of scores** (scheme `viescore`, [`parse_score_list`]): when the reply holds the
//!   delimiter `||V^=^V||` exactly twice, the text between them, else the whole reply; in it,
//!   the span from the first `{` to the last `}` with newlines removed (as VIEScore does) must
//!   be one JSON object whose `score` is a list of exactly `len` numbers, each in [0, 10].
//!   Text around the object (a markdown code fence, a sentence) is allowed; two objects are a
//!   failure.
//!
//! How this differs from the originals (docs/reference/qwen3-vl-verified.md §8-9):
//!
//! | reply | original scorer, in-process (`qwen3_vl_reward.py`) | original, standalone (`qwen3_vl_standalone.py`) | VIEScore (`viescore/utils.py`) | here |
//! |---|---|---|---|---|
//! | no score at all | 5.0 | 5.0 | retried once, then `random.randint(0, 10)` | `ParseFailed` |
//! | `Score: 12` | clamped to 10 | skipped, next pattern (any other number) | — | `ParseFailed` (out of range) |
//! | `The edit is good, 8` | 8 (any number) | 8 (any number) | — | `ParseFailed` |
//! | `评分：7` | 7 (any number) | 7 (Chinese label) | — | `ParseFailed` unless the set lists `评分` in `score_labels` |
//! | `Score: 6 ... Score: 8` | 6 (first) | 6 (first) | — | `ParseFailed` (differing values) |
//! | a failed batch | 5.0 per item | 5.0 per item | retried | no record; the item runs again |
//! | `[6, 4]` (bare list) | — | — | accepted | `ParseFailed` (no JSON object) |
//! | `{"score": 7}` | — | — | wrapped to `[7]` | `ParseFailed` (not a list) |
//! | broken JSON | — | — | repaired by `fix_json` | `ParseFailed` |
//! | `{"score": [11, 3]}` | — | — | accepted (min 3) | `ParseFailed` (out of range) |

use serde::{Deserialize, Serialize};

/// VIEScore's delimiter around the JSON object (`viescore/utils.py`).
pub const VIESCORE_DELIMITER: &str = "||V^=^V||";

/// How a call's reply is read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ReplyFormat {
    /// `Score: X`, X in [0, 10]; `labels` are the words that may precede the colon.
    ScoreLine {
        /// Accepted labels (`["Score"]` by default).
        labels: Vec<String>,
    },
    /// A JSON object whose `score` is a list of `len` numbers in [0, 10].
    ScoreList {
        /// The list's length the prompt asks for.
        len: usize,
    },
}

/// A reply that does not parse: why, and the reply as it came.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("reply does not parse: {reason}")]
pub struct ParseFailed {
    /// What was wrong, naming the value at fault.
    pub reason: String,
    /// The reply.
    pub raw: String,
}

/// Parses a reply in `format`: the scores (one for `ScoreLine`, `len` for `ScoreList`).
pub fn parse_reply(raw: &str, format: &ReplyFormat) -> Result<Vec<f64>, ParseFailed> {
    match format {
        ReplyFormat::ScoreLine { labels } => parse_score_line(raw, labels).map(|v| vec![v]),
        ReplyFormat::ScoreList { len } => parse_score_list(raw, *len),
    }
}

fn failed(raw: &str, reason: impl Into<String>) -> ParseFailed {
    ParseFailed {
        reason: reason.into(),
        raw: raw.to_string(),
    }
}

const LOW: f64 = 0.0;
const HIGH: f64 = 10.0;

fn in_range(v: f64) -> bool {
    (LOW..=HIGH).contains(&v)
}

/// Case-insensitive (ASCII) positions of `label` in `text` not inside an ASCII word (`Subscore`
/// is not `Score`; a CJK label may follow other CJK text, `总评分`).
fn label_positions(text: &str, label: &str) -> Vec<usize> {
    let lower = text.to_ascii_lowercase();
    let needle = label.to_ascii_lowercase();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(rel) = lower[from..].find(&needle) {
        let at = from + rel;
        let end = at + needle.len();
        let before_ok = text[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !c.is_ascii_alphanumeric());
        let after_ok = text[end..]
            .chars()
            .next()
            .is_none_or(|c| !c.is_ascii_alphanumeric());
        if before_ok && after_ok {
            out.push(at);
        }
        from = end.max(at + 1);
        while !lower.is_char_boundary(from) {
            from += 1;
        }
    }
    out
}

/// What follows a label occurrence.
enum AfterLabel {
    /// A number (as written, and its value).
    Number(String, f64),
    /// A number with a denominator or percent sign that is not `/10`.
    OtherScale(String),
    /// No colon, or a colon without a number.
    Nothing,
}

fn read_after_label(rest: &str) -> AfterLabel {
    let skip_emphasis = |s: &str| -> usize {
        s.char_indices()
            .find(|&(_, c)| !matches!(c, '*' | '_' | ' ' | '\t'))
            .map_or(s.len(), |(i, _)| i)
    };
    let mut i = skip_emphasis(rest);
    let colon = rest[i..].chars().next();
    match colon {
        Some(':') | Some('：') => i += colon.map_or(0, char::len_utf8),
        _ => return AfterLabel::Nothing,
    }
    i += skip_emphasis(&rest[i..]);
    let s = &rest[i..];
    let b = s.as_bytes();
    let mut j = 0;
    if matches!(b.first(), Some(b'-') | Some(b'+')) {
        j += 1;
    }
    let int_start = j;
    while j < b.len() && b[j].is_ascii_digit() {
        j += 1;
    }
    if j == int_start {
        return AfterLabel::Nothing;
    }
    if j + 1 < b.len() && b[j] == b'.' && b[j + 1].is_ascii_digit() {
        j += 1;
        while j < b.len() && b[j].is_ascii_digit() {
            j += 1;
        }
    }
    let number = &s[..j];
    let Ok(value) = number.parse::<f64>() else {
        return AfterLabel::Nothing;
    };
    // A denominator or a percent sign, possibly after spaces.
    let tail = s[j..].trim_start_matches([' ', '\t']);
    if let Some(den) = tail.strip_prefix('/') {
        let den = den.trim_start_matches([' ', '\t']);
        let digits: String = den.chars().take_while(char::is_ascii_digit).collect();
        if digits == "10" && !den[2..].starts_with(|c: char| c == '.' || c.is_ascii_digit()) {
            return AfterLabel::Number(number.to_string(), value);
        }
        return AfterLabel::OtherScale(format!("{number}/{digits}"));
    }
    if tail.starts_with('%') {
        return AfterLabel::OtherScale(format!("{number}%"));
    }
    AfterLabel::Number(number.to_string(), value)
}

/// Parses `<label>: X` (see the module docs) and returns X.
pub fn parse_score_line(raw: &str, labels: &[String]) -> Result<f64, ParseFailed> {
    if raw.trim().is_empty() {
        return Err(failed(raw, "the reply is empty"));
    }
    let mut found: Vec<(usize, String, f64)> = Vec::new();
    let mut other_scales = Vec::new();
    for label in labels {
        for at in label_positions(raw, label) {
            match read_after_label(&raw[at + label.len()..]) {
                AfterLabel::Number(text, v) => found.push((at, text, v)),
                AfterLabel::OtherScale(s) => other_scales.push(s),
                AfterLabel::Nothing => {}
            }
        }
    }
    let shown = labels
        .iter()
        .map(|l| format!("`{l}: X`"))
        .collect::<Vec<_>>()
        .join(" or ");
    if found.is_empty() {
        if let Some(s) = other_scales.first() {
            return Err(failed(
                raw,
                format!("the score {s} is not on the 0-10 scale the prompt asks for"),
            ));
        }
        return Err(failed(raw, format!("no {shown} in the reply")));
    }
    found.sort_by_key(|f| f.0);
    let first = found[0].2;
    if found.iter().any(|f| f.2 != first) {
        let values: Vec<&str> = found.iter().map(|f| f.1.as_str()).collect();
        return Err(failed(
            raw,
            format!(
                "several different scores ({}); the prompt asks for one",
                values.join(", ")
            ),
        ));
    }
    if !other_scales.is_empty() {
        return Err(failed(
            raw,
            format!(
                "a score {} and a score {} on another scale",
                found[0].1, other_scales[0]
            ),
        ));
    }
    if !in_range(first) {
        return Err(failed(
            raw,
            format!("the score {} is outside [0, 10]", found[0].1),
        ));
    }
    Ok(first)
}

/// Parses VIEScore's JSON reply (see the module docs) and returns its `score` list.
pub fn parse_score_list(raw: &str, len: usize) -> Result<Vec<f64>, ParseFailed> {
    if raw.trim().is_empty() {
        return Err(failed(raw, "the reply is empty"));
    }
    let delimiters = raw.matches(VIESCORE_DELIMITER).count();
    let region = match delimiters {
        0 => raw,
        2 => {
            let start = raw.find(VIESCORE_DELIMITER).unwrap_or(0) + VIESCORE_DELIMITER.len();
            let end = raw.rfind(VIESCORE_DELIMITER).unwrap_or(raw.len());
            &raw[start..end]
        }
        n => {
            return Err(failed(
                raw,
                format!("the delimiter {VIESCORE_DELIMITER} appears {n} times; it encloses the answer (twice) or is absent"),
            ))
        }
    };
    let (Some(open), Some(close)) = (region.find('{'), region.rfind('}')) else {
        return Err(failed(
            raw,
            "no JSON object; the prompt asks for {\"score\" : [...], \"reasoning\" : \"...\"}",
        ));
    };
    if close < open {
        return Err(failed(raw, "no JSON object (a `}` before the first `{`)"));
    }
    let span: String = region[open..=close]
        .chars()
        .filter(|&c| c != '\n' && c != '\r')
        .collect();
    let value: serde_json::Value = match serde_json::from_str(&span) {
        Ok(v) => v,
        Err(e) => return Err(failed(raw, format!("the JSON object does not parse ({e})"))),
    };
    let Some(scores) = value.get("score") else {
        return Err(failed(raw, "the JSON object has no \"score\" field"));
    };
    let Some(list) = scores.as_array() else {
        return Err(failed(
            raw,
            format!("\"score\" is {scores}, not a list of {len} numbers"),
        ));
    };
    let mut out = Vec::with_capacity(list.len());
    for v in list {
        match v.as_f64() {
            Some(x) if in_range(x) => out.push(x),
            Some(_) => {
                return Err(failed(
                    raw,
                    format!("the score {v} is outside [0, 10] (in \"score\")"),
                ))
            }
            None => {
                return Err(failed(
                    raw,
                    format!("\"score\" holds {v}, which is not a number"),
                ))
            }
        }
    }
    if out.len() != len {
        return Err(failed(
            raw,
            format!(
                "\"score\" has {} number(s); the prompt asks for {len}",
                out.len()
            ),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(raw: &str) -> Result<f64, ParseFailed> {
        parse_score_line(raw, &["Score".to_string()])
    }

    fn reason(r: Result<impl std::fmt::Debug, ParseFailed>) -> String {
        let e = r.unwrap_err();
        e.reason
    }

    #[test]
    fn score_lines_that_parse() {
        assert_eq!(line("Score: 7.500").unwrap(), 7.5);
        assert_eq!(line("**Score: 7.5**").unwrap(), 7.5);
        assert_eq!(line("**Score:** 7.5").unwrap(), 7.5);
        assert_eq!(line("Score: **8**").unwrap(), 8.0);
        assert_eq!(line("score：6").unwrap(), 6.0);
        assert_eq!(
            line("Score: 8\n\nThe edit keeps the lighting consistent.").unwrap(),
            8.0
        );
        assert_eq!(
            line("The shadows are off by 2 degrees and 3 objects float.\nFinal Score: 4.25.")
                .unwrap(),
            4.25
        );
        assert_eq!(line("Score: 7/10").unwrap(), 7.0);
        assert_eq!(line("Score: 10").unwrap(), 10.0);
        assert_eq!(line("Score: 0.000").unwrap(), 0.0);
        // The same value twice is one answer.
        assert_eq!(line("Score: 6\n...\nScore: 6.0").unwrap(), 6.0);
    }

    #[test]
    fn score_lines_that_fail_say_why() {
        assert_eq!(reason(line("")), "the reply is empty");
        assert_eq!(reason(line("  \n")), "the reply is empty");
        assert!(reason(line("The edit is good, 8")).contains("no `Score: X`"));
        assert!(reason(line("Score: X.XXX")).contains("no `Score: X`"));
        assert!(reason(line("Score: 12")).contains("12 is outside [0, 10]"));
        assert!(reason(line("Score: -1")).contains("-1 is outside"));
        assert!(reason(line("Score: 75/100")).contains("75/100"));
        assert!(reason(line("Score: 80%")).contains("80%"));
        let r = reason(line("Score: 6\nOn reflection, Score: 8"));
        assert!(r.contains("6, 8"), "{r}");
        // A word that merely contains the label is not the label.
        assert!(reason(line("Subscore: 4")).contains("no `Score: X`"));
        // No colon: not the format.
        assert!(reason(line("Score 7")).contains("no"));
        let e = line("评分：7").unwrap_err();
        assert_eq!(e.raw, "评分：7");
    }

    #[test]
    fn chinese_labels_parse_when_the_set_lists_them() {
        let labels = vec!["Score".to_string(), "评分".to_string()];
        assert_eq!(parse_score_line("评分：7", &labels).unwrap(), 7.0);
        assert_eq!(parse_score_line("总评分: 6.5", &labels).unwrap(), 6.5);
    }

    #[test]
    fn score_lists_that_parse() {
        let ok = |s: &str| parse_score_list(s, 2).unwrap();
        assert_eq!(
            ok("{\n\"score\" : [7, 9],\n\"reasoning\" : \"fine\"\n}"),
            vec![7.0, 9.0]
        );
        assert_eq!(
            ok("```json\n{\"score\": [5, 10], \"reasoning\": \"ok\"}\n```"),
            vec![5.0, 10.0]
        );
        assert_eq!(
            ok("||V^=^V||\n{\"score\": [3, 4.5], \"reasoning\": \"a\nb\"}\n||V^=^V||"),
            vec![3.0, 4.5]
        );
        assert_eq!(
            ok("Here is my evaluation: {\"score\": [0, 2], \"reasoning\": \"x\"} Done."),
            vec![0.0, 2.0]
        );
    }

    #[test]
    fn score_lists_that_fail_say_why() {
        let bad = |s: &str| reason(parse_score_list(s, 2));
        assert_eq!(bad(""), "the reply is empty");
        assert!(bad("[6, 0]").contains("no JSON object"));
        assert!(bad("7").contains("no JSON object"));
        assert!(bad("{\"score\": 7, \"reasoning\": \"x\"}").contains("not a list"));
        assert!(bad("{\"score\": [11, 3]}").contains("11 is outside"));
        assert!(bad("{\"score\": [7]}").contains("has 1 number(s); the prompt asks for 2"));
        assert!(bad("{\"score\": [7, \"8\"]}").contains("not a number"));
        assert!(bad("{score: [7, 8]}").contains("does not parse"));
        assert!(bad("{\"score\": [1, 2]} and {\"score\": [3, 4]}").contains("does not parse"));
        assert!(bad("{\"reasoning\": \"x\"}").contains("no \"score\""));
        assert!(bad("||V^=^V|| {\"score\": [1, 2]}").contains("appears 1 times"));
        assert!(bad("} {").contains("no JSON object"));
    }

    #[test]
    fn parse_reply_dispatches_on_format() {
        let line_fmt = ReplyFormat::ScoreLine {
            labels: vec!["Score".into()],
        };
        assert_eq!(parse_reply("Score: 3", &line_fmt).unwrap(), vec![3.0]);
        let list_fmt = ReplyFormat::ScoreList { len: 2 };
        assert_eq!(
            parse_reply("{\"score\": [3, 4]}", &list_fmt).unwrap(),
            vec![3.0, 4.0]
        );
        let e = parse_reply("nothing", &list_fmt).unwrap_err();
        assert_eq!(e.raw, "nothing");
        assert!(e.to_string().starts_with("reply does not parse: "));
    }
}
