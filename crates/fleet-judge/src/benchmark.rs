//! Benchmark loaders of the edit-score job.
//!
//! Three inputs, one output ([`Loaded`]):
//!
//! - [`load_scorer_json`] — the original scorer's data JSON (Thomas-uestc/image_edit_benchmark,
//!   `src/data/benchmark_loader.py`): a list of items with the source image inline as base64;
//!   the edited images lie in a directory, named by pair id.
//! - [`load_gedit`] — GEdit-Bench's directory layout
//!   (`fullset/<task_type>/<language>/<key>.png` beside `<key>_SRCIMG.png`), with the
//!   instructions from the dataset's rows; [`resize_to_source`] does what its scorer does to the
//!   edit before judging.
//! - [`load_jsonl`] — a plain JSONL of `{id, category, instruction, source, edited}`.
//!
//! Every item is validated up front: a bad item (missing image, base64 that does not decode or is
//! not an image, unknown category, a line that is not JSON or lacks a field, a duplicate) is
//! listed in [`Loaded::skipped`] with its reason and the rest runs. Only whole-file problems (the
//! file cannot be read, is not the expected shape, duplicate ids in a JSONL, nothing left) are
//! errors.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use fleet_models::vision::MAX_ASPECT_RATIO;
use image::DynamicImage;
use serde_json::{Map, Value};

/// How many skip reasons an [`Error::Empty`] quotes.
const EMPTY_REASONS_SHOWN: usize = 5;

/// Extensions tried after a pair id when looking for an edited image (the `image` crate here
/// reads PNG and JPEG).
const EDITED_EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

/// GEdit-Bench's 11 task groups (`test_gedit_score.py:14–16` in stepfun-ai/Step1X-Edit).
pub const GEDIT_GROUPS: [&str; 11] = [
    "background_change",
    "color_alter",
    "material_alter",
    "motion_change",
    "ps_human",
    "style_change",
    "subject-add",
    "subject-remove",
    "subject-replace",
    "text_change",
    "tone_transfer",
];

/// The languages of GEdit-Bench's layout (its folders `en/` and `cn/`).
pub const GEDIT_LANGUAGES: [&str; 2] = ["en", "cn"];

/// Errors of the loaders: whole-file problems only (bad items are [`Skipped`], not errors).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or directory could not be read.
    #[error("cannot read {path}: {source}; check that the path exists and is readable")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The scorer JSON is not JSON.
    #[error(
        "{path} is not valid JSON ({source}); the scorer's data file is one JSON list of items"
    )]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's message (line and column).
        source: serde_json::Error,
    },
    /// The scorer JSON is JSON but not a list.
    #[error(
        "{path}: expected a JSON list of items (each with subset, src_img_b64, \
         edit_instruction_en, original_image_path, ...), found {found}; pass the scorer's data file"
    )]
    NotAList {
        /// The file.
        path: PathBuf,
        /// What was found instead ("an object", "a string", ...).
        found: &'static str,
    },
    /// A directory argument is not a directory.
    #[error("{what} {path} is not a directory; pass the directory that holds the {what}")]
    NotADirectory {
        /// The path.
        path: PathBuf,
        /// What it should hold ("edited images", "GEdit-Bench fullset").
        what: &'static str,
    },
    /// Two lines of a JSONL share an id.
    #[error(
        "{path}: id {id:?} appears on line {first_line} and line {second_line}; \
         ids must be unique: rename or remove one"
    )]
    DuplicateId {
        /// The file.
        path: PathBuf,
        /// The id.
        id: String,
        /// Its first line (1-based).
        first_line: usize,
        /// The repeating line (1-based).
        second_line: usize,
    },
    /// An unsupported GEdit-Bench language.
    #[error(
        "GEdit-Bench language {language:?} is not one of en, cn (the layout's folder names; \
         for Chinese pass \"cn\", not \"zh\")"
    )]
    BadLanguage {
        /// The language given.
        language: String,
    },
    /// Every item was skipped.
    #[error(
        "{path}: no usable item, all {skipped} skipped; first reasons: {reasons}; \
         fix those items or point at the right files"
    )]
    Empty {
        /// The benchmark file.
        path: PathBuf,
        /// How many items were skipped.
        skipped: usize,
        /// The first few `id: reason` entries, `; `-separated.
        reasons: String,
    },
}

