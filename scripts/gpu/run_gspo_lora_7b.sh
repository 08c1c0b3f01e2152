#!/usr/bin/env bash
# LoRA (r 16, every linear layer) against full fine-tuning on the Qwen2.5-7B shape (bf16, batch 8,
# fleet only), the memory plan of both, and the 1.5B profile of a generation batch (FLEET_PROFILE=1),
# in one device call. Carried: dist/carry/gspo-train.xz, .whl/, COMMIT. Writes $OUT/g7.txt,
# $OUT/plans.txt and $OUT/results.tgz.
set -u; export NCCL_NVLS_ENABLE=0; cat COMMIT
O=$OUT; mkdir -p $O/prof
OUT=$O/g7 SHAPES=7b BATCHES=8 STEPS=12 TRL=0 BUDGET_S=330 VARIANTS="fleet-bf16 fleet-bf16-lora" bash scripts/gpu/run_gspo_vs_trl.sh > $O/g7.txt 2>&1
W=/tmp/gspo_bench
for v in "" "--set use_peft=true --set lora_r=16 --set lora_alpha=32 --set lora_target_modules=all-linear"; do
  echo "== plan $v"; $W/gspo-train --config configs/gspo/bench.toml --model $W/q7b --dataset $W/prompts.jsonl --output-dir /tmp/plan --dtype bf16 --torch-dtype bfloat16 --per-device-train-batch-size 8 --plan $v 2>&1 | grep -v "^\["
done > $O/plans.txt 2>&1
OUT=$O/prof SHAPES=1.5b EXTRA="--torch-dtype bfloat16" PROFILE_STEPS=8 timeout 150 bash scripts/gpu/profile_gspo.sh > /dev/null 2>&1
grep -h "rollout\.\|gen\." $O/prof/profile-1.5b.txt
python3 -c "
import json
d=json.load(open('$O/g7/gspo_vs_trl.json'))
for s in d:
  for b in d[s]:
    for k,r in d[s][b].items():
      if isinstance(r,dict) and 'seconds_per_generation_batch' in r: print(s,b,k,{x:(round(r[x],3) if isinstance(r.get(x),float) else r.get(x)) for x in ('seconds_per_generation_batch','generation','scoring','update','peak_mib','batches')})
"
cat $O/g7/search.tsv; grep -E "policy|role|fits|does not" $O/plans.txt | head -20
(cd $O && tar czf /tmp/all.tgz g7 prof && rm -rf g7 prof && mv /tmp/all.tgz $O/results.tgz)
