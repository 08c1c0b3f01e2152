//! Sentence embeddings from sentence-transformers BERT checkpoints (all-MiniLM-L6-v2 and the
//! like), computed as `SentenceTransformer.encode` computes them.
//!
//! A checkpoint is the directory (or hub repository) that sentence-transformers saves:
//! `config.json`, `model.safetensors`, `tokenizer.json`, and the module files
//! `modules.json` (Transformer → Pooling → optional Normalize), `sentence_bert_config.json`
//! (`max_seq_length`, `do_lower_case`) and `1_Pooling/config.json` (the pooling mode). Both file
//! layouts are read: the one sentence-transformers 2.x wrote (what the Hub mostly holds, e.g.
//! all-MiniLM-L6-v2) and the one sentence-transformers 6 writes.
//!
//! ```no_run
//! use fleet_models::embedder::{EmbedderOptions, SentenceEmbedder};
//!
//! # fn main() -> fleet_models::Result<()> {
//! let embedder = SentenceEmbedder::load("target/minilm/all-MiniLM-L6-v2", &EmbedderOptions::default())?;
//! let vectors = embedder.embed_vecs(&["What is the Near-RT RIC?", "E2 interface"])?;
//! assert_eq!(vectors[0].len(), embedder.dim());
//! # Ok(()) }
//! ```
//!
//! The encoder layers are candle-transformers' `bert::BertEncoder`. The embedding layer and
//! the attention mask are built here: `bert::BertModel::forward` (candle-transformers 0.11.1)
//! makes its additive mask as `(1 - mask) * f32::MIN` cast to the model dtype, which is −inf in
//! f16/bf16 and turns every unmasked score into `0 × −inf = NaN`. Here the mask holds the
//! dtype's most negative finite value where transformers puts `torch.finfo(dtype).min`, and
//! 0 elsewhere, so f16 and bf16 work; in f32 the computation is the one `BertModel` does.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Module, VarBuilder};
use candle_transformers::models::bert::{
    BertEncoder, Config as BertConfig, HiddenAct, PositionEmbeddingType,
};
use serde::{Deserialize, Serialize};
use tokenizers::{
    Encoding, NormalizerWrapper, TruncationDirection, TruncationParams, TruncationStrategy,
};

use crate::error::{ModelError, Result};
use crate::source::{CheckpointFiles, HubOptions, HubRepo, ModelSource};
use crate::weights::{Init, Unread, Weights};

/// How to load a [`SentenceEmbedder`].
#[derive(Debug, Clone)]
pub struct EmbedderOptions {
    /// Where the model runs (pass the same `Device` value as the other models on that GPU:
    /// candle tells devices apart by identity).
    pub device: Device,
    /// Compute dtype of the encoder (f32, f16 or bf16). Pooling and normalisation are always
    /// computed in f32 and embeddings are returned as f32.
    pub dtype: DType,
    /// Sentences per forward pass.
    pub batch_size: usize,
    /// Hub revision (branch, tag or commit) for hub ids.
    pub revision: Option<String>,
    /// Hub cache and offline mode.
    pub hub: HubOptions,
}

impl Default for EmbedderOptions {
    fn default() -> Self {
        EmbedderOptions {
            device: Device::Cpu,
            dtype: DType::F32,
            // sentence-transformers' encode() default.
            batch_size: 32,
            revision: None,
            hub: HubOptions::from_env(),
        }
    }
}

/// A pooling mode of sentence-transformers' `Pooling` module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The first token's (`[CLS]`) hidden state.
    Cls,
    /// Element-wise maximum over the sentence's tokens.
    Max,
    /// Mean over the sentence's tokens (padding excluded).
    Mean,
    /// Sum over the sentence's tokens divided by the square root of their number.
    MeanSqrtLenTokens,
}

impl Pooling {
    /// The name sentence-transformers uses (`cls`, `max`, `mean`, `mean_sqrt_len_tokens`).
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Cls => "cls",
            Pooling::Max => "max",
            Pooling::Mean => "mean",
            Pooling::MeanSqrtLenTokens => "mean_sqrt_len_tokens",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "cls" => Some(Pooling::Cls),
            "max" => Some(Pooling::Max),
            "mean" => Some(Pooling::Mean),
            "mean_sqrt_len_tokens" => Some(Pooling::MeanSqrtLenTokens),
            _ => None,
        }
    }
}

/// What a vector index must know about the embedder that filled it, to refuse vectors from
/// another one. Stored with the index (serde); compare with [`EmbedderId::check_compatible`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmbedderId {
    /// The checkpoint as given: a local path or a hub id (`owner/name`, `@revision` when not
    /// `main`). For messages only: the same weights in another directory are the same embedder.
    pub model: String,
    /// The hub commit the files came from, when known (hub sources); `None` for local dirs.
    pub revision: Option<String>,
    /// A digest of the weight files' bytes (`fnv1a64w:` + 16 hex digits: 64-bit FNV-1a over
    /// little-endian 8-byte words, then the length, per file). Not cryptographic; it tells
    /// checkpoints apart wherever they are stored.
    pub weights_digest: String,
    /// Embedding dimension.
    pub dim: usize,
    /// Tokens per sentence (longer sentences are truncated), special tokens included.
    pub max_seq_length: usize,
    /// Pooling modes, concatenated in this order.
    pub pooling: Vec<Pooling>,
    /// Whether embeddings are L2-normalised.
    pub normalize: bool,
    /// Whether text is lowercased before tokenizing (sentence_bert_config.json).
    pub do_lower_case: bool,
}

