#!/usr/bin/env bash
# The GPU checks of what was written without a GPU on 2026-11-28 (`tests`): per-query key
# starts (packed sequences) in the flash kernel and masked_softmax, the packed training batch on
# the GPU against transformers' goldens, the MoE GEMV (with its bounds kernel) against its twin
# and the grouped MoE, the MoE in a CUDA graph, cuBLAS's grouped GEMM and the reduce kernels
# against their twins, the GEMV (generation, paged generation), the vision tower's batched
# attention (qwen3_vl_parity). Then the 30B-A3B judge: `judge` (FLEET_MOE_GEMV=1 against =0,
# alternating; since 4f7f1d4 =0 decodes op by op, its fused kernels never captured),
# `moe_prefill` (FLEET_MOE_GROUPED_GEMM=0/1), `moe_decode` (graphs, op by op fused, op by op
# GEMV, then ncu of a replayed step); the 8B judge before and after the vision tower's batched
# attention (`vision`: edit-score-base.xz against edit-score.xz) and with FlashAttention-3 on
# its text prefill alone (`fa3`: FLEET_FA3=0/1, edit-score.xz, a build with `fa3`). Carried:
# dist/carry/next-tests.tar.xz (fleet_models lib tests, generation, paged_generation,
# train_grads, ops_grad, qwen3_vl_parity; CUDA) for `tests`; JUDGE_XZ (default
# dist/carry/edit-score.xz) for the 30B-A3B parts, edit-score-base.xz beside it for `vision`
# (the tests and two judges do not fit one carry).
#
#   WHAT=tests bash scripts/gpu/run_packed_moe_checks.sh
#   WHAT="moe_prefill moe_decode" JUDGE_XZ=dist/carry/edit-score-nofa3.xz bash scripts/gpu/run_packed_moe_checks.sh
#   WHAT="moe_gemv moe_ab prefill_profile" bash scripts/gpu/run_packed_moe_checks.sh   # carries
#                  dist/carry/lib-tests.tar.xz and edit-score-nofa3.xz; AB_VAR (FLEET_MOE_MMA),
#                  NCU=0 skips moe_ab's ncu of a decode step
#   WHAT="moe_gemv moe_ab" LIB_FILTERS="ops::moe_rows qwen::moe" AB_VAR=FLEET_MOE_ROWS_KERNEL NCU=0 \
#       bash scripts/gpu/run_packed_moe_checks.sh     # 2026-11-28f: the MoE row kernels
#   WHAT="passes prefill_profile" bash scripts/gpu/run_packed_moe_checks.sh   # the prompt pass's
#                  token budget (PASS_TOKENS), then ncu of a 30B-A3B prefill pass
#   WHAT=checks bash scripts/gpu/run_packed_moe_checks.sh   # carries lib-tests, tests-next and
#                  tests-vl (.tar.xz): the GPU tests of 2026-11-28f's later work
#   WHAT="moe_gemv moe_ab" LIB_FILTERS="ops::moe_rows qwen::moe" AB_VAR=FLEET_MOE_DEVICE_PLAN NCU=0 \
#       bash scripts/gpu/run_packed_moe_checks.sh     # the MoE plan on the device against the host's
#   WHAT="host_ab stage_tables decode_blocks" bash scripts/gpu/run_packed_moe_checks.sh   # carries
#                  edit-score-prev.xz and edit-score-nofa3.xz: the host side of a prompt pass
#                  (two builds alternating), the stage tables, the decode attention's grid
#   WHAT=env_ab AB_VAR=FLEET_PINNED_UPLOAD bash scripts/gpu/run_packed_moe_checks.sh   # one
#                  variable at each of AB_VALUES ("0 1") on both judges (AB_SHAPES, default
#                  "30b-a3b:32 8b:64"), alternating
#   WHAT="moe_gemv paged" LIB_FILTERS="moe_mma_kernel_agrees skinny_gemm_kernel_agrees" bash \
#       scripts/gpu/run_packed_moe_checks.sh   # 2026-11-28h's kernels: groups of 16, the x
#                  rows prefetched, the decode attention on the tensor cores (lib-tests.tar.xz)
#   WHAT=sets SHAPE=30b-a3b:96 SETS="- FLEET_PAGED_MMA=1 FLEET_MOE_MMA16=1,FLEET_PAGED_MMA=1" \
#       bash scripts/gpu/run_packed_moe_checks.sh   # one shape under several environments
#   WHAT="judge vision fa3" bash scripts/gpu/run_packed_moe_checks.sh   # BATCHES ("8 32"),
#                                                      # VISION_BATCHES ("16 64"), ROUNDS (2)
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
T=/tmp/next; mkdir -p $T
# Everything lands in $OUT/checks.tar (more files than a call brings back one by one).
FINAL=$OUT; OUT=$FINAL/checks; mkdir -p $OUT
# One test binary of $T, one thread (a GPU has one stream per process: ARCHITECTURE.md,
# invariant 6), its output in $OUT/test_<name>.txt and a summary here.
run_t() { # name binary args...
  local name=$1 bin=$2; shift 2
  timeout 300 $T/$bin --test-threads 1 "$@" > $OUT/test_$name.txt 2>&1
  echo "$name: rc $? $(grep -E '^test result' $OUT/test_$name.txt | tail -1)"
  grep -E 'panicked|FAILED|max \|' $OUT/test_$name.txt | head -12
}
# An edit-score build unpacked as $1 (default JUDGE_XZ, else edit-score-nofa3.xz).
unpack_judge() { # path [xz]
  mkdir -p "$(dirname $1)"
  xz -dc ${2:-${JUDGE_XZ:-dist/carry/edit-score-nofa3.xz}} > $1 && chmod +x $1
}
# A short run of a judge shape ("model:batch") that loads its kernels and grows the pool.
warm_judge() { # bin shape
  $1 bench --config configs/models/qwen3-vl-${2%:*}.json --image-size 512 --batch 2 --samples 2 \
    --new-tokens 4 > /dev/null 2>&1 || echo warm-up failed
}
# One judge bench run (1024 px, 128 tokens, two batches of the shape's batch) with the given
# environment, its report in JSON, and a line saying what it measured.
judge_run() { # bin shape json label [VAR=value ...]
  local bin=$1 shape=$2 j=$3 label=$4; shift 4
  local b=${shape#*:}
  env "$@" timeout 240 $bin bench --config configs/models/qwen3-vl-${shape%:*}.json \
    --image-size 1024 --batch $b --samples $((2 * b)) --new-tokens 128 --json $j \
    > /tmp/judge_run.log 2>&1 || tail -3 /tmp/judge_run.log
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], round(d['samples_per_s'],3), 'samples/s, prefill', round(d['prefill_s'],2), 'decode', round(d['decode_s'],2), 's a batch, peak GiB', round(d['peak_used_bytes']/2**30,1))" $j "$label" || true
}
# One variable of the environment at each of its values, alternating, ROUNDS rounds (default
# 2), on each judge shape: $OUT/judge_<model>_b<batch>_<VAR><value>_<round>.json.
env_ab() { # bin var "values" "shapes"
  local bin=$1 v=$2 values=$3 shapes=$4 shape i g
  for shape in $shapes; do
    warm_judge $bin $shape
    for i in $(seq 1 ${ROUNDS:-2}); do for g in $values; do
      judge_run $bin $shape $OUT/judge_${shape%:*}_b${shape#*:}_${v}${g}_$i.json \
        "${shape%:*} b${shape#*:} $v=$g round $i" $v=$g
    done; done
  done
}
for part in ${WHAT:-tests judge}; do
case $part in
tests)
  xz -dc dist/carry/next-tests.tar.xz | tar xf - -C $T
  cd crates/fleet-models
  run_t lib_linear fleet_models ops::linear --nocapture
  run_t lib_moe fleet_models qwen::moe --nocapture
  run_t lib_grouped_gemm fleet_models ops::grouped_gemm --nocapture
  run_t lib_reduce fleet_models ops::reduce --nocapture
  run_t lib_attention fleet_models attention::kernel_tests::flash_matches_reference --nocapture
  FLEET_TEST_DEVICES=cuda:0 run_t train_grads train_grads
  FLEET_TEST_DEVICES=cuda:0 run_t qwen3_vl_parity qwen3_vl_parity
  run_t ops_grad ops_grad cuda_
  run_t generation generation
  run_t paged_generation paged_generation
  cd - > /dev/null ;;
