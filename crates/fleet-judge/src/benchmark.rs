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
//! Every item is validated up front: a bad item (missing image, an image that does not decode
//! fully, base64 that does not decode or is not an image, unknown category, a line that is not
//! UTF-8, is not JSON or lacks a field, a duplicate) is listed in [`Loaded::skipped`] with its
//! reason and the rest runs. Only whole-file problems (the file cannot be read, is not the
//! expected shape, the scorer's JSON is not UTF-8, duplicate ids in a JSONL, nothing left) are
//! errors.
//!
//! Every image is decoded in full at load time, not only its header, so a file cut short (a
//! valid header, data missing) is skipped here rather than failing at judge time on every rerun;
//! the items' images are decoded in parallel on all cores, the pixels are dropped after the check,
//! and items and skip reasons stay in file order. JSONL files (and GEdit-Bench's rows) are read
//! as bytes: a line that is not UTF-8 is skipped as `line N`, naming the offset of its first bad
//! byte, and the other lines load.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use fleet_data::jsonl::json_kind;
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
    /// The scorer JSON holds a byte that is not UTF-8 (JSON is UTF-8 text).
    #[error(
        "{path}: byte 0x{byte:02X} at byte offset {offset} (line {line}, column {column}) is not \
         UTF-8; the scorer's data file is one UTF-8 JSON document: re-save the file as UTF-8"
    )]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// The first bad byte's offset in the file (0-based).
        offset: usize,
        /// Its line (1-based).
        line: usize,
        /// Its column in bytes (1-based).
        column: usize,
        /// The byte.
        byte: u8,
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
    /// An image file (checked at load time to exist and to decode in full).
    Path(PathBuf),
    /// Encoded image bytes (PNG, JPEG, ...) decoded from base64.
    Bytes(Vec<u8>),
}

impl ImageRef {
    /// `(width, height)` from the image's header (nothing decoded).
    pub fn dimensions(&self) -> image::ImageResult<(u32, u32)> {
        match self {
            ImageRef::Path(p) => image::io::Reader::open(p)?
                .with_guessed_format()?
                .into_dimensions(),
            ImageRef::Bytes(b) => image::io::Reader::new(std::io::Cursor::new(b))
                .with_guessed_format()?
                .into_dimensions(),
        }
    }

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
    /// An image file exists but does not decode in full as an image (an unreadable header, or
    /// data that is cut short or corrupt).
    UnreadableImage,
    /// The base64 does not decode.
    BadBase64,
    /// The base64 decodes but the bytes are not a readable image.
    Base64NotImage,
    /// The image is empty or more than 200 times longer than wide (or the reverse): the
    /// judge's image processor cannot take it.
    ExtremeAspectRatio,
    /// A line of a JSONL (or of GEdit-Bench's rows) holds a byte that is not UTF-8.
    NotUtf8,
    /// The item's prompt (its images and text) with max_new_tokens takes more positions than the
    /// judge model has (checked up front with the checkpoint's processor).
    PromptTooLong,
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
            SkipKind::NotUtf8 => "not UTF-8",
            SkipKind::PromptTooLong => "prompt too long",
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
    /// An item left out for `kind`, with the full `reason`.
    pub fn new(id: impl Into<String>, kind: SkipKind, reason: impl Into<String>) -> Self {
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

fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The lines of a file's bytes with their 1-based numbers: split on `\n`, a trailing `\r`
/// dropped (CRLF files read as `str::lines` reads them).
fn byte_lines(bytes: &[u8]) -> impl Iterator<Item = (usize, &[u8])> {
    bytes
        .split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .enumerate()
        .map(|(i, l)| (i + 1, l))
}

/// Line `n` of `file` as text, or the [`SkipKind::NotUtf8`] entry naming its first bad byte.
fn line_text<'a>(file: &Path, n: usize, line: &'a [u8]) -> std::result::Result<&'a str, Skipped> {
    std::str::from_utf8(line).map_err(|e| {
        let offset = e.valid_up_to();
        Skipped::new(
            format!("line {n}"),
            SkipKind::NotUtf8,
            format!(
                "{}: line {n} is not UTF-8: byte 0x{:02X} at byte offset {offset} of the line \
                 (counting from 0) is not valid UTF-8; re-save the file as UTF-8",
                file.display(),
                line[offset]
            ),
        )
    })
}

