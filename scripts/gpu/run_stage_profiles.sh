#!/usr/bin/env bash
# One call: the 7B prefill with FLEET_QKV_ROPE_P4=0/1 alternating (fleet bench generate, batch
# 32 x 512, static), then ncu kernel tables (scripts/gpu/profile_stage.sh) of the GSPO update's
# micro-step (1.5B, configs/gspo/bench.toml, bf16 masters) and of one judge prefill pass (8B,
# 1024 px, batch JUDGE_BATCH, default 16); `judge_torch`: transformers' prefill at the same
# batch under torch.profiler, kernels by device time, beside fleet's table. Carried:
# dist/carry/{fleet,gspo-train,edit-score}.xz (each part needs its own). WHAT picks parts
# (default "prefill update judge"; "judge judge_torch" sets the judge's prefill side by side).
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/sp; mkdir -p $W
for b in fleet gspo-train edit-score; do
  [ -x $W/$b ] || [ ! -f dist/carry/$b.xz ] || { xz -dc dist/carry/$b.xz > $W/$b; chmod +x $W/$b; }
done
JB=${JUDGE_BATCH:-16}
for part in ${WHAT:-prefill update judge}; do
case $part in
prefill)
  for i in 1 2; do for p4 in 0 1; do
    FLEET_QKV_ROPE_P4=$p4 $W/fleet bench generate --config configs/models/qwen2.5-7b.json --batch 32 \
      --prompt-len 512 --new-tokens 2 --batching static --json $OUT/prefill_p4${p4}_$i.json > $W/prefill.log 2>&1 \
      || tail -5 $W/prefill.log
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], [{k: v for k, v in r.items() if 'prefill' in k} for r in d['runs']])" $OUT/prefill_p4${p4}_$i.json
  done; done ;;
update)
  python3 scripts/gpu/make_gspo_prompts.py --out $W/prompts.jsonl --n 512
  python3 scripts/gpu/make_random_checkpoint.py --config configs/models/qwen2.5-1.5b.json --out $W/q1.5b \
    --tokenizer-from tests/fixtures/qwen2-tiny --dtype bf16 > /dev/null
  NAME=update STAGE=train.micro_step@3 bash scripts/gpu/profile_stage.sh $W/gspo-train --config configs/gspo/bench.toml \
    --model $W/q1.5b --dataset $W/prompts.jsonl --output-dir $W/g --max-steps 3 --dtype bf16 --torch-dtype bfloat16 ;;
judge)
  NAME=judge_prefill_b$JB STAGE=gen.prefill@3 bash scripts/gpu/profile_stage.sh $W/edit-score bench \
    --config configs/models/qwen3-vl-8b.json --image-size 1024 --batch $JB --samples $JB --new-tokens 8 --json $W/j.json ;;
judge_torch)
  timeout 400 python3 scripts/gpu/vl_bench_transformers.py --config configs/models/qwen3-vl-8b.json \
    --image-size 1024 --batch $JB --samples $JB --new-tokens 8 --prefill \
    --profile-prefill $OUT/torch_judge_prefill --json $OUT/torch_judge_prefill_b$JB.json > $W/torch.log 2>&1 \
    || tail -5 $W/torch.log ;;
esac
done
