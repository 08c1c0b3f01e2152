//! The sentence embedder against sentence-transformers: the tiny random checkpoint of
//! tests/fixtures/bert-tiny-st and, when it has been fetched, the real all-MiniLM-L6-v2 (goldens
//! made by scripts/fixtures/make_bert_fixtures.py; the model by scripts/fixtures/fetch_minilm.sh).
//!
//! `FLEET_TEST_DEVICES` (default `cpu`): the first device listed runs the models.
//! `FLEET_MINILM_DIR`: the all-MiniLM-L6-v2 directory (default `target/minilm/all-MiniLM-L6-v2`
//! in the repository); when it is absent the all-MiniLM-L6-v2 test says so and passes, unless
//! `FLEET_MINILM_DIR` was set, in which case a missing directory fails the test.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use fleet_models::embedder::{EmbedderId, EmbedderOptions, Pooling, SentenceEmbedder};
use fleet_models::{DeviceLocation, HubOptions};
use serde::Deserialize;

const TINY_TOL: f32 = 1e-5;
const MINILM_TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn tiny_dir() -> PathBuf {
    fixtures().join("bert-tiny-st")
}

#[derive(Deserialize)]
struct Golden {
    max_seq_length: usize,
    dim: usize,
    sentences: Vec<String>,
    input_ids: Vec<Vec<u32>>,
    embeddings: Vec<Vec<f32>>,
    #[serde(default)]
    embeddings_alone: Vec<Vec<f32>>,
    #[serde(default)]
    variants: Vec<Variant>,
    #[serde(default)]
    cosine: Vec<Vec<f32>>,
}

#[derive(Deserialize)]
struct Variant {
    name: String,
    edits: serde_json::Map<String, serde_json::Value>,
    max_seq_length: usize,
    dim: usize,
    input_ids: Vec<Vec<u32>>,
    embeddings: Vec<Vec<f32>>,
}

fn golden(name: &str) -> Golden {
    let p = fixtures().join("golden").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn test_device() -> Device {
    let first = std::env::var("FLEET_TEST_DEVICES")
        .unwrap_or_else(|_| "cpu".into())
        .split(',')
        .next()
        .unwrap()
        .to_string();
    let loc: DeviceLocation = first.parse().unwrap();
    fleet_models::open_device(loc).unwrap()
}

fn options() -> EmbedderOptions {
    EmbedderOptions {
        device: test_device(),
        ..EmbedderOptions::default()
    }
}

fn load(dir: &Path) -> SentenceEmbedder {
    SentenceEmbedder::load(dir.to_str().unwrap(), &options()).unwrap()
}

fn load_err(dir: &Path) -> String {
    match SentenceEmbedder::load(dir.to_str().unwrap(), &options()) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

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

/// A writable copy of the tiny checkpoint.
fn tiny_copy() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("bert-tiny-st");
    copy_dir(&tiny_dir(), &dir);
    (tmp, dir)
}

fn write_json(path: &Path, v: &serde_json::Value) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, serde_json::to_string_pretty(v).unwrap()).unwrap();
}

#[test]
fn tiny_batch_matches_sentence_transformers() {
    let g = golden("bert-tiny-st");
    let e = load(&tiny_dir());
    assert_eq!((e.dim(), e.max_seq_length()), (g.dim, g.max_seq_length));
    assert!(e.normalize());
    assert_eq!(e.pooling(), &[Pooling::Mean]);
    assert_eq!(e.tokenize(&g.sentences).unwrap(), g.input_ids);
    // All nine sentences in one right-padded batch, as the golden was made.
    let got = e.embed_vecs(&g.sentences).unwrap();
    let d = max_abs_diff(&got, &g.embeddings);
    eprintln!("bert-tiny-st batched: max abs diff {d:.3e}");
    assert!(d <= TINY_TOL, "batched: max abs diff {d}");
}

