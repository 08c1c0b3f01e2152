//! A reward model as a reward function: a `*ForSequenceClassification` checkpoint (one label)
//! scores prompt + completion, on its own device, a batch at a time.
//!
//! The text scored is what TRL scores: a plain prompt followed by its completion; for a chat
//! prompt, the conversation with the completion as the assistant's reply, rendered with the
//! reward model's own chat template. The score is the head's output at the last token
//! ([`fleet_models::QwenModel::classify`]), as transformers reads it.

use candle_core::DType;
use fleet_models::{ChatMessage, DeviceLocation, DeviceMap, LoadOptions, TextModel};

use crate::dataset::{Prompt, Sample};
use crate::rewards::{Completion, RewardError, RewardFunction};

/// A loaded reward model.
pub struct RewardModel {
    model: TextModel,
    spec: String,
    pad_id: u32,
}

impl RewardModel {
    /// The function's name (`rewards/reward_model/mean`).
    pub const NAME: &'static str = "reward_model";

    /// Loads `spec` (a directory or hub id) on `placement` (the CPU in f32 when `None`).
    pub fn load(
        spec: &str,
        revision: Option<&str>,
        placement: Option<(&DeviceMap, DType)>,
    ) -> Result<Self, RewardError> {
        let err = |message: String| RewardError::Model {
            model: spec.to_string(),
            message,
        };
        let config = fleet_models::ModelSource::parse(spec, revision)
            .and_then(|s| s.resolve(&fleet_models::HubOptions::from_env()))
            .and_then(|f| Ok(fleet_models::QwenConfig::from_file(&f.config)?))
            .map_err(|e| err(e.to_string()))?;
        match config.classifier_labels() {
            Some(1) => {}
            Some(n) => {
                return Err(err(format!(
                    "its score head has {n} labels; a reward model has one (num_labels = 1)"
                )))
            }
            None => {
                return Err(err(
                    "it is a causal LM, not a reward model: its config.json must name a \
                     *ForSequenceClassification architecture with one label"
                        .into(),
                ))
            }
        }
        let (map, dtype) = match placement {
            Some((map, dtype)) => (map.clone(), dtype),
            None => (
                DeviceMap::single(DeviceLocation::Cpu, config.num_hidden_layers),
                DType::F32,
            ),
        };
        let opts = LoadOptions {
            dtype,
            device_map: Some(map),
            revision: revision.map(str::to_string),
            ..LoadOptions::default()
        };
        let model = TextModel::load(spec, &opts).map_err(|e| err(e.to_string()))?;
        model.tokenizer().map_err(|e| err(e.to_string()))?;
        let pad_id = model.pad_id();
        Ok(RewardModel {
            model,
            spec: spec.to_string(),
            pad_id,
        })
    }

    /// The ids the model scores for one completion.
    fn ids(
        &self,
        prompt: &str,
        completion: &str,
        sample: &Sample,
    ) -> Result<Vec<u32>, RewardError> {
        let err = |e: fleet_models::ModelError| RewardError::Model {
            model: self.spec.clone(),
            message: e.to_string(),
        };
        let text = match &sample.prompt {
            Prompt::Chat(_) => {
                let mut messages = sample.prompt.messages();
                messages.push(ChatMessage::new("assistant", completion));
                self.model.chat_text(&messages, false).map_err(err)?
            }
            Prompt::Text(_) => format!("{prompt}{completion}"),
        };
        let ids = self
            .model
            .tokenizer()
            .map_err(err)?
            .encode(&text)
            .map_err(err)?;
        if ids.is_empty() {
            return Err(RewardError::Model {
                model: self.spec.clone(),
                message: format!("sample {}: nothing to score (empty text)", sample.id),
            });
        }
        Ok(ids)
    }
}

impl RewardFunction for RewardModel {
    fn name(&self) -> &str {
        Self::NAME
    }

    fn score(
        &self,
        prompt: &str,
        completion: &str,
        sample: &Sample,
    ) -> Result<Option<f64>, RewardError> {
        crate::rewards::score_one_via_batch(self, prompt, completion, sample)
    }

    fn score_many(&self, items: &[Completion<'_>]) -> Vec<Result<Option<f64>, RewardError>> {
        let mut out: Vec<Result<Option<f64>, RewardError>> = Vec::with_capacity(items.len());
        let mut batch = Vec::new();
        let mut slots = Vec::new();
        for (i, c) in items.iter().enumerate() {
            match self.ids(c.prompt, c.text, c.sample) {
                Ok(ids) => {
                    batch.push(ids);
                    slots.push(i);
                    out.push(Ok(None));
                }
                Err(e) => out.push(Err(e)),
            }
        }
        if batch.is_empty() {
            return out;
        }
        let scores = self
            .model
            .model
            .classify(&batch, self.pad_id)
            .and_then(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?));
        match scores {
            Ok(values) => {
                for (slot, v) in slots.into_iter().zip(values) {
                    out[slot] = Ok(Some(v as f64));
                }
            }
            Err(e) => {
                for slot in slots {
                    out[slot] = Err(RewardError::Model {
                        model: self.spec.clone(),
                        message: e.to_string(),
                    });
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> String {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(name)
            .display()
            .to_string()
    }

    #[test]
    fn scores_batched_equal_one_by_one_and_a_causal_lm_is_refused() {
        let rm = RewardModel::load(&fixture("qwen2-tiny-reward"), None, None).unwrap();
        let samples: Vec<Sample> = (0..3)
            .map(|i| Sample::text(&format!("s{i}"), &format!("Question {i}?"), "#### 1"))
            .collect();
        let completions = ["yes", "a longer answer here", "no"];
        let items: Vec<Completion<'_>> = samples
            .iter()
            .zip(completions)
            .map(|(s, c)| Completion {
                prompt: s.prompt.question_text(),
                text: c,
                ids: &[],
                sample: s,
            })
            .collect();
        let batched = rm.score_many(&items);
        for (item, b) in items.iter().zip(&batched) {
            let one = rm
                .score(item.prompt, item.text, item.sample)
                .unwrap()
                .unwrap();
            let b = b.as_ref().unwrap().unwrap();
            assert!((one - b).abs() < 1e-4, "{one} vs {b}");
        }
        let err = RewardModel::load(&fixture("qwen2-tiny"), None, None)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("not a reward model"), "{err}");
    }
}
