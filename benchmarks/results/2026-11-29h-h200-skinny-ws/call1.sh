set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p /tmp/lt $R/graphs $R/tests && xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
timeout 100 /tmp/lt/fleet_models --test-threads 1 ops::linear::kernel_tests::skinny > $R/tests/test_lib.txt 2>&1; rc=$?; echo "lib rc $rc"
grep -E "^test |test result|panicked|left|right" $R/tests/test_lib.txt | head -12
if [ $rc != 0 ]; then (cd $R && tar czf tests.tgz tests && rm -r tests); exit 0; fi
FLEET_SKINNY_GEMM=1 timeout 90 /tmp/lt/paged_generation --test-threads 1 > $R/tests/test_paged_skinny.txt 2>&1; echo "paged skinny rc $?"
grep -E "test result|FAILED|panicked" $R/tests/test_paged_skinny.txt | head -5
(cd $R && tar czf tests.tgz tests && rm -r tests)
F=/tmp/fleet; xz -dc dist/carry/fleet.xz > $F && chmod +x $F
b() {  # $1 tag, $2 batches, rest env
  tag=$1; bs=$2; shift 2
  env "$@" timeout 60 $F bench generate --config configs/models/qwen2.5-7b.json --batch $bs --prompt-len 512 \
    --new-tokens 128 --repeats 2 --batching continuous --num-scheduler-steps 8 --json $R/graphs/7b_$tag.json > /dev/null 2>&1
  python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], [(r["batch"], round(r["decode_tok_s"],1), round(r["prefill_tok_s"])) for r in j["runs"]])' $R/graphs/7b_$tag.json $tag
}
b cublas 8,32,64 FLEET_SKINNY_GEMM=0
b skinny 8,32,64 FLEET_SKINNY_GEMM=1
b cublas-r2 32 FLEET_SKINNY_GEMM=0
b skinny-r2 32 FLEET_SKINNY_GEMM=1
for s in 0.5b 1.5b; do for sk in 0 1; do
  FLEET_SKINNY_GEMM=$sk timeout 40 $F bench generate --config configs/models/qwen2.5-$s.json --batch 64 --prompt-len 128 \
    --new-tokens 256 --repeats 3 --batching continuous --num-scheduler-steps 8 --json $R/graphs/${s}_rollouts_s$sk.json > /dev/null 2>&1
  python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], [(r["batch"], round(r["decode_tok_s"],1)) for r in j["runs"]])' $R/graphs/${s}_rollouts_s$sk.json "$s skinny=$sk"
done; done
(cd $R && tar czf graphs.tgz graphs && rm -r graphs)
