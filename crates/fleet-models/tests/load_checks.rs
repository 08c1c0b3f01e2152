//! No silent wrong model: a config.json that does not describe its weights, NaN/infinite
//! weights or logits, and positions past `max_position_embeddings` are typed errors naming the
//! tensor, field or position; random weights on the CPU are reproducible (the benchmark path).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};
use fleet_models::{
    DType, DeviceLocation, DeviceMap, KvCache, LoadOptions, ModelError, QwenConfig, QwenModel,
    SentenceEmbedder, TextModel, Weights,
};

mod devices;
use devices::test_devices;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// A writable copy of a fixture directory (with its subdirectories).
fn copy_fixture(name: &str) -> tempfile::TempDir {
    fn copy_dir(src: &Path, dst: &Path) {
        std::fs::create_dir_all(dst).unwrap();
        for entry in std::fs::read_dir(src).unwrap() {
            let entry = entry.unwrap();
            let to = dst.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                copy_dir(&entry.path(), &to);
            } else {
                std::fs::copy(entry.path(), to).unwrap();
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture(name), dir.path());
    dir
}

/// Sets `field` of `dir/config.json`.
fn set_config(dir: &Path, field: &str, value: serde_json::Value) {
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg[field] = value;
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
}

/// Rewrites the shard `file` of `dir` through `edit` (name → tensor).
fn edit_shard(dir: &Path, file: &str, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let path = dir.join(file);
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, &path).unwrap();
}

fn load_with(dir: &Path, dtype: DType) -> fleet_models::Result<TextModel> {
    let opts = LoadOptions {
        dtype,
        ..LoadOptions::default()
    };
    TextModel::load(dir.to_str().unwrap(), &opts)
}

fn load(dir: &Path) -> fleet_models::Result<TextModel> {
    load_with(dir, DType::F32)
}

