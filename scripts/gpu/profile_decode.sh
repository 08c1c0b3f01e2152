#!/usr/bin/env bash
# Where a decode step's GPU time goes, kernel by kernel: ncu (duration and DRAM bytes of every
# launch, caches flushed before each) over the timed run of `fleet bench generate` only
# (`--cuda-profile-range` with `ncu --profile-from-start off`: not the model's build or the
# warm-up): continuous batching without graphs (`--enforce-eager`: the kernels a graph replays),
# prompt PROMPT tokens (default 16; 512 for the bench's decode shape), NEW new tokens.
# scripts/gpu/decode_profile.py then sums its last decode steps by kernel. Clocks run free
# (`--clock-control none`, NCU_CLOCKS); before 2026-11-28 ncu's default locked them to base.
# NCU_CACHE=none keeps the caches between launches (to see what an L2 prefetch left there).
# NCU_METRICS: more metrics (comma-separated) for the CSV in ncu.tar (the parsed step ignores them);
# TAG: a suffix for the file names (decode_<shape>_b<batch>_<TAG>.txt).
#
# Carried: dist/carry/fleet.xz. SHAPES: shape:batch pairs (default "7b:1 7b:64 0.5b:64").
# Writes $OUT/decode_<shape>_b<batch>.txt (the parsed step), $OUT/profile.log and $OUT/ncu.tar
# (each run's ncu_<shape>_b<batch>.csv.xz and its stderr). Run from the repo root.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_profile}"
NEW="${NEW:-6}"
SHAPES="${SHAPES:-7b:1 7b:64 0.5b:64}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/profile.log") 2>&1
F=/tmp/fleet
xz -dc dist/carry/fleet.xz > "$F" && chmod +x "$F"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
"$NCU" --version | tail -1
# The card's spec bandwidth for the percentages: H200 4.8 TB/s, else an H100 SXM's 3.35.
BW=3.35e12
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && BW=4.8e12
for s in $SHAPES; do
  shape=${s%%:*}; batch=${s##*:}
  cfg="configs/models/qwen2.5-$shape.json"
  layers=$(python3 -c "import json; print(json.load(open('$cfg'))['num_hidden_layers'])")
  name="${shape}_b$batch${TAG:+_$TAG}"
  echo "== $shape batch $batch ($layers layers), $NEW new tokens"
  timeout 300 "$NCU" --profile-from-start off --clock-control "${NCU_CLOCKS:-none}" \
    --cache-control "${NCU_CACHE:-all}" --csv --print-units base --metrics \
    gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size${NCU_METRICS:+,$NCU_METRICS} \
    "$F" bench generate --config "$cfg" --batch "$batch" --prompt-len "${PROMPT:-16}" --new-tokens "$NEW" \
    --repeats 1 --batching continuous --enforce-eager --cuda-profile-range \
    > "$OUT/ncu_$name.csv" 2> "$OUT/ncu_$name.err"
  echo "rc $? $(wc -l < "$OUT/ncu_$name.csv") lines"
  python3 scripts/gpu/decode_profile.py "$OUT/ncu_$name.csv" --layers "$layers" \
    --steps $((NEW - 3)) --bandwidth "$BW" | tee "$OUT/decode_$name.txt"
  xz -T8 "$OUT/ncu_$name.csv"
done
# A call brings back at most 8 files: the parsed steps stay beside the log, the rest in one
# archive.
# The archive is written outside $OUT: tar fails on a directory that changes as it reads it.
tmp=$(mktemp)
(cd "$OUT" && tar cf "$tmp" --exclude profile.log --exclude 'decode_*.txt' . \
  && find . -maxdepth 1 -type f ! -name profile.log ! -name 'decode_*.txt' -delete) \
  && mv "$tmp" "$OUT/ncu.tar"
echo "== done"
