//! Qwen3-VL image preprocessing against transformers 5.17's two Qwen2-VL image processors, with
//! no Python needed here:
//!
//! - the default backend, `ResizeBackend::Torchvision` = `Qwen2VLImageProcessor` (torch 2.11.0,
//!   torchvision 0.26.0): goldens in tests/fixtures/vision/torchvision, made by
//!   `scripts/fixtures/make_vision_fixtures.py --backend torchvision` in `.venv-torchvision`;
//! - `ResizeBackend::Pillow` = `Qwen2VLImageProcessorPil` (Pillow 13.0.0): goldens in
//!   tests/fixtures/vision, made by the same script with `--backend pil`.
//!
//! Everything is compared exactly (bit patterns of the f32 values): both resizes reproduce their
//! library's fixed-point bicubic, and rescale/normalise use each backend's own float steps, so
//! the tolerance is 0.

use std::path::PathBuf;

use fleet_models::vision::{
    image_pad_tokens, preprocess, resize_bicubic_rgb8, resize_bicubic_rgb8_torchvision,
    smart_resize, ImageProcessorConfig, ResizeBackend, UnknownResizeBackend, VisionError,
};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision")
}

fn golden_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("golden.json")).unwrap()).unwrap()
}

/// The fixtures' preprocessor_config.json as parsed: the default (torchvision) backend.
fn config() -> ImageProcessorConfig {
    ImageProcessorConfig::from_file(dir().join("preprocessor_config.json")).unwrap()
}

/// The same config on the Pillow backend, which tests/fixtures/vision's own goldens are for.
fn pillow_config() -> ImageProcessorConfig {
    config().with_resize_backend(ResizeBackend::Pillow)
}

fn tv_dir() -> PathBuf {
    dir().join("torchvision")
}

fn tv_golden_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(tv_dir().join("golden.json")).unwrap()).unwrap()
}

fn load(name: &str) -> image::DynamicImage {
    image::open(dir().join(name)).unwrap()
}

struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    /// tests/fixtures/vision/golden.safetensors (Pillow backend).
    fn open() -> Self {
        Self::at(dir().join("golden.safetensors"))
    }
    /// tests/fixtures/vision/torchvision/golden.safetensors (default backend).
    fn torchvision() -> Self {
        Self::at(tv_dir().join("golden.safetensors"))
    }
    fn at(path: PathBuf) -> Self {
        Self {
            bytes: std::fs::read(path).unwrap(),
        }
    }
    fn tensor(&self, name: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap();
        (t.dtype(), t.shape().to_vec(), t.data().to_vec())
    }
    fn f32s(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (dt, shape, data) = self.tensor(name);
        assert_eq!(dt, Dtype::F32);
        let v = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        (shape, v)
    }
    fn grid(&self, name: &str) -> Vec<[usize; 3]> {
        let (dt, shape, data) = self.tensor(name);
        assert_eq!(dt, Dtype::I64);
        assert_eq!(shape[1], 3);
        let v: Vec<usize> = data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as usize)
            .collect();
        v.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect()
    }
}

#[test]
fn smart_resize_matches_transformers_table() {
    let g = golden_json();
    let table = g["smart_resize"].as_array().unwrap();
    assert!(table.len() > 400);
    let (mut ok, mut errs, mut ties) = (0, 0, 0);
    for case in table {
        let n = |k: &str| case[k].as_u64().unwrap() as usize;
        let (h, w, f) = (n("height"), n("width"), n("factor"));
        let got = smart_resize(h, w, f, n("min_pixels"), n("max_pixels"));
        match case.get("output") {
            Some(out) => {
                let want = (
                    out[0].as_u64().unwrap() as usize,
                    out[1].as_u64().unwrap() as usize,
                );
                assert_eq!(got.unwrap(), want, "case {case}");
                ok += 1;
                if (2 * h) % f == 0 && h % f != 0 {
                    ties += 1;
                }
            }
            None => {
                let err = got.expect_err(&format!("case {case} must fail"));
                assert!(matches!(err, VisionError::AspectRatio { .. }), "{err}");
                assert!(err
                    .to_string()
                    .contains("aspect ratio must be smaller than 200"));
                errs += 1;
            }
        }
    }
    assert!(ok > 400 && errs > 0 && ties > 10, "{ok} {errs} {ties}");
}

