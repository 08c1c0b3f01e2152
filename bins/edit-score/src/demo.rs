//! `edit-score --demo`: a small generated benchmark (six image pairs in three GEdit-Bench
//! categories) scored with VIEScore by the tiny Qwen3-VL checkpoint bundled in this program
//! (tests/fixtures/qwen3-vl-tiny, written to a temporary directory), with no downloads.
//!
//! The bundled judge has random weights: its replies are gibberish, recorded as parse failures
//! and counted, so the demo's scores are meaningless. It shows the pipeline — benchmark,
//! prompts, judge, records, report — end to end. `--model` puts a real judge in its place.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use fleet_judge::benchmark::load_jsonl;
use fleet_judge::prompts::PromptSet;
use image::{Rgb, RgbImage};

use crate::score::{apply_images, execute, Format, Job, ScoreArgs};

/// The bundled judge (tests/fixtures/qwen3-vl-tiny, made by scripts/fixtures/): a Qwen3-VL
/// checkpoint of the real architecture with 4 text and 4 vision layers and random weights.
const TINY_JUDGE: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../../../tests/fixtures/qwen3-vl-tiny/config.json"),
    ),
    (
        "generation_config.json",
        include_bytes!("../../../tests/fixtures/qwen3-vl-tiny/generation_config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../../tests/fixtures/qwen3-vl-tiny/model.safetensors"),
    ),
    (
        "preprocessor_config.json",
        include_bytes!("../../../tests/fixtures/qwen3-vl-tiny/preprocessor_config.json"),
    ),
    (
        "chat_template.json",
        include_bytes!("../../../tests/fixtures/qwen3-vl-tiny/chat_template.json"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../../tests/fixtures/qwen3-vl-tiny/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../../tests/fixtures/qwen3-vl-tiny/tokenizer_config.json"),
    ),
];

/// The demo's prompt set: configs/judge/viescore.toml (VIEScore as GEdit-Bench runs it).
const VIESCORE: &str = include_str!("../../../configs/judge/viescore.toml");

const RANDOM_WEIGHTS_NOTE: &str = "NOTE: the bundled judge (tests/fixtures/qwen3-vl-tiny, 2 MB) \
has RANDOM WEIGHTS. Its replies are gibberish: they are recorded as parse failures (with the raw \
reply) and counted, never replaced by a score, so this demo's scores are meaningless. It shows \
the pipeline end to end. Meaningful scores need a real checkpoint, e.g. --model \
Qwen/Qwen3-VL-8B-Instruct or --model Qwen/Qwen3-VL-30B-A3B-Instruct.";

/// One generated pair.
struct Pair {
    id: &'static str,
    category: &'static str,
    instruction: &'static str,
    description: &'static str,
    edit: fn(&mut RgbImage),
}

const W: u32 = 128;
const H: u32 = 96;

/// A small scene: sky, ground, sun and a red box.
fn scene() -> RgbImage {
    let mut img = RgbImage::from_fn(W, H, |_, y| {
        if y < 64 {
            let t = y as f32 / 64.0;
            Rgb([(110.0 + 80.0 * t) as u8, (170.0 + 50.0 * t) as u8, 240])
        } else {
            Rgb([70, 140 - (y - 64) as u8, 60])
        }
    });
    disc(&mut img, 100, 20, 10, [250, 220, 60]);
    rect(&mut img, 30, 44, 28, 26, [200, 40, 40]);
    img
}

fn rect(img: &mut RgbImage, x: u32, y: u32, w: u32, h: u32, c: [u8; 3]) {
    for yy in y..(y + h).min(H) {
        for xx in x..(x + w).min(W) {
            img.put_pixel(xx, yy, Rgb(c));
        }
    }
}

fn disc(img: &mut RgbImage, cx: i32, cy: i32, r: i32, c: [u8; 3]) {
    for y in (cy - r).max(0)..(cy + r).min(H as i32) {
        for x in (cx - r).max(0)..(cx + r).min(W as i32) {
            if (x - cx).pow(2) + (y - cy).pow(2) <= r * r {
                img.put_pixel(x as u32, y as u32, Rgb(c));
            }
        }
    }
}

fn tree(img: &mut RgbImage, x: u32) {
    rect(img, x + 6, 58, 4, 14, [100, 60, 30]);
    for (i, y) in (34..58).enumerate() {
        let half = i as u32 / 3;
        rect(
            img,
            x + 8 - half.min(8),
            y,
            2 * half.min(8),
            1,
            [30, 120, 40],
        );
    }
}

