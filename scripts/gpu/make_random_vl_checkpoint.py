#!/usr/bin/env python3
"""A random-weight Qwen3-VL checkpoint of a real shape (dense or MoE), saved by transformers, and
a JSONL benchmark of generated image pairs, for edit-score speed runs with the real scoring path
(replicas, queue, records).

    python3 scripts/gpu/make_random_vl_checkpoint.py --config configs/models/qwen3-vl-8b.json \
        --out /tmp/vl8b --pairs 128 --image-size 1024 --bench-out /tmp/pairs

The GPU machine cannot download Qwen's tokenizer: the tokenizer, chat template and marker token
ids (image, video, vision start/end, bos/eos) come from --tokenizer-from (the tiny fixture), the
image processor from the released preprocessor_config.json. Weights ~ transformers' init, made on
the GPU in bf16. Replies of random weights do not parse (counted by edit-score); for speed only
the shapes and lengths matter.
"""
import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration


def pair_image(size: int, i: int, k: int) -> Image.Image:
    y, x = np.mgrid[0:size, 0:size]
    s = i * 31 + k * 17
    r = (x * 255 // size + s) % 256
    g = (y * 255 // size + 3 * s) % 256
    b = ((x // (8 + i % 7) + y // (5 + k)) % 2) * 200 + 20
    return Image.fromarray(np.stack([r, g, b], -1).astype(np.uint8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer-from", default="tests/fixtures/qwen3-vl-tiny")
    ap.add_argument("--preprocessor", default="configs/models/qwen3-vl-preprocessor.json")
    ap.add_argument("--pairs", type=int, default=0, help="also write a JSONL benchmark of this many pairs")
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--bench-out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    raw = json.loads(Path(a.config).read_text())
    tiny = json.loads((Path(a.tokenizer_from) / "config.json").read_text())
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        raw[k] = tiny[k]
    for k in ("bos_token_id", "eos_token_id"):
        raw["text_config"][k] = tiny["text_config"][k]
    shape = out / "shape.json"
    shape.write_text(json.dumps(raw, indent=2))
    cfg = AutoConfig.from_pretrained(str(shape))
    shape.unlink()
    cls = Qwen3VLMoeForConditionalGeneration if raw["model_type"] == "qwen3_vl_moe" else Qwen3VLForConditionalGeneration
    torch.manual_seed(a.seed)
    with torch.device("cuda"):
        model = cls._from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(out), max_shard_size="5GB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.json", "generation_config.json"):
        src = Path(a.tokenizer_from) / name
        if src.exists():
            shutil.copy(src, out / name)
    shutil.copy(a.preprocessor, out / "preprocessor_config.json")
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    if a.pairs:
        bench = Path(a.bench_out)
        (bench / "img").mkdir(parents=True, exist_ok=True)
        cats = ["background_change", "color_alter", "style_change", "subject-add"]
        with open(bench / "pairs.jsonl", "w") as f:
            for i in range(a.pairs):
                paths = []
                for k, name in ((0, "src"), (1, "edit")):
                    p = bench / "img" / f"{i:04d}_{name}.png"
                    pair_image(a.image_size, i, k).save(p, compress_level=1)
                    paths.append(str(p))
                f.write(json.dumps({"id": f"pair-{i:04d}", "category": cats[i % len(cats)],
                                    "instruction": f"Change the background of picture {i} to a beach.",
                                    "source": paths[0], "edited": paths[1]}) + "\n")
    print(json.dumps({"out": str(out), "parameters": params, "pairs": a.pairs, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
