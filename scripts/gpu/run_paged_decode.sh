#!/usr/bin/env bash
# Issue 26 on one GPU: decode on the paged KV cache (continuous batching) against the static
# left-padded batch and transformers, in one call, at the same batches.
#
# Carried: dist/carry/fleet.xz (scripts/cuda/build.sh -p fleet, stripped, xz); the graphs and
# sanitize parts also dist/carry/paged-tests.tar.xz (both built by scripts/gpu/build_paged_tests.sh).
#   PART=speed    7B shape (configs/models/qwen2.5-7b.json, random bf16 weights), prompt 512,
#                 128 new tokens, batches $BATCHES: fleet static, fleet continuous (reading
#                 tokens every step, and every 8), transformers
#                 (benches/transformers_generate.py) — fleet_7b_*.json, hf_7b.json
#   PART=graphs   the paged tests on the GPU (dist/carry/paged-tests.tar.xz: paged_generation,
#                 generation, parity, paged_attention, and the library's linear-layer
#                 kernel tests), then the 7B speed as PART=speed with
#                 the fleet modes $MODES (default all but continuous-eager: static;
#                 continuous-eager: no CUDA graphs;
#                 continuous: graphs, a read every step; continuous-skinny: the same with
#                 the skinny GEMM for 5-64 rows (FLEET_SKINNY_GEMM=1); continuous-cublas: with
#                 FLEET_DECODE_GEMV=0 (cuBLAS for every product); continuous-scalarnorm: with
#                 FLEET_VEC_NORM=0 (the norms' first kernel); continuous-splitkv: with
#                 FLEET_FUSED_KV_WRITE=0 (K/V written by their own launches); continuous-sync8: graphs, a read every
#                 8 steps; continuous-sync8-perlane: the same with the per-lane decode
#                 attention (FLEET_PAGED_MMA=0); continuous-sync8-t1: sampling at
#                 temperature 1; continuous-sync8-normgemv: the norm, GEMV and SwiGLU as
#                 one kernel (FLEET_NORM_GEMV=1); continuous-sync8-nopipe: the GEMV's
#                 four-loads kernel for every product (FLEET_GEMV_PIPE=0);
#                 continuous-sync8-noswiglu: the gate/up GEMV and the SwiGLU as two kernels
#                 (FLEET_GEMV_SWIGLU=0); continuous-sync8-noqkvrope: the q/k/v GEMV and the
#                 q/k/v + RoPE + K/V write kernel as two launches (FLEET_QKV_GEMV_ROPE=0);
#                 a mode may end in @N (a repeat with its own JSON);
#                 TESTS=0 skips the tests, HF=0 transformers, LIB_TESTS filters the
#                 library's tests; every mode runs the library's defaults otherwise — since
#                 2026-11-29b, before which the modes turned FLEET_PAGED_MMA and
#                 FLEET_SKINNY_PREFETCH_X off unless named); and GSPO's rollout shape (0.5B and 1.5B, 64 rows, prompt
#                 128, 256 new) in the same modes; HF_STATIC=1 adds transformers with its static
#                 cache, whose generate() compiles the decode step (hf_7b_static.json)
#   PART=sanitize the paged tests (dist/carry/paged-tests.tar.xz): the decode-graph test under
#                 compute-sanitizer memcheck (sanitize.txt: the faulting kernel of the
#                 illegal address), then the sampling kernel against its twin
#   PART=variable 0.5B shape, $VAR_REQUESTS requests with GSM8K-like reply lengths through 32
#                 and 64 decode slots, static batches vs continuous — fleet_05b_variable.json
# Writes $OUT/<part>.log and $OUT/<part>-results.tgz (the JSON reports and test logs).
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_paged_decode}"
PART="${PART:-speed}"
BATCHES="${BATCHES:-1,8,32,64}"
VAR_REQUESTS="${VAR_REQUESTS:-192}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/$PART.log") 2>&1
F=/tmp/fleet
xz -dc dist/carry/fleet.xz > "$F" && chmod +x "$F"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
"$F" --version
case "$PART" in
  graphs)
    # TESTS=0 skips the tests (a speed-only call); LIB_TESTS filters the library's kernel tests.
    if [ "${TESTS:-1}" = 1 ]; then
      T=/tmp/paged_tests; mkdir -p "$T"
      xz -dc "${TESTS_TAR:-dist/carry/paged-tests.tar.xz}" | tar xf - -C "$T"
      BUILT_AT="${BUILT_AT:-/work/main}"
      [ -e "$BUILT_AT/tests/fixtures" ] || { mkdir -p "$(dirname "$BUILT_AT")"; ln -sfn "$PWD" "$BUILT_AT"; }
      for t in paged_generation generation parity paged_attention qwen3_vl_parity; do
        [ -x "$T/$t" ] || { echo "== $t: not carried"; continue; }
        echo "== $t"
        timeout 120 "$T/$t" --test-threads 1 > "$OUT/test_$t.txt" 2>&1
        echo "rc $?"; grep -E '^test |test result|panicked|FAILED|left|right' "$OUT/test_$t.txt"
      done
      # The same generation tests with the skinny GEMM on for 5-64 rows (off by default until
      # its kernel test has passed on a GPU).
      for t in ${SKINNY_TESTS-paged_generation generation}; do
        [ -x "$T/$t" ] || continue
        echo "== $t (FLEET_SKINNY_GEMM=1)"
        FLEET_SKINNY_GEMM=1 timeout 120 "$T/$t" --test-threads 1 > "$OUT/test_${t}_skinny.txt" 2>&1
        echo "rc $?"; grep -E 'test result|panicked|FAILED' "$OUT/test_${t}_skinny.txt"
      done
      # The crate's own kernel tests (the library's unit tests): the GEMV and the linear layer;
      # the CUDA ops against their twins; decode graphs on two logical devices (a binary of its
      # own: the logical mapping is process-wide).
      if [ -x "$T/fleet_models" ]; then
        echo "== fleet_models kernel tests (${LIB_TESTS:-ops::linear ops::dropout ops::qkv_rope})"
        timeout 120 "$T/fleet_models" --test-threads 1 ${LIB_TESTS:-ops::linear ops::dropout ops::qkv_rope} > "$OUT/test_lib.txt" 2>&1
        echo "rc $?"; grep -E '^test |test result|panicked|FAILED|left|right' "$OUT/test_lib.txt"
      fi
      if [ -x "$T/ops_grad" ]; then
        echo "== ops_grad (cuda)"
        timeout 120 "$T/ops_grad" --test-threads 1 cuda > "$OUT/test_ops_grad.txt" 2>&1
        echo "rc $?"; grep -E '^test |test result|panicked|FAILED' "$OUT/test_ops_grad.txt"
      fi
      if [ -x "$T/decode_graph_segments" ]; then
        echo "== decode_graph_segments (two logical devices)"
        timeout 120 "$T/decode_graph_segments" > "$OUT/test_segments.txt" 2>&1
        echo "rc $?"; grep -E '^test |test result|panicked|FAILED|left|right' "$OUT/test_segments.txt"
      fi
    fi
    C=configs/models/qwen2.5-7b.json
    # The reference first, so that a call cut short still has it (HF=0 skips it).
    if [ "${HF:-1}" = 1 ]; then
      echo "== transformers"
      timeout 150 python3 benches/transformers_generate.py --config "$C" --dtype bf16 \
        --prompt-len 512 --new-tokens 128 --batch "$BATCHES" --device cuda --json "$OUT/hf_7b.json"
    fi
    # HF_STATIC=1: transformers again with its static cache, whose generate() compiles the
    # decode step (torch.compile; each batch's warm-up pays the compilation).
    if [ "${HF_STATIC:-0}" = 1 ]; then
      echo "== transformers, static cache + torch.compile"
      timeout "${HF_STATIC_TIMEOUT:-420}" python3 benches/transformers_generate.py --config "$C" \
        --dtype bf16 --prompt-len 512 --new-tokens 128 --batch "${HF_STATIC_BATCHES:-$BATCHES}" \
        --device cuda --cache-implementation static --json "$OUT/hf_7b_static.json"
    fi
    # continuous-cublas: as continuous, with cuBLAS for the few-row products too
    # (FLEET_DECODE_GEMV=0: no GEMV for up to 4 rows, no skinny GEMM for 5 to 64).
    # Every mode runs the library's defaults except what its name changes. (Until 2026-11-29
    # the modes set FLEET_PAGED_MMA=0 and FLEET_SKINNY_PREFETCH_X=0 unless named: the runs
    # of continuous-sync8 after 997da43 made them the defaults took the per-lane attention.)
    mode_flags() {
      gemv=1; batches=$BATCHES
      skinny=0; vecnorm=1; fusedkv=1; prefetch=1; attnmma=1; normgemv=0; gemvpipe=1
      gemvswiglu=1; qkvrope=1
      case "$1" in
        # The q/k/v GEMV and the q/k/v + RoPE + K/V write kernel as two launches
        # (FLEET_QKV_GEMV_ROPE=0; one since 2026-11-29f).
        continuous-sync8-noqkvrope) flags=(--batching continuous --num-scheduler-steps 8); qkvrope=0 ;;
        # The GEMV and the SwiGLU as two kernels (FLEET_GEMV_SWIGLU=0; one since 2026-11-29e).
        continuous-sync8-noswiglu) flags=(--batching continuous --num-scheduler-steps 8); gemvswiglu=0 ;;
        # The GEMV's four-loads kernel for every product (FLEET_GEMV_PIPE=0; the pipelined one
        # takes grids of less than a wave by default since 2026-11-29d), reads every 8.
        continuous-sync8-nopipe) flags=(--batching continuous --num-scheduler-steps 8); gemvpipe=0 ;;
        # The norm, the GEMV and the SwiGLU as one kernel (FLEET_NORM_GEMV=1, 2026-11-29d; off
        # by default: slower so far), reads every 8 as continuous-sync8.
        continuous-sync8-normgemv) flags=(--batching continuous --num-scheduler-steps 8); normgemv=1 ;;
        continuous-splitkv) flags=(--batching continuous); fusedkv=0 ;;
        continuous-skinny) flags=(--batching continuous); skinny=1 ;;
        # The skinny GEMM for 5-64 rows (FLEET_SKINNY_GEMM=1), reads every 8 as continuous-sync8.
        # FLEET_SKINNY_PREFETCH_X (2026-11-28h) reaches only the MoE kernel since the skinny
        # GEMM's TMA ring (2026-11-29g): the two modes run the same dense products.
        continuous-sync8-skinny) flags=(--batching continuous --num-scheduler-steps 8); skinny=1; prefetch=0 ;;
        continuous-sync8-skinny-prefetch) flags=(--batching continuous --num-scheduler-steps 8); skinny=1; prefetch=1 ;;
        # The decode attention's first pass on the tensor cores (FLEET_PAGED_MMA, 2026-11-28h;
        # the default since 997da43, so the same as continuous-sync8), and without it.
        continuous-sync8-attnmma) flags=(--batching continuous --num-scheduler-steps 8); attnmma=1 ;;
        continuous-sync8-perlane) flags=(--batching continuous --num-scheduler-steps 8); attnmma=0 ;;
        continuous-sync8-skinny-prefetch-attnmma) flags=(--batching continuous --num-scheduler-steps 8); skinny=1; prefetch=1; attnmma=1 ;;
        continuous-eager) flags=(--batching continuous --enforce-eager) ;;
        continuous-sync8) flags=(--batching continuous --num-scheduler-steps 8) ;;
        # Sampling at temperature 1, each row its own seed (GSPO's rollouts sample so).
        continuous-sync8-t1) flags=(--batching continuous --num-scheduler-steps 8 --temperature 1) ;;
        continuous-cublas) flags=(--batching continuous); gemv=0 ;;
        continuous-scalarnorm) flags=(--batching continuous); vecnorm=0 ;;
        *) flags=(--batching "$1") ;;
      esac
    }
    # Runs its arguments under the kernel switches mode_flags chose.
    in_mode_env() {
      FLEET_GEMV_SWIGLU=$gemvswiglu FLEET_QKV_GEMV_ROPE=$qkvrope \
        FLEET_NORM_GEMV=$normgemv FLEET_GEMV_PIPE=$gemvpipe \
        FLEET_PAGED_MMA=$attnmma FLEET_SKINNY_PREFETCH_X=$prefetch FLEET_FUSED_KV_WRITE=$fusedkv \
        FLEET_VEC_NORM=$vecnorm FLEET_SKINNY_GEMM=$skinny FLEET_DECODE_GEMV=$gemv "$@"
    }
    # A mode may carry a suffix @N (a repeat in the same call, its own JSON file).
    for mode in ${MODES:-static continuous continuous-skinny continuous-cublas continuous-sync8}; do
      echo "== fleet $mode"
      mode_flags "${mode%@*}"
      in_mode_env timeout 150 "$F" bench generate --config "$C" --batch "$batches" \
        --prompt-len 512 --new-tokens 128 --repeats 2 "${flags[@]}" \
        --json "$OUT/fleet_7b_${mode//@/-r}.json"
    done
    for shape in 0.5b 1.5b; do
      for mode in ${ROLLOUT_MODES:-static continuous continuous-skinny continuous-cublas continuous-sync8}; do
        echo "== fleet $shape rollouts $mode"
        mode_flags "$mode"
        in_mode_env timeout 60 "$F" bench generate --config "configs/models/qwen2.5-$shape.json" --batch 64 \
          --prompt-len 128 --new-tokens 256 --repeats 3 "${flags[@]}" \
          --json "$OUT/fleet_${shape}_rollouts_$mode.json"
      done
    done
    ;;
  sanitize)
    T=/tmp/paged_tests; mkdir -p "$T"
    xz -dc "${TESTS_TAR:-dist/carry/paged-tests.tar.xz}" | tar xf - -C "$T"
    BUILT_AT="${BUILT_AT:-/work/main}"
    [ -e "$BUILT_AT/tests/fixtures" ] || { mkdir -p "$(dirname "$BUILT_AT")"; ln -sfn "$PWD" "$BUILT_AT"; }
    echo "== memcheck: refilled_paged_batches_give_the_lock_step_tokens"
    timeout 300 compute-sanitizer --tool memcheck --print-limit 20 \
      "$T/paged_generation" --test-threads 1 --exact refilled_paged_batches_give_the_lock_step_tokens \
      > "$OUT/sanitize.txt" 2>&1
    echo "rc $?"; grep -m 40 -E 'Invalid|at 0x|by thread|Address|Saved host backtrace|=========     Host Frame' "$OUT/sanitize.txt"
    echo "== the sampling kernel against its twin"
    timeout 300 "$T/generation" --test-threads 1 gpu_sampling_kernel_matches_its_twin > "$OUT/sampler.txt" 2>&1
    echo "rc $?"; grep -E '^test |test result|panicked|differ' "$OUT/sampler.txt"
    ;;
  speed)
    C=configs/models/qwen2.5-7b.json
    for mode in static continuous continuous-sync8; do
      echo "== fleet $mode"
      case "$mode" in
        continuous-sync8) flags=(--batching continuous --num-scheduler-steps 8) ;;
        *) flags=(--batching "$mode") ;;
      esac
      "$F" bench generate --config "$C" --batch "$BATCHES" --prompt-len 512 --new-tokens 128 \
        --repeats 2 "${flags[@]}" --json "$OUT/fleet_7b_$mode.json"
    done
    echo "== transformers"
    python3 benches/transformers_generate.py --config "$C" --dtype bf16 --prompt-len 512 \
      --new-tokens 128 --batch "$BATCHES" --device cuda --json "$OUT/hf_7b.json"
    ;;
  variable)
    echo "== fleet 0.5B variable lengths"
    "$F" bench generate --config configs/models/qwen2.5-0.5b.json --batch 32,64 --prompt-len 256 \
      --new-tokens 384 --repeats 1 --batching continuous --variable-lengths "$VAR_REQUESTS" \
      --json "$OUT/fleet_05b_variable.json"
    ;;
esac
# A call brings back at most 8 files: everything but the log in one archive.
# The archive is written outside $OUT: tar fails on a directory that changes as it reads it.
tmp=$(mktemp)
(cd "$OUT" && tar czf "$tmp" --exclude '*.tgz' --exclude "$PART.log" . \
  && find . -maxdepth 1 -type f ! -name '*.tgz' ! -name "$PART.log" -delete) \
  && mv "$tmp" "$OUT/$PART-results.tgz"
echo "== done"