judge)
  W=/tmp/nj; mkdir -p $W
  # JUDGE_XZ: the build to run (default dist/carry/edit-score.xz). Before 4f7f1d4 every
  # build aborted with FLEET_MOE_GEMV=0: candle's fused MoE kernels inside the decode's capture.
  xz -dc ${JUDGE_XZ:-dist/carry/edit-score.xz} > $W/es; chmod +x $W/es
  C=configs/models/qwen3-vl-30b-a3b.json
  $W/es bench --config $C --image-size 512 --batch 2 --samples 2 --new-tokens 4 > /dev/null 2>&1
  for i in $(seq 1 ${ROUNDS:-2}); do for b in ${BATCHES:-8 32}; do for g in 0 1; do
    j=$OUT/judge30_b${b}_g${g}_$i.json
    FLEET_MOE_GEMV=$g timeout 240 $W/es bench --config $C --image-size 1024 --batch $b \
      --samples $((2 * b)) --new-tokens 128 --json $j > $W/j.log 2>&1 || tail -3 $W/j.log
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('30B-A3B b$b FLEET_MOE_GEMV=$g round $i', round(d['samples_per_s'],3), 'samples/s, prefill', round(d['prefill_s'],2), 'decode', round(d['decode_s'],2), 's a batch')" $j || true
  done; done; done ;;
