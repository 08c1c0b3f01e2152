//! Checkpoints, tokenizers, chat templates and the Qwen decoder for fleet.
//!
//! ```no_run
//! use fleet_models::{LoadOptions, TextModel, ChatMessage, GenerationRequest};
//!
//! # fn main() -> fleet_models::Result<()> {
//! let model = TextModel::load("Qwen/Qwen2.5-0.5B-Instruct", &LoadOptions::default())?;
//! let prompt = model.chat_prompt(&[ChatMessage::new("user", "Hello!")], true)?;
//! let out = model.generate(&[GenerationRequest::greedy(prompt, 32)], None)?;
//! println!("{}", out[0].text);
//! # Ok(()) }
//! ```
//!
//! The pieces are usable alone: [`ModelSource`] finds a checkpoint's files, [`QwenConfig`]
//! reads its config, [`Weights`] maps its shards, [`QwenModel`] runs it on the devices of a
//! [`DeviceMap`], [`Generator`] batches requests over a KV cache.

pub mod attention;
pub mod config;
pub mod device;
pub mod embedder;
mod error;
pub mod generation;
pub mod kv_blocks;
pub mod kv_cache;
pub mod lora;
pub mod ops;
pub mod profile;
pub mod qwen;
pub mod qwen3_vl;
mod rope;
pub mod source;
pub mod tokenizer;
mod upload;
pub mod vision;
pub mod weights;

use std::path::Path;

pub use candle_core::DType;
pub use config::{GenerationConfig, QwenArch, QwenConfig};
pub use device::{default_dtype, dtype_or_default, open_device, parse_dtype, Devices};
pub use embedder::{EmbedderId, EmbedderOptions, Pooling, SentenceEmbedder};
pub use error::{ModelError, Result};
pub use fleet_topology::{DeviceLocation, DeviceMap};
pub use generation::{
    continuation_logprobs, FinishReason, GenerationOutput, GenerationRequest, Generator,
    PagedOptions, PagedSession, PagedStats, SamplingParams, StreamEvent,
};
pub use kv_cache::KvCache;
pub use qwen::QwenModel;
pub use qwen3_vl::{MropePositions, Qwen3VlConfig, Qwen3VlModel, VisionLanguageModel, VlPrompt};
pub use source::{CheckpointFiles, CheckpointIdentity, HubOptions, ModelSource};
pub use tokenizer::{ChatMessage, ChatTemplate, TextTokenizer};
pub use weights::Weights;

/// How to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Compute dtype.
    pub dtype: DType,
    /// Where each block goes; `None` puts everything on the CPU.
    pub device_map: Option<DeviceMap>,
    /// Hub revision (branch, tag or commit) for hub ids.
    pub revision: Option<String>,
    /// Hub cache and offline mode.
    pub hub: HubOptions,
    /// Which of transformers' image-processor backends a vision checkpoint's images are
    /// prepared with: torchvision (transformers' default) or Pillow
    /// ([`vision::ResizeBackend`]). Text checkpoints ignore it.
    pub image_backend: vision::ResizeBackend,
    /// Vision-language checkpoints: generate each batch with continuous batching on a paged
    /// KV cache, this many replies decoding at once (a finished reply's place goes at once to
    /// the next request of the batch; the tokens are the same); `None`: one left-padded batch.
    /// Text checkpoints ignore it (their callers choose per call).
    pub decode_slots: Option<usize>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            dtype: DType::F32,
            device_map: None,
            revision: None,
            hub: HubOptions::from_env(),
            image_backend: vision::ResizeBackend::default(),
            decode_slots: None,
        }
    }
}

/// A checkpoint as every model loader starts from it (inference's [`TextModel::load`] and
/// [`VisionLanguageModel::load`], training's `TrainableQwen::load`): its files found (a local
/// directory or the hub), its config read as `C`, its weights mapped, and where its blocks go
/// (`opts.device_map`, else the CPU).
pub(crate) struct Checkpoint<C> {
    pub(crate) source: ModelSource,
    pub(crate) files: CheckpointFiles,
    pub(crate) config: C,
    pub(crate) weights: Weights,
    pub(crate) map: DeviceMap,
}

impl<C> Checkpoint<C> {
    /// Opens `spec`, reading its config.json with `read` (`layers` counts its decoder layers).
    pub(crate) fn open<E>(
        spec: &str,
        opts: &LoadOptions,
        read: impl Fn(&std::path::Path) -> Result<C, E>,
        layers: impl Fn(&C) -> usize,
    ) -> Result<Self>
    where
        ModelError: From<E>,
    {
        let source = ModelSource::parse(spec, opts.revision.as_deref())?;
        let files = source.resolve(&opts.hub)?;
        let config = read(&files.config)?;
        let map = opts
            .device_map
            .clone()
            .unwrap_or_else(|| DeviceMap::single(DeviceLocation::Cpu, layers(&config)));
        let weights = Weights::from_safetensors(&files.weights)?;
        Ok(Checkpoint {
            source,
            files,
            config,
            weights,
            map,
        })
    }
}

impl Checkpoint<QwenConfig> {
    /// A Qwen2/Qwen3 text checkpoint.
    pub(crate) fn open_text(spec: &str, opts: &LoadOptions) -> Result<Self> {
        Self::open(spec, opts, QwenConfig::from_file, |c| c.num_hidden_layers)
    }
}