/// Result of the loaders.
pub type Result<T> = std::result::Result<T, Error>;

/// An image: a file, or bytes decoded from base64 (checked to be a readable image).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRef {
    /// An image file (checked to exist and to have a readable image header).
    Path(PathBuf),
    /// Encoded image bytes (PNG, JPEG, ...) decoded from base64.
    Bytes(Vec<u8>),
}

impl ImageRef {
    /// Decodes the image.
    pub fn load(&self) -> image::ImageResult<DynamicImage> {
        match self {
            ImageRef::Path(p) => image::io::Reader::open(p)?.with_guessed_format()?.decode(),
            ImageRef::Bytes(b) => image::load_from_memory(b),
        }
    }
}

/// One (source, edit) pair to judge.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    /// The pair id (scorer: derived from `original_image_path`; GEdit: `key`; JSONL: `id`).
    pub id: String,
    /// The category (scorer: `subset`; GEdit: `task_type`; JSONL: `category`).
    pub category: String,
    /// The edit instruction.
    pub instruction: String,
    /// The source image.
    pub source: ImageRef,
    /// The edited image.
    pub edited: ImageRef,
    /// The instruction's language where known (`en`/`cn`).
    pub language: Option<String>,
    /// The item's other fields, as read (the scorer's base64 image left out; see each loader).
    pub extra: Map<String, Value>,
}

/// Why an item was skipped, as a kind (the summary counts by kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SkipKind {
    /// A line that is not JSON (or not a JSON object).
    NotJson,
    /// A required field is missing, empty or not a string.
    MissingField,
    /// The category is not among those allowed.
    UnknownCategory,
    /// The id repeats an earlier item's.
    DuplicateId,
    /// The source image file is missing.
    MissingSource,
    /// The edited image file is missing.
    MissingEdited,
    /// An image file exists but its header cannot be read as an image.
    UnreadableImage,
    /// The base64 does not decode.
    BadBase64,
    /// The base64 decodes but the bytes are not a readable image.
    Base64NotImage,
    /// The image is empty or more than 200 times longer than wide (or the reverse): the
    /// judge's image processor cannot take it.
    ExtremeAspectRatio,
}

impl fmt::Display for SkipKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SkipKind::NotJson => "not JSON",
            SkipKind::MissingField => "missing field",
            SkipKind::UnknownCategory => "unknown category",
            SkipKind::DuplicateId => "duplicate id",
            SkipKind::MissingSource => "missing source image",
            SkipKind::MissingEdited => "missing edited image",
            SkipKind::UnreadableImage => "unreadable image",
            SkipKind::BadBase64 => "bad base64",
            SkipKind::Base64NotImage => "base64 not an image",
            SkipKind::ExtremeAspectRatio => "extreme aspect ratio",
        })
    }
}

/// An item left out, with why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The item's id, or `line N` / `item N` (1-based) where it has none.
    pub id: String,
    /// The kind of problem (the summary counts these).
    pub kind: SkipKind,
    /// The full reason, naming the field or path and the fix.
    pub reason: String,
}

/// What a loader returns: the usable items in file order, and the skipped ones.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Loaded {
    /// Items that passed validation.
    pub items: Vec<Item>,
    /// Items left out, with the reason.
    pub skipped: Vec<Skipped>,
}

impl Loaded {
    /// Skip counts per kind, in [`SkipKind`] order.
    pub fn skip_counts(&self) -> BTreeMap<SkipKind, usize> {
        let mut counts = BTreeMap::new();
        for s in &self.skipped {
            *counts.entry(s.kind).or_insert(0) += 1;
        }
        counts
    }
}

/// `N items loaded, M skipped: 2 missing edited image, 1 bad base64`.
impl fmt::Display for Loaded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} items loaded, {} skipped",
            self.items.len(),
            self.skipped.len()
        )?;
        let counts = self.skip_counts();
        if !counts.is_empty() {
            let parts: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
            write!(f, ": {}", parts.join(", "))?;
        }
        Ok(())
    }
}

impl Skipped {
    fn new(id: impl Into<String>, kind: SkipKind, reason: impl Into<String>) -> Self {
        Skipped {
            id: id.into(),
            kind,
            reason: reason.into(),
        }
    }
}

