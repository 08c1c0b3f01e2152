#!/usr/bin/env bash
# One call of 2026-11-28e: ncu of a replayed 30B-A3B judge decode step (batch 32, the 20th
# decode call) with the register MoE GEMV variants of ba32c96 (removed in 20001b6: no faster;
# the call 2 of the same day has the table of the plain kernel), then gspo-train against TRL, 0.5B and 1.5B, batch 16,
# 20 optimizer steps (three timed generation batches a run). Carried:
# dist/carry/edit-score-nofa3.xz, dist/carry/gspo-train.xz, .whl. Everything lands in
# $OUT/r.tar.
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
F=$OUT; P=$F/r; mkdir -p $P
W=/tmp/nm; mkdir -p $W; xz -dc dist/carry/edit-score-nofa3.xz > $W/es; chmod +x $W/es
C=configs/models/qwen3-vl-30b-a3b.json
$W/es bench --config $C --image-size 512 --batch 2 --samples 2 --new-tokens 4 > /dev/null 2>&1 || echo warm-up failed
OUT=$P METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum TOP=12 NAME=moe30_decode_step_b32_regs \
  STAGE=gen.decode@20 NCU_TIMEOUT=200 bash scripts/gpu/profile_stage.sh $W/es bench --config $C --image-size 1024 \
  --batch 32 --samples 32 --new-tokens 32
head -16 $P/kernels_moe30_decode_step_b32_regs.txt
OUT=$P/gspo SHAPES="0.5b 1.5b" BATCHES=16 STEPS=20 VARIANTS=fleet-bf16 BUDGET_S=${GSPO_BUDGET:-330} bash scripts/gpu/run_gspo_vs_trl.sh > /dev/null 2>&1
cat $P/gspo/pairs.md | grep -E "^\| (0.5b|1.5b)"
tar -C $F -cf $F/r.tar r && rm -rf $P
