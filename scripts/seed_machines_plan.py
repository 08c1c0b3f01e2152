#!/usr/bin/env python3
"""The GSPO seed's machines (3 x 16 GB, 3 x 8 GB), planned by gspo-train before loading.

For each machine (a topology file of logical devices on one H200), model shape, master dtype
and the seed's layouts (1gpu, 2gpu, 3gpu) the largest per_device_train_batch_size whose plan
fits (see GROUPS for why one group size). gspo-train --plan only: no GPU, no weights (the
shapes' config.json beside a tokenizer), so it runs on any machine; the GPU call then trains
the chosen settings on capped logical devices and records their real peaks
(scripts/gpu/run_seed_machines.sh).

The settings are the seed's: the policy, its reference model (beta 0.04) and a Qwen2.5-0.5B
reward model; configs/gspo/bench.toml's lengths (256 new tokens, ~154-token prompts from
scripts/gpu/make_gspo_prompts.py) and steps_per_generation 4.

    python3 scripts/seed_machines_plan.py --gspo-train target/release/gspo-train \
        --out benchmarks/results/<dir>/plans.json
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MACHINES = {
    "3x16GB": "configs/topologies/gspo-3x16gb-on-h200.toml",
    "3x8GB": "configs/topologies/gspo-3x8gb-on-h200.toml",
}
SHAPES = ["0.5b", "1.5b", "7b"]
MASTERS = ["float32", "bfloat16"]
LAYOUTS = ["1gpu", "2gpu", "3gpu"]
# The group size does not enter the memory given the batch: a rollout is
# per_device_train_batch_size x steps_per_generation sequences whatever G is (G only splits them
# into prompts), so one G is planned (the bench setting's 8).
GROUPS = [8]
BATCHES = [256, 128, 64, 32, 16, 8, 4, 2, 1]


def shape_dir(work, name, classifier=False):
    d = os.path.join(work, ("rm" if classifier else "q") + name)
    if os.path.isdir(d):
        return d
    os.makedirs(d)
    cfg = json.load(open(os.path.join(ROOT, f"configs/models/qwen2.5-{name}.json")))
    if classifier:
        cfg["architectures"] = [cfg["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
        cfg.update(num_labels=1, pad_token_id=cfg.get("eos_token_id"))
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ROOT, "tests/fixtures/qwen2-tiny", f), d)
    return d


def plan(bin_, topology, config, model, dataset, layout, masters, g, b):
    cmd = [bin_, "--plan", "--topology", os.path.join(ROOT, topology), "--config", config,
           "--model", model, "--dataset", dataset, "--gpu-mode", layout, "--dtype", "bf16",
           "--torch-dtype", masters, "--set", f"num_generations={g}",
           "--set", f"per_device_train_batch_size={b}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    text = p.stdout + p.stderr
    totals = {m.group(1): m.group(2) for m in re.finditer(r"^(cuda:\d+): total (\S+ \S+) of budget", text, re.M)}
    return p.returncode == 0, totals, text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gspo-train", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="seed_plans_")
    dataset = os.path.join(work, "prompts.jsonl")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts/gpu/make_gspo_prompts.py"),
                    "--out", dataset, "--n", "256"], check=True, capture_output=True)
    config = os.path.join(work, "seed.toml")
    bench = open(os.path.join(ROOT, "configs/gspo/bench.toml")).read()
    bench = bench.replace("\nbeta = 0.0\n", "\nbeta = 0.04\n")
    bench += f'\n[[reward_funcs]]\nname = "reward_model"\nweight = 1.0\nmodel = "{shape_dir(work, "0.5b", True)}"\n'
    open(config, "w").write(bench)
    rows = []
    for machine, topology in MACHINES.items():
        for shape in SHAPES:
            model = shape_dir(work, shape)
            for masters in MASTERS:
                for layout in LAYOUTS:
                    row = {"machine": machine, "shape": shape, "masters": masters, "layout": layout,
                           "largest_batch": {}, "plan_totals": {}}
                    for g in GROUPS:
                        for b in BATCHES:
                            ok, totals, text = plan(args.gspo_train, topology, config, model, dataset,
                                                    layout, masters, g, b)
                            if ok:
                                row["largest_batch"][str(g)] = b
                                row["plan_totals"][str(g)] = totals
                                break
                        else:
                            row["largest_batch"][str(g)] = None
                            row.setdefault("why_not", {})[str(g)] = text.strip().splitlines()[-1][:400]
                    rows.append(row)
                    print(machine, shape, masters, layout, row["largest_batch"], flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    json.dump({"groups": GROUPS, "batches_tried": BATCHES, "rows": rows}, open(args.out, "w"), indent=1)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
