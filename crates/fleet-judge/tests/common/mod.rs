//! Test helpers: generated benchmarks and a scripted test double of a judge.
//!
//! `Scripted` is not a judge: it answers from a table the test writes, keyed by the item number
//! painted into the edited image (red channel) and the kind of call, so the orchestration
//! (batches, records, resume, pool, shards, reports) can be checked against hand-computed
//! numbers without a model.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_judge::benchmark::{load_jsonl, Loaded};
use fleet_judge::judge::{Decoding, Judge, JudgeReply, JudgeRequest, Part};
use fleet_judge::prompts::PromptSet;
use fleet_judge::run::ScoringSpec;
use image::{DynamicImage, Rgb, RgbImage};

/// A uniform PNG of `color`.
pub fn write_png(path: &Path, w: u32, h: u32, color: [u8; 3]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let img = RgbImage::from_pixel(w, h, Rgb(color));
    DynamicImage::ImageRgb8(img).save(path).unwrap();
}

/// One generated item: its number (painted into its images), category and instruction.
pub struct GenItem {
    pub n: u8,
    pub category: &'static str,
}

/// Writes a plain-JSONL benchmark under `dir`: per item `src/<n>.png` (6x4, colour (n, 200, 0))
/// and `edit/<n>.png` (4x4, colour (n, version, 0)); returns the JSONL path.
pub fn write_benchmark(dir: &Path, items: &[GenItem]) -> PathBuf {
    let mut lines = String::new();
    for it in items {
        write_png(
            &dir.join("src").join(format!("{}.png", it.n)),
            6,
            4,
            [it.n, 200, 0],
        );
        write_png(
            &dir.join("edit").join(format!("{}.png", it.n)),
            4,
            4,
            [it.n, 0, 0],
        );
        lines.push_str(
            &serde_json::json!({
                "id": format!("pair-{}", it.n),
                "category": it.category,
                "instruction": format!("edit number {}", it.n),
                "source": format!("src/{}.png", it.n),
                "edited": format!("edit/{}.png", it.n),
            })
            .to_string(),
        );
        lines.push('\n');
    }
    let path = dir.join("bench.jsonl");
    std::fs::write(&path, lines).unwrap();
    path
}

/// Loads the generated benchmark.
pub fn load(dir: &Path) -> Loaded {
    load_jsonl(&dir.join("bench.jsonl"), dir).unwrap()
}

/// Repaints an item's edited image with another version (a changed edit).
pub fn change_edit(dir: &Path, n: u8, version: u8) {
    write_png(
        &dir.join("edit").join(format!("{n}.png")),
        4,
        4,
        [n, version, 0],
    );
}

/// A single-scheme prompt set that shows source + edited and asks with the instruction.
pub const SINGLE_SET: &str = r#"
name = "test-single"
version = 1
scheme = "single"
[calls.score.templates.default]
system = "You judge edits in {category}."
user = "Judge this edit: {instruction}. Reply `Score: X`."
"#;

/// A VIEScore-like set (short texts).
pub const VIE_SET: &str = r#"
name = "test-vie"
version = 1
scheme = "viescore"
[calls.sc]
images = ["source", "edited"]
scores = 2
[calls.sc.templates.default]
user = "SC for: {instruction}. Output {{\"score\": [a, b]}}"
[calls.pq]
images = ["edited"]
scores = 2
[calls.pq.templates.default]
user = "PQ: rate naturalness and artifacts. Output {{\"score\": [a, b]}}"
"#;

pub fn prompt_set(dir: &Path, name: &str, text: &str) -> PromptSet {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    PromptSet::load(&path).unwrap()
}

pub fn spec(prompts: PromptSet, model: &str) -> ScoringSpec {
    ScoringSpec {
        prompts,
        model_id: model.to_string(),
        decoding: Decoding::greedy(64),
        retry: None,
        resize_edited_to_source: false,
        image_backend: Default::default(),
    }
}

/// What the scripted double saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The item number (red channel of the last image, the edit).
    pub item: u8,
    /// The edit's version (green channel of the last image).
    pub version: u8,
    /// The call kind: "pq" when the text mentions naturalness, "sc" when it starts with "SC",
    /// else "score".
    pub call: &'static str,
    /// Sizes of the images, in order.
    pub images: Vec<(u32, u32)>,
    /// The system text.
    pub system: Option<String>,
    /// The user text.
    pub text: String,
    /// The decoding.
    pub decoding: Decoding,
    /// Which double answered.
    pub by: String,
}

/// Replies by (item, call, sampled?): `Ok(text)` or `Err(reason)` for a failed request.
pub type Table = HashMap<(u8, &'static str, bool), Result<String, String>>;

/// The scripted test double.
pub struct Scripted {
    pub name: String,
    pub model: String,
    pub table: Arc<Table>,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    /// Fail every batch (a broken replica).
    pub fail_all: bool,
    /// Raised by a `fail_all` double when it has failed a batch.
    pub failed: Arc<AtomicBool>,
    /// Hold the first batch until this flag is raised (so a test decides which replica
    /// gets work first instead of racing for it); gives up after ten seconds.
    pub wait_for: Option<Arc<AtomicBool>>,
}

impl Scripted {
    pub fn new(name: &str, model: &str, table: Arc<Table>, seen: Arc<Mutex<Vec<Seen>>>) -> Self {
        Scripted {
            name: name.to_string(),
            model: model.to_string(),
            table,
            seen,
            fail_all: false,
            failed: Arc::new(AtomicBool::new(false)),
            wait_for: None,
        }
    }
}

impl Judge for Scripted {
    fn model_id(&self) -> String {
        self.model.clone()
    }

    fn judge(
        &mut self,
        batch: &[JudgeRequest],
        decoding: &Decoding,
    ) -> Vec<Result<JudgeReply, String>> {
        if let Some(flag) = self.wait_for.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !flag.load(Ordering::SeqCst) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        if self.fail_all {
            self.failed.store(true, Ordering::SeqCst);
            return batch
                .iter()
                .map(|_| {
                    Err(format!(
                        "{}: CUDA error: an illegal memory access",
                        self.name
                    ))
                })
                .collect();
        }
        batch
            .iter()
            .map(|r| {
                let images: Vec<&DynamicImage> = r
                    .user
                    .iter()
                    .filter_map(|p| match p {
                        Part::Image(i) => Some(i.as_ref()),
                        Part::Text(_) => None,
                    })
                    .collect();
                let last = images.last().expect("a request has an image").to_rgb8();
                let px = last.get_pixel(0, 0);
                let text = r.user_text();
                let call = if text.contains("naturalness") {
                    "pq"
                } else if text.starts_with("SC") {
                    "sc"
                } else {
                    "score"
                };
                let seen = Seen {
                    item: px[0],
                    version: px[1],
                    call,
                    images: images.iter().map(|i| (i.width(), i.height())).collect(),
                    system: r.system.clone(),
                    text,
                    decoding: *decoding,
                    by: self.name.clone(),
                };
                self.seen.lock().unwrap().push(seen);
                let sampled = decoding.sampling.is_some();
                let reply = self
                    .table
                    .get(&(px[0], call, sampled))
                    .or_else(|| self.table.get(&(px[0], call, false)))
                    .cloned()
                    .unwrap_or_else(|| {
                        Err(format!("no scripted reply for item {} {call}", px[0]))
                    })?;
                Ok(JudgeReply {
                    new_tokens: reply.split_whitespace().count(),
                    text: reply,
                    stopped_at_eos: true,
                })
            })
            .collect()
    }
}

/// Reads a JSONL file's lines.
pub fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}
