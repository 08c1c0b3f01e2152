#!/usr/bin/env python3
"""f32 parity of a CUDA build of fleet on the tiny fixtures, on one device and split.

For every checkpoint in tests/fixtures and every device spec (e.g. `cuda:0`, `cpu,cuda:0`,
`cuda:0,cuda:1`), runs `fleet logits` on the golden logits cases and compares with the
transformers goldens at the listed positions, and generates all greedy goldens as one
left-padded batch, which must be token-identical. A split spec puts contiguous layer ranges on
different devices, so hidden states cross a real device boundary.

    python3 scripts/gpu/parity_fixtures.py --fleet dist/cuda/fleet --devices cuda:0 cpu,cuda:0 --json out.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import load_file

CHECKPOINTS = ["qwen2-tiny", "qwen2-tiny-tied-sharded", "qwen3-tiny"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fleet", default="dist/cuda/fleet")
    ap.add_argument("--fixtures", default="tests/fixtures")
    ap.add_argument("--devices", nargs="+", default=["cuda:0", "cpu,cuda:0"])
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    results, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for name in CHECKPOINTS:
            golden = json.load(open(os.path.join(args.fixtures, "golden", f"{name}.json")))
            for spec in args.devices:
                worst = 0.0
                for i, case in enumerate(golden["logits"]):
                    ids = os.path.join(tmp, "ids.json")
                    out = os.path.join(tmp, "logits.safetensors")
                    json.dump({"input_ids": [case["input_ids"]]}, open(ids, "w"))
                    cmd = [args.fleet, "logits", "--model", os.path.join(args.fixtures, name),
                           "--ids-file", ids, "--dtype", "f32", "--device", spec, "--output", out]
                    p = subprocess.run(cmd, capture_output=True, text=True)
                    if p.returncode != 0:
                        print(f"{name} {spec} case {i}: fleet failed: {p.stderr.strip()}")
                        ok = False
                        worst = float("inf")
                        continue
                    got = load_file(out)["logits"][0]
                    for pos, want in zip(case["positions"], case["logits"]):
                        worst = max(worst, float(np.abs(got[pos] - np.asarray(want, np.float32)).max()))
                # All greedy goldens of the checkpoint as one left-padded batch (prompts of
                # different lengths): token-identical to transformers.
                greedy = golden["greedy"]
                ids = os.path.join(tmp, "greedy.json")
                json.dump({"input_ids": [c["input_ids"] for c in greedy]}, open(ids, "w"))
                n_new = max(c["max_new_tokens"] for c in greedy)
                cmd = [args.fleet, "generate", "--model", os.path.join(args.fixtures, name),
                       "--ids-file", ids, "--max-new-tokens", str(n_new), "--dtype", "f32",
                       "--device", spec]
                p = subprocess.run(cmd, capture_output=True, text=True)
                outs = [json.loads(l) for l in p.stdout.splitlines() if l.strip()] if p.returncode == 0 else []
                same = len(outs) == len(greedy) and all(
                    o["token_ids"][:c["max_new_tokens"]] == c["output_ids"] for o, c in zip(outs, greedy))
                if p.returncode != 0:
                    print(f"{name} {spec} greedy: fleet failed: {p.stderr.strip()}")
                passed = worst < args.tol and same
                ok &= passed
                results.append({"checkpoint": name, "devices": spec, "max_abs_diff": worst,
                                "batched_greedy_identical": same, "pass": passed})
                print(f"{name:<26} {spec:<14} max|diff| {worst:.3g}  batched greedy "
                      f"{'identical' if same else 'DIFFERS'}  {'PASS' if passed else 'FAIL'}")
    json.dump({"tolerance": args.tol, "dtype": "f32", "results": results, "pass": ok},
              open(args.json, "w"), indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
