#!/usr/bin/env python3
"""Combine one GPU run's fleet and transformers benchmark JSONs into benchmarks/results/<run>/summary.json
and print the Markdown rows of docs/benchmarks.md.

    python3 benches/summarize.py benchmarks/results/2026-11-22-h200-run4
"""
import json
import os
import sys


def main():
    run = sys.argv[1]
    fleet = json.load(open(os.path.join(run, "bench_fleet.json")))
    hf = json.load(open(os.path.join(run, "bench_transformers.json")))
    parity_path = os.path.join(run, "parity.json")
    parity = json.load(open(parity_path)) if os.path.exists(parity_path) else None
    hf_runs = {r["batch"]: r for r in hf["runs"]}
    rows = []
    for r in fleet["runs"]:
        h = hf_runs.get(r["batch"], {})
        rows.append({
            "batch": r["batch"],
            "fleet": {k: r[k] for k in ("prefill_tok_s", "decode_tok_s", "peak_used_bytes")},
            "transformers": {k: h.get(k) for k in ("prefill_tok_s", "decode_tok_s", "peak_alloc_bytes", "peak_reserved_bytes")},
            "decode_speedup": r["decode_tok_s"] / h["decode_tok_s"] if h.get("decode_tok_s") else None,
            "prefill_speedup": r["prefill_tok_s"] / h["prefill_tok_s"] if h.get("prefill_tok_s") else None,
        })
    summary = {
        "commit": fleet["commit"],
        "device": fleet["device"],
        "config": fleet["config"],
        "shape": fleet["shape"],
        "dtype": fleet["dtype"],
        "prompt_len": fleet["prompt_len"],
        "new_tokens": fleet["new_tokens"],
        "transformers": {k: hf.get(k) for k in ("transformers_version", "torch_version", "attn_implementation")},
        "rows": rows,
    }
    if parity:
        summary["parity_bf16"] = {k: parity["pairs"][k] for k in parity["pairs"]}
    json.dump(summary, open(os.path.join(run, "summary.json"), "w"), indent=1)
    for row in rows:
        f, h = row["fleet"], row["transformers"]
        print(f"| {row['batch']} | {f['prefill_tok_s']:,.0f} | {h['prefill_tok_s']:,.0f} | "
              f"{f['decode_tok_s']:,.1f} | {h['decode_tok_s']:,.1f} | {row['decode_speedup']:.2f}x | "
              f"{f['peak_used_bytes'] / 2**30:.1f} | {h['peak_reserved_bytes'] / 2**30:.1f} |")


if __name__ == "__main__":
    main()