fn load_err(dir: &Path) -> String {
    match load(dir) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// Runs `f` with the warnings it logs captured; returns its value and the log.
fn with_warnings<T>(f: impl FnOnce() -> T) -> (T, String) {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .finish();
    let out = tracing::subscriber::with_default(subscriber, f);
    let log = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    (out, log)
}

// ---- 1. config.json that does not describe the weights ------------------------------------

/// Fails before the unused-tensor check: a config with fewer layers loaded and ran.
#[test]
fn fewer_layers_in_config_than_in_the_weights_is_refused() {
    let d = copy_fixture("qwen2-tiny");
    set_config(d.path(), "num_hidden_layers", 1.into());
    let e = load_err(d.path());
    for needle in [
        "model.safetensors",
        "`model.layers.1.*` (12)",
        "`model.layers.3.*` (12)",
        "36 tensor(s)",
        "4 layers",
        "num_hidden_layers = 1",
        "config.json does not match the weights",
    ] {
        assert!(e.contains(needle), "`{needle}` not in: {e}");
    }

    // Sharded: the error names the shard holding the first unused tensor.
    let d = copy_fixture("qwen2-tiny-tied-sharded");
    set_config(d.path(), "num_hidden_layers", 2.into());
    let e = load_err(d.path());
    assert!(
        e.contains("model-00002-of-00003.safetensors")
            && e.contains("`model.layers.2.*`")
            && e.contains("num_hidden_layers = 2"),
        "{e}"
    );
}

/// Layers split over several devices still read every tensor once: the complete checkpoints
/// load without a warning, whatever the split.
#[test]
fn split_models_read_every_tensor() {
    for name in ["qwen2-tiny", "qwen2-tiny-tied-sharded", "qwen3-tiny"] {
        let dir = fixture(name);
        let cfg = QwenConfig::from_file(&dir.join("config.json")).unwrap();
        let map = DeviceMap::split_layers(&test_devices(), cfg.num_hidden_layers).unwrap();
        let opts = LoadOptions {
            dtype: DType::F32,
            device_map: Some(map),
            ..LoadOptions::default()
        };
        let (m, log) = with_warnings(|| TextModel::load(dir.to_str().unwrap(), &opts));
        m.unwrap();
        assert!(log.is_empty(), "{name}: unexpected warnings: {log}");
    }
}

/// A tensor of no known part (a classification head, say) and a bias the config does not
/// declare are refused.
#[test]
fn tensors_the_config_does_not_declare_are_refused() {
    let d = copy_fixture("qwen2-tiny");
    edit_shard(d.path(), "model.safetensors", |t| {
        t.insert(
            "score.weight".into(),
            Tensor::zeros((2, 64), candle_core::DType::F32, &Device::Cpu).unwrap(),
        );
    });
    let e = load_err(d.path());
    assert!(
        e.contains("`score.weight`") && e.contains("1 tensor(s)"),
        "{e}"
    );

    let d = copy_fixture("qwen2-tiny");
    edit_shard(d.path(), "model.safetensors", |t| {
        t.insert(
            "model.layers.0.self_attn.o_proj.bias".into(),
            Tensor::zeros(64, candle_core::DType::F32, &Device::Cpu).unwrap(),
        );
    });
    let e = load_err(d.path());
    assert!(
        e.contains("`model.layers.0.self_attn.o_proj.bias`") && e.contains("biases"),
        "{e}"
    );
}

/// What transformers ignores is loaded, with a warning naming it: a saved lm_head while
/// tie_word_embeddings is true, and the per-layer RoPE `inv_freq` buffers of old checkpoints.
#[test]
fn harmless_extra_tensors_load_with_a_warning() {
    let d = copy_fixture("qwen2-tiny");
    set_config(d.path(), "tie_word_embeddings", true.into());
    let (m, log) = with_warnings(|| load(d.path()));
    m.unwrap();
    assert!(
        log.contains("WARN")
            && log.contains("`lm_head.weight`")
            && log.contains("tie_word_embeddings"),
        "{log}"
    );

    let d = copy_fixture("qwen3-tiny");
    edit_shard(d.path(), "model.safetensors", |t| {
        for i in 0..4 {
            t.insert(
                format!("model.layers.{i}.self_attn.rotary_emb.inv_freq"),
                Tensor::ones(16, candle_core::DType::F32, &Device::Cpu).unwrap(),
            );
        }
    });
    let (m, log) = with_warnings(|| load(d.path()));
    m.unwrap();
    assert!(
        log.contains("4 checkpoint tensor(s) not used") && log.contains("rotary_emb.inv_freq"),
        "{log}"
    );
}

/// Shapes that differ from what config.json implies were already refused; kept so.
#[test]
fn shapes_that_differ_from_the_config_are_refused() {
    for (field, value, needle) in [
        ("num_key_value_heads", 4, "self_attn.k_proj.weight"),
        ("vocab_size", 1000, "model.embed_tokens.weight"),
        ("hidden_size", 128, "model.embed_tokens.weight"),
        ("intermediate_size", 96, "mlp.gate_proj.weight"),
    ] {
        let d = copy_fixture("qwen2-tiny");
        set_config(d.path(), field, value.into());
        let e = load_err(d.path());
        assert!(
            e.contains(needle) && e.contains("shape") && e.contains("config.json"),
            "{field}: {e}"
        );
    }
    let d = copy_fixture("qwen3-tiny");
    set_config(d.path(), "head_dim", 16.into());
    let e = load_err(d.path());
    assert!(e.contains("shape"), "{e}");
}

/// The embedder: pooler weights (unused by sentence-transformers too) load silently; a
/// config.json with fewer layers, or an unknown tensor, is refused; a task head next to
/// `bert.`-prefixed weights loads with a warning.
#[test]
fn embedder_refuses_tensors_its_config_does_not_use() {
    let opts = fleet_models::EmbedderOptions::default();
    let (e, log) =
        with_warnings(|| SentenceEmbedder::load(fixture("bert-tiny-st").to_str().unwrap(), &opts));
    e.unwrap();
    assert!(log.is_empty(), "{log}");

    let d = copy_fixture("bert-tiny-st");
    set_config(d.path(), "num_hidden_layers", 1.into());
    let e = SentenceEmbedder::load(d.path().to_str().unwrap(), &opts)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("model.safetensors")
            && e.contains("`encoder.layer.1.*` (16)")
            && e.contains("num_hidden_layers = 1"),
        "{e}"
    );

    let d = copy_fixture("bert-tiny-st");
    edit_shard(d.path(), "model.safetensors", |t| {
        t.insert(
            "encoder.layer.0.attention.self.rel_bias".into(),
            Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu).unwrap(),
        );
    });
    let e = SentenceEmbedder::load(d.path().to_str().unwrap(), &opts)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("`encoder.layer.0.attention.self.rel_bias`"),
        "{e}"
    );

    let d = copy_fixture("bert-tiny-st");
    edit_shard(d.path(), "model.safetensors", |t| {
        let old = std::mem::take(t);
        for (k, v) in old {
            t.insert(format!("bert.{k}"), v);
        }
        t.insert(
            "cls.predictions.bias".into(),
            Tensor::zeros(800, candle_core::DType::F32, &Device::Cpu).unwrap(),
        );
        t.insert(
            "bert.embeddings.position_ids".into(),
            Tensor::arange(0i64, 40, &Device::Cpu).unwrap(),
        );
    });
    let (e, log) = with_warnings(|| SentenceEmbedder::load(d.path().to_str().unwrap(), &opts));
    e.unwrap();
    assert!(
        log.contains("`cls.predictions.bias`") && !log.contains("position_ids"),
        "{log}"
    );
}

