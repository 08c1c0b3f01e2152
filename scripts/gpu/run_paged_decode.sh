#!/usr/bin/env bash
# Issue 26 on one GPU: decode on the paged KV cache (continuous batching) against the static
# left-padded batch and transformers, in one call, at the same batches.
#
# Carried: dist/carry/fleet.xz (scripts/cuda/build.sh -p fleet, stripped, xz).
#   PART=speed    7B shape (configs/models/qwen2.5-7b.json, random bf16 weights), prompt 512,
#                 128 new tokens, batches $BATCHES: fleet static, fleet continuous,
#                 transformers (benches/transformers_generate.py) — fleet_7b_*.json, hf_7b.json
#   PART=variable 0.5B shape, $VAR_REQUESTS requests with GSM8K-like reply lengths through 32
#                 and 64 decode slots, static batches vs continuous — fleet_05b_variable.json
# Writes $OUT/<part>.log and the JSON reports.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_paged_decode}"
PART="${PART:-speed}"
BATCHES="${BATCHES:-1,8,32,64}"
VAR_REQUESTS="${VAR_REQUESTS:-192}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/$PART.log") 2>&1
F=/tmp/fleet
xz -dc dist/carry/fleet.xz > "$F" && chmod +x "$F"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
"$F" --version
case "$PART" in
  speed)
    C=configs/models/qwen2.5-7b.json
    for mode in static continuous; do
      echo "== fleet $mode"
      "$F" bench generate --config "$C" --batch "$BATCHES" --prompt-len 512 --new-tokens 128 \
        --repeats 2 --batching "$mode" --json "$OUT/fleet_7b_$mode.json"
    done
    echo "== transformers"
    python3 benches/transformers_generate.py --config "$C" --dtype bf16 --prompt-len 512 \
      --new-tokens 128 --batch "$BATCHES" --device cuda --json "$OUT/hf_7b.json"
    ;;
  variable)
    echo "== fleet 0.5B variable lengths"
    "$F" bench generate --config configs/models/qwen2.5-0.5b.json --batch 32,64 --prompt-len 256 \
      --new-tokens 384 --repeats 1 --batching continuous --variable-lengths "$VAR_REQUESTS" \
      --json "$OUT/fleet_05b_variable.json"
    ;;
esac
echo "== done"
