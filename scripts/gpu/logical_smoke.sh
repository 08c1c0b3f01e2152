#!/usr/bin/env bash
# Logical devices on one GPU: a first smoke test (issue 24). Logits of tiny checkpoints on one
# device against the layers split over 2 and 3 logical devices, with both transfer waits, and
# with each wait turned off.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
F=dist/cuda/fleet
R="$OUT/logical"; mkdir -p "$R"
nvidia-smi -L > "$R/nvidia-smi.txt"
$F --logical-gpus 3:4GiB devices > "$R/devices.txt" 2>&1; cat "$R/devices.txt"
$F --logical-gpus 64:4GiB devices > "$R/devices-too-many.txt" 2>&1; echo "64x4GiB exit $?"; tail -1 "$R/devices-too-many.txt"
$F --logical-gpus 2:4GiB@5 devices > "$R/devices-bad-gpu.txt" 2>&1; echo "@5 exit $?"; tail -1 "$R/devices-bad-gpu.txt"
IDS="1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16"
for m in qwen2-tiny qwen3-tiny qwen2-tiny-tied-sharded; do
  for dt in f32 bf16; do
    $F logits --model tests/fixtures/$m --dtype $dt --ids $IDS --device cuda:0 --output "$R/$m-$dt-one.safetensors" > "$R/$m-$dt-one.log" 2>&1 || tail -3 "$R/$m-$dt-one.log"
    for n in 2 3; do
      devs=$(seq -s, -f "cuda:%g" 0 $((n-1)))
      for waits in both no-destination-wait no-source-wait; do
        FLEET_TRANSFER_WAITS=$waits $F --logical-gpus $n:4GiB logits --model tests/fixtures/$m --dtype $dt --ids $IDS --device "$devs" \
          --output "$R/$m-$dt-$n-$waits.safetensors" > "$R/$m-$dt-$n-$waits.log" 2>&1 || tail -3 "$R/$m-$dt-$n-$waits.log"
      done
    done
  done
done
python3 - "$R" <<'PY' | tee "$R/compare.txt"
import sys, glob, os
from safetensors.numpy import load_file
import numpy as np
r = sys.argv[1]
for one in sorted(glob.glob(f"{r}/*-one.safetensors")):
    base = load_file(one)["logits"].astype(np.float32)
    stem = one[: -len("-one.safetensors")]
    for other in sorted(glob.glob(f"{stem}-[23]-*.safetensors")):
        x = load_file(other)["logits"].astype(np.float32)
        d = float(np.abs(x - base).max()) if x.shape == base.shape else float("nan")
        print(f"{os.path.basename(other)}: max |diff| vs one device = {d:.3g} ({'bit-equal' if np.array_equal(x, base) else 'differs'})")
PY
