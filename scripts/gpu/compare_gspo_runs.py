#!/usr/bin/env python3
"""Compare two gspo-train output directories step by step: the loss and grad norm of every line
of metrics.jsonl, and the weights of the newest checkpoint (model.safetensors), as issue 24 asks
of a sharded layout against the single-device run.

    python3 scripts/gpu/compare_gspo_runs.py REFERENCE_DIR OTHER_DIR [--tol 1e-5] [--json OUT]

Prints one line per compared quantity and a verdict; exits 1 when a value differs by more than
the tolerance (relative to the reference's magnitude, floored at 1), when either run has a NaN
or infinite value, or when the runs have different steps or tensors.
"""
import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def metrics(d: Path) -> list:
    rows = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()]
    last = {}
    for r in rows:  # a step's last line wins (as the trainer's readers do)
        last[r["step"]] = r
    return [last[k] for k in sorted(last)]


def newest_checkpoint(d: Path) -> Path:
    cps = sorted(d.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if not cps:
        sys.exit(f"{d}: no checkpoint-*/ (run with save_steps <= max_steps)")
    return cps[-1]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("reference", type=Path)
    ap.add_argument("other", type=Path)
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    out = {"reference": str(a.reference), "other": str(a.other), "tol": a.tol, "steps": []}
    bad = []
    ra, rb = metrics(a.reference), metrics(a.other)
    if [r["step"] for r in ra] != [r["step"] for r in rb]:
        bad.append(f"steps differ: {[r['step'] for r in ra]} vs {[r['step'] for r in rb]}")
    for x, y in zip(ra, rb):
        row = {"step": x["step"]}
        for key in ("loss", "grad_norm"):
            vx, vy = x.get(key), y.get(key)
            if vx is None or vy is None or not math.isfinite(vx) or not math.isfinite(vy):
                bad.append(f"step {x['step']} {key}: {vx} vs {vy} (not finite)")
                continue
            row[key] = {"reference": vx, "other": vy, "rel": rel(vx, vy)}
            if rel(vx, vy) > a.tol:
                bad.append(f"step {x['step']} {key}: {vx} vs {vy} (rel {rel(vx, vy):.3g})")
        out["steps"].append(row)
    ca, cb = newest_checkpoint(a.reference), newest_checkpoint(a.other)
    wa, wb = load_file(str(ca / "model.safetensors")), load_file(str(cb / "model.safetensors"))
    if set(wa) != set(wb):
        bad.append(f"tensors differ: {sorted(set(wa) ^ set(wb))[:5]}")
    worst = (0.0, "")
    for k in sorted(set(wa) & set(wb)):
        x, y = wa[k].astype(np.float64), wb[k].astype(np.float64)
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            bad.append(f"{k}: not finite")
            continue
        d = float(np.abs(x - y).max() / max(float(np.abs(x).max()), 1.0)) if x.size else 0.0
        if d > worst[0]:
            worst = (d, k)
    out["weights"] = {"checkpoint": ca.name, "worst_rel": worst[0], "worst_tensor": worst[1]}
    if worst[0] > a.tol:
        bad.append(f"weights ({ca.name}): worst {worst[1]} rel {worst[0]:.3g}")
    steps = out["steps"]
    worst_loss = max((s["loss"]["rel"] for s in steps if "loss" in s), default=0.0)
    worst_gn = max((s["grad_norm"]["rel"] for s in steps if "grad_norm" in s), default=0.0)
    print(f"{len(steps)} steps: loss worst rel {worst_loss:.3g}, grad_norm worst rel {worst_gn:.3g}; "
          f"weights of {ca.name} worst rel {worst[0]:.3g} ({worst[1]}); tolerance {a.tol:g}")
    out["ok"] = not bad
    out["problems"] = bad
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    for b in bad[:20]:
        print("  " + b)
    print("EQUAL within tolerance" if not bad else "DIFFERENT")
    sys.exit(0 if not bad else 1)


if __name__ == "__main__":
    main()
