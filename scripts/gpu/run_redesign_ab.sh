#!/usr/bin/env bash
# Issue 25's before/after speed check as an A/B on one machine in one call: the same part run
# with the "before" and the "after" binary alternately, the first side swapped every round, so
# machine-to-machine differences (the host-bound decode follows the host CPU) and the order
# within a round cancel out.
# Carried: dist/carry/before/<bin>.xz and dist/carry/after/<bin>.xz for the part's binary, and
# COMMIT files dist/carry/{before,after}/COMMIT.
#   PART=generate ROUNDS=3 bash scripts/gpu/run_redesign_ab.sh   # fleet bench generate
#     (GEN_CONFIG, GEN_BATCH, GEN_PROMPT, GEN_NEW: another shape, e.g. GSPO's rollouts)
#   PART=judge    ROUNDS=3 bash scripts/gpu/run_redesign_ab.sh   # edit-score bench
#   PART=gspo     ROUNDS=2 bash scripts/gpu/run_redesign_ab.sh   # gspo-train, 8 steps
# Settings as scripts/gpu/run_redesign_speed.sh. Writes $OUT/ab-<PART>.tsv and .tgz (logs).
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
PART="${PART:?PART=generate|judge|gspo}"
ROUNDS="${ROUNDS:-3}"
W=/tmp/redesign_ab; R="$OUT/ab-$PART"; mkdir -p "$W" "$R"
case "$PART" in generate) BIN=fleet ;; judge) BIN=edit-score ;; gspo) BIN=gspo-train ;; esac
for side in before after; do
  mkdir -p "$W/$side"
  xz -dc "dist/carry/$side/$BIN.xz" > "$W/$side/$BIN" && chmod +x "$W/$side/$BIN"
  cp "dist/carry/$side/COMMIT" "$R/COMMIT-$side" 2>/dev/null
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/nvidia-smi.txt"
if [ "$PART" = gspo ]; then
  python3 scripts/gpu/make_gspo_prompts.py --out "$W/prompts.jsonl" --n 256 > /dev/null
  [ -f "$W/q05/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py \
    --config configs/models/qwen2.5-0.5b.json --out "$W/q05" \
    --tokenizer-from tests/fixtures/qwen2-tiny > /dev/null 2>&1
fi
run() { # side round
  local b="$W/$1/$BIN" tag="$1-$2"
  case "$PART" in
    generate) "$b" bench generate --config "${GEN_CONFIG:-configs/models/qwen2.5-7b.json}" \
        --batch "${GEN_BATCH:-1,32}" --prompt-len "${GEN_PROMPT:-512}" \
        --new-tokens "${GEN_NEW:-128}" --repeats 3 --json "$R/$tag.json" > "$R/$tag.log" 2>&1 ;;
    judge) "$b" bench --config configs/models/qwen3-vl-8b.json --image-size 512 --batch 8 \
        --samples 32 --new-tokens 128 --json "$R/$tag.json" > "$R/$tag.log" 2>&1 ;;
    gspo) rm -rf "$W/gspo"; "$b" --config configs/gspo/bench.toml --model "$W/q05" \
        --dataset "$W/prompts.jsonl" --gpu-mode 1gpu --dtype bf16 --torch-dtype bfloat16 \
        --max-steps 8 --output-dir "$W/gspo" > "$R/$tag.log" 2>&1
      cp "$W/gspo/metrics.jsonl" "$R/$tag.metrics.jsonl" ;;
  esac
  echo "$tag: exit $?"
}
# Rounds alternate which side goes first (before-after, after-before, ...), so that an order
# effect (a GPU warmer for the second run of a round) does not favour one side.
for i in $(seq 1 "$ROUNDS"); do
  if [ $((i % 2)) = 1 ]; then run before "$i"; run after "$i"; else run after "$i"; run before "$i"; fi
done
python3 - "$R" "$PART" <<'PY' | tee "$OUT/ab-$PART.tsv"
import json, sys, glob, os
r, part = sys.argv[1], sys.argv[2]
print("side\tround\tmetric\tvalue")
for f in sorted(glob.glob(f"{r}/*-[0-9]*.json")) + sorted(glob.glob(f"{r}/*.metrics.jsonl")):
    tag = os.path.basename(f).split(".")[0]
    side, rnd = tag.rsplit("-", 1)
    if part == "generate":
        for run in json.load(open(f))["runs"]:
            print(f"{side}\t{rnd}\tdecode_tok_s_b{run['batch']}\t{run['decode_tok_s']:.1f}")
            print(f"{side}\t{rnd}\tprefill_tok_s_b{run['batch']}\t{run['prefill_tok_s']:.0f}")
    elif part == "judge":
        print(f"{side}\t{rnd}\tsamples_per_s_b8\t{json.load(open(f))['samples_per_s']:.3f}")
    else:
        rows = [json.loads(l) for l in open(f)]
        second = [x for x in rows if x["step"] > 4]
        s = sum(x["generation_seconds"] + x["scoring_seconds"] + x["update_seconds"] for x in second)
        print(f"{side}\t{rnd}\ts_per_generation_batch\t{s:.3f}")
        print(f"{side}\t{rnd}\ttokens_per_s_last\t{rows[-1].get('tokens_per_second', 0):.0f}")
PY
tar -C "$OUT" -czf "$OUT/ab-$PART.tgz" "ab-$PART" && rm -rf "$R"
