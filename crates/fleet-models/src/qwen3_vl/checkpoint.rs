//! A Qwen3-VL checkpoint: [`VlProcessor`] — transformers' `Qwen3VLProcessor` without weights
//! (tokenizer, chat template, image processor settings, generation defaults, and the
//! config.json facts prompts depend on) — and [`VisionLanguageModel`], the model with its
//! processor.
//!
//! The processor builds prompts as `Qwen3VLProcessor` builds them and tells how many M-RoPE
//! positions a prompt takes from its images' sizes alone ([`VlProcessor::length`]), so a job
//! can refuse a request that can never fit the model before any weights are loaded, with the
//! same computation the model's generate uses.

use std::borrow::Borrow;
use std::path::Path;

use image::DynamicImage;
use serde_json::Value;

use crate::config::GenerationConfig;
use crate::error::{ModelError, Result};
use crate::generation::{
    GenerationOutput, GenerationRequest, PagedOptions, PagedStats, StreamEvent,
};
use crate::source::{CheckpointFiles, ModelSource};
use crate::tokenizer::{ChatTemplate, TextTokenizer};
use crate::vision::{preprocess, ImageProcessorConfig};
use crate::LoadOptions;

use super::{expand_image_pads, MropePositions, Qwen3VlConfig, Qwen3VlModel, VlPrompt};

/// How many positions one request takes, against how many the model has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLength {
    /// M-RoPE positions of the prompt (its largest position + 1): one per text token, and per
    /// image the largest side of its merged grid (fewer than the image's tokens).
    pub prompt: usize,
    /// Positions the reply may take.
    pub max_new_tokens: usize,
    /// The model's `max_position_embeddings`.
    pub max_positions: usize,
}

impl PromptLength {
    /// `prompt + max_new_tokens`.
    pub fn total(&self) -> usize {
        self.prompt + self.max_new_tokens
    }

    /// Whether the request fits the model.
    pub fn fits(&self) -> bool {
        self.total() <= self.max_positions
    }

    /// `Ok` when it fits; otherwise an error naming the numbers and the fix.
    pub fn check(&self) -> Result<()> {
        if self.fits() {
            return Ok(());
        }
        Err(ModelError::BadInput(format!(
            "{} positions (prompt {} + max_new_tokens {}) exceed \
             max_position_embeddings = {} of this model; shorten the prompt or lower \
             max_new_tokens",
            self.total(),
            self.prompt,
            self.max_new_tokens,
            self.max_positions
        )))
    }
}

/// transformers' `Qwen3VLProcessor` for one checkpoint, without weights: the tokenizer, the
/// processor's chat template, the image processor's settings (preprocessor_config.json), the
/// generation defaults (generation_config.json) and the checkpoint's config.json, checked
/// against each other when loaded (vocabulary, `<|image_pad|>` id, patch sizes).
pub struct VlProcessor {
    /// config.json (special token ids, the vision merge size, `max_position_embeddings`).
    pub config: Qwen3VlConfig,
    /// tokenizer.json.
    pub tokenizer: TextTokenizer,
    /// The processor's chat template.
    pub chat_template: ChatTemplate,
    /// preprocessor_config.json.
    pub image_processor: ImageProcessorConfig,
    /// generation_config.json (defaults when absent).
    pub generation_config: GenerationConfig,
}

impl std::fmt::Debug for VlProcessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VlProcessor")
            .field("model_type", &self.config.model_type)
            .field("vocab", &self.tokenizer.vocab_size())
            .field("image_processor", &self.image_processor)
            .field("max_positions", &self.max_positions())
            .finish_non_exhaustive()
    }
}

impl VlProcessor {
    /// The processor of a local directory or hub id: its config, tokenizer and processor
    /// files only (no weights are read or downloaded).
    /// `opts.image_backend` picks transformers' image-processor backend.
    pub fn load(spec: &str, opts: &LoadOptions) -> Result<Self> {
        let source = ModelSource::parse(spec, opts.revision.as_deref())?;
        Ok(Self::from_files(&source.resolve_for_plan(&opts.hub)?)?
            .with_image_backend(opts.image_backend))
    }

