//! Qwen3-VL image preprocessing: smart resize, rescale, normalise, patchify.
//!
//! Reproduces transformers' (5.17) Qwen2-VL image processor, which Qwen3-VL checkpoints use
//! (`image_processor_type: Qwen2VLImageProcessorFast`). transformers has two backends for it and
//! fleet reproduces both, bit for bit; [`ResizeBackend`] (the field
//! [`ImageProcessorConfig::resize_backend`]) picks one:
//!
//! - [`ResizeBackend::Torchvision`], **the default**, as transformers' default:
//!   `AutoImageProcessor` / `AutoProcessor` resolve the backend to `"torchvision"` whenever
//!   torchvision is importable (`models/auto/image_processing_auto.py`, `_resolve_backend`) and
//!   load `Qwen2VLImageProcessor` (`models/qwen2_vl/image_processing_qwen2_vl.py`, a
//!   `TorchvisionBackend` from `image_processing_backends.py`);
//! - [`ResizeBackend::Pillow`]: `Qwen2VLImageProcessorPil` (`image_processing_pil_qwen2_vl.py`),
//!   what transformers uses without torchvision or with `backend="pil"`.
//!
//! The steps:
//!
//! 1. each image is converted to 8-bit RGB (an alpha channel is dropped, as PIL's
//!    `convert("RGB")` does; greyscale is replicated); the torchvision backend then takes it as a
//!    uint8 CHW tensor (`pil_to_tensor`);
//! 2. resized to [`smart_resize`]'s size: both sides multiples of `patch_size * merge_size`,
//!    the area within `[min_pixels, max_pixels]`, the aspect ratio kept, with antialiased
//!    bicubic resampling on uint8 pixels:
//!    - torchvision: `tvF.resize(chw, [h, w], BICUBIC, antialias=True)`, on the CPU ATen's
//!      native uint8 kernel (int16 weights of per-axis precision, horizontal pass first):
//!      [`super::resize_bicubic_rgb8_torchvision`];
//!    - Pillow: `PIL.Image.resize((w, h), BICUBIC)` (Pillow 13: 22-bit weights, vertical pass
//!      first when the height shrinks much more): [`super::resize_bicubic_rgb8`].
//!
//!    Where both run the horizontal pass first they differ by at most one uint8 level, on a
//!    few pixels (the weights' precision; on the goldens' synthetic images 0 to 1.1% of the
//!    values); where Pillow runs the vertical pass first, the rounding and clipping between the
//!    passes differ too (on the goldens' `e_100x33.png`: 12% of the values, up to 20 levels at
//!    sharp edges);
//! 3. rescaled by `rescale_factor` and normalised with `image_mean` / `image_std`, per channel,
//!    in each backend's own float arithmetic (the results differ in the last bits of f32, so
//!    this is part of the backend too):
//!    - torchvision (`TorchvisionBackend.rescale_and_normalize`): with both steps on, mean and
//!      std are fused first, `m = f32(mean) * f32(1 / rescale_factor)` and the same for `s`
//!      (f32 products), then `(f32(x) - m) / s` in f32 (`tvF.normalize`); rescale alone is
//!      `f32(x) * f32(rescale_factor)`; normalise alone `(f32(x) - f32(mean)) / f32(std)`;
//!    - Pillow (numpy): `f32(x as f64 * rescale_factor)`, then `(x - f32(mean)) / f32(std)` in
//!      f32;
//!
//!    `pixel_values` are f32 in both (with neither step, transformers' torchvision backend
//!    returns uint8; here they are the same integers as f32);
//! 4. cut into `patch_size`² patches, the still image repeated to `temporal_patch_size` frames,
//!    in transformers' order: rows by (block row, block column, row in block, column in block)
//!    for blocks of `merge_size`² patches, each row `(channel, frame, y, x)`.
//!
//! `tests/vision_preprocess.rs` checks both backends exactly (tolerance 0, bit patterns) against
//! goldens made by `scripts/fixtures/make_vision_fixtures.py` with transformers 5.17.0, torch
//! 2.11.0, torchvision 0.26.0 and Pillow 13.0.0.

