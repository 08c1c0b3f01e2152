//! The components' prompts: Jinja templates in a TOML file (`configs/argo_prompts.toml`), not
//! in code. Each renders the user message of one call; the model's own chat template then
//! turns `system` + that message into tokens.
//!
//! Every template sees the same variables:
//!
//! | name | what |
//! |---|---|
//! | `question` | the question text |
//! | `options` | list of `{label, text}` (labels `1`..`N`) |
//! | `notes` | the Reasoner's notes so far, oldest first |
//! | `evidence` | retrieved chunks so far: `{text, source, score}` |
//! | `queries` | the sub-queries asked so far |
//!
//! Templates are checked when the file is loaded (rendered once with sample values), so a typo
//! fails at start-up with the prompt's name, not hours into a run.

use std::path::Path;

use minijinja::{Environment, UndefinedBehavior};
use serde::{Deserialize, Serialize};

/// Errors of the prompt file.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The file could not be read.
    #[error("cannot read prompt file {path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        message: String,
    },
    /// The TOML is malformed or lacks a prompt.
    #[error("prompt file {path}: {message}")]
    Toml {
        /// The file.
        path: String,
        /// toml's message, naming the key.
        message: String,
    },
    /// A template does not render.
    #[error("prompt `{prompt}` in {path}: {message}")]
    Template {
        /// The file.
        path: String,
        /// Which prompt: decomposer, reasoner or synthesizer.
        prompt: String,
        /// minijinja's message (line and the undefined name).
        message: String,
    },
}

/// One component's prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptTemplate {
    /// Jinja template of the user message.
    pub template: String,
    /// Most tokens the component may generate.
    pub max_new_tokens: usize,
}

/// The prompts of the three LLM components.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prompts {
    /// The system message of every call (empty: none).
    pub system: String,
    /// Writes the next sub-query from the question and the notes so far.
    pub decomposer: PromptTemplate,
    /// Writes an intermediate note from the question and the evidence so far.
    pub reasoner: PromptTemplate,
    /// Answers from the question, the options, all evidence and all notes.
    pub synthesizer: PromptTemplate,
    /// Judges whether a retrieval's new chunks (its `evidence`) help answer the question
    /// (`--progress llm-judge`); a reply starting with "yes" counts as progress.
    pub judge: PromptTemplate,
    /// Where the prompts came from (set on load).
    #[serde(skip)]
    pub source: String,
}

/// An option as templates see it.
#[derive(Debug, Clone, Serialize)]
pub struct OptionView<'a> {
    /// `1`, `2`, ...
    pub label: String,
    /// The option's text.
    pub text: &'a str,
}

/// A retrieved chunk as templates see it.
#[derive(Debug, Clone, Serialize)]
pub struct EvidenceView<'a> {
    /// The chunk's text.
    pub text: &'a str,
    /// The file it came from.
    pub source: &'a str,
    /// Cosine similarity to the query that found it.
    pub score: f32,
}

/// Everything a template may read.
#[derive(Debug, Clone, Serialize)]
pub struct PromptContext<'a> {
    /// The question.
    pub question: &'a str,
    /// The options.
    pub options: Vec<OptionView<'a>>,
    /// Notes so far.
    pub notes: &'a [String],
    /// Evidence so far.
    pub evidence: Vec<EvidenceView<'a>>,
    /// Sub-queries so far.
    pub queries: &'a [String],
}

/// Which component a prompt belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    /// The next sub-query.
    Decomposer,
    /// An intermediate note.
    Reasoner,
    /// The final answer.
    Synthesizer,
    /// Whether new evidence helps (progress by LLM judgement).
    Judge,
}

impl Component {
    /// The key in the prompt file.
    pub fn name(self) -> &'static str {
        match self {
            Component::Decomposer => "decomposer",
            Component::Reasoner => "reasoner",
            Component::Synthesizer => "synthesizer",
            Component::Judge => "judge",
        }
    }
}

/// The prompts shipped with fleet (`configs/argo_prompts.toml`, compiled in).
pub const DEFAULT_PROMPTS: &str = include_str!("../../../configs/argo_prompts.toml");

impl Prompts {
    /// The prompts shipped with fleet.
    pub fn default_prompts() -> Result<Self, PromptError> {
        Self::from_toml(DEFAULT_PROMPTS, "configs/argo_prompts.toml (built in)")
    }

