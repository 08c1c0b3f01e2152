#!/usr/bin/env bash
# Data-parallel generation through fleet's planned path (`fleet generate --gpu-mode
# data-parallel`), replicas in threads of one process (FLEET_REPLICA_PROCESSES=0) against
# replicas in processes of their own (the default), on random checkpoints saved by
# transformers. Run from the repo root on a machine with several GPUs (4 or 8), with
# dist/carry/fleet.xz (CUDA build) and dist/carry/benchtok/ (scripts/gpu/make_bench_tokenizer.py's tokenizer):
#
#     bash scripts/gpu/run_replica_processes.sh
#
# Workloads (96 prompts per GPU of the machine): 0.5B shape, prompts of 128 tokens + 128 new,
# batches of 8 (host-bound);
# 7B shape, prompts of 512 + 128 new, batches of 32 (issue 5's workload). Each on 1, 2, 4
# (and 8) GPUs with replicas in processes (after a warm-up run), and on all GPUs in threads;
# the outputs must be identical. On 8 GPUs this is issue 5's data-parallel run through the
# jobs' own path.
# Results: $OUT/replica_processes.tgz.
set -u
export NCCL_NVLS_ENABLE=0
ORIG_LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_replica_processes}"
RUN="$OUT/replica_processes"
SCRATCH=/tmp/replica_processes
mkdir -p "$RUN" "$SCRATCH"
LOG="$RUN/log.txt"
FLEET="$SCRATCH/fleet"
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open('dist/carry/fleet.xz'), open(sys.argv[1],'wb'))" "$FLEET"
chmod +x "$FLEET"
cat COMMIT > "$RUN/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$RUN/nvidia_smi.csv" 2>&1
PYRUN=(env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" python3)

for size in 0.5b 7b; do
    [ -f "$SCRATCH/q$size/config.json" ] || "${PYRUN[@]}" scripts/gpu/make_random_checkpoint.py \
        --config "configs/models/qwen2.5-$size.json" --out "$SCRATCH/q$size" \
        --tokenizer-from dist/carry/benchtok >> "$LOG" 2>&1
done
# 96 prompts per GPU of the machine (384 on four GPUs, 768 on eight).
NGPU=$(nvidia-smi -L | grep -c '^GPU')
"${PYRUN[@]}" - "$SCRATCH" "$((96 * NGPU))" <<'EOF'
import json, random, sys
rng = random.Random(0)
for name, length in [("prompts_128", 128), ("prompts_512", 512)]:
    prompts = [[rng.randrange(32000) for _ in range(length)] for _ in range(int(sys.argv[2]))]
    json.dump({"input_ids": prompts}, open(f"{sys.argv[1]}/{name}.json", "w"))
    json.dump({"input_ids": prompts[:16]}, open(f"{sys.argv[1]}/{name}_warm.json", "w"))
EOF

gen() {  # gen NAME SIZE PROMPTS BATCH GPU_IDS PROCESSES
    local name=$1 size=$2 prompts=$3 batch=$4 ids=$5 procs=$6
    echo "### [$name] $(date -u +%T) $size gpus=$ids processes=$procs" >> "$LOG"
    FLEET_REPLICA_PROCESSES=$procs "$FLEET" generate --model "$SCRATCH/q$size" --dtype bf16 \
        --ids-file "$SCRATCH/$prompts.json" --max-new-tokens 128 --gpu-mode data-parallel \
        --gpu-ids "$ids" --max-batch "$batch" > "$SCRATCH/$name.jsonl" 2> "$SCRATCH/$name.err"
    echo "### [$name] exit=$?" >> "$LOG"
    grep -v "^\s*$" "$SCRATCH/$name.err" | grep -v "batches" | tail -5 >> "$LOG"
    echo "$name $(grep -o 'generated.*' "$SCRATCH/$name.err")" >> "$RUN/table.txt"
}

# 1, 2, 4, 8 GPUs, as many as there are; threads against processes on all of them.
COUNTS=""
for n in 1 2 4 8; do [ "$n" -le "$NGPU" ] && COUNTS="$COUNTS $n"; done
ids_of() { seq -s, 0 $(($1 - 1)); }
for size in 0.5b 7b; do
    if [ "$size" = 0.5b ]; then p=prompts_128 b=8; else p=prompts_512 b=32; fi
    # Warm-up: the first process on a fresh machine JIT-compiles the kernels (cached after).
    gen "${size}_warmup" "$size" "${p}_warm" "$b" 0 1
    for n in $COUNTS; do
        gen "${size}_${n}_processes" "$size" "$p" "$b" "$(ids_of "$n")" 1
    done
    gen "${size}_${NGPU}_threads" "$size" "$p" "$b" "$(ids_of "$NGPU")" 0
    for f in "$SCRATCH/${size}"_*_processes.jsonl "$SCRATCH/${size}_${NGPU}_threads.jsonl"; do
        v=$(basename "$f" .jsonl)
        if cmp -s "$SCRATCH/${size}_1_processes.jsonl" "$f"; then
            echo "$v: outputs identical to one GPU's" >> "$RUN/table.txt"
        else
            echo "$v: outputs DIFFER from one GPU's" >> "$RUN/table.txt"
        fi
    done
done
cat "$RUN/table.txt"
tar czf "$OUT/replica_processes.tgz" -C "$OUT" replica_processes && rm -rf "$RUN"
