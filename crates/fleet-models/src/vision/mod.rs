//! Qwen3-VL vision input: image preprocessing (this module) ahead of the vision encoder.
//!
//! [`preprocess()`] turns decoded images into the `pixel_values` / `image_grid_thw` pair that
//! transformers' Qwen2-VL image processor (the one Qwen3-VL checkpoints name) produces, with
//! either of transformers' backends ([`ResizeBackend`]: torchvision, transformers' and fleet's
//! default, or Pillow); the fact sheet is `docs/reference/qwen3-vl-verified.md` section 4.

pub mod preprocess;
mod resample;
mod resample_torchvision;

pub use preprocess::{
    image_pad_tokens, preprocess, smart_resize, ImageProcessorConfig, PreprocessedImages,
    ResizeBackend, UnknownResizeBackend, VisionError, MAX_ASPECT_RATIO,
};
pub use resample::resize_bicubic_rgb8;
pub use resample_torchvision::resize_bicubic_rgb8_torchvision;