impl EmbedderId {
    /// `Ok` when vectors made by `embedder` can be searched together with the vectors this id
    /// (the one stored with an index) describes: same weights, dimension, truncation, pooling,
    /// normalisation and lowercasing. The path or hub id may differ.
    pub fn check_compatible(&self, embedder: &EmbedderId) -> Result<()> {
        let modes = |p: &[Pooling]| p.iter().map(|m| m.name()).collect::<Vec<_>>().join("+");
        let fields = [
            (
                "weights_digest",
                self.weights_digest.clone(),
                embedder.weights_digest.clone(),
            ),
            ("dim", self.dim.to_string(), embedder.dim.to_string()),
            (
                "max_seq_length",
                self.max_seq_length.to_string(),
                embedder.max_seq_length.to_string(),
            ),
            ("pooling", modes(&self.pooling), modes(&embedder.pooling)),
            (
                "normalize",
                self.normalize.to_string(),
                embedder.normalize.to_string(),
            ),
            (
                "do_lower_case",
                self.do_lower_case.to_string(),
                embedder.do_lower_case.to_string(),
            ),
        ];
        let diffs: Vec<String> = fields
            .iter()
            .filter(|(_, a, b)| a != b)
            .map(|(field, a, b)| format!("{field} {a} (index) vs {b} (embedder)"))
            .collect();
        if diffs.is_empty() {
            Ok(())
        } else {
            Err(ModelError::EmbedderMismatch {
                expected: self.model.clone(),
                found: embedder.model.clone(),
                differences: diffs.join(", "),
            })
        }
    }
}

/// A sentence-transformers BERT checkpoint, ready to embed text.
pub struct SentenceEmbedder {
    embeddings: BertEmbeddings,
    encoder: BertEncoder,
    tokenizer: tokenizers::Tokenizer,
    tokenizer_path: PathBuf,
    pad_id: u32,
    device: Device,
    dtype: DType,
    batch_size: usize,
    hidden_size: usize,
    id: EmbedderId,
}

impl SentenceEmbedder {
    /// Loads a local directory or a hub id (`owner/name`).
    pub fn load(spec: &str, opts: &EmbedderOptions) -> Result<Self> {
        let source = ModelSource::parse(spec, opts.revision.as_deref())?;
        Self::from_source(&source, opts)
    }

    /// Loads a checkpoint from a [`ModelSource`].
    pub fn from_source(source: &ModelSource, opts: &EmbedderOptions) -> Result<Self> {
        if !matches!(opts.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(ModelError::UnsupportedDtype {
                dtype: format!("{:?}", opts.dtype).to_lowercase(),
                device: format!("{:?}", opts.device.location()),
                hint: "the embedder runs in f32, f16 or bf16".into(),
            });
        }
        if opts.batch_size == 0 {
            return Err(ModelError::BadInput(
                "embedder batch_size is 0; use 1 or more".into(),
            ));
        }
        let files = StFiles::resolve(source, &opts.hub)?;
        let cfg = read_bert_config(&files.checkpoint.config)?;
        let modules = &files.modules;
        let st = read_sentence_bert_config(files.sentence_bert_config.as_deref())?;
        let max_seq_length = max_seq_length(&files, &st, &cfg)?;
        let pooling = match &modules.pooling {
            Some(_) => read_pooling(files.pooling.as_deref(), modules, cfg.hidden_size)?,
            None => vec![Pooling::Mean],
        };
        check_no_default_prompt(files.st_config.as_deref())?;

        let Some(tokenizer_path) = files.checkpoint.tokenizer.clone() else {
            return Err(ModelError::MissingFile {
                path: Path::new(&files.checkpoint.origin).join("tokenizer.json"),
                hint: "the embedder needs the fast tokenizer file; a checkpoint with only \
                       vocab.txt can be re-saved with transformers \
                       (AutoTokenizer.from_pretrained(dir).save_pretrained(dir)) to write one"
                    .into(),
            });
        };
        let tokenizer = load_tokenizer(&tokenizer_path, max_seq_length, st.do_lower_case)?;
        if tokenizer.get_vocab_size(true) > cfg.vocab_size {
            return Err(ModelError::Tokenizer {
                path: tokenizer_path,
                message: format!(
                    "has {} tokens but config.json's vocab_size is {}; tokenizer and weights are \
                     from different models",
                    tokenizer.get_vocab_size(true),
                    cfg.vocab_size
                ),
            });
        }

        let weights = Weights::from_safetensors(&files.checkpoint.weights)?;
        let names = TensorNames::detect(&weights, &files.checkpoint.weights)?;
        let get = |name: &str, shape: &[usize]| {
            weights.get(
                &names.resolve(&weights, name),
                shape,
                Init::Zeros,
                opts.dtype,
                &opts.device,
            )
        };
        let h = cfg.hidden_size;
        let embeddings = BertEmbeddings {
            word: Embedding::new(
                get("embeddings.word_embeddings.weight", &[cfg.vocab_size, h])?,
                h,
            ),
            position: Embedding::new(
                get(
                    "embeddings.position_embeddings.weight",
                    &[cfg.max_position_embeddings, h],
                )?,
                h,
            ),
            token_type: Embedding::new(
                get(
                    "embeddings.token_type_embeddings.weight",
                    &[cfg.type_vocab_size, h],
                )?,
                h,
            ),
            layer_norm: LayerNorm::new(
                get("embeddings.LayerNorm.weight", &[h])?,
                get("embeddings.LayerNorm.bias", &[h])?,
                cfg.layer_norm_eps,
            ),
        };
        // Every tensor the encoder reads, under the names candle-transformers expects, loaded
        // (and shape-checked, with the shard named on error) through fleet's Weights.
        let mut tensors = HashMap::new();
        for layer in 0..cfg.num_hidden_layers {
            for (name, shape) in encoder_tensors(&cfg, layer) {
                tensors.insert(name.clone(), get(&name, &shape)?);
            }
        }
        let vb = VarBuilder::from_tensors(tensors, opts.dtype, &opts.device);
        let encoder =
            BertEncoder::load(vb.pp("encoder"), &cfg).map_err(|e| ModelError::BadWeights {
                path: files.checkpoint.weights[0].clone(),
                message: format!("cannot build the BERT encoder: {e}"),
            })?;
        // Every tensor the embedder uses was read above; what is left must be a part that
        // sentence-transformers does not use either, or config.json does not fit the weights.
        weights.check_unread(
            |name| names.classify_unread(name),
            |unread| {
                let layers = unread
                    .iter()
                    .filter_map(|n| {
                        n.strip_prefix(names.prefix)?
                            .strip_prefix("encoder.layer.")?
                            .split('.')
                            .next()?
                            .parse::<usize>()
                            .ok()
                    })
                    .max();
                match layers {
                    Some(last) if last >= cfg.num_hidden_layers => format!(
                        "the checkpoint holds {} encoder layers but config.json has \
                         num_hidden_layers = {}: config.json does not match the weights; use \
                         the config.json saved with them",
                        last + 1,
                        cfg.num_hidden_layers
                    ),
                    _ => "config.json does not match the weights, or the checkpoint is not a \
                          BERT encoder: use the config.json saved with these weights"
                        .into(),
                }
            },
        )?;

        // Padded positions are masked out of attention and pooling, so any valid id will do;
        // BERT's own is config.json's pad_token_id.
        let pad_id = cfg.pad_token_id.min(cfg.vocab_size - 1) as u32;
        let id = EmbedderId {
            model: source.id(),
            revision: hub_commit(source, &files.checkpoint.config),
            weights_digest: weights_digest(&files.checkpoint.weights)?,
            dim: h * pooling.len(),
            max_seq_length,
            pooling,
            normalize: modules.normalize,
            do_lower_case: st.do_lower_case,
        };
        tracing::info!(
            "sentence embedder {}: dim {}, max_seq_length {}, pooling {:?}, normalize {}, {:?} on {:?}",
            id.model,
            id.dim,
            id.max_seq_length,
            id.pooling,
            id.normalize,
            opts.dtype,
            opts.device.location()
        );
        Ok(SentenceEmbedder {
            embeddings,
            encoder,
            tokenizer,
            tokenizer_path,
            pad_id,
            device: opts.device.clone(),
            dtype: opts.dtype,
            batch_size: opts.batch_size,
            hidden_size: h,
            id,
        })
    }