const PAIRS: &[Pair] = &[
    Pair {
        id: "color-box",
        category: "color_alter",
        instruction: "Change the color of the red box to blue.",
        description: "A red box on a meadow under a blue sky with the sun.",
        edit: |img| rect(img, 30, 44, 28, 26, [40, 60, 200]),
    },
    Pair {
        id: "color-sun",
        category: "color_alter",
        instruction: "Make the sun orange.",
        description: "A red box on a meadow under a blue sky with a yellow sun.",
        edit: |img| disc(img, 100, 20, 10, [250, 140, 30]),
    },
    Pair {
        id: "add-tree",
        category: "subject-add",
        instruction: "Add a tree to the right of the box.",
        description: "A red box on a meadow under a blue sky with the sun.",
        edit: |img| tree(img, 80),
    },
    Pair {
        id: "add-box",
        category: "subject-add",
        instruction: "Add a small green box next to the red one.",
        description: "A red box on a meadow under a blue sky with the sun.",
        edit: |img| rect(img, 64, 56, 14, 14, [40, 170, 60]),
    },
    Pair {
        id: "night-sky",
        category: "background_change",
        instruction: "Turn the sky into a night sky with stars.",
        description: "A red box on a meadow under a blue sky with the sun.",
        edit: |img| {
            rect(img, 0, 0, W, 64, [15, 20, 60]);
            for (x, y) in [(10, 8), (40, 20), (70, 6), (95, 30), (115, 12), (55, 40)] {
                rect(img, x, y, 2, 2, [250, 250, 220]);
            }
            rect(img, 30, 44, 28, 20, [200, 40, 40]);
        },
    },
    Pair {
        id: "sunset-sky",
        category: "background_change",
        instruction: "Replace the background with a sunset.",
        description: "A red box on a meadow under a blue sky with the sun.",
        edit: |img| {
            for y in 0..64 {
                let t = y as f32 / 64.0;
                rect(img, 0, y, W, 1, [250, (90.0 + 90.0 * t) as u8, 60]);
            }
            disc(img, 100, 50, 12, [255, 230, 120]);
            rect(img, 30, 44, 28, 20, [200, 40, 40]);
        },
    },
];

/// Writes the demo benchmark under `dir`: `src/<id>.png`, `edit/<id>.png` and
/// `benchmark.jsonl`; returns the JSONL's path.
fn write_benchmark(dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir.join("src"))?;
    std::fs::create_dir_all(dir.join("edit"))?;
    let mut lines = String::new();
    for p in PAIRS {
        let src = scene();
        let mut edit = src.clone();
        (p.edit)(&mut edit);
        let src_path = format!("src/{}.png", p.id);
        let edit_path = format!("edit/{}.png", p.id);
        src.save(dir.join(&src_path))
            .with_context(|| format!("writing {}", dir.join(&src_path).display()))?;
        edit.save(dir.join(&edit_path))
            .with_context(|| format!("writing {}", dir.join(&edit_path).display()))?;
        lines.push_str(
            &serde_json::json!({
                "id": p.id,
                "category": p.category,
                "instruction": p.instruction,
                "description": p.description,
                "source": src_path,
                "edited": edit_path,
            })
            .to_string(),
        );
        lines.push('\n');
    }
    let path = dir.join("benchmark.jsonl");
    std::fs::write(&path, lines).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// `edit-score --demo`.
pub fn run(args: &ScoreArgs) -> Result<()> {
    for (given, flag) in [
        (args.benchmark.is_some(), "--benchmark"),
        (args.format.is_some(), "--format"),
        (args.edited_dir.is_some(), "--edited-dir"),
        (args.gedit_rows.is_some(), "--gedit-rows"),
        (args.num_shards.is_some(), "--num-shards"),
        (args.shard_index.is_some(), "--shard-index"),
    ] {
        if given {
            bail!("{flag} does not apply to --demo, which generates its own benchmark; leave out --demo to score yours");
        }
    }
    let bundled = args.model.is_none();
    if bundled {
        eprintln!("{RANDOM_WEIGHTS_NOTE}\n");
    }
    let output = match &args.output {
        Some(o) => o.clone(),
        None => tempfile::Builder::new()
            .prefix("edit-score-demo-")
            .tempdir()
            .context("making a directory for the demo's output (or give --output-dir DIR)")?
            .keep(),
    };
    std::fs::create_dir_all(&output)
        .with_context(|| format!("creating the output directory {}", output.display()))?;
    let bench_dir = output.join("benchmark");
    let jsonl = write_benchmark(&bench_dir)?;
    let loaded = load_jsonl(&jsonl, &bench_dir)?;

    // The bundled judge lives in a temporary directory for the run (replica processes load it
    // from there too). Its directory name is part of the model id: keep it fixed.
    let judge_tmp = tempfile::Builder::new()
        .prefix("edit-score-judge-")
        .tempdir()
        .context("making a temporary directory for the bundled judge")?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => {
            let dir = judge_tmp.path().join("qwen3-vl-tiny");
            std::fs::create_dir_all(&dir)?;
            for (name, bytes) in TINY_JUDGE {
                std::fs::write(dir.join(name), bytes)
                    .with_context(|| format!("writing the bundled judge's {name}"))?;
            }
            dir.display().to_string()
        }
    };
    let prompts = match &args.prompts {
        Some(p) => crate::score::prompt_set(p, &args.images)?,
        None => apply_images(
            PromptSet::from_toml(
                VIESCORE,
                Path::new("configs/judge/viescore.toml (built in)"),
            )?,
            &args.images,
        )?,
    };
    let job = Job {
        loaded,
        benchmark: jsonl.display().to_string(),
        format: Format::Jsonl,
        prompts,
        model,
        resize_edited_to_source: false,
        output: output.clone(),
    };
    let result = execute(args, job);
    if bundled {
        eprintln!("\n{RANDOM_WEIGHTS_NOTE}");
    }
    result?;
    eprintln!(
        "the demo's benchmark is in {}; rerun with --output-dir {} to resume (nothing is judged twice)",
        bench_dir.display(),
        output.display()
    );
    Ok(())
}
