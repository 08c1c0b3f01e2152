#!/usr/bin/env bash
# Issue 24, item 3: the seeds' machines simulated on one H200 as logical devices capped to the
# seeds' memory. Each run says what the plan said, the peak per logical device (its own memory
# pool's high-water mark) and the throughput — one GPU's bandwidth and compute shared by all the
# logical devices, so never a figure of the seeds' GPUs.
#
# - GSPO, 3 x 16 GB and 3 x 8 GB (configs/topologies/gspo-3x*gb-on-h200.toml): the seed's 3gpu
#   layout (policy over cuda:0,1; reference, beta 0.04, and a Qwen2.5-0.5B reward model on
#   cuda:2) at the largest per_device_train_batch_size the plan fits
#   (scripts/seed_machines_plan.py), STEPS optimizer steps; a size ending in `+` also runs at
#   twice that batch, which the plan refuses, forced past the plan with --max-memory at the caps,
#   to see what the real devices do there.
# - ARGO's LLM, 8 x 12 GB (the seed's RTX 3060s): Qwen2.5-7B-shaped generation with one replica
#   per device (the seed's data-parallel: 14.2 GiB of bf16 weights on a 12 GiB device), one per
#   pair of devices (hybrid) and one over all eight (layer-sharded).
# - The judge, Qwen3-VL-30B-A3B: one replica on an 80 GB device (the seed's H100s), and one over
#   a group of two 40 GB devices.
#
# Carried: dist/carry/gspo-train.xz (gspo), fleet.xz (argo), edit-score.xz (judge); PARTS picks.
#   SIZES="16x1.5b:32+ 16x0.5b-f32:64 8x0.5b:32+ 8x0.5b-f32:8" bash scripts/gpu/run_seed_machines.sh
# Writes $OUT/seed_machines.log and $OUT/seed_machines.tgz (every run's log, metrics and JSON).
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_seed_machines}"
W=/tmp/seed_machines
R="$OUT/seed_machines"
STEPS="${STEPS:-2}"
PARTS="${PARTS:-gspo argo judge}"
SIZES="${SIZES:-16x1.5b:32+ 16x0.5b-f32:64 8x0.5b:32+ 8x0.5b-f32:8}"
mkdir -p "$W" "$R"
exec > >(tee -a "$OUT/seed_machines.log") 2>&1
for b in gspo-train fleet edit-score; do  # the parts' binaries that were carried
  [ -x "$W/$b" ] || [ ! -f "dist/carry/$b.xz" ] || { xz -dc "dist/carry/$b.xz" > "$W/$b" && chmod +x "$W/$b"; }
done
export FLEET_COMMIT="$(cat COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/nvidia-smi.txt"
peaks() { # metrics.jsonl -> the last line's peak per device in GiB
  tail -1 "$1" 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read() or '{}'); print('  peak per logical device:', {k: round(v/2**30, 2) for k, v in r.get('peak_memory_bytes', {}).items()}, 'GiB; tokens/s', r.get('tokens_per_second'))" 2>/dev/null
}