use std::borrow::{Borrow, Cow};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::resample::resize_bicubic_rgb8;
use super::resample_torchvision::resize_bicubic_rgb8_torchvision;

/// Which of transformers' two Qwen2-VL image-processor backends [`preprocess()`] reproduces: the
/// resize and the rescale/normalise arithmetic of that backend (module docs).
///
/// The default is [`ResizeBackend::Torchvision`], transformers' own default. Its stable short
/// names, for record keys, config files and command-line flags, are `"torchvision"` and
/// `"pillow"`: [`ResizeBackend::as_str`], [`fmt::Display`], serde (lowercase) and [`FromStr`]
/// all use them (`FromStr` and serde also take transformers' name `"pil"` for
/// [`ResizeBackend::Pillow`]).
///
/// ```
/// use fleet_models::vision::{ImageProcessorConfig, ResizeBackend};
/// assert_eq!(ResizeBackend::default(), ResizeBackend::Torchvision);
/// assert_eq!(ResizeBackend::Pillow.to_string(), "pillow");
/// assert_eq!("torchvision".parse::<ResizeBackend>().unwrap(), ResizeBackend::Torchvision);
/// # let json = r#"{"size": {"longest_edge": 16777216, "shortest_edge": 65536},
/// #   "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
/// #   "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}"#;
/// let cfg = ImageProcessorConfig::from_json_str(json)?.with_resize_backend(ResizeBackend::Pillow);
/// assert_eq!(cfg.resize_backend, ResizeBackend::Pillow);
/// # Ok::<(), fleet_models::vision::VisionError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResizeBackend {
    /// transformers' default `Qwen2VLImageProcessor` (torchvision backend): torchvision 0.26 /
    /// torch 2.11's antialiased bicubic on uint8 CPU tensors
    /// ([`super::resize_bicubic_rgb8_torchvision`]) and the fused f32 rescale/normalise.
    #[default]
    Torchvision,
    /// `Qwen2VLImageProcessorPil` (transformers' PIL backend): Pillow 13's bicubic
    /// ([`super::resize_bicubic_rgb8`]) and numpy's f64-then-f32 rescale, f32 normalise.
    #[serde(alias = "pil")]
    Pillow,
}

impl ResizeBackend {
    /// Every backend, the default first.
    pub const ALL: [ResizeBackend; 2] = [ResizeBackend::Torchvision, ResizeBackend::Pillow];

    /// The stable short name: `"torchvision"` or `"pillow"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ResizeBackend::Torchvision => "torchvision",
            ResizeBackend::Pillow => "pillow",
        }
    }

    /// Resizes an interleaved RGB8 buffer (`height` rows of `width` pixels) to `new_width` x
    /// `new_height` as this backend does (equal sizes give a copy).
    ///
    /// # Panics
    /// If `src.len() != width * height * 3` or a size is zero.
    pub fn resize_rgb8(
        self,
        src: &[u8],
        width: usize,
        height: usize,
        new_width: usize,
        new_height: usize,
    ) -> Vec<u8> {
        match self {
            ResizeBackend::Torchvision => {
                resize_bicubic_rgb8_torchvision(src, width, height, new_width, new_height)
            }
            ResizeBackend::Pillow => resize_bicubic_rgb8(src, width, height, new_width, new_height),
        }
    }
}

impl fmt::Display for ResizeBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A resize backend name that is neither `"torchvision"` nor `"pillow"` (nor `"pil"`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown image resize backend `{0}`: use `torchvision` (transformers' default) or `pillow`"
)]
pub struct UnknownResizeBackend(
    /// The name as given.
    pub String,
);

impl FromStr for ResizeBackend {
    type Err = UnknownResizeBackend;

    /// `"torchvision"`, `"pillow"` or `"pil"`, in any letter case, surrounding spaces ignored.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "torchvision" => Ok(ResizeBackend::Torchvision),
            "pillow" | "pil" => Ok(ResizeBackend::Pillow),
            _ => Err(UnknownResizeBackend(s.to_string())),
        }
    }
}

