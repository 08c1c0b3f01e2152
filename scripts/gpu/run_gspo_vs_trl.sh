#!/usr/bin/env bash
# gspo-train against TRL's GRPOTrainer (GSPO setting) on one GPU, in one call: Qwen2.5-0.5B and
# 1.5B shapes with random weights saved by transformers, the same prompts, batch (16
# completions per micro-batch, 8 per prompt, 4 micro-batches per generation batch), lengths
# (256 new tokens) and iterations. For each: seconds per generation batch (the mean over the
# batches after the first), split into generation+scoring and update, and the peak GPU memory
# (nvidia-smi, polled every 100 ms, above what the GPU held before the run).
#
# Carried: dist/carry/gspo-train.xz (scripts/cuda/build.sh -p gspo-train, xz) and .whl/ with
# the wheels TRL needs that the GPU machine lacks (trl 1.16.0, datasets 4.8.0 — 5.x wants a
# newer pyarrow than the machine's —, dill 0.4.1, multiprocess 0.70.19; see docs/gpu.md).
# Run from the repo root:
#
#     SHAPES="0.5b 1.5b" STEPS=16 bash scripts/gpu/run_gspo_vs_trl.sh
#
# VARIANTS picks fleet's runs (default "fleet fleet-bf16"; also fleet-bf16-mb8 and
# fleet-bf16-auto, whose --max-memory is TRL's peak measured just before).
#
# Writes $OUT/gspo_vs_trl.json (both engines' figures per shape) and the per-step logs.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_gspo}"
WORK="${WORK:-/tmp/gspo_bench}"
SHAPES="${SHAPES:-0.5b 1.5b}"
STEPS="${STEPS:-16}"
mkdir -p "$OUT" "$WORK"
LOG="$OUT/log.txt"
exec > >(tee -a "$LOG") 2>&1

[ -x "$WORK/gspo-train" ] || xz -dc dist/carry/gspo-train.xz > "$WORK/gspo-train"
chmod +x "$WORK/gspo-train"
[ -d "$WORK/site" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$WORK/site" .whl/*.whl
export PYTHONPATH="$WORK/site"
python3 -c "import trl, datasets, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/gpu/make_gspo_prompts.py --out "$WORK/prompts.jsonl" --n 512

used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0; }
# Runs "$@" while polling the GPU's memory; prints the peak above the baseline in MiB.
with_peak() {
  local name="$1"; shift
  local base; base=$(used)
  ( while true; do used; sleep 0.1; done ) > "$WORK/$name.mem" &
  local poll=$!
  "$@"
  local rc=$?
  kill "$poll" 2>/dev/null; wait "$poll" 2>/dev/null
  local peak; peak=$(sort -n "$WORK/$name.mem" | tail -1)
  echo "$name: exit $rc, peak $((peak - base)) MiB above the baseline of $base MiB"
  echo "{\"peak_mib\": $((peak - base)), \"baseline_mib\": $base, \"exit\": $rc}" > "$OUT/$name.mem.json"
}

for shape in $SHAPES; do
  ckpt="$WORK/q$shape"
  [ -f "$ckpt/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py \
      --config "configs/models/qwen2.5-$shape.json" --out "$ckpt" \
      --tokenizer-from tests/fixtures/qwen2-tiny --dtype bf16
  # TRL first: fleet-bf16-auto takes TRL's measured peak as its memory budget.
  with_peak "trl-$shape" python3 scripts/gpu/trl_gspo_bench.py --model "$ckpt" \
      --dataset "$WORK/prompts.jsonl" --out "$OUT/trl-$shape.json" --steps "$STEPS"
  trl_mib=$(python3 -c "import json; print(json.load(open('$OUT/trl-$shape.mem.json'))['peak_mib'])")
  # fleet: f32 master weights and moments (the default); bf16 ones (TRL's arithmetic); bf16
  # ones with each micro-batch of 16 run as two of 8 (gradient accumulation: the same
  # optimizer steps); bf16 ones with --auto-find-batch-size under TRL's peak as --max-memory
  # (the plan picks the micro-batch that fits it).
  for variant in ${VARIANTS:-fleet fleet-bf16}; do
    case "$variant" in
      fleet) extra="" ;;
      fleet-bf16) extra="--torch-dtype bfloat16" ;;
      fleet-bf16-mb8) extra="--torch-dtype bfloat16 --set per_device_train_batch_size=8 --set steps_per_generation=8 --set gradient_accumulation_steps=2" ;;
      fleet-bf16-auto) extra="--torch-dtype bfloat16 --auto-find-batch-size --max-memory 0=${trl_mib}MiB" ;;
      *) echo "unknown variant $variant"; continue ;;
    esac
    rm -rf "$WORK/$variant-$shape"
    # shellcheck disable=SC2086
    with_peak "$variant-$shape" "$WORK/gspo-train" --config configs/gspo/bench.toml \
        --model "$ckpt" --dataset "$WORK/prompts.jsonl" --output-dir "$WORK/$variant-$shape" \
        --max-steps "$STEPS" --dtype bf16 $extra
    cp "$WORK/$variant-$shape/metrics.jsonl" "$OUT/$variant-$shape.metrics.jsonl" 2>/dev/null
  done
