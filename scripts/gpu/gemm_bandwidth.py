"""How close cuBLAS (through PyTorch) comes to the memory bandwidth on the decode step's
few-row products: y = x · wᵀ for the Qwen2.5-7B / 1.5B / 0.5B projections at 1–64 rows, bf16, each
timed with CUDA events over a CUDA graph of many launches (so PyTorch's host overhead is not
timed) cycling through a weight set larger than L2 (so every launch reads its weight from DRAM). Prints rows, shape, microseconds and GB/s of weight + activation
traffic. Usage: python3 scripts/gpu/gemm_bandwidth.py [--rows 1,8,32,64]"""
import argparse

import torch

SHAPES = {
    # name: (n, k) of the weight [n, k]
    "7b.qkv": (4608, 3584),
    "7b.o": (3584, 3584),
    "7b.gate_up": (37888, 3584),
    "7b.down": (3584, 18944),
    "1.5b.qkv": (2048, 1536),
    "1.5b.o": (1536, 1536),
    "1.5b.gate_up": (17920, 1536),
    "1.5b.down": (1536, 8960),
    "0.5b.qkv": (1152, 896),
    "0.5b.gate_up": (9728, 896),
    "0.5b.down": (896, 4864),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16,32,48,64")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print(f"{'rows':>4} {'shape':<14} {'us':>8} {'GB/s':>7}")
    for name, (n, k) in SHAPES.items():
        # Enough copies of the weight to exceed L2 (50 MB on an H100) by far.
        copies = max(2, int(400e6 // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for w in ws:  # cuBLAS's handle and workspace before the capture
                    torch.matmul(x, w.t(), out=out)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(args.iters):
                    torch.matmul(x, ws[i % copies].t(), out=out)
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1e3 / args.iters
            gb = (n * k + rows * k + rows * n) * 2 / 1e9
            print(f"{rows:>4} {name:<14} {us:>8.1f} {gb / (us * 1e-6):>7.0f}")
        del ws


if __name__ == "__main__":
    main()