    /// The same processor with images prepared by transformers' `backend` (torchvision, its
    /// default, or Pillow).
    pub fn with_image_backend(mut self, backend: crate::vision::ResizeBackend) -> Self {
        self.image_processor = self.image_processor.with_resize_backend(backend);
        self
    }

    /// The processor of resolved checkpoint files (config.json read here).
    pub fn from_files(files: &CheckpointFiles) -> Result<Self> {
        Self::with_config(files, Qwen3VlConfig::from_file(&files.config)?)
    }

    /// The processor of checkpoint files whose config.json was read already; the files are
    /// checked against `config` (tokenizer vocabulary and `<|image_pad|>` id, the image
    /// processor's patch sizes).
    pub fn with_config(files: &CheckpointFiles, config: Qwen3VlConfig) -> Result<Self> {
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
        let vocab = config.text.vocab_size;
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
        if image_pad != Some(config.image_token_id) {
            return Err(ModelError::Tokenizer {
                path: files.tokenizer.clone().unwrap_or_default(),
                message: format!(
                    "<|image_pad|> is {image_pad:?} in the tokenizer but image_token_id is {} in \
                     config.json; tokenizer and config are from different models",
                    config.image_token_id
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
        let image_processor = ImageProcessorConfig::from_file(&processor_path).map_err(|e| {
            ModelError::BadConfig {
                path: processor_path.clone(),
                field: "preprocessor_config".into(),
                value: String::new(),
                hint: e.to_string(),
            }
        })?;
        let vision = &config.vision;
        if image_processor.patch_dim() != vision.patch_dim()
            || image_processor.merge_size != vision.spatial_merge_size
        {
            return Err(ModelError::BadConfig {
                path: processor_path,
                field: "patch_size / temporal_patch_size / merge_size".into(),
                value: format!(
                    "{} / {} / {}",
                    image_processor.patch_size,
                    image_processor.temporal_patch_size,
                    image_processor.merge_size
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
        Ok(VlProcessor {
            config,
            tokenizer,
            chat_template,
            image_processor,
            generation_config,
        })
    }

    /// The chat `messages` (transformers' format: `content` a string or a list of
    /// `{"type": "image"}` / `{"type": "text", "text": …}` parts) rendered by the chat
    /// template with the generation prompt.
    pub fn render(&self, messages: &Value) -> Result<String> {
        self.chat_template
            .render_json(messages.clone(), true, &serde_json::Map::new())
    }

    /// The chat `messages` rendered ([`Self::render`]), tokenized, each image's pad token
    /// expanded, its positions counted; `images` are the image parts' images in order (owned,
    /// borrowed or `Arc`s: they are not copied).
    pub fn prompt<I: Borrow<DynamicImage> + Sync>(
        &self,
        messages: &Value,
        images: &[I],
    ) -> Result<VlPrompt> {
        self.prompt_from_text(&self.render(messages)?, images)
    }

    /// A prompt from already rendered text holding one `<|image_pad|>` per image.
    pub fn prompt_from_text<I: Borrow<DynamicImage> + Sync>(
        &self,
        text: &str,
        images: &[I],
    ) -> Result<VlPrompt> {
        let ids = self.tokenizer.encode(text)?;
        let cfg = &self.config;
        if images.is_empty() {
            expand_image_pads(&ids, cfg.image_token_id, &[])?;
            let positions = MropePositions::count(&ids, &[], cfg)?;
            return Ok(VlPrompt {
                ids,
                images: None,
                positions: Some(positions),
            });
        }
        let pre = self.preprocess(images)?;
        let counts = pre.pad_tokens(cfg.vision.spatial_merge_size);
        let ids = expand_image_pads(&ids, cfg.image_token_id, &counts)?;
        let positions = MropePositions::count(&ids, &pre.image_grid_thw, cfg)?;
        Ok(VlPrompt {
            ids,
            images: Some(pre),
            positions: Some(positions),
        })
    }

    /// The prompt of one chat request, built once and checked before a pixel is touched: the
    /// template rendered and tokenized, each image's pad token expanded by the grid its size
    /// gives ([`Self::image_grid`]), the M-RoPE positions counted (once: the prefill uses
    /// them) and the length with `max_new_tokens` checked against the model
    /// ([`PromptLength::check`]); then the images preprocessed (owned, borrowed or `Arc`s:
    /// they are not copied). The same computation as [`Self::length`], so a request refused
    /// up front and one refused here are refused alike.
    pub fn chat_prompt<I: Borrow<DynamicImage> + Sync>(
        &self,
        messages: &Value,
        images: &[I],
        max_new_tokens: usize,
    ) -> Result<VlPrompt> {
        let sizes: Vec<(usize, usize)> = images
            .iter()
            .map(|img| {
                let img = img.borrow();
                (img.height() as usize, img.width() as usize)
            })
            .collect();
        let (ids, grids) = self.expand_by_sizes(&self.render(messages)?, &sizes)?;
        let positions = MropePositions::count(&ids, &grids, &self.config)?;
        self.prompt_length(&positions, max_new_tokens).check()?;
        let pre = if images.is_empty() {
            None
        } else {
            let pre = self.preprocess(images)?;
            if pre.image_grid_thw != grids {
                return Err(ModelError::BadInput(format!(
                    "the images were preprocessed into grids {:?} but their sizes give {grids:?}",
                    pre.image_grid_thw
                )));
            }
            Some(pre)
        };
        Ok(VlPrompt {
            ids,
            images: pre,
            positions: Some(positions),
        })
    }

    /// The images preprocessed with this checkpoint's image processor.
    fn preprocess<I: Borrow<DynamicImage> + Sync>(
        &self,
        images: &[I],
    ) -> Result<crate::vision::PreprocessedImages> {
        preprocess(images, &self.image_processor)
            .map_err(|e| ModelError::BadInput(format!("preprocessing the images: {e}")))
    }

    /// The patch grid `[t, h, w]` of a still image of `height` x `width` pixels: its size after
    /// the image processor's resize ([`ImageProcessorConfig::resized_size`]) in patches, as
    /// [`preprocess()`] makes it, without touching a pixel.
    pub fn image_grid(&self, height: usize, width: usize) -> Result<[usize; 3]> {
        let (h, w) = self
            .image_processor
            .resized_size(height, width)
            .map_err(|e| ModelError::BadInput(format!("an image of {width}x{height}: {e}")))?;
        let p = self.image_processor.patch_size;
        Ok([1, h / p, w / p])
    }

    /// The M-RoPE positions (largest position + 1) of the prompt of `messages` whose images
    /// are `image_sizes` (`(height, width)` each, in order): the template rendered, the text
    /// tokenized, each image's pads expanded by its grid ([`Self::image_grid`]) and the
    /// positions counted by [`super::rope_index`], the function the model's prefill uses.
    pub fn positions(&self, messages: &Value, image_sizes: &[(usize, usize)]) -> Result<usize> {
        self.positions_from_text(&self.render(messages)?, image_sizes)
    }

    /// [`Self::positions`] of already rendered text.
    pub fn positions_from_text(&self, text: &str, image_sizes: &[(usize, usize)]) -> Result<usize> {
        let (ids, grids) = self.expand_by_sizes(text, image_sizes)?;
        Ok(MropePositions::count(&ids, &grids, &self.config)?.span())
    }

    /// Rendered `text` tokenized with each image's pad token expanded by the grid of its size
    /// (`(height, width)`, [`Self::image_grid`]), and those grids: the prompt's ids without
    /// touching a pixel.
    fn expand_by_sizes(
        &self,
        text: &str,
        image_sizes: &[(usize, usize)],
    ) -> Result<(Vec<u32>, Vec<[usize; 3]>)> {
        let ids = self.tokenizer.encode(text)?;
        let cfg = &self.config;
        let merge = cfg.vision.spatial_merge_size;
        let grids = image_sizes
            .iter()
            .map(|&(h, w)| self.image_grid(h, w))
            .collect::<Result<Vec<_>>>()?;
        let counts: Vec<usize> = grids
            .iter()
            .map(|&g| crate::vision::image_pad_tokens(g, merge))
            .collect();
        Ok((expand_image_pads(&ids, cfg.image_token_id, &counts)?, grids))
    }

    /// How many positions a prompt with `positions` and a reply of `max_new_tokens` take,
    /// against the model's.
    fn prompt_length(&self, positions: &MropePositions, max_new_tokens: usize) -> PromptLength {
        PromptLength {
            prompt: positions.span(),
            max_new_tokens,
            max_positions: self.max_positions(),
        }
    }

    /// How many positions a request of `messages` with images of `image_sizes` (`(height,
    /// width)`) and `max_new_tokens` takes, against the model's `max_position_embeddings`.
    pub fn length(
        &self,
        messages: &Value,
        image_sizes: &[(usize, usize)],
        max_new_tokens: usize,
    ) -> Result<PromptLength> {
        let (ids, grids) = self.expand_by_sizes(&self.render(messages)?, image_sizes)?;
        let positions = MropePositions::count(&ids, &grids, &self.config)?;
        Ok(self.prompt_length(&positions, max_new_tokens))
    }

    /// The model's `max_position_embeddings`.
    pub fn max_positions(&self) -> usize {
        self.config.text.max_position_embeddings
    }

    /// EOS ids: generation_config.json's, else config.json's text_config, else `<|im_end|>` /
    /// `<|endoftext|>`.
    pub fn eos_ids(&self) -> Vec<u32> {
        crate::stop_ids(
            &self.generation_config,
            &self.config.text,
            Some(&self.tokenizer),
        )
    }

    /// The padding id (masked; Qwen uses `<|endoftext|>`).
    pub fn pad_id(&self) -> u32 {
        crate::padding_id(&self.generation_config, &self.eos_ids())
    }
}

/// A Qwen3-VL checkpoint ready to answer prompts with images: the model and its
/// [`VlProcessor`].
pub struct VisionLanguageModel {
    /// Where it came from.
    pub source: ModelSource,
    /// The files that were loaded.
    pub files: CheckpointFiles,
    /// The model.
    pub model: Qwen3VlModel,
    /// The tokenizer, chat template, image processor settings and generation defaults.
    pub processor: VlProcessor,
    /// Continuous batching's decode slots for [`VisionLanguageModel::generate_batch`]
    /// ([`LoadOptions::decode_slots`]); `None`: one left-padded batch.
    pub decode_slots: Option<usize>,
}

impl VisionLanguageModel {
    /// Loads a local directory or hub id with the given options.
    pub fn load(spec: &str, opts: &LoadOptions) -> Result<Self> {
        let c = crate::Checkpoint::open(spec, opts, Qwen3VlConfig::from_file, |c| {
            c.text.num_hidden_layers
        })?;
        let model = Qwen3VlModel::new(&c.config, &c.weights, opts.dtype, &c.map)?;
        let mut vlm = Self::with_model(c.source, c.files, model)?;
        vlm.processor = vlm.processor.with_image_backend(opts.image_backend);
        vlm.decode_slots = opts.decode_slots;
        Ok(vlm)
    }

    /// The checkpoint's processor ([`VlProcessor::with_config`], checked against the model's
    /// config) around a model built elsewhere (random weights of its shape, for benchmarks).
    pub fn with_model(
        source: ModelSource,
        files: CheckpointFiles,
        model: Qwen3VlModel,
    ) -> Result<Self> {
        let processor = VlProcessor::with_config(&files, model.config().clone())?;
        Ok(VisionLanguageModel {
            source,
            files,
            model,
            processor,
            decode_slots: None,
        })
    }

    /// [`VlProcessor::prompt`].
    pub fn prompt<I: Borrow<DynamicImage> + Sync>(
        &self,
        messages: &Value,
        images: &[I],
    ) -> Result<VlPrompt> {
        self.processor.prompt(messages, images)
    }

    /// [`VlProcessor::prompt_from_text`].
    pub fn prompt_from_text<I: Borrow<DynamicImage> + Sync>(
        &self,
        text: &str,
        images: &[I],
    ) -> Result<VlPrompt> {
        self.processor.prompt_from_text(text, images)
    }

    /// [`VlProcessor::eos_ids`].
    pub fn eos_ids(&self) -> Vec<u32> {
        self.processor.eos_ids()
    }

    /// [`VlProcessor::pad_id`].
    pub fn pad_id(&self) -> u32 {
        self.processor.pad_id()
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
            Some(&self.processor.tokenizer),
            self.eos_ids(),
            self.pad_id(),
            prompts,
            requests,
            on_token,
        )
    }

    /// A batch the way this model was loaded to generate: [`VisionLanguageModel::generate`],
    /// or with `decode_slots`, continuous batching through that many slots with blocks for
    /// all of them at once ([`VisionLanguageModel::generate_paged`]). Same tokens.
    pub fn generate_batch(
        &self,
        prompts: &[VlPrompt],
        requests: &[GenerationRequest],
    ) -> Result<Vec<GenerationOutput>> {
        match self.decode_slots {
            None => self.generate(prompts, requests, None),
            Some(slots) => {
                let options = PagedOptions::for_requests(requests, slots, 16);
                Ok(self.generate_paged(prompts, requests, &options, None)?.0)
            }
        }
    }

    /// [`VisionLanguageModel::generate`] with continuous batching on a paged KV cache
    /// ([`Qwen3VlModel::generate_paged`]).
    pub fn generate_paged(
        &self,
        prompts: &[VlPrompt],
        requests: &[GenerationRequest],
        options: &PagedOptions,
        on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
    ) -> Result<(Vec<GenerationOutput>, PagedStats)> {
        self.model.generate_paged(
            Some(&self.processor.tokenizer),
            self.eos_ids(),
            self.pad_id(),
            prompts,
            requests,
            options,
            on_token,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::rope_index;
    use super::*;
    use std::path::PathBuf;

    fn tiny() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3-vl-tiny")
    }

    fn picture(w: u32, h: u32) -> image::DynamicImage {
        image::DynamicImage::ImageRgb8(image::RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([(x * 3) as u8, (y * 5) as u8, 77])
        }))
    }

    fn messages(text: &str, images: usize) -> Value {
        let mut content: Vec<Value> = (0..images)
            .map(|_| serde_json::json!({"type": "image"}))
            .collect();
        content.push(serde_json::json!({"type": "text", "text": text}));
        serde_json::json!([
            {"role": "system", "content": "You judge image edits."},
            {"role": "user", "content": content}
        ])
    }

    /// Without weights: a copy of the checkpoint with no safetensors loads its processor.
    fn processor_without_weights() -> (tempfile::TempDir, VlProcessor) {
        let tmp = tempfile::tempdir().unwrap();
        for f in std::fs::read_dir(tiny()).unwrap() {
            let f = f.unwrap().path();
            if f.extension().is_some_and(|e| e != "safetensors") {
                std::fs::copy(&f, tmp.path().join(f.file_name().unwrap())).unwrap();
            }
        }
        let p = VlProcessor::load(tmp.path().to_str().unwrap(), &LoadOptions::default()).unwrap();
        (tmp, p)
    }

    #[test]
    fn positions_from_sizes_equal_the_built_prompts_positions() {
        let (_tmp, proc) = processor_without_weights();
        // Sizes that smart_resize rounds in different ways, and a text-only prompt.
        let cases: Vec<Vec<(u32, u32)>> = vec![
            vec![(48, 64), (37, 100)],
            vec![(90, 33)],
            vec![(300, 17), (64, 64), (129, 257)],
            vec![],
        ];
        for sizes in cases {
            let images: Vec<_> = sizes.iter().map(|&(w, h)| picture(w, h)).collect();
            let m = messages("Make the sky red. Reply `Score: X`.", images.len());
            let prompt = proc.prompt(&m, &images).unwrap();
            let grids = prompt
                .images
                .as_ref()
                .map_or(Vec::new(), |i| i.image_grid_thw.clone());
            let (_, delta) = rope_index(
                &prompt.ids,
                &grids,
                proc.config.vision.spatial_merge_size,
                proc.config.image_token_id,
                proc.config.video_token_id,
            )
            .unwrap();
            let hw: Vec<(usize, usize)> = sizes
                .iter()
                .map(|&(w, h)| (h as usize, w as usize))
                .collect();
            let expected = (prompt.ids.len() as i64 + delta) as usize;
            assert_eq!(proc.positions(&m, &hw).unwrap(), expected, "{sizes:?}");
            for (k, &(h, w)) in hw.iter().enumerate() {
                assert_eq!(proc.image_grid(h, w).unwrap(), grids[k]);
            }
        }
    }

    #[test]
    fn a_prompt_beyond_the_context_is_named_with_its_numbers() {
        let (_tmp, proc) = processor_without_weights();
        assert_eq!(proc.max_positions(), 2048);
        let short = proc
            .length(&messages("Rate it.", 1), &[(64, 48)], 128)
            .unwrap();
        assert!(short.fits() && short.check().is_ok(), "{short:?}");
        let long = "make every pixel of the sky a deeper red ".repeat(400);
        let len = proc.length(&messages(&long, 1), &[(64, 48)], 128).unwrap();
        assert!(!len.fits(), "{len:?}");
        assert_eq!(len.total(), len.prompt + 128);
        let err = len.check().unwrap_err().to_string();
        assert!(
            err.contains(&format!("{} positions", len.total()))
                && err.contains("max_position_embeddings = 2048"),
            "{err}"
        );
        // An image the processor refuses (200:1 at most) is an error, not a length.
        assert!(proc.length(&messages("x", 1), &[(1, 500)], 8).is_err());
    }

    /// A chat's prompt is built once: the same ids and pixels as `prompt`, the positions the
    /// prefill would count (computed here, from the images' sizes), and a request too long
    /// for the model refused with the numbers `length` gives.
    #[test]
    fn a_chat_prompt_carries_its_positions_and_is_checked_first() {
        let (_tmp, proc) = processor_without_weights();
        for sizes in [vec![(48, 64), (37, 100)], vec![(300, 17)], vec![]] {
            let images: Vec<std::sync::Arc<image::DynamicImage>> = sizes
                .iter()
                .map(|&(w, h)| std::sync::Arc::new(picture(w, h)))
                .collect();
            let m = messages("Rate the edit.", images.len());
            let chat = proc.chat_prompt(&m, &images, 16).unwrap();
            let plain = proc.prompt(&m, &images).unwrap();
            assert_eq!(chat.ids, plain.ids, "{sizes:?}");
            assert_eq!(chat.images, plain.images, "{sizes:?}");
            let grids = chat
                .images
                .as_ref()
                .map_or(Vec::new(), |i| i.image_grid_thw.clone());
            let counted = MropePositions::count(&chat.ids, &grids, &proc.config).unwrap();
            assert_eq!(chat.positions.as_ref(), Some(&counted), "{sizes:?}");
            assert_eq!(plain.positions.as_ref(), Some(&counted), "{sizes:?}");
            let hw: Vec<(usize, usize)> = sizes
                .iter()
                .map(|&(w, h)| (h as usize, w as usize))
                .collect();
            assert_eq!(counted.span(), proc.positions(&m, &hw).unwrap());
        }
        let long = messages(&"make the sky red ".repeat(600), 1);
        let image = [std::sync::Arc::new(picture(48, 64))];
        let want = proc
            .length(&long, &[(64, 48)], 128)
            .unwrap()
            .check()
            .unwrap_err()
            .to_string();
        let err = proc
            .chat_prompt(&long, &image, 128)
            .unwrap_err()
            .to_string();
        assert_eq!(err, want);
    }
}
