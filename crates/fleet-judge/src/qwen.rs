//! The Qwen3-VL judge: [`Judge`] over fleet-serve's Qwen3-VL replicas
//! ([`fleet_serve::Replica`] of [`VisionLanguage`]), one judge per replica.
//!
//! - A [`JudgeRequest`] becomes one [`ChatRequest`] ([`chat_request`]), the request that
//!   reaches the model's generate call, its images shared, not copied. Its messages are
//!   transformers' message list ([`messages`]): the system text as
//!   `{"role": "system", "content": text}`, then `{"role": "user", "content": [{"type":
//!   "image"}, …, {"type": "text", "text": …}]}` with the parts in the request's order, rendered
//!   by the checkpoint's own chat template (with the generation prompt) and tokenized with each
//!   image's pad token expanded, as `Qwen3VLProcessor` does.
//! - Decoding is greedy unless the [`Decoding`] samples; sampling maps onto fleet-models'
//!   [`SamplingParams`] with the recorded seed ([`sampling_params`]). The checkpoint's
//!   generation_config.json sampling defaults are not used.
//! - A batch of requests is one left-padded `generate` call on the replica. A request whose
//!   prompt cannot be built (an image the processor refuses, a prompt longer than the model
//!   takes) fails alone; a batch that fails as a whole (the device, a replica process that
//!   died) fails every request, and the run loop hands it to another judge.
//! - [`judge_model_id`]: what identifies the judge's answers in every record's key — the hub
//!   id at the resolved commit, or a local directory's content digests, plus the dtype.
//!
//! ```no_run
//! use fleet_judge::qwen::{judge_model_id, load_judges};
//! use fleet_models::LoadOptions;
//! use fleet_serve::{PlacementRequest, PlanMode};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let opts = LoadOptions::default();
//! let model = "Qwen/Qwen3-VL-8B-Instruct";
//! let id = judge_model_id(model, &opts)?;
//! let judges = load_judges(model, &opts, &PlacementRequest::new(PlanMode::Auto), &id)?;
//! # Ok(()) }
//! ```

use std::path::{Component, Path};
use std::sync::Arc;

use fleet_models::{DeviceMap, FinishReason, LoadOptions, ModelSource, SamplingParams};
use fleet_serve::{ChatRequest, PlacementRequest, Replica, Replicas, VisionLanguage};
use image::DynamicImage;
use serde_json::{json, Value};

use crate::benchmark::{ImageRef, Item, Loaded, SkipKind, Skipped};
use crate::judge::{Decoding, Judge, JudgeReply, JudgeRequest, Part};
use crate::prompts::{ImageRole, PromptError, PromptSet};
use fleet_models::qwen3_vl::VlProcessor;

/// transformers' message list for a request, and the images of its image parts in order.
pub fn messages(request: &JudgeRequest) -> (Value, Vec<Arc<DynamicImage>>) {
    let mut images = Vec::with_capacity(request.image_count());
    let parts = request.user.iter().map(|part| match part {
        Part::Image(img) => {
            images.push(img.clone());
            None
        }
        Part::Text(text) => Some(text.as_str()),
    });
    let m = message_list(request.system.as_deref(), parts);
    (m, images)
}

/// transformers' message list: the system text, then one user message whose parts are images
/// (`None`) and texts in order.
fn message_list<'a>(system: Option<&str>, user: impl Iterator<Item = Option<&'a str>>) -> Value {
    let mut out = Vec::with_capacity(2);
    if let Some(system) = system {
        out.push(json!({"role": "system", "content": system}));
    }
    let content: Vec<Value> = user
        .map(|part| match part {
            None => json!({"type": "image"}),
            Some(text) => json!({"type": "text", "text": text}),
        })
        .collect();
    out.push(json!({"role": "user", "content": content}));
    Value::Array(out)
}

/// Moves to `loaded.skipped` ([`SkipKind::PromptTooLong`], with the numbers) every item one of
/// whose calls cannot fit the judge: the call as the run will send it (its images at their
/// sizes — the edit at the source's when `resize_edited_to_source` — then the rendered text)
/// takes, with `max_new_tokens`, more positions than the checkpoint has. Counted by the
/// checkpoint's processor ([`VlProcessor::length`], the model's own computation), without
/// weights, so that such an item is refused before anything loads instead of failing at judge
/// time. Returns how many items were moved.
pub fn skip_too_long(
    loaded: &mut Loaded,
    prompts: &PromptSet,
    processor: &VlProcessor,
    max_new_tokens: usize,
    resize_edited_to_source: bool,
) -> Result<usize, PromptError> {
    let mut kept = Vec::with_capacity(loaded.items.len());
    let mut moved = 0;
    for item in std::mem::take(&mut loaded.items) {
        match too_long(
            &item,
            prompts,
            processor,
            max_new_tokens,
            resize_edited_to_source,
        )? {
            None => kept.push(item),
            Some(reason) => {
                moved += 1;
                loaded
                    .skipped
                    .push(Skipped::new(item.id, SkipKind::PromptTooLong, reason));
            }
        }
    }
    loaded.items = kept;
    Ok(moved)
}

