#!/usr/bin/env bash
# gspo-train's placements on nvidia-h200-x2, 4 optimizer steps each (configs/gspo/bench.toml,
# random weights): the Qwen2.5-1.5B shape on one GPU; its policy layer-sharded over two GPUs
# (--gpu-mode 2gpu, beta 0, no reward model); on one GPU with the reference model (beta 0.04)
# and a Qwen2.5-0.5B-shaped reward model; then the seed's 7B layout
# (scripts/gpu/run_gspo_seed_layout.sh). Prints each run's exit and error.
# Carried: dist/carry/gspo-train.xz, COMMIT.   bash scripts/gpu/check_gspo_placements.sh
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W=/tmp/gspo_seed
R="$OUT/placements"
mkdir -p "$W" "$R"
xz -dc dist/carry/gspo-train.xz > "$W/gspo-train" && chmod +x "$W/gspo-train"
export FLEET_COMMIT="$(cat COMMIT 2>/dev/null || echo unknown)"
python3 scripts/gpu/make_gspo_prompts.py --out "$W/prompts.jsonl" --n 256 > /dev/null
for s in 1.5b 0.5b; do
  [ -f "$W/q$s/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --config "configs/models/qwen2.5-$s.json" \
    --out "$W/q$s" --tokenizer-from tests/fixtures/qwen2-tiny > /dev/null 2>&1
done
[ -f "$W/rm05/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --classifier \
  --config configs/models/qwen2.5-0.5b.json --out "$W/rm05" --tokenizer-from tests/fixtures/qwen2-tiny > /dev/null 2>&1
sed 's/^beta = 0.0$/beta = 0.04/' configs/gspo/bench.toml > "$W/ref_rm.toml"
printf '\n[[reward_funcs]]\nname = "reward_model"\nweight = 1.0\nmodel = "%s"\n' "$W/rm05" >> "$W/ref_rm.toml"
one() { # name config gpu-mode
  rm -rf "$W/p-$1"
  timeout 150 "$W/gspo-train" --config "$2" --model "$W/q1.5b" --dataset "$W/prompts.jsonl" --gpu-mode "$3" \
    --dtype bf16 --max-steps 4 --output-dir "$W/p-$1" > "$R/$1.log" 2>&1
  echo "$1: exit $?; $(grep -c . "$W/p-$1/metrics.jsonl" 2>/dev/null) steps; $(grep -m1 -E '^(Error|error)' "$R/$1.log")"
  grep -E "^policy:|^reference:|^reward:" "$R/$1.log" | tr '\n' ' '; echo
}
one 1gpu configs/gspo/bench.toml 1gpu
one 2gpu-sharded configs/gspo/bench.toml 2gpu
one 1gpu-ref-rm "$W/ref_rm.toml" 1gpu
one 2gpu-ref-rm "$W/ref_rm.toml" 2gpu
OUT="$R/seed" STEPS=4 timeout 200 bash scripts/gpu/run_gspo_seed_layout.sh > "$R/seed.log" 2>&1
echo "seed layout (7B): $(grep -E '^exit|^Error' "$R/seed.log" | tr '\n' ' ')"
tar -C "$OUT" -czf "$OUT/placements.tgz" placements && rm -rf "$R"
