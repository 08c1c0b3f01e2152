#!/usr/bin/env python3
"""A random-weight sentence embedder of a real shape, saved by transformers, for speed runs.

    python3 scripts/gpu/make_random_embedder.py --from DIR --out DIR [--seed 0]

--from is a sentence-transformers folder without its weights (config.json, tokenizer.json,
modules.json, sentence_bert_config.json, 1_Pooling/ ... of all-MiniLM-L6-v2): the weights
(90 MB) do not fit what a device call carries beside the code, so the GPU machine makes
random ones of that shape (BertModel with transformers' _init_weights, the seed fixed) and
copies the other files. Retrieval with it is deterministic, chunk and prompt lengths are the
corpus's own: what a speed run needs; its answers mean nothing (nor do the random LLM's).
"""
import argparse
import shutil
from pathlib import Path

import torch
from transformers import BertConfig, BertModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    src, out = Path(a.src), Path(a.out)
    if (src / "model.safetensors").exists():
        raise SystemExit(f"{src} has weights already: use it as the embedder")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.rglob("*"):
        if f.is_file():
            dst = out / f.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dst)
    torch.manual_seed(a.seed)
    model = BertModel(BertConfig.from_pretrained(src), add_pooling_layer=False)
    model.save_pretrained(out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f'{{"out": "{out}", "parameters": {n}, "seed": {a.seed}}}')


if __name__ == "__main__":
    main()
