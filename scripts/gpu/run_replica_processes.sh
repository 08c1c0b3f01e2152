#!/usr/bin/env bash
# Data-parallel generation through fleet's planned path (`fleet generate --gpu-mode
# data-parallel`), replicas in threads of one process (FLEET_REPLICA_PROCESSES=0) against
# replicas in processes of their own (the default), on random checkpoints saved by
# transformers. Run from the repo root on a machine with 4 GPUs, with dist/carry/fleet.xz
# (CUDA build) and dist/carry/benchtok/ (scripts/gpu/make_bench_tokenizer.py's tokenizer):
#
#     bash scripts/gpu/run_replica_processes.sh
#
# Workloads: 0.5B shape, 384 prompts of 128 tokens + 128 new, batches of 8 (host-bound);
# 7B shape, 384 prompts of 512 + 128 new, batches of 32 (issue 5's workload). Each on GPU 0
# alone (after a warm-up run), on 2 GPUs in processes, on 4 GPUs in threads and in processes;
# the outputs must be identical.
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
"${PYRUN[@]}" - "$SCRATCH" <<'EOF'
import json, random, sys
rng = random.Random(0)
for name, length in [("prompts_128", 128), ("prompts_512", 512)]:
    prompts = [[rng.randrange(32000) for _ in range(length)] for _ in range(384)]
    json.dump({"input_ids": prompts}, open(f"{sys.argv[1]}/{name}.json", "w"))
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

for size in 0.5b 7b; do
    if [ "$size" = 0.5b ]; then p=prompts_128 b=8; else p=prompts_512 b=32; fi
    # Warm-up: the first process on a fresh machine JIT-compiles the kernels (cached after).
    gen "${size}_warmup" "$size" "$p" "$b" 0 1
    gen "${size}_1" "$size" "$p" "$b" 0 1
    gen "${size}_2_processes" "$size" "$p" "$b" 0,1 1
    gen "${size}_4_threads" "$size" "$p" "$b" 0,1,2,3 0
    gen "${size}_4_processes" "$size" "$p" "$b" 0,1,2,3 1
    for v in 4_threads 4_processes; do
        if cmp -s "$SCRATCH/${size}_1.jsonl" "$SCRATCH/${size}_$v.jsonl"; then
            echo "$size: ${v} outputs identical to one GPU's" >> "$RUN/table.txt"
        else
            echo "$size: ${v} outputs DIFFER from one GPU's" >> "$RUN/table.txt"
        fi
    done
done
cat "$RUN/table.txt"
tar czf "$OUT/replica_processes.tgz" -C "$OUT" replica_processes && rm -rf "$RUN"
