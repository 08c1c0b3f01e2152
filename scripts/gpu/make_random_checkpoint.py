#!/usr/bin/env python3
"""A random-weight checkpoint of a real shape, saved by transformers, for speed runs.

    python3 scripts/gpu/make_random_checkpoint.py --config configs/models/qwen2.5-7b.json \
        --out /tmp/q7b --tokenizer-from tests/fixtures/qwen2-tiny [--device cuda] [--dtype bf16]

With --classifier it is a reward model instead (the architecture's ForSequenceClassification,
one label, pad_token_id = eos). Weights ~ N(0, initializer_range) as transformers' _init_weights; saved as safetensors shards
with config.json and generation_config.json. The tokenizer files (tokenizer.json,
tokenizer_config.json with its chat template) are copied from --tokenizer-from: the GPU machine
cannot download Qwen's, and for speed only the prompt lengths matter (a smaller vocabulary
gives longer prompts, so the measurement errs on the slow side). Generated ids beyond that
vocabulary decode to nothing.
"""
import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer-from", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--classifier", action="store_true",
                    help="a reward model: *ForSequenceClassification with one label")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch.manual_seed(args.seed)
    fields = json.loads(Path(args.config).read_text())
    if args.classifier:
        fields["architectures"] = [fields["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
        fields.update(num_labels=1, pad_token_id=fields.get("eos_token_id"))
    config = AutoConfig.for_model(**fields)
    cls = AutoModelForSequenceClassification if args.classifier else AutoModelForCausalLM
    with torch.device(args.device):
        model = cls.from_config(config, dtype=dtype)
    model.save_pretrained(out, max_shard_size="5GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(args.tokenizer_from) / name, out / name)
    print(json.dumps({"out": str(out), "seconds": round(time.time() - t0, 1),
                      "parameters": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
