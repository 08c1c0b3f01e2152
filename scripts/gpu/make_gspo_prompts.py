#!/usr/bin/env python3
"""Arithmetic word problems in GSM8K's format for the GSPO speed runs.

    python3 scripts/gpu/make_gspo_prompts.py --out prompts.jsonl [--n 512] [--seed 0]

Each line: {"id", "prompt", "answer": "... #### n"}. Prompts are 250-400 characters (about
100 tokens with the tiny fixtures' tokenizer), so both trainers prefill the same lengths.
"""
import argparse
import json
import random

NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Randy"]
ITEMS = ["clips", "books", "apples", "marbles", "stamps", "pencils", "cookies", "shells"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for i in range(args.n):
            name, item = rng.choice(NAMES), rng.choice(ITEMS)
            a, b, c = rng.randint(2, 90), rng.randint(2, 90), rng.randint(2, 9)
            prompt = (
                f"Question: {name} collected {a} {item} on Monday. On Tuesday {name} collected "
                f"{b} more {item} than on Monday, and on Wednesday {c} times as many as on "
                f"Monday. How many {item} did {name} collect over the three days? Think step "
                f"by step, then give the final answer after '####'.\nAnswer:"
            )
            answer = f"{a} + {a + b} + {a * c} = {a + a + b + a * c}\n#### {a + a + b + a * c}"
            f.write(json.dumps({"id": f"q{i}", "prompt": prompt, "answer": answer}) + "\n")


if __name__ == "__main__":
    main()