    /// Embedding dimension (hidden size × number of pooling modes).
    pub fn dim(&self) -> usize {
        self.id.dim
    }

    /// Tokens per sentence after truncation, special tokens included.
    pub fn max_seq_length(&self) -> usize {
        self.id.max_seq_length
    }

    /// Whether embeddings are L2-normalised (the checkpoint's modules.json lists Normalize).
    pub fn normalize(&self) -> bool {
        self.id.normalize
    }

    /// Pooling modes, concatenated in this order.
    pub fn pooling(&self) -> &[Pooling] {
        &self.id.pooling
    }

    /// The identity to store with an index built from this embedder.
    pub fn id(&self) -> &EmbedderId {
        &self.id
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The encoder's compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Sentences per forward pass.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Changes the number of sentences per forward pass (at least 1).
    pub fn set_batch_size(&mut self, batch_size: usize) {
        self.batch_size = batch_size.max(1);
    }

    /// The token ids the model sees for each text: special tokens added, truncated at
    /// [`max_seq_length`](Self::max_seq_length), no padding.
    pub fn tokenize<S: AsRef<str>>(&self, texts: &[S]) -> Result<Vec<Vec<u32>>> {
        Ok(self
            .encode(texts)?
            .iter()
            .map(|e| e.get_ids().to_vec())
            .collect())
    }

    /// Embeddings of `texts` as an f32 tensor `[n, dim]` on the model's device, in input order.
    /// Texts are run longest first in batches of [`batch_size`](Self::batch_size) (each
    /// sentence's embedding does not depend on its batch, up to float rounding).
    pub fn embed<S: AsRef<str>>(&self, texts: &[S]) -> Result<Tensor> {
        if texts.is_empty() {
            return Ok(Tensor::zeros((0, self.dim()), DType::F32, &self.device)?);
        }
        let encodings = self.encode(texts)?;
        // Longest first, as sentence-transformers does, so each batch holds similar lengths and
        // little padding.
        let mut order: Vec<usize> = (0..encodings.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(encodings[i].get_ids().len()));
        let mut parts = Vec::new();
        for chunk in order.chunks(self.batch_size) {
            let batch: Vec<&Encoding> = chunk.iter().map(|&i| &encodings[i]).collect();
            parts.push(self.forward_batch(&batch)?);
        }
        // index_select needs a contiguous input (CLS pooling leaves a strided view).
        let sorted = Tensor::cat(&parts, 0)?.contiguous()?;
        // Row r of `sorted` is text order[r]; put each row back at its text's position.
        let mut position = vec![0u32; order.len()];
        for (r, &i) in order.iter().enumerate() {
            position[i] = r as u32;
        }
        let position = Tensor::new(position.as_slice(), &self.device)?;
        Ok(sorted.index_select(&position, 0)?)
    }

    /// Embeddings of `texts` as one `Vec<f32>` of length [`dim`](Self::dim) per text.
    pub fn embed_vecs<S: AsRef<str>>(&self, texts: &[S]) -> Result<Vec<Vec<f32>>> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self.embed(texts)?.to_vec2::<f32>()?)
    }

    /// The embedding of one text.
    pub fn embed_one(&self, text: &str) -> Result<Vec<f32>> {
        Ok(self.embed_vecs(&[text])?.remove(0))
    }

    fn encode<S: AsRef<str>>(&self, texts: &[S]) -> Result<Vec<Encoding>> {
        let inputs: Vec<&str> = texts.iter().map(|t| t.as_ref()).collect();
        self.tokenizer
            .encode_batch(inputs, true)
            .map_err(|e| ModelError::Tokenizer {
                path: self.tokenizer_path.clone(),
                message: e.to_string(),
            })
    }

    /// One right-padded batch → `[b, dim]` f32.
    fn forward_batch(&self, batch: &[&Encoding]) -> Result<Tensor> {
        let b = batch.len();
        let t = batch.iter().map(|e| e.get_ids().len()).max().unwrap_or(0);
        let mut ids = vec![self.pad_id; b * t];
        let mut type_ids = vec![0u32; b * t];
        let mut mask = vec![0f32; b * t];
        for (row, e) in batch.iter().enumerate() {
            let n = e.get_ids().len();
            ids[row * t..row * t + n].copy_from_slice(e.get_ids());
            type_ids[row * t..row * t + n].copy_from_slice(e.get_type_ids());
            mask[row * t..row * t + n].fill(1.0);
        }
        let ids = Tensor::from_vec(ids, (b, t), &self.device)?;
        let type_ids = Tensor::from_vec(type_ids, (b, t), &self.device)?;
        // Additive attention mask [b, 1, 1, t]: 0 on tokens, the dtype's most negative finite
        // value on padding (transformers' torch.finfo(dtype).min), built directly in that dtype.
        let neg = match self.dtype {
            DType::F16 => half::f16::MIN.to_f32(),
            DType::BF16 => half::bf16::MIN.to_f32(),
            _ => f32::MIN,
        };
        let additive: Vec<f32> = mask
            .iter()
            .map(|&m| if m > 0.0 { 0.0 } else { neg })
            .collect();
        let additive =
            Tensor::from_vec(additive, (b, 1, 1, t), &self.device)?.to_dtype(self.dtype)?;
        let mask = Tensor::from_vec(mask, (b, t, 1), &self.device)?;

        let x = self.embeddings.forward(&ids, &type_ids)?;
        let hidden = self.encoder.forward(&x, &additive)?.to_dtype(DType::F32)?;
        let mut parts = Vec::with_capacity(self.id.pooling.len());
        for mode in &self.id.pooling {
            parts.push(pool(*mode, &hidden, &mask)?);
        }
        let pooled = Tensor::cat(&parts, D::Minus1)?;
        debug_assert_eq!(pooled.dim(1)?, self.hidden_size * self.id.pooling.len());
        if !self.id.normalize {
            return Ok(pooled);
        }
        // torch.nn.functional.normalize(x, p=2, dim=-1): x / max(||x||, 1e-12).
        let norm = pooled
            .sqr()?
            .sum_keepdim(D::Minus1)?
            .sqrt()?
            .maximum(1e-12)?;
        Ok(pooled.broadcast_div(&norm)?)
    }
}

