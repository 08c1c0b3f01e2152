#!/usr/bin/env python3
"""bf16 logits parity: HF transformers (reference) vs `fleet logits`.

Two subcommands:

  make     Build a random-weight Qwen2/Qwen3 model from a hub-style config.json,
           save it as a HF checkpoint (safetensors + config.json +
           generation_config.json), write random input ids, and compute the
           transformers reference logits:
             DIR/model/                    the checkpoint `fleet logits --model` reads
             DIR/ids.json                  {"input_ids": [[...], ...]} (equal lengths)
             DIR/hf_logits.safetensors     "logits" f32 [n_seqs, seq_len, vocab]; bf16 model,
                                           default attention (sdpa)    <- the reference
             DIR/hf_logits_f32.safetensors same weights upcast to f32, f32 compute
             DIR/hf_logits_eager.safetensors  bf16, attn_implementation="eager" (unless --no-eager)
             DIR/hf_meta.json              versions, device, init scheme, and HF-vs-HF noise stats

  compare  Compare a `fleet logits` output file with the references above and
           write a JSON report (and print a short table).

Weights: every 2-D weight (embeddings, linear layers, lm_head) ~ N(0, initializer_range),
the same as transformers' _init_weights. By default the things that _init_weights
leaves trivial are also randomized, so that the parity test exercises them: linear
biases (Qwen2 q/k/v bias) ~ N(0, --bias-std) and norm weights ~ U(0.5, 1.5) (instead of
zeros / ones). Use --no-perturb for the plain transformers init. Weights are drawn in
f32 on --device with a generator seeded by --seed (so the checkpoint's values depend on
the device's RNG; both HF and fleet read the same saved files, so that does not matter).

The logits are computed from the checkpoint as reloaded from DIR/model (not from the
in-memory model), so the reference is, by construction, the model that fleet loads.

Smoke test on CPU (tiny shapes):
  python3 scripts/gpu/parity_bf16.py make --config tiny.json --out /tmp/p --device cpu \
      --n-seqs 2 --seq-len 16
  python3 scripts/gpu/parity_bf16.py compare --dir /tmp/p --fleet /tmp/p/hf_logits_eager.safetensors \
      --json /tmp/p/parity.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import shutil
import socket
import sys
import time

T0 = time.time()


def log(msg: str) -> None:
    print(f"[parity +{time.time() - T0:6.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- helpers


def versions() -> dict:
    import torch
    import transformers

    d = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda,
        "hostname": socket.gethostname(),
    }
    try:
        import safetensors

        d["safetensors"] = safetensors.__version__
    except Exception:  # pragma: no cover
        pass
    return d


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        return torch.cuda.get_device_name(idx)
    return f"cpu ({platform.processor() or platform.machine()})"


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def save_logits(path: str, logits, extra_meta: dict | None = None) -> None:
    from safetensors.torch import save_file

    meta = {"format": "pt"}
    for k, v in (extra_meta or {}).items():
        meta[k] = str(v)
    save_file({"logits": logits.contiguous()}, path, metadata=meta)


def load_logits(path: str):
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        keys = list(f.keys())
        if "logits" not in keys:
            raise SystemExit(f"{path}: no tensor named 'logits' (tensors: {keys})")
        return f.get_tensor("logits")


STATS_DEVICE = "cpu"


def pair_stats(a, b, ref_for_margin=None, margin: float = 0.1) -> dict:
    """Statistics of `b` against `a` (a is the reference). Tensors are [n, s, v] on the CPU;
    each sequence is moved to STATS_DEVICE for the arithmetic."""
    import torch

    assert a.shape == b.shape, (a.shape, b.shape)
    dv = STATS_DEVICE
    n, s, v = a.shape
    max_abs = 0.0
    sum_abs = 0.0
    agree = 0
    kl_sum = 0.0
    kl_max = 0.0
    dec_n = 0
    dec_agree = 0
    nonfinite = 0
    ref_absmax = 0.0
    for i in range(n):  # per sequence, to bound memory
        x = a[i].to(dv).float()
        y = b[i].to(dv).float()
        nonfinite += int((~torch.isfinite(y)).sum().item())
        d = (x - y).abs()
        max_abs = max(max_abs, float(d.max().item()))
        sum_abs += float(d.double().sum().item())
        ref_absmax = max(ref_absmax, float(x.abs().max().item()))
        ax = x.argmax(-1)
        ay = y.argmax(-1)
        eq = ax == ay
        agree += int(eq.sum().item())
        lpx = torch.log_softmax(x.double(), -1)
        lpy = torch.log_softmax(y.double(), -1)
        kl = (lpx.exp() * (lpx - lpy)).sum(-1)  # KL(a || b) per position
        kl_sum += float(kl.sum().item())
        kl_max = max(kl_max, float(kl.max().item()))
        m = (ref_for_margin[i] if ref_for_margin is not None else a[i]).to(dv).float()
        top2 = m.topk(2, dim=-1).values
        dec = (top2[:, 0] - top2[:, 1]) > margin
        dec_n += int(dec.sum().item())
        dec_agree += int((eq & dec).sum().item())
    npos = n * s
    return {
        "max_abs_diff": max_abs,
        "mean_abs_diff": sum_abs / (npos * v),
        "top1_agree": agree / npos,
        "top1_agree_decisive": (dec_agree / dec_n) if dec_n else None,
        "n_decisive": dec_n,
        "kl_mean": kl_sum / npos,
        "kl_max": kl_max,
        "ref_abs_max": ref_absmax,
        "n_positions": npos,
        "nonfinite": nonfinite,
    }


# --------------------------------------------------------------------------- make


def init_weights(model, std: float, perturb: bool, bias_std: float, seed: int) -> dict:
    """Deterministic in-place init (on the parameters' device, with a generator seeded by
    `seed`). Every parameter is written, so the model may be built without any init."""
    import torch

    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    counts = {"normal_2d": 0, "bias": 0, "norm": 0}
    with torch.no_grad():
        for name, p in model.named_parameters():  # shared (tied) params appear once
            if p.ndim >= 2:
                p.normal_(0.0, std, generator=g)
                counts["normal_2d"] += 1
            elif name.endswith(".bias"):
                if perturb:
                    p.normal_(0.0, bias_std, generator=g)
                else:
                    p.zero_()
                counts["bias"] += 1
            elif "norm" in name:
                if perturb:
                    p.uniform_(0.5, 1.5, generator=g)
                else:
                    p.fill_(1.0)
                counts["norm"] += 1
            else:
                raise SystemExit(f"init_weights: do not know how to init parameter {name} {tuple(p.shape)}")
    return {
        "weights_2d": f"normal(0, {std})",
        "biases": f"normal(0, {bias_std})" if perturb else "zeros",
        "norm_weights": "uniform(0.5, 1.5)" if perturb else "ones",
        "seed": seed,
        "generator_device": str(dev),
        "drawn_in": "float32, then cast to bfloat16",
        "counts": counts,
    }


def saved_tensor_names(model_dir: str) -> set:
    from safetensors import safe_open

    names = set()
    for fn in os.listdir(model_dir):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, fn), framework="pt", device="cpu") as f:
                names.update(f.keys())
    return names


def no_init_ctx():
    """transformers' context that skips all weight init (we write every parameter)."""
    try:
        from transformers.initialization import no_init_weights

        return no_init_weights()
    except Exception:  # older/newer layout: fall back to a normal (slower) init
        import contextlib

        return contextlib.nullcontext()


