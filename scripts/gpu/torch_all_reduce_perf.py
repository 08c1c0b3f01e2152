#!/usr/bin/env python3
"""torch.distributed's NCCL all-reduce timed as nccl-tests' all_reduce_perf times it, the
reference beside `gspo-train --bench-all-reduce` (same sizes, dtypes, 5 warm-up and 20 timed
calls per size, time averaged over the ranks, busbw = algbw x 2(n-1)/n).

    python3 -m torch.distributed.run --nproc-per-node 2 scripts/gpu/torch_all_reduce_perf.py \
        --max-bytes 1073741824 --out all_reduce_torch.json
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-bytes", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    n, rank = dist.get_world_size(), dist.get_rank()
    sizes, s = [], min(4096, a.max_bytes)
    while s <= a.max_bytes:
        sizes.append(s)
        s *= 4
    rows = []
    for dtype, name in ((torch.float32, "float"), (torch.bfloat16, "bfloat16")):
        width = torch.tensor([], dtype=dtype).element_size()
        for size in sizes:
            count = max(size // width, 1)
            check = torch.full((count,), float(rank + 1), dtype=dtype, device="cuda")
            dist.all_reduce(check)
            correct = bool((check.float() == n * (n + 1) / 2).all())
            t = torch.ones(count, dtype=dtype, device="cuda")
            for _ in range(5):
                dist.all_reduce(t)
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(20):
                dist.all_reduce(t)
            torch.cuda.synchronize()
            sec = torch.tensor([(time.perf_counter() - start) / 20], dtype=torch.float64, device="cuda")
            dist.all_reduce(sec)
            sec = sec.item() / n
            algbw = count * width / sec / 1e9
            rows.append({"bytes": count * width, "count": count, "dtype": name, "time_us": sec * 1e6,
                         "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n, "correct": correct})
    if rank == 0:
        print(f"# torch {torch.__version__} NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {n} ranks")
        print(f"{'size(B)':>12} {'count':>12} {'type':>9} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
        for r in rows:
            print(f"{r['bytes']:>12} {r['count']:>12} {r['dtype']:>9} {r['time_us']:>11.1f} {r['algbw']:>12.2f} {r['busbw']:>12.2f}")
        with open(a.out, "w") as f:
            json.dump({"world_size": n, "backend": "torch.distributed nccl", "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