/// sentence-transformers' pooling of `hidden` `[b, t, h]` (f32) with `mask` `[b, t, 1]`
/// (1 on tokens, 0 on padding).
fn pool(mode: Pooling, hidden: &Tensor, mask: &Tensor) -> Result<Tensor> {
    // torch.clamp(mask.sum(1), min=1e-9), as sentence-transformers divides.
    let count = || -> Result<Tensor> { Ok(mask.sum(1)?.maximum(1e-9)?) };
    Ok(match mode {
        // Right padding: the first token is [CLS] in every row.
        Pooling::Cls => hidden.narrow(1, 0, 1)?.squeeze(1)?,
        Pooling::Mean => hidden
            .broadcast_mul(mask)?
            .sum(1)?
            .broadcast_div(&count()?)?,
        Pooling::MeanSqrtLenTokens => hidden
            .broadcast_mul(mask)?
            .sum(1)?
            .broadcast_div(&count()?.sqrt()?)?,
        Pooling::Max => {
            let keep = mask.ne(0f32)?.broadcast_as(hidden.shape())?;
            let neg =
                Tensor::new(f32::NEG_INFINITY, hidden.device())?.broadcast_as(hidden.shape())?;
            keep.where_cond(hidden, &neg)?.max(1)?
        }
    })
}

/// BERT's input embeddings: word + token type + absolute position, then LayerNorm.
struct BertEmbeddings {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    layer_norm: LayerNorm,
}

impl BertEmbeddings {
    fn forward(&self, ids: &Tensor, type_ids: &Tensor) -> Result<Tensor> {
        let t = ids.dim(1)?;
        let positions = Tensor::arange(0u32, t as u32, ids.device())?;
        // Same order of additions as transformers' BertEmbeddings.
        let x = (self.word.forward(ids)? + self.token_type.forward(type_ids)?)?
            .broadcast_add(&self.position.forward(&positions)?)?;
        Ok(self.layer_norm.forward(&x)?)
    }
}

/// The names and shapes of one encoder layer's tensors, as candle-transformers' `BertEncoder`
/// reads them (under `encoder.`).
fn encoder_tensors(cfg: &BertConfig, layer: usize) -> Vec<(String, Vec<usize>)> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let p = format!("encoder.layer.{layer}");
    let mut out = Vec::new();
    let mut linear = |name: &str, out_f: usize, in_f: usize| {
        out.push((format!("{p}.{name}.weight"), vec![out_f, in_f]));
        out.push((format!("{p}.{name}.bias"), vec![out_f]));
    };
    linear("attention.self.query", h, h);
    linear("attention.self.key", h, h);
    linear("attention.self.value", h, h);
    linear("attention.output.dense", h, h);
    linear("intermediate.dense", i, h);
    linear("output.dense", h, i);
    for ln in ["attention.output.LayerNorm", "output.LayerNorm"] {
        out.push((format!("{p}.{ln}.weight"), vec![h]));
        out.push((format!("{p}.{ln}.bias"), vec![h]));
    }
    out
}

/// How the checkpoint spells tensor names: with or without the `bert.` prefix (a BertModel
/// saved alone has none; one saved inside BertForMaskedLM and the like has it), and LayerNorm
/// parameters as `weight`/`bias` or, in old TF-converted checkpoints, `gamma`/`beta`.
struct TensorNames {
    prefix: &'static str,
}

