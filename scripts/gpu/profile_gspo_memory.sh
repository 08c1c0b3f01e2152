#!/usr/bin/env bash
# Where gspo-train's peak GPU memory comes from (issue 10's memory goal): FLEET_PROFILE=1 runs of
# scripts/gpu/profile_gspo.sh, 8 steps of configs/gspo/bench.toml each, printing per coarse stage
# the driver's peak, the allocator's live-buffer peak and its pool's reserved peak, and the
# metrics' per-step peaks. Cases: bf16 masters 1.5B with micro-batch 16 and the same batch as
# 2 x 8 (gradient accumulation), bf16 0.5B, f32 masters 1.5B (CASES picks some). Carried:
# dist/carry/gspo-train.xz.
# Writes $OUT/all.tgz.
set -u
export NCCL_NVLS_ENABLE=0
OUT="${OUT:-$PWD/out_profile_memory}"
mkdir -p "$OUT"
run() {
  local name=$1; shift
  mkdir -p "$OUT/$name"
  env OUT="$OUT/$name" BIN=dist/carry/gspo-train.xz PROFILE_STEPS=8 "$@" \
    bash scripts/gpu/profile_gspo.sh > /dev/null 2>&1
  echo "== $name"
  grep -hE 'profile (train|optim|rollout)' "$OUT/$name"/*.txt
  python3 - "$OUT/$name" <<'PY'
import json, sys, pathlib
for f in pathlib.Path(sys.argv[1]).glob("*.metrics.jsonl"):
    m = [json.loads(l) for l in f.read_text().splitlines()]
    print("peak GiB", [round(r["peak_memory_bytes"]["cuda:0"] / 2**30, 2) for r in m],
          "step s", [round(r["step_time"], 2) for r in m])
PY
}
bf16="--torch-dtype bfloat16"
mb8="--set per_device_train_batch_size=8 --set steps_per_generation=8 --set gradient_accumulation_steps=2"
for c in ${CASES:-bf16-1.5b-b16 bf16-1.5b-b8x2 bf16-0.5b-b16 f32-1.5b-b16}; do
  case "$c" in
    bf16-1.5b-b16) run "$c" SHAPES=1.5b EXTRA="$bf16" ;;
    bf16-1.5b-b8x2) run "$c" SHAPES=1.5b EXTRA="$bf16 $mb8" ;;
    bf16-0.5b-b16) run "$c" SHAPES=0.5b EXTRA="$bf16" ;;
    f32-1.5b-b16) run "$c" SHAPES=1.5b EXTRA="" ;;
    *) echo "unknown case $c" ;;
  esac
done
(cd "$OUT" && tar czf all.tgz --exclude all.tgz */ && rm -rf -- */)