/// Ends a load: an empty result is an error quoting the first reasons.
fn finish(path: &Path, loaded: Loaded) -> Result<Loaded> {
    if loaded.items.is_empty() {
        let reasons: Vec<String> = loaded
            .skipped
            .iter()
            .take(EMPTY_REASONS_SHOWN)
            .map(|s| format!("{}: {}", s.id, s.reason))
            .collect();
        let reasons = if reasons.is_empty() {
            "the file holds no items".to_string()
        } else {
            reasons.join("; ")
        };
        return Err(Error::Empty {
            path: path.to_path_buf(),
            skipped: loaded.skipped.len(),
            reasons,
        });
    }
    Ok(loaded)
}

fn read_to_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn require_dir(path: &Path, what: &'static str) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::NotADirectory {
            path: path.to_path_buf(),
            what,
        }),
        Err(source) => Err(Error::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A non-empty string field, or `None`.
fn str_field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a str> {
    obj.get(name)
        .and_then(Value::as_str)
        .filter(|s| !s.trim().is_empty())
}

/// Checks that an image file exists and its header reads; `Err((kind, reason))` otherwise.
fn check_image_file(
    path: &Path,
    role: &str,
    missing: SkipKind,
) -> std::result::Result<(), (SkipKind, String)> {
    if !path.is_file() {
        return Err((
            missing,
            format!(
                "{role} image {} does not exist; add the file or fix the path",
                path.display()
            ),
        ));
    }
    let dims = image::io::Reader::open(path)
        .map_err(image::ImageError::IoError)
        .and_then(|r| r.with_guessed_format().map_err(image::ImageError::IoError))
        .and_then(|r| r.into_dimensions());
    match dims {
        Ok((w, h)) => check_aspect(w, h, &format!("{role} image {}", path.display())),
        Err(e) => Err((
            SkipKind::UnreadableImage,
            format!(
                "{role} image {} is not a readable PNG/JPEG image ({e}); re-save it as PNG",
                path.display()
            ),
        )),
    }
}

/// Refuses an image the judge's processor cannot take: a zero side, or one side more than
/// [`MAX_ASPECT_RATIO`] times the other.
fn check_aspect(
    width: u32,
    height: u32,
    what: &str,
) -> std::result::Result<(), (SkipKind, String)> {
    let (long, short) = (width.max(height), width.min(height));
    if short == 0 || long as f64 / short as f64 > MAX_ASPECT_RATIO {
        return Err((
            SkipKind::ExtremeAspectRatio,
            format!(
                "{what} is {width}x{height}: the judge's image processor takes at most \
                 {MAX_ASPECT_RATIO}:1 between the sides; crop or pad it"
            ),
        ));
    }
    Ok(())
}

/// Decodes the scorer's `src_img_b64` as its `decode_base64_image` does: a `data:` URL prefix
/// (everything up to the first comma) is dropped, then standard base64 (whitespace ignored,
/// padding optional); the bytes must be a readable image.
fn decode_b64_image(b64: &str) -> std::result::Result<Vec<u8>, (SkipKind, String)> {
    let body = match b64.split_once(',') {
        Some((_, rest)) => rest,
        None => b64,
    };
    let clean: String = body.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let bytes = engine.decode(clean.as_bytes()).map_err(|e| {
        (
            SkipKind::BadBase64,
            format!("field src_img_b64 is not valid base64 ({e}); re-encode the source image"),
        )
    })?;
    match image::load_from_memory(&bytes) {
        Err(e) => Err((
            SkipKind::Base64NotImage,
            format!("field src_img_b64 decodes but is not a readable image ({e}); re-encode the source image as PNG"),
        )),
        Ok(img) => {
            check_aspect(img.width(), img.height(), "the source image in src_img_b64")?;
            Ok(bytes)
        }
    }
}

/// The scorer's pair id (`benchmark_loader.py`): when `original_image_path` holds a `/`, its last
/// component with every `.png` and `.jpg` removed (Python's `str.replace`, so anywhere in the
/// name); otherwise the value as is; when the field is missing, `<subset>_<index>` (0-based index
/// in the whole list).
pub fn scorer_pair_id(original_image_path: Option<&str>, subset: &str, index: usize) -> String {
    match original_image_path {
        Some(p) if !p.is_empty() => {
            if p.contains('/') {
                let last = p.rsplit('/').next().unwrap_or(p);
                last.replace(".png", "").replace(".jpg", "")
            } else {
                p.to_string()
            }
        }
        _ => format!("{subset}_{index}"),
    }
}

/// Where the edited image of a scorer pair is, in order of preference; the first that exists wins.
///
/// 1. `<edited_dir>/<subset>/<pair id>.png` — the scorer's own save path
///    (`pipeline.py` `_save_edited_image`: `images_dir/<category>/<pair_id>.png`);
/// 2. `<edited_dir>/<subset>/<pair id>.jpg` / `.jpeg`;
/// 3. `<edited_dir>/<pair id>` exactly;
/// 4. `<edited_dir>/<pair id>.png` / `.jpg` / `.jpeg`.
pub fn scorer_edited_candidates(edited_dir: &Path, subset: &str, pair_id: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for ext in EDITED_EXTENSIONS {
        out.push(edited_dir.join(subset).join(format!("{pair_id}.{ext}")));
    }
    out.push(edited_dir.join(pair_id));
    for ext in EDITED_EXTENSIONS {
        out.push(edited_dir.join(format!("{pair_id}.{ext}")));
    }
    out
}

/// Loads the original scorer's data JSON (Thomas-uestc/image_edit_benchmark, HEAD `0299191`,
/// `src/data/benchmark_loader.py`).
///
/// The file is one JSON list; per item:
/// - category = `subset` (one of `物理` / `环境` / `社会` / `因果` / `指代` in its configs); when
///   `categories` is given, any other subset is skipped as an unknown category;
/// - id = the pair id from `original_image_path` ([`scorer_pair_id`]);
/// - instruction = `edit_instruction_en`, else `edit_instruction` (the scorer reads only `_en`);
///   `language` is `Some("en")` when the `_en` field was used, `None` otherwise;
/// - source = `src_img_b64`, decoded ([`ImageRef::Bytes`]); it must decode and be a readable
///   image;
/// - edited = the first existing path of [`scorer_edited_candidates`]
///   (`<edited_dir>/<subset>/<pair id>.png` as the scorer saves it, or `<edited_dir>/<pair id>`
///   exactly or with `.png`/`.jpg`/`.jpeg` appended);
/// - extra = every field except `src_img_b64`, as read (`original_description(_en)`,
///   `rationale_short(_en)`, `tags`, `difficulty`, `seed`, ...), plus `description`: the
///   `original_description_en` value, else `original_description` (what the judge prompt uses).
///
/// A (subset, pair id) that repeats an earlier item is skipped (both would name the same edited
/// file). Skipped items are named by pair id, or `item N` (1-based) when not an object.
pub fn load_scorer_json(
    json: &Path,
    edited_dir: &Path,
    categories: Option<&[&str]>,
) -> Result<Loaded> {
    require_dir(edited_dir, "edited images")?;
    let text = read_to_string(json)?;
    let value: Value = serde_json::from_str(&text).map_err(|source| Error::Json {
        path: json.to_path_buf(),
        source,
    })?;
    let list = match value {
        Value::Array(list) => list,
        other => {
            return Err(Error::NotAList {
                path: json.to_path_buf(),
                found: json_kind(&other),
            })
        }
    };
    let mut loaded = Loaded::default();
    let mut seen: HashMap<(String, String), usize> = HashMap::new();
    for (index, entry) in list.into_iter().enumerate() {
        let n = index + 1;
        let Value::Object(mut obj) = entry else {
            loaded.skipped.push(Skipped::new(
                format!("item {n}"),
                SkipKind::NotJson,
                format!("item {n} is {} not an object; each item is an object with subset, src_img_b64, ...", json_kind(&entry)),
            ));
            continue;
        };
        let subset = str_field(&obj, "subset").map(str::to_string);
        let id = scorer_pair_id(
            obj.get("original_image_path").and_then(Value::as_str),
            subset.as_deref().unwrap_or(""),
            index,
        );
        let skip =
            |kind, reason: String| Skipped::new(id.clone(), kind, format!("item {n}: {reason}"));
        let Some(subset) = subset else {
            loaded.skipped.push(skip(
                SkipKind::MissingField,
                "field subset (the category) is missing or empty; add it".into(),
            ));
            continue;
        };
        if let Some(cats) = categories {
            if !cats.contains(&subset.as_str()) {
                loaded.skipped.push(skip(
                    SkipKind::UnknownCategory,
                    format!("subset {subset:?} is not one of {cats:?}; fix the subset or add it to the categories"),
                ));
                continue;
            }
        }
        let (instruction, language) = match (
            str_field(&obj, "edit_instruction_en"),
            str_field(&obj, "edit_instruction"),
        ) {
            (Some(en), _) => (en.to_string(), Some("en".to_string())),
            (None, Some(plain)) => (plain.to_string(), None),
            (None, None) => {
                loaded.skipped.push(skip(
                    SkipKind::MissingField,
                    "fields edit_instruction_en and edit_instruction are both missing or empty; add one".into(),
                ));
                continue;
            }
        };
        if let Some(first) = seen.get(&(subset.clone(), id.clone())) {
            loaded.skipped.push(skip(
                SkipKind::DuplicateId,
                format!(
                    "pair id {id:?} in subset {subset:?} repeats item {first}, and both would name the same \
                     edited image; make original_image_path unique"
                ),
            ));
            continue;
        }
        let Some(b64) = obj
            .get("src_img_b64")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
        else {
            loaded.skipped.push(skip(
                SkipKind::MissingField,
                "field src_img_b64 is missing or empty; add the source image".into(),
            ));
            continue;
        };
        let source = match decode_b64_image(b64) {
            Ok(bytes) => bytes,
            Err((kind, reason)) => {
                loaded.skipped.push(skip(kind, reason));
                continue;
            }
        };
        let candidates = scorer_edited_candidates(edited_dir, &subset, &id);
        let Some(edited) = candidates.iter().find(|p| p.is_file()).cloned() else {
            loaded.skipped.push(skip(
                SkipKind::MissingEdited,
                format!(
                    "no edited image for pair id {id:?}: looked for {} and {} (also .jpg/.jpeg); add the edit",
                    candidates[0].display(),
                    edited_dir.join(&id).display()
                ),
            ));
            continue;
        };
        if let Err((kind, reason)) = check_image_file(&edited, "edited", SkipKind::MissingEdited) {
            loaded.skipped.push(skip(kind, reason));
            continue;
        }
        seen.insert((subset.clone(), id.clone()), n);
        obj.remove("src_img_b64");
        let description = str_field(&obj, "original_description_en")
            .or_else(|| str_field(&obj, "original_description"))
            .map(|s| Value::String(s.to_string()));
        if let Some(d) = description {
            obj.insert("description".to_string(), d);
        }
        loaded.items.push(Item {
            id,
            category: subset,
            instruction,
            source: ImageRef::Bytes(source),
            edited: ImageRef::Path(edited),
            language,
            extra: obj,
        });
    }
    finish(json, loaded)
}

/// Loads GEdit-Bench (stepfun-ai/Step1X-Edit `GEdit-Bench/`, HEAD `570eba6`) for one language.
///
/// - `root`: GEdit's `fullset` directory of one model, `<root>/<task_type>/<language>/` holding
///   `<key>_SRCIMG.png` (the source) beside `<key>.png` (the edit), as `generate_image_example.py`
///   writes and `test_gedit_score.py` reads them. A `root` that holds a `fullset/` folder
///   (`<save_path>/<model>/`) is accepted too.
/// - `language`: `en` or `cn`, the layout's folder names (GEdit's own `--language` flag says
///   `zh`, but the folders use the dataset's `instruction_language`, `cn`).
/// - `edited_dir`: where the `<task_type>/<language>/<key>.png` edits are, when not beside the
///   sources (default: `root`).
/// - `rows`: the instructions. GEdit's scorer takes them from the Hugging Face dataset
///   (`stepfun-ai/GEdit-Bench`), not from files, so they come here as a JSON Lines export of the
///   dataset's rows with its fields `task_type`, `key`, `instruction`, `instruction_language`
///   (image columns, if present, are ignored). This export format is this crate's choice.
///
/// Rows of the other language are left out (not skipped). Per row: category = `task_type` (one of
/// [`GEDIT_GROUPS`], else skipped as unknown), id = `key`, `language` = `Some(language)`, extra =
/// the row's other fields except `input_image` / `input_image_raw`. A repeated
/// (`task_type`, `key`) is skipped. Judge with [`resize_to_source`] applied to the edit.
pub fn load_gedit(
    root: &Path,
    language: &str,
    edited_dir: Option<&Path>,
    rows: &Path,
) -> Result<Loaded> {
    if !GEDIT_LANGUAGES.contains(&language) {
        return Err(Error::BadLanguage {
            language: language.to_string(),
        });
    }
    require_dir(root, "GEdit-Bench fullset")?;
    let root = if root.join("fullset").is_dir() {
        root.join("fullset")
    } else {
        root.to_path_buf()
    };
    let edited_root = match edited_dir {
        Some(d) => {
            require_dir(d, "edited images")?;
            if d.join("fullset").is_dir() {
                d.join("fullset")
            } else {
                d.to_path_buf()
            }
        }
        None => root.clone(),
    };
    let text = read_to_string(rows)?;
    let mut loaded = Loaded::default();
    let mut seen: HashMap<(String, String), usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let label = format!("line {n}");
        let mut obj = match parse_object(line, n) {
            Ok(obj) => obj,
            Err(s) => {
                loaded.skipped.push(s);
                continue;
            }
        };
        let mut missing = Vec::new();
        let mut get = |name: &'static str| {
            let v = str_field(&obj, name).map(str::to_string);
            if v.is_none() {
                missing.push(name);
            }
            v
        };
        let (task, key, instruction, lang) = (
            get("task_type"),
            get("key"),
            get("instruction"),
            get("instruction_language"),
        );
        let (Some(task), Some(key), Some(instruction), Some(lang)) = (task, key, instruction, lang)
        else {
            loaded.skipped.push(Skipped::new(
                label,
                SkipKind::MissingField,
                format!("line {n}: field(s) {} missing or empty; each row needs task_type, key, instruction, instruction_language", missing.join(", ")),
            ));
            continue;
        };
        if lang != language {
            continue;
        }
        let skip =
            |kind, reason: String| Skipped::new(key.clone(), kind, format!("line {n}: {reason}"));
        if !GEDIT_GROUPS.contains(&task.as_str()) {
            loaded.skipped.push(skip(
                SkipKind::UnknownCategory,
                format!("task_type {task:?} is not one of GEdit-Bench's 11 groups {GEDIT_GROUPS:?}; fix the row"),
            ));
            continue;
        }
        if let Some(first) = seen.get(&(task.clone(), key.clone())) {
            loaded.skipped.push(skip(
                SkipKind::DuplicateId,
                format!("key {key:?} in {task} repeats line {first}; keys are unique per task group and language"),
            ));
            continue;
        }
        let source = root
            .join(&task)
            .join(language)
            .join(format!("{key}_SRCIMG.png"));
        let edited = edited_root
            .join(&task)
            .join(language)
            .join(format!("{key}.png"));
        if let Err((kind, reason)) = check_image_file(&source, "source", SkipKind::MissingSource)
            .and_then(|_| check_image_file(&edited, "edited", SkipKind::MissingEdited))
        {
            loaded.skipped.push(skip(kind, reason));
            continue;
        }
        seen.insert((task.clone(), key.clone()), n);
        obj.remove("input_image");
        obj.remove("input_image_raw");
        loaded.items.push(Item {
            id: key,
            category: task,
            instruction,
            source: ImageRef::Path(source),
            edited: ImageRef::Path(edited),
            language: Some(language.to_string()),
            extra: obj,
        });
    }
    finish(rows, loaded)
}