/// Why `item` cannot be judged for its length (or its images' headers), if it cannot.
fn too_long(
    item: &Item,
    prompts: &PromptSet,
    processor: &VlProcessor,
    max_new_tokens: usize,
    resize_edited_to_source: bool,
) -> Result<Option<String>, PromptError> {
    let size = |r: &ImageRef| r.dimensions().map(|(w, h)| (h as usize, w as usize));
    let (source, edited) = match (size(&item.source), size(&item.edited)) {
        (Ok(s), Ok(e)) => (s, if resize_edited_to_source { s } else { e }),
        (Err(e), _) | (_, Err(e)) => {
            return Ok(Some(format!("an image's header cannot be read: {e}")))
        }
    };
    for call in &prompts.calls {
        let (system, user) = prompts.render(call, item)?;
        let sizes: Vec<(usize, usize)> = call
            .images
            .iter()
            .map(|role| match role {
                ImageRole::Source => source,
                ImageRole::Edited => edited,
            })
            .collect();
        let parts = call
            .images
            .iter()
            .map(|_| None)
            .chain(std::iter::once(Some(user.as_str())));
        let m = message_list(system.as_deref(), parts);
        let length = match processor.length(&m, &sizes, max_new_tokens) {
            Ok(l) => l,
            Err(e) => return Ok(Some(format!("call {}: {e}", call.name))),
        };
        if !length.fits() {
            return Ok(Some(format!(
                "call {} takes {} positions (prompt {} with its images + max_new_tokens {}) \
                 but the judge has max_position_embeddings = {}; shorten the instruction, \
                 shrink the images or lower --max-new-tokens",
                call.name,
                length.total(),
                length.prompt,
                length.max_new_tokens,
                length.max_positions
            )));
        }
    }
    Ok(None)
}

/// fleet-models' sampling for a decoding: greedy (`temperature` 0) unless it samples, then
/// its temperature, top-p, top-k and seed.
pub fn sampling_params(decoding: &Decoding) -> SamplingParams {
    match &decoding.sampling {
        None => SamplingParams::greedy(),
        Some(s) => SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            seed: s.seed,
            ..SamplingParams::greedy()
        },
    }
}

/// The model's request for a judge request: its messages, its images (shared), and the
/// decoding.
pub fn chat_request(request: &JudgeRequest, decoding: &Decoding) -> ChatRequest {
    let (messages, images) = messages(request);
    ChatRequest {
        messages,
        images,
        max_new_tokens: decoding.max_new_tokens,
        sampling: sampling_params(decoding),
        stop_strings: Vec::new(),
    }
}

/// A Qwen3-VL checkpoint as a [`Judge`]: one replica (here or in a process of its own).
pub struct Qwen3VlJudge {
    replica: Replica<VisionLanguage>,
    model_id: String,
}

impl Qwen3VlJudge {
    /// A judge over `replica`, reporting `model_id` ([`judge_model_id`] of the checkpoint it
    /// loaded).
    pub fn new(replica: Replica<VisionLanguage>, model_id: String) -> Self {
        Qwen3VlJudge { replica, model_id }
    }

    /// The replica.
    pub fn replica(&self) -> &Replica<VisionLanguage> {
        &self.replica
    }

    /// A short name for logs and progress bars: the replica's devices (and pid).
    pub fn name(&self) -> String {
        self.replica.name()
    }
}

impl Judge for Qwen3VlJudge {
    fn model_id(&self) -> String {
        self.model_id.clone()
    }

    fn judge(
        &mut self,
        batch: &[JudgeRequest],
        decoding: &Decoding,
    ) -> Vec<std::result::Result<JudgeReply, String>> {
        let requests: Vec<ChatRequest> = batch.iter().map(|r| chat_request(r, decoding)).collect();
        match self.replica.generate(&requests) {
            Ok(outcomes) => outcomes
                .into_iter()
                .map(|o| {
                    o.map(|g| JudgeReply {
                        new_tokens: g.token_ids.len(),
                        stopped_at_eos: g.finish_reason == FinishReason::Eos,
                        text: g.text,
                    })
                })
                .collect(),
            // The error names the replica (its devices, and the process when it runs in one).
            Err(e) => vec![Err(e.to_string()); batch.len()],
        }
    }
}

/// The commit of a hub snapshot path (`…/snapshots/<commit>/file`), if it is one.
fn snapshot_commit(path: &Path) -> Option<String> {
    let parts: Vec<Component<'_>> = path.components().collect();
    parts.windows(2).find_map(|w| match (w[0], w[1]) {
        (Component::Normal(a), Component::Normal(b)) if a == "snapshots" => {
            let commit = b.to_string_lossy().to_string();
            (commit.len() >= 7 && commit.chars().all(|c| c.is_ascii_hexdigit())).then_some(commit)
        }
        _ => None,
    })
}

