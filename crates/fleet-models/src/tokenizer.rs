//! The checkpoint's tokenizer (`tokenizer.json`) and chat template (`tokenizer_config.json`),
//! rendered by a real Jinja engine the way transformers' `apply_chat_template` renders it.

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// A tokenizer loaded from `tokenizer.json`.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl TextTokenizer {
    /// Loads `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| ModelError::Tokenizer {
            path: path.to_path_buf(),
            message: format!("cannot load: {e}"),
        })?;
        Ok(TextTokenizer {
            inner,
            path: path.to_path_buf(),
        })
    }

    /// Token ids of `text`. Special-token strings in the text (e.g. `<|im_start|>`) become
    /// their ids; no BOS/EOS is added (Qwen adds none), as transformers does for a rendered
    /// chat template.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; special tokens are dropped when `skip_special` is set.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| ModelError::Tokenizer {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }

    /// The id of a token string such as `<|im_end|>`.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
    /// Further fields templates read, as in transformers' message dicts: `tool_calls`,
    /// `reasoning_content`, `name`, …
    #[serde(flatten, default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            extra: serde_json::Map::new(),
        }
    }
}

/// A checkpoint's chat template with the special tokens it may reference.
pub struct ChatTemplate {
    /// The template compiled once at load (compiling it per render dominated the cost of
    /// rendering many prompts).
    env: Environment<'static>,
    path: PathBuf,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// The fields of `tokenizer_config.json` that chat rendering needs.
#[derive(Deserialize)]
struct TokenizerConfigFile {
    chat_template: Option<serde_json::Value>,
    bos_token: Option<serde_json::Value>,
    eos_token: Option<serde_json::Value>,
}

/// `bos_token` may be a string, null, or an AddedToken object with a `content` field.
fn token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    /// Reads the template from `tokenizer_config.json` (a `chat_template.jinja` file beside it
    /// takes precedence, as in transformers 4.43+). `Ok(None)` when the checkpoint has none.
    pub fn from_tokenizer_config(path: &Path) -> Result<Option<Self>> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let cfg: TokenizerConfigFile =
            serde_json::from_str(&text).map_err(|e| ModelError::BadJson {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        let jinja_file = path.with_file_name("chat_template.jinja");
        let (source, from) = if jinja_file.is_file() {
            let s =
                std::fs::read_to_string(&jinja_file).map_err(|e| ModelError::io(&jinja_file, e))?;
            (s, jinja_file)
        } else {
            let s = match cfg.chat_template {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(serde_json::Value::String(s)) => s,
                // A list of named templates: take "default", as transformers does.
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template").and_then(|s| s.as_str()))
                    .map(str::to_string)
                    .ok_or_else(|| ModelError::BadJson {
                        path: path.to_path_buf(),
                        message: "`chat_template` is a list without a template named `default`"
                            .into(),
                    })?,
                Some(other) => {
                    return Err(ModelError::BadJson {
                        path: path.to_path_buf(),
                        message: format!("`chat_template` must be a string, found {other}"),
                    })
                }
            };
            (s, path.to_path_buf())
        };
        // Compiled now, so a broken template fails at load, naming the file.
        let env = Self::environment(source, &from)?;
        Ok(Some(ChatTemplate {
            env,
            path: from,
            bos_token: token_text(cfg.bos_token.as_ref()),
            eos_token: token_text(cfg.eos_token.as_ref()),
        }))
    }

    /// Reads a template file of its own: `chat_template.jinja` (the template itself) or a
    /// processor's `chat_template.json` (`{"chat_template": "..."}`). Bos/eos tokens come from
    /// `tokenizer_config` when given.
    pub fn from_file(path: &Path, tokenizer_config: Option<&Path>) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let source = if path.extension().is_some_and(|e| e == "json") {
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::BadJson {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
            v.get("chat_template")
                .and_then(|t| t.as_str())
                .map(str::to_string)
                .ok_or_else(|| ModelError::BadJson {
                    path: path.to_path_buf(),
                    message: "expected {\"chat_template\": \"...\"}".into(),
                })?
        } else {
            text
        };
        let (bos_token, eos_token) = match tokenizer_config {
            Some(tc) => {
                let t = std::fs::read_to_string(tc).map_err(|e| ModelError::io(tc, e))?;
                let cfg: TokenizerConfigFile =
                    serde_json::from_str(&t).map_err(|e| ModelError::BadJson {
                        path: tc.to_path_buf(),
                        message: e.to_string(),
                    })?;
                (
                    token_text(cfg.bos_token.as_ref()),
                    token_text(cfg.eos_token.as_ref()),
                )
            }
            None => (None, None),
        };
        let env = Self::environment(source, path)?;
        Ok(ChatTemplate {
            env,
            path: path.to_path_buf(),
            bos_token,
            eos_token,
        })
    }

    fn environment(source: String, path: &Path) -> Result<Environment<'static>> {
        let mut env = Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks on.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |fmt: String| -> String {
            strftime_now(&fmt)
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source)
            .map_err(|e| ModelError::ChatTemplate {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        Ok(env)
    }

    /// Renders `messages`. `add_generation_prompt` appends the assistant header; `extra` holds
    /// further template variables (e.g. `{"enable_thinking": false}` for Qwen3, `tools`).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let messages = serde_json::to_value(messages).expect("messages serialize");
        self.render_json(messages, add_generation_prompt, extra)
    }

    /// [`ChatTemplate::render`] of messages given as JSON, in transformers' message format:
    /// `content` may be a list of parts (`{"type": "image"}`, `{"type": "text", "text": …}`),
    /// as vision-language templates expect.
    pub fn render_json(
        &self,
        messages: serde_json::Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .expect("added in environment()");
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), messages);
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        ctx.insert(
            "bos_token".into(),
            self.bos_token.clone().unwrap_or_default().into(),
        );
        ctx.insert(
            "eos_token".into(),
            self.eos_token.clone().unwrap_or_default().into(),
        );
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(|e| ModelError::ChatTemplate {
                path: self.path.clone(),
                message: format!("{e:#}"),
            })
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False)` with optional indent, i.e.
/// Python's separators `", "` and `": "` and no HTML escaping (minijinja's own escapes `<`).
fn tojson(value: Value, indent: Option<usize>) -> std::result::Result<String, JinjaError> {
    let v: serde_json::Value = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&v, indent, 0, &mut out);
    Ok(out)
}

fn python_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                python_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).expect("string serializes"));
                out.push_str(": ");
                python_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).expect("json serializes")),
    }
}

/// The current UTC date/time formatted with the few strftime codes chat templates use.
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    fmt.replace("%Y", &format!("{y:04}"))
        .replace("%m", &format!("{m:02}"))
        .replace("%d", &format!("{d:02}"))
        .replace("%B", MONTHS[(m - 1) as usize])
        .replace("%b", &MONTHS[(m - 1) as usize][..3])
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (Howard Hinnant's method).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_matches_python() {
        let v =
            Value::from_serialize(serde_json::json!({"name": "f", "args": [1, "<a>"], "e": {}}));
        assert_eq!(
            tojson(v.clone(), None).unwrap(),
            r#"{"name": "f", "args": [1, "<a>"], "e": {}}"#
        );
        assert_eq!(
            tojson(v, Some(2)).unwrap(),
            "{\n  \"name\": \"f\",\n  \"args\": [\n    1,\n    \"<a>\"\n  ],\n  \"e\": {}\n}"
        );
    }

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_414), (2025, 11, 22));
    }

    #[test]
    fn broken_template_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokenizer_config.json");
        std::fs::write(
            &p,
            r#"{"chat_template": "{% for m in messages %}{{ m.content }"}"#,
        )
        .unwrap();
        let e = ChatTemplate::from_tokenizer_config(&p)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("tokenizer_config.json"), "{e}");
        std::fs::write(&p, r#"{"chat_template": null}"#).unwrap();
        assert!(ChatTemplate::from_tokenizer_config(&p).unwrap().is_none());
    }

    #[test]
    fn raise_exception_surfaces() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokenizer_config.json");
        std::fs::write(
            &p,
            r#"{"chat_template": "{{ raise_exception('roles must alternate') }}"}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_tokenizer_config(&p).unwrap().unwrap();
        let e = t
            .render(&[], true, &Default::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("roles must alternate"), "{e}");
    }
}
