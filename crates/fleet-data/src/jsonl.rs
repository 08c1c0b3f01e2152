//! Reading a JSONL dataset line by line, the way every job's loader does it: each line's fate
//! is its own (a bad line is skipped and reported by its number, the rest load), a final
//! newline does not make an empty last line, CRLF files read as LF files, and a UTF-8
//! byte-order mark before the first line is ignored.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One skipped line of a JSONL file, as every loader reports it: its 1-based number, why (the
/// loader's own reason type) and the details (the JSON error, the field at fault, the line it
/// repeats, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedLine<R> {
    /// 1-based line number in the file.
    pub line: usize,
    /// Why.
    pub reason: R,
    /// The JSON error, the field at fault, the line it repeats, ...
    pub detail: String,
}

/// What one line of a JSONL file holds.
#[derive(Debug, Clone, PartialEq)]
pub enum JsonlLine {
    /// A JSON value.
    Value(Value),
    /// Nothing but whitespace: not an item, counted apart from skipped lines.
    Blank,
    /// Not UTF-8, or not JSON: why, for the skip report.
    Malformed(String),
}

/// The raw lines of a file's bytes, split on `\n`; the empty piece after a final newline is not
/// a line.
pub fn split_lines(bytes: &[u8]) -> Vec<&[u8]> {
    let mut lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    if lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    lines
}

/// Line `line_no` (1-based) of a JSONL file, `raw` as [`split_lines`] gave it: a trailing `\r`
/// dropped, a byte-order mark dropped from line 1, then UTF-8 and JSON checked.
pub fn parse_line(line_no: usize, raw: &[u8]) -> JsonlLine {
    let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
    // A UTF-8 byte-order mark would make the first line malformed JSON; it carries no data.
    let raw = if line_no == 1 {
        raw.strip_prefix(b"\xef\xbb\xbf".as_slice()).unwrap_or(raw)
    } else {
        raw
    };
    let text = match std::str::from_utf8(raw) {
        Ok(t) => t,
        Err(e) => {
            return JsonlLine::Malformed(format!("invalid UTF-8 at byte {}", e.valid_up_to()))
        }
    };
    if text.trim().is_empty() {
        return JsonlLine::Blank;
    }
    match serde_json::from_str(text) {
        Ok(v) => JsonlLine::Value(v),
        Err(e) => JsonlLine::Malformed(e.to_string()),
    }
}

/// A JSON value's kind as error messages name it ("a string", "a list", ...).
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_numbered_as_a_person_counts_them_and_each_keeps_its_own_fate() {
        let bytes = b"\xef\xbb\xbf{\"a\": 1}\r\n\n  \nnot json\n\xff\xfe\n[2]\n";
        let lines = split_lines(bytes);
        assert_eq!(lines.len(), 6, "a final newline ends the last line");
        let parsed: Vec<JsonlLine> = lines
            .iter()
            .enumerate()
            .map(|(i, raw)| parse_line(i + 1, raw))
            .collect();
        assert_eq!(parsed[0], JsonlLine::Value(serde_json::json!({"a": 1})));
        assert_eq!(parsed[1], JsonlLine::Blank);
        assert_eq!(parsed[2], JsonlLine::Blank);
        assert!(matches!(&parsed[3], JsonlLine::Malformed(m) if m.contains("expected")));
        assert_eq!(
            parsed[4],
            JsonlLine::Malformed("invalid UTF-8 at byte 0".into())
        );
        assert_eq!(parsed[5], JsonlLine::Value(serde_json::json!([2])));
        // A byte-order mark counts only before the first line.
        assert!(matches!(
            parse_line(2, b"\xef\xbb\xbf[1]"),
            JsonlLine::Malformed(_)
        ));
        assert_eq!(json_kind(&serde_json::json!("x")), "a string");
    }
}
