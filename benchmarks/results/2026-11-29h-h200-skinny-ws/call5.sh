# skinny_reduce with every slot's load in flight at once: kernel test, then the 7B A/B at 8, 16,
# 24 and 32 rows (twice at 16 and 32), the 1.5B rollouts, and ncu times at 32 rows.
set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p /tmp/lt $R/graphs && xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
timeout 100 /tmp/lt/fleet_models --test-threads 1 ops::linear::kernel_tests::skinny > $R/test_lib.txt 2>&1; rc=$?; echo "lib rc $rc"
grep -E "test result|panicked" $R/test_lib.txt | head -4
[ $rc != 0 ] && exit 0
F=/tmp/fleet; xz -dc dist/carry/fleet.xz > $F && chmod +x $F
b() {  # $1 tag, $2 batches, rest env
  tag=$1; bs=$2; shift 2
  env "$@" timeout 80 $F bench generate --config configs/models/qwen2.5-7b.json --batch $bs --prompt-len 512 \
    --new-tokens 128 --repeats 2 --batching continuous --num-scheduler-steps 8 --json $R/graphs/7b_$tag.json > /dev/null 2>&1
  python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], [(r["batch"], round(r["decode_tok_s"],1)) for r in j["runs"]])' $R/graphs/7b_$tag.json $tag
}
b cublas 8,16,24,32 FLEET_SKINNY_GEMM=0
b skinny 8,16,24,32 FLEET_SKINNY_GEMM=1
b cublas-r2 16,32 FLEET_SKINNY_GEMM=0
b skinny-r2 16,32 FLEET_SKINNY_GEMM=1
for sk in 0 1; do
  FLEET_SKINNY_GEMM=$sk timeout 40 $F bench generate --config configs/models/qwen2.5-1.5b.json --batch 64 --prompt-len 128 \
    --new-tokens 256 --repeats 3 --batching continuous --num-scheduler-steps 8 --json $R/graphs/1.5b_rollouts_s$sk.json > /dev/null 2>&1
  python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], [(r["batch"], round(r["decode_tok_s"],1)) for r in j["runs"]])' $R/graphs/1.5b_rollouts_s$sk.json "1.5b skinny=$sk"
done
(cd $R && tar czf graphs.tgz graphs && rm -r graphs)
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
FLEET_SKINNY_GEMM=1 timeout 100 $NCU --profile-from-start off --clock-control none --csv --print-units base \
    -k "regex:skinny" --launch-skip 8 --launch-count 8 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    $F bench generate --config configs/models/qwen2.5-7b.json --batch 32 --prompt-len 512 --new-tokens 4 \
    --repeats 1 --batching continuous --enforce-eager --cuda-profile-range > $R/ncu_b32.csv 2> $R/ncu_b32.err
sed -n '/^"ID"/,$p' $R/ncu_b32.csv | python3 -c '
import csv,sys,collections
rows=list(csv.reader(sys.stdin)); h=rows[0]; a=collections.defaultdict(dict)
for r in rows[1:]:
    d=dict(zip(h,r)); a[(d["ID"],d["Kernel Name"][:20],d["Grid Size"])][d["Metric Name"][:5]]=float(d["Metric Value"].replace(",",""))
for k,v in a.items(): print(k, round(v["gpu__"]/1000,1), round(v["dram_"],1))'
