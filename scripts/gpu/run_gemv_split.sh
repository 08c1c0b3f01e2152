#!/usr/bin/env bash
# The GEMV with warps sharing a column (`FLEET_GEMV_SPLIT`, 2026-11-28h): its GPU test against
# the twin (carried dist/carry/lib-tests.tar.xz), then the Qwen2.5-7B decode at batches 1 and 4
# (random bf16 weights, prompt 512, 128 new tokens, reads every 8; dist/carry/fleet.xz) with
# it off, on at the default target (16,384 warps) and on at 8,192, alternating, ROUNDS rounds
# (default 2). Everything lands in $OUT/gemv_split.tar (decode7b_<variant>_<round>.json, logs,
# the test's output).
#
#   bash scripts/gpu/run_gemv_split.sh
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
T=/tmp/gemv_split; mkdir -p $T
R=$OUT/gemv_split; mkdir -p $R
xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C $T
xz -dc dist/carry/fleet.xz > $T/fleet && chmod +x $T/fleet
(cd crates/fleet-models && timeout 120 $T/fleet_models --test-threads 1 gemv_kernel_matches_its_twin \
  > $R/test_gemv.txt 2>&1; echo "gemv_kernel_matches_its_twin: rc $?"; grep -E 'test result|panicked' $R/test_gemv.txt)
for i in $(seq 1 ${ROUNDS:-2}); do for v in off on on8192; do
  case $v in
    off) set -- FLEET_GEMV_SPLIT=0 ;;
    on) set -- FLEET_GEMV_SPLIT=1 ;;
    on8192) set -- FLEET_GEMV_SPLIT=1 FLEET_GEMV_SPLIT_WARPS=8192 ;;
  esac
  j=$R/decode7b_${v}_$i.json
  env "$@" timeout 90 $T/fleet bench generate --config configs/models/qwen2.5-7b.json --batch 1,4 \
    --prompt-len 512 --new-tokens 128 --repeats 2 --batching continuous --num-scheduler-steps 8 \
    --json $j > $R/decode7b_${v}_$i.log 2>&1 || tail -3 $R/decode7b_${v}_$i.log
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['batch'], round(r['decode_tok_s'],1)) for r in d['runs']])" $j "$v round $i" || true
done; done
tar -C $OUT -cf $OUT/gemv_split.tar gemv_split && rm -rf $R