/// The edit resized to the source's size, as GEdit-Bench's scorer does
/// (`Image.open(edit).convert("RGB").resize(src.size)`, `test_gedit_score.py:34`).
///
/// The result is RGB8. PIL's default resample for RGB is bicubic (Pillow >= 7); this uses
/// fleet-models' reimplementation of Pillow's bicubic
/// ([`fleet_models::vision::resize_bicubic_rgb8`], the one Qwen3-VL's preprocessing uses:
/// bit-exact with Pillow 13 on 8-bit images). An edit already at the source size is only
/// converted, as PIL returns a copy.
pub fn resize_to_source(edited: &DynamicImage, source: &DynamicImage) -> DynamicImage {
    let rgb = edited.to_rgb8();
    let (w, h) = (rgb.width(), rgb.height());
    let (sw, sh) = (source.width(), source.height());
    if (w, h) == (sw, sh) || w == 0 || h == 0 || sw == 0 || sh == 0 {
        return DynamicImage::ImageRgb8(rgb);
    }
    let resized = fleet_models::vision::resize_bicubic_rgb8(
        rgb.as_raw(),
        w as usize,
        h as usize,
        sw as usize,
        sh as usize,
    );
    let buf = image::RgbImage::from_raw(sw, sh, resized)
        .expect("the resize returns width x height x 3 bytes");
    DynamicImage::ImageRgb8(buf)
}

