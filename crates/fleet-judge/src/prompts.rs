//! Prompt sets: what the judge is asked, from TOML (`configs/judge/*.toml`).
//!
//! A prompt set has a `name`, a `version`, a `scheme` and one or more *calls* (requests per
//! item), each with the images the judge sees (`images`, in order; default
//! `["source", "edited"]`) and its templates, per category or a `default`:
//!
//! ```toml
//! name = "original-rubrics"
//! version = 1
//! scheme = "single"            # one call, `score`: a reply "Score: X" on 0-10
//! max_new_tokens = 128         # optional: the decoding length the set was written for
//! score_labels = ["Score"]     # single only: the labels a score may follow
//!
//! [categories]                 # optional: item category -> template name
//! "物理" = "physical"
//!
//! [calls.score]
//! images = ["edited"]
//! [calls.score.templates.physical]
//! system = "..."               # optional
//! user = "... {instruction} ... {description} ... {category} ..."
//! ```
//!
//! Schemes ([`Scheme`]):
//! - `single` — exactly one call, `score`; its reply is `Score: X` with X in [0, 10]
//!   (the original scorer's per-category rubrics, `configs/judge/original-rubrics.toml`).
//! - `viescore` — exactly two calls, `sc` (semantic consistency) and `pq` (perceptual quality),
//!   each replying a JSON object whose `score` is a list of `scores` numbers on 0-10
//!   (VIEScore as GEdit-Bench runs it, `configs/judge/viescore.toml`).
//!
//! The template for an item's category is `templates[categories[category]]`, else
//! `templates[category]`, else `templates.default`.
//!
//! Placeholders are Python `str.format` style: `{instruction}` (the edit instruction),
//! `{description}` (the original image's description, `Item.extra["description"]`, which the
//! scorer JSON loader fills from `original_description(_en)`), `{category}` (the item's
//! category as loaded). `{{` and `}}` are literal braces. Every template is checked at load
//! ([`PromptSet::load`]): an unknown placeholder or a lone brace is an error naming the file,
//! the template and the placeholder; [`PromptSet::check_items`] then refuses a benchmark whose
//! items cannot fill a placeholder (no description) or have no template.
//!
//! A set's identity is its content hash ([`PromptSet::hash`]): sha256 over its normalized form
//! (the parsed set as canonical JSON, so comments, whitespace, key order and spelled-out
//! defaults do not change it). It is part of every record's key.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::benchmark::Item;
use crate::parse::ReplyFormat;

/// The placeholders a template may use.
pub const PLACEHOLDERS: [&str; 3] = ["instruction", "description", "category"];

/// The template used for categories that have no template of their own.
pub const DEFAULT_TEMPLATE: &str = "default";

