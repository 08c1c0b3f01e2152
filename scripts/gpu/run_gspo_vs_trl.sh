#!/usr/bin/env bash
# gspo-train against TRL's GRPOTrainer (GSPO setting) on one GPU, in one call: Qwen2.5-0.5B and
# 1.5B shapes with random weights saved by transformers, the same prompts, batches, lengths
# (256 new tokens) and iterations for both. The batch is per_device_train_batch_size (completions
# per micro-batch, 8 per prompt, 4 micro-batches = 4 optimizer steps per generation batch of
# 4 x batch completions), and every batch of BATCHES runs on both engines. For each run: seconds
# per generation batch (the median over the batches after two warm-up ones,
# WARMUP_GENERATION_BATCHES in pair_results.py), split into generation and
# update, completions per second, and the peak GPU memory (nvidia-smi, polled every 100 ms,
# above what the GPU held before the run).
#
# Carried: dist/carry/gspo-train.xz (scripts/cuda/build.sh -p gspo-train, xz) and .whl/ with
# the wheels TRL needs that the GPU machine lacks (trl 1.16.0, datasets 4.8.0 — 5.x wants a
# newer pyarrow than the machine's —, dill 0.4.1, multiprocess 0.70.19; see docs/gpu.md).
# Run from the repo root:
#
#     SHAPES="0.5b 1.5b" BATCHES="16" STEPS=20 bash scripts/gpu/run_gspo_vs_trl.sh
#     SHAPES=1.5b BATCHES="8 16 32" STEPS=16 bash scripts/gpu/run_gspo_vs_trl.sh
#     SHAPES=1.5b BATCHES=16 BEST=1 bash scripts/gpu/run_gspo_vs_trl.sh
#
# TRL=0 runs fleet's variants only (a shape TRL cannot train on this GPU, or fleet against
# itself: LoRA against full fine-tuning).
#
# BATCHES: even numbers (a generation batch of 4 x batch must hold whole groups of 8). BEST=1
# then searches each engine's best batch that fits in this call: batches doubling from BEST_FROM
# (default twice the largest of BATCHES) to BEST_MAX (default 128), BEST_STEPS optimizer steps
# each (default 12: three generation batches, the third timed), until one fails; how each search
# ended (out of memory only where the engine's log says so) is in search.tsv; BUDGET_S (default
# 560 s) bounds the whole call, and a run that would start with less than a minute left is
# recorded as skipped. A larger batch
# changes the algorithm's batch (fewer, larger optimizer steps per completion): a best-batch
# figure is a throughput ceiling, not the same training run.
#
# VARIANTS picks fleet's runs (default "fleet fleet-bf16"; fleet-lora and fleet-bf16-lora: LoRA
# adapters, r 16, alpha 32, lora_dropout 0.05 (TRL's default), on every linear layer, against full fine-tuning in the same call;
# also fleet-bf16-packed: padding_free (packed sequences; with EOS_SCALE, below, where the
# completions' lengths vary); fleet-bf16-steps1: rollouts
# reading tokens back after every decode step (the default is every 8); fleet-bf16-oldpass: an
# old log-prob pass for every micro-batch (FLEET_OWN_OLD_LOGP=0), as before 2026-11-29c;
# fleet-bf16-mb8: each micro-batch
# run as micro-batches of 8 with gradient accumulation, the same optimizer steps, for batches that
# are multiples of 8; and fleet-bf16-auto, whose --max-memory is TRL's peak measured just before
# at the same batch).
#
# EOS_SCALE=S: a variable-length workload, the checkpoint's EOS row scaled by S
# (make_random_checkpoint.py --eos-scale; ~7.5 at 0.5B, ~5.8 at 1.5B for a mean of 100-150
# tokens: one shape a call), so that completions stop at different lengths for both engines.
#
# Writes $OUT/gspo_vs_trl.json (every run's figures per shape and batch), $OUT/pairs.md and
# pairs.json (fleet and TRL paired by batch, with the limit of the work: scripts/gpu/limits.py),
# $OUT/search.tsv, and the per-run logs and metrics in $OUT/details.tgz.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_gspo}"
WORK="${WORK:-/tmp/gspo_bench}"
SHAPES="${SHAPES:-0.5b 1.5b}"
STEPS="${STEPS:-20}"
BATCHES="${BATCHES:-16}"
BEST="${BEST:-0}"
BUDGET_S="${BUDGET_S:-560}"   # the whole call: each run gets what is left, none starts with < 60 s
START=$(date +%s)
mkdir -p "$OUT" "$WORK"
LOG="$OUT/log.txt"
exec > >(tee -a "$LOG") 2>&1

