//! Qwen3-VL (dense and MoE) against transformers 5.17 on the tiny random checkpoints of
//! scripts/fixtures/make_qwen3_vl_fixtures.py: preprocessing, M-RoPE positions, vision and
//! deepstack features, prompt logits (two images, one image, odd sizes, text only), greedy
//! continuations, and a left-padded batch equal to the prompts one by one. f32 on the CPU.
//!
//! `FLEET_TEST_DEVICES` (default `cpu`) names the device(s) the decoder's layers are split
//! over, as in `parity.rs`: `cuda:0,cuda:1` checks the layer-sharded model on two GPUs (the
//! deepstack features cross to the layers' devices), `cpu,cpu` runs the boundary code here.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use fleet_models::qwen3_vl::{rope_index, Qwen3VlConfig, Qwen3VlModel, VlPrompt};
use fleet_models::vision::{preprocess, ImageProcessorConfig, ResizeBackend};
use fleet_models::{
    DType, DeviceLocation, DeviceMap, GenerationRequest, LoadOptions, PagedOptions,
    VisionLanguageModel, Weights,
};
use serde_json::Value;

mod devices;
use devices::test_devices;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Fixture {
    model: Qwen3VlModel,
    golden: Value,
    tensors: std::collections::HashMap<String, Tensor>,
    processor: ImageProcessorConfig,
}

fn fixture(name: &str) -> Fixture {
    let dir = root().join("tests/fixtures").join(name);
    let cfg = Qwen3VlConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = Weights::from_safetensors(&[dir.join("model.safetensors")]).unwrap();
    let map = DeviceMap::split_layers(&test_devices(), cfg.text.num_hidden_layers).unwrap();
    let model = Qwen3VlModel::new(&cfg, &weights, DType::F32, &map).unwrap();
    let golden_dir = root().join("tests/fixtures/golden");
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(golden_dir.join(format!("{name}.json"))).unwrap(),
    )
    .unwrap();
    let tensors = candle_core::safetensors::load(
        golden_dir.join(format!("{name}.safetensors")),
        &Device::Cpu,
    )
    .unwrap();
    // These goldens were made with transformers' PIL backend (make_qwen3_vl_fixtures.py runs in
    // the venv without torchvision), so they are reproduced with fleet's Pillow backend, not
    // with the default (torchvision, transformers' default; see tests/vision_preprocess.rs).
    let processor = ImageProcessorConfig::from_file(dir.join("preprocessor_config.json"))
        .unwrap()
        .with_resize_backend(ResizeBackend::Pillow);
    Fixture {
        model,
        golden,
        tensors,
        processor,
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The image paths of a case's messages, in order.
fn image_paths(case: &Value) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for m in case["messages"].as_array().unwrap() {
        if let Some(parts) = m["content"].as_array() {
            for p in parts {
                if p["type"] == "image" {
                    out.push(root().join(p["image"].as_str().unwrap()));
                }
            }
        }
    }
    out
}

fn prompt(f: &Fixture, case: &Value) -> VlPrompt {
    let paths = image_paths(case);
    let images = if paths.is_empty() {
        None
    } else {
        let imgs: Vec<image::DynamicImage> =
            paths.iter().map(|p| image::open(p).unwrap()).collect();
        Some(preprocess(&imgs, &f.processor).unwrap())
    };
    VlPrompt {
        ids: ids(&case["input_ids"]),
        images,
        positions: None,
    }
}

/// Largest |a - b| / (1 + |b|) (relative for large values, absolute near zero).
fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes");
    let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f32::max)
}

const TOL: f32 = 1e-4;

