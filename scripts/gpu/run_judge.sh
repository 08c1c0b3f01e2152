#!/usr/bin/env bash
# edit-score's judge on GPUs, end to end with the bundled tiny judge (random weights: replies
# are parse failures, counted): the demo on every visible GPU (one replica per GPU, the ones
# after the first in child processes), the same with the replica process of GPU 1 dying on its
# first batch (its batches must go to GPU 0 and the failure be reported), and one GPU alone.
# Carried: dist/judge/edit-score.xz (scripts/cuda/build.sh -p edit-score, then xz).
#
#   bash scripts/gpu/run_judge.sh      # on nvidia-h200-x2; results in $OUT/judge/
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R="$OUT/judge"
mkdir -p "$R"
BIN=/tmp/judge_work/edit-score
mkdir -p /tmp/judge_work
xz -dc dist/judge/edit-score.xz > "$BIN" && chmod +x "$BIN"
export FLEET_COMMIT="$(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1

run() { # name, extra env/flags...
  local name="$1"; shift
  local start end
  start=$(date +%s%N)
  env "$@" > "$R/$name.log" 2>&1
  echo "exit $?" >> "$R/$name.log"
  end=$(date +%s%N)
  echo "$name: $(( (end - start) / 1000000 )) ms (load, judging and report)" | tee -a "$R/times.txt"
  for f in run.json report.json report.md scores.jsonl; do
    [ -f "/tmp/judge_work/$name/$f" ] && cp "/tmp/judge_work/$name/$f" "$R/$name.$f"
  done
  grep -E "replica|stopped|call\(s\)|Error|error" "$R/$name.log" | head -20
}

run dp "$BIN" --demo --output /tmp/judge_work/dp --gpu-mode data-parallel --batch-size 2 --no-progress
run dead FLEET_REPLICA_EXIT_AFTER=0 "$BIN" --demo --output /tmp/judge_work/dead --gpu-mode data-parallel --batch-size 2 --no-progress
run single "$BIN" --demo --output /tmp/judge_work/single --gpu-mode single --batch-size 2 --no-progress
run resume "$BIN" --demo --output /tmp/judge_work/dp --gpu-mode data-parallel --batch-size 2 --no-progress