# Always the carried build: a warm machine keeps /tmp from an earlier call, and its binary.
xz -dc dist/carry/gspo-train.xz > "$WORK/gspo-train"
chmod +x "$WORK/gspo-train"
[ -d "$WORK/site" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$WORK/site" .whl/*.whl
export PYTHONPATH="$WORK/site"
python3 -c "import trl, datasets, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
# pair_results.py reads the GPU's name (and so its limits) from nvidia-smi.txt.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
python3 scripts/gpu/make_gspo_prompts.py --out "$WORK/prompts.jsonl" --n 512

used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0; }
# with_peak NAME CMD...: runs CMD while polling the GPU's memory; prints the peak above the
# baseline in MiB, keeps the output in $OUT/NAME.log and returns CMD's exit status.
with_peak() {
  local name="$1"; shift
  local base; base=$(used)
  ( while true; do used; sleep 0.1; done ) > "$WORK/$name.mem" &
  local poll=$!
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  kill "$poll" 2>/dev/null; wait "$poll" 2>/dev/null
  local peak; peak=$(sort -n "$WORK/$name.mem" | tail -1)
  echo "$name: exit $rc, peak $((peak - base)) MiB above the baseline of $base MiB"
  echo "{\"peak_mib\": $((peak - base)), \"baseline_mib\": $base, \"exit\": $rc}" > "$OUT/$name.mem.json"
  return "$rc"
}
# outcome NAME RC: ok, oom (only where the log says so), no-fit (gspo-train's memory plan refused
# the batch before loading) or error, for search.tsv
outcome() {
  if [ "$2" = 0 ]; then echo ok
  elif [ "$2" = 124 ] || [ "$2" = 137 ]; then echo timeout
  elif grep -qiE 'out of memory|OUT_OF_MEMORY' "$OUT/$1.log" 2>/dev/null; then echo oom
  elif grep -q 'does not fit' "$OUT/$1.log" 2>/dev/null; then echo no-fit   # fleet's memory plan refused it
  else echo error; fi
}
SEARCH_TSV="$OUT/search.tsv"
: > "$SEARCH_TSV"
# left: seconds of the budget left minus a margin for the summary; 0 when a run should not start
left() { local l=$((START + BUDGET_S - $(date +%s) - 20)); [ "$l" -lt 60 ] && l=0; echo "$l"; }

# trl_run SHAPE BATCH STEPS MODE; fleet_run VARIANT SHAPE BATCH STEPS MODE: one run each,
# recorded in search.tsv as ENGINE MODE:SHAPE BATCH STATUS NOTE; non-zero when it did not run.
trl_run() {
  local shape=$1 b=$2 steps=$3 mode=$4 name="trl-$1-b$2" rc st t
  t=$(left)
  if [ "$t" = 0 ]; then printf 'trl\t%s:%s\t%s\tskipped\ttime budget used up\n' "$mode" "$shape" "$b" >> "$SEARCH_TSV"; return 1; fi
  with_peak "$name" timeout "$t" python3 scripts/gpu/trl_gspo_bench.py --model "$WORK/q$shape" \
      --dataset "$WORK/prompts.jsonl" --out "$OUT/$name.json" --steps "$steps" \
      --per-device-train-batch-size "$b"
  rc=$?
  st=$(outcome "$name" "$rc")
  printf 'trl\t%s:%s\t%s\t%s\t%s\n' "$mode" "$shape" "$b" "$st" "$([ "$st" = ok ] || echo "exit $rc; $name.log")" >> "$SEARCH_TSV"
  [ "$st" = ok ]
}
fleet_run() {
  local variant=$1 shape=$2 b=$3 steps=$4 mode=$5 name="$1-$2-b$3" extra envs="" rc st trl_mib t
  case "$variant" in
    fleet) extra="" ;;
    fleet-bf16) extra="--torch-dtype bfloat16" ;;
    fleet-bf16-steps1) extra="--torch-dtype bfloat16 --set num_scheduler_steps=1" ;;
    fleet-bf16-oldpass) extra="--torch-dtype bfloat16"; envs="FLEET_OWN_OLD_LOGP=0" ;;
    fleet-bf16-packed) extra="--torch-dtype bfloat16 --set padding_free=true" ;;
    fleet-bf16-lora) extra="--torch-dtype bfloat16 --set use_peft=true --set lora_r=16 --set lora_alpha=32 --set lora_target_modules=all-linear --set lora_dropout=0.05" ;;
    fleet-lora) extra="--set use_peft=true --set lora_r=16 --set lora_alpha=32 --set lora_target_modules=all-linear --set lora_dropout=0.05" ;;
    fleet-bf16-mb8)
      if [ $((b % 8)) != 0 ] || [ "$b" -le 8 ]; then echo "$name: skipped (batch $b is not a multiple of 8 above 8)"; return 0; fi
      extra="--torch-dtype bfloat16 --set per_device_train_batch_size=8 --set steps_per_generation=$((b / 2)) --set gradient_accumulation_steps=$((b / 8))" ;;
    fleet-bf16-auto)
      if [ ! -f "$OUT/trl-$shape-b$b.mem.json" ]; then echo "$name: skipped (no TRL peak at batch $b)"; return 0; fi
      trl_mib=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['peak_mib'])" "$OUT/trl-$shape-b$b.mem.json")
      extra="--torch-dtype bfloat16 --auto-find-batch-size --max-memory 0=${trl_mib}MiB" ;;
    *) echo "unknown variant $variant"; return 0 ;;
  esac
  t=$(left)
  if [ "$t" = 0 ]; then printf '%s\t%s:%s\t%s\tskipped\ttime budget used up\n' "$variant" "$mode" "$shape" "$b" >> "$SEARCH_TSV"; return 1; fi
  rm -rf "${WORK:?}/$name"
  # shellcheck disable=SC2086
  with_peak "$name" env $envs timeout "$t" "$WORK/gspo-train" --config configs/gspo/bench.toml \
      --model "$WORK/q$shape" --dataset "$WORK/prompts.jsonl" --output-dir "$WORK/$name" \
      --max-steps "$steps" --dtype bf16 --per-device-train-batch-size "$b" $extra
  rc=$?
  cp "$WORK/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  st=$(outcome "$name" "$rc")
  printf '%s\t%s:%s\t%s\t%s\t%s\n' "$variant" "$mode" "$shape" "$b" "$st" "$([ "$st" = ok ] || echo "exit $rc; $name.log")" >> "$SEARCH_TSV"
  [ "$st" = ok ]
}