/// Errors of the image preprocessing. Each names the value at fault and the way out.
#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    /// transformers refuses images whose longer side is more than 200 times the shorter.
    #[error(
        "image of height {height} and width {width}: absolute aspect ratio must be smaller than \
         200, got {ratio}; crop or pad the image first"
    )]
    AspectRatio {
        /// Image height in pixels.
        height: usize,
        /// Image width in pixels.
        width: usize,
        /// `max(h, w) / min(h, w)`.
        ratio: f64,
    },
    /// An image with no pixels.
    #[error("image of height {height} and width {width} is empty; pass a non-empty image")]
    EmptyImage {
        /// Image height in pixels.
        height: usize,
        /// Image width in pixels.
        width: usize,
    },
    /// smart_resize's answer has a zero side (only with a `min_pixels` too small to lift it).
    #[error(
        "image of height {height} and width {width} resizes to {resized_height}x{resized_width} \
         with factor {factor}, min_pixels {min_pixels}: raise min_pixels (size.shortest_edge) \
         to at least {factor}²"
    )]
    ResizedToNothing {
        /// Image height in pixels.
        height: usize,
        /// Image width in pixels.
        width: usize,
        /// smart_resize's height.
        resized_height: usize,
        /// smart_resize's width.
        resized_width: usize,
        /// patch_size * merge_size.
        factor: usize,
        /// The lower bound on the area.
        min_pixels: usize,
    },
    /// With `do_resize: false` the image must already fit the patch grid.
    #[error(
        "do_resize is false but the image of height {height} and width {width} is not a multiple \
         of patch_size * merge_size = {factor} on both sides; set do_resize to true or resize \
         the image first"
    )]
    NotOnGrid {
        /// Image height in pixels.
        height: usize,
        /// Image width in pixels.
        width: usize,
        /// patch_size * merge_size.
        factor: usize,
    },
    /// preprocessor_config.json lacks a field the processor needs.
    #[error("{origin}: field `{field}` is missing: {hint}")]
    MissingField {
        /// The file (or "preprocessor config").
        origin: String,
        /// The JSON field.
        field: &'static str,
        /// What to add.
        hint: &'static str,
    },
    /// A field has a value the processor cannot use.
    #[error("{origin}: field `{field}` = {value}: {reason}")]
    BadField {
        /// The file (or "preprocessor config").
        origin: String,
        /// The JSON field.
        field: &'static str,
        /// Its value as written.
        value: String,
        /// What is wrong and the fix.
        reason: String,
    },
    /// The config is not JSON of the expected shape.
    #[error("{origin}: {message}")]
    Json {
        /// The file (or "preprocessor config").
        origin: String,
        /// serde's message, naming the field and line.
        message: String,
    },
    /// The config file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// The longest side may be at most this many times the shortest (transformers' image processor
/// refuses more).
pub const MAX_ASPECT_RATIO: f64 = 200.0;