fn check_checkpoint(name: &str) {
    let f = fixture(name);
    let cases = f.golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    let cfg = f.model.config();
    for case in cases {
        let cname = case["name"].as_str().unwrap();
        let p = prompt(&f, case);

        // Preprocessing is bit-exact (tests/vision_preprocess.rs; Pillow backend here, as the
        // goldens were made); here it feeds the model.
        if let Some(img) = &p.images {
            let golden = &f.tensors[&format!("{cname}.pixel_values")];
            let ours = img.pixel_values_tensor(&Device::Cpu).unwrap();
            assert_eq!(
                max_rel_diff(&ours, golden),
                0.0,
                "{name}/{cname} pixel_values"
            );
            let grids: Vec<Vec<usize>> = img.image_grid_thw.iter().map(|g| g.to_vec()).collect();
            let golden_grids: Vec<Vec<usize>> =
                serde_json::from_value(case["image_grid_thw"].clone()).unwrap();
            assert_eq!(grids, golden_grids, "{name}/{cname} grids");
        }

        // M-RoPE positions and delta.
        let (axes, delta) = rope_index(
            &p.ids,
            p.images.as_ref().map_or(&[][..], |i| &i.image_grid_thw),
            cfg.vision.spatial_merge_size,
            cfg.image_token_id,
            cfg.video_token_id,
        )
        .unwrap();
        let golden_pos: Vec<Vec<u32>> =
            serde_json::from_value(case["position_ids"].clone()).unwrap();
        assert_eq!(axes.to_vec(), golden_pos, "{name}/{cname} position ids");
        assert_eq!(
            delta,
            case["rope_delta"].as_i64().unwrap(),
            "{name}/{cname}"
        );

        // Vision features and deepstack features.
        if let Some(img) = &p.images {
            let out = f.model.encode_images(img).unwrap();
            let d = max_rel_diff(
                &out.features,
                &f.tensors[&format!("{cname}.vision_features")],
            );
            assert!(d < TOL, "{name}/{cname} vision features differ by {d}");
            assert_eq!(out.deepstack.len(), 3);
            for (k, ds) in out.deepstack.iter().enumerate() {
                let d = max_rel_diff(ds, &f.tensors[&format!("{cname}.deepstack.{k}")]);
                assert!(d < TOL, "{name}/{cname} deepstack {k} differs by {d}");
            }
        }

        // Logits of every prompt position.
        let logits = f.model.logits(&p).unwrap();
        let d = max_rel_diff(&logits, &f.tensors[&format!("{cname}.logits")]);
        assert!(d < TOL, "{name}/{cname} logits differ by {d}");

        // Greedy continuation.
        let g = &case["greedy"];
        let req = GenerationRequest::greedy(
            p.ids.clone(),
            g["max_new_tokens"].as_u64().unwrap() as usize,
        );
        let out = f
            .model
            .generate(
                None,
                vec![997, 995],
                995,
                std::slice::from_ref(&p),
                &[req],
                None,
            )
            .unwrap();
        assert_eq!(
            out[0].token_ids,
            ids(&g["output_ids"]),
            "{name}/{cname} greedy"
        );
    }

    // The four prompts as one left-padded batch give each one's own continuation.
    let prompts: Vec<VlPrompt> = cases.iter().map(|c| prompt(&f, c)).collect();
    let reqs: Vec<GenerationRequest> = prompts
        .iter()
        .map(|p| GenerationRequest::greedy(p.ids.clone(), 10))
        .collect();
    let out = f
        .model
        .generate(None, vec![997, 995], 995, &prompts, &reqs, None)
        .unwrap();
    let golden: Vec<Vec<u32>> =
        serde_json::from_value(f.golden["batched"]["output_ids"].clone()).unwrap();
    for (r, o) in out.iter().enumerate() {
        assert_eq!(o.token_ids, golden[r], "{name} batched row {r}");
        assert_eq!(
            o.token_ids,
            ids(&cases[r]["greedy"]["output_ids"]),
            "{name} batched row {r} vs alone"
        );
    }

    // Continuous batching on a paged cache, two decode slots for the four prompts (each
    // newcomer's vision tower and prefill between the others' decode steps), twice over in one
    // call so that the second round's prompts find the first round's text blocks: the same
    // tokens as transformers.
    let twice: Vec<VlPrompt> = prompts.iter().chain(&prompts).cloned().collect();
    let reqs2: Vec<GenerationRequest> = reqs.iter().chain(&reqs).cloned().collect();
    for block_size in [4, 16] {
        let options = PagedOptions {
            max_batch: 2,
            block_size,
            num_blocks: 256,
            cuda_graphs: false,
            sync_every: 1,
        };
        let (out, stats) = f
            .model
            .generate_paged(None, vec![997, 995], 995, &twice, &reqs2, &options, None)
            .unwrap();
        for (r, o) in out.iter().enumerate() {
            assert_eq!(
                o.token_ids,
                golden[r % golden.len()],
                "{name} paged row {r}, blocks of {block_size}"
            );
        }
        assert_eq!(stats.max_running, 2, "{name}");
        // Only text before the first image is shared: image tokens are never found again.
        let image = cfg.image_token_id;
        let shareable: usize = twice
            .iter()
            .map(|p| {
                let first_image = p.ids.iter().position(|&t| t == image);
                first_image.unwrap_or(usize::MAX).min(p.ids.len() - 1)
            })
            .map(|n| n / block_size * block_size)
            .sum();
        assert!(
            stats.cached_prompt_tokens <= shareable,
            "{name}: {} cached of {shareable} shareable",
            stats.cached_prompt_tokens
        );
        assert!(
            stats.cached_prompt_tokens > 0,
            "{name}, blocks of {block_size}"
        );
    }
}