if [[ " $PARTS " == *" gspo "* ]]; then
  python3 scripts/gpu/make_gspo_prompts.py --out "$W/prompts.jsonl" --n 256 > /dev/null
  [ -f "$W/rm05/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --classifier \
    --config configs/models/qwen2.5-0.5b.json --out "$W/rm05" --tokenizer-from tests/fixtures/qwen2-tiny > /dev/null 2>&1
  sed 's/^beta = 0.0$/beta = 0.04/' configs/gspo/bench.toml > "$W/seed.toml"
  printf '\n[[reward_funcs]]\nname = "reward_model"\nweight = 1.0\nmodel = "%s"\n' "$W/rm05" >> "$W/seed.toml"
  for spec in $SIZES; do  # <cap GiB>x<shape>[-f32]:<batch>[+]
    batches_of() { if [[ "$1" == *+ ]]; then echo "${1%+} $(( ${1%+} * 2 ))"; else echo "$1"; fi; }
    cap="${spec%%x*}"; rest="${spec#*x}"; batch="${rest#*:}"; shape="${rest%%:*}"
    masters=bfloat16; [[ "$shape" == *-f32 ]] && masters=float32; shape="${shape%-f32}"
    [ -f "$W/q$shape/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py \
      --config "configs/models/qwen2.5-$shape.json" --out "$W/q$shape" --tokenizer-from tests/fixtures/qwen2-tiny > /dev/null 2>&1
    runs="$(batches_of "$batch")"; batch="${batch%+}"
    for b in $runs; do
      name="3x${cap}gb-$shape-$masters-b$b"
      extra=()
      # Twice the plan's batch: past the plan, with the caps as the budget (no reserve), so
      # the devices' caps, not the planner, decide.
      [ "$b" != "$batch" ] && extra=(--max-memory "0=${cap}GiB,1=${cap}GiB,2=${cap}GiB")
      dir="$W/$name"; rm -rf "$dir"
      args=(--logical-gpus "3:${cap}GiB" --config "$W/seed.toml" --model "$W/q$shape" --dataset "$W/prompts.jsonl"
            --gpu-mode 3gpu --dtype bf16 --torch-dtype "$masters" --set "per_device_train_batch_size=$b"
            --max-steps "$STEPS" --output-dir "$dir" "${extra[@]}")
      "$W/gspo-train" "${args[@]}" --plan > "$R/$name.plan.txt" 2>&1
      echo "== $name: plan exit $?; $(grep -E '^cuda:[0-9]+: total' "$R/$name.plan.txt" | sed 's/ of budget.*//' | tr '\n' ' ')"
      start=$(date +%s)
      timeout 300 "$W/gspo-train" "${args[@]}" > "$R/$name.log" 2>&1
      echo "   run exit $? in $(( $(date +%s) - start )) s; $(grep -c . "$dir/metrics.jsonl" 2>/dev/null) steps; $(grep -m1 -iE '^Error|out of memory' "$R/$name.log" | cut -c1-300)"
      peaks "$dir/metrics.jsonl"
      cp "$dir/metrics.jsonl" "$R/$name.metrics.jsonl" 2>/dev/null
    done
  done
fi

if [[ " $PARTS " == *" argo "* ]]; then
  # ARGO's LLM calls are batched generation: prompts of retrieved chunks (~1k tokens), short
  # answers. The plan first (what fleet says before loading), then the run.
  C=configs/models/qwen2.5-7b.json
  T=configs/topologies/rtx3060-8x-on-h200.toml
  D=cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7
  for g in 1 2 8; do
    mode=data-parallel; [ "$g" = 2 ] && mode=hybrid:2; [ "$g" = 8 ] && mode=layer-sharded
    "$W/fleet" plan --model "$C" --topology "$T" --mode "$mode" --batch 8 --seq-len 1152 > "$R/argo-8x12gb-g$g.plan.txt" 2>&1
    echo "== ARGO 7B on 8 x 12 GiB, $g device(s) per replica: plan ($mode) exit $?: $(tail -1 "$R/argo-8x12gb-g$g.plan.txt" | cut -c1-200)"
    timeout 300 "$W/fleet" --logical-gpus 8:12GiB bench data-parallel --config "$C" --devices "$D" --group-size "$g" \
      --batch 8 --batches-per-replica 2 --prompt-len 1024 --new-tokens 128 --json "$R/argo-8x12gb-g$g.json" \
      > "$R/argo-8x12gb-g$g.log" 2>&1
    echo "   run exit $?: $(grep -m1 -iE 'new tok/s|^Error' "$R/argo-8x12gb-g$g.log" | cut -c1-300)"
    grep "peak on" "$R/argo-8x12gb-g$g.log" | tr '\n' ' '; echo
  done
fi

if [[ " $PARTS " == *" judge "* ]]; then
  C=configs/models/qwen3-vl-30b-a3b.json
  for spec in "1:80GB cuda:0 8" "1:80GB cuda:0 16" "2:40GB cuda:0,cuda:1 8"; do
    set -- $spec
    name="judge-30b-a3b-$1-b$3"; name="${name//:/x}"
    timeout 300 "$W/edit-score" --logical-gpus "$1" bench --config "$C" --device "$2" --batch "$3" \
      --samples "$(( $3 * 2 ))" --new-tokens 128 --json "$R/$name.json" > "$R/$name.log" 2>&1
    echo "== judge 30B-A3B on --logical-gpus $1 ($2), batch $3: exit $?: $(grep -m1 -iE 'samples/s|^Error' "$R/$name.log" | cut -c1-300)"
    grep "peak on" "$R/$name.log" | tr '\n' ' '; echo
  done
fi
tar -C "$OUT" -czf "$OUT/seed_machines.tgz" seed_machines && rm -rf "$R"
