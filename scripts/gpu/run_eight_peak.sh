#!/usr/bin/env bash
# Issue 5, item 3: measured peak memory of the 7B, 32B and 72B shapes at batch 8 x (512 + 128)
# on the eight-GPU machine, beside `fleet plan --topology live --json` for the same workload.
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH
python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('dist/carry/fleet.xz'), open('dist/fleet','wb'))"; chmod +x dist/fleet
F=dist/fleet; mkdir -p $OUT/pk
$F bench generate --config configs/models/qwen2.5-7b.json --dtype bf16 --device cuda:0 --batch 8 --prompt-len 512 --new-tokens 128 --json $OUT/pk/peak_7b.json > $OUT/pk/peak_7b.txt 2>&1 &
$F bench generate --config configs/models/qwen2.5-32b.json --dtype bf16 --device cuda:1 --batch 8 --prompt-len 512 --new-tokens 128 --json $OUT/pk/peak_32b.json > $OUT/pk/peak_32b.txt 2>&1 &
$F bench generate --config configs/models/qwen2.5-72b.json --dtype bf16 --device cuda:2,cuda:3 --batch 8 --prompt-len 512 --new-tokens 128 --json $OUT/pk/peak_72b.json > $OUT/pk/peak_72b.txt 2>&1 &
wait; tail -qn2 $OUT/pk/*.txt; for s in 7b 32b 72b; do $F plan --model configs/models/qwen2.5-$s.json --topology live --mode auto --batch 8 --seq-len 640 --json > $OUT/pk/plan_$s.json 2>&1; done
cd $OUT && tar czf pk.tgz pk && rm -rf pk
