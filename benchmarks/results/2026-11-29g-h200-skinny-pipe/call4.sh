set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
F=/tmp/fleet; xz -dc dist/carry/fleet.xz > $F && chmod +x $F
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
M=gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio
run() {  # $1 name, $2 kernel regex, rest env
  name=$1; k=$2; shift 2
  env "$@" timeout 150 $NCU --profile-from-start off --clock-control none --cache-control all --csv --print-units base \
    -k "regex:$k" --launch-skip 4 --launch-count 8 --metrics $M \
    $F bench generate --config configs/models/qwen2.5-7b.json --batch 32 --prompt-len 512 --new-tokens 4 \
    --repeats 1 --batching continuous --enforce-eager --cuda-profile-range > $R/ncu_$name.csv 2> $R/ncu_$name.err
  echo "$name rc $?"
  grep -v '^==' $R/ncu_$name.csv | python3 -c '
import csv,sys,collections
rows=list(csv.reader(sys.stdin)); h=rows[0]; a=collections.defaultdict(dict)
for r in rows[1:]:
    d=dict(zip(h,r)); a[(d["ID"],d["Kernel Name"][:40],d["Grid Size"])][d["Metric Name"].replace("smsp__average_warps_issue_stalled_","stall_").replace("_per_issue_active.ratio","")]=d["Metric Value"]
for k,v in a.items(): print(k, v)'
}
run skinny skinny FLEET_SKINNY_GEMM=1
run cublas "gemm|nvjet|sm90|cutlass|splitK" FLEET_SKINNY_GEMM=0
