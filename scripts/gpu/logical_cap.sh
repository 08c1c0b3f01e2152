#!/usr/bin/env bash
# Issue 24: is a logical device's memory cap real? The Qwen2.5-0.5B shape (about 1 GiB of bf16
# weights, random, built on the GPU) on one logical device capped at 512 MiB must fail out of
# memory while the GPU has ~80 GiB free; capped at 8 GiB it runs, split over 2 logical devices
# too; the peak per logical device is reported from its pool. Carry dist/cuda/fleet.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
F=dist/cuda/fleet
R="$OUT/logical_cap"; mkdir -p "$R"
nvidia-smi -L > "$R/nvidia-smi.txt"
C=configs/models/qwen2.5-0.5b.json
B="bench generate --config $C --dtype bf16 --prompt-len 128 --new-tokens 16 --batch 4 --repeats 1"
$F --logical-gpus 1:512MiB $B --device cuda:0 --json "$R/cap512m.json" > "$R/cap512m.log" 2>&1
echo "1 x 512 MiB: exit $? ($(grep -ioE 'out of memory|OUT_OF_MEMORY' "$R/cap512m.log" | head -1))"; tail -2 "$R/cap512m.log"
$F --logical-gpus 1:8GiB $B --device cuda:0 --json "$R/cap8g.json" > "$R/cap8g.log" 2>&1
echo "1 x 8 GiB: exit $?"; tail -2 "$R/cap8g.log"
$F --logical-gpus 2:8GiB $B --device cuda:0,cuda:1 --json "$R/cap8g-x2.json" > "$R/cap8g-x2.log" 2>&1
echo "2 x 8 GiB: exit $?"; tail -2 "$R/cap8g-x2.log"
$F $B --device cuda:0 --json "$R/physical.json" > "$R/physical.log" 2>&1
echo "physical: exit $?"; tail -2 "$R/physical.log"
grep -h "peak\|logical\|capped" "$R"/*.log | sort | uniq -c | head -20
