#!/usr/bin/env python3
"""Reward and loss of gspo-train runs drawn together (metrics.jsonl of each), raw and as a
20-step moving mean: e.g. the same config on 1 and on 2 GPUs.

    python3 scripts/plots/dp_curves.py --out curves.png 1gpu=run1/metrics.jsonl 2gpu=run2/metrics.jsonl
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def moving(v, k=20):
    out, acc = [], 0.0
    for i, x in enumerate(v):
        acc += x
        if i >= k:
            acc -= v[i - k]
        out.append(acc / min(i + 1, k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("runs", nargs="+", help="label=metrics.jsonl")
    a = ap.parse_args()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for spec in a.runs:
        label, path = spec.split("=", 1)
        m = [json.loads(l) for l in open(path) if l.strip()]
        steps = [x["step"] for x in m]
        for ax, key in zip(axes, ("reward", "loss")):
            v = [x.get(key) or 0.0 for x in m]
            line, = ax.plot(steps, v, alpha=0.25, lw=0.8)
            ax.plot(steps, moving(v), color=line.get_color(), lw=1.8, label=f"{label} (20-step mean)")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(a.title)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
