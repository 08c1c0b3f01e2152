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

--eos-scale S multiplies the tokenizer's EOS row of the output projection (the embedding's too
when they are tied) by S and adds that id to generation_config.json's eos_token_id, so that
sampled completions stop at it at variable lengths instead of running to the maximum (random
weights almost never sample one id out of ~152k): a variable-length workload that every engine
reading the checkpoint sees alike. By the logit spread of N(0, 0.02) weights after the final
RMSNorm, S ~ 4.5 / (0.02 sqrt(hidden)) gives a mean of roughly 100-150 tokens (7.5 at 0.5B, 5.8
at 1.5B); the completions' mean length in the runs' metrics is the check.
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
    ap.add_argument("--eos-scale", type=float, default=None,
                    help="scale the tokenizer's EOS row of the output projection by this")
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
    if args.eos_scale is not None:
        from transformers import AutoTokenizer
        eos = AutoTokenizer.from_pretrained(args.tokenizer_from).eos_token_id
        with torch.no_grad():
            model.get_output_embeddings().weight[eos] *= args.eos_scale
        ids = model.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        model.generation_config.eos_token_id = ids + [eos] if eos not in ids else ids
    model.save_pretrained(out, max_shard_size="5GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(args.tokenizer_from) / name, out / name)
    print(json.dumps({"out": str(out), "seconds": round(time.time() - t0, 1),
                      "parameters": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
