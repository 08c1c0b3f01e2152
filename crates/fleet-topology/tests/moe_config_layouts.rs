//! The config.json of a Qwen3-VL MoE checkpoint in both layouts it is found in: the released
//! 4.x layout (`num_experts`, `rope_scaling`) and the one transformers 5's `save_pretrained`
//! writes (`num_local_experts`, `rope_parameters`), on the tiny checkpoints of
//! scripts/fixtures/make_qwen3_vl_moe_layouts.py. Both describe the same model and must size
//! the same.

use std::path::PathBuf;

use fleet_topology::{ModelShape, MoeShape};

fn config(dir: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen3-vl-moe-layouts")
        .join(dir)
        .join("config.json")
}

#[test]
fn saved_and_released_moe_configs_give_the_same_shape() {
    for (shape, inter) in [("i4", 4), ("i8", 8), ("i16", 16)] {
        let released = ModelShape::from_config_file(config(&format!("{shape}-released"))).unwrap();
        let saved = ModelShape::from_config_file(config(&format!("{shape}-saved"))).unwrap();
        assert_eq!(
            released.moe,
            Some(MoeShape {
                num_experts: 4,
                num_experts_per_tok: 2,
                moe_intermediate_size: inter,
            }),
            "{shape}"
        );
        assert_eq!(
            saved, released,
            "{shape}: the saved config.json sizes another model"
        );
    }
}

/// Qwen3-VL-30B-A3B's text_config as transformers 5 saves it: read as a dense model it would be
/// sized at a few billion parameters instead of ~31B.
#[test]
fn num_local_experts_sizes_the_30b_a3b() {
    let released = r#"{
      "model_type": "qwen3_vl_moe", "tie_word_embeddings": false,
      "text_config": {
        "model_type": "qwen3_vl_moe_text",
        "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "vocab_size": 151936
      }
    }"#;
    let saved = released.replace("\"num_experts\"", "\"num_local_experts\"");
    let a = ModelShape::from_config_str(released, "released").unwrap();
    let b = ModelShape::from_config_str(&saved, "saved").unwrap();
    assert_eq!(a, b);
    let total = b.total_params() as f64 / 1e9;
    assert!((30.0..31.0).contains(&total), "{total}B");
}