impl TensorNames {
    fn detect(weights: &Weights, files: &[PathBuf]) -> Result<Self> {
        for prefix in ["", "bert."] {
            if weights.contains(&format!("{prefix}embeddings.word_embeddings.weight")) {
                return Ok(TensorNames { prefix });
            }
        }
        Err(ModelError::BadWeights {
            path: files.first().cloned().unwrap_or_default(),
            message: "no BERT word embeddings: neither `embeddings.word_embeddings.weight` nor \
                      `bert.embeddings.word_embeddings.weight` is in the checkpoint; the embedder \
                      loads BERT checkpoints only"
                .into(),
        })
    }

    /// Tensors of a BERT checkpoint the embedder may leave unread: BERT's pooler (the
    /// sentence embedding is pooled from the token states, as sentence-transformers does),
    /// the `position_ids` / `token_type_ids` buffers old transformers versions saved (it drops
    /// them silently), and, in a checkpoint saved with a task head (`bert.` prefix), the head
    /// (`cls.*`, ...), which transformers reports with a warning when it loads a BertModel.
    fn classify_unread(&self, name: &str) -> Unread {
        match name.strip_prefix(self.prefix) {
            Some("pooler.dense.weight" | "pooler.dense.bias") => Unread::Ignore,
            Some("embeddings.position_ids" | "embeddings.token_type_ids") => Unread::Ignore,
            Some(_) => Unread::Refuse,
            // Outside the `bert.` prefix (an empty prefix matches every name): the task head.
            None => Unread::Warn(
                "the checkpoint was saved with a task head (its BERT tensors are under `bert.`); \
                 the embedder uses the encoder only, as transformers' BertModel does",
            ),
        }
    }

    fn resolve(&self, weights: &Weights, canonical: &str) -> String {
        let name = format!("{}{canonical}", self.prefix);
        if weights.contains(&name) {
            return name;
        }
        let legacy = name
            .strip_suffix("LayerNorm.weight")
            .map(|s| format!("{s}LayerNorm.gamma"))
            .or_else(|| {
                name.strip_suffix("LayerNorm.bias")
                    .map(|s| format!("{s}LayerNorm.beta"))
            });
        match legacy {
            Some(l) if weights.contains(&l) => l,
            // Let Weights::get report the missing tensor with its shard.
            _ => name,
        }
    }
}

/// config.json of a BERT checkpoint, read by fleet (for its messages) and turned into
/// candle-transformers' config.
#[derive(Deserialize)]
struct BertConfigFile {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    intermediate_size: usize,
    #[serde(default = "default_hidden_act")]
    hidden_act: String,
    max_position_embeddings: usize,
    #[serde(default = "default_type_vocab_size")]
    type_vocab_size: usize,
    #[serde(default = "default_layer_norm_eps")]
    layer_norm_eps: f64,
    #[serde(default)]
    pad_token_id: Option<usize>,
    #[serde(default)]
    position_embedding_type: Option<String>,
}