/// Errors of prompt sets. Each names the file and the field or template at fault.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The file cannot be read.
    #[error("cannot read prompt set {path}: {source}; check the path (the shipped sets are in configs/judge/)")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not valid TOML or has fields of the wrong type or unknown fields.
    #[error("prompt set {path} does not parse: {message}; compare with configs/judge/original-rubrics.toml")]
    Toml {
        /// The file.
        path: PathBuf,
        /// The parser's message (line, column, field).
        message: String,
    },
    /// A field has a value that cannot work.
    #[error("prompt set {path}: {field} {problem}")]
    BadField {
        /// The file.
        path: PathBuf,
        /// The field (`name`, `calls.sc.images`, ...).
        field: String,
        /// What is wrong and what to write instead.
        problem: String,
    },
    /// The calls do not match the scheme.
    #[error("prompt set {path}: scheme {scheme} needs exactly the call(s) {expected:?}, found {found:?}; rename or add the [calls.<name>] tables")]
    CallsForScheme {
        /// The file.
        path: PathBuf,
        /// The scheme.
        scheme: Scheme,
        /// The calls the scheme needs.
        expected: Vec<&'static str>,
        /// The calls found.
        found: Vec<String>,
    },
    /// A template names a placeholder that does not exist.
    #[error("prompt set {path}: template {template} uses the unknown placeholder {{{placeholder}}}; the placeholders are {{instruction}}, {{description}}, {{category}} (write {{{{ and }}}} for literal braces)")]
    UnknownPlaceholder {
        /// The file.
        path: PathBuf,
        /// The template (`calls.score.templates.physical.user`).
        template: String,
        /// The placeholder's name as written.
        placeholder: String,
    },
    /// A brace that opens or closes nothing.
    #[error("prompt set {path}: template {template} has a lone `{brace}` at byte {offset} (near {near:?}); write {{{{ or }}}} for a literal brace, or {{name}} for a placeholder")]
    LoneBrace {
        /// The file.
        path: PathBuf,
        /// The template.
        template: String,
        /// The brace.
        brace: char,
        /// Byte offset in the template text.
        offset: usize,
        /// The text around it.
        near: String,
    },
    /// A benchmark item cannot fill a placeholder.
    #[error("prompt set {path}: template {template} uses {{{placeholder}}}, which item {item:?} cannot fill: {why}; use a prompt set without it, or a benchmark that has it")]
    Unfillable {
        /// The file.
        path: PathBuf,
        /// The template.
        template: String,
        /// The placeholder.
        placeholder: String,
        /// The first item that cannot fill it.
        item: String,
        /// Why (with the item's category).
        why: String,
    },
    /// No template for an item's category.
    #[error("prompt set {path}: call {call} has no template for category {category:?} (item {item:?}); add [calls.{call}.templates.default], a template named like the category, or map the category in [categories]; templates there: {available:?}")]
    NoTemplate {
        /// The file.
        path: PathBuf,
        /// The call.
        call: String,
        /// The category.
        category: String,
        /// The first item of that category.
        item: String,
        /// The call's templates.
        available: Vec<String>,
    },
}

/// Result of this module.
pub type Result<T, E = PromptError> = std::result::Result<T, E>;

/// How replies are asked for and combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheme {
    /// One call, `score`: `Score: X` on 0-10.
    Single,
    /// VIEScore: calls `sc` and `pq`, each a list of scores on 0-10; SC = min, PQ = min,
    /// O = sqrt(SC x PQ).
    Viescore,
}

impl Scheme {
    /// The calls this scheme makes per item, in order.
    pub fn calls(self) -> &'static [&'static str] {
        match self {
            Scheme::Single => &["score"],
            Scheme::Viescore => &["sc", "pq"],
        }
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Scheme::Single => "single",
            Scheme::Viescore => "viescore",
        })
    }
}

/// An image the judge can be shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageRole {
    /// The image before the edit.
    Source,
    /// The edited image.
    Edited,
}

/// One template: an optional system text and the user text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Template {
    /// The system message (none when absent).
    #[serde(default)]
    pub system: Option<String>,
    /// The user message's text (after the images).
    pub user: String,
}

/// One request per item: its images, reply format and templates.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Call {
    /// The call's name (`score`, `sc`, `pq`).
    pub name: String,
    /// The images shown, in order, before the text.
    pub images: Vec<ImageRole>,
    /// How its reply is parsed.
    pub format: ReplyFormat,
    /// Templates by name (a category, a mapped name, or `default`).
    pub templates: BTreeMap<String, Template>,
}

/// A validated prompt set.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptSet {
    /// The set's name.
    pub name: String,
    /// Its version (bump it when the texts change).
    pub version: u32,
    /// The scheme.
    pub scheme: Scheme,
    /// What it is, for reports.
    pub description: Option<String>,
    /// The reply length the set was written for (a default for the run's decoding).
    pub max_new_tokens: Option<usize>,
    /// Item category -> template name.
    pub categories: BTreeMap<String, String>,
    /// The calls, in the scheme's order.
    pub calls: Vec<Call>,
    /// The file it was read from (for messages; not part of the hash).
    pub path: PathBuf,
    hash: String,
}

/// What identifies a prompt set in records and reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptSetId {
    /// Its name.
    pub name: String,
    /// Its version.
    pub version: u32,
    /// Its content hash (sha256 hex of the normalized set).
    pub hash: String,
}

