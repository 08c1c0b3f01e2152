//! The differentiable path against transformers: per-token log-probs and the gradient of
//! sum(weights * logp) with respect to every parameter, on the tiny fixtures, in f32
//! (goldens by scripts/fixtures/make_grad_goldens.py).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use fleet_models::qwen::train::{ParamGrads, TokenBatch, TokenLogprobs, TrainableQwen};
use fleet_models::{DeviceMap, HubOptions, ModelSource, QwenConfig, Weights};

mod devices;
use devices::test_devices;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn load(name: &str, map: Option<DeviceMap>) -> TrainableQwen {
    let dir = fixtures().join(name);
    let files = ModelSource::parse(dir.to_str().unwrap(), None)
        .unwrap()
        .resolve(&HubOptions::from_env())
        .unwrap();
    let cfg = QwenConfig::from_file(&files.config).unwrap();
    let weights = Weights::from_safetensors(&files.weights).unwrap();
    // FLEET_TEST_DEVICES (default the CPU): on a GPU machine, the CUDA kernels' backward and
    // the gradient buffers' views against the same goldens.
    let map = map.unwrap_or_else(|| {
        DeviceMap::split_layers(&test_devices(), cfg.num_hidden_layers).unwrap()
    });
    TrainableQwen::new(&cfg, &weights, DType::F32, &map).unwrap()
}

struct Golden {
    batch: TokenBatch,
    logp: Tensor,
    weights: Tensor,
    grads: HashMap<String, Tensor>,
}

fn golden(name: &str) -> Golden {
    let path = fixtures().join(format!("golden/{name}-grads.safetensors"));
    let t = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let ids: Vec<Vec<i64>> = t["input_ids"].to_vec2().unwrap();
    let pad: Vec<i64> = t["pad"].to_vec1().unwrap();
    let prompt_len = t["prompt_len"].to_vec1::<i64>().unwrap()[0] as usize;
    let batch = TokenBatch {
        ids: ids
            .into_iter()
            .map(|r| r.into_iter().map(|x| x as u32).collect())
            .collect(),
        pad: pad.into_iter().map(|p| p as usize).collect(),
        prompt_len,
        packing: None,
    };
    let grads = t
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n.to_string(), v.clone())))
        .collect();
    Golden {
        batch,
        logp: t["logp"].clone(),
        weights: t["weights"].clone(),
        grads,
    }
}

/// `t` on the CPU, where the goldens are.
fn cpu(t: &Tensor) -> Tensor {
    t.to_device(&Device::Cpu).unwrap()
}

/// max |a - b| / max |b|.
fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (cpu(a), cpu(b));
    let diff = (&a - &b).unwrap().abs().unwrap().max_all().unwrap();
    let scale = b.abs().unwrap().max_all().unwrap();
    diff.to_scalar::<f32>().unwrap() / scale.to_scalar::<f32>().unwrap().max(1e-12)
}

const TEMPERATURE: f64 = 0.7;

/// One forward/backward of the goldens' loss (the weighted sum of the log-probs), its
/// gradients added into `grads`; returns the log-probs and the loss.
fn backward_into(
    model: &TrainableQwen,
    g: &Golden,
    grads: &mut ParamGrads,
) -> (TokenLogprobs, f32) {
    let weights = g.weights.clone();
    model
        .forward_backward(
            &g.batch,
            TEMPERATURE,
            &mut |logp| {
                let loss = (logp * weights.to_device(logp.device())?)?.sum_all()?;
                let value = loss.to_scalar::<f32>()?;
                Ok((loss, value))
            },
            grads,
        )
        .unwrap()
}

/// One forward/backward of `batch` with the loss `sum(weights * logp)`, into fresh gradients.
fn weighted_pass(
    model: &TrainableQwen,
    batch: &TokenBatch,
    weights: &Tensor,
) -> (TokenLogprobs, ParamGrads) {
    let mut grads = ParamGrads::new();
    let (out, _) = model
        .forward_backward(
            batch,
            TEMPERATURE,
            &mut |logp| {
                let loss = (logp * weights.to_device(logp.device())?)?.sum_all()?;
                let value = loss.to_scalar::<f32>()?;
                Ok((loss, value))
            },
            &mut grads,
        )
        .unwrap();
    (out, grads)
}

