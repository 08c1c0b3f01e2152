#!/usr/bin/env bash
# ARGO's speed goal on one GPU: the seed's experiment (hard questions x 4 strategies x 10 c_r
# points, 7B model) with random Qwen2.5-7B-shaped weights and a real ingested corpus.
#
# Carried in dist/carry/: argo-exp.xz (CUDA build) and argo-data.tar.xz
# (scripts/gpu/make_argo_data.sh: the corpus, all-MiniLM-L6-v2's shape and tokenizer without
# its weights, oran-bench-13k/fin_H.json). The first call makes random embedder weights of
# that shape, the index (argo-exp ingest) and the bench tokenizer, on the GPU machine. Run
# from the repo root:
#
#     N_QUESTIONS=100 bash scripts/gpu/run_argo_speed.sh
#
# Writes $OUT/argo_speed.tgz (log, summary.json, nvidia-smi), $OUT/records.jsonl.gz and
# $OUT/argo_resume.tgz (records and LLM cache): put the latter in dist/carry/ to go on with the
# same run in a later call (RUN_TIMEOUT bounds each call; the records make it resumable).
#
# A run longer than one call's 10 minutes, measured in one piece: DETACH=1 starts it in its own
# process session (it outlives the call while the machine stays held) and waits up to WAIT
# seconds; call again with DETACH=1 at once (the machine goes back when idle) to wait on, and
# the call that sees it finish copies argo_speed.tgz to $OUT.
#
#     DETACH=1 N_QUESTIONS=1000 RUN_TIMEOUT=1500 bash scripts/gpu/run_argo_speed.sh
#
# BATCHING=static runs lock-step rounds instead of continuous batching (KV_GIB: the paged
# cache's GiB; NUM_SCHEDULER_STEPS: decode steps between two reads of their tokens). The
# defaults, 384 decode slots and a 96 GiB pool, are the fastest measured on one H200
# (2026-11-29c: 3.8 min; 512 slots no faster); on an 80 GB H100 use KV_GIB=48; KV_GIB=auto
# leaves the flag out (argo-exp then takes what the placement leaves beside the model).
# GPU_MODE=data-parallel spreads the LLM over every GPU (replicas after the first in processes
# of their own); WORK=/tmp/other keeps a second run's records and cache apart.
set -u
if [ "${DETACH:-0}" = 1 ]; then
  WORK="${WORK:-/tmp/argo_speed}"
  mkdir -p "$WORK"
  if [ ! -f "$WORK/started" ]; then
    date -u +%T > "$WORK/started"
    DETACH=0 RESUME_TGZ=0 OUT="$WORK/out" WORK="$WORK" setsid nohup bash "$0" > "$WORK/detached.log" 2>&1 < /dev/null &
  fi
  deadline=$((SECONDS + ${WAIT:-540}))
  while [ $SECONDS -lt $deadline ] && [ ! -f "$WORK/out/argo_speed.tgz" ]; do sleep 5; done
  echo "started $(cat "$WORK/started"), now $(date -u +%T)"
  tail -3 "$WORK/out/argo_speed/log.txt" 2>/dev/null
  if [ -f "$WORK/out/argo_speed.tgz" ]; then
    cp "$WORK/out/argo_speed.tgz" "${OUT:?}/"
    # Per-job records come back when they fit what a call returns (16 MiB a file).
    if [ "$(stat -c %s "$WORK/out/records.jsonl.gz")" -lt 16000000 ]; then cp "$WORK/out/records.jsonl.gz" "$OUT/"; fi
    tar xzf "$WORK/out/argo_speed.tgz" -O argo_speed/log.txt | tail -30
  else
    echo "still running: call again with DETACH=1"
  fi
  exit 0