def forward_logits(model, ids, device: str):
    import torch

    with torch.inference_mode():
        x = ids.to(device)
        out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)
        logits = out.logits.float().cpu()
    sync(device)
    return logits


def load_model(model_dir: str, dtype, device: str, attn: str | None):
    from transformers import AutoModelForCausalLM

    kw = {"dtype": dtype}
    if attn is not None:
        kw["attn_implementation"] = attn
    m = AutoModelForCausalLM.from_pretrained(model_dir, **kw)  # load on CPU, then move
    m = m.to(device)
    m.eval()
    return m


def free_memory(device: str) -> None:
    """Call after dropping the caller's last reference to a model."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def cmd_make(args) -> int:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    out = os.path.abspath(args.out)
    model_dir = os.path.join(out, "model")
    if os.path.exists(model_dir):
        shutil.rmtree(model_dir)
    os.makedirs(model_dir, exist_ok=True)

    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda requested but torch.cuda.is_available() is False")
        # f32 reference must be real f32 (no TF32) on the GPU.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    with open(args.config) as f:
        src = json.load(f)
    cfg = AutoConfig.from_pretrained(os.path.abspath(args.config))
    std = args.init_std if args.init_std is not None else float(src.get("initializer_range", 0.02))
    vocab = int(cfg.vocab_size)
    log(f"config {args.config}: {cfg.model_type} layers={cfg.num_hidden_layers} hidden={cfg.hidden_size} "
        f"heads={cfg.num_attention_heads} kv={cfg.num_key_value_heads} vocab={vocab} "
        f"tied={cfg.tie_word_embeddings}")

    # Build in f32 directly on --device without transformers' init, draw the weights there
    # (fast on a GPU; the values depend on the device's RNG, which does not matter: HF and
    # fleet both read the saved checkpoint), then cast to bf16.
    torch.manual_seed(args.seed)
    t = time.time()
    with torch.device(args.device), no_init_ctx():
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # no_init_weights also skips the tying of lm_head to embed_tokens: redo it.
    model.tie_weights()
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    is_tied = head is not None and head.weight is emb.weight
    if bool(getattr(cfg, "tie_word_embeddings", False)) != is_tied:
        raise SystemExit(f"tie_word_embeddings={cfg.tie_word_embeddings} but lm_head tied={is_tied}")
    init = init_weights(model, std, not args.no_perturb, args.bias_std, args.seed)
    model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"built {type(model).__name__} with {n_params / 1e6:.1f}M params in {time.time() - t:.1f}s; init {init}")

    t = time.time()
    save_kw = {}
    sig = inspect.signature(model.save_pretrained).parameters
    if "safe_serialization" in sig:  # transformers 4.x; 5.x always writes safetensors
        save_kw["safe_serialization"] = True
    if args.max_shard_size:
        save_kw["max_shard_size"] = args.max_shard_size
    model.save_pretrained(model_dir, **save_kw)
    model = None
    free_memory(args.device)
    # transformers 5 writes its own config format (rope_parameters, dtype, layer_types).
    # Keep it for reference outside the checkpoint, and give the checkpoint the hub-style
    # config.json we built from, like a real hub download.
    shutil.copyfile(os.path.join(model_dir, "config.json"), os.path.join(out, "config.transformers.json"))
    src_out = dict(src)
    src_out["torch_dtype"] = "bfloat16"
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(src_out, f, indent=2)
        f.write("\n")
    gen = {
        "bos_token_id": src.get("bos_token_id"),
        "eos_token_id": src.get("eos_token_id"),
        "do_sample": False,
        "transformers_version": transformers.__version__,
    }
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    files = sorted(os.listdir(model_dir))
    saved = saved_tensor_names(model_dir)
    if is_tied and "lm_head.weight" in saved:
        raise SystemExit("tied model but the checkpoint has lm_head.weight")
    if not is_tied and "lm_head.weight" not in saved:
        raise SystemExit("untied model but the checkpoint has no lm_head.weight")
    log(f"saved checkpoint to {model_dir} in {time.time() - t:.1f}s: {files}")

    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    ids = torch.randint(0, vocab, (args.n_seqs, args.seq_len), generator=g, dtype=torch.int64)
    with open(os.path.join(out, "ids.json"), "w") as f:
        json.dump({"input_ids": ids.tolist()}, f)
    log(f"wrote ids.json: {args.n_seqs} x {args.seq_len}")

    meta = {
        "config": os.path.abspath(args.config),
        "model_dir": model_dir,
        "files": files,
        "tied_embeddings": is_tied,
        "n_tensors": len(saved),
        "device": args.device,
        "device_name": device_name(args.device),
        "versions": versions(),
        "init": init,
        "n_params": n_params,
        "n_seqs": args.n_seqs,
        "seq_len": args.seq_len,
        "vocab": vocab,
        "references": {},
        "timings_s": {},
    }

    # 1) reference: bf16, default attention implementation (sdpa)
    t = time.time()
    m = load_model(model_dir, torch.bfloat16, args.device, None)
    attn_default = getattr(m.config, "_attn_implementation", None)
    log(f"reloaded bf16 model, attn_implementation={attn_default}")
    ref = forward_logits(m, ids, args.device)
    ref2 = forward_logits(m, ids, args.device)
    rerun_max = float((ref - ref2).abs().max().item())
    del ref2
    m = None
    free_memory(args.device)
    save_logits(os.path.join(out, "hf_logits.safetensors"), ref,
                {"dtype": "bfloat16", "attn_implementation": attn_default})
    meta["references"]["hf_logits.safetensors"] = {"dtype": "bfloat16", "attn_implementation": attn_default}
    meta["rerun_max_abs_diff_bf16"] = rerun_max
    meta["timings_s"]["bf16_default"] = time.time() - t
    log(f"bf16 ({attn_default}) logits {tuple(ref.shape)}; rerun max|diff|={rerun_max:g}")

    # 2) f32 compute on the same (bf16-valued) weights
    t = time.time()
    m = load_model(model_dir, torch.float32, args.device, None)
    ref32 = forward_logits(m, ids, args.device)
    attn32 = getattr(m.config, "_attn_implementation", None)
    m = None
    free_memory(args.device)
    save_logits(os.path.join(out, "hf_logits_f32.safetensors"), ref32,
                {"dtype": "float32", "attn_implementation": attn32})
    meta["references"]["hf_logits_f32.safetensors"] = {"dtype": "float32", "attn_implementation": attn32}
    meta["timings_s"]["f32_default"] = time.time() - t
    log("f32 logits done")

    # 3) bf16 eager attention
    eager = None
    if not args.no_eager:
        t = time.time()
        m = load_model(model_dir, torch.bfloat16, args.device, "eager")
        eager = forward_logits(m, ids, args.device)
        m = None
        free_memory(args.device)
        save_logits(os.path.join(out, "hf_logits_eager.safetensors"), eager,
                    {"dtype": "bfloat16", "attn_implementation": "eager"})
        meta["references"]["hf_logits_eager.safetensors"] = {"dtype": "bfloat16", "attn_implementation": "eager"}
        meta["timings_s"]["bf16_eager"] = time.time() - t
        log("bf16 eager logits done")

    global STATS_DEVICE
    STATS_DEVICE = args.device
    base = {f"hf_bf16_{attn_default}_vs_hf_f32": pair_stats(ref32, ref, margin=args.margin)}
    if eager is not None:
        base["hf_bf16_eager_vs_hf_f32"] = pair_stats(ref32, eager, margin=args.margin)
        base[f"hf_bf16_eager_vs_hf_bf16_{attn_default}"] = pair_stats(ref, eager, ref_for_margin=ref32,
                                                                        margin=args.margin)
    meta["baseline"] = base
    meta["margin"] = args.margin
    meta["total_s"] = time.time() - T0
    with open(os.path.join(out, "hf_meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    for k, v in base.items():
        log(f"{k}: max|d|={v['max_abs_diff']:.4g} mean|d|={v['mean_abs_diff']:.4g} "
            f"top1={v['top1_agree']:.4f} kl={v['kl_mean']:.3g}")
    log(f"make done in {time.time() - T0:.1f}s -> {out}")
    return 0


# --------------------------------------------------------------------------- compare


def fmt(x, nd=4):
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e4):
            return f"{x:.{nd - 1}e}"
        return f"{x:.{nd}f}"
    return str(x)


def cmd_compare(args) -> int:
    import torch

    global STATS_DEVICE
    if args.stats_device:
        STATS_DEVICE = args.stats_device
    elif torch.cuda.is_available():
        STATS_DEVICE = "cuda"
    d = os.path.abspath(args.dir)
    meta_path = os.path.join(d, "hf_meta.json")
    meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
    margin = args.margin if args.margin is not None else meta.get("margin", 0.1)

    ref = load_logits(os.path.join(d, "hf_logits.safetensors")).float()
    p32 = os.path.join(d, "hf_logits_f32.safetensors")
    ref32 = load_logits(p32).float() if os.path.exists(p32) else None
    pe = os.path.join(d, "hf_logits_eager.safetensors")
    eager = load_logits(pe).float() if os.path.exists(pe) else None
    fleet = None
    fleet_dtype = None
    fleet_error = None
    if not os.path.exists(args.fleet):
        fleet_error = f"fleet logits file not found: {args.fleet}"
    else:
        try:
            fleet_raw = load_logits(args.fleet)
            fleet_dtype = str(fleet_raw.dtype).replace("torch.", "")
            fleet = fleet_raw.float()
            del fleet_raw
        except (Exception, SystemExit) as e:  # malformed file: still report the HF baselines
            fleet_error = f"cannot read fleet logits {args.fleet}: {e}"

    report = {
        "test": "bf16 logits parity: fleet vs HF transformers",
        "dir": d,
        "fleet_file": os.path.abspath(args.fleet),
        "hf_shape": list(ref.shape),
        "fleet_shape": list(fleet.shape) if fleet is not None else None,
        "fleet_file_dtype": fleet_dtype,
        "model_dtype": "bfloat16",
        "hf_make": {
            "device": meta.get("device"),
            "device_name": meta.get("device_name"),
            "versions": meta.get("versions"),
            "config": meta.get("config"),
            "init": meta.get("init"),
            "references": meta.get("references"),
            "rerun_max_abs_diff_bf16": meta.get("rerun_max_abs_diff_bf16"),
        },
        "compare_env": versions(),
        "compare_device_name": device_name(STATS_DEVICE),
        "margin": margin,
        "pairs": {},
    }

    if fleet_error is None and list(fleet.shape) != list(ref.shape):
        fleet_error = (f"shape mismatch: fleet {list(fleet.shape)} vs hf {list(ref.shape)} "
                       "(expected [n_seqs, seq_len, vocab], every position)")
    if fleet_error is not None:
        report["error"] = fleet_error
        report["verdict"] = {"pass": False, "reason": fleet_error}
        # Still record the HF-vs-HF noise, which is useful on its own.
        report["pairs"] = meta.get("baseline", {})
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"ERROR: {fleet_error}", file=sys.stderr)
        print(f"wrote {args.json} (HF baselines only)")
        return 2

    attn = (meta.get("references", {}).get("hf_logits.safetensors", {}) or {}).get("attn_implementation") or "default"
    pairs = {}
    pairs[f"fleet_bf16_vs_hf_bf16_{attn}"] = pair_stats(ref, fleet, ref_for_margin=ref32, margin=margin)
    if ref32 is not None:
        pairs["fleet_bf16_vs_hf_f32"] = pair_stats(ref32, fleet, margin=margin)
        pairs[f"hf_bf16_{attn}_vs_hf_f32"] = pair_stats(ref32, ref, margin=margin)
        if eager is not None:
            pairs["hf_bf16_eager_vs_hf_f32"] = pair_stats(ref32, eager, margin=margin)
    if eager is not None:
        pairs["fleet_bf16_vs_hf_bf16_eager"] = pair_stats(eager, fleet, ref_for_margin=ref32, margin=margin)
        pairs[f"hf_bf16_eager_vs_hf_bf16_{attn}"] = pair_stats(ref, eager, ref_for_margin=ref32, margin=margin)
    report["pairs"] = pairs

    # Verdict: fleet's distance to the f32 truth may be at most `--tol-factor` times HF bf16's
    # own distance to it (worst of sdpa/eager), and its top-1 agreement with f32 may be at most
    # `--top1-slack` below HF bf16's.
    verdict = {"pass": None}
    prim = pairs[f"fleet_bf16_vs_hf_bf16_{attn}"]
    if prim["nonfinite"]:
        verdict = {"pass": False, "reason": f"{prim['nonfinite']} non-finite fleet logits"}
    elif ref32 is not None:
        hf_noise = [pairs[f"hf_bf16_{attn}_vs_hf_f32"]]
        if "hf_bf16_eager_vs_hf_f32" in pairs:
            hf_noise.append(pairs["hf_bf16_eager_vs_hf_f32"])
        fl = pairs["fleet_bf16_vs_hf_f32"]
        lim_max = args.tol_factor * max(p["max_abs_diff"] for p in hf_noise)
        lim_mean = args.tol_factor * max(p["mean_abs_diff"] for p in hf_noise)
        lim_top1 = min(p["top1_agree"] for p in hf_noise) - args.top1_slack
        checks = {
            "max_abs_diff_vs_f32": [fl["max_abs_diff"], lim_max, fl["max_abs_diff"] <= lim_max],
            "mean_abs_diff_vs_f32": [fl["mean_abs_diff"], lim_mean, fl["mean_abs_diff"] <= lim_mean],
            "top1_agree_vs_f32": [fl["top1_agree"], lim_top1, fl["top1_agree"] >= lim_top1],
        }
        verdict = {
            "pass": all(c[2] for c in checks.values()),
            "rule": (f"fleet-vs-f32 max/mean |diff| <= {args.tol_factor} x HF-bf16-vs-f32 (worst of sdpa/eager); "
                     f"fleet-vs-f32 top1 >= HF-bf16-vs-f32 top1 (min) - {args.top1_slack}"),
            "checks": {k: {"value": v[0], "limit": v[1], "ok": v[2]} for k, v in checks.items()},
        }
    report["verdict"] = verdict

    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)

    n, s, v = ref.shape
    print(f"parity: {n} seqs x {s} positions, vocab {v}; HF made on {meta.get('device_name')} "
          f"(torch {meta.get('versions', {}).get('torch')}, transformers {meta.get('versions', {}).get('transformers')})")
    hdr = f"{'pair (b vs reference a)':44s} {'max|a-b|':>10s} {'mean|a-b|':>10s} {'top1':>8s} {'top1dec':>8s} {'KLmean':>10s}"
    print(hdr)
    print("-" * len(hdr))
    for k, p in pairs.items():
        print(f"{k:44s} {fmt(p['max_abs_diff']):>10s} {fmt(p['mean_abs_diff']):>10s} "
              f"{fmt(p['top1_agree']):>8s} {fmt(p['top1_agree_decisive']):>8s} {fmt(p['kl_mean']):>10s}")
    print(f"(top1dec: agreement at positions whose f32 top-1/top-2 logit margin > {margin}; "
          f"HF bf16 rerun max|diff| = {meta.get('rerun_max_abs_diff_bf16')})")
    print(f"verdict: {'PASS' if verdict.get('pass') else ('FAIL' if verdict.get('pass') is False else 'n/a')}"
          + (f"  {json.dumps(verdict.get('checks'))}" if verdict.get("checks") else ""))
    print(f"wrote {args.json}")
    if args.strict and verdict.get("pass") is False:
        return 1
    return 0


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    mk = sub.add_parser("make", help="build random checkpoint + ids + HF reference logits")
    mk.add_argument("--config", required=True, help="hub-style config.json (e.g. configs/models/qwen2.5-0.5b.json)")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu (where the HF logits are computed)")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--n-seqs", type=int, default=4)
    mk.add_argument("--seq-len", type=int, default=128)
    mk.add_argument("--init-std", type=float, default=None, help="default: config initializer_range")
    mk.add_argument("--bias-std", type=float, default=0.1)
    mk.add_argument("--no-perturb", action="store_true",
                    help="plain transformers init: zero biases, unit norm weights")
    mk.add_argument("--no-eager", action="store_true", help="skip the eager-attention reference")
    mk.add_argument("--max-shard-size", default=None, help="e.g. 200MB to force a sharded checkpoint")
    mk.add_argument("--margin", type=float, default=0.1, help="logit margin for 'decisive' positions")
    mk.set_defaults(func=cmd_make)

    cp = sub.add_parser("compare", help="compare fleet logits with the HF references")
    cp.add_argument("--dir", required=True, help="the directory `make` wrote")
    cp.add_argument("--fleet", required=True, help="safetensors with tensor 'logits' [n_seqs, seq_len, vocab]")
    cp.add_argument("--json", required=True, help="report path")
    cp.add_argument("--margin", type=float, default=None)
    cp.add_argument("--tol-factor", type=float, default=2.0)
    cp.add_argument("--top1-slack", type=float, default=0.02)
    cp.add_argument("--strict", action="store_true", help="exit 1 when the verdict is FAIL")
    cp.add_argument("--stats-device", default=None, help="where to compute the stats (default: cuda if available)")
    cp.set_defaults(func=cmd_compare)

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
