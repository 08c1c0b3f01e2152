//! The errors of fleet-models. Each names the file, field or value at fault and the fix.

use std::path::PathBuf;

/// Errors from loading checkpoints, tokenizers and running models.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A required file is not in the checkpoint.
    #[error("{path} is missing: {hint}")]
    MissingFile {
        /// Where it was expected.
        path: PathBuf,
        /// What to do about it.
        hint: String,
    },
    /// A JSON file did not parse, or a field is missing or has the wrong type.
    #[error("{path}: {message}")]
    BadJson {
        /// The file.
        path: PathBuf,
        /// serde's message, naming the field and line.
        message: String,
    },
    /// A config field has a value fleet cannot use.
    #[error("{path}: field `{field}` = {value}: {hint}")]
    BadConfig {
        /// The config file.
        path: PathBuf,
        /// The field.
        field: String,
        /// The value found.
        value: String,
        /// What is allowed.
        hint: String,
    },
    /// The architecture in config.json is not one fleet implements.
    #[error("{path}: architecture `{arch}` is not supported; fleet runs {supported}")]
    UnsupportedArchitecture {
        /// The config file.
        path: PathBuf,
        /// `model_type` / `architectures` as found.
        arch: String,
        /// What fleet supports.
        supported: String,
    },
    /// A safetensors shard is truncated, malformed, or misses a tensor.
    #[error("{path}: {message}")]
    BadWeights {
        /// The shard.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// The requested dtype cannot run on the device.
    #[error("dtype {dtype} is not supported on {device}: {hint}")]
    UnsupportedDtype {
        /// The dtype asked for.
        dtype: String,
        /// The device.
        device: String,
        /// The alternative.
        hint: String,
    },
    /// A device id that the machine does not have, or a build without GPU support.
    #[error("device {device} is not available: {hint}")]
    DeviceUnavailable {
        /// The device asked for.
        device: String,
        /// Why and what to do.
        hint: String,
    },
    /// Input that the model cannot take (too long, empty, out-of-vocabulary ids…).
    #[error("{0}")]
    BadInput(String),
    /// The caller's loss function failed inside a training pass
    /// (`TrainableQwen::forward_backward`): its own error, kept whole. A crate whose loss has
    /// an error type of its own gives it `From` for this (`ModelError::loss`), so that `?`
    /// converts it inside the loss closure.
    #[error("{0}")]
    Loss(Box<dyn std::error::Error + Send + Sync>),
    /// The model source could not be resolved (hub offline, unknown repo…).
    #[error("model `{model}`: {message}")]
    Source {
        /// The model id or path as given.
        model: String,
        /// What went wrong and what to do.
        message: String,
    },
    /// The tokenizer failed.
    #[error("tokenizer {path}: {message}")]
    Tokenizer {
        /// tokenizer.json.
        path: PathBuf,
        /// The tokenizer's message.
        message: String,
    },
    /// The chat template failed to parse or render.
    #[error("chat template of {path}: {message}")]
    ChatTemplate {
        /// tokenizer_config.json (or the template file).
        path: PathBuf,
        /// minijinja's message.
        message: String,
    },
    /// A device map that does not match the model.
    #[error(transparent)]
    Topology(#[from] fleet_topology::TopologyError),
    /// Work spread over replicas failed (fleet-serve's replica layer: every replica failed a
    /// batch, a replica process stopped, or the pool refused).
    #[error("replicas: {0}")]
    Replicas(String),
    /// Vectors made by one embedder compared with another's (see `EmbedderId::check_compatible`).
    #[error(
        "embedder mismatch: the vectors were made with {expected}, this embedder is {found}; they \
         differ in {differences}. Rebuild the index with this embedder, or load the one it was \
         built with"
    )]
    EmbedderMismatch {
        /// The embedder the index was built with (its model path or hub id).
        expected: String,
        /// The embedder at hand.
        found: String,
        /// Each differing field with both values.
        differences: String,
    },
    /// The model computed NaN or infinite values (from weights that hold them, or activations
    /// that overflow the compute dtype).
    #[error("{what} are not finite ({value}): {hint}")]
    NonFinite {
        /// What is not finite (which logits: row and position).
        what: String,
        /// The first bad value and how many there are.
        value: String,
        /// The likely cause and what to do.
        hint: String,
    },
    /// An error inside candle while computing.
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
}

/// Result alias for this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// A config file's error as the variant of the same name (the same message).
impl From<fleet_config::ConfigError> for ModelError {
    fn from(e: fleet_config::ConfigError) -> Self {
        use fleet_config::ConfigError as C;
        match e {
            C::Io { path, source } => ModelError::Io { path, source },
            C::BadJson { path, message } => ModelError::BadJson { path, message },
            C::BadConfig {
                path,
                field,
                value,
                hint,
            } => ModelError::BadConfig {
                path,
                field,
                value,
                hint,
            },
            C::UnsupportedArchitecture {
                path,
                arch,
                supported,
            } => ModelError::UnsupportedArchitecture {
                path,
                arch,
                supported,
            },
        }
    }
}

impl ModelError {
    /// [`ModelError::Loss`] holding `error`: a loss function's own error.
    pub fn loss(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        ModelError::Loss(Box::new(error))
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}
