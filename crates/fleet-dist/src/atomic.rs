//! Files written whole or not at all: a temporary sibling, synced, then renamed over the target.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::{DistError, Result};

/// The directory a file lives in (`.` for a bare file name).
pub(crate) fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory (created when
/// missing), flushed and synced, then renamed over `path`. A reader — or a run resumed after a
/// kill — sees the old file or the new one, never half of one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = parent_dir(path);
    std::fs::create_dir_all(&dir).map_err(|e| DistError::io("create directory", &dir, e))?;
    let name = path
        .file_name()
        .ok_or_else(|| DistError::OutputNotAFile {
            path: path.to_path_buf(),
        })?
        .to_string_lossy()
        .into_owned();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(DistError::WriteOutput {
            path: path.to_path_buf(),
            source: e,
        });
    }
    Ok(())
}

/// Serializes `value` as pretty JSON (with a final newline) and writes it atomically.
pub fn write_json_atomic<T: Serialize + ?Sized>(path: &Path, value: &T) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).map_err(|source| DistError::Json {
        what: path.display().to_string(),
        source,
    })?;
    text.push('\n');
    write_atomic(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("a.json");
        write_json_atomic(&path, &serde_json::json!({"x": 1})).unwrap();
        write_json_atomic(&path, &serde_json::json!({"x": 2})).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "{\n  \"x\": 2\n}\n");
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("a.json")]);
    }

    #[test]
    fn a_path_without_file_name_is_an_error() {
        let err = write_atomic(Path::new("/"), b"x").unwrap_err();
        assert!(matches!(err, DistError::OutputNotAFile { .. }), "{err}");
    }
}