largest=$(for b in $BATCHES; do echo "$b"; done | sort -n | tail -1)
best_list() {
  local b="${BEST_FROM:-$((largest * 2))}" out=""
  while [ "$b" -le "${BEST_MAX:-128}" ]; do out="$out $b"; b=$((b * 2)); done
  echo "$out"
}

for shape in $SHAPES; do
  ckpt="$WORK/q$shape"
  [ -n "${EOS_SCALE:-}" ] && ckpt="$ckpt-eos$EOS_SCALE"
  [ -f "$ckpt/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py \
      --config "configs/models/qwen2.5-$shape.json" --out "$ckpt" \
      --tokenizer-from tests/fixtures/qwen2-tiny --dtype bf16 ${EOS_SCALE:+--eos-scale $EOS_SCALE}
  # The same batches for both engines, in this call. TRL first at each batch:
  # fleet-bf16-auto takes TRL's measured peak at that batch as its memory budget. fleet's
  # variants: f32 master weights and moments (the default); bf16 ones (TRL's arithmetic);
  # bf16 with micro-batches of 8 (gradient accumulation: the same optimizer steps); bf16 with
  # --auto-find-batch-size under TRL's peak as --max-memory (the plan picks the micro-batch).
  for b in $BATCHES; do
    [ "${TRL:-1}" = 1 ] && trl_run "$shape" "$b" "$STEPS" list
    for variant in ${VARIANTS:-fleet fleet-bf16}; do fleet_run "$variant" "$shape" "$b" "$STEPS" list; done
  done
  if [ "$BEST" = 1 ]; then
    # Each engine's best batch that fits: larger batches until one fails.
    for b in $(best_list); do trl_run "$shape" "$b" "${BEST_STEPS:-12}" best || break; done
    for variant in ${VARIANTS:-fleet fleet-bf16}; do
      [ "$variant" = fleet-bf16-auto ] && continue  # its budget is TRL's peak: not a search
      for b in $(best_list); do fleet_run "$variant" "$shape" "$b" "${BEST_STEPS:-12}" best || break; done
    done
  fi
done

python3 scripts/gpu/pair_results.py gspo "$OUT"
# Few files come back from a device call: the per-run files travel as one archive.
KEEP=(details.tgz gspo_vs_trl.json log.txt pairs.md pairs.json search.tsv nvidia-smi.txt)
EXCLUDE=(); NOT=()
for k in "${KEEP[@]}"; do EXCLUDE+=(--exclude "$k"); NOT+=(! -name "$k"); done
# The archive is written outside $OUT: tar fails on a directory that changes as it reads it.
tmp=$(mktemp)
(cd "$OUT" && tar czf "$tmp" "${EXCLUDE[@]}" . && find . -maxdepth 1 -type f "${NOT[@]}" -delete) \
  && mv "$tmp" "$OUT/details.tgz"