/// The size Qwen2-VL / Qwen3-VL resize an image of `height` x `width` to, as transformers'
/// `smart_resize` computes it: both sides multiples of `factor` (`patch_size * merge_size`,
/// 32 for Qwen3-VL), the area within `[min_pixels, max_pixels]` (`size.shortest_edge` /
/// `size.longest_edge`), the aspect ratio kept as well as can be.
///
/// - `h = round(height / factor) * factor`, the same for `w`, with Python's `round`: half to
///   even (2.5 -> 2), hence [`f64::round_ties_even`];
/// - if `h * w > max_pixels`: `beta = sqrt(height * width / max_pixels)`,
///   `h = max(factor, floor(height / beta / factor) * factor)`, the same for `w`;
/// - else if `h * w < min_pixels`: `beta = sqrt(min_pixels / (height * width))`,
///   `h = ceil(height * beta / factor) * factor`, the same for `w`.
///
/// Returns `(height, width)`.
///
/// # Errors
/// [`VisionError::AspectRatio`] when `max / min > 200` (transformers' `ValueError`),
/// [`VisionError::EmptyImage`] for a zero side (transformers divides by zero).
///
/// # Panics
/// If `factor` is zero.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize), VisionError> {
    assert!(factor > 0, "smart_resize: factor must be positive");
    if height == 0 || width == 0 {
        return Err(VisionError::EmptyImage { height, width });
    }
    let ratio = height.max(width) as f64 / height.min(width) as f64;
    if ratio > MAX_ASPECT_RATIO {
        return Err(VisionError::AspectRatio {
            height,
            width,
            ratio,
        });
    }
    let (hf, wf, ff) = (height as f64, width as f64, factor as f64);
    let mut h_bar = (hf / ff).round_ties_even() as usize * factor;
    let mut w_bar = (wf / ff).round_ties_even() as usize * factor;
    if h_bar * w_bar > max_pixels {
        let beta = ((height * width) as f64 / max_pixels as f64).sqrt();
        h_bar = factor.max((hf / beta / ff).floor() as usize * factor);
        w_bar = factor.max((wf / beta / ff).floor() as usize * factor);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (height * width) as f64).sqrt();
        h_bar = (hf * beta / ff).ceil() as usize * factor;
        w_bar = (wf * beta / ff).ceil() as usize * factor;
    }
    Ok((h_bar, w_bar))
}

/// Number of `<|image_pad|>` tokens an image of grid `[t, h, w]` (in patches) takes in the
/// prompt: `t * h * w / merge_size²` (Qwen3-VL's processor).
pub fn image_pad_tokens(grid_thw: [usize; 3], merge_size: usize) -> usize {
    grid_thw[0] * grid_thw[1] * grid_thw[2] / (merge_size * merge_size)
}

/// The image processor settings of a checkpoint's `preprocessor_config.json`.
///
/// Required (an error names the one missing): `patch_size`, `temporal_patch_size`, `merge_size`,
/// `image_mean`, `image_std`, and the area bounds as `min_pixels`/`max_pixels` or
/// `size.shortest_edge`/`size.longest_edge` (top-level `min_pixels`/`max_pixels` win, as in
/// transformers). These are required because transformers' class defaults are Qwen2-VL's
/// (patch 14, CLIP mean/std), wrong for Qwen3-VL. Optional with transformers' defaults:
/// `do_resize`, `do_rescale`, `do_normalize` (true), `rescale_factor` (1/255); `resample`
/// must be 3 (bicubic) when given. [`Self::resize_backend`] is fleet's choice of transformers
/// backend, [`ResizeBackend::Torchvision`] after parsing.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessorConfig {
    /// Side of a square patch in pixels (Qwen3-VL: 16).
    pub patch_size: usize,
    /// Frames per patch; a still image is repeated to this many (Qwen3-VL: 2).
    pub temporal_patch_size: usize,
    /// Patches merged per side into one LLM token (Qwen3-VL: 2).
    pub merge_size: usize,
    /// Per-channel mean (RGB), subtracted after rescaling.
    pub image_mean: [f64; 3],
    /// Per-channel standard deviation (RGB), divided by after subtracting the mean.
    pub image_std: [f64; 3],
    /// Lower bound on the resized area in pixels.
    pub min_pixels: usize,
    /// Upper bound on the resized area in pixels.
    pub max_pixels: usize,
    /// Resize with [`smart_resize`] (else the image must already be on the patch grid).
    pub do_resize: bool,
    /// Multiply the 0..=255 values by `rescale_factor`.
    pub do_rescale: bool,
    /// The rescale multiplier (1/255).
    pub rescale_factor: f64,
    /// Normalise with `image_mean` / `image_std`.
    pub do_normalize: bool,
    /// Which transformers backend to reproduce: the resize and the rescale/normalise arithmetic
    /// ([`ResizeBackend`]). Not part of preprocessor_config.json: [`ResizeBackend::default`]
    /// (torchvision, transformers' default) unless set, e.g. with
    /// [`ImageProcessorConfig::with_resize_backend`].
    pub resize_backend: ResizeBackend,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum MeanStd {
    One(f64),
    Many(Vec<f64>),
}

