//! A random-weight Qwen2 of head_dim 64 with groups of 7 query heads (Qwen2.5-7B's), which
//! the paged decode kernel takes (the fixtures' head_dim 16 take the reference path). Shared
//! by the test binaries that include it with `#[path]`.

use std::path::Path;

/// The model (2 layers, f32, seed 3) placed by `map` (given the number of layers).
pub fn model(map: impl FnOnce(usize) -> fleet_models::DeviceMap) -> fleet_models::QwenModel {
    let cfg = fleet_models::QwenConfig::from_json(
        r#"{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 448,
            "intermediate_size": 256, "num_attention_heads": 7, "num_key_value_heads": 1,
            "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
            "hidden_act": "silu"}"#,
        Path::new("kernel_shaped.json"),
    )
    .unwrap();
    let map = map(cfg.num_hidden_layers);
    fleet_models::QwenModel::new(
        &cfg,
        &fleet_models::Weights::Random { seed: 3 },
        fleet_models::DType::F32,
        &map,
    )
    .unwrap()
}
