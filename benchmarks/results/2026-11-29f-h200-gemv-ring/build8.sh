set -euo pipefail
cd /work/main
source scripts/cuda/env.sh
json=$(mktemp)
cargo test --release --no-run -p fleet-models --features fleet-models/cuda --lib --message-format=json-render-diagnostics > "$json"
stage=/tmp/stage_lib; rm -rf $stage; mkdir -p $stage
python3 - "$json" "$stage" <<'PY'
import json, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
for line in open(src):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        shutil.copy(m["executable"], f"{dst}/{m['target']['name']}")
PY
strip "$stage"/*
(cd "$stage" && tar cf - . | xz -T2 -9e > /work/main/dist/carry/lib-tests.tar.xz)