    /// Reads and checks a prompt file.
    pub fn from_file(path: &Path) -> Result<Self, PromptError> {
        let text = std::fs::read_to_string(path).map_err(|e| PromptError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Parses and checks prompt TOML; `source` names it in errors.
    pub fn from_toml(text: &str, source: &str) -> Result<Self, PromptError> {
        let mut prompts: Prompts = toml::from_str(text).map_err(|e| PromptError::Toml {
            path: source.to_string(),
            message: e.message().to_string(),
        })?;
        prompts.source = source.to_string();
        let notes = vec!["a note".to_string()];
        let queries = vec!["a query".to_string()];
        let sample = PromptContext {
            question: "What is a sample question?",
            options: vec![
                OptionView {
                    label: "1".into(),
                    text: "first",
                },
                OptionView {
                    label: "2".into(),
                    text: "second",
                },
            ],
            notes: &notes,
            evidence: vec![EvidenceView {
                text: "a chunk",
                source: "doc.txt",
                score: 0.5,
            }],
            queries: &queries,
        };
        for c in [
            Component::Decomposer,
            Component::Reasoner,
            Component::Synthesizer,
            Component::Judge,
        ] {
            if prompts.template(c).max_new_tokens == 0 {
                return Err(PromptError::Template {
                    path: source.to_string(),
                    prompt: c.name().into(),
                    message: "max_new_tokens is 0: give the component room to answer".into(),
                });
            }
            prompts.check_variables(c)?;
            prompts.render(c, &sample)?;
        }
        Ok(prompts)
    }

    /// Errors naming any variable a template reads that is not one of the documented ones.
    fn check_variables(&self, component: Component) -> Result<(), PromptError> {
        const KNOWN: [&str; 5] = ["question", "options", "notes", "evidence", "queries"];
        let env = Environment::new();
        let err = |message: String| PromptError::Template {
            path: self.source.clone(),
            prompt: component.name().into(),
            message,
        };
        let template = env
            .template_from_str(&self.template(component).template)
            .map_err(|e| err(e.to_string()))?;
        let mut unknown: Vec<String> = template
            .undeclared_variables(false)
            .into_iter()
            .filter(|v| !KNOWN.contains(&v.as_str()))
            .collect();
        unknown.sort();
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(err(format!(
                "unknown variable(s) {}: templates may read {}",
                unknown.join(", "),
                KNOWN.join(", ")
            )))
        }
    }

    /// The template of a component.
    pub fn template(&self, component: Component) -> &PromptTemplate {
        match component {
            Component::Decomposer => &self.decomposer,
            Component::Reasoner => &self.reasoner,
            Component::Synthesizer => &self.synthesizer,
            Component::Judge => &self.judge,
        }
    }

    /// The user message of `component` for `ctx`.
    pub fn render(
        &self,
        component: Component,
        ctx: &PromptContext<'_>,
    ) -> Result<String, PromptError> {
        let mut env = Environment::new();
        // A misspelt variable is an error, not an empty string.
        env.set_undefined_behavior(UndefinedBehavior::Strict);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        let err = |e: minijinja::Error| PromptError::Template {
            path: self.source.clone(),
            prompt: component.name().into(),
            message: e.to_string(),
        };
        let template = self.template(component);
        env.template_from_str(&template.template)
            .map_err(err)?
            .render(ctx)
            .map(|s| s.trim().to_string())
            .map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_prompts_render() {
        let p = Prompts::default_prompts().unwrap();
        let notes = vec!["The E2 interface links the RIC and the E2 nodes.".to_string()];
        let ctx = PromptContext {
            question: "Which interface links the near-RT RIC to E2 nodes?",
            options: vec![
                OptionView {
                    label: "1".into(),
                    text: "A1",
                },
                OptionView {
                    label: "2".into(),
                    text: "E2",
                },
            ],
            notes: &notes,
            evidence: vec![],
            queries: &[],
        };
        let text = p.render(Component::Synthesizer, &ctx).unwrap();
        assert!(
            text.contains("Which interface") && text.contains("2. E2"),
            "{text}"
        );
        assert!(text.contains("The E2 interface links"), "{text}");
    }

    #[test]
    fn misspelt_variable_names_the_prompt() {
        let text = DEFAULT_PROMPTS.replacen("{{ question }}", "{{ qestion }}", 1);
        let err = Prompts::from_toml(&text, "p.toml").unwrap_err().to_string();
        assert!(err.contains("p.toml") && err.contains("qestion"), "{err}");
    }

    #[test]
    fn missing_prompt_is_named() {
        let err = Prompts::from_toml("system = \"x\"\n", "p.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("p.toml") && err.contains("decomposer"),
            "{err}"
        );
    }
}