fi
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
# The binary and data are unpacked under $WORK: a later call's transfer cannot touch them.
BIN="$WORK/argo-exp"
DATA="$WORK/data"
mkdir -p "$DATA"
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open('dist/carry/argo-exp.xz'), open(sys.argv[1],'wb'))" "$BIN"
tar xJf dist/carry/argo-data.tar.xz -C "$DATA"
chmod +x "$BIN"
# A run split over several calls: the previous call's records and LLM cache come back in.
if [ -f dist/carry/argo_resume.tgz ] && [ ! -d "$WORK/real" ]; then
  tar xzf dist/carry/argo_resume.tgz -C "$WORK"
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$RUN/nvidia_smi.csv" 2>&1
# GPU utilisation every 5 s: shows where the run waits on the CPU.
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$RUN/gpu_util.csv" 2>&1 &
SMI_PID=$!
cat COMMIT > "$RUN/commit.txt" 2>/dev/null
{
  # argo-data from scripts/gpu/make_argo_data.sh carries the corpus and the embedder's shape,
  # not the embedder's weights (too large to carry beside the code): random weights of that
  # shape, the index and the bench tokenizer are made here (older archives hold them built).
  PY="env LD_LIBRARY_PATH=$ORIG_LD_LIBRARY_PATH python3"
  EMB="$DATA/minilm16"
  if [ -d "$DATA/minilm-config" ]; then
    EMB="$DATA/embedder"
    [ -f "$EMB/model.safetensors" ] || $PY scripts/gpu/make_random_embedder.py \
        --from "$DATA/minilm-config" --out "$EMB"
  fi
  if [ ! -f "$DATA/benchtok/tokenizer.json" ]; then
    echo "### bench tokenizer $(date -u +%T)"
    $PY scripts/gpu/make_bench_tokenizer.py --text "$DATA/corpus" \
        --text "$DATA/oran-bench-13k/fin_H.json" --out "$DATA/benchtok" \
        --template-from tests/fixtures/qwen2-tiny
  fi
  if [ ! -d "$DATA/argo-index" ]; then
    echo "### ingest $(date -u +%T)"
    "$BIN" ingest --docs "$DATA/corpus" --index "$DATA/argo-index" --embedder "$EMB" \
        --embed-device cuda:0
  fi
  if [ ! -f /tmp/q7b/config.json ]; then
    echo "### make checkpoint $(date -u +%T)"
    env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" python3 scripts/gpu/make_random_checkpoint.py \
        --config configs/models/qwen2.5-7b.json --out /tmp/q7b --tokenizer-from "$DATA/benchtok"
  fi
  # KV_GIB=auto leaves --kv-cache-gib out: argo-exp sizes the pool from the placement.
  KV_FLAG=()
  [ "${KV_GIB:-96}" = auto ] || KV_FLAG=(--kv-cache-gib "${KV_GIB:-96}")
  echo "### compare --sweep $(date -u +%T), $N hard questions, $STRATEGIES"
  FLEET_COMMIT="$(cat COMMIT 2>/dev/null)" timeout "${RUN_TIMEOUT:-420}" "$BIN" compare --sweep \
      --model /tmp/q7b --dtype bf16 --gpu-mode "${GPU_MODE:-single}" \
      --dataset "$DATA/oran-bench-13k" --difficulty hard --n-questions "$N" \
      --strategies "$STRATEGIES" \
      --index "$DATA/argo-index" --embedder "$EMB" --embed-device cuda:0 \
      --max-batch "${MAX_BATCH:-384}" --max-in-flight "${MAX_IN_FLIGHT:-1024}" \
      --batching "${BATCHING:-continuous}" ${KV_FLAG[@]+"${KV_FLAG[@]}"} \
      --num-scheduler-steps "${NUM_SCHEDULER_STEPS:-1}" \
      --out "$WORK/real"
  echo "### exit $? $(date -u +%T)"
} > "$LOG" 2>&1
kill "$SMI_PID" 2>/dev/null
tail -30 "$LOG"
mkdir -p "$RUN/real"
cp "$WORK"/real/summary.json "$RUN/real/" 2>/dev/null
gzip -c "$WORK"/real/records.jsonl > "$OUT/records.jsonl.gz"
ls -la "$WORK/real" >> "$LOG"
[ "${RESUME_TGZ:-1}" = 1 ] && tar czf "$OUT/argo_resume.tgz" -C "$WORK" real
tar czf "$OUT/argo_speed.tgz" -C "$OUT" argo_speed && rm -rf "$RUN"
