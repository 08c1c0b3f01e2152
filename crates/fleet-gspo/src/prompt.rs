//! Prompts as the policy reads them: plain text as it is, chat messages through the
//! checkpoint's chat template (with the generation prompt), tokenized, and cut to
//! `max_prompt_length` from the left (TRL keeps the end of a long prompt, where the question is).

use fleet_models::{ChatTemplate, CheckpointFiles, ModelError, TextTokenizer};

use crate::dataset::{Prompt, Sample};

/// A sample's prompt, rendered and tokenized.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderedPrompt {
    /// The text the model continues (what reward functions see as the prompt).
    pub text: String,
    /// Its token ids, after the cut.
    pub ids: Vec<u32>,
    /// Tokens cut from the front (0 when the prompt fitted).
    pub cut: usize,
}

/// Renders and tokenizes prompts with one checkpoint's tokenizer and chat template.
pub struct PromptRenderer {
    tokenizer: TextTokenizer,
    template: Option<ChatTemplate>,
    max_prompt_length: Option<usize>,
}

impl PromptRenderer {
    /// The renderer of the checkpoint whose files are `files`.
    pub fn new(
        files: &CheckpointFiles,
        max_prompt_length: Option<usize>,
    ) -> Result<Self, ModelError> {
        let path = files.tokenizer.as_ref().ok_or_else(|| ModelError::MissingFile {
            path: std::path::Path::new(&files.origin).join("tokenizer.json"),
            hint: "training renders text prompts and completions: the checkpoint needs its tokenizer"
                .into(),
        })?;
        let template = match &files.tokenizer_config {
            Some(p) => ChatTemplate::from_tokenizer_config(p)?,
            None => None,
        };
        Ok(PromptRenderer {
            tokenizer: TextTokenizer::from_file(path)?,
            template,
            max_prompt_length,
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// `sample`'s prompt as the model reads it.
    pub fn render(&self, sample: &Sample) -> Result<RenderedPrompt, ModelError> {
        let text = match &sample.prompt {
            Prompt::Text(t) => t.clone(),
            Prompt::Chat(_) => {
                let template = self.template.as_ref().ok_or_else(|| {
                    ModelError::BadInput(format!(
                        "sample {} has chat messages but the checkpoint has no chat_template: give \
                         plain-text prompts, or a checkpoint with a template",
                        sample.id
                    ))
                })?;
                template.render(&sample.prompt.messages(), true, &Default::default())?
            }
        };
        let mut ids = self.tokenizer.encode(&text)?;
        let mut cut = 0;
        if let Some(max) = self.max_prompt_length {
            if ids.len() > max {
                cut = ids.len() - max;
                ids.drain(..cut);
            }
        }
        Ok(RenderedPrompt { text, ids, cut })
    }
}
