# The skinny kernel's time per product at 32 rows with parts switched off (FLEET_SKINNY_DEBUG, a
# debug argument in debug.diff): 0 all, 1 no products (waits and releases only), 2 no partials
# (cut tiles' sums dropped), 3 neither; then 8 rows with 0 and 2.
set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
F=/tmp/fleet; xz -dc dist/carry/fleet.xz > $F && chmod +x $F
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
run() {  # $1 batch, $2 debug
  b=$1; d=$2
  FLEET_SKINNY_DEBUG=$d FLEET_SKINNY_GEMM=1 timeout 100 $NCU --profile-from-start off --clock-control none --csv --print-units base \
    -k "regex:skinny" --launch-skip 4 --launch-count 4 --metrics $M \
    $F bench generate --config configs/models/qwen2.5-7b.json --batch $b --prompt-len 512 --new-tokens 4 \
    --repeats 1 --batching continuous --enforce-eager --cuda-profile-range > $R/ncu_b${b}_d$d.csv 2> $R/ncu_b${b}_d$d.err
  sed -n '/^"ID"/,$p' $R/ncu_b${b}_d$d.csv | python3 -c '
import csv,sys,collections
rows=list(csv.reader(sys.stdin)); h=rows[0]; a=collections.defaultdict(dict)
for r in rows[1:]:
    d=dict(zip(h,r)); a[d["Grid Size"]][d["Metric Name"][:5]]=float(d["Metric Value"].replace(",",""))
print(sys.argv[1], [(g, round(v["gpu__"]/1000,1), round(v["dram_"],1)) for g,v in a.items()])' "b$b d$d"
}
for d in 0 1 2 3; do run 32 $d; done
run 8 0; run 8 2
