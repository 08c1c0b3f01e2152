#!/usr/bin/env python3
"""One gspo-train run's update time per optimizer step, from its metrics.jsonl: the median of
`update_seconds` over the steps after the first generation batch (4 optimizer steps with
configs/gspo/bench.toml), and the run's peak memory. With --losses, the gradient norms and
losses too (two builds of the same seed and data should train alike).

    update_seconds.py METRICS.jsonl LABEL [--losses]
"""
import json
import statistics
import sys


def pick(row, key):
    for k in (key, f"timing/{key}", f"timings/{key}"):
        if k in row:
            return row[k]
    return (row.get("timings") or {}).get(key)


def main():
    path, label = sys.argv[1], sys.argv[2]
    try:
        rows = [json.loads(line) for line in open(path)]
    except OSError:
        print(label, "no metrics")
        return
    up = [u for u in (pick(r, "update_seconds") for r in rows[4:]) if u is not None]
    peak = {k: v for k, v in rows[-1].items() if "peak" in k or "memory" in k} if rows else {}
    print(label, "update s/step median", round(statistics.median(up), 4) if up else None,
          "n", len(up), "peak", peak)
    if "--losses" in sys.argv[3:]:
        print("  grad_norm", [r.get("grad_norm") for r in rows],
              "loss", [r.get("loss") for r in rows])


if __name__ == "__main__":
    main()
