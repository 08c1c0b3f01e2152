#!/usr/bin/env bash
# ZeRO stage 1 (issue 28, item 5) on two real GPUs through NCCL, in one call on nvidia-h100-x2:
# the same data-parallel run (configs/gspo/bench.toml plus a random reward model, so that every
# step has gradients) with zero_stage 0 and 1 — the Qwen2.5-1.5B shape with f32 masters
# (--dtype bf16) and the 7B shape with bf16 masters (--torch-dtype bfloat16) — each with the
# plan of one rank, the peak memory of each GPU (nvidia-smi every 100 ms, above the idle
# baseline), the peak fleet's allocator saw (metrics.jsonl), seconds per generation batch, and
# whether both runs logged the same loss, reward and grad_norm at every step (ZeRO-1 gathers
# the updated weights exactly: the sums it uses add zeros).
#
# Carried: dist/carry/gspo-train.xz and COMMIT.   OUT=... bash scripts/gpu/run_gspo_zero.sh
# SHAPES (default "1.5b 7b"), STEPS (default 8: two generation batches), BATCH (the global
# per_device_train_batch_size, default 16: 8 rows per rank). Writes $OUT/zero_summary.json and
# $OUT/zero.tgz (logs, metrics, plans).
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_zero}"
W="${WORK:-/tmp/zero}"
SHAPES="${SHAPES:-1.5b 7b}"
STEPS="${STEPS:-8}"
BATCH="${BATCH:-16}"
R="$OUT/zero"
mkdir -p "$R" "$W"
exec > >(tee -a "$R/log.txt") 2>&1
BIN="$W/gspo-train"
xz -dc dist/carry/gspo-train.xz > "$BIN" && chmod +x "$BIN"
export FLEET_COMMIT="$(cat COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$R/gpus.txt"
[ -f "$W/prompts.jsonl" ] || python3 scripts/gpu/make_gspo_prompts.py --out "$W/prompts.jsonl" --n 512 > /dev/null
# Random weights earn no gsm8k reward, so nothing would train: a random Qwen2.5-0.5B-shaped
# reward model scores the completions as well, giving every step gradients to compare.
[ -f "$W/rm05/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --classifier \
  --config configs/models/qwen2.5-0.5b.json --out "$W/rm05" --tokenizer-from tests/fixtures/qwen2-tiny > "$R/make-rm.log" 2>&1
cp configs/gspo/bench.toml "$W/zero.toml"
printf '\n[[reward_funcs]]\nname = "reward_model"\nweight = 1.0\nmodel = "%s"\n' "$W/rm05" >> "$W/zero.toml"
used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | paste -sd' '; }
for shape in $SHAPES; do
  c="$W/q$shape"
  [ -f "$c/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --config "configs/models/qwen2.5-$shape.json" \
    --out "$c" --tokenizer-from tests/fixtures/qwen2-tiny --dtype bf16 > "$R/make-$shape.log" 2>&1
  case "$shape" in
    7b) masters=(--torch-dtype bfloat16); port=29701 ;;
    *) masters=(); port=29711 ;;
  esac
  for z in 0 1; do
    name="$shape-zero$z"
    common=(--config "$W/zero.toml" --model "$c" --dataset "$W/prompts.jsonl" --dtype bf16
            "${masters[@]}" --per-device-train-batch-size "$BATCH" --max-steps "$STEPS" --set "zero_stage=$z")
    "$BIN" --plan --nproc-per-node 2 "${common[@]}" --output-dir "$W/plan" > "$R/$name.plan.txt" 2>&1
    echo "== $name ($(date +%T)); plan of one rank:"; grep -iE "zero|per rank|policy" "$R/$name.plan.txt" | head -6
    rm -rf "${W:?}/$name"
    base=$(used)
    ( while true; do used; sleep 0.1; done ) > "$W/$name.mem" &
    poll=$!
    timeout 280 "$BIN" --nproc-per-node 2 --master-port $((port + z)) "${common[@]}" \
      --output-dir "$W/$name" > "$R/$name.log" 2>&1
    rc=$?
    kill "$poll" 2>/dev/null; wait "$poll" 2>/dev/null
    cp "$W/$name/metrics.jsonl" "$R/$name.metrics.jsonl" 2>/dev/null
    python3 - "$W/$name.mem" "$base" "$rc" > "$R/$name.mem.json" <<'PY'
import json, sys
rows = [list(map(int, l.split())) for l in open(sys.argv[1]) if l.strip()]
base = list(map(int, sys.argv[2].split()))
peak = [max(r[i] for r in rows) - base[i] for i in range(len(base))] if rows else []
print(json.dumps({"peak_mib_per_gpu": peak, "baseline_mib": base, "exit": int(sys.argv[3])}))
PY
    echo "$name: exit $rc; $(cat "$R/$name.mem.json")"
    grep -E "^Error|error:" "$R/$name.log" | head -3
  done
  rm -rf "${W:?}/$shape-zero"*
done
python3 - "$R" <<'PY' | tee "$OUT/zero_summary.json"
import json, sys
from pathlib import Path
r = Path(sys.argv[1]); out = {}
def metrics(name):
    p = r / f"{name}.metrics.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
for plan in sorted(r.glob("*.plan.txt")):
    shape = plan.name.split("-zero")[0]
    z = plan.name.split("-zero")[1].split(".")[0]
    m = metrics(f"{shape}-zero{z}")
    mem = json.loads((r / f"{shape}-zero{z}.mem.json").read_text()) if (r / f"{shape}-zero{z}.mem.json").exists() else {}
    batches = {}
    for x in m:
        batches.setdefault(x.get("generation_batch"), []).append(x.get("step_time", 0.0))
    later = [sum(v) for k, v in sorted(batches.items(), key=lambda kv: str(kv[0]))[1:]]
    out.setdefault(shape, {})[f"zero{z}"] = {
        "exit": mem.get("exit"), "steps": len(m), "peak_mib_per_gpu": mem.get("peak_mib_per_gpu"),
        "allocator_peak_bytes": m[-1].get("peak_memory_bytes") if m else None,
        "seconds_per_generation_batch": sum(later) / len(later) if later else None,
        "plan": [l for l in plan.read_text().splitlines() if l.strip()][:12],
    }
for shape, v in out.items():
    a, b = metrics(f"{shape}-zero0"), metrics(f"{shape}-zero1")
    if a and b:
        keys = ("loss", "reward", "grad_norm", "entropy", "num_tokens")
        v["same_metrics_every_step"] = len(a) == len(b) and all(x.get(k) == y.get(k) for x, y in zip(a, b) for k in keys)
print(json.dumps(out, indent=1))
PY
tar -C "$OUT" -czf "$OUT/zero.tgz" zero && rm -rf "$R"
