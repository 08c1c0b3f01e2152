#!/usr/bin/env python3
"""Writes the gsm8k.jsonl that gspo-train's GSM8K example reads, from GSM8K's own files.

GSM8K ships as Parquet on the Hugging Face hub (openai/gsm8k, config `main`:
main/train-00000-of-00001.parquet and main/test-00000-of-00001.parquet) and as JSON Lines in
the original repository (openai/grade-school-math: grade_school_math/data/train.jsonl). Each
row has `question` and `answer`; the answer ends with `#### <number>`, which gspo-train's
gsm8k_exact reward compares against. gspo-train reads these two fields as they are, so this
script only converts and checks: every row must have both as non-empty strings and an answer
with a `####` line, else it stops naming the row.

    pip install pyarrow                      # only for Parquet input
    huggingface-cli download openai/gsm8k --repo-type dataset --local-dir gsm8k
    python scripts/data/make_gsm8k_jsonl.py gsm8k/main/train-00000-of-00001.parquet gsm8k.jsonl
    python scripts/data/make_gsm8k_jsonl.py grade_school_math/data/train.jsonl gsm8k.jsonl
"""

import argparse
import json
import os
import sys


def rows(path):
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            sys.exit(f"{path}: reading Parquet needs pyarrow: pip install pyarrow")
        table = pq.read_table(path, columns=["question", "answer"])
        yield from enumerate(table.to_pylist(), start=1)
    else:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        yield n, json.loads(line)
                    except json.JSONDecodeError as e:
                        sys.exit(f"{path} line {n}: not JSON ({e})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", help="GSM8K .parquet or .jsonl (question/answer per row)")
    ap.add_argument("output", help="the JSON Lines file to write (question/answer per line)")
    args = ap.parse_args()
    out = []
    for n, row in rows(args.input):
        q, a = row.get("question"), row.get("answer")
        if not (isinstance(q, str) and q.strip() and isinstance(a, str) and a.strip()):
            sys.exit(f"{args.input} row {n}: needs non-empty `question` and `answer` strings")
        if "####" not in a:
            sys.exit(f"{args.input} row {n}: the answer has no `#### <number>` line")
        out.append(json.dumps({"question": q, "answer": a}, ensure_ascii=False))
    tmp = args.output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")
    os.replace(tmp, args.output)
    print(f"wrote {len(out)} rows to {args.output}")


if __name__ == "__main__":
    main()
