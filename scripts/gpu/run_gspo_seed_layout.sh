#!/usr/bin/env bash
# The seed's two-GPU layout on nvidia-h200-x2: a Qwen2.5-7B-shaped policy layer-sharded over
# GPUs 0 and 1, the reference model (beta > 0) and a reward model (a Qwen2.5-0.5B-shaped
# sequence classifier) on GPU 1: gspo-train --gpu-mode 2gpu. Random weights saved by
# transformers; the bench settings of configs/gspo/bench.toml (16 completions per micro-batch,
# 8 per prompt, 256 new tokens) with beta 0.04 and the reward model added.
#
# Carried: dist/carry/gspo-train.xz. Run from the repo root:  STEPS=8 bash scripts/gpu/run_gspo_seed_layout.sh
# Writes $OUT/plan.txt (gspo-train --plan), $OUT/metrics.jsonl and $OUT/log.txt.
#
# On one H200 as two logical devices (issue 24), with bf16 masters (f32 masters and moments
# need ~122 GB):
#   LOGICAL="--logical-gpus 2:64GiB" TORCH_DTYPE=bfloat16 STEPS=4 bash scripts/gpu/run_gspo_seed_layout.sh
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_seed_layout}"
WORK="${WORK:-/tmp/gspo_seed}"
STEPS="${STEPS:-8}"
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
xz -dc dist/carry/gspo-train.xz > "$WORK/gspo-train"
chmod +x "$WORK/gspo-train"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 scripts/gpu/make_gspo_prompts.py --out "$WORK/prompts.jsonl" --n 256
[ -f "$WORK/q7b/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py \
    --config configs/models/qwen2.5-7b.json --out "$WORK/q7b" --tokenizer-from tests/fixtures/qwen2-tiny
[ -f "$WORK/rm05/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --classifier \
    --config configs/models/qwen2.5-0.5b.json --out "$WORK/rm05" --tokenizer-from tests/fixtures/qwen2-tiny
sed 's/^beta = 0.0$/beta = 0.04/' configs/gspo/bench.toml > "$WORK/seed.toml"
printf '\n[[reward_funcs]]\nname = "reward_model"\nweight = 1.0\nmodel = "%s"\n' "$WORK/rm05" >> "$WORK/seed.toml"
# shellcheck disable=SC2206
common=(${LOGICAL:-} --config "$WORK/seed.toml" --model "$WORK/q7b" --dataset "$WORK/prompts.jsonl"
        --gpu-mode 2gpu --dtype bf16 --torch-dtype "${TORCH_DTYPE:-float32}"
        --output-dir "$WORK/run" --max-steps "$STEPS")
"$WORK/gspo-train" "${common[@]}" --plan | tee "$OUT/plan.txt"
rm -rf "$WORK/run"
start=$(date +%s)
"$WORK/gspo-train" "${common[@]}"
echo "exit $? after $(( $(date +%s) - start )) s"
cp "$WORK/run/metrics.jsonl" "$OUT/" 2>/dev/null
# The peak per device (a logical device's: its own pool) beside the plan's totals.
tail -1 "$WORK/run/metrics.jsonl" 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read() or '{}'); print('peaks:', {k: round(v/2**30, 2) for k, v in r.get('peak_memory_bytes', {}).items()}, 'GiB')"
grep -E "^cuda:[0-9]+: total" "$OUT/plan.txt"
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
