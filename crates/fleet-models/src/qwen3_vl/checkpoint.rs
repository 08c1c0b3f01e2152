//! A loaded Qwen3-VL checkpoint: model, tokenizer, chat template, image processor and
//! generation defaults, with prompts built as transformers' `Qwen3VLProcessor` builds them.

use std::path::Path;

use fleet_topology::{DeviceLocation, DeviceMap};
use serde_json::Value;

use crate::config::GenerationConfig;
use crate::error::{ModelError, Result};
use crate::generation::{GenerationOutput, GenerationRequest, StreamEvent};
use crate::source::{CheckpointFiles, ModelSource};
use crate::tokenizer::{ChatTemplate, TextTokenizer};
use crate::vision::{preprocess, ImageProcessorConfig};
use crate::weights::Weights;
use crate::LoadOptions;

use super::{expand_image_pads, Qwen3VlConfig, Qwen3VlModel, VlPrompt};

/// A Qwen3-VL checkpoint ready to answer prompts with images.
pub struct VisionLanguageModel {
    /// Where it came from.
    pub source: ModelSource,
    /// The files that were loaded.
    pub files: CheckpointFiles,
    /// The model.
    pub model: Qwen3VlModel,
    /// tokenizer.json.
    pub tokenizer: TextTokenizer,
    /// The processor's chat template.
    pub chat_template: ChatTemplate,
    /// generation_config.json (defaults when absent).
    pub generation_config: GenerationConfig,
    /// preprocessor_config.json.
    pub processor: ImageProcessorConfig,
}

impl VisionLanguageModel {
    /// Loads a local directory or hub id with the given options.
    pub fn load(spec: &str, opts: &LoadOptions) -> Result<Self> {
        let source = ModelSource::parse(spec, opts.revision.as_deref())?;
        let files = source.resolve(&opts.hub)?;
        let cfg = Qwen3VlConfig::from_file(&files.config)?;
        let map = opts
            .device_map
            .clone()
            .unwrap_or_else(|| DeviceMap::single(DeviceLocation::Cpu, cfg.text.num_hidden_layers));
        let weights = Weights::from_safetensors(&files.weights)?;
        let model = Qwen3VlModel::new(&cfg, &weights, opts.dtype, &map)?;
        Self::with_model(source, files, model)
    }

    /// The checkpoint's tokenizer, template, processor and generation defaults around a model
    /// built elsewhere (random weights of its shape, for benchmarks).
    pub fn with_model(
        source: ModelSource,
        files: CheckpointFiles,
        model: Qwen3VlModel,
    ) -> Result<Self> {
        let origin = Path::new(&files.origin).to_path_buf();
        let missing = |name: &str, hint: &str| ModelError::MissingFile {
            path: origin.join(name),
            hint: hint.into(),
        };
        let tokenizer = TextTokenizer::from_file(files.tokenizer.as_deref().ok_or_else(|| {
            missing(
                "tokenizer.json",
                "a Qwen3-VL checkpoint ships its tokenizer; download the complete checkpoint",
            )
        })?)?;
        let vocab = model.config().text.vocab_size;
        if tokenizer.vocab_size() > vocab {
            return Err(ModelError::Tokenizer {
                path: files.tokenizer.clone().unwrap_or_default(),
                message: format!(
                    "has {} tokens but the model's vocab_size is {vocab}; tokenizer and weights \
                     are from different models",
                    tokenizer.vocab_size()
                ),
            });
        }
        let image_pad = tokenizer.token_id("<|image_pad|>");
        if image_pad != Some(model.config().image_token_id) {
            return Err(ModelError::Tokenizer {
                path: files.tokenizer.clone().unwrap_or_default(),
                message: format!(
                    "<|image_pad|> is {image_pad:?} in the tokenizer but image_token_id is {} in \
                     config.json; tokenizer and config are from different models",
                    model.config().image_token_id
                ),
            });
        }
        let chat_template = match &files.chat_template {
            Some(p) => ChatTemplate::from_file(p, files.tokenizer_config.as_deref())?,
            None => files
                .tokenizer_config
                .as_deref()
                .map(ChatTemplate::from_tokenizer_config)
                .transpose()?
                .flatten()
                .ok_or_else(|| {
                    missing(
                        "chat_template.json",
                        "the checkpoint has no chat template (chat_template.json, \
                         chat_template.jinja or tokenizer_config.json's chat_template)",
                    )
                })?,
        };
        let processor_path = files.preprocessor_config.clone().ok_or_else(|| {
            missing(
                "preprocessor_config.json",
                "the image processor's settings (pixel limits, mean/std) come from this file; \
                 download the complete checkpoint",
            )
        })?;
        let processor = ImageProcessorConfig::from_file(&processor_path).map_err(|e| {
            ModelError::BadConfig {
                path: processor_path.clone(),
                field: "preprocessor_config".into(),
                value: String::new(),
                hint: e.to_string(),
            }
        })?;
        let vision = &model.config().vision;
        if processor.patch_dim() != vision.patch_dim()
            || processor.merge_size != vision.spatial_merge_size
        {
            return Err(ModelError::BadConfig {
                path: processor_path,
                field: "patch_size / temporal_patch_size / merge_size".into(),
                value: format!(
                    "{} / {} / {}",
                    processor.patch_size, processor.temporal_patch_size, processor.merge_size
                ),
                hint: format!(
                    "config.json's vision_config has patch_size {}, temporal_patch_size {}, \
                     spatial_merge_size {}: the files are from different models",
                    vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size
                ),
            });
        }
        let generation_config = match &files.generation_config {
            Some(p) => GenerationConfig::from_file(p)?,
            None => GenerationConfig::default(),
        };
        Ok(VisionLanguageModel {
            source,
            files,
            model,
            tokenizer,
            chat_template,
            generation_config,
            processor,
        })
    }

