#!/usr/bin/env bash
# Host-side contention of several GPUs driven from one process (issue 5: eight replicas in one
# process ran ~20% slower each than alone, eight processes did not). On a machine with 4 GPUs,
# run from the repo root with the CUDA binary carried as dist/carry/fleet.xz:
#
#     bash scripts/gpu/run_contention.sh
#
# For cudarc's per-allocation CUDA events off (fleet's default) and on (FLEET_CUDA_EVENTS=1),
# `fleet bench data-parallel` with one replica, with N replicas in one process, and with N
# processes of one replica each, on two workloads:
#   7b   Qwen2.5-7B shape, 12 batches of 32 x (512 + 128) per replica (issue 5's workload)
#   05b  Qwen2.5-0.5B shape, 12 batches of 8 x (128 + 128): host-bound (kernel launches and
#        allocations dominate), so any per-call cost shared between threads shows at once
# plus batch-1 decode of the 7B shape on one GPU (launch-bound; what one replica gains).
# Results: $OUT/contention.tgz (log and one JSON per step).
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_contention}"
RUN="$OUT/contention"
N="${N_GPUS:-4}"
mkdir -p "$RUN"
LOG="$RUN/log.txt"
FLEET=/tmp/fleet_contention
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open('dist/carry/fleet.xz'), open(sys.argv[1],'wb'))" "$FLEET"
chmod +x "$FLEET"
cat COMMIT > "$RUN/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$RUN/nvidia_smi.csv" 2>&1
nproc > "$RUN/nproc.txt"

devices() {  # devices N -> cuda:0,...,cuda:N-1
    local out="" i
    for ((i = 0; i < $1; i++)); do out="${out:+$out,}cuda:$i"; done
    echo "$out"
}

dp() {  # dp NAME EVENTS SHAPE DEVICES
    local name=$1 ev=$2 shape=$3 devs=$4 args
    if [ "$shape" = 7b ]; then
        args=(--config configs/models/qwen2.5-7b.json --batch 32 --prompt-len 512 --new-tokens 128)
    else
        args=(--config configs/models/qwen2.5-0.5b.json --batch 8 --prompt-len 128 --new-tokens 128)
    fi
    echo "### [$name] $(date -u +%T) events=$ev $shape $devs" >> "$LOG"
    FLEET_CUDA_EVENTS=$ev "$FLEET" bench data-parallel "${args[@]}" --dtype bf16 --devices "$devs" \
        --batches-per-replica 12 --json "$RUN/$name.json" >> "$LOG" 2>&1
    echo "### [$name] exit=$?" >> "$LOG"
}

procs() {  # procs NAME EVENTS SHAPE: N processes of one replica each, at once
    local name=$1 ev=$2 shape=$3 i
    for ((i = 0; i < N; i++)); do
        dp "${name}_$i" "$ev" "$shape" "cuda:$i" &
    done
    wait
}

for ev in 0 1; do
    dp "b1_ev$ev" "$ev" 7b cuda:0 >/dev/null
    echo "### [decode_b1_ev$ev] $(date -u +%T)" >> "$LOG"
    FLEET_CUDA_EVENTS=$ev "$FLEET" bench generate --config configs/models/qwen2.5-7b.json \
        --dtype bf16 --device cuda:0 --batch 1 --prompt-len 512 --new-tokens 128 --repeats 3 \
        --json "$RUN/decode_b1_ev$ev.json" >> "$LOG" 2>&1
    for shape in 05b 7b; do
        dp "${shape}_1_ev$ev" "$ev" "$shape" cuda:0
        dp "${shape}_${N}_ev$ev" "$ev" "$shape" "$(devices "$N")"
        procs "${shape}_proc${N}_ev$ev" "$ev" "$shape"
    done
done
rm -f "$RUN"/b1_ev*.json
# One line per step: name, replicas, new tok/s (wall), per replica busy rate.
python3 - "$RUN" > "$RUN/table.txt" <<'EOF'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(p.read_text())
    if "replicas" in d:
        busy = [round(r["new_tok_s_while_busy"], 1) for r in d["replicas"]]
        print(f"{p.stem:24} {len(busy)} replica(s) {d['decode_tok_s']:10.1f} tok/s  busy rates {busy}")
    else:
        print(f"{p.stem:24} {json.dumps(d)[:300]}")
EOF
cat "$RUN/table.txt"
tar czf "$OUT/contention.tgz" -C "$OUT" contention && rm -rf "$RUN"
