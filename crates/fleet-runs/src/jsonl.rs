//! Append-only JSON Lines files that survive a kill: per-item records and caches.
//!
//! A run appends one line per finished item, each with a single `write` call, so a kill leaves
//! at most the last line torn (no newline, not parseable). [`JsonlLog::open`] reads what is
//! there and repairs that tail before anything is appended after it: a record written after a
//! torn line would otherwise be glued to it and lost too.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::atomic::parent_dir;
use crate::{Result, RunsError};

/// A complete line that did not parse as a record. It stays in the file; its item counts as
/// not done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    /// 1-based line number.
    pub line: usize,
    /// Why it did not parse.
    pub reason: String,
}

/// What [`JsonlLog::open`] did to a last line without its newline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TailRepair {
    /// The last line was whole JSON missing only its newline (a kill between the two): the
    /// newline was added and the line kept.
    Terminated {
        /// 1-based line number.
        line: usize,
    },
    /// The last line was cut off mid-write: the file was truncated back to the end of the
    /// line before it, so the item runs again.
    Truncated {
        /// 1-based line number of the removed fragment.
        line: usize,
        /// Bytes removed.
        bytes: usize,
    },
}

impl std::fmt::Display for TailRepair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TailRepair::Terminated { line } => {
                write!(f, "line {line} was missing its newline; added")
            }
            TailRepair::Truncated { line, bytes } => write!(
                f,
                "line {line} was cut off mid-write ({bytes} bytes, a killed run); removed, its item runs again"
            ),
        }
    }
}

/// The records read when a log was opened.
#[derive(Debug, Clone)]
pub struct JsonlContents<T> {
    /// Records in file order.
    pub records: Vec<T>,
    /// Lines that did not parse (kept in the file).
    pub bad_lines: Vec<BadLine>,
    /// The repair of a torn last line, if there was one.
    pub repair: Option<TailRepair>,
}

impl<T> JsonlContents<T> {
    /// A one-line account of what was wrong with the file, or `None` when nothing was.
    pub fn problems(&self, path: &Path) -> Option<String> {
        if self.bad_lines.is_empty() && self.repair.is_none() {
            return None;
        }
        let mut parts = Vec::new();
        if let Some(r) = &self.repair {
            parts.push(r.to_string());
        }
        if !self.bad_lines.is_empty() {
            let lines: Vec<String> = self
                .bad_lines
                .iter()
                .take(5)
                .map(|b| format!("{} ({})", b.line, b.reason))
                .collect();
            let more = self.bad_lines.len().saturating_sub(5);
            parts.push(format!(
                "{} unreadable line(s) left in place and their items run again: {}{}",
                self.bad_lines.len(),
                lines.join("; "),
                if more > 0 {
                    format!("; and {more} more")
                } else {
                    String::new()
                }
            ));
        }
        Some(format!("{}: {}", path.display(), parts.join("; ")))
    }
}

/// An append-only JSONL file, one record per line.
#[derive(Debug)]
pub struct JsonlLog {
    path: PathBuf,
    file: File,
}

