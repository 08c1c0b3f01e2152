# Does the skinny kernel win at 5-8 rows (one x tile)? The 7B at 5, 6 and 8 rows with cuBLAS and
# with the kernel, alternating, three times; then the 0.5B and 1.5B at 8 rows.
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
for i in 1 2 3; do b 7b cublas$i 5,6,8 FLEET_SKINNY_GEMM=0; b 7b skinny$i 5,6,8 FLEET_SKINNY_GEMM=1; done
for m in 0.5b 1.5b; do b $m cublas 8 FLEET_SKINNY_GEMM=0; b $m skinny 8 FLEET_SKINNY_GEMM=1; done
(cd $R && tar czf graphs.tgz graphs && rm -r graphs)
