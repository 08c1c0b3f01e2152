set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
OUT=$R/g SHAPES="0.5b 1.5b" BATCHES=16 STEPS=16 VARIANTS="fleet-bf16" BUDGET_S=330 \
  bash scripts/gpu/run_gspo_vs_trl.sh > $R/gspo.log 2>&1
echo "gspo rc $?"
cp $R/g/pairs.md $R/pairs.md 2>/dev/null; head -40 $R/pairs.md
(cd $R && tar czf gspo.tgz g && rm -r g)
