//! Qwen3-VL image preprocessing on the CPU (what the judge does per request before the GPU sees
//! it): smart resize, bicubic (transformers' default torchvision path and Pillow's), rescale,
//! normalise and patchify, for a source and an edited image of 1024 x 768 (resized) and of
//! 1024 x 1024 (the judge bench's size: no resize, the patchify alone).

use criterion::{criterion_group, criterion_main, Criterion};
use fleet_models::vision::{preprocess, ImageProcessorConfig, ResizeBackend};
use std::hint::black_box;

/// The released Qwen3-VL preprocessor_config.json.
const RELEASED: &str = include_str!("../../../configs/models/qwen3-vl-preprocessor.json");

fn image(w: u32, h: u32, salt: u32) -> image::DynamicImage {
    image::DynamicImage::ImageRgb8(image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([
            ((x * 255 / w + salt) % 256) as u8,
            ((y * 255 / h + 3 * salt) % 256) as u8,
            (((x / 8 + y / 8 + salt) % 2) * 200) as u8,
        ])
    }))
}

fn bench(c: &mut Criterion) {
    for (w, h) in [(1024, 768), (1024, 1024)] {
        let images = vec![image(w, h, 1), image(w, h, 2)];
        for (name, backend) in [
            ("torchvision", ResizeBackend::Torchvision),
            ("pillow", ResizeBackend::Pillow),
        ] {
            let mut cfg = ImageProcessorConfig::from_json_str(RELEASED).unwrap();
            cfg.resize_backend = backend;
            c.bench_function(&format!("preprocess/{name}/two {w}x{h} images"), |b| {
                b.iter(|| preprocess(black_box(&images), &cfg).unwrap())
            });
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
