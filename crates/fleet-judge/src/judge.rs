//! The boundary to the model: what a judge is asked and what it answers.
//!
//! A [`Judge`] takes a batch of [`JudgeRequest`]s (a chat of an optional system message and one
//! user message made of images and text, in order) and decodes each with the same
//! [`Decoding`]. It returns one result per request, in order: a [`JudgeReply`] or the reason
//! that request failed. Everything else — which prompt, which images, parsing the reply,
//! records — is this crate's, so a judge only runs a model.
//!
//! The Qwen3-VL judge ([`crate::qwen`], on fleet-serve's replicas) implements this trait; the
//! orchestration is tested with scripted judges (test code only).

use std::sync::Arc;

use image::DynamicImage;
use serde::{Deserialize, Serialize};

/// One piece of a user message: an image, or text. Parts are shown to the model in order.
#[derive(Debug, Clone)]
pub enum Part {
    /// An image (decoded; resized by this crate only where a benchmark's own scorer resizes).
    Image(Arc<DynamicImage>),
    /// Text.
    Text(String),
}

/// One conversation to judge: an optional system message, then one user message.
#[derive(Debug, Clone)]
pub struct JudgeRequest {
    /// The system message, if the prompt set has one.
    pub system: Option<String>,
    /// The user message's parts, in order (images first, then the text, as the original
    /// scorer and VIEScore send them).
    pub user: Vec<Part>,
}

impl JudgeRequest {
    /// The number of images in the user message.
    pub fn image_count(&self) -> usize {
        self.user
            .iter()
            .filter(|p| matches!(p, Part::Image(_)))
            .count()
    }

    /// The user message's text parts, concatenated (for logs and tests).
    pub fn user_text(&self) -> String {
        self.user
            .iter()
            .filter_map(|p| match p {
                Part::Text(t) => Some(t.as_str()),
                Part::Image(_) => None,
            })
            .collect()
    }
}

/// Sampling settings. Names and meaning follow fleet-models' `SamplingParams` (and
/// transformers' `generate`): `top_k` is applied after the temperature, `None` turns a filter
/// off.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sampling {
    /// Softmax temperature, > 0.
    pub temperature: f64,
    /// Nucleus filter: keep the smallest set of tokens whose probability reaches `top_p`.
    pub top_p: Option<f64>,
    /// Keep only the `top_k` most likely tokens.
    pub top_k: Option<usize>,
    /// The seed. Every request of a batch samples with this seed (fleet-models seeds each
    /// request's generator on its own), so a reply does not depend on the batch it was in.
    pub seed: u64,
    /// The version of fleet-models' sampler that draws the replies
    /// ([`fleet_models::ops::SAMPLER_VERSION`]; 1 in records that do not say): it is part of
    /// the decoding, so records drawn by another version are never reused.
    #[serde(default = "first_sampler_version")]
    pub sampler_version: u32,
}

/// The sampler version of records written before versions were recorded.
fn first_sampler_version() -> u32 {
    1
}

/// How replies are decoded.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decoding {
    /// The most tokens a reply may have.
    pub max_new_tokens: usize,
    /// `None`: greedy (the default; the original scorer used the checkpoint's sampling
    /// defaults instead). `Some`: sampled, with its seed recorded in every record.
    pub sampling: Option<Sampling>,
}

impl Decoding {
    /// Greedy decoding of at most `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Decoding {
            max_new_tokens,
            sampling: None,
        }
    }

    /// `greedy` or `sampled (T=…, top_p=…, top_k=…, seed=…)`, for reports.
    pub fn describe(&self) -> String {
        match &self.sampling {
            None => format!("greedy, max_new_tokens={}", self.max_new_tokens),
            Some(s) => format!(
                "sampled (temperature={}, top_p={}, top_k={}, seed={}, sampler v{}), max_new_tokens={}",
                s.temperature,
                s.top_p.map_or("off".to_string(), |p| p.to_string()),
                s.top_k.map_or("off".to_string(), |k| k.to_string()),
                s.seed,
                s.sampler_version,
                self.max_new_tokens
            ),
        }
    }
}

/// A judge's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JudgeReply {
    /// The decoded reply (special tokens skipped).
    pub text: String,
    /// Tokens generated.
    pub new_tokens: usize,
    /// Whether generation ended at an end-of-sequence token (`false`: it hit
    /// `max_new_tokens`, and the reply may be cut off).
    pub stopped_at_eos: bool,
}

/// A model that judges batches of requests.
///
/// Implementations load the model once and answer many batches; a run holds one judge per
/// replica (one per GPU, or per GPU group).
pub trait Judge {
    /// What identifies the model's answers: the checkpoint and its revision or content digest,
    /// e.g. `Qwen/Qwen3-VL-8B-Instruct@<revision>` or `<dir>@<sha of config and weights>`, plus
    /// anything else that changes a reply (dtype). It is part of every record's key: a record
    /// is reused only for the same model id.
    fn model_id(&self) -> String;

    /// Judges a batch: one result per request, in the order given. A request that fails (it
    /// does not fit, the device failed) is `Err` with the reason; a judge whose whole batch
    /// failed returns `Err` for every request. Never a made-up reply.
    fn judge(
        &mut self,
        batch: &[JudgeRequest],
        decoding: &Decoding,
    ) -> Vec<std::result::Result<JudgeReply, String>>;
}

impl<J: Judge + ?Sized> Judge for &mut J {
    fn model_id(&self) -> String {
        (**self).model_id()
    }

    fn judge(
        &mut self,
        batch: &[JudgeRequest],
        decoding: &Decoding,
    ) -> Vec<std::result::Result<JudgeReply, String>> {
        (**self).judge(batch, decoding)
    }
}

impl<J: Judge + ?Sized> Judge for Box<J> {
    fn model_id(&self) -> String {
        (**self).model_id()
    }

    fn judge(
        &mut self,
        batch: &[JudgeRequest],
        decoding: &Decoding,
    ) -> Vec<std::result::Result<JudgeReply, String>> {
        (**self).judge(batch, decoding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding_describes_itself_and_round_trips() {
        assert_eq!(
            Decoding::greedy(128).describe(),
            "greedy, max_new_tokens=128"
        );
        let d = Decoding {
            max_new_tokens: 64,
            sampling: Some(Sampling {
                temperature: 0.7,
                top_p: Some(0.8),
                top_k: None,
                seed: 3,
                sampler_version: fleet_models::ops::SAMPLER_VERSION,
            }),
        };
        assert_eq!(
            d.describe(),
            "sampled (temperature=0.7, top_p=0.8, top_k=off, seed=3, sampler v2), max_new_tokens=64"
        );
        let text = serde_json::to_string(&d).unwrap();
        assert_eq!(serde_json::from_str::<Decoding>(&text).unwrap(), d);
    }

    #[test]
    fn request_counts_images_and_joins_text() {
        let img = Arc::new(DynamicImage::new_rgb8(2, 2));
        let r = JudgeRequest {
            system: None,
            user: vec![
                Part::Image(img.clone()),
                Part::Image(img),
                Part::Text("a".into()),
                Part::Text("b".into()),
            ],
        };
        assert_eq!(r.image_count(), 2);
        assert_eq!(r.user_text(), "ab");
    }
}
