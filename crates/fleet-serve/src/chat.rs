//! The chat request: what a job sends to a vision-language model, from the job to the model's
//! generate call.
//!
//! ```no_run
//! use std::sync::Arc;
//! use fleet_models::LoadOptions;
//! use fleet_serve::{ChatRequest, PlacementRequest, PlanMode, Replicas, VisionLanguage};
//!
//! # fn main() -> fleet_models::Result<()> {
//! let opts = LoadOptions::default();
//! let request = PlacementRequest::new(PlanMode::DataParallel);
//! let replicas = Replicas::<VisionLanguage>::load_planned("Qwen/Qwen3-VL-8B-Instruct", &opts, &request)?;
//! let mut replicas = replicas.into_replicas();
//! let image = Arc::new(image::open("edit.png").expect("an image"));
//! let messages = serde_json::json!([{"role": "user", "content": [
//!     {"type": "image"}, {"type": "text", "text": "Describe the image."}]}]);
//! let batch = vec![ChatRequest::greedy(messages, vec![image], 64)];
//! let outcomes = replicas[0].generate(&batch)?;
//! # Ok(()) }
//! ```

use std::sync::Arc;

use fleet_models::{
    GenerationOutput, GenerationRequest, Result, SamplingParams, VisionLanguageModel, VlPrompt,
};
use image::DynamicImage;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One chat to continue, as a job makes it and as the model's generate call takes it.
///
/// Its images are shared (`Arc`): in this process a request and its images are never copied
/// on their way to the model. Serde carries everything but the pixels (`images` is skipped):
/// the wire to a replica process sends them beside the request, as raw pixel files.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatRequest {
    /// transformers' message list: `{"role": "system"|"user"|"assistant", "content": text or
    /// a list of `{"type": "image"}` / `{"type": "text", "text": …}` parts}`.
    pub messages: Value,
    /// The images of the image parts, in order (none for a text-only chat).
    #[serde(skip)]
    pub images: Vec<Arc<DynamicImage>>,
    /// The most tokens to generate.
    pub max_new_tokens: usize,
    /// Greedy (the default) or seeded sampling.
    pub sampling: SamplingParams,
    /// Stop when the generated text contains any of these.
    pub stop_strings: Vec<String>,
}

impl ChatRequest {
    /// A greedy request of at most `max_new_tokens` tokens.
    pub fn greedy(messages: Value, images: Vec<Arc<DynamicImage>>, max_new_tokens: usize) -> Self {
        ChatRequest {
            messages,
            images,
            max_new_tokens,
            sampling: SamplingParams::greedy(),
            stop_strings: Vec::new(),
        }
    }
}

/// What became of one request of a batch: its output, or why it alone failed (its prompt
/// could not be built, it is too long for the model).
pub type ChatOutcome = std::result::Result<GenerationOutput, String>;

/// Generates a batch on a model of this process. Each request's prompt is built once
/// ([`fleet_models::qwen3_vl::VlProcessor::chat_prompt`]: the template rendered, the length
/// checked from the images' sizes before their pixels are preprocessed, the M-RoPE positions
/// counted once for the check and the prefill); the ones that build are generated together
/// ([`VisionLanguageModel::generate_batch`]: one left-padded batch, or continuous batching
/// through the model's decode slots). One outcome per request, in order (`Err` for a request that cannot be
/// answered); `Err` when the batch as a whole failed.
pub fn generate_chats(
    model: &VisionLanguageModel,
    batch: &[ChatRequest],
) -> Result<Vec<ChatOutcome>> {
    use rayon::prelude::*;
    let mut outcomes: Vec<Option<ChatOutcome>> = vec![None; batch.len()];
    let mut prompts = Vec::with_capacity(batch.len());
    let mut requests = Vec::with_capacity(batch.len());
    let mut index = Vec::with_capacity(batch.len());
    // Prompts are built in parallel: preprocessing a 1024x1024 image takes tens of
    // milliseconds of one core, and a batch holds dozens of images.
    let built: Vec<Result<VlPrompt>> = batch
        .par_iter()
        .map(|r| {
            model
                .processor
                .chat_prompt(&r.messages, &r.images, r.max_new_tokens)
        })
        .collect();
    for ((i, r), built) in batch.iter().enumerate().zip(built) {
        match built {
            Ok(p) => {
                requests.push(GenerationRequest {
                    prompt_ids: p.ids.clone(),
                    max_new_tokens: r.max_new_tokens,
                    sampling: r.sampling.clone(),
                    stop_strings: r.stop_strings.clone(),
                });
                prompts.push(p);
                index.push(i);
            }
            Err(e) => outcomes[i] = Some(Err(format!("request {i}: {e}"))),
        }
    }
    if !prompts.is_empty() {
        let out = model.generate_batch(&prompts, &requests)?;
        for (i, o) in index.into_iter().zip(out) {
            outcomes[i] = Some(Ok(o));
        }
    }
    Ok(outcomes
        .into_iter()
        .map(|o| o.expect("every request has an outcome"))
        .collect())
}