/// Parses one JSONL line into an object, or the [`Skipped`] entry for it.
fn parse_object(line: &str, n: usize) -> std::result::Result<Map<String, Value>, Skipped> {
    match serde_json::from_str::<Value>(line) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(other) => Err(Skipped::new(
            format!("line {n}"),
            SkipKind::NotJson,
            format!(
                "line {n} is {}, not a JSON object; write one object per line",
                json_kind(&other)
            ),
        )),
        Err(e) => Err(Skipped::new(
            format!("line {n}"),
            SkipKind::NotJson,
            format!("line {n} is not JSON ({e}); write one JSON object per line"),
        )),
    }
}

/// Loads a plain JSONL benchmark: one object per line with string fields `id`, `category`,
/// `instruction`, `source` and `edited` (image paths, absolute or relative to `base`); an
/// optional string `language`; other fields go to [`Item::extra`].
///
/// Blank lines are ignored. A line that is not JSON or lacks a field is skipped as `line N` with
/// the reason; a missing or unreadable image skips the item. Two lines with the same `id` are an
/// error naming both lines (checked before any other validation of the second line).
pub fn load_jsonl(path: &Path, base: &Path) -> Result<Loaded> {
    let text = read_to_string(path)?;
    let mut loaded = Loaded::default();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let mut obj = match parse_object(line, n) {
            Ok(obj) => obj,
            Err(s) => {
                loaded.skipped.push(s);
                continue;
            }
        };
        if let Some(id) = str_field(&obj, "id") {
            if let Some(&first) = seen.get(id) {
                return Err(Error::DuplicateId {
                    path: path.to_path_buf(),
                    id: id.to_string(),
                    first_line: first,
                    second_line: n,
                });
            }
            seen.insert(id.to_string(), n);
        }
        let fields = ["id", "category", "instruction", "source", "edited"];
        let missing: Vec<&str> = fields
            .iter()
            .copied()
            .filter(|f| str_field(&obj, f).is_none())
            .collect();
        if !missing.is_empty() {
            loaded.skipped.push(Skipped::new(
                format!("line {n}"),
                SkipKind::MissingField,
                format!(
                    "line {n}: field(s) {} missing, empty or not a string; each line needs {}",
                    missing.join(", "),
                    fields.join(", ")
                ),
            ));
            continue;
        }
        let mut take = |name: &str| match obj.remove(name) {
            Some(Value::String(s)) => s,
            _ => unreachable!("checked above"),
        };
        let (id, category, instruction, source, edited) = (
            take("id"),
            take("category"),
            take("instruction"),
            take("source"),
            take("edited"),
        );
        let language = match obj.get("language") {
            Some(Value::String(s)) if !s.is_empty() => {
                let l = s.clone();
                obj.remove("language");
                Some(l)
            }
            _ => None,
        };
        let source = base.join(source);
        let edited = base.join(edited);
        if let Err((kind, reason)) = check_image_file(&source, "source", SkipKind::MissingSource)
            .and_then(|_| check_image_file(&edited, "edited", SkipKind::MissingEdited))
        {
            loaded
                .skipped
                .push(Skipped::new(id, kind, format!("line {n}: {reason}")));
            continue;
        }
        loaded.items.push(Item {
            id,
            category,
            instruction,
            source: ImageRef::Path(source),
            edited: ImageRef::Path(edited),
            language,
            extra: obj,
        });
    }
    finish(path, loaded)
}
