#!/usr/bin/env bash
# The GPU session of the topology issue, in one command, on a machine with 4 GPUs
# (nvidia-h200-x4). Run from the repo root with the stripped CUDA binary at dist/cuda/fleet:
#
#     bash scripts/gpu/run_topology.sh
#
# Steps (each logged with its exit code; a failure does not stop the next step):
#   devices    fleet devices (table with peer access) and --json
#   plan_*     fleet plan --topology live for the 7B, 32B and 72B shapes
#   dp_N       fleet bench data-parallel, 7B shape, N = 1, 2, 4 replicas
#   boundary_* fleet bench generate, 7B shape, batch 1: one GPU, split over 2 GPUs (peer
#              access on and off), split over 4 GPUs (3 boundaries)
#   peak_32b   fleet bench generate, 32B shape on one GPU (peak memory vs plan)
#   gen_dp_*   fleet generate --ids-file --gpu-mode data-parallel on a random 0.5B checkpoint
#              saved by transformers (the jobs' planned path: headers -> plan -> replicas)
#
# Everything lands in $OUT (default ./out_topology): log.txt and one JSON per step, packed at
# the end into $OUT.tgz (the device machine returns only a few files).
set -u
export NCCL_NVLS_ENABLE=0
ORIG_LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

OUT="${OUT:-$PWD/out_topology}"
FLEET="${FLEET:-dist/cuda/fleet}"
SCRATCH="${SCRATCH:-/tmp/fleet_topology}"
BATCHES="${BATCHES:-12}"
mkdir -p "$OUT" "$SCRATCH"
LOG="$OUT/log.txt"
: > "$LOG"

step() {  # step NAME CMD... ; stdout+stderr to the log and $SCRATCH/NAME.txt
    local name=$1
    shift
    echo "### [$name] $(date -u +%H:%M:%S) $*" | tee -a "$LOG"
    local t0 t1
    t0=$(date +%s.%N)
    "$@" > "$SCRATCH/$name.txt" 2>&1
    local rc=$?
    t1=$(date +%s.%N)
    tail -n 40 "$SCRATCH/$name.txt" >> "$LOG"
    echo "### [$name] exit=$rc ($(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')s)" | tee -a "$LOG"
}

git rev-parse HEAD 2>/dev/null > "$OUT/commit.txt" || cp COMMIT "$OUT/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv > "$OUT/nvidia_smi.csv" 2>&1
nvidia-smi topo -m > "$OUT/nvidia_smi_topo.txt" 2>&1

step devices "$FLEET" devices
step devices_json "$FLEET" devices --json
cp "$SCRATCH/devices.txt" "$OUT/devices.txt"
cp "$SCRATCH/devices_json.txt" "$OUT/devices.json"

for size in 7b 32b 72b; do
    step "plan_$size" "$FLEET" plan --model "configs/models/qwen2.5-$size.json" --topology live \
        --mode auto --batch 8 --seq-len 640
    cp "$SCRATCH/plan_$size.txt" "$OUT/plan_$size.txt"
done
# The plan for the exact workload of peak_32b below.
step plan_32b_single "$FLEET" plan --model configs/models/qwen2.5-32b.json --topology live \
    --mode single --batch 16 --seq-len 640 --json
cp "$SCRATCH/plan_32b_single.txt" "$OUT/plan_32b_single.json"

# Data-parallel scaling: 12 batches of 32 x (512 + 128) per replica, each replica's busy time.
for devs in cuda:0 cuda:0,cuda:1 cuda:0,cuda:1,cuda:2,cuda:3; do
    n=$(echo "$devs" | tr ',' '\n' | wc -l)
    step "dp_$n" "$FLEET" bench data-parallel --config configs/models/qwen2.5-7b.json \
        --dtype bf16 --devices "$devs" --batch 32 --batches-per-replica "$BATCHES" \
        --prompt-len 512 --new-tokens 128 --json "$OUT/dp_$n.json"
done

# The cost of a layer boundary at batch-1 decode.
bench7() {  # bench7 NAME DEVICES [ENV...]
    local name=$1 devs=$2
    shift 2
    step "boundary_$name" env "$@" "$FLEET" bench generate --config configs/models/qwen2.5-7b.json \
        --dtype bf16 --device "$devs" --batch 1 --prompt-len 512 --new-tokens 128 \
        --repeats 3 --json "$OUT/boundary_$name.json"
}
bench7 1gpu cuda:0
bench7 2gpu cuda:0,cuda:1
bench7 2gpu_no_peer cuda:0,cuda:1 FLEET_PEER_ACCESS=0
bench7 4gpu cuda:0,cuda:1,cuda:2,cuda:3

# Peak memory of the 32B shape on one GPU against the plan.
step peak_32b "$FLEET" bench generate --config configs/models/qwen2.5-32b.json --dtype bf16 \
    --device cuda:0 --batch 1,16 --prompt-len 512 --new-tokens 128 --json "$OUT/peak_32b.json"

# The planned path of the jobs on a real checkpoint directory.
PYRUN=(env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" python3)
step make_05b "${PYRUN[@]}" scripts/gpu/parity_bf16.py make --config configs/models/qwen2.5-0.5b.json \
    --out "$SCRATCH/q05" --device cuda --n-seqs 1 --seq-len 16 --no-eager
"${PYRUN[@]}" - "$SCRATCH/prompts.json" <<'EOF'
import json, random, sys
rng = random.Random(0)
prompts = [[rng.randrange(151000) for _ in range(rng.randrange(64, 512))] for _ in range(512)]
json.dump({"input_ids": prompts}, open(sys.argv[1], "w"))
EOF
step plan_05b_checkpoint "$FLEET" plan --model "$SCRATCH/q05/model" --topology live \
    --mode data-parallel --batch 64 --seq-len 640
cp "$SCRATCH/plan_05b_checkpoint.txt" "$OUT/plan_05b_checkpoint.txt"
for ids in 0 0,1,2,3; do
    name="gen_dp_$(echo "$ids" | tr ',' '\n' | wc -l)"
    step "$name" bash -c "s=\$(date +%s.%N); '$FLEET' generate --model '$SCRATCH/q05/model' \
        --dtype bf16 --ids-file '$SCRATCH/prompts.json' --max-new-tokens 128 \
        --gpu-mode data-parallel --gpu-ids $ids --max-batch 64 > '$SCRATCH/$name.jsonl'; \
        rc=\$?; e=\$(date +%s.%N); \
        echo \"lines \$(wc -l < '$SCRATCH/$name.jsonl') tokens \$(grep -o '\"token_ids\":\[[^]]*\]' '$SCRATCH/$name.jsonl' | tr ',' '\n' | wc -l) wall_s \$(awk -v a=\$s -v b=\$e 'BEGIN{print b-a}')\"; exit \$rc"
done
# Same outputs whatever the number of replicas.
cmp "$SCRATCH/gen_dp_1.jsonl" "$SCRATCH/gen_dp_4.jsonl" && echo "gen_dp outputs identical" | tee -a "$LOG"
echo "done" | tee -a "$LOG"
# The device returns only a few files: pack them.
cp "$SCRATCH"/*.txt "$OUT"/ 2>/dev/null
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && rm -rf "$OUT"