moe_prefill)
  # The 30B-A3B judge's prefill with the sorted path's per-expert GEMM loop against one cuBLAS
  # grouped GEMM per projection (FLEET_MOE_GROUPED_GEMM=0/1), alternating, batch 32.
  W=/tmp/np; mkdir -p $W
  xz -dc ${JUDGE_XZ:-dist/carry/edit-score.xz} > $W/es; chmod +x $W/es
  C=configs/models/qwen3-vl-30b-a3b.json
  $W/es bench --config $C --image-size 512 --batch 2 --samples 2 --new-tokens 4 > /dev/null 2>&1 || echo warm-up failed
  for i in $(seq 1 ${ROUNDS:-2}); do for g in 0 1; do
    j=$OUT/judge30_b32_groupedgemm${g}_$i.json
    FLEET_MOE_GROUPED_GEMM=$g timeout 240 $W/es bench --config $C --image-size 1024 --batch 32 \
      --samples 64 --new-tokens 128 --json $j > $W/j.log 2>&1 || tail -3 $W/j.log
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('30B-A3B b32 FLEET_MOE_GROUPED_GEMM=$g round $i', round(d['samples_per_s'],3), 'samples/s, prefill', round(d['prefill_s'],2), 'decode', round(d['decode_s'],2), 's a batch')" $j || true
  done; done ;;
checks)
  # The GPU tests of what 2026-11-28f wrote after its device time: lib-tests.tar.xz
  # (`ops::moe_rows`: the plan's kernels against the host's order, the row kernels; `qwen::moe`;
  # `upload::`: the pinned upload against the pageable one),
  # tests-next.tar.xz (ops_grad's `cuda_` tests: qk_norm_rope's four warps a block against the
  # CPU twin; train_grads on cuda:0) and tests-vl.tar.xz (qwen3_vl_parity and paged_generation
  # on cuda:0: the Qwen3 decoder through qk_norm_rope, prefill and paged decode).
  for a in lib-tests tests-next tests-vl; do xz -dc dist/carry/$a.tar.xz | tar xf - -C $T; done
  cd crates/fleet-models
  run_t lib_moe_rows fleet_models ops::moe_rows --nocapture
  run_t lib_moe fleet_models qwen::moe
  run_t lib_upload fleet_models upload:: --nocapture
  run_t ops_grad ops_grad cuda_ --nocapture
  FLEET_TEST_DEVICES=cuda:0 run_t train_grads train_grads
  FLEET_TEST_DEVICES=cuda:0 run_t qwen3_vl_parity qwen3_vl_parity
  run_t paged_generation paged_generation
  cd - > /dev/null ;;
moe_gemv)
  # The fleet_models lib tests of LIB_FILTERS (lib-tests.tar.xz, CUDA; default: `ops::linear`
  # — the MoE GEMV and its tensor-core kernel against the twin —, `qwen::moe` and
  # `attention::kernel_tests` — the flash kernels, the fused backward among them).
  xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C $T
  for f in ${LIB_FILTERS:-ops::linear qwen::moe attention::kernel_tests}; do
    run_t lib_${f//::/_} fleet_models $f --nocapture
  done ;;
paged)
  # The decode attention's GPU tests (lib-tests.tar.xz's paged_attention binary, since
  # 2026-11-28h): the per-lane and the tensor-core first pass (FLEET_PAGED_MMA) against the twin.
  xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C $T
  run_t paged_attention paged_attention gpu_ --nocapture ;;
