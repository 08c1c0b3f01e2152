#!/usr/bin/env python3
"""A decode step's GPU time by kernel, from an ncu CSV of scripts/gpu/profile_decode.sh: the
last decode steps of the run (found by the paged attention's combine kernel, one per layer and
step) summed by kernel: launches, microseconds and DRAM bytes per step, the bandwidth reached,
and the time the step's bytes take at the limit.

    python3 scripts/gpu/decode_profile.py ncu_7b_6.csv --layers 28 --bandwidth 3.35e12
"""
import argparse
from collections import defaultdict

from kernel_times import launches, short


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="ncu CSV (or .csv.xz) of a run with at least steps + 1 decode steps")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3, help="decode steps to sum (the last ones)")
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM 3.35e12)")
    a = ap.parse_args()
    l = launches(a.run)
    # A window from one step's last-layer combine to a later step's holds each of a step's
    # launches once per step between them (the head and sampling of the earlier one included).
    cl = [i for i, k in enumerate(l) if "paged_attn_combine" in k["name"]]
    L, n = a.layers, a.steps
    if len(cl) < (n + 1) * L:
        raise SystemExit(f"{len(cl)} combine launches: fewer than {n + 1} steps of {L} layers")
    last = l[cl[-1 - n * L]:cl[-1]]
    per = len(last) // n
    by = defaultdict(lambda: [0, 0.0, 0.0])
    for k in last:
        e = by[(short(k["name"], 70), k["grid"])]
        e[0] += 1
        e[1] += k.get("gpu__time_duration.sum", 0) / 1e3
        e[2] += k.get("dram__bytes_read.sum", 0) + k.get("dram__bytes_write.sum", 0)
    total_us = sum(e[1] for e in by.values()) / n
    total_b = sum(e[2] for e in by.values()) / n
    print(f"{per} launches per decode step; GPU time {total_us:.0f} us, DRAM {total_b/1e9:.3f} GB "
          f"-> {total_b/(total_us*1e-6)/1e9:.0f} GB/s ({100*total_b/(total_us*1e-6)/a.bandwidth:.0f}% "
          f"of {a.bandwidth/1e12:.2f} TB/s); at the limit {total_b/a.bandwidth*1e6:.0f} us")
    print(f"{'kernel':70} {'grid':>14} {'n':>4} {'us':>8} {'%':>5} {'GB/s':>6}")
    for (name, grid), (c, us, b) in sorted(by.items(), key=lambda x: -x[1][1]):
        print(f"{name:70} {grid:>14} {c//n:>4} {us/n:8.1f} {100*us/n/total_us:5.1f} "
              f"{b/(us*1e-6)/1e9 if us else 0:6.0f}")


if __name__ == "__main__":
    main()
