#!/usr/bin/env bash
# What needs two real GPUs, on nvidia-h100-x2 in one call (the multi-GPU paths were verified on
# logical devices of one GPU while machines with several were withheld):
#   tests     the carried CUDA tests (dist/carry/two-gpu-tests.tar.xz: decode_graph_segments,
#             parity, qwen3_vl_parity and train_grads out of scripts/gpu/build_paged_tests.sh's
#             paged-tests.tar.xz, which is too large to carry beside gspo-train):
#             decode_graph_segments on GPUs 0 and 1 (then on logical devices); parity,
#             qwen3_vl_parity and train_grads with the layers split over both
#             (FLEET_TEST_DEVICES=cuda:0,cuda:1: the goldens of transformers, LoRA's gradients
#             against PEFT's, the dropout masks drawn again by the recompute) and train_grads on
#             cuda:0 alone
#   sharded   gspo-train's policy layer-sharded over both GPUs (--gpu-mode 2gpu; rollouts
#             through one CUDA graph per GPU) against one GPU, 8 steps of the 1.5B shape
#             (configs/gspo/bench.toml, random weights): both run, and the same metrics
#   zero      scripts/gpu/run_gspo_zero.sh (ZeRO-1 against zero_stage 0 through NCCL)
# Carried: dist/carry/two-gpu-tests.tar.xz, dist/carry/gspo-train.xz, COMMIT.
#     PARTS="tests sharded zero" bash scripts/gpu/run_two_gpu_checks.sh
# Writes $OUT/two_gpu.log and $OUT/two_gpu.tgz (test logs, metrics); zero's own files beside.
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_two_gpu}"
PARTS="${PARTS:-tests sharded zero}"
R="$OUT/two_gpu"
mkdir -p "$R"
exec > >(tee -a "$OUT/two_gpu.log") 2>&1
has() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m | head -4
echo "commit $(cat COMMIT 2>/dev/null)"
if has tests; then
  T=/tmp/paged_tests; mkdir -p "$T"
  xz -dc dist/carry/two-gpu-tests.tar.xz | tar xf - -C "$T"
  # The test binaries find tests/fixtures through the path they were built at.
  [ -e /work/main/tests/fixtures ] || { mkdir -p /work; ln -sfn "$PWD" /work/main; }
  t() { # name devices args...
    local name="$1" devices="$2"; shift 2
    echo "== $name on ${devices:-default} ($(date +%T))"
    FLEET_TEST_DEVICES="$devices" timeout 200 "$T/$name" --test-threads 1 "$@" > "$R/test_${name}_${devices//[:,]/_}.txt" 2>&1
    echo "rc $?"; grep -E '^test |test result|panicked|FAILED|two real|logical|one real' "$R/test_${name}_${devices//[:,]/_}.txt" | head -30
  }
  t decode_graph_segments "" --nocapture
  t parity cuda:0,cuda:1
  t qwen3_vl_parity cuda:0,cuda:1
  t train_grads cuda:0,cuda:1
  t train_grads cuda:0
fi
if has sharded; then
  W=/tmp/two_gpu; mkdir -p "$W"
  BIN="$W/gspo-train"
  [ -x "$BIN" ] || { xz -dc dist/carry/gspo-train.xz > "$BIN" && chmod +x "$BIN"; }
  [ -f "$W/prompts.jsonl" ] || python3 scripts/gpu/make_gspo_prompts.py --out "$W/prompts.jsonl" --n 256 > /dev/null
  c=/tmp/zero/q1.5b
  [ -f "$c/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py --config configs/models/qwen2.5-1.5b.json \
    --out "$c" --tokenizer-from tests/fixtures/qwen2-tiny --dtype bf16 > "$R/make-1.5b.log" 2>&1
  for mode in 1gpu 2gpu; do
    echo "== gspo-train 1.5B, --gpu-mode $mode ($(date +%T))"
    rm -rf "$W/s-$mode"
    timeout 200 "$BIN" --config configs/gspo/bench.toml --model "$c" --dataset "$W/prompts.jsonl" --gpu-mode "$mode" \
      --dtype bf16 --torch-dtype bfloat16 --max-steps 8 --output-dir "$W/s-$mode" > "$R/sharded-$mode.log" 2>&1
    echo "exit $?"; grep -E "^policy:|^Error" "$R/sharded-$mode.log" | head -3
    cp "$W/s-$mode/metrics.jsonl" "$R/sharded-$mode.metrics.jsonl" 2>/dev/null
  done
  python3 - "$R" <<'PY'
import json, sys
from pathlib import Path
r = Path(sys.argv[1])
m = {k: [json.loads(l) for l in (r / f"sharded-{k}.metrics.jsonl").read_text().splitlines() if l.strip()]
     for k in ("1gpu", "2gpu") if (r / f"sharded-{k}.metrics.jsonl").exists()}
if len(m) == 2:
    a, b = m["1gpu"], m["2gpu"]
    # With random weights every reward is 0 (so loss and grad_norm too): the entropy and the
    # unparsed answers are what the rollouts and the scoring pass leave to compare.
    keys = ("loss", "reward", "grad_norm", "entropy", "unparsed_answers", "num_tokens")
    print("sharded: steps", len(a), len(b), "same metrics every step:",
          len(a) == len(b) and all(x.get(k) == y.get(k) for x, y in zip(a, b) for k in keys))
    for x, y in zip(a, b):
        print(" ", x.get("step"), [x.get(k) for k in keys], [y.get(k) for k in keys])
    for k, v in m.items():
        print(k, "seconds per step", [round(x.get("step_time", 0), 2) for x in v])
PY
fi
if has zero; then
  OUT="$OUT" bash scripts/gpu/run_gspo_zero.sh
fi
tar -C "$OUT" -czf "$OUT/two_gpu.tgz" two_gpu && rm -rf "$R"
ls -la "$OUT"
