#!/usr/bin/env python3
"""TRL's GRPOTrainer with the GSPO setting, timed, as the reference for gspo-train's benchmark.

    python3 scripts/gpu/trl_gspo_bench.py --model DIR --dataset data.jsonl --out result.json \
        [--steps 16] [--per-device-train-batch-size 16] [--num-generations 8] \
        [--steps-per-generation 4] [--max-completion-length 256] [--gradient-checkpointing 1]

The settings are TRL's documented GSPO setting (docs/source/paper_index.md):
importance_sampling_level="sequence", loss_type="grpo", beta=0, epsilon=3e-4,
epsilon_high=4e-4, gradient_accumulation_steps=1, steps_per_generation=4; transformers'
generation (no vLLM); bf16. The reward is exact match of the last number against the
dataset's "#### n" answer, as fleet's gsm8k_exact (with random weights every reward is 0, so
both trainers do the same work: the loss and its backward run on every micro-batch).

Writes per-step wall times (each optimizer step, synchronized), the time spent generating and
scoring (GRPOTrainer._generate_and_score_completions, synchronized), and torch's peak memory.
"""
import argparse
import json
import re
import time
from pathlib import Path

import torch
from datasets import Dataset
from datasets.table import InMemoryTable
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def exact_match(completions, answer, **kwargs):
    out = []
    for c, a in zip(completions, answer):
        ref = a.split("####")[-1].strip().replace(",", "")
        nums = NUMBER.findall(c)
        out.append(1.0 if nums and nums[-1].replace(",", "") == ref else 0.0)
    return out


class StepTimer(TrainerCallback):
    def __init__(self):
        self.starts, self.times = [], []

    def on_step_begin(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self.starts.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.starts[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--per-device-train-batch-size", type=int, default=16)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--steps-per-generation", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=256)
    ap.add_argument("--gradient-checkpointing", type=int, default=1)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    rows = [json.loads(l) for l in Path(args.dataset).read_text().splitlines() if l.strip()]
    # An explicit fingerprint: hashing the table with dill fails on the GPU machine's Python
    # 3.12 (pyarrow's MonthDayNano); the dataset is not cached anyway.
    table = InMemoryTable.from_pylist([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    dataset = Dataset(table, fingerprint="gspo-bench-prompts")
    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda()
    load_s = time.perf_counter() - t0
    config = GRPOConfig(
        output_dir="/tmp/trl_gspo_out",
        importance_sampling_level="sequence",
        loss_type="grpo",
        beta=0.0,
        epsilon=3e-4,
        epsilon_high=4e-4,
        gradient_accumulation_steps=1,
        steps_per_generation=args.steps_per_generation,
        per_device_train_batch_size=args.per_device_train_batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        learning_rate=1e-6,
        bf16=True,
        gradient_checkpointing=bool(args.gradient_checkpointing),
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        use_vllm=False,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[exact_match],
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[timer],
    )
    gen_times = []
    inner = trainer._generate_and_score_completions

    def timed(*a, **kw):
        torch.cuda.synchronize()
        s = time.perf_counter()
        r = inner(*a, **kw)
        torch.cuda.synchronize()
        gen_times.append(time.perf_counter() - s)
        return r

    trainer._generate_and_score_completions = timed
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "loss" in h or "reward" in h]
    result = {
        "engine": "trl",
        "trl_version": __import__("trl").__version__,
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "model": args.model,
        "parameters": sum(p.numel() for p in model.parameters()),
        "settings": vars(args),
        "load_seconds": load_s,
        "wall_seconds": wall,
        "step_seconds": timer.times,
        "generate_and_score_seconds": gen_times,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "log": logs,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("log", "step_seconds")}))


if __name__ == "__main__":
    main()
