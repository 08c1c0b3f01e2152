#!/usr/bin/env bash
# Issue 24, item 2.1: gspo-train's seed layouts on logical devices of one GPU (nvidia-h200),
# against the single-device run of the same settings: `2gpu` (policy layer-sharded over cuda:0,1;
# reference and reward model on cuda:1) and `3gpu` (reference and reward on cuda:2), with
# beta 0.04 and a Qwen2.5-0.5B-shaped reward model so that every role is placed. Random weights
# saved by transformers (scripts/gpu/make_random_checkpoint.py), configs/gspo/bench.toml's
# batches, STEPS optimizer steps, a checkpoint at the last one.
#
# For each SHAPE x DTYPE: the single-device run (physical GPU), then each layout on logical
# devices; scripts/gpu/compare_gspo_runs.py compares loss and grad norm at every step and the
# weights of the last checkpoint (tolerance TOL_F32 / TOL_BF16), and the log keeps each run's
# plan and its peak per device (metrics.jsonl's peak_memory_bytes: a logical device's pool).
#
# Carried: dist/carry/gspo-train.xz, COMMIT.
#   SHAPES="0.5b 1.5b" DTYPES="f32 bf16" STEPS=4 MAXLEN=64 bash scripts/gpu/run_gspo_logical_layouts.sh
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SHAPES="${SHAPES:-0.5b 1.5b}"
DTYPES="${DTYPES:-f32 bf16}"
STEPS="${STEPS:-4}"
MAXLEN="${MAXLEN:-256}"   # max_completion_length: shorter keeps a check of equality quick
TOL_F32="${TOL_F32:-1e-5}"
TOL_BF16="${TOL_BF16:-1e-2}"
CAP2="${CAP2:-65GiB}"
CAP3="${CAP3:-44GiB}"
W=/tmp/gspo_logical
R="$OUT/gspo_logical"
mkdir -p "$W" "$R"
xz -dc dist/carry/gspo-train.xz > "$W/gspo-train" && chmod +x "$W/gspo-train"
export FLEET_COMMIT="$(cat COMMIT 2>/dev/null || echo unknown)"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
python3 scripts/gpu/make_gspo_prompts.py --out "$W/prompts.jsonl" --n 256 > /dev/null
[ -f "$W/rm05/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --classifier \
  --config configs/models/qwen2.5-0.5b.json --out "$W/rm05" --tokenizer-from tests/fixtures/qwen2-tiny > /dev/null 2>&1
sed 's/^beta = 0.0$/beta = 0.04/' configs/gspo/bench.toml > "$W/layouts.toml"
printf '\n[[reward_funcs]]\nname = "reward_model"\nweight = 1.0\nmodel = "%s"\n' "$W/rm05" >> "$W/layouts.toml"
for s in $SHAPES; do
  [ -f "$W/q$s/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --config "configs/models/qwen2.5-$s.json" \
    --out "$W/q$s" --tokenizer-from tests/fixtures/qwen2-tiny > /dev/null 2>&1
  for dt in $DTYPES; do
    tol=$TOL_F32; [ "$dt" = bf16 ] && tol=$TOL_BF16
    run() { # name logical-flag gpu-mode
      local name="$1" flag="$2" mode="$3" dir="$W/$s-$dt-$1"
      rm -rf "$dir"
      # shellcheck disable=SC2086
      timeout 240 "$W/gspo-train" $flag --config "$W/layouts.toml" --model "$W/q$s" --dataset "$W/prompts.jsonl" \
        --gpu-mode "$mode" --dtype "$dt" --max-steps "$STEPS" --set save_steps="$STEPS" --max-completion-length "$MAXLEN" --output-dir "$dir" \
        > "$R/$s-$dt-$name.log" 2>&1
      echo "$s $dt $name: exit $?; $(grep -c . "$dir/metrics.jsonl" 2>/dev/null) steps; $(grep -m1 -E '^Error' "$R/$s-$dt-$name.log")"
      tail -1 "$dir/metrics.jsonl" 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read() or '{}'); print('  peaks:', {k: round(v/2**30, 2) for k, v in r.get('peak_memory_bytes', {}).items()}, 'GiB')" 2>/dev/null
      cp "$dir/metrics.jsonl" "$R/$s-$dt-$name.metrics.jsonl" 2>/dev/null
    }
    run single "" 1gpu
    run 2gpu "--logical-gpus 2:$CAP2" 2gpu
    run 3gpu "--logical-gpus 3:$CAP3" 3gpu
    for l in 2gpu 3gpu; do
      python3 scripts/gpu/compare_gspo_runs.py "$W/$s-$dt-single" "$W/$s-$dt-$l" --tol "$tol" \
        --json "$R/$s-$dt-$l.compare.json" 2>&1 | sed "s/^/  $l vs single: /"
    done
    # A 1.5B f32 checkpoint with its optimizer state is ~18 GB: three of them fill the disk.
    rm -rf "$W/$s-$dt-single" "$W/$s-$dt-2gpu" "$W/$s-$dt-3gpu"
  done
done
tar -C "$OUT" -czf "$OUT/gspo_logical.tgz" gspo_logical
