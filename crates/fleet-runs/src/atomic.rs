//! Files written whole or not at all: a temporary sibling, synced, then renamed over the target.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::{Result, RunsError};

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
    std::fs::create_dir_all(&dir).map_err(|e| RunsError::io("create directory", &dir, e))?;
    let name = path
        .file_name()
        .ok_or_else(|| RunsError::OutputNotAFile {
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
        return Err(RunsError::WriteOutput {
            path: path.to_path_buf(),
            source: e,
        });
    }
    Ok(())
}

/// Gives `path` the permissions a new file gets from `File::create` under this process's
/// umask (0644 under the usual 022). For files another library wrote through a private
/// temporary file (safetensors' writer creates 0600 files): checkpoints must be readable by
/// whoever may read the output directory. The mode is read from a probe file made beside
/// `path`, so it is exactly what the umask gives, ACLs and all.
pub fn set_created_permissions(path: &Path) -> Result<()> {
    let dir = parent_dir(path);
    let probe = dir.join(format!(".fleet-mode-probe-{}", std::process::id()));
    let result = (|| {
        let mode = std::fs::File::create(&probe)?.metadata()?.permissions();
        std::fs::remove_file(&probe)?;
        std::fs::set_permissions(path, mode)
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&probe);
        RunsError::WriteOutput {
            path: path.to_path_buf(),
            source: e,
        }
    })
}

/// Removes the hidden temporary files and directories that writes interrupted by a kill or a
/// failure left in `dir` and the directories below it: names that start with `.` and hold
/// `.tmp` (fleet's `.<name>.tmp-<pid>`, the safetensors writer's `.tmpXXXXXX`). Only for a
/// directory this process holds alone (a [`crate::RunDir`]). Returns what was removed.
pub fn remove_stale_temporaries(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(RunsError::io("list", dir, e)),
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if name.starts_with('.') && name.contains(".tmp") {
            let gone = if is_dir {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            gone.map_err(|e| RunsError::io("remove", &path, e))?;
            removed.push(path);
        } else if is_dir {
            removed.extend(remove_stale_temporaries(&path)?);
        }
    }
    Ok(removed)
}

/// Serializes `value` as pretty JSON (with a final newline) and writes it atomically.
pub fn write_json_atomic<T: Serialize + ?Sized>(path: &Path, value: &T) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).map_err(|source| RunsError::Json {
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

    #[cfg(unix)]
    #[test]
    fn permissions_follow_the_umask_not_the_writer() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        std::fs::write(&path, b"x").unwrap();
        let created = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        set_created_permissions(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, created);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn stale_temporaries_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join(".checkpoint-4.tmp-77/sub")).unwrap();
        std::fs::create_dir_all(d.join("checkpoint-2")).unwrap();
        for f in [
            ".summary.json.tmp-12",
            ".tmpAbC123",
            "checkpoint-2/.optimizer.safetensors.tmp-9",
            "checkpoint-2/model.safetensors",
            ".fleet-lock",
            "metrics.jsonl",
            "notes.tmp",
        ] {
            std::fs::write(d.join(f), b"x").unwrap();
        }
        let mut removed = remove_stale_temporaries(d).unwrap();
        removed.sort();
        let mut want = vec![
            d.join(".checkpoint-4.tmp-77"),
            d.join(".summary.json.tmp-12"),
            d.join(".tmpAbC123"),
            d.join("checkpoint-2/.optimizer.safetensors.tmp-9"),
        ];
        want.sort();
        assert_eq!(removed, want);
        for kept in [
            "checkpoint-2/model.safetensors",
            ".fleet-lock",
            "metrics.jsonl",
            "notes.tmp",
        ] {
            assert!(d.join(kept).exists(), "{kept}");
        }
    }

    #[test]
    fn a_path_without_file_name_is_an_error() {
        let err = write_atomic(Path::new("/"), b"x").unwrap_err();
        assert!(matches!(err, RunsError::OutputNotAFile { .. }), "{err}");
    }
}