/// The TOML file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptFile {
    name: String,
    version: u32,
    scheme: Scheme,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    max_new_tokens: Option<usize>,
    #[serde(default)]
    score_labels: Option<Vec<String>>,
    #[serde(default)]
    categories: BTreeMap<String, String>,
    #[serde(default)]
    calls: BTreeMap<String, CallFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CallFile {
    #[serde(default)]
    images: Option<Vec<ImageRole>>,
    #[serde(default)]
    scores: Option<usize>,
    #[serde(default)]
    templates: BTreeMap<String, Template>,
}

/// The normalized form that is hashed.
#[derive(Serialize)]
struct Normalized<'a> {
    name: &'a str,
    version: u32,
    scheme: Scheme,
    description: &'a Option<String>,
    max_new_tokens: Option<usize>,
    categories: &'a BTreeMap<String, String>,
    calls: &'a [Call],
}

/// A piece of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment<'a> {
    Text(&'a str),
    Brace(char),
    Placeholder(&'a str),
}

/// Splits a template into text, escaped braces and placeholders; `Err((brace, offset))` at a
/// lone brace.
fn segments(text: &str) -> std::result::Result<Vec<Segment<'_>>, (char, usize)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' if bytes.get(i + 1) == Some(&b'{') => {
                out.push(Segment::Text(&text[start..i]));
                out.push(Segment::Brace('{'));
                i += 2;
                start = i;
            }
            b'}' if bytes.get(i + 1) == Some(&b'}') => {
                out.push(Segment::Text(&text[start..i]));
                out.push(Segment::Brace('}'));
                i += 2;
                start = i;
            }
            b'{' => {
                let Some(len) = text[i + 1..].find(['}', '{']) else {
                    return Err(('{', i));
                };
                if bytes[i + 1 + len] == b'{' {
                    return Err(('{', i));
                }
                out.push(Segment::Text(&text[start..i]));
                out.push(Segment::Placeholder(&text[i + 1..i + 1 + len]));
                i += len + 2;
                start = i;
            }
            b'}' => return Err(('}', i)),
            _ => i += 1,
        }
    }
    out.push(Segment::Text(&text[start..]));
    Ok(out)
}

fn near(text: &str, offset: usize) -> String {
    let lo = text[..offset]
        .char_indices()
        .rev()
        .nth(15)
        .map_or(0, |(i, _)| i);
    let hi = text[offset..]
        .char_indices()
        .nth(16)
        .map_or(text.len(), |(i, _)| offset + i);
    text[lo..hi].to_string()
}

/// The placeholders a template text uses, checked to be known.
fn placeholders_of(path: &Path, template: &str, text: &str) -> Result<BTreeSet<String>> {
    let segs = segments(text).map_err(|(brace, offset)| PromptError::LoneBrace {
        path: path.to_path_buf(),
        template: template.to_string(),
        brace,
        offset,
        near: near(text, offset),
    })?;
    let mut out = BTreeSet::new();
    for s in segs {
        if let Segment::Placeholder(name) = s {
            if !PLACEHOLDERS.contains(&name) {
                return Err(PromptError::UnknownPlaceholder {
                    path: path.to_path_buf(),
                    template: template.to_string(),
                    placeholder: name.to_string(),
                });
            }
            out.insert(name.to_string());
        }
    }
    Ok(out)
}