#[test]
fn dense_matches_transformers() {
    check_checkpoint("qwen3-vl-tiny");
}

#[test]
fn moe_matches_transformers() {
    check_checkpoint("qwen3-vl-moe-tiny");
}

#[test]
fn config_without_mrope_section_is_an_error() {
    let path = root().join("tests/fixtures/qwen3-vl-moe-tiny/config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["text_config"]["rope_scaling"]
        .as_object_mut()
        .unwrap()
        .remove("mrope_section");
    let e = Qwen3VlConfig::from_json(&v.to_string(), Path::new("m/config.json"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("m/config.json") && e.contains("mrope_section"),
        "{e}"
    );

    // A text checkpoint is not a judge.
    let text_cfg = root().join("tests/fixtures/qwen3-tiny/config.json");
    let e = Qwen3VlConfig::from_file(&text_cfg).unwrap_err().to_string();
    assert!(e.contains("qwen3_vl"), "{e}");
}

/// The checkpoint's chat template, tokenizer and image processor build the prompts transformers'
/// processor built: the rendered text and the expanded ids of every case.
#[test]
fn prompts_match_the_processor() {
    for name in ["qwen3-vl-tiny", "qwen3-vl-moe-tiny"] {
        let dir = root().join("tests/fixtures").join(name);
        let vlm =
            VisionLanguageModel::load(dir.to_str().unwrap(), &LoadOptions::default()).unwrap();
        let golden: Value = serde_json::from_str(
            &std::fs::read_to_string(root().join(format!("tests/fixtures/golden/{name}.json")))
                .unwrap(),
        )
        .unwrap();
        for case in golden["cases"].as_array().unwrap() {
            // transformers' message format; the template only needs the part types.
            let images: Vec<image::DynamicImage> = image_paths(case)
                .iter()
                .map(|p| image::open(p).unwrap())
                .collect();
            let text = vlm
                .processor
                .chat_template
                .render_json(case["messages"].clone(), true, &Default::default())
                .unwrap();
            assert_eq!(
                text,
                case["text"].as_str().unwrap(),
                "{name} {}",
                case["name"]
            );
            let p = vlm.prompt(&case["messages"], &images).unwrap();
            assert_eq!(p.ids, ids(&case["input_ids"]), "{name} {}", case["name"]);
        }
        assert_eq!(vlm.eos_ids(), vec![997, 995]);
    }
}

/// Experts saved by transformers 5 (`[E, 2I, H]` / `[E, H, I]`, its in-memory layout) load to
/// the same model as the released layout.
#[test]
fn moe_experts_saved_transposed_load_the_same() {
    let src = root().join("tests/fixtures/qwen3-vl-moe-tiny");
    let tmp = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        if f.file_name().unwrap() != "model.safetensors" {
            std::fs::copy(&f, tmp.path().join(f.file_name().unwrap())).unwrap();
        }
    }
    let mut tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut flipped = 0;
    for (name, t) in tensors.iter_mut() {
        if name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj") {
            *t = t.transpose(1, 2).unwrap().contiguous().unwrap();
            flipped += 1;
        }
    }
    assert_eq!(flipped, 6, "three MoE layers, two tensors each");
    candle_core::safetensors::save(&tensors, tmp.path().join("model.safetensors")).unwrap();

    let load = |dir: &Path| {
        let cfg = Qwen3VlConfig::from_file(&dir.join("config.json")).unwrap();
        let w = Weights::from_safetensors(&[dir.join("model.safetensors")]).unwrap();
        let map = DeviceMap::single(DeviceLocation::Cpu, cfg.text.num_hidden_layers);
        Qwen3VlModel::new(&cfg, &w, DType::F32, &map).unwrap()
    };
    let p = VlPrompt {
        ids: (0..20).map(|i| (i * 37 % 990) as u32).collect(),
        images: None,
        positions: None,
    };
    let a = load(&src).logits(&p).unwrap();
    let b = load(tmp.path()).logits(&p).unwrap();
    assert_eq!(max_rel_diff(&a, &b), 0.0);
}

