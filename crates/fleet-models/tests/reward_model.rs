//! A reward model (Qwen2ForSequenceClassification) against transformers: the score head read at
//! each sequence's last token, one by one and in a padded batch (golden by
//! scripts/fixtures/make_reward_fixture.py).

use std::path::{Path, PathBuf};

use fleet_models::{LoadOptions, TextModel};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

#[test]
fn scores_match_transformers_one_by_one_and_batched() {
    let dir = fixtures().join("qwen2-tiny-reward");
    let model = TextModel::load(dir.to_str().unwrap(), &LoadOptions::default()).unwrap();
    assert_eq!(model.model.config().classifier_labels(), Some(1));
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/qwen2-tiny-reward.json")).unwrap(),
    )
    .unwrap();
    let seqs: Vec<Vec<u32>> = serde_json::from_value(golden["sequences"].clone()).unwrap();
    let want: Vec<f32> = serde_json::from_value(golden["scores"].clone()).unwrap();
    let pad = golden["pad_token_id"].as_u64().unwrap() as u32;
    for (s, w) in seqs.iter().zip(&want) {
        let got = model.model.classify(std::slice::from_ref(s), pad).unwrap();
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap()[0];
        assert!((got - w).abs() < 1e-4, "{s:?}: {got} vs {w}");
    }
    let batch = model.model.classify(&seqs, pad).unwrap();
    assert_eq!(batch.dims(), &[seqs.len(), 1]);
    let got: Vec<f32> = batch.flatten_all().unwrap().to_vec1().unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-4, "batched {g} vs {w}");
    }
}

#[test]
fn a_causal_lm_is_not_a_reward_model() {
    let dir = fixtures().join("qwen2-tiny");
    let model = TextModel::load(dir.to_str().unwrap(), &LoadOptions::default()).unwrap();
    let err = model
        .model
        .classify(&[vec![1, 2, 3]], 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("ForSequenceClassification"), "{err}");
}