moe_ab)
  # The 30B-A3B judge, batch 32, alternating A (AB_VAR=0) and B (AB_VAR=1); AB_VAR defaults to
  # FLEET_MOE_MMA (the MoE decode's products on the tensor cores). The bench's prefill is the
  # generation's own prompt passes (since ba32c96), so a decode change shows in decode_s.
  # 2026-11-28e's call 4 ran ba32c96's build with FLEET_MOE_GEMV_REGS (register MoE GEMV
  # variants, removed after) and FLEET_MOE_GROUPED_GEMM switched together.
  W=/tmp/nab; unpack_judge $W/es
  C=configs/models/qwen3-vl-30b-a3b.json; V=${AB_VAR:-FLEET_MOE_MMA}
  env_ab $W/es $V "0 1" 30b-a3b:32
  # Then (unless NCU=0) ncu of a replayed decode step with B (stage gen.decode@20).
  [ "${NCU:-1}" = 0 ] && continue
  env $V=1 METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum TOP=12 \
    NAME=moe30_decode_step_b32_${V}1 STAGE=gen.decode@20 NCU_TIMEOUT=200 bash scripts/gpu/profile_stage.sh \
    $W/es bench --config $C --image-size 1024 --batch 32 --samples 32 --new-tokens 32
  head -8 $OUT/kernels_moe30_decode_step_b32_${V}1.txt ;;
prefill_profile)
  # Where the 30B-A3B judge's prefill goes (batch 32, 1024 px): a FLEET_PROFILE=1 run (its
  # stage table in the JSON's `profile`), then ncu of one prompt pass of the generation (the
  # 5th gen.prefill call, a pass of three prompts in the warm-up's second generation, kernels
  # loaded and the pool grown), every kernel.
  W=/tmp/npp; unpack_judge $W/es
  C=configs/models/qwen3-vl-30b-a3b.json
  FLEET_PROFILE=1 timeout 240 $W/es bench --config $C --image-size 1024 --batch 32 --samples 32 \
    --new-tokens 16 --json $OUT/judge30_b32_profile.json > $W/p.log 2>&1 || tail -3 $W/p.log
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(f'{s:32s} {t:8.3f} s {n:6d} calls  host {h[0] if h else 0:8.3f} s') for s,t,n,*h in d['profile'][:25]]" $OUT/judge30_b32_profile.json || true
  METRICS=gpu__time_duration.sum,dram__bytes_read.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    TOP=30 NAME=moe30_prefill_pass STAGE=gen.prefill@5 NCU_TIMEOUT=300 bash scripts/gpu/profile_stage.sh \
    $W/es bench --config $C --image-size 1024 --batch 8 --samples 8 --new-tokens 2
  head -34 $OUT/kernels_moe30_prefill_pass.txt ;;
passes)
  # The prompt pass's token budget (FLEET_PREFILL_TOKENS, PASS_TOKENS default "8192 16384
  # 32768"): the 30B-A3B judge at batch 32 and the 8B judge at batch 64, each budget in turn,
  # one round unless ROUNDS says more.
  W=/tmp/npt; unpack_judge $W/es
  ROUNDS=${ROUNDS:-1} env_ab $W/es FLEET_PREFILL_TOKENS "${PASS_TOKENS:-8192 16384 32768}" \
    "30b-a3b:32 8b:64" ;;