/// One directory of `tests/fixtures/qwen3-vl-moe-layouts/` (scripts/fixtures/
/// make_qwen3_vl_moe_layouts.py), loaded on the CPU.
fn layout_model(dir: &str) -> fleet_models::Result<Qwen3VlModel> {
    let dir = root().join("tests/fixtures/qwen3-vl-moe-layouts").join(dir);
    let cfg = Qwen3VlConfig::from_file(&dir.join("config.json"))?;
    let w = Weights::from_safetensors(&[dir.join("model.safetensors")])?;
    let map = DeviceMap::single(DeviceLocation::Cpu, cfg.text.num_hidden_layers);
    Qwen3VlModel::new(&cfg, &w, DType::F32, &map)
}

/// The tiny MoE of `shape` (`i4`, `i8`, `i16`) with its experts in the released layout
/// (`[E, H, 2I]` / `[E, I, H]`, 4.x hub config.json) and as transformers 5's `save_pretrained`
/// wrote it (`[E, 2I, H]` / `[E, H, I]`, native config.json): both give transformers' logits of
/// the in-memory model, and the same logits to the bit.
fn check_expert_layouts(shape: &str) {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/golden/qwen3-vl-moe-layouts.json"))
            .unwrap(),
    )
    .unwrap();
    let g = &golden["shapes"][shape];
    let prompts = golden["prompts"].as_array().unwrap();
    let mut outs = Vec::new();
    for layout in ["released", "saved"] {
        let name = format!("{shape}-{layout}");
        let model = layout_model(&name).unwrap_or_else(|e| panic!("{name}: {e}"));
        let inter = g["moe_intermediate_size"].as_u64().unwrap() as usize;
        assert_eq!(model.config().text.moe_intermediate_size, Some(inter));
        assert_eq!(model.config().text.num_experts, Some(4), "{name}");
        let mut logits = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let ours = model
                .logits(&VlPrompt {
                    ids: ids(p),
                    images: None,
                    positions: None,
                })
                .unwrap();
            let rows: Vec<Vec<f32>> = serde_json::from_value(g["logits"][i].clone()).unwrap();
            let want = Tensor::new(rows, &Device::Cpu).unwrap();
            let d = max_rel_diff(&ours, &want);
            assert!(d < TOL, "{name} prompt {i}: logits differ by {d}");
            logits.push(ours);
        }
        outs.push(logits);
    }
    for (a, b) in outs[0].iter().zip(&outs[1]) {
        assert_eq!(max_rel_diff(a, b), 0.0, "{shape}: released vs saved");
    }
}

/// I = 4, H = 16: each tensor's shape alone tells the layouts apart.
#[test]
fn moe_expert_layouts_match_transformers() {
    check_expert_layouts("i4");
}

/// 2I == H: `gate_up_proj` is square in both layouts and only `down_proj` tells them apart.
/// transformers 5.17 itself misreads the released file here (recorded in the golden).
#[test]
fn moe_expert_layouts_with_square_gate_up_match_transformers() {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/golden/qwen3-vl-moe-layouts.json"))
            .unwrap(),
    )
    .unwrap();
    let reload = &golden["shapes"]["i8"]["transformers_reload"];
    assert_eq!(reload["saved"]["exact"], true);
    assert_eq!(
        reload["released"]["misread_tensors"],
        serde_json::json!(["mlp.experts.gate_up_proj"])
    );
    check_expert_layouts("i8");
}

