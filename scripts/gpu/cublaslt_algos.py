#!/usr/bin/env python3
"""How fast cuBLASLt's candidate algorithms stream a decode step's weights: for each of the
Qwen2.5-7B's products at a few rows (a decode step at batch M: y[M, n] = x[M, k] · w[n, k]ᵀ,
bf16, f32 accumulation), ask cuBLASLt's heuristic for up to ALGOS algorithms, time each with
CUDA events and report GB/s of the weight read. The first candidate is what a plain cuBLASLt
call takes; torch.matmul (cuBLAS, as candle calls it) is timed beside them.

Weights are cycled over enough copies (> 200 MB together) that each call reads its weight from
HBM, not L2 (50 MB on an H200). Needs torch with CUDA; cuBLASLt is called through ctypes.

    python3 scripts/gpu/cublaslt_algos.py [--rows 32] [--algos 32] [--json out.json]
"""
import argparse
import ctypes
import json
import os

import torch

SHAPES = {  # name: (n, k) of Qwen2.5-7B (hidden 3584, intermediate 18944, 28/4 heads of 128)
    "q/k/v": (4608, 3584),
    "o": (3584, 3584),
    "gate/up": (37888, 3584),
    "down": (3584, 18944),
    "lm_head": (152064, 3584),
}

# cublasLt enums (cublasLt.h, CUDA 13.0; library_types.h, cublas_api.h).
CUBLAS_COMPUTE_32F = 68
CUDA_R_32F = 0
CUDA_R_16BF = 14
DESC_TRANSA, DESC_TRANSB = 3, 4
OP_N, OP_T = 0, 1
PREF_MAX_WORKSPACE_BYTES = 1


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", Algo),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def load_lt():
    names = ["libcublasLt.so.13", "/usr/local/cuda/lib64/libcublasLt.so.13", "libcublasLt.so"]
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError:
            continue
    raise SystemExit("no libcublasLt")


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cublas status {status}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--algos", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.ones(8, 8, device="cuda", dtype=torch.bfloat16) @ torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    lt = load_lt()  # after torch's first GEMM: the cuBLASLt torch loaded, where the sonames match
    vp = ctypes.c_void_p
    handle = vp()
    check(lt.cublasLtCreate(ctypes.byref(handle)), "create")
    ws_bytes = 32 << 20
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
    stream = vp(torch.cuda.current_stream().cuda_stream)
    bw = 4.8e12 if "H200" in torch.cuda.get_device_name() else 3.35e12
    m = args.rows
    report = {"device": torch.cuda.get_device_name(), "rows": m, "shapes": {}}
    for name, (n, k) in SHAPES.items():
        wbytes = n * k * 2
        copies = max(1, -(-220_000_000 // wbytes))
        ws_list = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        desc = vp()
        check(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        ta, tb = ctypes.c_int(OP_T), ctypes.c_int(OP_N)
        check(lt.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSA, ctypes.byref(ta), ctypes.c_size_t(4)), "transa")
        check(lt.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSB, ctypes.byref(tb), ctypes.c_size_t(4)), "transb")
        # Column-major: yᵀ [n, m] = w [k x n stored, transposed] · xᵀ [k, m].
        la, lb, lc = vp(), vp(), vp()
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(la), CUDA_R_16BF, ctypes.c_uint64(k), ctypes.c_uint64(n), ctypes.c_int64(k)), "la")
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(lb), CUDA_R_16BF, ctypes.c_uint64(k), ctypes.c_uint64(m), ctypes.c_int64(k)), "lb")
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(lc), CUDA_R_16BF, ctypes.c_uint64(n), ctypes.c_uint64(m), ctypes.c_int64(n)), "lc")
        pref = vp()
        check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        wsz = ctypes.c_uint64(ws_bytes)
        check(lt.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(wsz), ctypes.c_size_t(8)), "pref ws")
        results = (Heuristic * args.algos)()
        found = ctypes.c_int(0)
        check(lt.cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, pref, ctypes.c_int(args.algos),
                                                 results, ctypes.byref(found)), "heuristic")
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        ref = (x.float() @ ws_list[0].float().t())

        def run(i, w):
            return lt.cublasLtMatmul(handle, desc, ctypes.byref(alpha), vp(w.data_ptr()), la,
                                     vp(x.data_ptr()), lb, ctypes.byref(beta), vp(y.data_ptr()), lc,
                                     vp(y.data_ptr()), lc, ctypes.byref(results[i].algo),
                                     vp(ws.data_ptr()), ctypes.c_size_t(ws_bytes), stream)

        def timed(fn):
            for j in range(3):
                fn(ws_list[j % copies])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for j in range(args.reps):
                fn(ws_list[j % copies])
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / args.reps * 1e3  # µs

        rows = []
        us = timed(lambda w: torch.matmul(x, w.t(), out=y))
        rows.append({"algo": "torch.matmul", "us": us, "gbps": wbytes / us / 1e3})
        for i in range(found.value):
            if results[i].state != 0:
                continue
            st = run(i, ws_list[0])
            if st != 0:
                rows.append({"algo": i, "error": st})
                continue
            torch.cuda.synchronize()
            err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
            us = timed(lambda w, i=i: run(i, w))
            rows.append({"algo": i, "us": us, "gbps": wbytes / us / 1e3, "waves": results[i].wavesCount,
                         "workspace": results[i].workspaceSize, "rel_err": err})
        timed_rows = [r for r in rows if "us" in r]
        best = min(timed_rows, key=lambda r: r["us"])
        print(f"== {name} n {n} k {k} rows {m}: {wbytes / 1e6:.1f} MB, {found.value} candidates; limit {wbytes / bw * 1e6:.1f} us")
        for r in rows:
            if "us" in r:
                extra = f" waves {r['waves']:.2f} ws {r['workspace']} err {r['rel_err']:.1e}" if "waves" in r else ""
                print(f"  {str(r['algo']):>12}  {r['us']:8.1f} us  {r['gbps']:7.1f} GB/s  {r['gbps'] * 1e9 / bw * 100:5.1f}%{extra}")
            else:
                print(f"  {r['algo']:>12}  error {r['error']}")
        print(f"  best: {best['algo']} at {best['gbps']:.1f} GB/s")
        report["shapes"][name] = {"n": n, "k": k, "bytes": wbytes, "candidates": rows}
        for o in (la, lb, lc):
            lt.cublasLtMatrixLayoutDestroy(o)
        lt.cublasLtMatmulPreferenceDestroy(pref)
        lt.cublasLtMatmulDescDestroy(desc)
        del ws_list
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