impl JsonlLog {
    /// Opens (or creates) `path` for appending and returns the records already in it.
    ///
    /// A last line without its newline is repaired first ([`TailRepair`]): whole JSON gets its
    /// newline, a fragment is cut off. Other lines that do not parse as `T` are reported in
    /// [`JsonlContents::bad_lines`] and left alone. The caller must be the file's only writer
    /// (see [`crate::RunDir`], which holds the directory's lock).
    pub fn open<T: DeserializeOwned>(path: &Path) -> Result<(JsonlLog, JsonlContents<T>)> {
        let dir = parent_dir(path);
        std::fs::create_dir_all(&dir).map_err(|e| RunsError::io("create directory", &dir, e))?;
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(RunsError::io("read", path, e)),
        };
        let mut contents = JsonlContents {
            records: Vec::new(),
            bad_lines: Vec::new(),
            repair: None,
        };
        // Complete lines end with '\n'; whatever follows the last one is the tail.
        let complete_end = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let mut line_no = 0;
        for line in bytes[..complete_end].split(|&b| b == b'\n') {
            line_no += 1;
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match parse::<T>(line) {
                Ok(r) => contents.records.push(r),
                Err(reason) => contents.bad_lines.push(BadLine {
                    line: line_no,
                    reason,
                }),
            }
        }
        // `split` yields one empty piece after the final '\n'; the tail's number is that one's.
        let tail_line = line_no.max(1);
        let tail = &bytes[complete_end..];
        let mut terminate = false;
        let mut truncate = false;
        if !tail.is_empty() {
            if tail.iter().all(u8::is_ascii_whitespace) {
                truncate = true;
            } else {
                match parse::<T>(tail) {
                    Ok(r) => {
                        contents.records.push(r);
                        terminate = true;
                    }
                    // Whole JSON of another shape is a complete (bad) line, not a torn one.
                    Err(reason) if serde_json::from_slice::<serde_json::Value>(tail).is_ok() => {
                        contents.bad_lines.push(BadLine {
                            line: tail_line,
                            reason,
                        });
                        terminate = true;
                    }
                    Err(_) => truncate = true,
                }
            }
        }
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| RunsError::io("open for appending", path, e))?;
        if truncate {
            file.set_len(complete_end as u64)
                .map_err(|e| RunsError::io("truncate the torn last line of", path, e))?;
            contents.repair = Some(TailRepair::Truncated {
                line: tail_line,
                bytes: tail.len(),
            });
        } else if terminate {
            file.write_all(b"\n")
                .map_err(|e| RunsError::io("append to", path, e))?;
            contents.repair = Some(TailRepair::Terminated { line: tail_line });
        }
        Ok((
            JsonlLog {
                path: path.to_path_buf(),
                file,
            },
            contents,
        ))
    }

    /// Appends one record as one line, in a single write (a kill tears at most this line; a
    /// failed write is cut back off).
    pub fn append<T: Serialize + ?Sized>(&mut self, record: &T) -> Result<()> {
        let mut line = serde_json::to_vec(record).map_err(|source| RunsError::Json {
            what: format!("a record for {}", self.path.display()),
            source,
        })?;
        line.push(b'\n');
        let before = self
            .file
            .metadata()
            .map_err(|e| RunsError::io("append to", &self.path, e))?
            .len();
        self.file.write_all(&line).map_err(|e| {
            // A write cut short (a full disk) leaves part of the line: cut the file back so it
            // holds whole records only. If even that fails, the next open repairs the tail.
            let _ = self.file.set_len(before);
            RunsError::io("append to", &self.path, e)
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn parse<T: DeserializeOwned>(line: &[u8]) -> std::result::Result<T, String> {
    let text = std::str::from_utf8(line).map_err(|_| "not valid UTF-8".to_string())?;
    serde_json::from_str(text.trim()).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Rec {
        key: String,
        value: u32,
    }

    fn rec(key: &str, value: u32) -> Rec {
        Rec {
            key: key.into(),
            value,
        }
    }

    #[test]
    fn a_line_cut_in_half_is_removed_before_the_next_append() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("records.jsonl");
        let (mut log, _) = JsonlLog::open::<Rec>(&path).unwrap();
        log.append(&rec("a", 1)).unwrap();
        log.append(&rec("b", 2)).unwrap();
        drop(log);
        // A kill in the middle of the third write.
        let whole = serde_json::to_string(&rec("c", 3)).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&whole.as_bytes()[..whole.len() / 2]);
        std::fs::write(&path, &bytes).unwrap();

        let (mut log, contents) = JsonlLog::open::<Rec>(&path).unwrap();
        assert_eq!(contents.records, vec![rec("a", 1), rec("b", 2)]);
        assert!(contents.bad_lines.is_empty());
        assert_eq!(
            contents.repair,
            Some(TailRepair::Truncated {
                line: 3,
                bytes: whole.len() / 2
            })
        );
        log.append(&rec("c", 3)).unwrap();
        drop(log);
        let (_, again) = JsonlLog::open::<Rec>(&path).unwrap();
        assert_eq!(again.records, vec![rec("a", 1), rec("b", 2), rec("c", 3)]);
        assert!(again.bad_lines.is_empty() && again.repair.is_none());
    }

    #[test]
    fn a_whole_last_line_without_newline_is_kept_and_terminated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.jsonl");
        std::fs::write(&path, r#"{"key":"a","value":1}"#).unwrap();
        let (mut log, contents) = JsonlLog::open::<Rec>(&path).unwrap();
        assert_eq!(contents.records, vec![rec("a", 1)]);
        assert_eq!(contents.repair, Some(TailRepair::Terminated { line: 1 }));
        log.append(&rec("b", 2)).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 2, "{text}");
    }

    #[test]
    fn bad_middle_lines_are_reported_with_numbers_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.jsonl");
        let text = "{\"key\":\"a\",\"value\":1}\nnot json\n\n{\"other\":true}\n";
        std::fs::write(&path, text).unwrap();
        let (_, contents) = JsonlLog::open::<Rec>(&path).unwrap();
        assert_eq!(contents.records, vec![rec("a", 1)]);
        let lines: Vec<usize> = contents.bad_lines.iter().map(|b| b.line).collect();
        assert_eq!(lines, vec![2, 4]);
        assert!(contents.repair.is_none());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        let msg = contents.problems(&path).unwrap();
        assert!(msg.contains("2 unreadable line(s)"), "{msg}");
    }

    #[test]
    fn a_missing_file_is_created_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("new").join("r.jsonl");
        let (_, contents) = JsonlLog::open::<Rec>(&path).unwrap();
        assert!(contents.records.is_empty() && contents.problems(&path).is_none());
        assert!(path.exists());
    }
}
