//! `config.json` and `generation_config.json` as the hub ships them: read and validated by
//! fleet-config (which fleet-topology shares), re-exported here under their old paths. Their
//! errors convert into [`crate::ModelError`] with `?`.

pub use fleet_config::{GenerationConfig, QwenArch, QwenConfig, RopeParameters};