#[test]
fn smart_resize_rounds_half_to_even() {
    // 80 / 32 = 2.5 -> 2 (Python's round), not 3; 48 / 32 = 1.5 -> 2.
    assert_eq!(smart_resize(80, 48, 32, 1, 1 << 30).unwrap(), (64, 64));
    assert_eq!(smart_resize(16, 16, 32, 0, 1 << 30).unwrap(), (0, 0));
    assert_eq!(smart_resize(16, 16, 32, 1, 1 << 30).unwrap(), (32, 32));
}

#[test]
fn grid_and_pad_tokens_exact() {
    let g = golden_json();
    let cfg = config();
    let images = g["images"].as_array().unwrap();
    let imgs: Vec<_> = images
        .iter()
        .map(|i| load(i["file"].as_str().unwrap()))
        .collect();
    let out = preprocess(&imgs, &cfg).unwrap();
    let golden = Golden::open();
    assert_eq!(out.image_grid_thw, golden.grid("raw_grid_thw"));
    for (k, img) in images.iter().enumerate() {
        let resized = &img["resized"];
        assert_eq!(
            out.resized[k],
            (
                resized[0].as_u64().unwrap() as usize,
                resized[1].as_u64().unwrap() as usize
            )
        );
        let want = img["pad_tokens"].as_u64().unwrap() as usize;
        assert_eq!(
            image_pad_tokens(out.image_grid_thw[k], cfg.merge_size),
            want
        );
        assert_eq!(out.pad_tokens(cfg.merge_size)[k], want);
    }
    assert_eq!(image_pad_tokens([1, 64, 48], 2), 768);
    assert_eq!(image_pad_tokens([2, 4, 6], 2), 12);
}

#[test]
fn pillow_pixel_values_exact() {
    let cfg = pillow_config();
    assert_eq!(cfg.patch_dim(), 1536);
    let golden = Golden::open();
    let (shape, want) = golden.f32s("pixel_values");
    let out = preprocess(&[load("a_48x64.png"), load("b_37x100.png")], &cfg).unwrap();
    assert_eq!(vec![out.num_patches, out.patch_dim], shape);
    assert_eq!(out.image_grid_thw, golden.grid("image_grid_thw"));
    let max_diff = out
        .pixel_values
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert_eq!(max_diff, 0.0, "max |diff| {max_diff}");
    assert!(out
        .pixel_values
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));

    let t = out.pixel_values_tensor(&candle_core::Device::Cpu).unwrap();
    assert_eq!(t.dims(), &[20, 1536]);
}

