set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p /tmp/lt $R/graphs $R/tests && xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
timeout 120 /tmp/lt/fleet_models --test-threads 1 ops::linear::kernel_tests::skinny > $R/tests/test_lib.txt 2>&1; echo "lib rc $?"
grep -E "^test |test result|panicked" $R/tests/test_lib.txt | head
FLEET_SKINNY_GEMM=1 timeout 150 /tmp/lt/paged_generation --test-threads 1 > $R/tests/test_paged_skinny.txt 2>&1; echo "paged skinny rc $?"
grep -E "test result|FAILED|panicked" $R/tests/test_paged_skinny.txt | head -5
(cd $R && tar czf tests.tgz tests && rm -r tests)
F=/tmp/fleet; xz -dc dist/carry/fleet.xz > $F && chmod +x $F
b() {  # $1 tag, $2 batches, rest env
  tag=$1; bs=$2; shift 2
  env "$@" timeout 100 $F bench generate --config configs/models/qwen2.5-7b.json --batch $bs --prompt-len 512 \
    --new-tokens 128 --repeats 2 --batching continuous --num-scheduler-steps 8 --json $R/graphs/7b_$tag.json > /dev/null 2>&1
  python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], [(r["batch"], round(r["decode_tok_s"],1)) for r in j["runs"]])' $R/graphs/7b_$tag.json $tag
}
b cublas 8,32,64 FLEET_SKINNY_GEMM=0
b skinny 8,32,64 FLEET_SKINNY_GEMM=1
b cublas-r2 8,32,64 FLEET_SKINNY_GEMM=0
b skinny-r2 8,32,64 FLEET_SKINNY_GEMM=1
b skinny-nox 32 FLEET_SKINNY_GEMM=1 FLEET_SKINNY_DEBUG=1
b skinny-nomma 32 FLEET_SKINNY_GEMM=1 FLEET_SKINNY_DEBUG=2
b skinny-noevict 32 FLEET_SKINNY_GEMM=1 FLEET_SKINNY_DEBUG=4
for s in 0.5b 1.5b; do for sk in 0 1; do
  FLEET_SKINNY_GEMM=$sk timeout 60 $F bench generate --config configs/models/qwen2.5-$s.json --batch 64 --prompt-len 128 \
    --new-tokens 256 --repeats 3 --batching continuous --num-scheduler-steps 8 --json $R/graphs/${s}_rollouts_s$sk.json > /dev/null 2>&1
  python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], [(r["batch"], round(r["decode_tok_s"],1)) for r in j["runs"]])' $R/graphs/${s}_rollouts_s$sk.json "$s skinny=$sk"
done; done
(cd $R && tar czf graphs.tgz graphs && rm -r graphs)
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu)
M=gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
for sk in 1 0; do
  FLEET_SKINNY_GEMM=$sk timeout 120 $NCU --profile-from-start off --clock-control none --cache-control all --csv --print-units base \
    -k "regex:skinny|nvjet" --launch-count 12 --metrics $M \
    $F bench generate --config configs/models/qwen2.5-7b.json --batch 32 --prompt-len 512 --new-tokens 6 \
    --repeats 1 --batching continuous --enforce-eager --cuda-profile-range > $R/ncu_s$sk.csv 2> $R/ncu_s$sk.err
  echo "ncu s$sk rc $?"
  grep -v '^{' $R/ncu_s$sk.csv | grep -E '^"[0-9]' | python3 -c '
import csv,sys,collections
a=collections.defaultdict(dict)
for r in csv.reader(sys.stdin):
    a[(r[0],r[4][:34],r[8])][r[12].replace("smsp__average_warps_issue_stalled_","stall_").replace("_per_issue_active.ratio","")]=r[14]
for k,v in a.items(): print(k, v)' | head -14
done