done

python3 - "$OUT" $SHAPES <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1]); shapes = sys.argv[2:]
per_gen = 4
report = {}
for shape in shapes:
    row = {}
    for variant in ("fleet", "fleet-bf16", "fleet-bf16-mb8", "fleet-bf16-auto"):
      f = out / f"{variant}-{shape}.metrics.jsonl"
      if f.exists():
          m = [json.loads(l) for l in f.read_text().splitlines()]
          batches = {}
          for r in m:
              b = batches.setdefault(r["generation_batch"], {"total": 0.0, "gen": 0.0, "score": 0.0, "update": 0.0})
              b["total"] += r["step_time"]; b["gen"] += r["generation_seconds"]
              b["score"] += r["scoring_seconds"]; b["update"] += r["update_seconds"]
          later = [v for k, v in sorted(batches.items())[1:]]
          mean = lambda key: sum(b[key] for b in later) / max(len(later), 1)
          row[variant] = {"seconds_per_generation_batch": mean("total"), "generation": mean("gen"),
                          "scoring": mean("score"), "update": mean("update"), "batches": len(later),
                          "peak_torch_or_cuda": m[-1].get("peak_memory_bytes"),
                          **json.loads((out / f"{variant}-{shape}.mem.json").read_text())}
    f = out / f"trl-{shape}.json"
    if f.exists():
        t = json.loads(f.read_text())
        steps = t["step_seconds"]
        batches = [sum(steps[i:i + per_gen]) for i in range(0, len(steps), per_gen)][1:]
        gens = t["generate_and_score_seconds"][1:]
        total = sum(batches) / max(len(batches), 1)
        gen = sum(gens) / max(len(gens), 1)
        row["trl"] = {"seconds_per_generation_batch": total, "generation_and_scoring": gen,
                      "update": total - gen, "batches": len(batches),
                      "peak_allocated_bytes": t["peak_allocated_bytes"],
                      "peak_reserved_bytes": t["peak_reserved_bytes"],
                      "versions": {k: t[k] for k in ("trl_version", "transformers_version", "torch_version")},
                      **json.loads((out / f"trl-{shape}.mem.json").read_text())}
    if "fleet" in row and "trl" in row:
        row["speedup"] = row["trl"]["seconds_per_generation_batch"] / row["fleet"]["seconds_per_generation_batch"]
        row["memory_ratio_fleet_over_trl"] = row["fleet"]["peak_mib"] / max(row["trl"]["peak_mib"], 1)
    for v in ("fleet-bf16", "fleet-bf16-mb8", "fleet-bf16-auto"):
        if v in row and "trl" in row:
            key = v.replace("fleet-", "").replace("-", "_")
            row[f"speedup_{key}"] = row["trl"]["seconds_per_generation_batch"] / row[v]["seconds_per_generation_batch"]
            row[f"memory_ratio_fleet_{key}_over_trl"] = row[v]["peak_mib"] / max(row["trl"]["peak_mib"], 1)
    report[shape] = row
(out / "gspo_vs_trl.json").write_text(json.dumps(report, indent=1))
print(json.dumps(report, indent=1))
EOF
# Few files come back from a device call: the per-run files travel as one archive.
(cd "$OUT" && tar czf details.tgz --exclude details.tgz --exclude gspo_vs_trl.json --exclude log.txt . \
  && find . -maxdepth 1 -type f ! -name details.tgz ! -name gspo_vs_trl.json ! -name log.txt -delete)
