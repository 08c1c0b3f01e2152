#!/usr/bin/env bash
# Builds what scripts/gpu/run_paged_decode.sh carries, on this (CPU) machine: the CUDA test
# binaries of fleet-models that generation relies on, stripped, in dist/carry/paged-tests.tar.xz
# (the library's unit tests as `fleet_models`, and paged_generation, generation, parity,
# qwen3_vl_parity, paged_attention, decode_graph_segments, ops_grad, train_grads; four of them
# again in two-gpu-tests.tar.xz), then the four binaries (scripts/cuda/build.sh) as
# dist/carry/<name>.xz. About 5 minutes on 2 cores, then xz.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/cuda/env.sh
json=$(mktemp)
cargo test --release --no-run -p fleet-models --features fleet-models/cuda --lib \
  --test paged_generation --test generation --test parity --test qwen3_vl_parity \
  --test paged_attention --test decode_graph_segments --test ops_grad --test train_grads \
  --message-format=json-render-diagnostics > "$json"
stage=$(mktemp -d)
python3 - "$json" "$stage" <<'PY'
import json, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
for line in open(src):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") \
            and m.get("executable"):
        shutil.copy(m["executable"], f"{dst}/{m['target']['name']}")
PY
strip "$stage"/*
mkdir -p dist/carry
(cd "$stage" && tar cf - . | xz -T2 -9e > "$OLDPWD/dist/carry/paged-tests.tar.xz")
# The four that run_two_gpu_checks.sh runs, small enough to carry beside gspo-train.
(cd "$stage" && tar cf - ./decode_graph_segments ./parity ./qwen3_vl_parity ./train_grads \
  | xz -T2 -9e > "$OLDPWD/dist/carry/two-gpu-tests.tar.xz")
rm -rf "$stage" "$json"
git rev-parse --short HEAD > COMMIT
bash scripts/cuda/build.sh -p fleet -p argo-exp -p gspo-train -p edit-score
for b in fleet argo-exp gspo-train edit-score; do
  xz -T2 -6 -c "dist/cuda/$b" > "dist/carry/$b.xz"
done
ls -la dist/carry