fn check(name: &str, model: &TrainableQwen) {
    let g = golden(name);
    // No-gradient pass.
    let lp = model.logprobs(&g.batch, TEMPERATURE).unwrap();
    let mask = g.weights.ne(0f32).unwrap().to_dtype(DType::F32).unwrap();
    let masked = |t: &Tensor| (cpu(t) * &mask).unwrap();
    let e = rel_err(&masked(&lp.logp), &masked(&g.logp));
    assert!(e < 1e-5, "{name}: logp rel err {e}");

    let mut grads = ParamGrads::new();
    let (out, loss) = backward_into(model, &g, &mut grads);
    let e = rel_err(&masked(&out.logp), &masked(&g.logp));
    assert!(e < 1e-5, "{name}: forward_backward logp rel err {e}");
    // The log-prob pass gives the training forward's values to the bit: gspo-train takes the
    // update's own log-probs as the old ones of the micro-batches before its first optimizer
    // step, instead of a pass of their own.
    let bits = |t: &Tensor| masked(t).flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(
        bits(&lp.logp)
            .iter()
            .zip(bits(&out.logp))
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{name}: the log-prob pass and the training forward differ"
    );
    assert!(loss.is_finite());

    let params = model.params();
    assert_eq!(params.len(), g.grads.len(), "{name}: parameters vs goldens");
    for ((pname, var), grad) in params.iter().zip(grads.iter()) {
        let want = &g.grads[pname];
        let got = grad.unwrap_or_else(|| panic!("{name}: no gradient reached {pname}"));
        // On its parameter's own device (stream): candle tells two logical devices of one GPU
        // apart only by identity, so a gradient kept on the other one would go unnoticed and
        // race (issue 24: a sharded policy's step 2 was NaN on logical devices).
        assert!(
            got.device().same_device(var.device()),
            "{name}: the gradient of {pname} is not on its parameter's device"
        );
        let e = rel_err(got, want);
        assert!(e < 1e-4, "{name}: gradient of {pname}: rel err {e}");
    }
}

#[test]
fn qwen2_gradients_match_transformers() {
    let mut model = load("qwen2-tiny", None);
    check("qwen2-tiny", &model);
    // Without checkpointing, and with a head chunk smaller than the rows: the same numbers.
    model.gradient_checkpointing = false;
    model.head_chunk_rows = 5;
    check("qwen2-tiny", &model);
    // Gradients summed in place a few rows at a time (what the 0.5-1 GB embedding gradient of
    // a real vocabulary takes): the same numbers.
    model.gradient_slice_elements = 100;
    check("qwen2-tiny", &model);
}

#[test]
fn qwen3_gradients_match_transformers() {
    check("qwen3-tiny", &load("qwen3-tiny", None));
}

#[test]
fn tied_embeddings_sum_both_gradients_and_layers_may_sit_on_several_devices() {
    // The map splits blocks into two groups (two CPU devices are one device to candle, but
    // the boundary code runs).
    let mut model = load("qwen2-tiny-tied-sharded", None);
    check("qwen2-tiny-tied-sharded", &model);
    // Several head chunks, each product added to the tied weight's gradient in vocabulary
    // slices, then the embedding's own gradient summed in place: the same numbers.
    model.head_chunk_rows = 5;
    model.gradient_slice_elements = 100;
    check("qwen2-tiny-tied-sharded", &model);
}

/// Two backward passes into the same gradients (gradient accumulation) sum them: every
/// parameter's gradient is twice the golden one, also when the sums are made in place a few
/// elements at a time.
#[test]
fn gradients_accumulate_over_passes_in_place() {
    for slice in [usize::MAX, 100] {
        let mut model = load("qwen2-tiny-tied-sharded", None);
        model.head_chunk_rows = 5;
        model.gradient_slice_elements = slice;
        let g = golden("qwen2-tiny-tied-sharded");
        let mut grads = ParamGrads::new();
        for _ in 0..2 {
            backward_into(&model, &g, &mut grads);
        }
        for ((pname, _), grad) in model.params().iter().zip(grads.iter()) {
            let want = (&g.grads[pname] * 2.0).unwrap();
            let e = rel_err(grad.unwrap(), &want);
            assert!(e < 1e-4, "slices of {slice}: {pname}: rel err {e}");
        }
    }
}

#[test]
fn a_loss_that_ignores_the_model_gives_no_gradient() {
    let model = load("qwen2-tiny", None);
    let g = golden("qwen2-tiny");
    let mut grads = ParamGrads::new();
    model
        .forward_backward(
            &g.batch,
            1.0,
            &mut |logp| Ok(((logp.detach() * 0.0)?.sum_all()?, ())),
            &mut grads,
        )
        .unwrap();
    assert!(grads.iter().all(|g| g.is_none()));
}

