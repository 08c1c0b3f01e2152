//! The errors of fleet-config. Each names the file, the field and the value at fault and the fix.

use std::path::{Path, PathBuf};

/// Why a config file could not be read or used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not JSON, or a field is missing or has the wrong type.
    #[error("{path}: {message}")]
    BadJson {
        /// The file.
        path: PathBuf,
        /// serde's message, naming the field (and the line where there is one).
        message: String,
    },
    /// A field has a value fleet cannot use.
    #[error("{path}: field `{field}` = {value}: {hint}")]
    BadConfig {
        /// The file.
        path: PathBuf,
        /// The field (`text_config.` / `vision_config.` in front for a Qwen3-VL section).
        field: String,
        /// The value found.
        value: String,
        /// What is allowed, and what to do.
        hint: String,
    },
    /// The architecture of the file is not one fleet implements.
    #[error("{path}: architecture `{arch}` is not supported; fleet runs {supported}")]
    UnsupportedArchitecture {
        /// The file.
        path: PathBuf,
        /// `model_type` / `architectures` as found.
        arch: String,
        /// What fleet supports.
        supported: String,
    },
}

/// Result alias for this crate.
pub type Result<T, E = ConfigError> = std::result::Result<T, E>;

impl ConfigError {
    /// [`ConfigError::BadConfig`] for `field` of `path`.
    pub(crate) fn bad(
        path: &Path,
        field: impl Into<String>,
        value: String,
        hint: impl Into<String>,
    ) -> Self {
        ConfigError::BadConfig {
            path: path.to_path_buf(),
            field: field.into(),
            value,
            hint: hint.into(),
        }
    }
}

/// The text of `path`.
pub(crate) fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// `text` as a JSON value; `path` names it in the error.
pub(crate) fn parse_value(text: &str, path: &Path) -> Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| ConfigError::BadJson {
        path: path.to_path_buf(),
        message: format!("not valid JSON: {e}"),
    })
}

/// The `model_type` of the config `raw` when it is one of `allowed`; otherwise
/// [`ConfigError::UnsupportedArchitecture`] naming it and the `architectures` found, and saying
/// what fleet runs (`supported`). Checked before any field, so that another model says so rather
/// than "missing field".
pub(crate) fn model_type(
    raw: &serde_json::Value,
    allowed: &[&str],
    supported: &str,
    path: &Path,
) -> Result<String> {
    let model_type = raw
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("<missing>");
    if !allowed.contains(&model_type) {
        let archs = raw
            .get("architectures")
            .map(|v| v.to_string())
            .unwrap_or_default();
        return Err(ConfigError::UnsupportedArchitecture {
            path: path.to_path_buf(),
            arch: format!("model_type={model_type} architectures={archs}"),
            supported: supported.into(),
        });
    }
    Ok(model_type.to_string())
}

/// serde's error `e` for fields of the config at `path` (`section` in front of it, e.g.
/// `text_config: `), with the fix.
pub(crate) fn bad_fields(path: &Path, section: &str, e: serde_json::Error) -> ConfigError {
    ConfigError::BadJson {
        path: path.to_path_buf(),
        message: format!(
            "{section}{e}; compare with the config.json the checkpoint was published with"
        ),
    }
}

/// `text` deserialized as `T`; `path` names it in the error (serde's message, with the line and
/// column).
pub(crate) fn parse<T: serde::de::DeserializeOwned>(text: &str, path: &Path) -> Result<T> {
    serde_json::from_str(text).map_err(|e| ConfigError::BadJson {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// A required field that the file does not have: why a raw struct does not convert into its
/// validated view (`QwenConfig::try_from(RawConfig)`). Its message is serde's for a missing
/// field, so that deserializing a view through its raw struct says what a derived one would.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingField(pub &'static str);

impl std::error::Error for MissingField {}

impl std::fmt::Display for MissingField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "missing field `{}`", self.0)
    }
}

/// `value`, or [`MissingField`] naming `field`.
pub(crate) fn required<T>(value: Option<T>, field: &'static str) -> Result<T, MissingField> {
    value.ok_or(MissingField(field))
}
