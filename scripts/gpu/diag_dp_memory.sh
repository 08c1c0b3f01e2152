#!/usr/bin/env bash
# Where a data-parallel gspo-train run's GPU memory goes: the 1.5B shape (bench.toml plus a
# random reward model) on one GPU, then as 2 ranks, polling nvidia-smi per process and GPU.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
W=/tmp/zero; mkdir -p "$W"
BIN="$W/gspo-train"; xz -dc dist/carry/gspo-train.xz > "$BIN" && chmod +x "$BIN"
[ -f "$W/prompts.jsonl" ] || python3 scripts/gpu/make_gspo_prompts.py --out "$W/prompts.jsonl" --n 512 > /dev/null
[ -f "$W/q1.5b/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --config configs/models/qwen2.5-1.5b.json \
  --out "$W/q1.5b" --tokenizer-from tests/fixtures/qwen2-tiny --dtype bf16 > /dev/null 2>&1
[ -f "$W/rm05/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --classifier \
  --config configs/models/qwen2.5-0.5b.json --out "$W/rm05" --tokenizer-from tests/fixtures/qwen2-tiny > /dev/null 2>&1
cp configs/gspo/bench.toml "$W/zero.toml"
printf '\n[[reward_funcs]]\nname = "reward_model"\nweight = 1.0\nmodel = "%s"\n' "$W/rm05" >> "$W/zero.toml"
common=(--config "$W/zero.toml" --model "$W/q1.5b" --dataset "$W/prompts.jsonl" --dtype bf16 --max-steps 4)
poll() { while true; do nvidia-smi --query-compute-apps=pid,gpu_bus_id,used_memory --format=csv,noheader,nounits; sleep 0.2; done; }
peaks() { sort -t, -k1,2 "$1" | awk -F', ' '{k=$1" "$2; if ($3>m[k]) m[k]=$3} END {for (k in m) print "  pid/bus", k, m[k], "MiB"}'; }
for z in 0 1; do
  if [ "$z" = 0 ]; then
  echo "== one GPU, micro-batch 8 (the rows one rank of two computes)"
  poll > "$W/m1.txt" & p=$!
  CUDA_VISIBLE_DEVICES=0 timeout 200 "$BIN" "${common[@]}" --per-device-train-batch-size 8 --output-dir "$W/one$z" > "$W/one$z.log" 2>&1; echo "exit $?"
  kill $p; peaks "$W/m1.txt"; grep -E "^Error" "$W/one$z.log"; tail -1 "$W/one$z/metrics.jsonl" | python3 -c "import json,sys; print('allocator peak', json.load(sys.stdin)['peak_memory_bytes'])"
  fi
  echo "== 2 ranks, zero_stage=$z"
  poll > "$W/m2.txt" & p=$!
  timeout 200 "$BIN" --nproc-per-node 2 --master-port $((29800 + z)) "${common[@]}" --per-device-train-batch-size 16 --set zero_stage=$z --output-dir "$W/two$z" > "$W/two$z.log" 2>&1; echo "exit $?"
  kill $p; peaks "$W/m2.txt"; grep -E "Error|error" "$W/two$z.log" | grep -v "^\[rank .\]    " | head -5
  tail -1 "$W/two$z/metrics.jsonl" 2>/dev/null | python3 -c "import json,sys; print('allocator peak', json.load(sys.stdin)['peak_memory_bytes'])"
done
