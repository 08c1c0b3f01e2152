#!/usr/bin/env bash
# One device call for issue 10's memory and speed goal on one GPU: the CUDA kernel tests that
# training relies on (fused AdamW in f32 and bf16 against the composed step; the decoder's and
# the head's kernels against their CPU twins), a profiled bf16-master run of the 1.5B shape
# (peak memory per stage), then gspo-train against TRL (scripts/gpu/run_gspo_vs_trl.sh).
#
# Carried: dist/carry/gspo-train.xz, dist/carry/gpu-tests.tar.xz (test executables `optim`
# = fleet-gspo's lib tests and `ops_grad`, `parity` = fleet-models' integration tests, built
# with `cargo test --no-run --release --features cuda` and scripts/cuda/env.sh sourced; they
# find tests/fixtures through the checkout path they were built at, $BUILT_AT), .whl (TRL).
# Run from the repo root:
#
#     BUILT_AT=/work/main SHAPES="0.5b 1.5b" STEPS=12 bash scripts/gpu/run_gspo_memory.sh
#
# Writes $OUT/tests.log, $OUT/gspo_vs_trl.json, $OUT/log.txt and $OUT/all.tgz (the rest).
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_gspo_memory}"
export WORK="${WORK:-/tmp/gb}"
mkdir -p "$OUT" "$WORK/tests"
# The test executables look for the fixtures where they were built.
if [ -n "${BUILT_AT:-}" ] && [ ! -e "$BUILT_AT" ]; then
  mkdir -p "$(dirname "$BUILT_AT")" && ln -sfn "$PWD" "$BUILT_AT"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/tests.log"
if [ -f dist/carry/gpu-tests.tar.xz ]; then
  xz -dc dist/carry/gpu-tests.tar.xz | tar xf - -C "$WORK/tests"
  for t in "optim fused_gpu" "ops_grad kernels_match" "parity"; do
    set -- $t
    echo "== $*" >> "$OUT/tests.log"
    timeout 300 "$WORK/tests/$1" ${2:-} --test-threads 1 --nocapture >> "$OUT/tests.log" 2>&1
    echo "== $*: exit $?" >> "$OUT/tests.log"
  done
  grep -E '^== |test result|worst|panicked' "$OUT/tests.log"
fi
mkdir -p "$OUT/profile"
OUT="$OUT/profile" SHAPES="${PROFILE_SHAPES:-1.5b}" PROFILE_STEPS=8 EXTRA="--torch-dtype bfloat16" \
  BIN=dist/carry/gspo-train.xz bash scripts/gpu/profile_gspo.sh
python3 - "$OUT/profile" <<'EOF'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.metrics.jsonl")):
    m = [json.loads(l) for l in f.read_text().splitlines()]
    print(f.name, "peak GiB per step:", [round(r["peak_memory_bytes"]["cuda:0"] / 2**30, 2) for r in m])
EOF
mkdir -p "$OUT/vs"
OUT="$OUT/vs" bash scripts/gpu/run_gspo_vs_trl.sh
cp "$OUT/vs/gspo_vs_trl.json" "$OUT/" 2>/dev/null
(cd "$OUT" && tar czf all.tgz profile vs && rm -rf profile vs)
