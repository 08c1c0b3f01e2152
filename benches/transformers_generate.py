#!/usr/bin/env python3
"""HF transformers reference for `fleet bench generate`: prefill and decode throughput.

The definitions are in benches/README.md. The Rust side must measure the same way.

  python3 benches/transformers_generate.py --config configs/models/qwen2.5-7b.json \
      --dtype bf16 --prompt-len 512 --new-tokens 128 --batch 1,32 --device cuda \
      --json OUT.json [--seed 0] [--cache-implementation static]

The model is built from the config with random weights, directly on the target device
(no CPU init, no checkpoint). Every 2-D weight ~ N(0, --init-std), biases 0, norm
weights 1. With random weights, the speed is the same as with real weights.

For each batch size B:
  * prompt: random ids [B, prompt_len], no padding, attention_mask all ones;
  * warm-up: one prefill forward and one full generate (not timed);
  * prefill: forward over the prompt with use_cache=True and logits for the last
    position only (logits_to_keep=1, as generate() does). Timed between
    torch.cuda.synchronize() calls; we keep the median of --prefill-repeats (3).
    prefill_tok_s = B * prompt_len / t_prefill;
  * generate: model.generate(greedy, max_new_tokens = min_new_tokens = N, EOS
    disabled, so exactly N new tokens). Timed the same way; we keep the median of
    --gen-repeats (3, as fleet's --repeats; 1 before 2026-11-28). The first new token comes from the prefill, so
    decode_tok_s = B * (N - 1) / (t_generate - t_prefill);
  * --cache-implementation static: generate() with transformers' static cache, which on
    CUDA makes generate() compile the decode step (torch.compile, its default
    compile_config); the warm-up generate of each B pays the compilation, not the timing;
  * memory: torch.cuda.reset_peak_memory_stats() before the warm-up of each B, then
    max_memory_allocated() / max_memory_reserved() after the timed runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import sys
import time

T0 = time.time()


def log(msg: str) -> None:
    print(f"[hf-bench +{time.time() - T0:6.1f}s] {msg}", flush=True)


DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f16": "float16", "fp16": "float16",
          "float16": "float16", "f32": "float32", "fp32": "float32", "float32": "float32"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="hub-style config.json")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--attn", default=None,
                    help="attn_implementation (default: the transformers default, i.e. sdpa)")
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--gen-repeats", type=int, default=3)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--cache-implementation", default="dynamic", choices=["dynamic", "static"],
                    help="generate()'s KV cache: dynamic (transformers' default) or static, with "
                         "which generate() compiles the decode step itself on CUDA (torch.compile, "
                         "its default compile_config); the warm-up generate pays the compilation")
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    dtype = getattr(torch, DTYPES[args.dtype])
    dev = torch.device(args.device)
    is_cuda = dev.type == "cuda"
    if is_cuda:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda requested but torch.cuda.is_available() is False")
        if dev.index is not None:
            torch.cuda.set_device(dev)
    batches = [int(b) for b in str(args.batch).split(",") if b.strip()]
    P, N = args.prompt_len, args.new_tokens
    if N < 2:
        raise SystemExit("--new-tokens must be >= 2 (decode_tok_s uses N-1)")

    def sync():
        if is_cuda:
            torch.cuda.synchronize(dev)

    cfg = AutoConfig.from_pretrained(os.path.abspath(args.config))
    # ---------------------------------------------------------------- build on device
    t = time.time()
    torch.manual_seed(args.seed)
    kw = {"dtype": dtype}
    if args.attn:
        kw["attn_implementation"] = args.attn
    try:  # skip transformers' own init: every parameter is written below
        from transformers.initialization import no_init_weights
    except Exception:
        import contextlib

        no_init_weights = contextlib.nullcontext
    with dev, no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, **kw)
    model.tie_weights()  # no_init_weights also skips tying lm_head to embed_tokens
    model = model.to(dev)  # no-op when already there
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, args.init_std, generator=gen)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    model.eval()
    sync()
    t_build = time.time() - t
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    attn_impl = getattr(model.config, "_attn_implementation", None)
    log(f"built {type(model).__name__} {n_params / 1e9:.3f}B params ({weight_bytes / 2**30:.2f} GiB) "
        f"{args.dtype} on {dev} in {t_build:.1f}s; attn_implementation={attn_impl}")

    # Never stop early: no EOS anywhere, and min_new_tokens = max_new_tokens = N.
    pad_id = cfg.pad_token_id if getattr(cfg, "pad_token_id", None) is not None else 0
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad_id
    gcfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=N, min_new_tokens=N,
                            eos_token_id=None, pad_token_id=pad_id, use_cache=True)
    if args.cache_implementation == "static":
        gcfg.cache_implementation = "static"

    def prefill(ids, mask):
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        sync()
        dt = time.perf_counter() - t0
        del out
        return dt

    def generate(ids, mask):
        sync()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gcfg)
        sync()
        dt = time.perf_counter() - t0
        n_new = int(out.shape[1] - ids.shape[1])
        del out
        return dt, n_new

    runs = []
    g_ids = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    for B in batches:
        r = {"batch": B}
        try:
            ids = torch.randint(0, cfg.vocab_size, (B, P), generator=g_ids, dtype=torch.int64).to(dev)
            mask = torch.ones_like(ids)
            gc.collect()
            if is_cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            with torch.inference_mode():
                if not args.no_warmup:
                    prefill(ids, mask)
                    generate(ids, mask)
                tp = [prefill(ids, mask) for _ in range(max(1, args.prefill_repeats))]
                tg = []
                n_new = None
                for _ in range(max(1, args.gen_repeats)):
                    dt, n_new = generate(ids, mask)
                    tg.append(dt)
            t_p = statistics.median(tp)
            t_g = statistics.median(tg)
            r.update({
                "prefill_tok_s": B * P / t_p,
                "decode_tok_s": (B * (N - 1) / (t_g - t_p)) if t_g > t_p else None,
                "t_prefill_s": t_p,
                "t_generate_s": t_g,
                "decode_ms_per_step": ((t_g - t_p) / (N - 1) * 1e3) if t_g > t_p else None,
                "e2e_tok_s": B * N / t_g,
                "t_prefill_all_s": tp,
                "t_generate_all_s": tg,
                "new_tokens_generated": n_new,
                "stopped_early": n_new != N,
                "peak_alloc_bytes": torch.cuda.max_memory_allocated(dev) if is_cuda else None,
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev) if is_cuda else None,
            })
            log(f"B={B}: prefill {r['prefill_tok_s']:.1f} tok/s ({t_p * 1e3:.1f} ms), "
                f"decode {r['decode_tok_s'] or float('nan'):.1f} tok/s (generate {t_g:.3f}s, {n_new} new)")
        except torch.cuda.OutOfMemoryError as e:  # keep going with the other batch sizes
            r["error"] = f"OOM: {str(e).splitlines()[0]}"
            log(f"B={B}: {r['error']}")
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"
            log(f"B={B}: {r['error']}")
        finally:
            ids = mask = None
            gc.collect()
            if is_cuda:
                torch.cuda.empty_cache()
        runs.append(r)

    res = {
        "engine": "transformers",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
        "device": torch.cuda.get_device_name(dev) if is_cuda else f"cpu ({platform.machine()})",
        "config": args.config,
        "shape": {
            "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            "vocab": cfg.vocab_size,
            "intermediate": cfg.intermediate_size,
            "tied_embeddings": bool(cfg.tie_word_embeddings),
            "params": n_params,
            "weight_bytes": weight_bytes,
        },
        "dtype": DTYPES[args.dtype],
        "prompt_len": P,
        "new_tokens": N,
        "seed": args.seed,
        "attn_implementation": attn_impl,
        "cache": ("DynamicCache (transformers default)" if args.cache_implementation == "dynamic"
                  else "static (cache_implementation='static'; generate() compiles the decode step)"),
        "method": {
            "prefill": "median of prefill_repeats forward(use_cache=True, logits_to_keep=1) over [B, prompt_len]",
            "generate": "median of gen_repeats generate(greedy, max_new_tokens=min_new_tokens=N, no EOS)",
            "decode_tok_s": "B*(N-1)/(t_generate - t_prefill)",
            "prefill_repeats": args.prefill_repeats,
            "gen_repeats": args.gen_repeats,
            "warmup": not args.no_warmup,
            "memory": "reset_peak_memory_stats before each batch's warm-up; max_memory_allocated/reserved after",
        },
        "build_s": t_build,
        "runs": runs,
        "total_s": time.time() - T0,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=2)

    print(f"\ntransformers {transformers.__version__} / torch {torch.__version__} on {res['device']}; "
          f"{args.config} {DTYPES[args.dtype]} attn={attn_impl} prompt={P} new={N}")
    hdr = f"{'batch':>6s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'t_prefill s':>12s} {'t_gen s':>9s} {'peak alloc GiB':>15s} {'peak rsvd GiB':>14s}"
    print(hdr)
    print("-" * len(hdr))
    for r in runs:
        if "error" in r:
            print(f"{r['batch']:>6d}  {r['error']}")
            continue
        pa = r["peak_alloc_bytes"]
        pr = r["peak_reserved_bytes"]
        print(f"{r['batch']:>6d} {r['prefill_tok_s']:>14.1f} {(r['decode_tok_s'] or float('nan')):>13.1f} "
              f"{r['t_prefill_s']:>12.4f} {r['t_generate_s']:>9.3f} "
              f"{(pa / 2**30 if pa else float('nan')):>15.2f} {(pr / 2**30 if pr else float('nan')):>14.2f}")
    print(f"wrote {args.json}")
    return 0 if all("error" not in r for r in runs) else 3


if __name__ == "__main__":
    sys.exit(main())