/// Each sentence alone matches sentence-transformers' one-at-a-time output and the padded
/// batch; batch size does not change any embedding.
#[test]
fn tiny_padding_and_batch_size_change_nothing() {
    let g = golden("bert-tiny-st");
    let mut e = load(&tiny_dir());
    let batched = e.embed_vecs(&g.sentences).unwrap();
    let alone: Vec<Vec<f32>> = g
        .sentences
        .iter()
        .map(|s| e.embed_one(s).unwrap())
        .collect();
    let d = max_abs_diff(&alone, &g.embeddings_alone);
    eprintln!("bert-tiny-st one at a time: max abs diff {d:.3e}");
    assert!(d <= TINY_TOL, "alone vs golden: {d}");
    let d = max_abs_diff(&alone, &batched);
    assert!(d <= 1e-6, "alone vs padded batch: {d}");
    for bs in [1, 2, 4] {
        e.set_batch_size(bs);
        let d = max_abs_diff(&e.embed_vecs(&g.sentences).unwrap(), &batched);
        assert!(d <= 1e-6, "batch size {bs}: {d}");
    }
}

#[test]
fn tiny_truncates_at_max_seq_length() {
    let g = golden("bert-tiny-st");
    let e = load(&tiny_dir());
    let long = &g.sentences[5];
    let ids = e.tokenize(&[long]).unwrap().remove(0);
    // [CLS] ... [SEP] at max_seq_length (24), not at tokenizer.json's own truncation (8).
    assert_eq!(ids.len(), 24);
    assert_eq!((ids[0], ids[23]), (2, 3));
    assert_eq!(e.tokenize(&[&g.sentences[0]]).unwrap()[0].len(), 22);
    // Text past the cut changes nothing.
    let longer = format!("{long} And a few more words that are cut off.");
    let v = e.embed_vecs(&[long.as_str(), longer.as_str()]).unwrap();
    assert!(max_abs_diff(&v[..1], &v[1..]) <= 1e-6);
}

#[test]
fn tiny_embeddings_have_unit_norm() {
    let g = golden("bert-tiny-st");
    let e = load(&tiny_dir());
    let t = e.embed(&g.sentences).unwrap();
    assert_eq!(t.dims(), &[g.sentences.len(), 32]);
    assert_eq!(t.dtype(), DType::F32);
    let norms: Vec<f32> = t
        .sqr()
        .unwrap()
        .sum(1)
        .unwrap()
        .sqrt()
        .unwrap()
        .to_vec1()
        .unwrap();
    for (i, n) in norms.iter().enumerate() {
        assert!((n - 1.0).abs() < 1e-5, "sentence {i}: norm {n}");
    }
    let empty: [&str; 0] = [];
    assert_eq!(e.embed(&empty).unwrap().dims(), &[0, 32]);
    assert!(e.embed_vecs(&empty).unwrap().is_empty());
}

/// Other pooling modes, no Normalize, do_lower_case and sentence-transformers 6's own file
/// layout: the goldens' edits written over a copy of the checkpoint.
#[test]
fn tiny_variants_match_sentence_transformers() {
    let g = golden("bert-tiny-st");
    assert!(g.variants.len() >= 7);
    for v in &g.variants {
        let (_tmp, dir) = tiny_copy();
        for (rel, content) in &v.edits {
            write_json(&dir.join(rel), content);
        }
        let e = load(&dir);
        assert_eq!(
            (e.dim(), e.max_seq_length()),
            (v.dim, v.max_seq_length),
            "{}",
            v.name
        );
        assert_eq!(e.tokenize(&g.sentences).unwrap(), v.input_ids, "{}", v.name);
        let d = max_abs_diff(&e.embed_vecs(&g.sentences).unwrap(), &v.embeddings);
        eprintln!("bert-tiny-st variant {}: max abs diff {d:.3e}", v.name);
        assert!(d <= TINY_TOL, "variant {}: max abs diff {d}", v.name);
        let expected: &[Pooling] = match v.name.as_str() {
            "pooling-cls" => &[Pooling::Cls],
            "pooling-max" => &[Pooling::Max],
            "pooling-mean-sqrt-len" => &[Pooling::MeanSqrtLenTokens],
            "pooling-cls-mean" => &[Pooling::Cls, Pooling::Mean],
            _ => &[Pooling::Mean],
        };
        assert_eq!(e.pooling(), expected, "{}", v.name);
        let normalized = !matches!(
            v.name.as_str(),
            "pooling-cls" | "pooling-max" | "pooling-mean-sqrt-len" | "mean-no-normalize"
        );
        assert_eq!(e.normalize(), normalized, "{}", v.name);
    }
}

