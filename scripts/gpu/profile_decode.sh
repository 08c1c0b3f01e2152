#!/usr/bin/env bash
# Where a decode step's GPU time goes, kernel by kernel (ncu: duration and DRAM bytes of every
# launch, caches flushed before each). For each shape, two runs of `fleet bench generate`
# (continuous batching, no graphs: the same kernels the graph replays) that differ only in
# new tokens (2 and NEW); the launches of the longer run past the shorter one's are decode
# steps, which scripts/gpu/decode_profile.py sums by kernel.
#
# Carried: dist/carry/fleet.xz. Writes $OUT/ncu_<shape>_<n>.csv and $OUT/profile.log.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_profile}"
NEW="${NEW:-6}"
SHAPES="${SHAPES:-7b:1 0.5b:64}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/profile.log") 2>&1
F=/tmp/fleet
xz -dc dist/carry/fleet.xz > "$F" && chmod +x "$F"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
"$NCU" --version | tail -1
for s in $SHAPES; do
  shape=${s%%:*}; batch=${s##*:}
  for n in 2 "$NEW"; do
    echo "== $shape batch $batch, $n new tokens"
    timeout 240 "$NCU" --csv --print-units base --metrics \
      gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size \
      "$F" bench generate --config "configs/models/qwen2.5-$shape.json" --batch "$batch" \
      --prompt-len 64 --new-tokens "$n" --repeats 1 --batching continuous \
      > "$OUT/ncu_${shape}_$n.csv" 2> "$OUT/ncu_${shape}_$n.err"
    echo "rc $? $(wc -l < "$OUT/ncu_${shape}_$n.csv") lines"
  done
done
xz -T8 "$OUT"/ncu_*.csv 2>/dev/null
echo "== done"