/// A loaded checkpoint: the model with its tokenizer, chat template and generation defaults.
pub struct TextModel {
    /// Where it came from.
    pub source: ModelSource,
    /// The decoder.
    pub model: QwenModel,
    /// tokenizer.json, when the checkpoint has one.
    pub tokenizer: Option<TextTokenizer>,
    /// The chat template, when tokenizer_config.json has one.
    pub chat_template: Option<ChatTemplate>,
    /// generation_config.json (defaults when absent).
    pub generation_config: GenerationConfig,
    /// The files that were loaded.
    pub files: CheckpointFiles,
}

impl TextModel {
    /// Loads a local directory or hub id (`owner/name`) with the given options.
    pub fn load(spec: &str, opts: &LoadOptions) -> Result<Self> {
        let c = Checkpoint::open_text(spec, opts)?;
        let model = QwenModel::new(&c.config, &c.weights, opts.dtype, &c.map)?;
        Self::with_model(c.source, c.files, model)
    }

    /// The checkpoint's tokenizer, chat template and generation config around a model built
    /// elsewhere from its weights (a trainer's inference copy of the weights it trains).
    pub fn with_model(
        source: ModelSource,
        files: CheckpointFiles,
        model: QwenModel,
    ) -> Result<Self> {
        let cfg = model.config().clone();
        let tokenizer = files
            .tokenizer
            .as_deref()
            .map(TextTokenizer::from_file)
            .transpose()?;
        if let Some(t) = &tokenizer {
            if t.vocab_size() > cfg.vocab_size {
                return Err(ModelError::Tokenizer {
                    path: files.tokenizer.clone().unwrap_or_default(),
                    message: format!(
                        "has {} tokens but the model's vocab_size is {}; tokenizer and weights are from different models",
                        t.vocab_size(),
                        cfg.vocab_size
                    ),
                });
            }
        }
        let chat_template = match &files.tokenizer_config {
            Some(p) => ChatTemplate::from_tokenizer_config(p)?,
            None => None,
        };
        let generation_config = match &files.generation_config {
            Some(p) => GenerationConfig::from_file(p)?,
            None => GenerationConfig::default(),
        };
        Ok(TextModel {
            source,
            model,
            tokenizer,
            chat_template,
            generation_config,
            files,
        })
    }

    /// The tokenizer, or an error naming what is missing.
    pub fn tokenizer(&self) -> Result<&TextTokenizer> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| ModelError::MissingFile {
                path: Path::new(&self.files.origin).join("tokenizer.json"),
                hint: "this checkpoint has no tokenizer; pass token ids instead of text".into(),
            })
    }

    /// Token ids of a chat rendered with the checkpoint's template.
    pub fn chat_prompt(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text = self.chat_text(messages, add_generation_prompt)?;
        self.tokenizer()?.encode(&text)
    }

    /// A chat rendered with the checkpoint's template, as text (what [`TextModel::chat_prompt`]
    /// tokenizes). Callers that cache by prompt use it to skip tokenizing prompts seen before.
    pub fn chat_text(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| ModelError::MissingFile {
                path: Path::new(&self.files.origin).join("tokenizer_config.json"),
                hint: "this checkpoint has no chat_template; use a plain prompt".into(),
            })?;
        template.render(messages, add_generation_prompt, &Default::default())
    }

    /// EOS ids: generation_config.json's, else config.json's, else `<|im_end|>` / `<|endoftext|>`.
    pub fn eos_ids(&self) -> Vec<u32> {
        stop_ids(
            &self.generation_config,
            self.model.config(),
            self.tokenizer.as_ref(),
        )
    }

    /// The padding id (any id works, padded positions are masked; Qwen uses `<|endoftext|>`).
    pub fn pad_id(&self) -> u32 {
        padding_id(&self.generation_config, &self.eos_ids())
    }

    /// A generator with this checkpoint's tokenizer and stop ids.
    pub fn generator(&self) -> Generator<'_> {
        Generator::new(
            &self.model,
            self.tokenizer.as_ref(),
            self.eos_ids(),
            self.pad_id(),
        )
    }

    /// Generates continuations for a batch of requests (see [`Generator::generate`]).
    pub fn generate(
        &self,
        requests: &[GenerationRequest],
        on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
    ) -> Result<Vec<GenerationOutput>> {
        self.generator().generate(requests, on_token)
    }
}

/// EOS ids of a checkpoint: generation_config.json's, else config.json's, else the tokenizer's
/// `<|im_end|>` / `<|endoftext|>`.
pub(crate) fn stop_ids(
    generation: &GenerationConfig,
    config: &QwenConfig,
    tokenizer: Option<&TextTokenizer>,
) -> Vec<u32> {
    let mut ids = generation.eos_token_ids();
    if ids.is_empty() {
        ids = config.eos_token_ids();
    }
    if ids.is_empty() {
        if let Some(t) = tokenizer {
            ids.extend(
                ["<|im_end|>", "<|endoftext|>"]
                    .iter()
                    .filter_map(|s| t.token_id(s)),
            );
        }
    }
    ids
}

/// The padding id: generation_config.json's, else the first EOS id, else 0 (any id works:
/// padded positions are masked).
pub(crate) fn padding_id(generation: &GenerationConfig, eos: &[u32]) -> u32 {
    generation
        .pad_token_id()
        .or_else(|| eos.first().copied())
        .unwrap_or(0)
}