// ---- 2. NaN / infinite weights and logits ---------------------------------------------------

/// Fails before the check: NaN weights loaded and the logits came out NaN.
#[test]
fn nan_weights_are_refused_at_load_naming_the_tensor() {
    let d = copy_fixture("qwen2-tiny");
    edit_shard(d.path(), "model.safetensors", |t| {
        let w = &t["model.layers.2.mlp.up_proj.weight"];
        let nan = (w.ones_like().unwrap() * f64::NAN).unwrap();
        t.insert("model.layers.2.mlp.up_proj.weight".into(), nan);
    });
    let e = load_err(d.path());
    assert!(
        e.contains("model.safetensors")
            && e.contains("`model.layers.2.mlp.up_proj.weight`")
            && e.contains("8192 NaN/infinite value(s) of 8192")
            && e.contains("download it again"),
        "{e}"
    );

    // Every tensor NaN, sharded: the first tensor read is named, with its shard.
    let d = copy_fixture("qwen2-tiny-tied-sharded");
    for i in 1..=3 {
        edit_shard(
            d.path(),
            &format!("model-0000{i}-of-00003.safetensors"),
            |t| {
                for v in t.values_mut() {
                    *v = (v.ones_like().unwrap() * f64::INFINITY).unwrap();
                }
            },
        );
    }
    let e = load_err(d.path());
    assert!(
        e.contains("model-00001-of-00003.safetensors")
            && e.contains("`model.embed_tokens.weight`")
            && e.contains("inf"),
        "{e}"
    );
}

/// Finite f32 weights that overflow f16 are named at load, with the dtype to use instead.
#[test]
fn weights_that_overflow_the_dtype_are_refused_at_load() {
    let d = copy_fixture("qwen2-tiny");
    edit_shard(d.path(), "model.safetensors", |t| {
        let w = &t["model.norm.weight"];
        t.insert(
            "model.norm.weight".into(),
            (w.ones_like().unwrap() * 1e6).unwrap(),
        );
    });
    assert!(load_with(d.path(), DType::F32).is_ok());
    let e = load_with(d.path(), DType::F16).err().unwrap().to_string();
    assert!(
        e.contains("`model.norm.weight`")
            && e.contains("finite as stored")
            && e.contains("overflow F16")
            && e.contains("bf16 or f32"),
        "{e}"
    );
}

