//! Qwen3-VL image preprocessing against transformers 5.17's `Qwen2VLImageProcessorPil` (PIL
//! backend, Pillow 13.0.0). Goldens in tests/fixtures/vision, made by
//! scripts/fixtures/make_vision_fixtures.py; no Python needed here.
//!
//! Everything is compared exactly: the resize reproduces Pillow's fixed-point bicubic, and
//! rescale/normalise use the same f64-then-f32 steps as transformers, so the tolerance is 0.

use std::path::PathBuf;

use fleet_models::vision::{
    image_pad_tokens, preprocess, smart_resize, ImageProcessorConfig, VisionError,
};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision")
}

fn golden_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("golden.json")).unwrap()).unwrap()
}

fn config() -> ImageProcessorConfig {
    ImageProcessorConfig::from_file(dir().join("preprocessor_config.json")).unwrap()
}

fn load(name: &str) -> image::DynamicImage {
    image::open(dir().join(name)).unwrap()
}

struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    fn open() -> Self {
        Self {
            bytes: std::fs::read(dir().join("golden.safetensors")).unwrap(),
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
fn pixel_values_exact() {
    let cfg = config();
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

/// All five images (upscale, downscale, one side only, vertical pass first) in the raw patch layout: the resized
/// uint8 pixels must be Pillow's exactly, and each row must hold the frame twice.
#[test]
fn resized_pixels_exact_in_patch_layout() {
    let mut cfg = config();
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