/// Without modules.json the checkpoint is a plain transformers one: mean pooling, no
/// Normalize, as sentence-transformers does.
#[test]
fn tiny_without_modules_json_is_mean_pooled_unnormalized() {
    let g = golden("bert-tiny-st");
    let want = g
        .variants
        .iter()
        .find(|v| v.name == "mean-no-normalize")
        .unwrap();
    let (_tmp, dir) = tiny_copy();
    std::fs::remove_file(dir.join("modules.json")).unwrap();
    std::fs::remove_dir_all(dir.join("1_Pooling")).unwrap();
    let e = load(&dir);
    assert!(!e.normalize());
    let d = max_abs_diff(&e.embed_vecs(&g.sentences).unwrap(), &want.embeddings);
    assert!(d <= TINY_TOL, "{d}");
}

/// Tensor names with the `bert.` prefix (a BertModel saved inside BertForMaskedLM and the
/// like) and old `gamma`/`beta` LayerNorm names load to the same model.
#[test]
fn tiny_prefixed_and_gamma_beta_names_load_the_same() {
    let g = golden("bert-tiny-st");
    let (_tmp, dir) = tiny_copy();
    let path = dir.join("model.safetensors");
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let renamed: std::collections::HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, t)| {
            let k = k
                .replace("LayerNorm.weight", "LayerNorm.gamma")
                .replace("LayerNorm.bias", "LayerNorm.beta");
            (format!("bert.{k}"), t)
        })
        .collect();
    candle_core::safetensors::save(&renamed, &path).unwrap();
    let e = load(&dir);
    let d = max_abs_diff(&e.embed_vecs(&g.sentences).unwrap(), &g.embeddings);
    assert!(d <= TINY_TOL, "{d}");
}

#[test]
fn half_precision_stays_close_to_f32() {
    let g = golden("bert-tiny-st");
    for dtype in [DType::F16, DType::BF16] {
        let opts = EmbedderOptions { dtype, ..options() };
        let e = SentenceEmbedder::load(tiny_dir().to_str().unwrap(), &opts).unwrap();
        let got = e.embed_vecs(&g.sentences).unwrap();
        for (i, (a, b)) in got.iter().zip(&g.embeddings).enumerate() {
            assert!(
                a.iter().all(|x| x.is_finite()),
                "{dtype:?} sentence {i}: {a:?}"
            );
            let cos: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
            assert!(
                cos > 0.99,
                "{dtype:?} sentence {i}: cosine to f32 golden {cos}"
            );
        }
    }
}

