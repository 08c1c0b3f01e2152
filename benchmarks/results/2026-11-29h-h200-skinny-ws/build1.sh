set -euo pipefail
cd /work/main
source scripts/cuda/env.sh
json=$(mktemp)
cargo test --release --no-run -p fleet-models --features fleet-models/cuda --lib --test paged_generation --test generation --message-format=json-render-diagnostics > "$json"
stage=/tmp/stage_all; rm -rf $stage; mkdir -p $stage
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
ls $stage
(cd "$stage" && tar cf - . | xz -T2 -9e > /work/main/dist/carry/lib-tests.tar.xz)
echo TESTS DONE
bash scripts/cuda/build.sh -p fleet
xz -T2 -6 -c dist/cuda/fleet > dist/carry/fleet.xz
echo ALL DONE
