//! The kinds of model the replica layer serves. A kind says how to load a model, how many
//! decoder layers its checkpoint has (for a CPU replica's device map), how to generate a batch
//! of its requests, and how a batch crosses to a replica process and is answered there.
//! Everything else — placement, processes, the pool — is the same code for every kind.

use std::path::Path;

use fleet_models::{
    DeviceMap, GenerationOutput, GenerationRequest, LoadOptions, ModelError, Qwen3VlConfig,
    QwenConfig, Result, TextModel, VisionLanguageModel,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::chat::{generate_chats, ChatOutcome, ChatRequest};
use crate::process::StreamWorker;
use crate::stream::{LocalStream, StreamConfig};
use crate::wire::{Spool, WireChat};

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Text {}
    impl Sealed for super::VisionLanguage {}
}

/// A kind of model served by [`crate::Replicas`]: [`Text`] or [`VisionLanguage`]. Sealed: a
/// replica process must know every kind it may be asked to serve (a new Qwen-family kind adds
/// an implementation here and a line in [`crate::process`]).
pub trait ModelKind: sealed::Sealed + Sized + 'static {
    /// The loaded model.
    type Model: Send + Sync + 'static;
    /// One request.
    type Request: Sync;
    /// What one request gives.
    type Output: Serialize + DeserializeOwned + Send;
    /// The kind's name in a replica worker's spec.
    const NAME: &'static str;
    /// How its replicas are called in logs.
    const LABEL: &'static str;

    /// Loads a checkpoint (a local directory or hub id) on `opts.device_map`.
    fn load(spec: &str, opts: &LoadOptions) -> Result<Self::Model>;

    /// Decoder layers of the checkpoint whose config.json is `config`.
    fn layers(config: &Path) -> Result<usize>;

    /// Where the model's blocks are.
    fn device_map(model: &Self::Model) -> &DeviceMap;

    /// Generates one batch on a model of this process, one output per request, in order.
    fn generate(model: &Self::Model, batch: &[Self::Request]) -> Result<Vec<Self::Output>>;

    /// A batch as the JSON line a replica process reads (images, if any, as files of `spool`).
    fn encode(batch: &[Self::Request], spool: &Spool) -> Result<String>;

    /// In a replica process: a batch line read and generated; `Err` when the whole batch
    /// failed.
    fn serve(model: &Self::Model, line: &str) -> std::result::Result<Vec<Self::Output>, String>;

    /// In a replica process: continuous batching on `model` ([`crate::ReplicaStream`]), for
    /// the kinds that stream.
    fn open_stream(
        model: &Self::Model,
        config: StreamConfig,
    ) -> Result<Box<dyn StreamWorker + '_>> {
        let _ = (model, config);
        Err(ModelError::Replicas(format!(
            "{} replicas do not stream",
            Self::NAME
        )))
    }
}

fn encode_error(e: serde_json::Error) -> ModelError {
    ModelError::Replicas(format!("a batch for a replica process: {e}"))
}

fn unparsed(e: serde_json::Error) -> String {
    format!("a batch that does not parse: {e}")
}

/// Qwen2/Qwen2.5/Qwen3 text checkpoints ([`TextModel`]): batches of token-id
/// [`GenerationRequest`]s (jobs render and tokenize their chats, and cache by prompt).
#[derive(Debug, Clone, Copy)]
pub enum Text {}

impl ModelKind for Text {
    type Model = TextModel;
    type Request = GenerationRequest;
    type Output = GenerationOutput;
    const NAME: &'static str = "text";
    const LABEL: &'static str = "replica";

    fn load(spec: &str, opts: &LoadOptions) -> Result<TextModel> {
        TextModel::load(spec, opts)
    }

    fn layers(config: &Path) -> Result<usize> {
        Ok(QwenConfig::from_file(config)?.num_hidden_layers)
    }

    fn device_map(model: &TextModel) -> &DeviceMap {
        model.model.device_map()
    }

    fn generate(model: &TextModel, batch: &[GenerationRequest]) -> Result<Vec<GenerationOutput>> {
        model.generate(batch, None)
    }

    fn encode(batch: &[GenerationRequest], _: &Spool) -> Result<String> {
        serde_json::to_string(batch).map_err(encode_error)
    }

    fn serve(model: &TextModel, line: &str) -> std::result::Result<Vec<GenerationOutput>, String> {
        let batch: Vec<GenerationRequest> = serde_json::from_str(line).map_err(unparsed)?;
        model.generate(&batch, None).map_err(|e| e.to_string())
    }

    fn open_stream(model: &TextModel, config: StreamConfig) -> Result<Box<dyn StreamWorker + '_>> {
        Ok(Box::new(LocalStream::new(model, config)?))
    }
}

/// Qwen3-VL checkpoints ([`VisionLanguageModel`]): batches of [`ChatRequest`]s, one
/// [`ChatOutcome`] each (a request that cannot be answered fails alone).
#[derive(Debug, Clone, Copy)]
pub enum VisionLanguage {}

impl ModelKind for VisionLanguage {
    type Model = VisionLanguageModel;
    type Request = ChatRequest;
    type Output = ChatOutcome;
    const NAME: &'static str = "vision_language";
    const LABEL: &'static str = "judge replica";

    fn load(spec: &str, opts: &LoadOptions) -> Result<VisionLanguageModel> {
        VisionLanguageModel::load(spec, opts)
    }

    fn layers(config: &Path) -> Result<usize> {
        Ok(Qwen3VlConfig::from_file(config)?.text.num_hidden_layers)
    }

    fn device_map(model: &VisionLanguageModel) -> &DeviceMap {
        model.model.text().device_map()
    }

    fn generate(model: &VisionLanguageModel, batch: &[ChatRequest]) -> Result<Vec<ChatOutcome>> {
        generate_chats(model, batch)
    }

    /// The requests as they are, their images written to the spool in parallel.
    fn encode(batch: &[ChatRequest], spool: &Spool) -> Result<String> {
        use rayon::prelude::*;
        let wire = batch
            .par_iter()
            .map(|r| WireChat::new(r, spool))
            .collect::<Result<Vec<_>>>()?;
        serde_json::to_string(&wire).map_err(encode_error)
    }

    /// The images read back (in parallel, as the parent wrote them; a request whose images
    /// do not read fails alone), the rest generated as one batch.
    fn serve(
        model: &VisionLanguageModel,
        line: &str,
    ) -> std::result::Result<Vec<ChatOutcome>, String> {
        use rayon::prelude::*;
        let batch: Vec<WireChat<ChatRequest>> = serde_json::from_str(line).map_err(unparsed)?;
        let n = batch.len();
        let mut outcomes: Vec<Option<ChatOutcome>> = vec![None; n];
        let mut requests = Vec::with_capacity(n);
        let mut index = Vec::with_capacity(n);
        let read: Vec<_> = batch.into_par_iter().map(WireChat::into_request).collect();
        for (i, r) in read.into_iter().enumerate() {
            match r {
                Ok(r) => {
                    requests.push(r);
                    index.push(i);
                }
                Err(e) => outcomes[i] = Some(Err(format!("request {i}: {e}"))),
            }
        }
        if !requests.is_empty() {
            let out = generate_chats(model, &requests).map_err(|e| e.to_string())?;
            for (i, o) in index.into_iter().zip(out) {
                outcomes[i] = Some(o);
            }
        }
        Ok(outcomes
            .into_iter()
            .map(|o| o.expect("every request has an outcome"))
            .collect())
    }
}
