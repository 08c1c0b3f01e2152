# The warp-specialised skinny kernel with its cut tiles summed by skinny_reduce (a launch of its
# own): kernel test, paged generation with it on, the 7B A/B at 8/32/64 rows and the rollouts
# (call1.sh), then ncu times of both kernels at 32 rows.
bash benchmarks/results/2026-11-29h-h200-skinny-ws/call1.sh
F=/tmp/fleet
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
FLEET_SKINNY_GEMM=1 timeout 100 $NCU --profile-from-start off --clock-control none --csv --print-units base \
    -k "regex:skinny" --launch-skip 8 --launch-count 8 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    $F bench generate --config configs/models/qwen2.5-7b.json --batch 32 --prompt-len 512 --new-tokens 4 \
    --repeats 1 --batching continuous --enforce-eager --cuda-profile-range > $OUT/ncu_b32.csv 2> $OUT/ncu_b32.err
sed -n '/^"ID"/,$p' $OUT/ncu_b32.csv | python3 -c '
import csv,sys,collections
rows=list(csv.reader(sys.stdin)); h=rows[0]; a=collections.defaultdict(dict)
for r in rows[1:]:
    d=dict(zip(h,r)); a[(d["ID"],d["Kernel Name"][:20],d["Grid Size"])][d["Metric Name"][:5]]=float(d["Metric Value"].replace(",",""))
for k,v in a.items(): print(k, round(v["gpu__"]/1000,1), round(v["dram_"],1))'