/// What identifies a judge's answers (part of every record's key and of the output
/// directory's manifest): for a hub id, `owner/name@<commit>` — the commit the revision
/// resolved to in the hub cache (`@<revision>` when the files are not in a snapshot); for a
/// local directory, its name and the content digests of its weights, config and
/// tokenizer/processor files (`qwen3-vl-tiny@fnv1a64w:<weights>.<config>.<tokenizer>`, so the
/// same files anywhere share records and changed files do not); then the dtype.
///
/// Resolving a hub id fetches its files (or needs them cached with `HF_HUB_OFFLINE=1`); a
/// local directory's weights are read once for the digest.
pub fn judge_model_id(spec: &str, opts: &LoadOptions) -> fleet_models::Result<String> {
    let source = ModelSource::parse(spec, opts.revision.as_deref())?;
    let files = source.resolve(&opts.hub)?;
    let dtype = opts.dtype.as_str();
    Ok(match &source {
        ModelSource::Hub { repo, revision } => {
            let commit = files
                .weights
                .first()
                .and_then(|p| snapshot_commit(p))
                .unwrap_or_else(|| revision.clone());
            format!("{repo}@{commit} {dtype}")
        }
        ModelSource::Local(dir) => {
            let id = files.identity()?;
            let strip = |d: &str| d.trim_start_matches("fnv1a64w:").to_string();
            let name = dir
                .canonicalize()
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().to_string()))
                .or_else(|| dir.file_name().map(|n| n.to_string_lossy().to_string()))
                .unwrap_or_else(|| "local".to_string());
            format!(
                "{name}@fnv1a64w:{}.{}.{} {dtype}",
                strip(&id.weights_digest),
                strip(&id.config_digest),
                strip(&id.tokenizer_digest)
            )
        }
    })
}

/// Loads one judge per device map (see [`Replicas::load`]: the first replica here, the
/// others in child processes of this program when it opted in and they use GPUs).
pub fn load_judges_on(
    spec: &str,
    opts: &LoadOptions,
    maps: &[DeviceMap],
    model_id: &str,
) -> fleet_models::Result<Vec<Qwen3VlJudge>> {
    Ok(judges(Replicas::load(spec, opts, maps)?, model_id))
}

/// One judge per replica.
fn judges(replicas: Replicas<VisionLanguage>, model_id: &str) -> Vec<Qwen3VlJudge> {
    replicas
        .into_replicas()
        .into_iter()
        .map(|r| Qwen3VlJudge::new(r, model_id.to_string()))
        .collect()
}

/// Plans the judge's replicas on this machine (`--gpu-mode`, `--gpu-ids`, `--max-memory`:
/// one replica per GPU, or per GPU group when it does not fit one; one CPU replica without
/// GPUs) and loads one judge per replica.
pub fn load_judges(
    spec: &str,
    opts: &LoadOptions,
    placement: &PlacementRequest,
    model_id: &str,
) -> fleet_models::Result<Vec<Qwen3VlJudge>> {
    Ok(judges(
        Replicas::load_planned(spec, opts, placement)?,
        model_id,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::Sampling;

    #[test]
    fn requests_become_transformers_messages() {
        let img = Arc::new(DynamicImage::new_rgb8(2, 2));
        let r = JudgeRequest {
            system: Some("sys".into()),
            user: vec![
                Part::Image(img.clone()),
                Part::Image(img),
                Part::Text("judge".into()),
            ],
        };
        let (m, images) = messages(&r);
        assert_eq!(images.len(), 2);
        assert_eq!(
            m,
            json!([
                {"role": "system", "content": "sys"},
                {"role": "user", "content": [
                    {"type": "image"}, {"type": "image"}, {"type": "text", "text": "judge"}
                ]}
            ])
        );
        let (m, images) = messages(&JudgeRequest {
            system: None,
            user: vec![Part::Text("only text".into())],
        });
        assert!(images.is_empty());
        assert_eq!(m.as_array().unwrap().len(), 1);
    }

    #[test]
    fn decoding_maps_onto_sampling_params() {
        assert_eq!(
            sampling_params(&Decoding::greedy(8)),
            SamplingParams::greedy()
        );
        let d = Decoding {
            max_new_tokens: 8,
            sampling: Some(Sampling {
                temperature: 0.7,
                top_p: Some(0.8),
                top_k: Some(20),
                seed: 11,
                sampler_version: fleet_models::ops::SAMPLER_VERSION,
            }),
        };
        assert_eq!(
            sampling_params(&d),
            SamplingParams {
                temperature: 0.7,
                top_k: Some(20),
                top_p: Some(0.8),
                seed: 11,
                ..SamplingParams::greedy()
            }
        );
    }

    #[test]
    fn hub_snapshot_commits_are_found() {
        let p = Path::new("/h/hub/models--Qwen--Qwen3-VL-8B-Instruct/snapshots/0123abcd4567/model-00001-of-00004.safetensors");
        assert_eq!(snapshot_commit(p).as_deref(), Some("0123abcd4567"));
        assert_eq!(
            snapshot_commit(Path::new("/data/ckpt/model.safetensors")),
            None
        );
    }
}
