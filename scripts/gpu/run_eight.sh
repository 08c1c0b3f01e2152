#!/usr/bin/env bash
# Issue 5 on nvidia-h200-x8, in one command (stripped CUDA fleet carried as dist/carry/fleet.xz):
#
#     bash scripts/gpu/run_eight.sh
#
#   plan_*   fleet plan --topology live for the 7B, 32B and 72B shapes (batch 8 x 640)
#   dp_N     fleet bench data-parallel, 7B, N = 1, 2, 4, 8 replicas of one GPU
#   hy_N     fleet bench data-parallel --group-size 2, 72B, N = 1 and 4 replicas of a GPU pair
# Results packed into $OUT/eight.tgz.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_eight}"
R="$OUT/eight"
mkdir -p "$R"
python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('dist/carry/fleet.xz'), open('dist/fleet','wb'))"
chmod +x dist/fleet
F=dist/fleet
cp COMMIT "$R/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$R/nvidia_smi.csv" 2>&1
nvidia-smi topo -m > "$R/nvidia_smi_topo.txt" 2>&1
$F devices > "$R/devices.txt" 2>&1
for size in 7b 32b 72b; do
  $F plan --model "configs/models/qwen2.5-$size.json" --topology live --mode auto \
      --batch 8 --seq-len 640 > "$R/plan_$size.txt" 2>&1
done
A7="--config configs/models/qwen2.5-7b.json --dtype bf16 --batch 32 --batches-per-replica 12 --prompt-len 512 --new-tokens 128"
for devs in cuda:0 cuda:0,cuda:1 cuda:0,cuda:1,cuda:2,cuda:3 cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7; do
  n=$(echo "$devs" | tr ',' '\n' | wc -l)
  $F bench data-parallel $A7 --devices "$devs" --json "$R/dp_$n.json" > "$R/dp_$n.txt" 2>&1
  tail -n1 "$R/dp_$n.txt"
done
A72="--config configs/models/qwen2.5-72b.json --dtype bf16 --group-size 2 --batch 8 --batches-per-replica 3 --prompt-len 512 --new-tokens 128"
$F bench data-parallel $A72 --devices cuda:0,cuda:1 --json "$R/hy_1.json" > "$R/hy_1.txt" 2>&1
tail -n1 "$R/hy_1.txt"
$F bench data-parallel $A72 --devices cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7 \
    --json "$R/hy_4.json" > "$R/hy_4.txt" 2>&1
tail -n1 "$R/hy_4.txt"
tar czf "$OUT/eight.tgz" -C "$OUT" eight && rm -rf "$R"