#[test]
fn embedder_id_tells_embedders_apart() {
    let e = load(&tiny_dir());
    let id = e.id().clone();
    assert_eq!(id.dim, 32);
    assert_eq!(id.max_seq_length, 24);
    assert_eq!(id.pooling, vec![Pooling::Mean]);
    assert!(id.normalize && !id.do_lower_case && id.revision.is_none());
    assert!(id.weights_digest.starts_with("fnv1a64w:"));
    let json = serde_json::to_string(&id).unwrap();
    assert!(json.contains(r#""pooling":["mean"]"#), "{json}");
    let back: EmbedderId = serde_json::from_str(&json).unwrap();
    assert_eq!(back, id);

    // The same files elsewhere: the same embedder.
    let (_tmp, dir) = tiny_copy();
    let moved = load(&dir).id().clone();
    assert_ne!(moved.model, id.model);
    id.check_compatible(&moved).unwrap();

    // No Normalize, and other weights: refused, with what differs.
    write_json(
        &dir.join("modules.json"),
        &serde_json::json!([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
        ]),
    );
    let msg = id
        .check_compatible(load(&dir).id())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("normalize true (index) vs false (embedder)") && msg.contains("Rebuild"),
        "{msg}"
    );
    let path = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let w = tensors.get_mut("embeddings.LayerNorm.bias").unwrap();
    *w = (w.clone() + 1e-3).unwrap();
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let msg = id
        .check_compatible(load(&dir).id())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("weights_digest"), "{msg}");
}

/// A hub id read from the huggingface_hub cache layout with HF_HUB_OFFLINE: the commit becomes
/// the id's revision; a cache without modules.json is refused rather than guessed at.
#[test]
fn offline_hub_cache_is_read() {
    let g = golden("bert-tiny-st");
    let cache = tempfile::tempdir().unwrap();
    let repo_dir = cache.path().join("models--org--bert-tiny");
    std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
    std::fs::write(repo_dir.join("refs/main"), "abc123").unwrap();
    copy_dir(&tiny_dir(), &repo_dir.join("snapshots/abc123"));
    let opts = EmbedderOptions {
        hub: HubOptions {
            cache_dir: Some(cache.path().into()),
            offline: true,
        },
        ..options()
    };
    let e = SentenceEmbedder::load("org/bert-tiny", &opts).unwrap();
    assert_eq!(e.id().model, "org/bert-tiny");
    assert_eq!(e.id().revision.as_deref(), Some("abc123"));
    let d = max_abs_diff(&e.embed_vecs(&g.sentences).unwrap(), &g.embeddings);
    assert!(d <= TINY_TOL, "{d}");

    std::fs::remove_file(repo_dir.join("snapshots/abc123/modules.json")).unwrap();
    let msg = SentenceEmbedder::load("org/bert-tiny", &opts)
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("modules.json") && msg.contains("HF_HUB_OFFLINE"),
        "{msg}"
    );
}

#[test]
fn missing_files_are_named_with_the_fix() {
    let (_tmp, dir) = tiny_copy();
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let msg = load_err(&dir);
    assert!(
        msg.contains("tokenizer.json is missing") && msg.contains("save_pretrained"),
        "{msg}"
    );

    let (_tmp, dir) = tiny_copy();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let msg = load_err(&dir);
    assert!(
        msg.contains("model.safetensors is missing") && msg.contains("safetensors weights only"),
        "{msg}"
    );
    std::fs::write(dir.join("pytorch_model.bin"), b"not really").unwrap();
    let msg = load_err(&dir);
    assert!(
        msg.contains("only pytorch_model.bin") && msg.contains(".save("),
        "{msg}"
    );

    let (_tmp, dir) = tiny_copy();
    std::fs::remove_dir_all(dir.join("1_Pooling")).unwrap();
    let msg = load_err(&dir);
    assert!(
        msg.contains("1_Pooling/config.json is missing") && msg.contains("Pooling module"),
        "{msg}"
    );
}