#[test]
fn the_inference_model_of_the_trained_weights_gives_the_same_logits() {
    let model = load("qwen3-tiny", None);
    let inference = model.inference_model().unwrap();
    let g = golden("qwen3-tiny");
    // Row 0 has no left padding in the golden batch when its prompt is the longest; use a
    // row-free check: the logits of one unpadded sequence.
    let row: Vec<u32> = g.batch.ids[2].clone();
    let logits = inference.logits(std::slice::from_ref(&row)).unwrap();
    let batch = TokenBatch::new(
        &[row[..row.len() - 1].to_vec()],
        &[vec![row[row.len() - 1]]],
        0,
    )
    .unwrap();
    let lp = model.logprobs(&batch, 1.0).unwrap();
    let last = logits.get(0).unwrap().get(row.len() - 2).unwrap();
    let want = candle_nn::ops::log_softmax(&last, 0)
        .unwrap()
        .get(row[row.len() - 1] as usize)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let got = lp.logp.flatten_all().unwrap().to_vec1::<f32>().unwrap()[0];
    assert!((got - want).abs() < 1e-5, "{got} vs {want}");
}

/// One call loads a trainable model from a checkpoint directory (or hub id), and its gradients
/// come back by the checkpoint's parameter names.
#[test]
fn one_call_loads_a_trainable_model_and_gradients_come_back_by_name() {
    let dir = fixtures().join("qwen2-tiny");
    let model =
        TrainableQwen::load(dir.to_str().unwrap(), &fleet_models::LoadOptions::default()).unwrap();
    let g = golden("qwen2-tiny");
    let mut grads = ParamGrads::new();
    backward_into(&model, &g, &mut grads);
    let named: Vec<(&str, &Tensor)> = model.named_gradients(&grads).collect();
    assert_eq!(named.len(), g.grads.len());
    for (name, grad) in named {
        let e = rel_err(grad, &g.grads[name]);
        assert!(e < 1e-4, "gradient of {name}: rel err {e}");
    }
}

/// Issue 28, item 4: LoRA adapters as PEFT writes them, on a frozen base: the adapters are the
/// only parameters and their gradients match PEFT + transformers' (goldens by
/// scripts/fixtures/make_lora_goldens.py); new adapters leave the model as the base was; a
/// target that names no module is refused with the model's module names.
#[test]
fn lora_adapter_gradients_match_peft() {
    use fleet_models::lora::LoraConfig;
    let dir = fixtures().join("qwen2-tiny-lora");
    let config = LoraConfig::from_dir(&dir).unwrap();
    assert_eq!((config.r, config.scaling()), (4, 2.0));
    let adapters = Weights::from_safetensors(&[dir.join("adapter_model.safetensors")]).unwrap();
    let model = load("qwen2-tiny", None)
        .with_lora(config.clone(), Some(&adapters), 0)
        .unwrap();
    check("qwen2-tiny-lora", &model);

    // Fresh adapters (B = 0): the base model's log-probs exactly.
    let g = golden("qwen2-tiny");
    let base = load("qwen2-tiny", None)
        .logprobs(&g.batch, TEMPERATURE)
        .unwrap();
    let fresh = load("qwen2-tiny", None)
        .with_lora(config.clone(), None, 7)
        .unwrap();
    let lp = fresh.logprobs(&g.batch, TEMPERATURE).unwrap();
    assert_eq!(rel_err(&lp.logp, &base.logp), 0.0);

    // The merged weights hold no adapter; the saved adapter has PEFT's file layout (the
    // committed file's names, shapes and dtypes) and reads back to the same model.
    let merged = model.merged_weights().unwrap();
    assert!(merged.keys().all(|k| !k.contains("lora_")));
    // The rollouts' inference copy (built block by block) is the model of the merged weights.
    let of_merged = fleet_models::qwen::QwenModel::new(
        model.config(),
        &Weights::Tensors(merged.clone()),
        model.dtype(),
        model.device_map(),
    )
    .unwrap();
    let row = g.batch.ids[0].clone();
    let (a, b) = (
        model
            .inference_model()
            .unwrap()
            .logits(std::slice::from_ref(&row))
            .unwrap(),
        of_merged.logits(std::slice::from_ref(&row)).unwrap(),
    );
    assert_eq!(rel_err(&a, &b), 0.0);
    let out = tempfile::tempdir().unwrap();
    model
        .save_adapter(out.path(), "tests/fixtures/qwen2-tiny")
        .unwrap();
    let read = |p: &Path| {
        candle_core::safetensors::load(p.join("adapter_model.safetensors"), &Device::Cpu).unwrap()
    };
    let (ours, peft) = (read(out.path()), read(&dir));
    assert_eq!(ours.len(), peft.len());
    for (k, t) in &peft {
        let u = &ours[k];
        assert_eq!((u.dims(), u.dtype()), (t.dims(), t.dtype()), "{k}");
        assert_eq!(rel_err(u, t), 0.0, "{k}");
    }
    // FLEET_SAVE_ADAPTER_TO=DIR keeps a copy for PEFT to load (scripts/fixtures/
    // check_peft_loads.py; PEFT needs torch, which CI does not install).
    if let Ok(keep) = std::env::var("FLEET_SAVE_ADAPTER_TO") {
        model
            .save_adapter(Path::new(&keep), "tests/fixtures/qwen2-tiny")
            .unwrap();
    }
    let again = LoraConfig::from_dir(out.path()).unwrap();
    assert_eq!(
        (again.r, again.scaling(), again.modules().len()),
        (4, 2.0, 3)
    );
    let mut bad = config;
    bad.target_modules = fleet_models::lora::TargetModules::List(vec!["qkv_proj".into()]);
    let err = load("qwen2-tiny", None)
        .with_lora(bad, None, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("q_proj, k_proj"), "{err}");
    let twice = load("qwen2-tiny", None)
        .with_lora(LoraConfig::new(2, 4.0, &["q_proj"]), None, 0)
        .unwrap()
        .with_lora(LoraConfig::new(2, 4.0, &["q_proj"]), None, 0)
        .err()
        .unwrap()
        .to_string();
    assert!(twice.contains("already carries LoRA adapters"), "{twice}");
}