struct RawConfig {
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    image_mean: Option<MeanStd>,
    image_std: Option<MeanStd>,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    size: Option<RawSize>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    rescale_factor: Option<f64>,
    do_normalize: Option<bool>,
    resample: Option<i64>,
}

#[derive(Deserialize)]
struct RawSize {
    shortest_edge: Option<usize>,
    longest_edge: Option<usize>,
}

impl ImageProcessorConfig {
    /// Reads a `preprocessor_config.json` file.
    ///
    /// # Errors
    /// [`VisionError::Io`], or those of [`ImageProcessorConfig::from_json_str`] naming the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, VisionError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| VisionError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses the text of a `preprocessor_config.json`.
    ///
    /// # Errors
    /// [`VisionError::Json`] for malformed JSON or a field of the wrong type,
    /// [`VisionError::MissingField`] for a required field absent, [`VisionError::BadField`]
    /// for an unusable value (a zero size, a mean of the wrong length, a zero std, ...).
    pub fn from_json_str(text: &str) -> Result<Self, VisionError> {
        Self::parse(text, "preprocessor config")
    }

    fn parse(text: &str, origin: &str) -> Result<Self, VisionError> {
        let json: serde_json::Value =
            serde_json::from_str(text).map_err(|e| VisionError::Json {
                origin: origin.to_string(),
                message: e.to_string(),
            })?;
        let Some(map) = json.as_object() else {
            return Err(VisionError::Json {
                origin: origin.to_string(),
                message: format!("expected a JSON object, got {json}"),
            });
        };
        // Each field read on its own, so that a wrong type names the field.
        fn field<T: serde::de::DeserializeOwned>(
            map: &serde_json::Map<String, serde_json::Value>,
            name: &'static str,
            origin: &str,
        ) -> Result<Option<T>, VisionError> {
            match map.get(name) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => {
                    serde_json::from_value(v.clone())
                        .map(Some)
                        .map_err(|e| VisionError::BadField {
                            origin: origin.to_string(),
                            field: name,
                            value: v.to_string(),
                            reason: format!("{e}; see the checkpoint's preprocessor_config.json"),
                        })
                }
            }
        }
        let raw = RawConfig {
            patch_size: field(map, "patch_size", origin)?,
            temporal_patch_size: field(map, "temporal_patch_size", origin)?,
            merge_size: field(map, "merge_size", origin)?,
            image_mean: field(map, "image_mean", origin)?,
            image_std: field(map, "image_std", origin)?,
            min_pixels: field(map, "min_pixels", origin)?,
            max_pixels: field(map, "max_pixels", origin)?,
            size: field(map, "size", origin)?,
            do_resize: field(map, "do_resize", origin)?,
            do_rescale: field(map, "do_rescale", origin)?,
            rescale_factor: field(map, "rescale_factor", origin)?,
            do_normalize: field(map, "do_normalize", origin)?,
            resample: field(map, "resample", origin)?,
        };
        let missing = |field: &'static str, hint: &'static str| VisionError::MissingField {
            origin: origin.to_string(),
            field,
            hint,
        };
        let bad = |field: &'static str, value: String, reason: &str| VisionError::BadField {
            origin: origin.to_string(),
            field,
            value,
            reason: reason.to_string(),
        };
        let positive = |field: &'static str, v: Option<usize>, hint: &'static str| match v {
            None => Err(missing(field, hint)),
            Some(0) => Err(bad(field, "0".into(), "must be positive")),
            Some(v) => Ok(v),
        };
        let patch_size = positive("patch_size", raw.patch_size, "Qwen3-VL uses 16")?;
        let temporal_patch_size = positive(
            "temporal_patch_size",
            raw.temporal_patch_size,
            "Qwen3-VL uses 2",
        )?;
        let merge_size = positive("merge_size", raw.merge_size, "Qwen3-VL uses 2")?;
        let channels = |field: &'static str, v: Option<MeanStd>| -> Result<[f64; 3], VisionError> {
            match v {
                None => Err(missing(field, "Qwen3-VL uses [0.5, 0.5, 0.5]")),
                Some(MeanStd::One(x)) => Ok([x; 3]),
                Some(MeanStd::Many(v)) if v.len() == 3 => Ok([v[0], v[1], v[2]]),
                Some(MeanStd::Many(v)) => Err(bad(
                    field,
                    format!("{v:?}"),
                    "needs one value per RGB channel (3) or a single number",
                )),
            }
        };
        let image_mean = channels("image_mean", raw.image_mean)?;
        let image_std = channels("image_std", raw.image_std)?;
        if image_std.contains(&0.0) {
            return Err(bad(
                "image_std",
                format!("{image_std:?}"),
                "a zero std divides by zero; use the checkpoint's values",
            ));
        }
        let bounds_hint = "give min_pixels/max_pixels or size {shortest_edge, longest_edge} \
                           (Qwen3-VL: 65536 / 16777216)";
        let min_pixels = raw
            .min_pixels
            .or(raw.size.as_ref().and_then(|s| s.shortest_edge));
        let max_pixels = raw
            .max_pixels
            .or(raw.size.as_ref().and_then(|s| s.longest_edge));
        // transformers treats a zero bound as absent.
        let min_pixels = match min_pixels {
            None | Some(0) => return Err(missing("size.shortest_edge", bounds_hint)),
            Some(v) => v,
        };
        let max_pixels = match max_pixels {
            None | Some(0) => return Err(missing("size.longest_edge", bounds_hint)),
            Some(v) => v,
        };
        if min_pixels > max_pixels {
            return Err(bad(
                "size.shortest_edge",
                min_pixels.to_string(),
                &format!("the minimum area exceeds the maximum ({max_pixels}); swap them"),
            ));
        }
        if let Some(r) = raw.resample {
            if r != 3 {
                return Err(bad(
                    "resample",
                    r.to_string(),
                    "only 3 (bicubic, Qwen's choice) is implemented",
                ));
            }
        }
        let rescale_factor = raw.rescale_factor.unwrap_or(1.0 / 255.0);
        if !rescale_factor.is_finite() {
            return Err(bad(
                "rescale_factor",
                rescale_factor.to_string(),
                "must be finite (1/255)",
            ));
        }
        Ok(Self {
            patch_size,
            temporal_patch_size,
            merge_size,
            image_mean,
            image_std,
            min_pixels,
            max_pixels,
            do_resize: raw.do_resize.unwrap_or(true),
            do_rescale: raw.do_rescale.unwrap_or(true),
            rescale_factor,
            do_normalize: raw.do_normalize.unwrap_or(true),
            resize_backend: ResizeBackend::default(),
        })
    }

    /// The same config with `backend` as [`Self::resize_backend`].
    pub fn with_resize_backend(mut self, backend: ResizeBackend) -> Self {
        self.resize_backend = backend;
        self
    }

    /// `patch_size * merge_size`: the multiple both resized sides are.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Values per patch row: `3 * temporal_patch_size * patch_size²`.
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// The resized `(height, width)` of an image of `height` x `width` under this config.
    ///
    /// # Errors
    /// As [`smart_resize`]; [`VisionError::NotOnGrid`] with `do_resize` false and sides that
    /// are not multiples of [`Self::factor`]; [`VisionError::ResizedToNothing`].
    pub fn resized_size(&self, height: usize, width: usize) -> Result<(usize, usize), VisionError> {
        let factor = self.factor();
        if height == 0 || width == 0 {
            return Err(VisionError::EmptyImage { height, width });
        }
        let (h, w) = if self.do_resize {
            smart_resize(height, width, factor, self.min_pixels, self.max_pixels)?
        } else {
            (height, width)
        };
        if h == 0 || w == 0 {
            return Err(VisionError::ResizedToNothing {
                height,
                width,
                resized_height: h,
                resized_width: w,
                factor,
                min_pixels: self.min_pixels,
            });
        }
        if h % factor != 0 || w % factor != 0 {
            return Err(VisionError::NotOnGrid {
                height,
                width,
                factor,
            });
        }
        Ok((h, w))
    }
}

