//! The errors of a job's assembly, shared by the job crates: a setting that cannot work, a
//! step that failed with what was being done, or a step's error as it is. Each keeps its
//! cause chain, so after a binary's `?` into anyhow the messages read as the binary's own.
//!
//! A job crate wraps [`StepError`] in its own error type (`#[error(transparent)]`, with
//! `#[from] StepError`) and lists the errors of its steps with [`step_error_from!`].

/// A boxed cause.
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An error of one of a job's steps.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// A setting or input that cannot work, with the fix.
    #[error("{0}")]
    Invalid(String),
    /// A step failed: what was being done, and why.
    #[error("{what}")]
    Context {
        /// What was being done (`finding the judge checkpoint --model M`).
        what: String,
        /// Why it failed.
        #[source]
        source: Cause,
    },
    /// A step failed (its error as it is).
    #[error(transparent)]
    Step(Cause),
}

/// `.context(..)` for a step's error.
pub trait StepContext<T> {
    /// The error, with what was being done as its message and the error as its cause.
    fn context(self, what: impl FnOnce() -> String) -> Result<T, StepError>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> StepContext<T> for Result<T, E> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T, StepError> {
        self.map_err(|e| StepError::Context {
            what: what(),
            source: Box::new(e),
        })
    }
}

/// `From` each listed error type for a job crate's error type `$job` (which has
/// `From<StepError>`), as [`StepError::Step`]: `step_error_from!(JobError; ModelError, ...)`.
#[macro_export]
macro_rules! step_error_from {
    ($job:ty; $($t:ty),* $(,)?) => {$(
        impl From<$t> for $job {
            fn from(e: $t) -> Self {
                <$job>::from($crate::StepError::Step(Box::new(e)))
            }
        }
    )*};
}
