#!/usr/bin/env bash
# edit-score's replica scaling on nvidia-h200-x2 (issue 11: replicas on 2 GPUs >= 0.95 x N): the
# real scoring path (benchmark JSONL, prompt set, shared queue, records) with a random-weight
# Qwen3-VL-8B-shaped checkpoint saved by transformers, PAIRS generated 1024x1024 pairs, VIEScore's
# two calls per pair with both images in each and 128 new tokens, batch BATCH: one replica on
# GPU 0, then one replica per GPU on both (the second in a child process).
# Judging time is edit-score's own (after loading): calls per second = calls / seconds. A short
# `edit-score bench` first compiles the PTX, so neither timed run pays the JIT.
#
# Carried: dist/carry/edit-score.xz and COMMIT.   PAIRS=128 BATCH=16 bash scripts/gpu/run_judge_scaling.sh
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R="$OUT/judge_scaling"
W=/tmp/judge_scaling
mkdir -p "$R" "$W"
BIN="$W/edit-score"
xz -dc dist/carry/edit-score.xz > "$BIN" && chmod +x "$BIN"
export FLEET_COMMIT="$(cat COMMIT 2>/dev/null || echo unknown)"
PAIRS="${PAIRS:-128}"; BATCH="${BATCH:-16}"; SHAPE="${SHAPE:-configs/models/qwen3-vl-8b.json}"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$R/gpus.txt"
[ -f "$W/model/config.json" ] || python3 scripts/gpu/make_random_vl_checkpoint.py --config "$SHAPE" \
  --out "$W/model" --pairs "$PAIRS" --image-size 1024 --bench-out "$W/bench" 2>&1 | tail -2 | tee "$R/make.log"
# A fresh machine compiles fleet's PTX on first use (~15 s, cached for later processes): a short
# bench first, so that neither timed run pays it.
"$BIN" bench --config "$SHAPE" --image-size 1024 --batch 2 --samples 2 --new-tokens 8 > "$R/warmup.log" 2>&1
echo "warm-up exit $?"
for mode in single data-parallel; do
  rm -rf "$W/out-$mode"
  start=$(date +%s.%N)
  "$BIN" --benchmark "$W/bench/pairs.jsonl" --format jsonl --prompts configs/judge/viescore.toml \
    --images source,edited --max-new-tokens 128 --model "$W/model" --output "$W/out-$mode" \
    --gpu-mode "$mode" --batch-size "$BATCH" --no-progress > "$R/$mode.log" 2>&1
  echo "$mode: exit $? after $(awk "BEGIN{print $(date +%s.%N) - $start}") s wall" | tee -a "$R/times.txt"
  grep -E "judge loaded|call\(s\):|stopped|failed" "$R/$mode.log" | head -5
  cp "$W/out-$mode/run.json" "$R/$mode.run.json" 2>/dev/null
done
python3 - "$R" <<'PY'
import json, re, sys
from pathlib import Path
r = Path(sys.argv[1]); out = {}
for mode in ("single", "data-parallel"):
    log = (r / f"{mode}.log").read_text()
    m = re.search(r"(\d+) call\(s\): (\d+) judged now.*?; ([\d.]+)s\n", log)
    loaded = re.search(r"judge loaded in ([\d.]+)s: (\d+) replica", log)
    if m:
        calls, judged, sec = int(m.group(1)), int(m.group(2)), float(m.group(3))
        out[mode] = {"calls": calls, "judged": judged, "judging_s": sec, "calls_per_s": judged / sec,
                     "load_s": float(loaded.group(1)) if loaded else None,
                     "replicas": int(loaded.group(2)) if loaded else None}
if "single" in out and "data-parallel" in out:
    n = out["data-parallel"]["replicas"] or 2
    out["scaling"] = out["data-parallel"]["calls_per_s"] / out["single"]["calls_per_s"]
    out["scaling_over_n"] = out["scaling"] / n
(r.parent / "judge_scaling.json").write_text(json.dumps(out, indent=1))
print(json.dumps(out, indent=1))
PY
tar -C "$OUT" -czf "$OUT/judge_scaling.tgz" judge_scaling && rm -rf "$R"