/// The output of [`preprocess()`]: what the Qwen3-VL vision encoder takes.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessedImages {
    /// Row-major `[num_patches, patch_dim]`, all images' patches one after another.
    pub pixel_values: Vec<f32>,
    /// Rows of `pixel_values`: the sum over images of `t * h * w`.
    pub num_patches: usize,
    /// Values per row: `3 * temporal_patch_size * patch_size²` (Qwen3-VL: 1536).
    pub patch_dim: usize,
    /// Per image `[t, h, w]` in patches: `[1, resized_height / patch, resized_width / patch]`.
    pub image_grid_thw: Vec<[usize; 3]>,
    /// Per image the resized `(height, width)` in pixels.
    pub resized: Vec<(usize, usize)>,
}

impl PreprocessedImages {
    /// `pixel_values` as an f32 tensor `[num_patches, patch_dim]` on `device`.
    ///
    /// # Errors
    /// candle's, if the device cannot hold it.
    pub fn pixel_values_tensor(
        &self,
        device: &candle_core::Device,
    ) -> candle_core::Result<candle_core::Tensor> {
        candle_core::Tensor::from_slice(
            &self.pixel_values,
            (self.num_patches, self.patch_dim),
            device,
        )
    }

    /// `<|image_pad|>` tokens per image ([`image_pad_tokens`]).
    pub fn pad_tokens(&self, merge_size: usize) -> Vec<usize> {
        self.image_grid_thw
            .iter()
            .map(|&g| image_pad_tokens(g, merge_size))
            .collect()
    }
}