    /// The chat `messages` (transformers' format: `content` a string or a list of
    /// `{"type": "image"}` / `{"type": "text", "text": …}` parts) rendered with the generation
    /// prompt, tokenized, each image's pad token expanded; `images` are the image parts' images
    /// in order.
    pub fn prompt(&self, messages: &Value, images: &[image::DynamicImage]) -> Result<VlPrompt> {
        let text =
            self.chat_template
                .render_json(messages.clone(), true, &serde_json::Map::new())?;
        self.prompt_from_text(&text, images)
    }

    /// A prompt from already rendered text holding one `<|image_pad|>` per image.
    pub fn prompt_from_text(&self, text: &str, images: &[image::DynamicImage]) -> Result<VlPrompt> {
        let ids = self.tokenizer.encode(text)?;
        let cfg = self.model.config();
        if images.is_empty() {
            expand_image_pads(&ids, cfg.image_token_id, &[])?;
            return Ok(VlPrompt { ids, images: None });
        }
        let pre = preprocess(images, &self.processor)
            .map_err(|e| ModelError::BadInput(format!("preprocessing the images: {e}")))?;
        let counts = pre.pad_tokens(cfg.vision.spatial_merge_size);
        let ids = expand_image_pads(&ids, cfg.image_token_id, &counts)?;
        Ok(VlPrompt {
            ids,
            images: Some(pre),
        })
    }

    /// EOS ids: generation_config.json's, else config.json's text_config, else `<|im_end|>` /
    /// `<|endoftext|>`.
    pub fn eos_ids(&self) -> Vec<u32> {
        crate::stop_ids(
            &self.generation_config,
            &self.model.config().text,
            Some(&self.tokenizer),
        )
    }

    /// The padding id (masked; Qwen uses `<|endoftext|>`).
    pub fn pad_id(&self) -> u32 {
        crate::padding_id(&self.generation_config, &self.eos_ids())
    }

    /// Generates continuations of `prompts` (one left-padded batch); `requests[r]` holds
    /// `prompts[r].ids` and how to decode.
    pub fn generate(
        &self,
        prompts: &[VlPrompt],
        requests: &[GenerationRequest],
        on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
    ) -> Result<Vec<GenerationOutput>> {
        self.model.generate(
            Some(&self.tokenizer),
            self.eos_ids(),
            self.pad_id(),
            prompts,
            requests,
            on_token,
        )
    }
}