fn default_hidden_act() -> String {
    "gelu".into()
}
fn default_type_vocab_size() -> usize {
    2
}
fn default_layer_norm_eps() -> f64 {
    1e-12
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::BadJson {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

fn read_bert_config(path: &Path) -> Result<BertConfig> {
    let c: BertConfigFile = read_json(path)?;
    let bad = |field: &str, value: String, hint: &str| ModelError::BadConfig {
        path: path.to_path_buf(),
        field: field.into(),
        value,
        hint: hint.into(),
    };
    match c.model_type.as_deref() {
        Some("bert") => {}
        other => {
            return Err(ModelError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                arch: other.unwrap_or("(no model_type)").to_string(),
                supported: "BERT sentence embedders (model_type `bert`, e.g. all-MiniLM-L6-v2)"
                    .into(),
            })
        }
    }
    let hidden_act = match c.hidden_act.as_str() {
        // transformers' "gelu" is the exact (erf) GELU; "gelu_new" and "gelu_pytorch_tanh"
        // are the tanh approximation.
        "gelu" => HiddenAct::Gelu,
        "gelu_new" | "gelu_pytorch_tanh" => HiddenAct::GeluApproximate,
        "relu" => HiddenAct::Relu,
        other => {
            return Err(bad(
                "hidden_act",
                format!("\"{other}\""),
                "fleet's BERT supports gelu, gelu_new, gelu_pytorch_tanh and relu",
            ))
        }
    };
    if let Some(p) = c.position_embedding_type.as_deref() {
        if p != "absolute" {
            return Err(bad(
                "position_embedding_type",
                format!("\"{p}\""),
                "fleet's BERT supports absolute position embeddings only",
            ));
        }
    }
    for (field, v) in [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("max_position_embeddings", c.max_position_embeddings),
        ("type_vocab_size", c.type_vocab_size),
    ] {
        if v == 0 {
            return Err(bad(
                field,
                "0".into(),
                "must be positive; the config is corrupt",
            ));
        }
    }
    if c.num_attention_heads == 0 || !c.hidden_size.is_multiple_of(c.num_attention_heads) {
        return Err(bad(
            "num_attention_heads",
            c.num_attention_heads.to_string(),
            &format!(
                "must divide hidden_size ({}); the config is corrupt",
                c.hidden_size
            ),
        ));
    }
    Ok(BertConfig {
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        intermediate_size: c.intermediate_size,
        hidden_act,
        hidden_dropout_prob: 0.0,
        max_position_embeddings: c.max_position_embeddings,
        type_vocab_size: c.type_vocab_size,
        initializer_range: 0.02,
        layer_norm_eps: c.layer_norm_eps,
        pad_token_id: c.pad_token_id.unwrap_or(0),
        position_embedding_type: PositionEmbeddingType::Absolute,
        use_cache: false,
        classifier_dropout: None,
        model_type: Some("bert".into()),
    })
}

/// What modules.json says about the pipeline.
struct Modules {
    /// `(path, index)` of the Pooling module, if listed.
    pooling: Option<(String, usize)>,
    /// Whether a Normalize module follows.
    normalize: bool,
    /// modules.json, for messages.
    path: Option<PathBuf>,
}

#[derive(Deserialize)]
struct ModuleEntry {
    #[serde(default)]
    path: String,
    #[serde(rename = "type")]
    kind: String,
}

/// The class name at the end of a module type (`sentence_transformers.models.Pooling` and
/// `sentence_transformers.sentence_transformer.modules.pooling.Pooling` are both `Pooling`).
fn module_class(kind: &str) -> &str {
    kind.rsplit('.').next().unwrap_or(kind)
}

fn read_modules(path: Option<&Path>) -> Result<Modules> {
    let Some(path) = path else {
        // What sentence-transformers does with a plain transformers checkpoint: mean pooling,
        // no normalisation. Recorded in the EmbedderId, and said here.
        tracing::warn!(
            "no modules.json: not a sentence-transformers checkpoint; using mean pooling without \
             normalisation, as sentence-transformers does"
        );
        return Ok(Modules {
            pooling: None,
            normalize: false,
            path: None,
        });
    };
    let entries: Vec<ModuleEntry> = read_json(path)?;
    let bad = |i: usize, value: &str, hint: &str| ModelError::BadConfig {
        path: path.to_path_buf(),
        field: format!("[{i}].type"),
        value: value.to_string(),
        hint: hint.to_string(),
    };
    let expected = "fleet runs Transformer → Pooling → optional Normalize";
    let mut pooling = None;
    let mut normalize = false;
    for (i, m) in entries.iter().enumerate() {
        match (i, module_class(&m.kind)) {
            (0, "Transformer") => {
                if !m.path.is_empty() {
                    return Err(ModelError::BadConfig {
                        path: path.to_path_buf(),
                        field: "[0].path".into(),
                        value: format!("\"{}\"", m.path),
                        hint: "the Transformer module must be the checkpoint's root directory \
                               (as sentence-transformers 2.x and later save it); re-save the \
                               model with a current sentence-transformers"
                            .into(),
                    });
                }
            }
            (1, "Pooling") => pooling = Some((m.path.clone(), i)),
            (2, "Normalize") if pooling.is_some() => normalize = true,
            (_, class) => {
                return Err(bad(
                    i,
                    &m.kind,
                    &format!("module `{class}` in position {i} is not supported; {expected}"),
                ))
            }
        }
    }
    if pooling.is_none() {
        return Err(ModelError::BadConfig {
            path: path.to_path_buf(),
            field: "[1]".into(),
            value: "(missing)".into(),
            hint: format!(
                "no Pooling module, so the model gives no sentence embedding; {expected}"
            ),
        });
    }
    Ok(Modules {
        pooling,
        normalize,
        path: Some(path.to_path_buf()),
    })
}

/// sentence_bert_config.json: both the 2.x keys and the 6.x ones (which drop max_seq_length in
/// favour of tokenizer_config.json's model_max_length) parse; unknown keys are ignored.
#[derive(Deserialize, Default)]
struct SentenceBertConfig {
    #[serde(default)]
    max_seq_length: Option<usize>,
    #[serde(default)]
    do_lower_case: bool,
}

fn read_sentence_bert_config(path: Option<&Path>) -> Result<SentenceBertConfig> {
    path.map(read_json)
        .transpose()
        .map(Option::unwrap_or_default)
}

/// sentence-transformers' rule: sentence_bert_config.json's max_seq_length, else
/// tokenizer_config.json's model_max_length capped at max_position_embeddings.
fn max_seq_length(files: &StFiles, st: &SentenceBertConfig, cfg: &BertConfig) -> Result<usize> {
    if let Some(n) = st.max_seq_length {
        let path = files.sentence_bert_config.clone().unwrap_or_default();
        if n > cfg.max_position_embeddings {
            return Err(ModelError::BadConfig {
                path,
                field: "max_seq_length".into(),
                value: n.to_string(),
                hint: format!(
                    "the model has only {} positions (config.json max_position_embeddings); \
                     lower max_seq_length to {} or less",
                    cfg.max_position_embeddings, cfg.max_position_embeddings
                ),
            });
        }
        if n < 2 {
            return Err(ModelError::BadConfig {
                path,
                field: "max_seq_length".into(),
                value: n.to_string(),
                hint: "it must leave room for [CLS] and [SEP]: use 2 or more".into(),
            });
        }
        return Ok(n);
    }
    #[derive(Deserialize)]
    struct TokenizerConfig {
        #[serde(default)]
        model_max_length: Option<f64>,
    }
    let from_tokenizer = match &files.checkpoint.tokenizer_config {
        // transformers writes a huge float (1e30) when the tokenizer has no limit.
        Some(p) => read_json::<TokenizerConfig>(p)?
            .model_max_length
            .filter(|n| *n >= 2.0)
            .map(|n| n.min(usize::MAX as f64) as usize),
        None => None,
    };
    Ok(from_tokenizer
        .unwrap_or(usize::MAX)
        .min(cfg.max_position_embeddings))
}

/// 1_Pooling/config.json: the legacy boolean keys (`pooling_mode_mean_tokens`, …, concatenated
/// in sentence-transformers' fixed order) or the 6.x `pooling_mode` string / list.
fn read_pooling(path: Option<&Path>, modules: &Modules, hidden: usize) -> Result<Vec<Pooling>> {
    let (dir, _) = modules.pooling.clone().unwrap_or_default();
    let path = path.ok_or_else(|| ModelError::MissingFile {
        path: modules
            .path
            .as_deref()
            .and_then(Path::parent)
            .unwrap_or(Path::new(""))
            .join(&dir)
            .join("config.json"),
        hint: "modules.json lists a Pooling module but its config.json is absent; download the \
               complete checkpoint"
            .into(),
    })?;
    let v: serde_json::Value = read_json(path)?;
    let bad = |field: &str, value: String, hint: String| ModelError::BadConfig {
        path: path.to_path_buf(),
        field: field.into(),
        value,
        hint,
    };
    let supported = "fleet supports cls, max, mean and mean_sqrt_len_tokens";
    let dim = v
        .get("embedding_dimension")
        .or_else(|| v.get("word_embedding_dimension"))
        .and_then(|d| d.as_u64());
    if let Some(d) = dim {
        if d as usize != hidden {
            return Err(bad(
                "word_embedding_dimension",
                d.to_string(),
                format!("config.json's hidden_size is {hidden}; pooling config and model disagree"),
            ));
        }
    }
    let mut modes = Vec::new();
    if let Some(mode) = v.get("pooling_mode") {
        let names: Vec<String> = match mode {
            serde_json::Value::String(s) => vec![s.clone()],
            serde_json::Value::Array(a) => a
                .iter()
                .map(|m| {
                    m.as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| m.to_string())
                })
                .collect(),
            other => {
                return Err(bad(
                    "pooling_mode",
                    other.to_string(),
                    "must be a mode name or a list of them".into(),
                ))
            }
        };
        for n in names {
            modes.push(
                Pooling::from_name(&n).ok_or_else(|| {
                    bad("pooling_mode", format!("\"{n}\""), supported.to_string())
                })?,
            );
        }
    } else {
        // The order sentence-transformers concatenates legacy modes in.
        let legacy = [
            ("pooling_mode_cls_token", Some(Pooling::Cls)),
            ("pooling_mode_max_tokens", Some(Pooling::Max)),
            ("pooling_mode_mean_tokens", Some(Pooling::Mean)),
            (
                "pooling_mode_mean_sqrt_len_tokens",
                Some(Pooling::MeanSqrtLenTokens),
            ),
            ("pooling_mode_weightedmean_tokens", None),
            ("pooling_mode_lasttoken", None),
        ];
        for (key, mode) in legacy {
            if v.get(key).and_then(|b| b.as_bool()) == Some(true) {
                modes.push(mode.ok_or_else(|| bad(key, "true".into(), supported.to_string()))?);
            }
        }
        if modes.is_empty() {
            // sentence-transformers' default when no mode is set.
            modes.push(Pooling::Mean);
        }
    }
    if modes.is_empty() {
        return Err(bad(
            "pooling_mode",
            "[]".into(),
            "names no mode; use e.g. \"mean\"".into(),
        ));
    }
    Ok(modes)
}

