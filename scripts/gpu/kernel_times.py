#!/usr/bin/env python3
"""GPU time by kernel from an ncu CSV (`--csv --print-units base`, at least
gpu__time_duration.sum): launches, milliseconds, share of the window, and where the CSV has
them the DRAM bandwidth reached and the tensor pipes' busy percent, largest first. The window
is what ncu profiled (`--profile-from-start off` with FLEET_CUDA_PROFILE_STAGE, or a bench's
`--cuda-profile-range`): scripts/gpu/profile_stage.sh.

    python3 scripts/gpu/kernel_times.py ncu_update.csv.xz --top 40
"""
import argparse
import csv
import lzma
import re
from collections import OrderedDict, defaultdict

TIME = "gpu__time_duration.sum"
DRAM = ("dram__bytes_read.sum", "dram__bytes_write.sum")
TENSOR = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"


def launches(path):
    """Every launch of an ncu CSV (or .csv.xz), in order: name, grid, block and each metric."""
    rows = OrderedDict()
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        k = rows.setdefault(r["ID"], {"name": r["Kernel Name"], "grid": r.get("Grid Size", ""),
                                      "block": r.get("Block Size", "")})
        k[r["Metric Name"]] = float(r["Metric Value"].replace(",", "") or 0)
    return list(rows.values())


def short(name, width=64):
    """A kernel's name without its arguments and template parameters."""
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"^void ", "", name)
    return re.sub(r"<.*>", "<>", name)[:width]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", help="ncu CSV (or .csv.xz)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--by-grid", action="store_true", help="one row per kernel and grid")
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM)")
    a = ap.parse_args()
    ls = launches(a.csv)
    by = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for k in ls:
        key = (short(k["name"]), k["grid"] if a.by_grid else "")
        e = by[key]
        t = k.get(TIME, 0.0) / 1e6  # ns -> ms
        e[0] += 1
        e[1] += t
        e[2] += sum(k.get(m, 0.0) for m in DRAM)
        e[3] += k.get(TENSOR, 0.0) * t  # time-weighted
    total = sum(e[1] for e in by.values())
    print(f"{len(ls)} launches, {total:.2f} ms of kernel time")
    print(f"{'kernel':64} {'grid':>14} {'n':>6} {'ms':>9} {'share':>6} {'GB/s':>7} {'%bw':>4} {'%tc':>4}")
    for (name, grid), (n, ms, b, tc) in sorted(by.items(), key=lambda kv: -kv[1][1])[: a.top]:
        bw = b / (ms * 1e-3) / 1e9 if ms > 0 and b > 0 else 0.0
        pct = 100 * bw * 1e9 / a.bandwidth if bw else 0.0
        tcs = f"{tc / ms:4.0f}" if ms > 0 and tc > 0 else "   -"
        print(f"{name:64} {grid:>14} {n:6d} {ms:9.2f} {100 * ms / total:5.1f}% {bw:7.0f} {pct:4.0f} {tcs}")


if __name__ == "__main__":
    main()