/// LoRA dropout (PEFT's on the adapters' input): the backward's recompute of each block draws
/// the masks its forward drew (the same gradients with gradient checkpointing as without, where
/// each block runs once), a key always gives the same gradients and another key others, and
/// without a key (the log-prob passes) nothing is dropped.
#[test]
fn lora_dropout_masks_are_drawn_again_by_the_recompute() {
    use fleet_models::lora::LoraConfig;
    let dir = fixtures().join("qwen2-tiny-lora");
    let mut config = LoraConfig::from_dir(&dir).unwrap();
    config.lora_dropout = 0.3;
    let adapters = Weights::from_safetensors(&[dir.join("adapter_model.safetensors")]).unwrap();
    let model = |checkpointing: bool| {
        let mut m = load("qwen2-tiny", None)
            .with_lora(config.clone(), Some(&adapters), 0)
            .unwrap();
        m.gradient_checkpointing = checkpointing;
        m
    };
    let g = golden("qwen2-tiny");
    let grads_of = |m: &TrainableQwen, key: Option<u64>| -> (f32, Vec<Tensor>) {
        m.set_dropout_key(key);
        let mut grads = ParamGrads::new();
        let (_, loss) = backward_into(m, &g, &mut grads);
        m.set_dropout_key(None);
        (loss, grads.iter().map(|t| cpu(t.unwrap())).collect())
    };
    let (on, off) = (model(true), model(false));
    let (loss, a) = grads_of(&on, Some(11));
    let (loss_once, b) = grads_of(&off, Some(11));
    assert_eq!(loss, loss_once);
    for (x, y) in a.iter().zip(&b) {
        assert!(
            rel_err(x, y) < 1e-6,
            "recompute against one pass: {}",
            rel_err(x, y)
        );
    }
    let (again, c) = grads_of(&on, Some(11));
    assert_eq!(loss, again);
    assert!(a.iter().zip(&c).all(|(x, y)| rel_err(x, y) == 0.0));
    let (other, d) = grads_of(&on, Some(12));
    assert_ne!(loss, other);
    assert!(a.iter().zip(&d).any(|(x, y)| rel_err(x, y) > 1e-3));
    // No key: PEFT's adapters with dropout off, exactly the model without dropout.
    let mut plain_config = config.clone();
    plain_config.lora_dropout = 0.0;
    let plain = load("qwen2-tiny", None)
        .with_lora(plain_config, Some(&adapters), 0)
        .unwrap();
    let (no_key, e) = grads_of(&on, None);
    let (no_dropout, f) = grads_of(&plain, None);
    assert_eq!(no_key, no_dropout);
    assert!(e.iter().zip(&f).all(|(x, y)| rel_err(x, y) == 0.0));
}