/// Fails before the logits check: the logits came back as inf/NaN (printed as null).
#[test]
fn non_finite_logits_are_an_error_naming_the_position() {
    // Finite weights whose activations overflow f16 (as some Qwen layers do): the final norm
    // scales by 60000 and the head multiplies by ~15 per term.
    let d = copy_fixture("qwen2-tiny");
    edit_shard(d.path(), "model.safetensors", |t| {
        let n = &t["model.norm.weight"];
        t.insert(
            "model.norm.weight".into(),
            (n.ones_like().unwrap() * 60000.0).unwrap(),
        );
        let h = &t["lm_head.weight"];
        t.insert("lm_head.weight".into(), (h * 100.0).unwrap());
    });
    let model = load_with(d.path(), DType::F16).unwrap();
    let e = model.model.logits(&[vec![5, 6, 7]]).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ModelError::NonFinite { .. }), "{msg}");
    assert!(
        msg.contains("row 0 at position 0") && msg.contains("f16") && msg.contains("bf16 or f32"),
        "{msg}"
    );
    // Generation stops on it too, instead of sampling from NaN.
    let e = model
        .generate(
            &[fleet_models::GenerationRequest::greedy(vec![5, 6, 7], 4)],
            None,
        )
        .unwrap_err();
    assert!(matches!(e, ModelError::NonFinite { .. }), "{e}");

    // In f32 the same weights are fine; f32-overflowing ones fail with the weights named as
    // the likely cause.
    let model = load_with(d.path(), DType::F32).unwrap();
    model.model.logits(&[vec![5, 6, 7]]).unwrap();
    let d = copy_fixture("qwen2-tiny");
    edit_shard(d.path(), "model.safetensors", |t| {
        let n = &t["model.norm.weight"];
        t.insert(
            "model.norm.weight".into(),
            (n.ones_like().unwrap() * 3e38).unwrap(),
        );
    });
    let model = load_with(d.path(), DType::F32).unwrap();
    let mut cache = model.model.new_cache(8).unwrap();
    model
        .model
        .forward(&[vec![5, 6]], &[0], &mut cache, false)
        .unwrap_err();
    let e = model
        .model
        .forward(
            &[vec![0, 5, 6]],
            &[1],
            &mut model.model.new_cache(8).unwrap(),
            true,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("row 0 at position 1 (token 3 of this call)")
            && e.contains("check the checkpoint"),
        "{e}"
    );
}

// ---- 3. random weights on the CPU (the benchmark path) --------------------------------------

fn random_model(cfg: &QwenConfig, seed: u64, dtype: DType) -> QwenModel {
    // As `fleet bench --config ... --device cpu` builds it.
    let map = DeviceMap::single(DeviceLocation::Cpu, cfg.num_hidden_layers);
    QwenModel::new(cfg, &Weights::Random { seed }, dtype, &map).unwrap()
}

/// Fails before the fix: "cannot seed the CPU rng".
#[test]
fn random_weights_on_the_cpu_are_reproducible() {
    for name in ["qwen2-tiny", "qwen3-tiny"] {
        let cfg = QwenConfig::from_file(&fixture(name).join("config.json")).unwrap();
        let ids = vec![vec![1u32, 2, 3, 500, 900]];
        let a: Vec<f32> = random_model(&cfg, 7, DType::F32)
            .logits(&ids)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let b: Vec<f32> = random_model(&cfg, 7, DType::F32)
            .logits(&ids)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let c: Vec<f32> = random_model(&cfg, 8, DType::F32)
            .logits(&ids)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(a, b, "{name}: same seed, different logits");
        assert_ne!(a, c, "{name}: different seeds, same logits");
        assert!(a.iter().all(|x| x.is_finite()) && a.iter().any(|&x| x != 0.0));
        // The benchmark's default dtype.
        let m = random_model(&cfg, 7, DType::BF16);
        assert_eq!(
            m.logits(&ids).unwrap().dims3().unwrap(),
            (1, 5, cfg.vocab_size)
        );
    }
}

// ---- 4. positions past max_position_embeddings ----------------------------------------------

/// Fails before the check: `logits` gave a raw tensor error.
#[test]
fn positions_past_max_position_embeddings_are_an_error() {
    let d = copy_fixture("qwen2-tiny");
    set_config(d.path(), "max_position_embeddings", 16.into());
    let model = load(d.path()).unwrap();
    let m = &model.model;
    m.logits(&[vec![1; 16]]).unwrap();
    let e = m.logits(&[vec![1; 17]]).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ModelError::BadInput(_)), "{msg}");
    assert!(
        msg.contains("17 positions") && msg.contains("max_position_embeddings = 16"),
        "{msg}"
    );

    // Through the cache: 14 cached + 3 new.
    let mut cache: KvCache = m.new_cache(32).unwrap();
    m.forward(&[vec![1; 14]], &[0], &mut cache, true).unwrap();
    let msg = m
        .forward(&[vec![1; 3]], &[0], &mut cache, true)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("17 positions") && msg.contains("14 already in the cache"),
        "{msg}"
    );

    // Left padding does not count: 18 slots, 2 of them padding, fit 16 positions; a row with
    // less padding in the same batch does not.
    let mut cache = m.new_cache(32).unwrap();
    m.forward(&[vec![1; 18]], &[2], &mut cache, true).unwrap();
    let mut cache = m.new_cache(32).unwrap();
    let msg = m
        .forward(&[vec![1; 18], vec![1; 18]], &[2, 1], &mut cache, true)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("row 1 needs 17 positions"), "{msg}");
}
