#!/usr/bin/env bash
# Issue 25's before/after speed check: the redesign must not change speed. One call, fleet
# alone, fixed settings, run once before the refactor and once after on the same machine kind
# (compare only calls on the same GPU; rerun the "before" binaries in the "after" call when the
# card differs):
#   - decode and prefill: fleet bench generate, Qwen2.5-7B shape, bf16, batches 1 and 32;
#   - the judge: edit-score bench, Qwen3-VL-8B shape, two 512 px images, batch 8;
#   - GSPO: gspo-train, Qwen2.5-0.5B shape, configs/gspo/bench.toml, 8 steps (the second
#     generation batch's seconds from metrics.jsonl).
# Carried: dist/carry/fleet.xz, dist/carry/edit-score.xz, dist/carry/gspo-train.xz, COMMIT.
#   TAG=before bash scripts/gpu/run_redesign_speed.sh     # writes $OUT/redesign-<TAG>.json
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
TAG="${TAG:-run}"
W=/tmp/redesign_speed; R="$OUT/redesign-$TAG"; mkdir -p "$W" "$R"
for b in fleet edit-score gspo-train; do
  xz -dc "dist/carry/$b.xz" > "$W/$b" && chmod +x "$W/$b"
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/nvidia-smi.txt"
cp COMMIT "$R/" 2>/dev/null
"$W/fleet" bench generate --config configs/models/qwen2.5-7b.json --batch 1,32 --prompt-len 512 \
  --new-tokens 128 --repeats 3 --json "$R/generate.json" > "$R/generate.log" 2>&1
echo "generate: exit $?; $(grep -E '^batch' "$R/generate.log" | tr '\n' ';')"
"$W/edit-score" bench --config configs/models/qwen3-vl-8b.json --image-size 512 --batch 8 --samples 32 \
  --new-tokens 128 --json "$R/judge.json" > "$R/judge.log" 2>&1
echo "judge: exit $?; $(grep -m1 'samples/s' "$R/judge.log")"
python3 scripts/gpu/make_gspo_prompts.py --out "$W/prompts.jsonl" --n 256 > /dev/null
[ -f "$W/q05/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --config configs/models/qwen2.5-0.5b.json \
  --out "$W/q05" --tokenizer-from tests/fixtures/qwen2-tiny > /dev/null 2>&1
rm -rf "$W/gspo"
"$W/gspo-train" --config configs/gspo/bench.toml --model "$W/q05" --dataset "$W/prompts.jsonl" --gpu-mode 1gpu \
  --dtype bf16 --torch-dtype bfloat16 --max-steps 8 --output-dir "$W/gspo" > "$R/gspo.log" 2>&1
echo "gspo: exit $?"
cp "$W/gspo/metrics.jsonl" "$R/gspo.metrics.jsonl" 2>/dev/null
python3 - "$R" <<'PY' | tee "$R/summary.txt"
import json, sys, os
r = sys.argv[1]
out = {}
g = json.load(open(f"{r}/generate.json"))
for run in g["runs"]:
    out[f"decode_tok_s_b{run['batch']}"] = run["decode_tok_s"]
    out[f"prefill_tok_s_b{run['batch']}"] = run["prefill_tok_s"]
out["judge_samples_s_b8"] = json.load(open(f"{r}/judge.json"))["samples_per_s"]
rows = [json.loads(l) for l in open(f"{r}/gspo.metrics.jsonl")]
# Steps 5-8 are the second generation batch (4 optimizer steps each).
second = [x for x in rows if x["step"] > 4]
out["gspo_s_per_generation_batch"] = sum(
    x["generation_seconds"] + x["scoring_seconds"] + x["update_seconds"] for x in second)
out["gspo_tokens_per_s_last"] = rows[-1].get("tokens_per_second")
json.dump(out, open(f"{r}.json", "w"), indent=1)
print(json.dumps(out, indent=1))
PY
tar -C "$OUT" -czf "$OUT/redesign-$TAG.tgz" "redesign-$TAG" && rm -rf "$R"