/// I == H: `down_proj` is square in both layouts and only `gate_up_proj` tells them apart.
#[test]
fn moe_expert_layouts_with_square_down_match_transformers() {
    check_expert_layouts("i16");
}

/// Experts in neither layout (here one layer's `gate_up_proj` in the released layout and its
/// `down_proj` as transformers 5 saves it) are an error naming the tensor, the file, both
/// shapes and what each layout expects.
#[test]
fn moe_experts_in_no_layout_are_an_error() {
    let src = root().join("tests/fixtures/qwen3-vl-moe-layouts/i4-saved");
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), tmp.path().join("config.json")).unwrap();
    let mut tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let name = "model.language_model.layers.1.mlp.experts.gate_up_proj";
    let t = tensors[name].transpose(1, 2).unwrap().contiguous().unwrap();
    tensors.insert(name.to_string(), t);
    let file = tmp.path().join("model.safetensors");
    candle_core::safetensors::save(&tensors, &file).unwrap();

    let cfg = Qwen3VlConfig::from_file(&tmp.path().join("config.json")).unwrap();
    let w = Weights::from_safetensors(std::slice::from_ref(&file)).unwrap();
    let map = DeviceMap::single(DeviceLocation::Cpu, cfg.text.num_hidden_layers);
    let e = Qwen3VlModel::new(&cfg, &w, DType::F32, &map)
        .err()
        .expect("experts in no layout")
        .to_string();
    for s in [
        file.to_str().unwrap(),
        name,
        "[4, 16, 8]",                 // gate_up_proj as stored
        "down_proj [4, 16, 4]",       // down_proj as stored, transformers 5's layout
        "gate_up_proj is [4, 8, 16]", // what that layout expects
        "released layout expects [4, 16, 8]",
        "mixes the layouts",
    ] {
        assert!(e.contains(s), "`{s}` not in: {e}");
    }
}

/// On a GPU, in bf16 (the MoE's kernel paths): continuous batching with each decode step
/// captured as a CUDA graph gives the tokens of the same run op by op, and a graph is
/// captured. The f32 parity runs above take the grouped MoE, which no capture reaches; a MoE
/// step's capture once aborted the process (candle's fused MoE kernels inside it, H200,
/// 2026-11-28), which this end-to-end run would have shown.
#[cfg(feature = "cuda")]
#[test]
fn moe_decode_graphs_give_the_op_by_op_tokens_in_bf16() {
    if let Err(e) = Device::new_cuda(0) {
        eprintln!("SKIPPED moe_decode_graphs_give_the_op_by_op_tokens_in_bf16: no GPU ({e})");
        return;
    }
    let f = fixture("qwen3-vl-moe-tiny");
    let dir = root().join("tests/fixtures/qwen3-vl-moe-tiny");
    let cfg = Qwen3VlConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = Weights::from_safetensors(&[dir.join("model.safetensors")]).unwrap();
    let map = DeviceMap::single(DeviceLocation::Cuda(0), cfg.text.num_hidden_layers);
    let model = Qwen3VlModel::new(&cfg, &weights, DType::BF16, &map).unwrap();
    let cases = f.golden["cases"].as_array().unwrap();
    let prompts: Vec<VlPrompt> = cases.iter().map(|c| prompt(&f, c)).collect();
    let reqs: Vec<GenerationRequest> = prompts
        .iter()
        .map(|p| GenerationRequest::greedy(p.ids.clone(), 12))
        .collect();
    let run = |cuda_graphs: bool| {
        let options = PagedOptions {
            max_batch: 2,
            block_size: 16,
            num_blocks: 256,
            cuda_graphs,
            sync_every: 1,
        };
        let (out, stats) = model
            .generate_paged(None, vec![997, 995], 995, &prompts, &reqs, &options, None)
            .unwrap();
        let tokens: Vec<Vec<u32>> = out.into_iter().map(|o| o.token_ids).collect();
        (tokens, stats.graphs_captured)
    };
    let (plain, _) = run(false);
    let (graphed, captured) = run(true);
    assert!(captured > 0, "no MoE decode step was captured");
    assert_eq!(graphed, plain, "graphs changed the MoE's greedy tokens");
}