/// sentence-transformers prepends `prompts[default_prompt_name]` to every text; fleet does not,
/// so such a checkpoint would silently embed different text.
fn check_no_default_prompt(path: Option<&Path>) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let v: serde_json::Value = read_json(path)?;
    match v.get("default_prompt_name") {
        None | Some(serde_json::Value::Null) => Ok(()),
        Some(name) => Err(ModelError::BadConfig {
            path: path.to_path_buf(),
            field: "default_prompt_name".into(),
            value: name.to_string(),
            hint: "fleet's embedder does not prepend prompts; use a checkpoint without a default \
                   prompt, or set it to null and prepend the prompt to the texts yourself"
                .into(),
        }),
    }
}

fn load_tokenizer(
    path: &Path,
    max_seq_length: usize,
    do_lower_case: bool,
) -> Result<tokenizers::Tokenizer> {
    let fail = |message: String| ModelError::Tokenizer {
        path: path.to_path_buf(),
        message,
    };
    let mut tok =
        tokenizers::Tokenizer::from_file(path).map_err(|e| fail(format!("cannot load: {e}")))?;
    // tokenizer.json may carry its own truncation and fixed padding (all-MiniLM-L6-v2's
    // truncates at 128 and pads to 128); sentence-transformers overrides both with
    // max_seq_length and pad-to-longest, and so does fleet (padding is done per batch here).
    tok.with_truncation(Some(TruncationParams {
        direction: TruncationDirection::Right,
        max_length: max_seq_length,
        strategy: TruncationStrategy::LongestFirst,
        stride: 0,
    }))
    .map_err(|e| fail(format!("cannot truncate at {max_seq_length}: {e}")))?;
    tok.with_padding(None);
    if do_lower_case {
        // sentence-transformers 6 puts a Lowercase normalizer in front of the tokenizer's own.
        let mut seq = vec![NormalizerWrapper::Lowercase(
            tokenizers::normalizers::Lowercase,
        )];
        seq.extend(tok.get_normalizer().cloned());
        tok.with_normalizer(Some(tokenizers::normalizers::Sequence::new(seq)));
    }
    Ok(tok)
}

/// The hub commit of a resolved hub checkpoint (its files live in `snapshots/<commit>/`).
fn hub_commit(source: &ModelSource, config: &Path) -> Option<String> {
    let ModelSource::Hub { revision, .. } = source else {
        return None;
    };
    let snapshot = config.parent()?;
    if snapshot.parent()?.file_name()? == "snapshots" {
        snapshot.file_name()?.to_str().map(str::to_string)
    } else {
        Some(revision.clone())
    }
}

/// 64-bit FNV-1a over little-endian 8-byte words (and trailing bytes), then each file's length:
/// stable across platforms and Rust versions, and fast enough to run at every load.
fn weights_digest(files: &[PathBuf]) -> Result<String> {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        let mut f = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        let mut len = 0u64;
        loop {
            // Fill the whole buffer (short reads happen), so words never straddle two reads.
            let mut n = 0;
            while n < buf.len() {
                match f.read(&mut buf[n..]) {
                    Ok(0) => break,
                    Ok(k) => n += k,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(ModelError::io(path, e)),
                }
            }
            if n == 0 {
                break;
            }
            len += n as u64;
            let mut words = buf[..n].chunks_exact(8);
            for w in &mut words {
                let w = u64::from_le_bytes(w.try_into().expect("chunks of 8"));
                h = (h ^ w).wrapping_mul(PRIME);
            }
            for &byte in words.remainder() {
                h = (h ^ byte as u64).wrapping_mul(PRIME);
            }
            if n < buf.len() {
                break;
            }
        }
        h = (h ^ len).wrapping_mul(PRIME);
    }
    Ok(format!("fnv1a64w:{h:016x}"))
}

