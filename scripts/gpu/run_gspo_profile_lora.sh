#!/usr/bin/env bash
# One device call for gspo-train (carried: dist/carry/gspo-train.xz and .whl/, as
# run_gspo_vs_trl.sh): where a generation batch's time goes beyond the bench's generate
# (profile_gspo.sh, 1.5B, bf16 masters), then LoRA (r 16, every linear layer) against full
# fine-tuning with TRL in the same call on the 1.5B shape, then both on the 7B shape (fleet
# only: TRL=0) with the memory plan of each. Writes $OUT/summary.txt (the profile's stages and
# pairs.md of each part), $OUT/plans.txt and $OUT/results.tgz (everything).
set -u
export NCCL_NVLS_ENABLE=0
OUT="${OUT:-$PWD/out_gspo_profile_lora}"
mkdir -p "$OUT"/profile "$OUT"/lora-1.5b "$OUT"/lora-7b
exec > >(tee -a "$OUT/console.txt") 2>&1
start=$(date +%s)
echo "== profile (1.5B, bf16 masters)"
OUT="$OUT/profile" SHAPES=1.5b EXTRA="--torch-dtype bfloat16" PROFILE_STEPS="${PROFILE_STEPS:-8}" \
  timeout 150 bash scripts/gpu/profile_gspo.sh
echo "== LoRA vs full fine-tuning, 1.5B, with TRL ($(( $(date +%s) - start )) s in)"
OUT="$OUT/lora-1.5b" SHAPES=1.5b BATCHES=16 STEPS="${STEPS_15:-12}" BUDGET_S="${BUDGET_15:-260}" \
  VARIANTS="fleet-bf16 fleet-bf16-lora" bash scripts/gpu/run_gspo_vs_trl.sh
echo "== LoRA vs full fine-tuning, 7B, fleet only ($(( $(date +%s) - start )) s in)"
OUT="$OUT/lora-7b" SHAPES=7b BATCHES="${BATCHES_7B:-8}" STEPS="${STEPS_7B:-12}" TRL=0 BUDGET_S="${BUDGET_7B:-220}" \
  VARIANTS="fleet-bf16 fleet-bf16-lora" bash scripts/gpu/run_gspo_vs_trl.sh
# The memory plan of both 7B runs, beside what they measured.
W=/tmp/gspo_bench
for v in "" "--set use_peft=true --set lora_r=16 --set lora_alpha=32 --set lora_target_modules=all-linear"; do
  echo "== plan $v"
  # shellcheck disable=SC2086
  "$W/gspo-train" --config configs/gspo/bench.toml --model "$W/q7b" --dataset "$W/prompts.jsonl" \
    --output-dir /tmp/plan --dtype bf16 --torch-dtype bfloat16 --per-device-train-batch-size "${BATCHES_7B:-8}" \
    --plan $v 2>&1 | grep -v "^\["
done > "$OUT/plans.txt" 2>&1
{
  echo "# profile"; grep -h profile "$OUT"/profile/profile-*.txt
  for p in lora-1.5b lora-7b; do echo "# $p"; cat "$OUT/$p/pairs.md" "$OUT/$p/search.tsv" 2>/dev/null; done
} > "$OUT/summary.txt"
# A call brings back at most 8 files: one archive beside the summary and the console.
tmp=$(mktemp)
(cd "$OUT" && tar czf "$tmp" profile lora-1.5b lora-7b && rm -rf profile lora-1.5b lora-7b) \
  && mv "$tmp" "$OUT/results.tgz"
echo "== done in $(( $(date +%s) - start )) s"
