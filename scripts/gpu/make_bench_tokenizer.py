#!/usr/bin/env python3
"""A byte-level BPE tokenizer with Qwen's special tokens and chat template, for speed runs.

    python3 scripts/gpu/make_bench_tokenizer.py --text DIR [--text FILE ...] --out DIR \
        [--vocab-size 32000] [--template-from tests/fixtures/qwen2-tiny]

Qwen's own tokenizer cannot be downloaded here or on the GPU machine, and the tiny fixtures'
1,024-token vocabulary makes prompts about 2.5x longer than Qwen's would be. A BPE trained on
the run's own corpus and questions gives token counts close to a real subword tokenizer
(about 4 characters per token on English), so speed runs measure realistic prompt lengths.
Writes tokenizer.json and tokenizer_config.json (the chat template of --template-from).
"""
import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def texts(paths):
    for p in paths:
        p = Path(p)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            yield f.read_text(errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", action="append", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--template-from", default="tests/fixtures/qwen2-tiny")
    args = ap.parse_args()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(args.text), trainer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    src = json.loads((Path(args.template_from) / "tokenizer_config.json").read_text())
    cfg = {k: src[k] for k in ("chat_template", "eos_token", "pad_token", "bos_token",
                               "add_bos_token", "clean_up_tokenization_spaces")}
    cfg["additional_special_tokens"] = SPECIAL[1:]
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    sample = "The E2 interface connects the near-RT RIC to E2 nodes such as O-CU and O-DU."
    n = len(tok.encode(sample).ids)
    print(json.dumps({"vocab": tok.get_vocab_size(), "chars_per_token": round(len(sample) / n, 2)}))


if __name__ == "__main__":
    main()
