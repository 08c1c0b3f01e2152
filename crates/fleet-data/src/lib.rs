//! What fleet's jobs read alike, whichever job they serve: ARGO's question answering and GSPO's
//! multiple-choice rewards parse a model's answer the same way, and both report skipped dataset
//! lines by where they came from. A job crate uses this crate, never another job crate.
//!
//! - [`answer`]: the option a reply chose, or why it could not be read (never a default).
//! - [`source`]: where a dataset item came from ([`SourceLocation`]) and how many examples of
//!   each skip reason a load report keeps.
//! - [`jsonl`]: a JSONL dataset read line by line (each line's fate its own).
//! - [`digest`]: content digests of files and bytes (FNV-1a over 8-byte words), what manifests
//!   and checkpoint identities record; here, below fleet-runs and fleet-models, so both use one.

pub mod answer;
pub mod digest;
pub mod jsonl;
pub mod source;

pub use source::{SourceLocation, MAX_EXAMPLES_PER_REASON};