host_ab)
  # Two builds alternating (PREV_XZ, default dist/carry/edit-score-prev.xz, then JUDGE_XZ):
  # the 30B-A3B judge at batch 32 and the 8B at batch 64, ROUNDS rounds (default 2).
  # 2026-11-28f/g: 2e035f8 against 25c532f (the pixel values cast on the host in parallel,
  # half the upload; the features scattered by gather_rows; qk_norm_rope's four warps a block;
  # the MoE plan as one op, on the host).
  W=/tmp/nha
  unpack_judge $W/es_a ${PREV_XZ:-dist/carry/edit-score-prev.xz}; unpack_judge $W/es_b
  for shape in 30b-a3b:32 8b:64; do
    warm_judge $W/es_a $shape
    for i in $(seq 1 ${ROUNDS:-2}); do for v in a b; do
      judge_run $W/es_$v $shape $OUT/judge_${shape%:*}_b${shape#*:}_build_${v}_$i.json \
        "${shape%:*} b${shape#*:} build $v round $i"
    done; done
  done ;;
sets)
  # One judge shape (SHAPE, "model:batch", default 30b-a3b:96) under each environment set of
  # SETS, in order, ROUNDS rounds (default 1): a set is comma-joined VAR=value pairs, "-" for
  # the defaults. 2026-11-29: the three kernel switches of 2026-11-28h alone and together.
  W=/tmp/nsets; unpack_judge $W/es; shape=${SHAPE:-30b-a3b:96}
  warm_judge $W/es $shape
  for i in $(seq 1 ${ROUNDS:-1}); do for set in ${SETS:?SETS lists the environment sets}; do
    name=${set//,/+}; name=${name//=/}; [ "$set" = - ] && name=defaults
    [ "$set" = - ] && set -- || { IFS=, read -ra envs <<< "$set"; set -- "${envs[@]}"; }
    judge_run $W/es $shape $OUT/judge_${shape%:*}_b${shape#*:}_${name}_$i.json \
      "${shape%:*} b${shape#*:} $name round $i" "$@"
  done; done ;;
env_ab)
  # One variable of the environment (AB_VAR, required) at each of AB_VALUES (default "0 1"),
  # alternating, ROUNDS rounds: the 30B-A3B judge at batch 32 and the 8B at batch 64
  # (AB_SHAPES, "model:batch" pairs). 2026-11-28g: FLEET_PINNED_UPLOAD (the pixel values
  # through pinned memory; measured in 2026-11-28h and on since), FLEET_QKV_ROPE_P4,
  # FLEET_PREFILL_TOKENS; 2026-11-28h: FLEET_MOE_MMA16 (the MoE decode's slots 16 a group),
  # FLEET_SKINNY_PREFETCH_X (its x rows prefetched), FLEET_PAGED_MMA (the decode attention's
  # first pass on the tensor cores), e.g. AB_SHAPES="30b-a3b:96 8b:128".
  W=/tmp/nea; unpack_judge $W/es
  env_ab $W/es ${AB_VAR:?AB_VAR names the variable} "${AB_VALUES:-0 1}" \
    "${AB_SHAPES:-30b-a3b:32 8b:64}" ;;
stage_tables)
  # Stage tables of the 30B-A3B judge at batch 32 and the 8B at batch 64, one batch, 16 new
  # tokens, in both modes: FLEET_PROFILE=events (each stage's span on the GPU's timeline,
  # nothing synchronized: the run keeps its plain speed) and FLEET_PROFILE=1 (every stage
  # synchronized: shares, not totals). Beside each, the host's seconds in the stage.
  W=/tmp/nst; unpack_judge $W/es
  for shape in 30b-a3b:32 8b:64; do for mode in events 1; do
    C=configs/models/qwen3-vl-${shape%:*}.json; b=${shape#*:}
    j=$OUT/profile_${mode}_${shape%:*}_b$b.json
    FLEET_PROFILE=$mode timeout 240 $W/es bench --config $C --image-size 1024 --batch $b --samples $b \
      --new-tokens 16 --json $j > $W/p.log 2>&1 || tail -3 $W/p.log
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], 'prefill', round(d['prefill_s'],2)); [print(f'{s:32s} {t:8.3f} s {n:6d} calls  host {h[0] if h else 0:8.3f} s') for s,t,n,*h in d['profile'][:34]]" $j || true
  done; done ;;
decode_blocks)
  # The decode attention's grid target (FLEET_PAGED_MIN_BLOCKS, BLOCKS default "512 2048
  # 4096"; 512 is the default): the 30B-A3B judge at batch 32, alternating, ROUNDS rounds.
  W=/tmp/ndb; unpack_judge $W/es
  env_ab $W/es FLEET_PAGED_MIN_BLOCKS "${BLOCKS:-512 2048 4096}" 30b-a3b:32 ;;
torch30)
  # transformers' 30B-A3B judge at TORCH_BATCH (default 32), 1024 px, 128 greedy tokens.
  b=${TORCH_BATCH:-32}
  timeout ${TORCH_TIMEOUT:-300} python3 scripts/gpu/vl_bench_transformers.py \
    --config configs/models/qwen3-vl-30b-a3b.json --image-size 1024 --batch $b --samples $b \
    --new-tokens 128 --json $OUT/torch30_b$b.json > $OUT/torch30.log 2>&1 || tail -5 $OUT/torch30.log
  tail -4 $OUT/torch30.log ;;