/// gspo-train cuts each micro-batch's completions to its longest scored one: the columns after
/// it carry no loss weight, and a position's log-prob depends only on the tokens before it,
/// so the cut batch must give the same log-probs on the columns it keeps and the same
/// gradients.
#[test]
fn cutting_unweighted_trailing_columns_changes_no_logprob_or_gradient() {
    let model = load("qwen2-tiny", None);
    let g = golden("qwen2-tiny");
    let c = g.batch.completion_len();
    assert!(c > 2, "the golden needs a few completion columns");
    let keep = c - 2;
    // The goldens' weights without their last two columns' weight.
    let weights = Tensor::cat(
        &[
            g.weights.narrow(1, 0, keep).unwrap(),
            Tensor::zeros((g.batch.rows(), 2), DType::F32, &Device::Cpu).unwrap(),
        ],
        1,
    )
    .unwrap();
    let run = |batch: &TokenBatch, weights: &Tensor| weighted_pass(&model, batch, weights);
    let (full, full_grads) = run(&g.batch, &weights);
    let cut_batch = TokenBatch {
        ids: g
            .batch
            .ids
            .iter()
            .map(|r| r[..r.len() - 2].to_vec())
            .collect(),
        pad: g.batch.pad.clone(),
        prompt_len: g.batch.prompt_len,
        packing: None,
    };
    let (cut, cut_grads) = run(&cut_batch, &weights.narrow(1, 0, keep).unwrap());
    assert_eq!(cut.logp.dims(), &[g.batch.rows(), keep]);
    let e = rel_err(&cut.logp, &full.logp.narrow(1, 0, keep).unwrap());
    assert!(e < 1e-6, "log-probs of the kept columns: rel err {e}");
    for (((pname, _), a), b) in model
        .params()
        .iter()
        .zip(cut_grads.iter())
        .zip(full_grads.iter())
    {
        let e = rel_err(a.unwrap(), b.unwrap());
        assert!(e < 1e-5, "gradient of {pname}: rel err {e}");
    }
}

/// Packed sequences (`TokenBatch::packed`: each prompt and completion back to back, no
/// padding computed) give transformers' padded goldens: the log-probs of every weighted column
/// and every gradient. Each completion is cut after its last weighted column (what comes after
/// cannot change a weighted log-prob), so the sequences have different lengths and several
/// share a bin; the weights' columns past a cut completion are zero.
#[test]
fn packed_sequences_give_the_padded_goldens() {
    for name in ["qwen2-tiny", "qwen3-tiny"] {
        let model = load(name, None);
        let g = golden(name);
        let b = &g.batch;
        let weights: Vec<Vec<f32>> = g.weights.to_vec2().unwrap();
        let (mut prompts, mut completions) = (Vec::new(), Vec::new());
        for (r, row) in b.ids.iter().enumerate() {
            let kept = weights[r]
                .iter()
                .rposition(|&w| w != 0.0)
                .map_or(1, |i| i + 1);
            prompts.push(row[b.pad[r]..b.prompt_len].to_vec());
            completions.push(row[b.prompt_len..b.prompt_len + kept].to_vec());
        }
        let packed = TokenBatch::packed(&prompts, &completions, 0).unwrap();
        let p = packed.packing.as_ref().unwrap();
        assert!(
            packed.ids.len() < b.ids.len(),
            "{name}: the golden's {} rows should share bins ({} bins)",
            b.ids.len(),
            packed.ids.len()
        );
        assert!(packed.ids[0].len() <= 2 * b.ids[0].len());
        let c = packed.completion_len();
        let w = g.weights.narrow(1, 0, c).unwrap();
        let (out, grads) = weighted_pass(&model, &packed, &w);
        assert_eq!(out.logp.dims(), &[p.sequences.len(), c]);
        let mask = w.ne(0f32).unwrap().to_dtype(DType::F32).unwrap();
        let masked = |t: &Tensor| (cpu(t) * &mask).unwrap();
        let want = g.logp.narrow(1, 0, c).unwrap();
        let e = rel_err(&masked(&out.logp), &masked(&want));
        assert!(e < 1e-5, "{name}: packed logp rel err {e}");
        let plain = model.logprobs(&packed, TEMPERATURE).unwrap();
        let e = rel_err(&masked(&plain.logp), &masked(&want));
        assert!(e < 1e-5, "{name}: packed no-gradient logp rel err {e}");
        for ((pname, _), grad) in model.params().iter().zip(grads.iter()) {
            let e = rel_err(grad.unwrap(), &g.grads[pname]);
            assert!(e < 1e-4, "{name}: packed gradient of {pname}: rel err {e}");
        }
    }
}

/// The embedding's gradient added by `ops::embedding_grad_add_` (the default; forced here)
/// instead of index_add and scatter_add: the same golden gradients (tied embeddings, so the
/// head's gradient is in the sum first).
#[test]
fn the_embedding_gradient_kernel_gives_the_golden_gradients() {
    fleet_models::ops::set_embedding_grad_kernel(Some(true));
    let model = load("qwen2-tiny-tied-sharded", None);
    check("qwen2-tiny-tied-sharded", &model);
    fleet_models::ops::set_embedding_grad_kernel(None);
}