/// All five images (upscale, downscale, one side only, vertical pass first) in the raw patch
/// layout: the resized uint8 pixels must be Pillow's exactly, and each row must hold the frame
/// twice.
#[test]
fn pillow_resized_pixels_exact_in_patch_layout() {
    let mut cfg = pillow_config();
    cfg.do_rescale = false;
    cfg.do_normalize = false;
    let g = golden_json();
    let imgs: Vec<_> = g["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| load(i["file"].as_str().unwrap()))
        .collect();
    let out = preprocess(&imgs, &cfg).unwrap();
    let golden = Golden::open();
    let (dt, shape, want) = golden.tensor("raw_patches");
    assert_eq!(dt, Dtype::U8);
    assert_eq!(vec![out.num_patches, out.patch_dim], shape);
    let got: Vec<u8> = out.pixel_values.iter().map(|&v| v as u8).collect();
    assert!(out.pixel_values.iter().all(|&v| v == f32::from(v as u8)));
    let mismatches = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    assert_eq!(
        mismatches,
        0,
        "{mismatches} of {} values differ",
        want.len()
    );
    // Each row: (C=3, T=2, 16, 16), both frames equal.
    for row in out.pixel_values.chunks_exact(1536) {
        for c in 0..3 {
            let base = c * 512;
            assert_eq!(row[base..base + 256], row[base + 256..base + 512]);
        }
    }
}

#[test]
fn config_as_shipped_and_errors() {
    let cfg = config();
    assert_eq!(
        (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size),
        (16, 2, 2)
    );
    assert_eq!((cfg.min_pixels, cfg.max_pixels), (2048, 3072));
    assert_eq!(cfg.image_mean, [0.5; 3]);
    assert_eq!(cfg.rescale_factor, 1.0 / 255.0);

    // The Qwen3-VL checkpoint's file (as shipped) and the older min/max_pixels style.
    let qwen3 = r#"{"size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"}"#;
    let c = ImageProcessorConfig::from_json_str(qwen3).unwrap();
    assert_eq!(
        (c.min_pixels, c.max_pixels, c.factor()),
        (65536, 16777216, 32)
    );
    assert!(c.do_resize && c.do_rescale && c.do_normalize);
    let old = r#"{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
        "temporal_patch_size": 2, "merge_size": 2, "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "size": {"shortest_edge": 1, "longest_edge": 2}}"#;
    let c = ImageProcessorConfig::from_json_str(old).unwrap();
    assert_eq!((c.min_pixels, c.max_pixels), (3136, 12845056));

    let without = |field: &str| {
        let mut v: Value = serde_json::from_str(qwen3).unwrap();
        v.as_object_mut().unwrap().remove(field);
        ImageProcessorConfig::from_json_str(&v.to_string()).unwrap_err()
    };
    for (field, named) in [
        ("patch_size", "patch_size"),
        ("merge_size", "merge_size"),
        ("temporal_patch_size", "temporal_patch_size"),
        ("image_mean", "image_mean"),
        ("image_std", "image_std"),
        ("size", "size.shortest_edge"),
    ] {
        let e = without(field);
        assert!(matches!(e, VisionError::MissingField { .. }), "{e}");
        assert!(e.to_string().contains(&format!("`{named}`")), "{e}");
    }
    let bad = |edit: &str| {
        let mut v: Value = serde_json::from_str(qwen3).unwrap();
        let patch: Value = serde_json::from_str(edit).unwrap();
        for (k, x) in patch.as_object().unwrap() {
            v[k] = x.clone();
        }
        ImageProcessorConfig::from_json_str(&v.to_string())
            .unwrap_err()
            .to_string()
    };
    assert!(bad(r#"{"image_mean": [0.5, 0.5]}"#).contains("`image_mean` = [0.5, 0.5]"));
    assert!(bad(r#"{"image_std": [0.5, 0, 0.5]}"#).contains("`image_std`"));
    assert!(bad(r#"{"patch_size": 0}"#).contains("`patch_size` = 0"));
    assert!(bad(r#"{"resample": 2}"#).contains("`resample` = 2"));
    let typed = bad(r#"{"patch_size": "16"}"#);
    assert!(typed.contains("`patch_size` = \"16\""), "{typed}");
    let typed = bad(r#"{"size": {"shortest_edge": -1}}"#);
    assert!(typed.contains("`size`"), "{typed}");
    let swapped = bad(r#"{"size": {"shortest_edge": 10, "longest_edge": 5}}"#);
    assert!(swapped.contains("swap"), "{swapped}");
    let e = ImageProcessorConfig::from_file(dir().join("nope.json")).unwrap_err();
    assert!(e.to_string().contains("nope.json"));
}

#[test]
fn bad_images_give_clear_errors() {
    let cfg = config();
    let long = image::DynamicImage::new_rgb8(201, 1);
    let e = preprocess(&[long], &cfg).unwrap_err();
    assert!(
        matches!(
            e,
            VisionError::AspectRatio {
                height: 1,
                width: 201,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("got 201"), "{e}");
    let empty = image::DynamicImage::new_rgb8(0, 5);
    let e = preprocess(&[empty], &cfg).unwrap_err();
    assert!(matches!(e, VisionError::EmptyImage { .. }), "{e}");

    let mut no_resize = cfg.clone();
    no_resize.do_resize = false;
    let e = preprocess(&[load("a_48x64.png")], &no_resize).unwrap_err();
    assert!(e.to_string().contains("do_resize is false"), "{e}");
    // On the grid already: accepted as is.
    let ok = preprocess(&[image::DynamicImage::new_rgb8(64, 32)], &no_resize).unwrap();
    assert_eq!(ok.image_grid_thw, vec![[1, 2, 4]]);

    // A zero min_pixels (refused in a config file, possible in the struct) lets a small image
    // round to nothing.
    let mut tiny = cfg.clone();
    tiny.min_pixels = 0;
    let e = preprocess(&[image::DynamicImage::new_rgb8(10, 10)], &tiny).unwrap_err();
    assert!(matches!(e, VisionError::ResizedToNothing { .. }), "{e}");
    assert!(e.to_string().contains("raise min_pixels"), "{e}");
}

// ---- backend choice --------------------------------------------------------------------------

/// fleet's default is transformers' default: the torchvision backend (`Qwen2VLImageProcessor`),
/// for a parsed preprocessor_config.json as for the enum itself.
#[test]
fn default_backend_is_torchvision() {
    assert_eq!(ResizeBackend::default(), ResizeBackend::Torchvision);
    assert_eq!(ResizeBackend::ALL[0], ResizeBackend::Torchvision);
    assert_eq!(config().resize_backend, ResizeBackend::Torchvision);
    let qwen3 = r#"{"size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast"}"#;
    let c = ImageProcessorConfig::from_json_str(qwen3).unwrap();
    assert_eq!(c.resize_backend, ResizeBackend::Torchvision);
    assert_eq!(
        c.with_resize_backend(ResizeBackend::Pillow).resize_backend,
        ResizeBackend::Pillow
    );
    // The goldens say which class transformers picked by default, and that it is torchvision's.
    let g = tv_golden_json();
    assert_eq!(g["processor_class"], "Qwen2VLImageProcessor");
    assert_eq!(g["backend"], "torchvision");
    for (_, class) in g["resolved_by_default"].as_object().unwrap() {
        assert!(
            class == "Qwen2VLImageProcessor" || class == "torchvision",
            "{class}"
        );
    }
}

/// The short names are stable (record keys, CLI flags): "torchvision" and "pillow".
#[test]
fn backend_names_are_stable() {
    for (b, name) in [
        (ResizeBackend::Torchvision, "torchvision"),
        (ResizeBackend::Pillow, "pillow"),
    ] {
        assert_eq!(b.as_str(), name);
        assert_eq!(b.to_string(), name);
        assert_eq!(name.parse::<ResizeBackend>().unwrap(), b);
        assert_eq!(serde_json::to_string(&b).unwrap(), format!("\"{name}\""));
        assert_eq!(
            serde_json::from_str::<ResizeBackend>(&format!("\"{name}\"")).unwrap(),
            b
        );
    }
    // transformers' own name for the PIL backend is accepted on input, never written.
    assert_eq!(
        " PIL ".parse::<ResizeBackend>().unwrap(),
        ResizeBackend::Pillow
    );
    assert_eq!(
        serde_json::from_str::<ResizeBackend>("\"pil\"").unwrap(),
        ResizeBackend::Pillow
    );
    let e = "opencv".parse::<ResizeBackend>().unwrap_err();
    assert_eq!(e, UnknownResizeBackend("opencv".into()));
    let msg = e.to_string();
    assert!(
        msg.contains("`opencv`") && msg.contains("torchvision") && msg.contains("pillow"),
        "{msg}"
    );
    assert!(serde_json::from_str::<ResizeBackend>("\"Torch\"").is_err());
}

// ---- torchvision backend (the default) against transformers' default processor ------------------

fn rgb8(img: &image::DynamicImage) -> (Vec<u8>, usize, usize) {
    let rgb = img.to_rgb8();
    let (w, h) = (rgb.width() as usize, rgb.height() as usize);
    (rgb.into_raw(), w, h)
}

fn stem(file: &str) -> String {
    std::path::Path::new(file)
        .file_stem()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string()
}

/// The resized uint8 pixels of all seven images (rounded, shrunk on one side or both, a 3.75x
/// shrink, grown 3x, vertical-heavy, and one already on the grid that is not resized) equal
/// `tvF.resize(BICUBIC, antialias=True)`'s as transformers' default processor ran it, exactly.
#[test]
fn torchvision_resized_pixels_exact() {
    let g = tv_golden_json();
    let golden = Golden::torchvision();
    let cfg = config();
    let images = g["images"].as_array().unwrap();
    assert_eq!(images.len(), 7);
    let (mut resized, mut unchanged) = (0, 0);
    for img in images {
        let file = img["file"].as_str().unwrap();
        let (src, w, h) = rgb8(&load(file));
        assert_eq!(
            (h, w),
            (
                img["height"].as_u64().unwrap() as usize,
                img["width"].as_u64().unwrap() as usize
            )
        );
        let (rh, rw) = cfg.resized_size(h, w).unwrap();
        let (dt, shape, want) = golden.tensor(&format!("resized.{}", stem(file)));
        assert_eq!(dt, Dtype::U8);
        assert_eq!(shape, vec![rh, rw, 3], "{file}");
        let got = ResizeBackend::Torchvision.resize_rgb8(&src, w, h, rw, rh);
        assert_eq!(got, resize_bicubic_rgb8_torchvision(&src, w, h, rw, rh));
        let mismatches = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            mismatches,
            0,
            "{file}: {mismatches} of {} values differ",
            want.len()
        );
        if img["resize_called"].as_bool().unwrap() {
            resized += 1;
        } else {
            assert_eq!(got, src, "{file}: equal sizes are not resampled");
            unchanged += 1;
        }
    }
    assert_eq!((resized, unchanged), (6, 1));
}

/// The two backends differ exactly where transformers' two processors differ: per image, the
/// number of uint8 values in which fleet's torchvision and Pillow resizes disagree is the number
/// the script counted between `Qwen2VLImageProcessor` and `Qwen2VLImageProcessorPil`. The new
/// images' Pillow resize is also compared exactly.
#[test]
fn backends_differ_as_transformers_backends_do() {
    let g = tv_golden_json();
    let golden = Golden::torchvision();
    let cfg = config();
    let mut total_diff = 0;
    for img in g["images"].as_array().unwrap() {
        let file = img["file"].as_str().unwrap();
        let (src, w, h) = rgb8(&load(file));
        let (rh, rw) = cfg.resized_size(h, w).unwrap();
        let tv = ResizeBackend::Torchvision.resize_rgb8(&src, w, h, rw, rh);
        let pil = ResizeBackend::Pillow.resize_rgb8(&src, w, h, rw, rh);
        assert_eq!(pil, resize_bicubic_rgb8(&src, w, h, rw, rh));
        let diff = tv.iter().zip(&pil).filter(|(a, b)| a != b).count();
        let want = img["values_differing_from_pil"].as_u64().unwrap() as usize;
        assert_eq!(diff, want, "{file}");
        // With one pass or the same pass order (Pillow 13 runs the vertical pass first only when
        // the height shrinks by more than twice what the width does) only the weights'
        // precision differs: one level at most. With the other order the uint8 rounding and
        // clipping between the passes differs too: e_100x33 differs by up to 20 levels at its
        // sharp edges.
        let max_diff = tv
            .iter()
            .zip(&pil)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        let (dh, dw) = (h as i64 - rh as i64, w as i64 - rw as i64);
        if dw != 0 && dh > 0 && dh > 2 * dw {
            assert_eq!((file, max_diff), ("e_100x33.png", 20));
        } else {
            assert!(max_diff <= 1, "{file}: {max_diff}");
        }
        total_diff += diff;
        if file.starts_with("torchvision/") {
            let (dt, shape, want) = golden.tensor(&format!("pil_resized.{}", stem(file)));
            assert_eq!((dt, shape), (Dtype::U8, vec![rh, rw, 3]));
            assert_eq!(pil, want, "{file}: Pillow resize");
        }
    }
    assert!(total_diff > 1000, "{total_diff}");
}

/// The full default pipeline (resize, fused rescale + normalise in f32, patchify, two images of
/// different shapes in order) gives transformers' default `pixel_values` bit for bit.
#[test]
fn torchvision_pixel_values_exact() {
    let g = tv_golden_json();
    let golden = Golden::torchvision();
    let batch: Vec<_> = g["pixel_values_batch"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| load(f.as_str().unwrap()))
        .collect();
    assert_eq!(batch.len(), 2);
    let cfg = config();
    assert_eq!(cfg.resize_backend, ResizeBackend::Torchvision);
    let out = preprocess(&batch, &cfg).unwrap();
    let (shape, want) = golden.f32s("pixel_values");
    assert_eq!(vec![out.num_patches, out.patch_dim], shape);
    assert_eq!(out.image_grid_thw, golden.grid("image_grid_thw"));
    let bits_differ = out
        .pixel_values
        .iter()
        .zip(&want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(bits_differ, 0, "{bits_differ} of {} values", want.len());

    // The Pillow backend on the same batch is not this (resize and arithmetic both differ).
    let pil = preprocess(&batch, &pillow_config()).unwrap();
    assert_ne!(pil.pixel_values, out.pixel_values);
}

/// The 32x32 image the script's value tables were made from: every uint8 value four times in
/// each channel.
fn value_image() -> image::DynamicImage {
    let mut buf = Vec::with_capacity(32 * 32 * 3);
    for i in 0..1024usize {
        buf.push((i % 256) as u8);
        buf.push(((7 * i + 3) % 256) as u8);
        buf.push(((201 * i + 100) % 256) as u8);
    }
    image::DynamicImage::ImageRgb8(image::RgbImage::from_raw(32, 32, buf).unwrap())
}

/// Rescale and normalise, per channel and uint8 value, in each backend's float arithmetic:
/// Qwen3-VL's mean = std = 0.5, CLIP's mean/std, an odd rescale factor (0.007, where
/// `1 / rescale_factor` is not exact), rescale only and normalise only. Bit patterns must equal
/// the tables transformers' two processors produced.
#[test]
fn rescale_normalize_exact_for_both_backends() {
    let g = tv_golden_json();
    let golden = Golden::torchvision();
    let img = value_image();
    let cases = g["value_cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let three = |k: &str| -> [f64; 3] {
            let v: Vec<f64> = serde_json::from_value(case[k].clone()).unwrap();
            [v[0], v[1], v[2]]
        };
        let mut cfg = config();
        cfg.do_resize = false;
        cfg.image_mean = three("image_mean");
        cfg.image_std = three("image_std");
        cfg.rescale_factor = case["rescale_factor"].as_f64().unwrap();
        cfg.do_rescale = case["do_rescale"].as_bool().unwrap();
        cfg.do_normalize = case["do_normalize"].as_bool().unwrap();
        let mut tables = Vec::new();
        for backend in ResizeBackend::ALL {
            let key = match backend {
                ResizeBackend::Torchvision => "torchvision",
                ResizeBackend::Pillow => "pil",
            };
            let (shape, table) = golden.f32s(&format!("values.{key}.{name}"));
            assert_eq!(shape, vec![3, 256]);
            let cfg = cfg.clone().with_resize_backend(backend);
            let mut raw_cfg = cfg.clone();
            raw_cfg.do_rescale = false;
            raw_cfg.do_normalize = false;
            let raw = preprocess(std::slice::from_ref(&img), &raw_cfg).unwrap();
            let out = preprocess(std::slice::from_ref(&img), &cfg).unwrap();
            assert_eq!(out.pixel_values.len(), 4 * 1536);
            let mut seen = [[false; 256]; 3];
            for (k, (&v, &got)) in raw.pixel_values.iter().zip(&out.pixel_values).enumerate() {
                let ch = (k % 1536) / 512;
                let v = v as usize;
                seen[ch][v] = true;
                assert_eq!(
                    got.to_bits(),
                    table[ch * 256 + v].to_bits(),
                    "{backend} {name}: channel {ch} value {v}: {got} vs {}",
                    table[ch * 256 + v]
                );
            }
            assert!(seen.iter().all(|c| c.iter().all(|&s| s)));
            tables.push(table);
        }
        // With rescaling, the two backends' arithmetic really differs somewhere.
        if cfg.do_rescale {
            assert_ne!(tables[0], tables[1], "{name}");
        }
    }
}
