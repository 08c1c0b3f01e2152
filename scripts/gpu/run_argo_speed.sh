#!/usr/bin/env bash
# ARGO's speed goal on one GPU: the seed's experiment (hard questions x 4 strategies x 10 c_r
# points, 7B model) with random Qwen2.5-7B-shaped weights and a real ingested corpus.
#
# Carried in dist/carry/: argo-exp.xz (CUDA build) and argo-data.tar.xz holding minilm16/
# (all-MiniLM-L6-v2 in f16, the embedder the index was built with), argo-index/ (the ingested
# corpus), benchtok/ (scripts/gpu/make_bench_tokenizer.py's tokenizer) and oran-bench-13k/
# (fin_H.json). Run from the repo root:
#
#     N_QUESTIONS=100 bash scripts/gpu/run_argo_speed.sh
#
# Writes $OUT/argo_speed.tgz (log, summary.json, records.jsonl, nvidia-smi) and
# $OUT/argo_resume.tgz (records and LLM cache): put the latter in dist/carry/ to go on with the
# same run in a later call (RUN_TIMEOUT bounds each call; the records make it resumable).
set -u
export NCCL_NVLS_ENABLE=0
ORIG_LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_argo}"
N="${N_QUESTIONS:-100}"
STRATEGIES="${STRATEGIES:-argo,always-retrieve,always-reason,fixed-k:3}"
# Work under /tmp so that a second call on the same (warm) machine resumes the run: records
# and the LLM cache stay there; each call's log and summary are copied to $OUT.
WORK="${WORK:-/tmp/argo_speed}"
RUN="$OUT/argo_speed"
mkdir -p "$RUN" "$WORK"
LOG="$RUN/log.txt"
python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('dist/carry/argo-exp.xz'), open('dist/argo-exp','wb'))"
tar xJf dist/carry/argo-data.tar.xz -C dist/carry
chmod +x dist/argo-exp
# A run split over several calls: the previous call's records and LLM cache come back in.
if [ -f dist/carry/argo_resume.tgz ] && [ ! -d "$WORK/real" ]; then
  tar xzf dist/carry/argo_resume.tgz -C "$WORK"
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$RUN/nvidia_smi.csv" 2>&1
cat COMMIT > "$RUN/commit.txt" 2>/dev/null
{
  if [ ! -f /tmp/q7b/config.json ]; then
    echo "### make checkpoint $(date -u +%T)"
    env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" python3 scripts/gpu/make_random_checkpoint.py \
        --config configs/models/qwen2.5-7b.json --out /tmp/q7b --tokenizer-from dist/carry/benchtok
  fi
  echo "### compare --sweep $(date -u +%T), $N hard questions, $STRATEGIES"
  FLEET_COMMIT="$(cat COMMIT 2>/dev/null)" timeout "${RUN_TIMEOUT:-420}" dist/argo-exp compare --sweep \
      --model /tmp/q7b --dtype bf16 --gpu-mode single \
      --dataset dist/carry/oran-bench-13k --difficulty hard --n-questions "$N" \
      --strategies "$STRATEGIES" \
      --index dist/carry/argo-index --embedder dist/carry/minilm16 --embed-device cuda:0 \
      --max-batch "${MAX_BATCH:-128}" --max-in-flight "${MAX_IN_FLIGHT:-1024}" \
      --out "$WORK/real"
  echo "### exit $? $(date -u +%T)"
} > "$LOG" 2>&1
tail -30 "$LOG"
mkdir -p "$RUN/real"
cp "$WORK"/real/summary.json "$WORK"/real/records.jsonl "$RUN/real/" 2>/dev/null
ls -la "$WORK/real" >> "$LOG"
tar czf "$OUT/argo_resume.tgz" -C "$WORK" real
tar czf "$OUT/argo_speed.tgz" -C "$OUT" argo_speed && rm -rf "$RUN"
