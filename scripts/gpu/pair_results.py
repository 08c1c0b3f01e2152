#!/usr/bin/env python3
"""Pair fleet's and the reference engine's rows of one device call at the same batch, with each
engine's best batch and the physical limit of the work (scripts/gpu/limits.py).

    python3 scripts/gpu/pair_results.py generate DIR   # run_foundation.sh: fleet bench generate
                                                       # vs benches/transformers_generate.py
    python3 scripts/gpu/pair_results.py judge DIR      # run_vl.sh: edit-score bench vs
                                                       # vl_bench_transformers.py
    python3 scripts/gpu/pair_results.py gspo DIR       # run_gspo_vs_trl.sh: gspo-train vs TRL

Writes DIR/pairs.json and DIR/pairs.md and prints the Markdown. Rows are paired only when both
engines ran that batch in the files of DIR (one device call). A batch an engine could not run is
listed with the reason the script recorded in DIR/search.tsv (engine, key, batch, status, note;
status is ok, oom, no-fit, error, timeout or skipped): "oom" only where the engine's own log
said so, "no-fit" where fleet's memory plan refused the batch before loading.

"Best batch" is the measured batch with the highest throughput among those that ran; how the
search for it ended (the first batch that ran out of memory, the cap, or no search at all) is
stated beside it: a best batch below a cap that never ran out of memory is a lower bound.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import limits  # noqa: E402


def read_search(d: Path) -> list[dict]:
    rows = []
    p = d / "search.tsv"
    if p.exists():
        for line in p.read_text().splitlines():
            f = line.split("\t")
            if len(f) >= 4 and f[2].isdigit():
                rows.append({"engine": f[0], "key": f[1], "batch": int(f[2]), "status": f[3],
                             "note": f[4] if len(f) > 4 else ""})
    return rows


def search_end(search: list[dict], engine: str, key: str, searched: bool) -> str:
    bad = sorted((r for r in search if r["engine"] == engine and r["key"] == key
                  and r["status"] != "ok"), key=lambda r: r["batch"])
    if bad:
        r = bad[0]
        what = {"oom": "ran out of memory", "timeout": "hit its time limit",
                "no-fit": "was refused by fleet's memory plan (does not fit)",
                "skipped": "was not run (time budget)"}.get(r["status"], "failed")
        return f"batch {r['batch']} {what}" + (f" ({r['note']})" if r["note"] else "")
    return "no failure up to the largest batch tried (a lower bound)" if searched else "not searched"


def pct(x, lim):
    return None if x is None or not lim else 100.0 * x / lim


def fmt(x, nd=2):
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    return f"{x:,.{nd}f}"


def pairs_table(rows: list[dict], metric: str, unit: str) -> list[str]:
    out = ["| " + " | ".join(["what", "batch", "fleet " + unit, "reference " + unit,
                              "fleet / reference", "limit (spec / practical)",
                              "fleet % of limit (spec / practical)",
                              "reference % of limit (spec / practical)"]) + " |",
           "|" + "---|" * 8]
    for r in rows:
        f, ref = r["fleet"].get(metric), r["reference"].get(metric)
        ls, lp = r["limit"]["spec"], r["limit"]["practical"]
        out.append("| " + " | ".join([
            r["key"], str(r["batch"]), fmt(f), fmt(ref),
            f"{f / ref:.2f}x" if f and ref else "–",
            f"{fmt(ls)} / {fmt(lp)}",
            f"{fmt(pct(f, ls), 1)}% / {fmt(pct(f, lp), 1)}%" if f else "–",
            f"{fmt(pct(ref, ls), 1)}% / {fmt(pct(ref, lp), 1)}%" if ref else "–"]) + " |")
    return out


def best_lines(best: dict, unit: str) -> list[str]:
    out = ["| what | engine | best batch | " + unit + " | limit at that batch (spec / practical) "
           "| % of limit | how the search ended |", "|---|---|---|---|---|---|---|"]
    for key, engines in best.items():
        for eng, b in engines.items():
            if b.get("batch") is None:
                out.append(f"| {key} | {eng} | – | – | – | – | {b['search']} |")
                continue
            label = str(b["batch"]) + (" (best of the list; not searched)"
                                       if b["search"] == "not searched" else "")
            out.append(f"| {key} | {eng} | {label} | {fmt(b['value'])} | {fmt(b['limit']['spec'])} / "
                       f"{fmt(b['limit']['practical'])} | {fmt(pct(b['value'], b['limit']['spec']), 1)}% / "
                       f"{fmt(pct(b['value'], b['limit']['practical']), 1)}% | {b['search']} |")
    return out


def gpu_of(d: Path) -> dict:
    """The GPU the call ran on, from the nvidia-smi output the scripts save beside their
    results (nvidia-smi*.txt, or run_foundation.sh's env.json): H100 or H200. FLEET_GPU
    (h100 or h200) names it where no such file is there; without either this is an error,
    not a guess (a guess once put an H200's limits under an H100's figures)."""
    for f in sorted(d.glob("nvidia-smi*.txt")) + sorted(d.glob("env.json")):
        text = f.read_text(errors="replace")
        if "H100" in text:
            return limits.GPUS["h100"]
        if "H200" in text:
            return limits.GPUS["h200"]
    named = os.environ.get("FLEET_GPU", "").lower()
    if named in limits.GPUS:
        return limits.GPUS[named]
    sys.exit(f"{d}: no nvidia-smi*.txt or env.json naming an H100 or H200; save nvidia-smi's "
             "output there or set FLEET_GPU=h100|h200")


def finish(d: Path, kind: str, metric: str, unit: str, rows: list, best: dict, meta: dict,
           about: str = "") -> None:
    g = gpu_of(d)
    md = [f"# {kind}: fleet and the reference at the same batch ({d.name})", "",
          f"Throughput in {unit}{'; ' + about if about else ''}. Limits from "
          f"scripts/gpu/limits.py for the {g['name']} this call ran on (spec: HBM bandwidth "
          f"{g['bw_spec'] / 1e12:.2f} TB/s and dense bf16 {g['flops_spec'] / 1e12:.0f} TFLOP/s; "
          f"practical: {g['bw_practical'] / 1e12:.1f} TB/s and "
          f"{g['flops_practical'] / 1e12:.0f} TFLOP/s).", ""]
    md += pairs_table(rows, metric, unit) + ["", "Each engine's best batch in this call:", ""]
    md += best_lines(best, unit)
    failed = [r for r in read_search(d) if r["status"] != "ok"]
    if failed:
        md += ["", "Batches that did not run to the end (search.tsv):", "",
               "| engine | what | batch | status | note |", "|---|---|---|---|---|"]
        md += [f"| {r['engine']} | {r['key']} | {r['batch']} | {r['status']} | {r['note']} |"
               for r in failed]
    meta = {**meta, "not_run": failed}
    (d / "pairs.json").write_text(json.dumps({"kind": kind, "metric": metric, "unit": unit,
                                              "gpu": g["name"], **meta,
                                              "pairs": rows, "best": best}, indent=1))
    (d / "pairs.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def best_of(runs: dict, metric: str):
    ok = {b: r for b, r in runs.items() if r.get(metric)}
    if not ok:
        return None
    b = max(ok, key=lambda k: ok[k][metric])
    return b, ok[b][metric]


# ---------------------------------------------------------------- generate (7B decode)
def generate(d: Path) -> None:
    search = read_search(d)
    fleet, ref, cfg, meta = {}, {}, None, {}
    for f in sorted(glob.glob(str(d / "bench_fleet*.json"))):
        j = json.loads(Path(f).read_text())
        cfg = cfg or j.get("config")
        meta.setdefault("fleet_commit", j.get("commit"))
        meta.setdefault("prompt_len", j.get("prompt_len"))
        meta.setdefault("new_tokens", j.get("new_tokens"))
        for r in j.get("runs", []):
            fleet[r["batch"]] = r
    for f in sorted(glob.glob(str(d / "bench_transformers*.json"))):
        j = json.loads(Path(f).read_text())
        cfg = cfg or j.get("config")
        meta.setdefault("transformers", j.get("transformers_version"))
        for r in j.get("runs", []):
            if "error" in r:
                continue
            ref[r["batch"]] = r
    if not cfg:
        sys.exit(f"no bench_fleet*.json or bench_transformers*.json in {d}")
    c = limits.load(cfg)
    gpu = gpu_of(d)
    P, N = meta.get("prompt_len") or 512, meta.get("new_tokens") or 128
    rows = []
    for metric in ("decode_tok_s", "prefill_tok_s"):
        for b in sorted(set(fleet) & set(ref)):
            lim = limits.generate(c, b, P, N, gpu)
            rows.append({"key": metric, "batch": b,
                         "fleet": {"value": fleet[b][metric]}, "reference": {"value": ref[b][metric]},
                         "limit": {k: lim[k][metric] for k in ("spec", "practical")}})
    best = {}
    searched = os.environ.get("BEST_SEARCHED", "0") == "1" or any(r["key"] == "best" for r in search)
    for metric in ("decode_tok_s", "prefill_tok_s"):
        best[metric] = {}
        for eng, runs in (("fleet", fleet), ("transformers", ref)):
            bb = best_of(runs, metric)
            end = search_end(search, eng, "best", searched)
            if bb is None:
                best[metric][eng] = {"batch": None, "search": end}
                continue
            lim = limits.generate(c, bb[0], P, N, gpu)
            best[metric][eng] = {"batch": bb[0], "value": bb[1], "search": end,
                                 "limit": {k: lim[k][metric] for k in ("spec", "practical")}}
    finish(d, "generate", "value", "tok/s", rows, best, {"config": cfg, **meta},
           "decode_tok_s and prefill_tok_s as benches/README.md defines them")


# ---------------------------------------------------------------- judge (Qwen3-VL)
def judge(d: Path) -> None:
    search = read_search(d)
    runs = {}  # (shape-size key, engine) -> {batch: report}
    cfgs = {}
    for f in sorted(glob.glob(str(d / "fleet-*-b*.json"))):
        if f.endswith("-profile.json"):
            continue
        j = json.loads(Path(f).read_text())
        key = f"{Path(j['config']).stem}@{j['image_size']}px"
        cfgs[key] = j
        runs.setdefault((key, "fleet"), {})[j["batch"]] = j
    for f in sorted(glob.glob(str(d / "hf-*.json"))):
        j = json.loads(Path(f).read_text())
        key = f"{Path(j['config']).stem}@{j['image_size']}px"
        cfgs.setdefault(key, j)
        for r in j.get("runs", [j]):
            if "error" in r or "samples_per_s" not in r:
                continue
            runs.setdefault((key, "transformers"), {})[r["batch"]] = r
    gpu = gpu_of(d)
    rows, best = [], {}
    for key, j in sorted(cfgs.items()):
        c = limits.load(j["config"])
        size, imgs, N = j["image_size"], j.get("images_per_sample", 2), j.get("new_tokens", 128)
        fl, tr = runs.get((key, "fleet"), {}), runs.get((key, "transformers"), {})
        for b in sorted(set(fl) & set(tr)):
            lim = limits.judge(c, b, size, imgs, N, gpu)
            rows.append({"key": key, "batch": b, "fleet": {"samples_per_s": fl[b]["samples_per_s"]},
                         "reference": {"samples_per_s": tr[b]["samples_per_s"]},
                         "limit": {k: lim[k]["samples_per_s"] for k in ("spec", "practical")}})
        best[key] = {}
        for eng, rr in (("fleet", fl), ("transformers", tr)):
            searched = any(s["engine"] == eng and s["key"] == f"best:{key}" for s in search)
            end = search_end(search, eng, f"best:{key}", searched)
            bb = best_of(rr, "samples_per_s")
            if bb is None:
                best[key][eng] = {"batch": None, "search": end}
                continue
            lim = limits.judge(c, bb[0], size, imgs, N, gpu)
            best[key][eng] = {"batch": bb[0], "value": bb[1], "search": end,
                              "limit": {k: lim[k]["samples_per_s"] for k in ("spec", "practical")}}
    finish(d, "judge", "samples_per_s", "samples/s", rows, best, {})


# ---------------------------------------------------------------- gspo (gspo-train vs TRL)
VARIANTS = ("fleet", "fleet-bf16", "fleet-bf16-mb8", "fleet-bf16-auto", "fleet-lora", "fleet-bf16-lora",
            "fleet-bf16-release", "fleet-bf16-steps1", "fleet-bf16-packed")  # -release: a measured A/B of 2026-11-27 (the pool keeping freed blocks)


def gspo(d: Path) -> None:
    search = read_search(d)
    per_gen = int(os.environ.get("STEPS_PER_GENERATION", "4"))
    # Generation batches left out as warm-up, the same for both engines. TRL's second batch was
    # still its slowest timed one in every stored run (10-25% above its later ones) where
    # fleet's second equalled its third, so one left out flattered fleet; 2 since 2026-11-28.
    # A run with fewer batches keeps its last (recorded as `warmup_batches`).
    warmup = int(os.environ.get("WARMUP_GENERATION_BATCHES", "2"))
    report, rows, best, steps_md = {}, [], {}, []
    gpu = gpu_of(d)
    table = {}
    for n in sorted(glob.glob(str(d / "*.metrics.jsonl"))):
        name = Path(n).name[: -len(".metrics.jsonl")]
        variant, shape, b = split_name(name)
        if variant is None:
            continue
        m = [json.loads(x) for x in Path(n).read_text().splitlines() if x.strip()]
        if not m:
            continue
        batches = {}
        for r in m:
            g = batches.setdefault(r["generation_batch"], {"total": 0.0, "gen": 0.0, "score": 0.0,
                                                            "update": 0.0, "tokens": r["num_tokens"]})
            # The step's wall time: its phases (equal to step_time in metrics written before
            # step_time left out the optimizer update; the sum holds either way).
            g["total"] += r["generation_seconds"] + r["scoring_seconds"] + r["update_seconds"]
            g["gen"] += r["generation_seconds"]
            g["score"] += r["scoring_seconds"]
            g["update"] += r["update_seconds"]
        ordered = [v for _, v in sorted(batches.items())]
        if len(ordered) < 2:
            continue
        w = min(warmup, len(ordered) - 1)
        later = ordered[w:]
        med = lambda k: statistics.median(x[k] for x in later)  # noqa: E731
        first_tokens = ordered[0]["tokens"]
        # Medians over the timed batches, each phase on its own.
        row = {"seconds_per_generation_batch": med("total"), "generation": med("gen"),
               "scoring": med("score"), "update": med("update"), "batches": len(later),
               "warmup_batches": w, "rows": b * per_gen,
               "tokens_first_generation_batch": first_tokens}
        # The optimizer step alone: the median of the steps after the warm-up batches that did
        # not generate (what TRL's figure below measures too).
        timed = set(sorted(batches)[w:])
        plain = [r["update_seconds"] for r in m
                 if r["generation_batch"] in timed and r["generation_seconds"] == 0]
        if plain:
            row["update_step_median"] = statistics.median(plain)
        row["completions_per_s"] = row["rows"] / row["seconds_per_generation_batch"]
        mem = d / f"{name}.mem.json"
        if mem.exists():
            row.update(json.loads(mem.read_text()))
        table.setdefault(shape, {}).setdefault(b, {})[variant] = row
    for n in sorted(glob.glob(str(d / "trl-*.json"))):
        name = Path(n).name[: -len(".json")]
        if name.endswith(".mem"):
            continue
        variant, shape, b = split_name(name)
        if variant != "trl":
            continue
        t = json.loads(Path(n).read_text())
        steps = t["step_seconds"]
        all_gens = [sum(steps[i:i + per_gen]) for i in range(0, len(steps), per_gen)]
        if len(all_gens) < 2:
            continue
        w = min(warmup, len(all_gens) - 1)
        gens = all_gens[w:]
        gs = t["generate_and_score_seconds"][w:]
        total = statistics.median(gens)
        row = {"seconds_per_generation_batch": total,
               "generation_and_scoring": statistics.median(gs) if gs else 0.0,
               "batches": len(gens), "warmup_batches": w, "rows": b * per_gen,
               "peak_allocated_bytes": t["peak_allocated_bytes"],
               "peak_reserved_bytes": t["peak_reserved_bytes"],
               "versions": {k: t[k] for k in ("trl_version", "transformers_version", "torch_version")}}
        # The update per generation batch as total minus generation: its first step also
        # carries whatever TRL does around generating (in some batches more than a second), so
        # the optimizer step is compared by the median of the steps that did not generate.
        row["update"] = total - row["generation_and_scoring"]
        plain = [x for i, x in enumerate(steps) if i >= w * per_gen and i % per_gen != 0]
        if plain:
            row["update_step_median"] = statistics.median(plain)
        row["completions_per_s"] = row["rows"] / total
        mem = d / f"{name}.mem.json"
        if mem.exists():
            row.update(json.loads(mem.read_text()))
        table.setdefault(shape, {}).setdefault(b, {})["trl"] = row
    for shape, bs in sorted(table.items()):
        c = limits.load(f"configs/models/qwen2.5-{shape}.json")
        report[shape] = {}
        for b, row in sorted(bs.items()):
            prompt = 147
            for v in VARIANTS:
                if v in row and row[v].get("tokens_first_generation_batch"):
                    prompt = round(row[v]["tokens_first_generation_batch"] / (b * per_gen)) - 256
                    break
            lim = limits.gspo(c, b, per_gen, prompt, 256, gpu)
            limit_cps = {k: b * per_gen / lim[k]["generation_batch_s"] for k in ("spec", "practical")}
            row["limit"] = {"prompt_tokens": prompt, "update_tflop": lim["update_tflop"],
                            "rollout_step_gb": lim["rollout_step_gb"],
                            **{k: lim[k] for k in ("spec", "practical")},
                            "completions_per_s": limit_cps}
            for v in VARIANTS:
                if v in row and "trl" in row:
                    row[f"speedup_{v}"] = (row["trl"]["seconds_per_generation_batch"]
                                           / row[v]["seconds_per_generation_batch"])
                    if row[v].get("update_step_median") and row["trl"].get("update_step_median"):
                        row[f"update_step_speedup_{v}"] = (row["trl"]["update_step_median"]
                                                          / row[v]["update_step_median"])
                        steps_md.append(
                            f"| {shape} {v} | {b} | {row[v]['update_step_median']:.3f} | "
                            f"{row['trl']['update_step_median']:.3f} | "
                            f"{row[f'update_step_speedup_{v}']:.2f}x |")
                    if row[v].get("peak_mib") and row["trl"].get("peak_mib"):
                        row[f"memory_ratio_{v}_over_trl"] = row[v]["peak_mib"] / row["trl"]["peak_mib"]
                    rows.append({"key": f"{shape} {v}", "batch": b,
                                 "fleet": {"completions_per_s": row[v]["completions_per_s"]},
                                 "reference": {"completions_per_s": row["trl"]["completions_per_s"]},
                                 "limit": limit_cps})
            report[shape][b] = row
        best[shape] = {}
        for eng in ("trl",) + VARIANTS:
            rr = {b: row[eng] for b, row in bs.items() if eng in row}
            searched = any(s["engine"] == eng and s["key"] == f"best:{shape}" for s in search)
            end = search_end(search, eng, f"best:{shape}", searched)
            bb = best_of(rr, "completions_per_s")
            if bb is None:
                if searched or eng == "trl" or eng == "fleet":
                    best[shape][eng] = {"batch": None, "search": end}
                continue
            best[shape][eng] = {"batch": bb[0], "value": bb[1], "search": end,
                                "limit": bs[bb[0]]["limit"]["completions_per_s"]}
    (d / "gspo_vs_trl.json").write_text(json.dumps(report, indent=1))
    finish(d, "gspo", "completions_per_s", "completions/s", rows, best, {},
           "rows of a generation batch / its seconds; batch = per_device_train_batch_size, "
           f"{per_gen} micro-batches per generation batch")
    if steps_md:
        md = ["", f"The optimizer step alone (seconds, the median of the steps after {warmup} "
              "warm-up generation batches that did not generate):", "",
              "| what | batch | fleet | TRL | TRL / fleet |", "|---|---|---|---|---|"] + steps_md
        with open(d / "pairs.md", "a") as f:
            f.write("\n".join(md) + "\n")
        print("\n".join(md))


def split_name(name: str):
    """'fleet-bf16-0.5b-b16' -> ('fleet-bf16', '0.5b', 16); 'trl-1.5b-b32' -> ('trl', '1.5b', 32)."""
    if "-b" not in name:
        return None, None, None
    head, _, b = name.rpartition("-b")
    if not b.isdigit():
        return None, None, None
    variant, _, shape = head.rpartition("-")
    if not variant:
        return None, None, None
    return variant, shape, int(b)


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("generate", "judge", "gspo"):
        sys.exit(__doc__)
    d = Path(sys.argv[2])
    {"generate": generate, "judge": judge, "gspo": gspo}[sys.argv[1]](d)


if __name__ == "__main__":
    main()
