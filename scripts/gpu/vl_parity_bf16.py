#!/usr/bin/env python3
"""Qwen3-VL bf16 logits parity on real shapes: transformers (reference) vs `edit-score logits`.

  make     Random-weight Qwen3-VL model of a shape (configs/models/qwen3-vl-*.json, optionally
           with fewer decoder layers), saved with save_pretrained (transformers' own layout:
           MoE experts as [E, 2I, H], which fleet recognises), the released
           preprocessor_config.json, two images and a prompt with both:
             DIR/model/                       the checkpoint
             DIR/inputs.json                  {"input_ids": [...], "images": [...]} (pads expanded)
             DIR/hf_bf16.safetensors          "logits" f32 [len, vocab], bf16 model (sdpa)
             DIR/hf_f32.safetensors           same weights upcast to f32, f32 compute
             DIR/meta.json                    versions, shape, device, HF bf16 vs f32 stats
  compare  A `edit-score logits` file against both references -> JSON report.

The images go through transformers' PIL image processor (the path fleet reproduces bit for bit;
tests/vision_preprocess.rs); fleet preprocesses the same PNG files itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

T0 = time.time()


def log(msg: str) -> None:
    print(f"[vl-parity +{time.time() - T0:6.1f}s] {msg}", flush=True)


RELEASED_PROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
}


def make_images(out: Path, size: int) -> list[Path]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    paths = []
    for k in range(2):
        y, x = np.mgrid[0:size, 0:size]
        img = np.stack([(x * 255 // size + 40 * k) % 256, (y * 255 // size) % 256,
                        ((x // 16 + y // 16 + k) % 2) * 200], axis=-1).astype(np.int32)
        img = np.clip(img + rng.integers(-20, 20, img.shape), 0, 255).astype(np.uint8)
        p = out / f"image{k}.png"
        Image.fromarray(img).save(p)
        paths.append(p)
    return paths


def cmd_make(a) -> None:
    import torch
    import transformers
    from transformers import (AutoConfig, AutoImageProcessor, Qwen3VLForConditionalGeneration,
                              Qwen3VLMoeForConditionalGeneration)
    from safetensors.torch import save_file

    out = Path(a.out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    raw = json.loads(Path(a.config).read_text())
    if a.layers:
        raw["text_config"]["num_hidden_layers"] = a.layers
    cfg_path = out / "shape.json"
    cfg_path.write_text(json.dumps(raw, indent=2))
    cfg = AutoConfig.from_pretrained(str(cfg_path))
    moe = raw["model_type"] == "qwen3_vl_moe"
    cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    torch.manual_seed(a.seed)
    t = time.time()
    with torch.device("cuda"):
        model = cls._from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    # Norm weights ~ U(0.5, 1.5) and LayerNorm biases ~ N(0, 0.02) instead of ones/zeros, so a
    # dropped norm or bias cannot pass.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name):
                if name.endswith("bias"):
                    p.normal_(0, 0.02)
                else:
                    p.uniform_(0.5, 1.5)
    log(f"random {cls.__name__} in {time.time() - t:.1f}s")
    t = time.time()
    model.save_pretrained(str(out / "model"), safe_serialization=True)
    (out / "model" / "preprocessor_config.json").write_text(json.dumps(RELEASED_PROCESSOR, indent=2))
    log(f"saved in {time.time() - t:.1f}s")

    images = make_images(out, a.image_size)
    from PIL import Image
    ip = AutoImageProcessor.from_pretrained(str(out / "model"), backend="pil")
    pics = [Image.open(p).convert("RGB") for p in images]
    px = ip(images=pics, return_tensors="pt")
    grid = px["image_grid_thw"].tolist()
    counts = [t_ * h * w // 4 for t_, h, w in grid]
    vs, ve, pad = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id
    text = lambda n, s: [(s * 7919 + i * 104729) % 151000 for i in range(n)]  # noqa: E731
    ids = text(20, 1)
    for k, c in enumerate(counts):
        ids += [vs] + [pad] * c + [ve] + text(6, k + 2)
    ids += text(30, 9)
    (out / "inputs.json").write_text(json.dumps({"input_ids": ids,
                                                   "images": [p.name for p in images]}))
    kw = dict(input_ids=torch.tensor([ids], device="cuda"),
              attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
              mm_token_type_ids=torch.tensor([[1 if i == pad else 0 for i in ids]], device="cuda"),
              pixel_values=px["pixel_values"].to("cuda"),
              image_grid_thw=px["image_grid_thw"].to("cuda"))
    with torch.no_grad():
        ref = model(**kw, use_cache=False).logits[0].float().cpu()
        save_file({"logits": ref.contiguous()}, str(out / "hf_bf16.safetensors"))
        log(f"bf16 logits {tuple(ref.shape)}")
        model.float()
        kw["pixel_values"] = kw["pixel_values"].float()
        f32 = model(**kw, use_cache=False).logits[0].float().cpu()
        save_file({"logits": f32.contiguous()}, str(out / "hf_f32.safetensors"))
    meta = {
        "transformers": transformers.__version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0), "shape": a.config, "layers": a.layers,
        "moe": moe, "image_size": a.image_size, "grids": grid, "seq_len": len(ids),
        "image_tokens": counts, "hf_bf16_vs_hf_f32": stats(ref, f32),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    log(json.dumps(meta["hf_bf16_vs_hf_f32"]))


def stats(a, b) -> dict:
    d = (a - b).abs()
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()),
            "ref_mean_abs": float(b.abs().mean()),
            "top1_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


def cmd_compare(a) -> None:
    from safetensors.torch import load_file

    d = Path(a.dir)
    fleet = load_file(a.fleet)["logits"]
    hf16 = load_file(str(d / "hf_bf16.safetensors"))["logits"]
    hf32 = load_file(str(d / "hf_f32.safetensors"))["logits"]
    meta = json.loads((d / "meta.json").read_text())
    rep = dict(meta, fleet_bf16_vs_hf_bf16=stats(fleet, hf16), fleet_bf16_vs_hf_f32=stats(fleet, hf32))
    Path(a.json).write_text(json.dumps(rep, indent=2))
    for k in ("hf_bf16_vs_hf_f32", "fleet_bf16_vs_hf_bf16", "fleet_bf16_vs_hf_f32"):
        print(f"{k:>24}: {rep[k]}")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--config", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's)")
    m.add_argument("--image-size", type=int, default=512)
    m.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("compare")
    c.add_argument("--dir", required=True)
    c.add_argument("--fleet", required=True)
    c.add_argument("--json", required=True)
    a = p.parse_args()
    {"make": cmd_make, "compare": cmd_compare}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
