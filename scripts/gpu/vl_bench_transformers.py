#!/usr/bin/env python3
"""transformers' judge throughput on random weights of a Qwen3-VL shape, measured as
`edit-score bench` measures fleet: samples of IMAGES square images plus text (the same token
ids), preprocessed with transformers' default image processor for the checkpoint, prefilled and
greedily decoded for exactly NEW_TOKENS tokens, in batches; samples/s over the timed samples
after one warm-up batch, counting preprocessing and generation (not the drawing of the images,
as fleet's bench). --prefill: also one prefill alone per batch size (`prefill_s`).

  python3 scripts/gpu/vl_bench_transformers.py --config configs/models/qwen3-vl-8b.json \
      --image-size 512 --batch 8,16,32 --samples-per-batch 2 --new-tokens 128 --json out.json

--batch takes a comma list: the model is built once and every batch size is measured in turn
(warm-up batch, then the timed batches), each with the peak memory reset. A batch that runs out
of memory is recorded as {"batch": B, "error": "OOM: ..."} (any other failure with its own
message, never as OOM); with --stop-at-oom the ones after the first failure are not tried
(the search for the best batch that fits: run_vl.sh BEST=1). The report
has the settings at the top level and one entry per batch in "runs"; with a single batch its
figures are also copied to the top level, as before.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RELEASED_PROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
}


def image(size: int, sample: int, k: int):
    import numpy as np
    from PIL import Image

    s = sample * 31 + k * 17
    y, x = np.mgrid[0:size, 0:size]
    img = np.stack([(x * 255 // size + s) % 256, (y * 255 // size + 3 * s) % 256,
                    ((x // 8 + y // 8 + s) % 2) * 200], axis=-1).astype(np.uint8)
    return Image.fromarray(img)


def prompt_ids(cfg, pads: list[int], sample: int) -> list[int]:
    span = min(cfg.text_config.vocab_size, 151643) - 100
    text = lambda n, salt: [(salt * 7919 + i * 104729) % span for i in range(n)]  # noqa: E731
    ids = text(24, sample)
    for k, n in enumerate(pads):
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]
        ids += text(8, sample + k + 1)
    return ids + text(48, sample + 99)


def main() -> None:
    import tempfile

    import torch
    import transformers
    from transformers import (AutoConfig, AutoImageProcessor, Qwen3VLForConditionalGeneration,
                              Qwen3VLMoeForConditionalGeneration)

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--images-per-sample", type=int, default=2)
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    p.add_argument("--samples", type=int, default=None,
                   help="timed samples per batch size (default: --samples-per-batch batches)")
    p.add_argument("--samples-per-batch", type=int, default=2,
                   help="timed batches per batch size when --samples is not given")
    p.add_argument("--stop-at-oom", action="store_true",
                   help="stop at the first batch size that fails (out of memory or otherwise)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--prefill", action="store_true",
                   help="also time one prefill alone per batch size (on the warm-up batch)")
    p.add_argument("--profile-prefill", metavar="PATH",
                   help="with --prefill: run that prefill under torch.profiler and write its CUDA "
                        "kernels, summed by name, to PATH.<batch>.txt (fleet's side: "
                        "scripts/gpu/profile_stage.sh)")
    p.add_argument("--json")
    a = p.parse_args()

    cfg = AutoConfig.from_pretrained(a.config)
    cfg._attn_implementation = a.attn
    moe = cfg.model_type == "qwen3_vl_moe"
    cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    t = time.time()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls._from_config(cfg, dtype=torch.bfloat16).eval()
    torch.cuda.synchronize()
    load_s = time.time() - t
    d = tempfile.mkdtemp()
    Path(d, "preprocessor_config.json").write_text(json.dumps(RELEASED_PROCESSOR))
    ip = AutoImageProcessor.from_pretrained(d)  # transformers' default backend

    def batch(first: int, bsz: int):
        # The images are drawn before the clock starts (a judge reads them from files), as in
        # fleet's bench.
        imgs = [image(a.image_size, s, k) for s in range(first, first + bsz)
                for k in range(a.images_per_sample)]
        t = time.time()
        px = ip(images=imgs, return_tensors="pt")
        grid = px["image_grid_thw"].tolist()
        rows = []
        for s in range(bsz):
            g = grid[s * a.images_per_sample:(s + 1) * a.images_per_sample]
            rows.append(prompt_ids(cfg, [t_ * h * w // 4 for t_, h, w in g], first + s))
        L = max(len(r) for r in rows)
        pad = cfg.text_config.eos_token_id if isinstance(cfg.text_config.eos_token_id, int) else 0
        ids = torch.tensor([[pad] * (L - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows])
        mm = (ids == cfg.image_token_id).long()
        kw = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), mm_token_type_ids=mm.cuda(),
                  pixel_values=px["pixel_values"].cuda(), image_grid_thw=px["image_grid_thw"].cuda())
        return kw, time.time() - t, len(rows[0]), sum(t_ * h * w // 4 for t_, h, w in grid[:a.images_per_sample])

    def run(kw):
        with torch.no_grad():
            out = model.generate(**kw, do_sample=False, max_new_tokens=a.new_tokens,
                                 min_new_tokens=a.new_tokens, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        assert out.shape[1] - kw["input_ids"].shape[1] == a.new_tokens
        return out

    def profile_prefill(kw, path: str):
        # One more prefill under the profiler (after the timed one, so its overhead is not in
        # prefill_s): the CUDA kernels by total device time, as kernel_times.py sums fleet's.
        from torch.profiler import ProfilerActivity, profile
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(**kw, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        events.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events)
        lines = [f"# transformers prefill, kernels by device time: {total / 1e3:.1f} ms in all",
                 f"{'ms':>9} {'%':>6} {'calls':>6}  kernel"]
        for e in events[:60]:
            lines.append(f"{e.device_time_total / 1e3:9.2f} {100 * e.device_time_total / total:6.2f} "
                         f"{e.count:6d}  {e.key[:160]}")
        Path(path).write_text("\n".join(lines) + "\n")
        print("\n".join(lines[:25]), flush=True)

    def measure(bsz: int) -> dict:
        kw, _, prompt_len, image_tokens = batch(1_000_000, bsz)
        run(kw)  # warm-up
        prefill = None
        if a.prefill:
            # The prefill alone (vision tower and text, the last position's logits, as
            # generate() runs it), once on the warm-up batch: fleet's bench reports its own.
            torch.cuda.synchronize()
            t = time.time()
            with torch.no_grad():
                model(**kw, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            prefill = time.time() - t
            print(f"batch size {bsz}: prefill {prefill:.3f}s", flush=True)
            if a.profile_prefill:
                profile_prefill(kw, f"{a.profile_prefill}.{bsz}.txt")
        del kw
        torch.cuda.reset_peak_memory_stats()
        samples = a.samples if a.samples else bsz * a.samples_per_batch
        batches = -(-samples // bsz)
        pre = gen = 0.0
        for b in range(batches):
            kw, tp, _, _ = batch(b * bsz, bsz)
            t = time.time()
            run(kw)
            tg = time.time() - t
            del kw
            pre += tp
            gen += tg
            print(f"batch size {bsz}: batch {b + 1}/{batches}: preprocess {tp:.3f}s "
                  f"generate {tg:.3f}s", flush=True)
        # A judge's work: preprocessing and generation, not the drawing of the images (before
        # 2026-11-28 the total also counted the drawing, ~66 ms an image at 1024 px: that
        # understated transformers' samples/s, by a third at batch 64).
        total = pre + gen
        return {"batch": bsz, "samples": batches * bsz, "total_s": total,
                "samples_per_s": batches * bsz / total, "preprocess_s": pre / batches,
                "generate_s": gen / batches, "prefill_s": prefill,
                "image_tokens_per_sample": image_tokens, "prompt_tokens_per_sample": prompt_len,
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved()}

    runs = []
    for bsz in [int(x) for x in str(a.batch).split(",") if x.strip()]:
        try:
            r = measure(bsz)
            print(f"batch size {bsz}: {r['samples_per_s']:.3f} samples/s", flush=True)
        except torch.cuda.OutOfMemoryError as e:
            r = {"batch": bsz, "error": f"OOM: {str(e).splitlines()[0]}"}
            print(f"batch size {bsz}: {r['error']}", flush=True)
        except Exception as e:  # recorded, not hidden: a failure is not an out-of-memory
            r = {"batch": bsz, "error": f"{type(e).__name__}: {e}"}
            print(f"batch size {bsz}: {r['error']}", flush=True)
        runs.append(r)
        if a.json:  # after every batch size: a later one that hangs or is killed loses nothing
            Path(a.json).write_text(json.dumps({"partial": True, "config": a.config,
                                                "image_size": a.image_size,
                                                "images_per_sample": a.images_per_sample,
                                                "new_tokens": a.new_tokens, "runs": runs}, indent=2))
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        if "error" in r and a.stop_at_oom:
            break
    rep = {
        "engine": "transformers", "transformers": transformers.__version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0), "config": a.config, "attn": a.attn,
        "image_processor": type(ip).__name__, "dtype": "bf16", "image_size": a.image_size,
        "images_per_sample": a.images_per_sample, "new_tokens": a.new_tokens, "load_s": load_s,
        "runs": runs,
    }
    if len(runs) == 1 and "error" not in runs[0]:
        rep.update(runs[0])
    print(json.dumps(rep, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=2))
    if any("error" in r for r in runs):
        raise SystemExit(3)


if __name__ == "__main__":
    main()