/// [`Error::NotUtf8`] for a whole-file document whose bytes are not UTF-8, with the line and
/// column of the first bad byte.
fn utf8_document<'a>(path: &Path, bytes: &'a [u8]) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        let offset = e.valid_up_to();
        let before = &bytes[..offset];
        let line_start = before
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        Error::NotUtf8 {
            path: path.to_path_buf(),
            offset,
            line: before.iter().filter(|&&b| b == b'\n').count() + 1,
            column: offset - line_start + 1,
            byte: bytes[offset],
        }
    })
}

/// `f` over `inputs` on rayon's threads, results in input order.
fn par_map<T: Sync, R: Send>(inputs: &[T], f: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
    use rayon::prelude::*;
    inputs.par_iter().map(f).collect()
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

/// A non-empty string field, or `None`.
fn str_field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a str> {
    obj.get(name)
        .and_then(Value::as_str)
        .filter(|s| !s.trim().is_empty())
}

/// Checks that an image file exists and decodes in full (its pixels are dropped at once), and
/// that its size suits the judge; `Err((kind, reason))` otherwise.
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
        .and_then(|r| r.decode())
        .map(|img| (img.width(), img.height()));
    match dims {
        Ok((w, h)) => check_aspect(w, h, &format!("{role} image {}", path.display())),
        Err(e) => Err((
            SkipKind::UnreadableImage,
            format!(
                "{role} image {} does not decode as a PNG/JPEG image ({e}); the file may be cut \
                 short (an interrupted write or copy) or not an image; re-save it as PNG",
                path.display()
            ),
        )),
    }
}