/// The files of a sentence-transformers checkpoint.
struct StFiles {
    /// The Transformer module's files (config.json, weights, tokenizer).
    checkpoint: CheckpointFiles,
    /// modules.json, parsed.
    modules: Modules,
    sentence_bert_config: Option<PathBuf>,
    pooling: Option<PathBuf>,
    /// config_sentence_transformers.json (prompts).
    st_config: Option<PathBuf>,
}

impl StFiles {
    fn resolve(source: &ModelSource, hub: &HubOptions) -> Result<Self> {
        let files = match source {
            ModelSource::Local(dir) => ExtraFiles::Local(dir.clone()),
            ModelSource::Hub { repo, revision } => {
                ExtraFiles::Hub(Box::new(HubRepo::new(repo, revision, hub)?))
            }
        };
        let extra = |name: &str| files.get(name);
        let modules_file = extra("modules.json")?;
        if modules_file.is_none() {
            if let ModelSource::Hub { repo, .. } = source {
                if hub.offline {
                    return Err(ModelError::Source {
                        model: source.id(),
                        message: format!(
                            "modules.json of {repo} is not in the hub cache and HF_HUB_OFFLINE \
                             is set; load the model once with network access, or pass a local \
                             directory"
                        ),
                    });
                }
            }
        }
        let modules = read_modules(modules_file.as_deref())?;
        let pooling = match &modules.pooling {
            Some((dir, _)) if dir.is_empty() => extra("config.json")?,
            Some((dir, _)) => extra(&format!("{dir}/config.json"))?,
            None => None,
        };
        let checkpoint = source.resolve(hub).map_err(|e| weights_hint(source, e))?;
        Ok(StFiles {
            checkpoint,
            modules,
            sentence_bert_config: extra("sentence_bert_config.json")?,
            pooling,
            st_config: extra("config_sentence_transformers.json")?,
        })
    }
}

/// Where the module files (those [`ModelSource::resolve`] does not look for) come from.
enum ExtraFiles {
    Local(PathBuf),
    Hub(Box<HubRepo>),
}

impl ExtraFiles {
    /// `Ok(None)` when the checkpoint has no such file.
    fn get(&self, name: &str) -> Result<Option<PathBuf>> {
        match self {
            ExtraFiles::Local(dir) => {
                let p = dir.join(name);
                Ok(p.is_file().then_some(p))
            }
            ExtraFiles::Hub(h) => h.optional(name),
        }
    }
}

/// A local checkpoint with PyTorch weights only gets told how to convert them.
fn weights_hint(source: &ModelSource, e: ModelError) -> ModelError {
    match (source, e) {
        (ModelSource::Local(dir), ModelError::MissingFile { path, hint })
            if dir.join("pytorch_model.bin").is_file() && !path.ends_with("config.json") =>
        {
            ModelError::MissingFile {
                path,
                hint: format!(
                    "{hint}. This checkpoint has only pytorch_model.bin; convert it once with \
                     python -c \"from sentence_transformers import SentenceTransformer as S; \
                     S('{d}').save('{d}-safetensors')\" and load that directory",
                    d = dir.display()
                ),
            }
        }
        (_, e) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replica pools share one embedder across worker threads.
    #[test]
    fn embedder_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<SentenceEmbedder>();
    }

    #[test]
    fn digest_is_stable_and_sees_every_byte() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.safetensors");
        let mut bytes: Vec<u8> = (0..3_000_003u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&p, &bytes).unwrap();
        let a = weights_digest(std::slice::from_ref(&p)).unwrap();
        assert_eq!(a, weights_digest(std::slice::from_ref(&p)).unwrap());
        assert!(a.starts_with("fnv1a64w:") && a.len() == 9 + 16, "{a}");
        bytes[2_500_000] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        assert_ne!(a, weights_digest(std::slice::from_ref(&p)).unwrap());
        // A trailing zero byte changes the length, hence the digest.
        bytes[2_500_000] ^= 1;
        bytes.push(0);
        std::fs::write(&p, &bytes).unwrap();
        assert_ne!(a, weights_digest(&[p]).unwrap());
    }

    #[test]
    fn pooling_config_formats() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        let modules = Modules {
            pooling: Some(("1_Pooling".into(), 1)),
            normalize: false,
            path: None,
        };
        let read = |json: &str| {
            std::fs::write(&p, json).unwrap();
            read_pooling(Some(&p), &modules, 8)
        };
        assert_eq!(
            read(r#"{"word_embedding_dimension": 8, "pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true}"#).unwrap(),
            vec![Pooling::Cls, Pooling::Mean]
        );
        assert_eq!(
            read(r#"{"embedding_dimension": 8, "pooling_mode": ["max", "mean_sqrt_len_tokens"]}"#)
                .unwrap(),
            vec![Pooling::Max, Pooling::MeanSqrtLenTokens]
        );
        assert_eq!(
            read(r#"{"word_embedding_dimension": 8}"#).unwrap(),
            vec![Pooling::Mean]
        );
        let e = read(r#"{"embedding_dimension": 9, "pooling_mode": "mean"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_size is 8"), "{e}");
        let e = read(r#"{"pooling_mode_lasttoken": true}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("pooling_mode_lasttoken") && e.contains("fleet supports"),
            "{e}"
        );
    }
}