moe_decode)
  # The 30B-A3B judge's decode three ways at batch DECODE_BATCH (default 32): graphs (the
  # default; the MoE GEMV inside them), op by op with candle's fused MoE kernels, op by op with
  # the MoE GEMV; then ncu of the 20th decode call (the judge reads every step: one step,
  # replayed from its graph; stage gen.decode@20), every kernel. (2026-11-28d profiled the step
  # before the first capture instead, gen.graph_capture@1: its rows are inactive, so its
  # attention reads no cache and every row routes alike; not a decode step's profile.)
  W=/tmp/nm; mkdir -p $W
  xz -dc ${JUDGE_XZ:-dist/carry/edit-score.xz} > $W/es; chmod +x $W/es
  C=configs/models/qwen3-vl-30b-a3b.json; b=${DECODE_BATCH:-32}
  $W/es bench --config $C --image-size 512 --batch 2 --samples 2 --new-tokens 4 > /dev/null 2>&1 || echo warm-up failed
  for mode in graphs eager_fused eager_gemv; do
    case $mode in
      graphs) set -- ;;
      eager_fused) set -- FLEET_ENFORCE_EAGER=1 FLEET_MOE_GEMV=0 ;;
      eager_gemv) set -- FLEET_ENFORCE_EAGER=1 FLEET_MOE_GEMV=1 ;;
    esac
    j=$OUT/judge30_b${b}_$mode.json
    env "$@" timeout 240 $W/es bench --config $C --image-size 1024 --batch $b --samples $((2 * b)) \
      --new-tokens 128 --json $j > $W/j.log 2>&1 || tail -3 $W/j.log
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('30B-A3B b$b $mode', round(d['samples_per_s'],3), 'samples/s, prefill', round(d['prefill_s'],2), 'decode', round(d['decode_s'],2), 's a batch')" $j || true
  done
  METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum TOP=30 NAME=moe30_decode_step_b$b \
    STAGE=gen.decode@20 bash scripts/gpu/profile_stage.sh $W/es bench --config $C --image-size 1024 \
    --batch $b --samples $b --new-tokens 32 ;;
vision)
  W=/tmp/nv; mkdir -p $W
  xz -dc dist/carry/edit-score-base.xz > $W/A; xz -dc dist/carry/edit-score.xz > $W/B
  chmod +x $W/A $W/B
  C=configs/models/qwen3-vl-8b.json
  $W/A bench --config $C --image-size 512 --batch 2 --samples 2 --new-tokens 4 > /dev/null 2>&1
  for i in $(seq 1 ${ROUNDS:-2}); do for b in ${VISION_BATCHES:-16 64}; do for v in A B; do
    j=$OUT/judge8_b${b}_${v}_$i.json
    timeout 240 $W/$v bench --config $C --image-size 1024 --batch $b --samples $((2 * b)) \
      --new-tokens 128 --json $j > $W/j.log 2>&1 || tail -3 $W/j.log
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('8B b$b $v round $i', round(d['samples_per_s'],3), 'samples/s, prefill', round(d['prefill_s'],2), 'decode', round(d['decode_s'],2), 's a batch')" $j || true
  done; done; done ;;
fa3)
  W=/tmp/nf; mkdir -p $W
  xz -dc dist/carry/edit-score.xz > $W/B; chmod +x $W/B
  C=configs/models/qwen3-vl-8b.json
  $W/B bench --config $C --image-size 512 --batch 2 --samples 2 --new-tokens 4 > /dev/null 2>&1
  for i in $(seq 1 ${ROUNDS:-2}); do for f in 0 1; do
    j=$OUT/judge8_b64_fa3text${f}_$i.json
    FLEET_FA3=$f timeout 240 $W/B bench --config $C --image-size 1024 --batch 64 --samples 128 \
      --new-tokens 128 --json $j > $W/j.log 2>&1 || tail -3 $W/j.log
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('8B b64 FLEET_FA3=$f round $i', round(d['samples_per_s'],3), 'samples/s, prefill', round(d['prefill_s'],2), 's a batch')" $j || true
  done; done ;;
esac
done
tar -C $FINAL -cf $FINAL/checks.tar checks && rm -rf $OUT