/// Checks an item's source and edited image files, the source first.
fn check_image_pair(source: &Path, edited: &Path) -> std::result::Result<(), (SkipKind, String)> {
    check_image_file(source, "source", SkipKind::MissingSource)?;
    check_image_file(edited, "edited", SkipKind::MissingEdited)
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
    let value: Value = {
        let bytes = read_bytes(json)?;
        let text = utf8_document(json, &bytes)?;
        serde_json::from_str(text).map_err(|source| Error::Json {
            path: json.to_path_buf(),
            source,
        })?
    };
    let list = match value {
        Value::Array(list) => list,
        other => {
            return Err(Error::NotAList {
                path: json.to_path_buf(),
                found: json_kind(&other),
            })
        }
    };
    // First the checks that need no image, in file order; the images of the items that pass are
    // then decoded in parallel, and the results are taken in file order again.
    struct Pending {
        n: usize,
        id: String,
        subset: String,
        instruction: String,
        language: Option<String>,
        b64: Option<String>,
        obj: Map<String, Value>,
    }
    let mut entries: Vec<std::result::Result<Pending, Skipped>> = Vec::new();
    for (index, entry) in list.into_iter().enumerate() {
        let n = index + 1;
        let Value::Object(mut obj) = entry else {
            entries.push(Err(Skipped::new(
                format!("item {n}"),
                SkipKind::NotJson,
                format!("item {n} is {} not an object; each item is an object with subset, src_img_b64, ...", json_kind(&entry)),
            )));
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
            entries.push(Err(skip(
                SkipKind::MissingField,
                "field subset (the category) is missing or empty; add it".into(),
            )));
            continue;
        };
        if let Some(cats) = categories {
            if !cats.contains(&subset.as_str()) {
                entries.push(Err(skip(
                    SkipKind::UnknownCategory,
                    format!("subset {subset:?} is not one of {cats:?}; fix the subset or add it to the categories"),
                )));
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
                entries.push(Err(skip(
                    SkipKind::MissingField,
                    "fields edit_instruction_en and edit_instruction are both missing or empty; add one".into(),
                )));
                continue;
            }
        };
        let b64 = match obj.remove("src_img_b64") {
            Some(Value::String(s)) if !s.is_empty() => Some(s),
            _ => None,
        };
        entries.push(Ok(Pending {
            n,
            id,
            subset,
            instruction,
            language,
            b64,
            obj,
        }));
    }
    let images = par_map(&entries, |entry| {
        entry
            .as_ref()
            .ok()
            .map(|p| scorer_images(p.b64.as_deref(), edited_dir, &p.subset, &p.id))
    });
    let mut loaded = Loaded::default();
    let mut seen: HashMap<(String, String), usize> = HashMap::new();
    for (entry, images) in entries.into_iter().zip(images) {
        let Pending {
            n,
            id,
            subset,
            instruction,
            language,
            b64: _,
            mut obj,
        } = match entry {
            Ok(pending) => pending,
            Err(skipped) => {
                loaded.skipped.push(skipped);
                continue;
            }
        };
        let skip =
            |kind, reason: String| Skipped::new(id.clone(), kind, format!("item {n}: {reason}"));
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
        let (source, edited) = match images.expect("every pending item is checked") {
            Ok(images) => images,
            Err((kind, reason)) => {
                loaded.skipped.push(skip(kind, reason));
                continue;
            }
        };
        seen.insert((subset.clone(), id.clone()), n);
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

/// A scorer item's images, checked in the loader's order: `src_img_b64` present, decoded and a
/// readable image; the edited file found among [`scorer_edited_candidates`] and decoded in full.
/// Returns the source's encoded bytes and the edited image's path.
fn scorer_images(
    b64: Option<&str>,
    edited_dir: &Path,
    subset: &str,
    id: &str,
) -> std::result::Result<(Vec<u8>, PathBuf), (SkipKind, String)> {
    let Some(b64) = b64 else {
        return Err((
            SkipKind::MissingField,
            "field src_img_b64 is missing or empty; add the source image".into(),
        ));
    };
    let source = decode_b64_image(b64)?;
    let candidates = scorer_edited_candidates(edited_dir, subset, id);
    let Some(edited) = candidates.iter().find(|p| p.is_file()).cloned() else {
        return Err((
            SkipKind::MissingEdited,
            format!(
                "no edited image for pair id {id:?}: looked for {} and {} (also .jpg/.jpeg); add the edit",
                candidates[0].display(),
                edited_dir.join(id).display()
            ),
        ));
    };
    check_image_file(&edited, "edited", SkipKind::MissingEdited)?;
    Ok((source, edited))
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
/// (`task_type`, `key`) is skipped. A rows line that is not UTF-8, not JSON or lacks a field is
/// skipped as `line N` (whatever its language: it cannot be read to tell). Both images are
/// decoded in full up front. Judge with [`resize_to_source`] applied to the edit.
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
    let bytes = read_bytes(rows)?;
    // First the checks that need no image, in file order; the images of the rows that pass are
    // then decoded in parallel, and the results are taken in file order again.
    struct Pending {
        n: usize,
        task: String,
        key: String,
        instruction: String,
        source: PathBuf,
        edited: PathBuf,
        obj: Map<String, Value>,
    }
    let mut entries: Vec<std::result::Result<Pending, Skipped>> = Vec::new();
    for (n, line) in byte_lines(&bytes) {
        let line = match line_text(rows, n, line) {
            Ok(line) => line,
            Err(s) => {
                entries.push(Err(s));
                continue;
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        let label = format!("line {n}");
        let obj = match parse_object(line, n) {
            Ok(obj) => obj,
            Err(s) => {
                entries.push(Err(s));
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
            entries.push(Err(Skipped::new(
                label,
                SkipKind::MissingField,
                format!("line {n}: field(s) {} missing or empty; each row needs task_type, key, instruction, instruction_language", missing.join(", ")),
            )));
            continue;
        };
        if lang != language {
            continue;
        }
        if !GEDIT_GROUPS.contains(&task.as_str()) {
            entries.push(Err(Skipped::new(
                key,
                SkipKind::UnknownCategory,
                format!("line {n}: task_type {task:?} is not one of GEdit-Bench's 11 groups {GEDIT_GROUPS:?}; fix the row"),
            )));
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
        entries.push(Ok(Pending {
            n,
            task,
            key,
            instruction,
            source,
            edited,
            obj,
        }));
    }
    let checks = par_map(&entries, |entry| {
        entry
            .as_ref()
            .ok()
            .map(|p| check_image_pair(&p.source, &p.edited))
    });
    let mut loaded = Loaded::default();
    let mut seen: HashMap<(String, String), usize> = HashMap::new();
    for (entry, check) in entries.into_iter().zip(checks) {
        let Pending {
            n,
            task,
            key,
            instruction,
            source,
            edited,
            mut obj,
        } = match entry {
            Ok(pending) => pending,
            Err(skipped) => {
                loaded.skipped.push(skipped);
                continue;
            }
        };
        let skip =
            |kind, reason: String| Skipped::new(key.clone(), kind, format!("line {n}: {reason}"));
        if let Some(first) = seen.get(&(task.clone(), key.clone())) {
            loaded.skipped.push(skip(
                SkipKind::DuplicateId,
                format!("key {key:?} in {task} repeats line {first}; keys are unique per task group and language"),
            ));
            continue;
        }
        if let Err((kind, reason)) = check.expect("every pending row is checked") {
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
/// Blank lines are ignored. A line that is not UTF-8 (named with the offset of its first bad
/// byte), is not JSON or lacks a field is skipped as `line N` with the reason; a missing image,
/// or one that does not decode in full, skips the item. Two lines with the same `id` are an
/// error naming both lines (checked before any other validation of the second line).
pub fn load_jsonl(path: &Path, base: &Path) -> Result<Loaded> {
    let bytes = read_bytes(path)?;
    // First the checks that need no image, in file order; the images of the lines that pass are
    // then decoded in parallel, and the results are taken in file order again.
    let mut entries: Vec<std::result::Result<(usize, Item), Skipped>> = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (n, line) in byte_lines(&bytes) {
        let line = match line_text(path, n, line) {
            Ok(line) => line,
            Err(s) => {
                entries.push(Err(s));
                continue;
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        let mut obj = match parse_object(line, n) {
            Ok(obj) => obj,
            Err(s) => {
                entries.push(Err(s));
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
            entries.push(Err(Skipped::new(
                format!("line {n}"),
                SkipKind::MissingField,
                format!(
                    "line {n}: field(s) {} missing, empty or not a string; each line needs {}",
                    missing.join(", "),
                    fields.join(", ")
                ),
            )));
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
        entries.push(Ok((
            n,
            Item {
                id,
                category,
                instruction,
                source: ImageRef::Path(base.join(source)),
                edited: ImageRef::Path(base.join(edited)),
                language,
                extra: obj,
            },
        )));
    }
    let checks = par_map(&entries, |entry| match entry {
        Ok((_, item)) => match (&item.source, &item.edited) {
            (ImageRef::Path(source), ImageRef::Path(edited)) => check_image_pair(source, edited),
            _ => unreachable!("JSONL images are paths"),
        },
        Err(_) => Ok(()),
    });
    let mut loaded = Loaded::default();
    for (entry, check) in entries.into_iter().zip(checks) {
        match (entry, check) {
            (Err(skipped), _) => loaded.skipped.push(skipped),
            (Ok((_, item)), Ok(())) => loaded.items.push(item),
            (Ok((n, item)), Err((kind, reason))) => {
                loaded
                    .skipped
                    .push(Skipped::new(item.id, kind, format!("line {n}: {reason}")));
            }
        }
    }
    finish(path, loaded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_lines_drop_crlf_and_number_from_one() {
        let lines: Vec<(usize, &[u8])> = byte_lines(b"a\r\n\nb\xFF\nc").collect();
        assert_eq!(lines, [(1, &b"a"[..]), (2, b""), (3, b"b\xFF"), (4, b"c")]);
        let s = line_text(Path::new("f.jsonl"), 3, lines[2].1).unwrap_err();
        assert_eq!((s.id.as_str(), s.kind), ("line 3", SkipKind::NotUtf8));
        assert!(s.reason.contains("0xFF at byte offset 1"), "{}", s.reason);
    }

    #[test]
    fn utf8_document_names_line_and_column() {
        let err = utf8_document(Path::new("x.json"), b"[\n  \"ab\xC3(\"\n]").unwrap_err();
        match err {
            Error::NotUtf8 {
                offset,
                line,
                column,
                byte,
                ..
            } => assert_eq!((offset, line, column, byte), (7, 2, 6, 0xC3)),
            other => panic!("expected NotUtf8, got {other}"),
        }
        assert_eq!(utf8_document(Path::new("x.json"), b"[1]").unwrap(), "[1]");
    }
}
