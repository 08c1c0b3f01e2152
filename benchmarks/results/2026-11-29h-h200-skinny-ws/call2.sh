# ncu on the warp-specialised skinny kernel at 32 and 8 rows (7B decode): time, DRAM, tensor pipe, stall reasons.
set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
F=/tmp/fleet; xz -dc dist/carry/fleet.xz > $F && chmod +x $F
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
S=smsp__average_warps_issue_stalled_
P=_per_issue_active.ratio
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second,${S}long_scoreboard$P,${S}barrier$P,${S}mio_throttle$P,${S}short_scoreboard$P,${S}math_pipe_throttle$P,${S}sleeping$P,${S}wait$P,${S}no_instruction$P,${S}branch_resolving$P
run() {  # $1 name, $2 batch
  name=$1; b=$2
  FLEET_SKINNY_GEMM=1 timeout 150 $NCU --profile-from-start off --clock-control none --csv --print-units base \
    -k "regex:skinny" --launch-skip 4 --launch-count 8 --metrics $M \
    $F bench generate --config configs/models/qwen2.5-7b.json --batch $b --prompt-len 512 --new-tokens 4 \
    --repeats 1 --batching continuous --enforce-eager --cuda-profile-range > $R/ncu_$name.csv 2> $R/ncu_$name.err
  echo "$name rc $?"
  grep -v '^==' $R/ncu_$name.csv | python3 -c '
import csv,sys,collections
rows=list(csv.reader(sys.stdin)); h=rows[0]; a=collections.defaultdict(dict)
for r in rows[1:]:
    d=dict(zip(h,r)); a[(d["ID"],d["Kernel Name"][:24],d["Grid Size"])][d["Metric Name"].replace("smsp__average_warps_issue_stalled_","st_").replace("_per_issue_active.ratio","").replace(".avg.pct_of_peak_sustained_","%")]=d["Metric Value"]
for k,v in a.items(): print(k, {m: (round(float(x),2) if x.replace(".","",1).isdigit() else x) for m,x in v.items()})'
}
run b32 32
run b8 8
