//! Devices and placement for fleet.
//!
//! This is the lowest crate of the workspace: it holds facts (which devices exist, how much memory
//! they have) and plans (which device holds which part of a model), and no model code. The model
//! loader in `fleet-models` consumes a [`DeviceMap`] and builds every block on the device it names.

mod device_map;
mod discover;

pub use device_map::{DeviceLocation, DeviceMap};
pub use discover::{discover, gpu_memory_info, DeviceInfo};

/// Errors of this crate. Each message names the value at fault and what to change.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// A device string such as `cuda:7` did not parse.
    #[error("device `{value}` is not a device: write `cpu`, `cuda` or `cuda:N` (N = GPU index)")]
    BadDevice {
        /// The string as given.
        value: String,
    },
    /// A device map does not cover the model's layers.
    #[error("device map has {got} layer entries but the model has {expected} layers")]
    LayerCountMismatch {
        /// Layers named by the map.
        got: usize,
        /// Layers in the model.
        expected: usize,
    },
    /// A layer split was asked for with no device to put layers on.
    #[error("a device map needs at least one device")]
    NoDevices,
    /// More groups than layers.
    #[error("cannot split {layers} layers over {groups} devices: use at most {layers} devices")]
    TooManyGroups {
        /// Layers in the model.
        layers: usize,
        /// Devices asked for.
        groups: usize,
    },
    /// The CUDA driver failed while discovering devices.
    #[error("CUDA driver error while reading device {ordinal}: {message}")]
    Driver {
        /// GPU index.
        ordinal: usize,
        /// The driver's message.
        message: String,
    },
}
