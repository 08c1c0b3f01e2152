//! Where a dataset item came from: the file and line a loader read it at, which records and
//! skip reports carry so that a person can find it.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// How many skipped lines a load report remembers per file and reason; the counts are always
/// exact.
pub const MAX_EXAMPLES_PER_REASON: usize = 100;

/// A line of a file: where an item came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SourceLocation {
    /// The file, as it was given to the loader.
    pub file: PathBuf,
    /// 1-based line number.
    pub line: usize,
}

impl SourceLocation {
    /// `line 12` when `other` is in the same file, else `file.json:12` (file name only), for
    /// short report details.
    pub fn relative_to(&self, other: &SourceLocation) -> String {
        if self.file == other.file {
            format!("line {}", self.line)
        } else {
            let name = self.file.file_name().map_or_else(
                || self.file.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            format!("{name}:{}", self.line)
        }
    }
}

impl fmt::Display for SourceLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file.display(), self.line)
    }
}
