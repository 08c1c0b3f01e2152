# Programmatic dependent launch (FLEET_PDL=1) of the decode step's own kernels (GEMVs, q/k/v
# GEMV with RoPE, paged attention's two passes, the norms): their kernel tests and the paged
# and generation tests with it on, then the 7B at batch 1 and 32, alternating, three times.
set -u
export NCCL_NVLS_ENABLE=0
R=$OUT; mkdir -p /tmp/lt $R/graphs $R/tests
xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
for f in rms_norm paged_attention qkv_rope gemv; do
  FLEET_PDL=1 timeout 60 /tmp/lt/fleet_models --test-threads 1 $f > $R/tests/lib_$f.txt 2>&1; echo "lib $f rc $?"
  grep -E "test result|panicked" $R/tests/lib_$f.txt | head -3
done
for t in paged_generation generation; do
  FLEET_PDL=1 timeout 100 /tmp/lt/$t --test-threads 1 > $R/tests/$t.txt 2>&1; echo "$t rc $?"
  grep -E "test result|FAILED|panicked" $R/tests/$t.txt | head -4
done
(cd $R && tar czf tests.tgz tests && rm -r tests)
F=/tmp/fleet; xz -dc dist/carry/fleet.xz > $F && chmod +x $F
b() {  # $1 tag, $2 batches, rest env
  tag=$1; bs=$2; shift 2
  env "$@" timeout 80 $F bench generate --config configs/models/qwen2.5-7b.json --batch $bs --prompt-len 512 \
    --new-tokens 128 --repeats 2 --batching continuous --num-scheduler-steps 8 --json $R/graphs/7b_$tag.json > /dev/null 2>&1
  python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], [(r["batch"], round(r["decode_tok_s"],1)) for r in j["runs"]])' $R/graphs/7b_$tag.json $tag
}
for i in 1 2 3; do b base$i 1,32 FLEET_PDL=0; b pdl$i 1,32 FLEET_PDL=1; done
(cd $R && tar czf graphs.tgz graphs && rm -r graphs)