/// Preprocesses still images for Qwen3-VL as transformers' Qwen2-VL image processor does, with
/// the backend `cfg.resize_backend` names (default: torchvision, transformers' default):
/// convert to RGB8, bicubic resize to [`smart_resize`]'s size, rescale, normalise, patchify
/// with each image repeated to `temporal_patch_size` frames (module docs).
///
/// # Errors
/// Per image, those of [`ImageProcessorConfig::resized_size`].
///
/// `images` may be owned images, references or `Arc`s (anything that borrows as a
/// [`image::DynamicImage`]): nothing is copied before the conversion to RGB8, and an image
/// that is RGB8 already is read in place.
pub fn preprocess<I: Borrow<image::DynamicImage> + Sync>(
    images: &[I],
    cfg: &ImageProcessorConfig,
) -> Result<PreprocessedImages, VisionError> {
    // Each image's size first (its header only), so that every image writes its patches straight
    // into its own range of one buffer: the images in parallel (a 1024x1024 image is tens of
    // milliseconds of one core), no per-image vector copied into the whole afterwards.
    use rayon::prelude::*;
    let patch_dim = cfg.patch_dim();
    let sizes: Vec<(usize, usize)> = images
        .iter()
        .map(|img| {
            let img = img.borrow();
            cfg.resized_size(img.height() as usize, img.width() as usize)
        })
        .collect::<Result<_, _>>()?;
    let p = cfg.patch_size;
    let patches: Vec<usize> = sizes.iter().map(|&(h, w)| (h / p) * (w / p)).collect();
    let mut pixel_values = vec![0f32; patches.iter().sum::<usize>() * patch_dim];
    let mut ranges = Vec::with_capacity(images.len());
    let mut rest: &mut [f32] = &mut pixel_values;
    for &n in &patches {
        let (head, tail) = rest.split_at_mut(n * patch_dim);
        ranges.push(head);
        rest = tail;
    }
    let table = value_table(cfg);
    images
        .par_iter()
        .zip(&sizes)
        .zip(ranges)
        .try_for_each(|((img, &size), out)| patchify_into(img.borrow(), size, cfg, &table, out))?;
    Ok(PreprocessedImages {
        pixel_values,
        num_patches: patches.iter().sum(),
        patch_dim,
        image_grid_thw: sizes.iter().map(|&(h, w)| [1, h / p, w / p]).collect(),
        resized: sizes,
    })
}

