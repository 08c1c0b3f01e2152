#!/usr/bin/env bash
# Diagnosis of the sharded policy's wrong gradients on logical devices (issue 24): short
# gspo-train runs (0.5B shape, 16 new tokens, STEPS steps) of one setting each, their loss and
# grad norm per step beside the single-device run's. Carried: dist/carry/gspo-train.xz.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W=/tmp/gspo_bisect; R="$OUT/bisect"; mkdir -p "$W" "$R"
STEPS="${STEPS:-2}"
xz -dc dist/carry/gspo-train.xz > "$W/gspo-train" && chmod +x "$W/gspo-train"
python3 scripts/gpu/make_gspo_prompts.py --out "$W/prompts.jsonl" --n 256 > /dev/null
[ -f "$W/rm05/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --classifier \
  --config configs/models/qwen2.5-0.5b.json --out "$W/rm05" --tokenizer-from tests/fixtures/qwen2-tiny > /dev/null 2>&1
[ -f "$W/q/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --config configs/models/qwen2.5-0.5b.json \
  --out "$W/q" --tokenizer-from tests/fixtures/qwen2-tiny > /dev/null 2>&1
sed 's/^beta = 0.0$/beta = 0.04/' configs/gspo/bench.toml > "$W/full.toml"
printf '\n[[reward_funcs]]\nname = "reward_model"\nweight = 1.0\nmodel = "%s"\n' "$W/rm05" >> "$W/full.toml"
cp configs/gspo/bench.toml "$W/plain.toml"
run() { # name config mode logical [env...]
  local name="$1" cfg="$2" mode="$3" logical="$4"; shift 4
  local dir="$W/$name"; rm -rf "$dir"
  # shellcheck disable=SC2086
  env "$@" timeout 120 "$W/gspo-train" $logical --config "$W/$cfg.toml" --model "$W/q" --dataset "$W/prompts.jsonl" \
    --gpu-mode "$mode" --dtype "${DT:-f32}" --max-steps "$STEPS" --max-completion-length 16 --output-dir "$dir" > "$R/$name.log" 2>&1
  local rc=$?
  printf '%-28s exit %s ' "$name" "$rc"
  python3 -c "
import json,sys
for l in open('$dir/metrics.jsonl'):
    r=json.loads(l); print('step', r['step'], 'loss %.9g grad_norm %.9g' % (r['loss'], r['grad_norm']), end='; ')
" 2>/dev/null
  echo " $(grep -m1 '^Error' "$R/$name.log" | cut -c1-120)"
}
for cfg in full plain; do
  run "$cfg-single" "$cfg" 1gpu ""
  run "$cfg-logical1" "$cfg" 1gpu "--logical-gpus 1:30GiB"
  run "$cfg-2gpu" "$cfg" 2gpu "--logical-gpus 2:30GiB"
  run "$cfg-2gpu-blocking" "$cfg" 2gpu "--logical-gpus 2:30GiB" CUDA_LAUNCH_BLOCKING=1
  run "$cfg-3gpu" "$cfg" 3gpu "--logical-gpus 3:20GiB"
  run "$cfg-3gpu-blocking" "$cfg" 3gpu "--logical-gpus 3:20GiB" CUDA_LAUNCH_BLOCKING=1
done
tar -C "$OUT" -czf "$OUT/bisect.tgz" bisect && rm -rf "$R"
