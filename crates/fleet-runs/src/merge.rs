//! Merging the per-shard JSONL record files into one file sorted by `index`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use crate::{Result, RunsError};

/// A line that was skipped because it is not a JSON object with a non-negative integer `index`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MalformedLine {
    /// The file.
    pub file: PathBuf,
    /// 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    pub reason: String,
}

/// A record whose `index` was already seen; the first one is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Duplicate {
    /// The repeated index.
    pub index: u64,
    /// File and 1-based line of the record kept.
    pub kept: (PathBuf, usize),
    /// File and 1-based line of the record dropped.
    pub dropped: (PathBuf, usize),
}

/// Counts for one input file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputStats {
    /// The file.
    pub path: PathBuf,
    /// Non-blank lines read.
    pub lines: usize,
    /// Records taken into the output.
    pub records: usize,
}

/// What [`merge_jsonl`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeReport {
    /// One entry per input, in the order given.
    pub inputs: Vec<InputStats>,
    /// Records written to the output.
    pub records_written: usize,
    /// Skipped lines, with file and line number.
    pub malformed: Vec<MalformedLine>,
    /// Repeated indices (the first record was kept).
    pub duplicates: Vec<Duplicate>,
    /// Indices in `0..=max_index` that no input has (the first [`MAX_LISTED_MISSING`]).
    pub missing: Vec<u64>,
    /// How many indices in `0..=max_index` no input has (may exceed `missing.len()`).
    pub missing_count: u64,
    /// The largest index seen, `None` when there were no records.
    pub max_index: Option<u64>,
}

impl MergeReport {
    /// Whether the merge found nothing wrong: no malformed lines, duplicates or gaps.
    pub fn is_clean(&self) -> bool {
        self.malformed.is_empty() && self.duplicates.is_empty() && self.missing_count == 0
    }
}

/// At most this many missing indices are listed in [`MergeReport::missing`]; all are counted.
pub const MAX_LISTED_MISSING: usize = 100_000;

fn record_index(line: &str) -> std::result::Result<u64, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let obj = value
        .as_object()
        .ok_or_else(|| "not a JSON object".to_string())?;
    let index = obj
        .get("index")
        .ok_or_else(|| "no `index` field".to_string())?;
    index
        .as_u64()
        .ok_or_else(|| format!("`index` is {index}, not a non-negative integer"))
}

/// Merges per-shard JSONL files into `output`, sorted by each record's `index` field.
///
/// Every input line must be one JSON object with a non-negative integer `index` (the item's
/// global index). Blank lines are ignored; other lines that do not parse are skipped and listed in
/// [`MergeReport::malformed`] with file and line number. When an index repeats, the first record
/// (in input order, then line order) is kept and the others listed in
/// [`MergeReport::duplicates`]. Indices absent from `0..=max` are listed in
/// [`MergeReport::missing`]. Records are written exactly as read (one per line).
///
/// The output is written to a temporary file beside it and renamed into place, so readers never
/// see a half-written file; `output` may be one of the inputs.
///
/// Errors: [`RunsError::ReadInput`] when an input cannot be opened or read,
/// [`RunsError::WriteOutput`] when the output cannot be written, [`RunsError::OutputNotAFile`]
/// when `output` names no file.
pub fn merge_jsonl(inputs: &[PathBuf], output: &Path) -> Result<MergeReport> {
    if output.file_name().is_none() {
        return Err(RunsError::OutputNotAFile {
            path: output.to_path_buf(),
        });
    }

    let mut records: BTreeMap<u64, (String, usize, usize)> = BTreeMap::new();
    let mut stats = Vec::with_capacity(inputs.len());
    let mut malformed = Vec::new();
    let mut duplicates = Vec::new();

    for (file_no, path) in inputs.iter().enumerate() {
        let read_err = |source| RunsError::ReadInput {
            path: path.clone(),
            source,
        };
        let reader = BufReader::new(File::open(path).map_err(read_err)?);
        let mut st = InputStats {
            path: path.clone(),
            lines: 0,
            records: 0,
        };
        for (line_no, line) in reader.lines().enumerate() {
            let line_no = line_no + 1;
            let line = match line {
                Ok(l) => l,
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    st.lines += 1;
                    malformed.push(MalformedLine {
                        file: path.clone(),
                        line: line_no,
                        reason: "not valid UTF-8".to_string(),
                    });
                    continue;
                }
                Err(e) => return Err(read_err(e)),
            };
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            st.lines += 1;
            match record_index(line) {
                Err(reason) => {
                    tracing::warn!(file = %path.display(), line = line_no, "skipping malformed record: {reason}");
                    malformed.push(MalformedLine {
                        file: path.clone(),
                        line: line_no,
                        reason,
                    });
                }
                Ok(index) => {
                    if let Some((_, kept_file, kept_line)) = records.get(&index) {
                        tracing::warn!(index, file = %path.display(), line = line_no, "duplicate index, keeping the first");
                        duplicates.push(Duplicate {
                            index,
                            kept: (inputs[*kept_file].clone(), *kept_line),
                            dropped: (path.clone(), line_no),
                        });
                    } else {
                        records.insert(index, (line.to_string(), file_no, line_no));
                        st.records += 1;
                    }
                }
            }
        }
        stats.push(st);
    }

    let max_index = records.keys().next_back().copied();
    let mut missing = Vec::new();
    let mut missing_count = 0u64;
    let mut expected = 0u64;
    for &index in records.keys() {
        missing_count += index - expected;
        let room = MAX_LISTED_MISSING.saturating_sub(missing.len()) as u64;
        missing.extend(expected..index.min(expected.saturating_add(room)));
        expected = index.saturating_add(1);
    }

    let mut bytes = Vec::new();
    for (line, _, _) in records.values() {
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
    }
    crate::atomic::write_atomic(output, &bytes)?;

    let report = MergeReport {
        inputs: stats,
        records_written: records.len(),
        malformed,
        duplicates,
        missing,
        missing_count,
        max_index,
    };
    tracing::info!(
        written = report.records_written,
        malformed = report.malformed.len(),
        duplicates = report.duplicates.len(),
        missing = report.missing_count,
        output = %output.display(),
        "merged shard records"
    );
    Ok(report)
}
