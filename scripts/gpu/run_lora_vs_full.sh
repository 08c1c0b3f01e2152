#!/usr/bin/env bash
# LoRA (r 16, alpha 32, every linear layer; PEFT's unmerged forward with lora_dropout 0.05, TRL's
# default) against full fine-tuning, bf16 masters, fleet only (TRL=0: TRL's time at these
# shapes is in earlier calls), on one GPU: the Qwen2.5-1.5B shape at batch 16 and the 7B shape
# at batch 8 (run_gspo_vs_trl.sh; its seconds per generation batch, phases and peak memory).
# Carried: dist/carry/gspo-train.xz, COMMIT, .whl/.   bash scripts/gpu/run_lora_vs_full.sh
# Writes $OUT/lora_summary.txt (each shape's pairs.md and search.tsv) and $OUT/lora.tgz.
set -u
export NCCL_NVLS_ENABLE=0
OUT="${OUT:-$PWD/out_lora}"
mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
OUT="$OUT/lora-1.5b" SHAPES=1.5b BATCHES=16 STEPS="${STEPS_15:-12}" TRL=0 BUDGET_S=200 \
  VARIANTS="fleet-bf16 fleet-bf16-lora" bash scripts/gpu/run_gspo_vs_trl.sh
OUT="$OUT/lora-7b" SHAPES=7b BATCHES=8 STEPS="${STEPS_7B:-12}" TRL=0 BUDGET_S=300 \
  VARIANTS="fleet-bf16 fleet-bf16-lora" bash scripts/gpu/run_gspo_vs_trl.sh
for p in lora-1.5b lora-7b; do echo "# $p"; cat "$OUT/$p/pairs.md" "$OUT/$p/search.tsv" 2>/dev/null; grep -h "peak" "$OUT/$p/log.txt" | head -4; done > "$OUT/lora_summary.txt"
(cd "$OUT" && tar czf lora.tgz lora-1.5b lora-7b && rm -rf lora-1.5b lora-7b)
cat "$OUT/lora_summary.txt"