#[test]
fn unsupported_checkpoints_are_refused_clearly() {
    let cases: Vec<(&str, serde_json::Value, &[&str])> = vec![
        (
            "1_Pooling/config.json",
            serde_json::json!({"embedding_dimension": 32, "pooling_mode": "weightedmean"}),
            &[
                "1_Pooling/config.json",
                "`pooling_mode`",
                "weightedmean",
                "fleet supports cls, max, mean and mean_sqrt_len_tokens",
            ],
        ),
        (
            "1_Pooling/config.json",
            serde_json::json!({"word_embedding_dimension": 32, "pooling_mode_lasttoken": true}),
            &["pooling_mode_lasttoken", "fleet supports"],
        ),
        (
            "modules.json",
            serde_json::json!([
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
            ]),
            &[
                "modules.json",
                "sentence_transformers.models.Dense",
                "module `Dense` in position 2 is not supported",
            ],
        ),
        (
            "sentence_bert_config.json",
            serde_json::json!({"max_seq_length": 100, "do_lower_case": false}),
            &[
                "sentence_bert_config.json",
                "`max_seq_length` = 100",
                "only 40 positions",
                "lower max_seq_length to 40",
            ],
        ),
        (
            "config_sentence_transformers.json",
            serde_json::json!({"prompts": {"query": "query: "}, "default_prompt_name": "query"}),
            &["default_prompt_name", "does not prepend prompts"],
        ),
    ];
    for (rel, content, needles) in cases {
        let (_tmp, dir) = tiny_copy();
        write_json(&dir.join(rel), &content);
        let msg = load_err(&dir);
        for n in needles {
            assert!(msg.contains(n), "{rel}: `{n}` not in: {msg}");
        }
    }

    let (_tmp, dir) = tiny_copy();
    let cfg_path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["model_type"] = "roberta".into();
    write_json(&cfg_path, &cfg);
    let msg = load_err(&dir);
    assert!(
        msg.contains("architecture `roberta` is not supported") && msg.contains("BERT"),
        "{msg}"
    );
}

/// The minilm directory, or `None` (with a note) when it has not been fetched.
fn minilm_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("FLEET_MINILM_DIR") {
        let dir = PathBuf::from(dir);
        assert!(
            dir.join("model.safetensors").is_file(),
            "FLEET_MINILM_DIR={} has no model.safetensors; run scripts/fixtures/fetch_minilm.sh {}",
            dir.display(),
            dir.display()
        );
        return Some(dir);
    }
    let default =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/minilm/all-MiniLM-L6-v2");
    if default.join("model.safetensors").is_file() {
        return Some(default);
    }
    // Straight to stderr: libtest captures eprintln! of passing tests, and a skip must show.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED minilm_matches_sentence_transformers: all-MiniLM-L6-v2 is not at {} and \
         FLEET_MINILM_DIR is unset; fetch it with scripts/fixtures/fetch_minilm.sh",
        default.display()
    );
    None
}

#[test]
fn minilm_matches_sentence_transformers() {
    let Some(dir) = minilm_dir() else { return };
    let g = golden("all-minilm-l6-v2");
    let mut e = load(&dir);
    // Pairs of similar length (the embedder runs longest first): every batch is padded, and
    // far fewer padded tokens go through an unoptimised debug build than in one batch of 7.
    e.set_batch_size(2);
    assert_eq!((e.dim(), e.max_seq_length()), (384, 256));
    assert!(e.normalize() && e.pooling() == [Pooling::Mean]);
    assert_eq!(e.tokenize(&g.sentences).unwrap(), g.input_ids);
    let got = e.embed_vecs(&g.sentences).unwrap();
    let d = max_abs_diff(&got, &g.embeddings);
    let cos: Vec<Vec<f32>> = got
        .iter()
        .map(|a| {
            got.iter()
                .map(|b| a.iter().zip(b).map(|(x, y)| x * y).sum())
                .collect()
        })
        .collect();
    let dc = max_abs_diff(&cos, &g.cosine);
    eprintln!(
        "all-MiniLM-L6-v2 ({}): max abs diff {d:.3e} over {}x384, cosine max abs diff {dc:.3e}",
        dir.display(),
        got.len()
    );
    assert!(d <= MINILM_TOL, "embeddings: max abs diff {d}");
    assert!(dc <= MINILM_TOL, "cosine similarities: max abs diff {dc}");
}