/// One image resized to `(h, w)` (from [`ImageProcessorConfig::resized_size`]) and its patches
/// written into `out` (exactly its `h / p * w / p` patches): transformers' order, merge blocks
/// row by row, within a block its `m x m` patches, within a patch `[channel, temporal, py,
/// px]`. The temporal copies of a still image are the same values, copied.
fn patchify_into(
    img: &image::DynamicImage,
    (h, w): (usize, usize),
    cfg: &ImageProcessorConfig,
    table: &[[f32; 256]; 3],
    out: &mut [f32],
) -> Result<(), VisionError> {
    let p = cfg.patch_size;
    let m = cfg.merge_size;
    let t = cfg.temporal_patch_size;
    let patch_dim = cfg.patch_dim();
    // The conversion to RGB8 is the first step; an RGB8 image is read where it is.
    let rgb: Cow<'_, image::RgbImage> = match img.as_rgb8() {
        Some(rgb) => Cow::Borrowed(rgb),
        None => Cow::Owned(img.to_rgb8()),
    };
    let (width, height) = (rgb.width() as usize, rgb.height() as usize);
    let resized;
    let pixels: &[u8] = if cfg.do_resize {
        resized = cfg
            .resize_backend
            .resize_rgb8(rgb.as_raw(), width, height, w, h);
        &resized
    } else {
        rgb.as_raw()
    };
    let (gh, gw) = (h / p, w / p);
    debug_assert_eq!(out.len(), gh * gw * patch_dim);
    let mut patches = out.chunks_exact_mut(patch_dim);
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let patch = patches.next().expect("sized from the grid");
                    let y0 = (bh * m + mh) * p;
                    let x0 = (bw * m + mw) * p;
                    for (ch, slab) in patch.chunks_exact_mut(t * p * p).enumerate() {
                        let (first, copies) = slab.split_at_mut(p * p);
                        let lut = &table[ch];
                        for (py, dst) in first.chunks_exact_mut(p).enumerate() {
                            let start = ((y0 + py) * w + x0) * 3 + ch;
                            let src = &pixels[start..start + 3 * (p - 1) + 1];
                            for (d, &v) in dst.iter_mut().zip(src.iter().step_by(3)) {
                                *d = lut[usize::from(v)];
                            }
                        }
                        for copy in copies.chunks_exact_mut(p * p) {
                            copy.copy_from_slice(first);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Per channel, the f32 `pixel_values` entry of each uint8 value after rescale and normalise, in
/// the arithmetic of `cfg.resize_backend`'s transformers backend (module docs, step 3).
fn value_table(cfg: &ImageProcessorConfig) -> [[f32; 256]; 3] {
    let mut table = [[0f32; 256]; 3];
    for (ch, row) in table.iter_mut().enumerate() {
        let mean = cfg.image_mean[ch] as f32;
        let std = cfg.image_std[ch] as f32;
        for (v, out) in row.iter_mut().enumerate() {
            let x = v as f32;
            *out = match (cfg.resize_backend, cfg.do_rescale, cfg.do_normalize) {
                // TorchvisionBackend._fuse_mean_std_and_rescale_factor: f32 tensors times the
                // Python float 1 / rescale_factor, which torch casts to f32 first.
                (ResizeBackend::Torchvision, true, true) => {
                    let inv = (1.0 / cfg.rescale_factor) as f32;
                    (x - mean * inv) / (std * inv)
                }
                (ResizeBackend::Torchvision, true, false) => x * cfg.rescale_factor as f32,
                (ResizeBackend::Pillow, true, _) => {
                    let y = (v as f64 * cfg.rescale_factor) as f32;
                    if cfg.do_normalize {
                        (y - mean) / std
                    } else {
                        y
                    }
                }
                (_, false, true) => (x - mean) / std,
                (_, false, false) => x,
            };
        }
    }
    table
}