impl PromptSet {
    /// Reads and validates a prompt set file (see the module docs).
    pub fn load(path: &Path) -> Result<PromptSet> {
        let text = std::fs::read_to_string(path).map_err(|source| PromptError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Parses and validates a prompt set from TOML text; `path` names it in messages.
    pub fn from_toml(text: &str, path: &Path) -> Result<PromptSet> {
        let file: PromptFile = toml::from_str(text).map_err(|e| PromptError::Toml {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let bad = |field: &str, problem: String| PromptError::BadField {
            path: path.to_path_buf(),
            field: field.to_string(),
            problem,
        };
        if file.name.trim().is_empty() {
            return Err(bad("name", "is empty; give the set a name".into()));
        }
        if file.max_new_tokens == Some(0) {
            return Err(bad(
                "max_new_tokens",
                "is 0; a reply needs at least one token (128 for `Score: X`)".into(),
            ));
        }
        let expected = file.scheme.calls();
        let found: Vec<String> = file.calls.keys().cloned().collect();
        if found.len() != expected.len() || expected.iter().any(|c| !file.calls.contains_key(*c)) {
            return Err(PromptError::CallsForScheme {
                path: path.to_path_buf(),
                scheme: file.scheme,
                expected: expected.to_vec(),
                found,
            });
        }
        let labels = match (&file.scheme, file.score_labels) {
            (Scheme::Single, None) => vec!["Score".to_string()],
            (Scheme::Single, Some(l)) => {
                if l.is_empty() || l.iter().any(|s| s.trim().is_empty()) {
                    return Err(bad(
                        "score_labels",
                        "must list at least one non-empty label (default [\"Score\"])".into(),
                    ));
                }
                l
            }
            (Scheme::Viescore, Some(_)) => {
                return Err(bad(
                    "score_labels",
                    "applies to scheme single only; remove it (viescore replies are JSON)".into(),
                ))
            }
            (Scheme::Viescore, None) => Vec::new(),
        };
        let mut calls_in = file.calls;
        let mut calls = Vec::new();
        for &name in expected {
            let Some(c) = calls_in.remove(name) else {
                unreachable!("checked above");
            };
            let field = |f: &str| format!("calls.{name}.{f}");
            let images = c
                .images
                .unwrap_or_else(|| vec![ImageRole::Source, ImageRole::Edited]);
            if images.is_empty() {
                return Err(bad(
                    &field("images"),
                    "is empty; list \"source\" and/or \"edited\"".into(),
                ));
            }
            let distinct: BTreeSet<_> = images.iter().collect();
            if distinct.len() != images.len() {
                return Err(bad(
                    &field("images"),
                    format!("{images:?} repeats an image; list each once"),
                ));
            }
            let format = match file.scheme {
                Scheme::Single => {
                    if c.scores.is_some() {
                        return Err(bad(
                            &field("scores"),
                            "applies to scheme viescore only; remove it".into(),
                        ));
                    }
                    ReplyFormat::ScoreLine {
                        labels: labels.clone(),
                    }
                }
                Scheme::Viescore => match c.scores {
                    Some(0) => {
                        return Err(bad(
                            &field("scores"),
                            "is 0; give the length of the score list the prompt asks for (2 in VIEScore)".into(),
                        ))
                    }
                    Some(n) => ReplyFormat::ScoreList { len: n },
                    None => {
                        return Err(bad(
                            &field("scores"),
                            "is missing; give the length of the score list the prompt asks for (2 in VIEScore)".into(),
                        ))
                    }
                },
            };
            if c.templates.is_empty() {
                return Err(bad(
                    &field("templates"),
                    "is empty; add [calls.<call>.templates.default] with a user text".into(),
                ));
            }
            for (tname, t) in &c.templates {
                let base = format!("calls.{name}.templates.{tname}");
                if t.user.trim().is_empty() {
                    return Err(bad(&format!("{base}.user"), "is empty".into()));
                }
                placeholders_of(path, &format!("{base}.user"), &t.user)?;
                if let Some(s) = &t.system {
                    placeholders_of(path, &format!("{base}.system"), s)?;
                }
            }
            calls.push(Call {
                name: name.to_string(),
                images,
                format,
                templates: c.templates,
            });
        }
        for (category, target) in &file.categories {
            for c in &calls {
                if !c.templates.contains_key(target) {
                    return Err(bad(
                        &format!("categories.{category:?}"),
                        format!(
                            "maps to template {target:?}, which call {} does not have (it has {:?}); add [calls.{}.templates.{target}] or fix the name",
                            c.name,
                            c.templates.keys().collect::<Vec<_>>(),
                            c.name
                        ),
                    ));
                }
            }
        }
        let mut set = PromptSet {
            name: file.name,
            version: file.version,
            scheme: file.scheme,
            description: file.description,
            max_new_tokens: file.max_new_tokens,
            categories: file.categories,
            calls,
            path: path.to_path_buf(),
            hash: String::new(),
        };
        set.hash = set.compute_hash();
        Ok(set)
    }

    fn compute_hash(&self) -> String {
        let normalized = Normalized {
            name: &self.name,
            version: self.version,
            scheme: self.scheme,
            description: &self.description,
            max_new_tokens: self.max_new_tokens,
            categories: &self.categories,
            calls: &self.calls,
        };
        let bytes = serde_json::to_vec(&normalized).unwrap_or_default();
        hex(&Sha256::digest(&bytes))
    }

    /// The content hash: sha256 (hex) of the normalized set.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// Name, version and hash, for records and reports.
    pub fn id(&self) -> PromptSetId {
        PromptSetId {
            name: self.name.clone(),
            version: self.version,
            hash: self.hash.clone(),
        }
    }

    /// The name of the template `call` uses for `category` (see the module docs), if any.
    pub fn template_name(&self, call: &Call, category: &str) -> Option<String> {
        let mapped = self
            .categories
            .get(category)
            .map(String::as_str)
            .unwrap_or(category);
        [mapped, DEFAULT_TEMPLATE]
            .into_iter()
            .find(|n| call.templates.contains_key(*n))
            .map(str::to_string)
    }

    /// A display label for a category: `物理 (physical)` when the set maps it to a template of
    /// another name, else the category.
    pub fn category_label(&self, category: &str) -> String {
        match self.categories.get(category) {
            Some(t) if t != category => format!("{category} ({t})"),
            _ => category.to_string(),
        }
    }

    /// An ASCII-friendly label for charts (the embedded font has no CJK glyphs): the mapped
    /// template name when the category is mapped, else the category.
    pub fn chart_label(&self, category: &str) -> String {
        self.categories
            .get(category)
            .cloned()
            .unwrap_or_else(|| category.to_string())
    }

    /// Checks that every item has a template in every call and can fill its placeholders.
    /// The first problem is the error (naming the file, template, placeholder and item).
    pub fn check_items(&self, items: &[Item]) -> Result<()> {
        for call in &self.calls {
            // Placeholders per template, computed once.
            let mut used: BTreeMap<&str, Vec<(String, BTreeSet<String>)>> = BTreeMap::new();
            for (tname, t) in &call.templates {
                let base = format!("calls.{}.templates.{tname}", call.name);
                let mut parts = vec![(
                    format!("{base}.user"),
                    placeholders_of(&self.path, &base, &t.user)?,
                )];
                if let Some(s) = &t.system {
                    parts.push((
                        format!("{base}.system"),
                        placeholders_of(&self.path, &base, s)?,
                    ));
                }
                used.insert(tname.as_str(), parts);
            }
            for item in items {
                let Some(tname) = self.template_name(call, &item.category) else {
                    return Err(PromptError::NoTemplate {
                        path: self.path.clone(),
                        call: call.name.clone(),
                        category: item.category.clone(),
                        item: item.id.clone(),
                        available: call.templates.keys().cloned().collect(),
                    });
                };
                for (template, names) in &used[tname.as_str()] {
                    for name in names {
                        if let Err(why) = fill_value(name, item) {
                            return Err(PromptError::Unfillable {
                                path: self.path.clone(),
                                template: template.clone(),
                                placeholder: name.clone(),
                                item: item.id.clone(),
                                why: format!("(category {:?}) {why}", item.category),
                            });
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The system and user texts of `call` for `item`.
    pub fn render(&self, call: &Call, item: &Item) -> Result<(Option<String>, String)> {
        let Some(tname) = self.template_name(call, &item.category) else {
            return Err(PromptError::NoTemplate {
                path: self.path.clone(),
                call: call.name.clone(),
                category: item.category.clone(),
                item: item.id.clone(),
                available: call.templates.keys().cloned().collect(),
            });
        };
        let t = &call.templates[&tname];
        let base = format!("calls.{}.templates.{tname}", call.name);
        let user = self.fill(&format!("{base}.user"), &t.user, item)?;
        let system = match &t.system {
            Some(s) => Some(self.fill(&format!("{base}.system"), s, item)?),
            None => None,
        };
        Ok((system, user))
    }

    fn fill(&self, template: &str, text: &str, item: &Item) -> Result<String> {
        let segs = segments(text).map_err(|(brace, offset)| PromptError::LoneBrace {
            path: self.path.clone(),
            template: template.to_string(),
            brace,
            offset,
            near: near(text, offset),
        })?;
        let mut out = String::with_capacity(text.len() + 256);
        for s in segs {
            match s {
                Segment::Text(t) => out.push_str(t),
                Segment::Brace(c) => out.push(c),
                Segment::Placeholder(name) => {
                    if !PLACEHOLDERS.contains(&name) {
                        return Err(PromptError::UnknownPlaceholder {
                            path: self.path.clone(),
                            template: template.to_string(),
                            placeholder: name.to_string(),
                        });
                    }
                    let value = fill_value(name, item).map_err(|why| PromptError::Unfillable {
                        path: self.path.clone(),
                        template: template.to_string(),
                        placeholder: name.to_string(),
                        item: item.id.clone(),
                        why: format!("(category {:?}) {why}", item.category),
                    })?;
                    out.push_str(value);
                }
            }
        }
        Ok(out)
    }

    /// The call named `name`.
    pub fn call(&self, name: &str) -> Option<&Call> {
        self.calls.iter().find(|c| c.name == name)
    }

    /// The same set with every call showing `images`, in this order, instead of its own (a
    /// command line's `--images`). The content hash changes with it, so records made with
    /// other images are never reused. `images` must be non-empty without repeats.
    pub fn with_images(mut self, images: &[ImageRole]) -> Result<PromptSet> {
        let distinct: BTreeSet<_> = images.iter().collect();
        if images.is_empty() || distinct.len() != images.len() {
            return Err(PromptError::BadField {
                path: self.path.clone(),
                field: "images (override)".into(),
                problem: format!("{images:?} must list \"source\" and/or \"edited\", each once"),
            });
        }
        for c in &mut self.calls {
            c.images = images.to_vec();
        }
        self.hash = self.compute_hash();
        Ok(self)
    }
}

/// The value of a placeholder for an item, or why there is none.
fn fill_value<'a>(name: &str, item: &'a Item) -> std::result::Result<&'a str, String> {
    match name {
        "instruction" => Ok(&item.instruction),
        "category" => Ok(&item.category),
        "description" => match item.extra.get("description") {
            Some(serde_json::Value::String(s)) if !s.trim().is_empty() => Ok(s),
            Some(_) => Err("its description is empty or not text".into()),
            None => Err(
                "it has no description (the scorer JSON's original_description_en / \
                 original_description; GEdit-Bench and plain JSONL items have none unless a \
                 `description` field is given)"
                    .into(),
            ),
        },
        other => Err(format!("{{{other}}} is not a placeholder")),
    }
}

/// Lower-case hex of bytes.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::benchmark::ImageRef;

    fn item(category: &str, description: Option<&str>) -> Item {
        let mut extra = serde_json::Map::new();
        if let Some(d) = description {
            extra.insert("description".into(), d.into());
        }
        Item {
            id: "p1".into(),
            category: category.into(),
            instruction: "make the {car} blue".into(),
            source: ImageRef::Bytes(Vec::new()),
            edited: ImageRef::Bytes(Vec::new()),
            language: None,
            extra,
        }
    }

    const SINGLE: &str = r#"
name = "t"
version = 1
scheme = "single"
[categories]
"物理" = "physical"
[calls.score]
images = ["edited"]
[calls.score.templates.physical]
system = "rubric for {category}"
user = "Describe: {description}\nEdit: {instruction}\nJSON: {{\"a\": 1}}"
[calls.score.templates.default]
user = "Edit: {instruction}"
"#;

    fn load(text: &str) -> Result<PromptSet> {
        PromptSet::from_toml(text, Path::new("judge/t.toml"))
    }

    #[test]
    fn renders_placeholders_and_escaped_braces() {
        let set = load(SINGLE).unwrap();
        let call = &set.calls[0];
        assert_eq!(call.images, vec![ImageRole::Edited]);
        let (system, user) = set.render(call, &item("物理", Some("a red car"))).unwrap();
        assert_eq!(system.as_deref(), Some("rubric for 物理"));
        // The instruction's own braces are inserted as they are.
        assert_eq!(
            user,
            "Describe: a red car\nEdit: make the {car} blue\nJSON: {\"a\": 1}"
        );
        let (system, user) = set.render(call, &item("other", None)).unwrap();
        assert_eq!(system, None);
        assert_eq!(user, "Edit: make the {car} blue");
        assert_eq!(set.category_label("物理"), "物理 (physical)");
        assert_eq!(set.chart_label("物理"), "physical");
    }

    #[test]
    fn an_unknown_placeholder_is_named_with_file_and_template() {
        let text = SINGLE.replace("Edit: {instruction}\"", "Edit: {instuction}\"");
        let err = load(&text).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(&err, PromptError::UnknownPlaceholder { placeholder, template, .. }
                if placeholder == "instuction" && template == "calls.score.templates.default.user"),
            "{msg}"
        );
        assert!(
            msg.contains("judge/t.toml") && msg.contains("{instuction}"),
            "{msg}"
        );
    }

    #[test]
    fn a_lone_brace_is_refused() {
        for bad in ["a { b", "a } b", "a {x{y} b", "tail {"] {
            let text = SINGLE.replace("Edit: {instruction}\"", &format!("{bad}\""));
            let err = load(&text).unwrap_err();
            assert!(matches!(err, PromptError::LoneBrace { .. }), "{bad}: {err}");
            assert!(err.to_string().contains("{{"), "{err}");
        }
    }

    #[test]
    fn items_that_cannot_fill_a_placeholder_are_refused_before_running() {
        let set = load(SINGLE).unwrap();
        set.check_items(&[item("物理", Some("d")), item("x", None)])
            .unwrap();
        let err = set.check_items(&[item("物理", None)]).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(&err, PromptError::Unfillable { placeholder, template, item, .. }
                if placeholder == "description" && template == "calls.score.templates.physical.user" && item == "p1"),
            "{msg}"
        );
    }

    #[test]
    fn a_category_without_template_is_refused() {
        let text = SINGLE.replace(
            "[calls.score.templates.default]\nuser = \"Edit: {instruction}\"",
            "",
        );
        let set = load(&text).unwrap();
        let err = set.check_items(&[item("环境", None)]).unwrap_err();
        assert!(matches!(err, PromptError::NoTemplate { .. }), "{err}");
        assert!(err.to_string().contains("环境"), "{err}");
    }

    #[test]
    fn calls_must_match_the_scheme() {
        let text = SINGLE.replace("[calls.score", "[calls.rate");
        let err = load(&text).unwrap_err();
        assert!(matches!(err, PromptError::CallsForScheme { .. }), "{err}");
        let vie = r#"
name = "v"
version = 1
scheme = "viescore"
[calls.sc.templates.default]
user = "{instruction}"
[calls.pq]
scores = 2
[calls.pq.templates.default]
user = "q"
"#;
        let err = load(vie).unwrap_err();
        assert!(err.to_string().contains("calls.sc.scores"), "{err}");
    }

    #[test]
    fn unknown_fields_and_bad_images_are_refused() {
        let err = load(&SINGLE.replace("version = 1", "version = 1\nmodel = \"x\"")).unwrap_err();
        assert!(matches!(err, PromptError::Toml { .. }), "{err}");
        let err = load(&SINGLE.replace("[\"edited\"]", "[\"edited\", \"mask\"]")).unwrap_err();
        assert!(err.to_string().contains("mask"), "{err}");
        let err = load(&SINGLE.replace("[\"edited\"]", "[\"edited\", \"edited\"]")).unwrap_err();
        assert!(err.to_string().contains("calls.score.images"), "{err}");
        let err =
            load(&SINGLE.replace("\"物理\" = \"physical\"", "\"物理\" = \"phys\"")).unwrap_err();
        assert!(err.to_string().contains("phys"), "{err}");
    }

    #[test]
    fn the_hash_ignores_layout_and_defaults_but_not_text() {
        let a = load(SINGLE).unwrap();
        let reordered = format!(
            "# a comment\nscheme = \"single\"\nversion = 1\n{}",
            SINGLE
                .replace("scheme = \"single\"\n", "")
                .replace("version = 1\n", "")
        );
        let b = load(&reordered).unwrap();
        assert_eq!(a.hash(), b.hash());
        let with_default = SINGLE.replace(
            "scheme = \"single\"",
            "scheme = \"single\"\nscore_labels = [\"Score\"]",
        );
        assert_eq!(load(&with_default).unwrap().hash(), a.hash());
        let changed = SINGLE.replace("rubric for", "Rubric for");
        assert_ne!(load(&changed).unwrap().hash(), a.hash());
        assert_eq!(a.hash().len(), 64);
    }

    #[test]
    fn the_shipped_sets_load() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/judge");
        let orig = PromptSet::load(&root.join("original-rubrics.toml")).unwrap();
        assert_eq!(orig.scheme, Scheme::Single);
        assert_eq!(orig.calls[0].images, vec![ImageRole::Edited]);
        for zh in ["物理", "环境", "社会", "因果", "指代"] {
            let t = orig.template_name(&orig.calls[0], zh).unwrap();
            assert_ne!(t, DEFAULT_TEMPLATE, "{zh}");
            let (system, user) = orig
                .render(&orig.calls[0], &item(zh, Some("a red car")))
                .unwrap();
            assert!(system.unwrap().contains("Score: X.XXX"));
            assert!(user.contains("- Original Description: a red car\n"));
            assert!(user.contains("- Edit Instruction: make the {car} blue\n"));
            assert!(user.ends_with("Score: X.XXX\n"), "{user:?}");
        }
        let vie = PromptSet::load(&root.join("viescore.toml")).unwrap();
        assert_eq!(vie.scheme, Scheme::Viescore);
        let sc = vie.call("sc").unwrap();
        let pq = vie.call("pq").unwrap();
        assert_eq!(sc.images, vec![ImageRole::Source, ImageRole::Edited]);
        assert_eq!(pq.images, vec![ImageRole::Edited]);
        let (system, user) = vie.render(sc, &item("color_alter", None)).unwrap();
        assert_eq!(system, None);
        assert!(user.contains("{\n\"score\" : [...],\n\"reasoning\" : \"...\"\n}\nRULES:"));
        assert!(user.ends_with("Editing instruction: make the {car} blue\n"));
        assert!(
            user.contains("From scale 0 to 10: \n"),
            "trailing space kept"
        );
        let (_, user) = vie.render(pq, &item("color_alter", None)).unwrap();
        assert!(user.ends_with("output score = [naturalness, artifacts]\n"));
        vie.check_items(&[item("anything", None)]).unwrap();
    }

    #[test]
    fn an_images_override_changes_every_call_and_the_hash() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/judge");
        let orig = PromptSet::load(&root.join("original-rubrics.toml")).unwrap();
        let both = orig
            .clone()
            .with_images(&[ImageRole::Source, ImageRole::Edited])
            .unwrap();
        assert_eq!(
            both.calls[0].images,
            vec![ImageRole::Source, ImageRole::Edited]
        );
        assert_ne!(both.hash(), orig.hash());
        let again = both.clone().with_images(&[ImageRole::Edited]).unwrap();
        assert_eq!(again.hash(), orig.hash(), "the hash is of the content");
        for bad in [&[][..], &[ImageRole::Edited, ImageRole::Edited][..]] {
            let e = orig.clone().with_images(bad).unwrap_err().to_string();
            assert!(e.contains("images"), "{e}");
        }
    }
}
