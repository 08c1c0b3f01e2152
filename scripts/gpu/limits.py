#!/usr/bin/env python3
"""The physical limits of fleet's benchmark workloads on one GPU, from the model shapes in
configs/models/*.json (the limits model of docs/benchmarks.md, "Limits model"; stdlib only).

    python3 scripts/gpu/limits.py examples                 # the worked examples of the docs
    python3 scripts/gpu/limits.py generate --config configs/models/qwen2.5-7b.json \
        --batch 32 [--prompt-len 512 --new-tokens 128]      # fleet bench generate / transformers
    python3 scripts/gpu/limits.py judge --config configs/models/qwen3-vl-8b.json \
        --batch 32 [--image-size 1024 --images 2 --new-tokens 128]   # edit-score bench
    python3 scripts/gpu/limits.py gspo --config configs/models/qwen2.5-0.5b.json \
        --batch 16 [--steps-per-generation 4 --prompt-len 147 --new-tokens 256]
    (--gpu h200|h100, --json: one JSON object instead of text)

Each workload gets two limits: at the spec (HBM bandwidth, dense bf16 peak) and at a practical
ceiling (the bandwidth a device copy reaches, the rate large cuBLAS GEMMs reach). A step is
bound by the larger of its bytes / bandwidth and its FLOPs / FLOP rate (a roofline per step).

Counting rules (bf16: 2 bytes per weight and per cached K/V element):
  decode step  bytes = the weights a step reads (the body, final norm and lm_head; not the input
               embedding, which is gathered; for a MoE the experts that the batch's rows pick:
               E * (1 - (1 - k/E)^B) of E per layer for uniform routing, which random weights
               give) + the KV cache read (B rows x context x layers x 2 x kv heads x head dim)
  prefill      FLOPs = 2 x active body parameters x tokens + causal attention
               (2 x layers x heads x head dim x s(s+1) per sequence of s) + lm_head for the
               last position only
  vision       per image of P = (size/16)^2 patches: 2 x tower parameters x P (patch embedding,
               27 blocks) + full attention within the image (4 x blocks x hidden x P^2) + the
               main and 3 deepstack mergers on the P/4 merged tokens
  GSPO update  per generation batch of T = rows x (prompt + completion) tokens: old log-probs
               (forward, 2 N T) + training forward (2 N T) + backward (4 N T) + the recompute of
               gradient checkpointing (2 N T) = 10 N T over the body, 8 x lm_head x completion
               tokens (the head is not checkpointed), attention 4x its forward; rollouts =
               prefill + decode as above
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# bytes/s and FLOP/s. Spec: NVIDIA's data sheets (H200 SXM 4.8 TB/s HBM3e, H100 SXM 3.35 TB/s
# HBM3; dense bf16 989.4 TFLOP/s for both, i.e. the 1,979 "with sparsity" figure halved).
# Practical: /work/shared/reference/limits.md: a device-to-device copy on an H200 reaches about
# 4.3 TB/s (read + write counted); candle's cuBLAS GEMMs reached 650-780 TFLOP/s at fleet's
# shapes (docs/benchmarks.md, profiles), so 650 is a ceiling a whole model can plausibly hold.
GPUS = {
    "h200": {"name": "H200 SXM", "bw_spec": 4.8e12, "flops_spec": 989.4e12,
             "bw_practical": 4.3e12, "flops_practical": 650e12, "nvlink_per_direction": 450e9},
    "h100": {"name": "H100 SXM", "bw_spec": 3.35e12, "flops_spec": 989.4e12,
             "bw_practical": 3.0e12, "flops_practical": 650e12, "nvlink_per_direction": 450e9},
}
BYTES = 2  # bf16


def load(path: str) -> dict:
    return json.loads(Path(path).read_text())


class Text:
    """A Qwen2 / Qwen2.5 / Qwen3(-VL) text decoder's shape."""

    def __init__(self, c: dict, model_type: str):
        self.h = c["hidden_size"]
        self.L = c["num_hidden_layers"]
        self.nh = c["num_attention_heads"]
        self.nkv = c.get("num_key_value_heads", self.nh)
        self.hd = c.get("head_dim", self.h // self.nh)
        self.V = c["vocab_size"]
        self.I = c.get("intermediate_size", 0)
        self.tied = bool(c.get("tie_word_embeddings", False))
        qwen2 = model_type.startswith("qwen2")
        q, kv = self.nh * self.hd, self.nkv * self.hd
        self.attn = self.h * q + 2 * self.h * kv + q * self.h
        if c.get("attention_bias", qwen2):
            self.attn += q + 2 * kv
        norms = 2 * self.h + (0 if qwen2 else 2 * self.hd)  # Qwen3: q_norm, k_norm
        self.E = c.get("num_experts", 0)
        if self.E:
            self.k = c["num_experts_per_tok"]
            self.expert = 3 * self.h * c["moe_intermediate_size"]
            self.router = self.h * self.E
            self.layer_fixed = self.attn + norms + self.router
        else:
            self.k, self.expert, self.router = 0, 0, 0
            self.layer_fixed = self.attn + norms + 3 * self.h * self.I
        self.lm_head = self.V * self.h
        self.embed = self.V * self.h

    # parameters one token goes through (FLOPs), without lm_head
    def active_body(self) -> int:
        return self.L * (self.layer_fixed + self.k * self.expert) + self.h

    def total_params(self) -> int:
        body = self.L * (self.layer_fixed + self.E * self.expert) + self.h
        return body + self.embed + (0 if self.tied else self.lm_head)

    def experts_touched(self, rows: int) -> float:
        return self.E * (1 - (1 - self.k / self.E) ** rows) if self.E else 0.0

    def kv_bytes_per_token(self) -> int:
        return self.L * 2 * self.nkv * self.hd * BYTES

    def decode_step(self, rows: int, context: float) -> tuple[float, float]:
        """(bytes, FLOPs) of one decode step of `rows` rows at `context` cached tokens each."""
        weights = self.L * (self.layer_fixed + self.experts_touched(rows) * self.expert) + self.h
        weights += self.lm_head
        by = weights * BYTES + rows * context * self.kv_bytes_per_token()
        fl = rows * (2 * (self.active_body() + self.lm_head)
                     + self.L * 4 * self.nh * self.hd * context)
        return by, fl

    def attention_causal(self, s: int) -> float:
        return 2 * self.L * self.nh * self.hd * s * (s + 1)

    def prefill(self, s: int, head_rows: int = 1) -> float:
        """FLOPs of one sequence's prefill of s tokens, lm_head on `head_rows` positions."""
        return 2 * self.active_body() * s + self.attention_causal(s) + 2 * self.lm_head * head_rows


class Vision:
    """Qwen3-VL's vision tower (the same in the 8B and 30B-A3B checkpoints but for out_hidden)."""

    def __init__(self, c: dict):
        self.D = c["depth"]
        self.hv = c["hidden_size"]
        self.Iv = c["intermediate_size"]
        self.p = c["patch_size"]
        self.m = c["spatial_merge_size"]
        self.inp = 3 * c.get("temporal_patch_size", 2) * self.p * self.p
        self.out = c["out_hidden_size"]
        self.deepstack = len(c.get("deepstack_visual_indexes", []))
        self.block = self.hv * 3 * self.hv + self.hv * self.hv + 2 * self.hv * self.Iv
        mh = self.hv * self.m * self.m
        self.merger = mh * mh + mh * self.out

    def patches(self, size: int) -> int:
        # The processor resizes to multiples of patch x merge (32 px); 512 and 1024 stay.
        side = max(self.p * self.m, round(size / (self.p * self.m)) * self.p * self.m)
        return (side // self.p) ** 2

    def flops(self, size: int) -> dict:
        P = self.patches(size)
        linear = 2 * P * (self.inp * self.hv + self.D * self.block)
        attention = 4 * self.D * self.hv * P * P
        mergers = 2 * (P // (self.m * self.m)) * self.merger * (1 + self.deepstack)
        return {"patches": P, "merged_tokens": P // (self.m * self.m), "linear": linear,
                "attention": attention, "mergers": mergers, "total": linear + attention + mergers}


def text_of(cfg: dict) -> Text:
    mt = cfg.get("model_type", "qwen2")
    return Text(cfg.get("text_config", cfg), mt)


def seconds(by: float, fl: float, gpu: dict, kind: str) -> float:
    return max(by / gpu["bw_" + kind], fl / gpu["flops_" + kind])


def decode_time(t: Text, rows: int, context0: float, steps: int, gpu: dict, kind: str) -> float:
    # The context grows by one per step: sum the steps (they are few hundred at most).
    return sum(seconds(*t.decode_step(rows, context0 + i), gpu, kind) for i in range(steps))


def generate(cfg: dict, batch: int, prompt_len: int, new_tokens: int, gpu: dict) -> dict:
    t = text_of(cfg)
    pre = t.prefill(prompt_len)
    by1, _ = t.decode_step(batch, prompt_len + new_tokens / 2)
    out = {"workload": "generate", "batch": batch, "prompt_len": prompt_len,
           "new_tokens": new_tokens, "prefill_gflop_per_token": pre / prompt_len / 1e9,
           "weights_read_per_step_gb": (by1 - batch * (prompt_len + new_tokens / 2)
                                        * t.kv_bytes_per_token()) / 1e9,
           "kv_read_per_step_gb_mean": batch * (prompt_len + new_tokens / 2)
           * t.kv_bytes_per_token() / 1e9}
    for kind in ("spec", "practical"):
        tp = seconds(0, batch * pre, gpu, kind)
        td = decode_time(t, batch, prompt_len + 1, new_tokens - 1, gpu, kind)
        out[kind] = {"prefill_tok_s": batch * prompt_len / tp,
                     "decode_tok_s": batch * (new_tokens - 1) / td,
                     # fleet bench data-parallel: new tokens over prefill + decode
                     "end_to_end_new_tok_s": batch * new_tokens / (tp + td)}
    return out


def judge(cfg: dict, batch: int, image_size: int, images: int, new_tokens: int, gpu: dict) -> dict:
    t = text_of(cfg)
    v = Vision(cfg["vision_config"])
    vf = v.flops(image_size)
    # The prompt of edit-score bench / vl_bench_transformers.py: 24 text tokens, each image as
    # <start> pads <end> + 8 text tokens, 48 text tokens.
    s = 24 + images * (2 + vf["merged_tokens"] + 8) + 48
    text_prefill = t.prefill(s)
    per_sample = images * vf["total"] + text_prefill
    out = {"workload": "judge", "batch": batch, "image_size": image_size, "images": images,
           "prompt_tokens": s, "new_tokens": new_tokens,
           "vision_tflop_per_image": vf["total"] / 1e12,
           "vision_attention_tflop_per_image": vf["attention"] / 1e12,
           "text_prefill_tflop_per_sample": text_prefill / 1e12,
           "prefill_tflop_per_sample": per_sample / 1e12,
           "active_params_b": (t.active_body() + t.lm_head) / 1e9,
           "decode_step_gb": t.decode_step(batch, s + new_tokens / 2)[0] / 1e9}
    if t.E:
        out["experts_touched_per_layer"] = t.experts_touched(batch)
    for kind in ("spec", "practical"):
        tp = seconds(0, batch * per_sample, gpu, kind)
        td = decode_time(t, batch, s + 1, new_tokens - 1, gpu, kind)
        out[kind] = {"prefill_s": tp, "decode_s": td, "samples_per_s": batch / (tp + td)}
    return out


def gspo(cfg: dict, batch: int, steps_per_generation: int, prompt_len: int, new_tokens: int,
         gpu: dict) -> dict:
    t = text_of(cfg)
    rows = batch * steps_per_generation
    T = rows * (prompt_len + new_tokens)
    Tc = rows * new_tokens
    n = t.active_body()
    attn = rows * t.attention_causal(prompt_len + new_tokens)
    old_logp = 2 * n * T + attn + 2 * t.lm_head * Tc
    train = 8 * n * T + 4 * attn + 6 * t.lm_head * Tc
    update = old_logp + train
    roll_prefill = rows * t.prefill(prompt_len)
    out = {"workload": "gspo", "per_device_train_batch_size": batch,
           "rows_per_generation_batch": rows, "tokens_per_generation_batch": T,
           "update_tflop": update / 1e12, "rollout_prefill_tflop": roll_prefill / 1e12,
           "rollout_step_gb": t.decode_step(rows, prompt_len + new_tokens / 2)[0] / 1e9,
           "params_b": t.total_params() / 1e9}
    for kind in ("spec", "practical"):
        tr = seconds(0, roll_prefill, gpu, kind) + decode_time(
            t, rows, prompt_len + 1, new_tokens - 1, gpu, kind)
        tu = seconds(0, update, gpu, kind)
        out[kind] = {"rollout_s": tr, "update_s": tu, "generation_batch_s": tr + tu}
    return out


def examples(gpu: dict) -> dict:
    m = "configs/models/"
    ex = {}
    for b in (1, 32):
        ex[f"7b_generate_b{b}"] = generate(load(m + "qwen2.5-7b.json"), b, 512, 128, gpu)
    ex["72b_generate_b1"] = generate(load(m + "qwen2.5-72b.json"), 1, 512, 128, gpu)
    for shape in ("8b", "30b-a3b"):
        for b in (1, 8, 16, 32, 64):
            for size in (512, 1024):
                ex[f"judge_{shape}_{size}_b{b}"] = judge(load(m + f"qwen3-vl-{shape}.json"), b,
                                                         size, 2, 128, gpu)
    for shape in ("0.5b", "1.5b"):
        ex[f"gspo_{shape}_b16"] = gspo(load(m + f"qwen2.5-{shape}.json"), 16, 4, 147, 256, gpu)
    return ex


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["examples", "generate", "judge", "gspo"])
    ap.add_argument("--config")
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--steps-per-generation", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    gpu = GPUS[a.gpu]
    if a.what == "examples":
        r = examples(gpu)
    else:
        if not a.config:
            sys.exit("--config is required")
        cfg = load(a.config)
        if a.what == "generate":
            r = generate(cfg, a.batch, a.prompt_len or 512, a.new_tokens or 128, gpu)
        elif a.what == "judge":
            r = judge(cfg, a.batch, a.image_size, a.images, a.new_tokens or 128, gpu)
        else:
            r = gspo(cfg, a.batch, a.steps_per_generation, a.prompt_len or 147,
                     a.new_tokens or 256, gpu)
    r = {"gpu": gpu, **r} if a.what != "examples" else {"gpu": gpu, "examples": r}
    if a.json:
        print(json.dumps(r, indent=1))
        return

    def show(d, indent=""):
        for k, v in d.items():
            if isinstance(v, dict):
                print(f"{indent}{k}:")
                show(v, indent + "  ")
            else:
                print(f"{indent}{k}: {v:,.4g}" if isinstance(v, float) and math.isfinite(v)
                      else f"{indent}{k}: {v}")
    show(r)


if __name__ == "__main__":
    main()
