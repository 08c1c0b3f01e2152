# Which products should take the skinny kernel by default at 5-8 rows? FLEET_SKINNY_MIN_WEIGHTS
# (a measuring override of the threshold, in this call's build only) at 16, 32 and 100 Mi
# weights against cuBLAS (FLEET_SKINNY_GEMM=0): the 7B at 5 and 8 rows, the 1.5B and 0.5B at 8,
# alternating, twice.
set -u
export NCCL_NVLS_ENABLE=0
R=$OUT; mkdir -p $R/graphs
F=/tmp/fleet; xz -dc dist/carry/fleet.xz > $F && chmod +x $F
b() {  # $1 model, $2 tag, $3 batches, rest env
  mdl=$1; tag=$2; bs=$3; shift 3
  env "$@" timeout 80 $F bench generate --config configs/models/qwen2.5-$mdl.json --batch $bs --prompt-len 512 \
    --new-tokens 128 --repeats 2 --batching continuous --num-scheduler-steps 8 --json $R/graphs/${mdl}_$tag.json > /dev/null 2>&1
  python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], [(r["batch"], round(r["decode_tok_s"],1)) for r in j["runs"]])' $R/graphs/${mdl}_$tag.json "$mdl $tag"
}
for i in 1 2; do
  for m in 7b 1.5b 0.5b; do
    bs=8; [ $m = 7b ] && bs=5,8
    b $m cublas$i $bs FLEET_SKINNY_GEMM=0
    for t in 16 32 100; do b $m min${t}Mi_$i $bs FLEET_SKINNY_MIN_WEIGHTS=$((t << 20)); done
  done
done
(cd $R && tar czf graphs.tgz graphs && rm -r graphs)
