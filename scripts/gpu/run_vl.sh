#!/usr/bin/env bash
# Qwen3-VL on the GPU machine: bf16 parity with transformers on real shapes, and judge speed of
# fleet and transformers in the same call at the same batches. Carried: JUDGE_XZ (default
# dist/carry/edit-score.xz; a CUDA build of edit-score, xz).
#
#   WHAT=parity bash scripts/gpu/run_vl.sh      # 8B shape, and 30B-A3B shape with LAYERS30 layers
#   WHAT=speed SHAPES="8b" SIZES="1024" BATCHES="8 16 32" bash scripts/gpu/run_vl.sh
#                                               # both engines at every batch of BATCHES, in this
#                                               # call; pairs.md / pairs.json pair them by batch
#                                               # with the limit of the work (limits.py)
#   FLEET_BENCH_FLAGS="--batching static" WHAT=speed ...
#                                               # fleet's runs on the left-padded path (the
#                                               # bench's default before 2026-11-27, as
#                                               # edit-score's is now continuous)
#   BEST=1 WHAT=speed ...                       # and each engine's best batch that fits: batches
#                                               # doubling from BEST_FROM (default: twice the
#                                               # largest of BATCHES) to BEST_MAX (256) until one
#                                               # fails; how each search ended is in search.tsv
#   WHAT=speed8b bash scripts/gpu/run_vl.sh     # = WHAT=speed SHAPES=8b SIZES="512 1024"
#   WHAT=speed30b bash scripts/gpu/run_vl.sh    # = WHAT=speed SHAPES=30b SIZES=1024
#   WHAT=kernels bash scripts/gpu/run_vl.sh     # fleet-models' GPU tests (carried test binary
#                                               # dist/carry/fleet-models-tests.xz): fused
#                                               # attention and MoE paths against references
#   WHAT=fleet RUNS="8b:1024:8:16:0 30b:1024:8:8:1" bash scripts/gpu/run_vl.sh
#                                               # fleet only: shape:size:batch:samples:profile
#                                               # (FLEET_BENCH_FLAGS="--batching static":
#                                               # the left-padded path)
#   WHAT=hf HF_RUNS="8b:1024:8,16:16 30b:1024:8:16" bash scripts/gpu/run_vl.sh
#                                               # transformers only: shape:size:batches:samples
#                                               # (fleet-only or transformers-only figures are
#                                               # not comparisons: use WHAT=speed for those)
#
# Speed settings: SAMPLES_PER_BATCH timed batches per batch size after one warm-up batch
# (default 2), 128 greedy new tokens, two images per sample; FLEET_TIMEOUT (per fleet batch,
# default 240 s), HF_TIMEOUT (per transformers process, default 420 s) and BUDGET_S (the whole
# call, default 570 s): a step that would start with less than 30 s left is skipped and recorded.
# Everything lands in $OUT/vl_$WHAT.tgz (logs, JSON reports, nvidia-smi; vl_${WHAT}_$TAG.tgz
# with TAG set, and _2, _3, ... after it when that archive exists, so runs in one call never
# overwrite each other's); pairs.md and pairs.json are also copied to $OUT.
set -u
WHAT="${WHAT:?parity, speed, speed8b, speed30b, kernels, fleet or hf}"
START=$(date +%s)
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R="$OUT/vl_$WHAT"
mkdir -p "$R"
W=/tmp/vl_work
mkdir -p "$W"
BIN="$W/edit-score"
[ -x "$BIN" ] || { xz -dc "${JUDGE_XZ:-dist/carry/edit-score.xz}" > "$BIN" && chmod +x "$BIN"; }
FLEET_COMMIT="$(cat COMMIT 2>/dev/null || echo unknown)"
export FLEET_COMMIT
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
python3 -c "import transformers, torch; print(transformers.__version__, torch.__version__)" > "$R/versions.txt" 2>&1

case "$WHAT" in
kernels)
  T="$W/fleet-models-tests"
  xz -dc dist/carry/fleet-models-tests.xz > "$T" && chmod +x "$T"
  "$T" --test-threads 1 --nocapture kernel_tests > "$R/kernel-tests.log" 2>&1
  echo "kernel tests exit $?" >> "$R/kernel-tests.log"
  tail -30 "$R/kernel-tests.log"
  ;;
fleet)
  for run in ${RUNS:?shape:size:batch:samples:profile ...}; do
    IFS=: read -r shape size batch samples prof <<< "$run"
    case "$shape" in 8b) C=configs/models/qwen3-vl-8b.json ;; *) C=configs/models/qwen3-vl-30b-a3b.json ;; esac
    tag="fleet-$shape-$size-b$batch$( [ "$prof" = 1 ] && echo -profile )"
    # shellcheck disable=SC2086
    FLEET_PROFILE="$prof" "$BIN" bench --config "$C" --image-size "$size" --batch "$batch" --samples "$samples" \
        --new-tokens 128 ${FLEET_BENCH_FLAGS:-} --json "$R/$tag.json" > "$R/$tag.log" 2>&1 || tail -20 "$R/$tag.log"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], round(d['samples_per_s'],3), 'samples/s', 'prefill', round(d['prefill_s'],2), 'decode', round(d['decode_s'],2), 'peak GiB', round(d['peak_used_bytes']/2**30,1))" "$R/$tag.json" "$tag" || true
  done
  ;;
hf)
  for run in ${HF_RUNS:?shape:size:batches:samples ...}; do
    IFS=: read -r shape size batch samples <<< "$run"
    case "$shape" in 8b) C=configs/models/qwen3-vl-8b.json ;; *) C=configs/models/qwen3-vl-30b-a3b.json ;; esac
    tag="hf-$shape-$size-b${batch//,/_}"
    timeout "${HF_TIMEOUT:-240}" python3 scripts/gpu/vl_bench_transformers.py --config "$C" --image-size "$size" \
        --batch "$batch" --samples "$samples" --new-tokens 128 --json "$R/$tag.json" > "$R/$tag.log" 2>&1 \
        || tail -20 "$R/$tag.log"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], r['batch'], round(r['samples_per_s'],3) if 'samples_per_s' in r else r.get('error'), 'samples/s') for r in d['runs']]" "$R/$tag.json" "$tag" || true
  done
  ;;
parity)
  for spec in "8b:configs/models/qwen3-vl-8b.json:0" "30b-a3b:configs/models/qwen3-vl-30b-a3b.json:${LAYERS30:-4}"; do
    IFS=: read -r name cfg layers <<< "$spec"
    case " ${PARITY_SHAPES:-8b 30b-a3b} " in *" $name "*) ;; *) continue ;; esac
    D="$W/parity-$name"
    rm -rf "$D"
    python3 scripts/gpu/vl_parity_bf16.py make --config "$cfg" --out "$D" --layers "$layers" \
        --image-size "${IMAGE_SIZE:-512}" > "$R/make-$name.log" 2>&1 || { tail -20 "$R/make-$name.log"; continue; }
    "$BIN" logits --model "$D/model" --inputs "$D/inputs.json" --output "$D/fleet.safetensors" \
        --device cuda:0 --dtype bf16 > "$R/fleet-$name.log" 2>&1 || tail -20 "$R/fleet-$name.log"
    python3 scripts/gpu/vl_parity_bf16.py compare --dir "$D" --fleet "$D/fleet.safetensors" \
        --json "$R/parity-$name.json" 2>&1 | tee "$R/compare-$name.log"
    if grep -q qwen3_vl_moe "$D/model/config.json"; then
      # The same with candle's fused MoE kernels off (the grouped path, as transformers loops).
      FLEET_MOE_KERNEL=0 "$BIN" logits --model "$D/model" --inputs "$D/inputs.json" \
          --output "$D/fleet-grouped.safetensors" --device cuda:0 --dtype bf16 > "$R/fleet-$name-grouped.log" 2>&1
      python3 scripts/gpu/vl_parity_bf16.py compare --dir "$D" --fleet "$D/fleet-grouped.safetensors" \
          --json "$R/parity-$name-grouped.json" 2>&1 | tee "$R/compare-$name-grouped.log"
      python3 -c "
import json,struct,sys
f=open(sys.argv[1],'rb');n=struct.unpack('<Q',f.read(8))[0];h=json.loads(f.read(n))
print({k:v['shape'] for k,v in h.items() if 'layers.0.mlp' in k})" "$(ls "$D"/model/*.safetensors | head -1)" | tee "$R/moe-shapes.txt"
    fi
    cp "$D/meta.json" "$R/meta-$name.json"
    rm -rf "$D/model"
  done
  ;;
speed|speed8b|speed30b)
  case "$WHAT" in
    speed8b) SHAPES="${SHAPES:-8b}"; SIZES="${SIZES:-512 1024}" ;;
    speed30b) SHAPES="${SHAPES:-30b}"; SIZES="${SIZES:-1024}" ;;
  esac
  SPB="${SAMPLES_PER_BATCH:-2}"
  BATCHES="${BATCHES:-8 16 32}"
  BUDGET_S="${BUDGET_S:-570}"
  TSV="$R/search.tsv"
  : > "$TSV"
  left() { echo $((START + BUDGET_S - $(date +%s))); }
  # cap SECONDS: the smaller of SECONDS and what is left of the budget (0 if under 30 s)
  cap() { local l; l=$(left); if [ "$l" -lt 30 ]; then echo 0; elif [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi; }
  largest=$(for b in $BATCHES; do echo "$b"; done | sort -n | tail -1)
  best_list() {  # the doubling batches of the search: BEST_FROM, 2x, ... up to BEST_MAX
    local b="${BEST_FROM:-$((largest * 2))}" out=""
    while [ "$b" -le "${BEST_MAX:-256}" ]; do out="$out $b"; b=$((b * 2)); done
    echo "$out"
  }
  # fleet_at KEY CONFIG SIZE BATCH MODE: one edit-score bench process; records the outcome in
  # search.tsv (oom only where the log says so); returns non-zero when the batch did not run.
  fleet_at() {
    local key=$1 C=$2 size=$3 b=$4 mode=$5 t tag rc status note
    tag="fleet-$(basename "$C" .json)-$size-b$b"
    t=$(cap "${FLEET_TIMEOUT:-240}")
    if [ "$t" = 0 ]; then printf 'fleet\t%s:%s\t%s\tskipped\ttime budget used up\n' "$mode" "$key" "$b" >> "$TSV"; return 1; fi
    # shellcheck disable=SC2086
    timeout "$t" "$BIN" bench --config "$C" --image-size "$size" --batch "$b" --samples "$((b * SPB))" \
        --new-tokens 128 ${FLEET_BENCH_FLAGS:-} --json "$R/$tag.json" > "$R/$tag.log" 2>&1
    rc=$?
    if [ "$rc" = 0 ]; then status=ok; note=""
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=timeout; note="killed after ${t}s"
    elif grep -qiE 'out of memory|OUT_OF_MEMORY' "$R/$tag.log"; then status=oom; note="$(grep -iE -m1 'out of memory|OUT_OF_MEMORY' "$R/$tag.log" | cut -c1-160)"
    else status=error; note="exit $rc: $(tail -1 "$R/$tag.log" | cut -c1-160)"; fi
    printf 'fleet\t%s:%s\t%s\t%s\t%s\n' "$mode" "$key" "$b" "$status" "$note" >> "$TSV"
    echo "fleet $key batch $b: $status $( [ "$status" = ok ] && python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['samples_per_s'],3), 'samples/s')" "$R/$tag.json")"
    [ "$status" = ok ]
  }
  # hf_at KEY CONFIG SIZE "B1 B2 ..." MODE: one transformers process over the batches.
  hf_at() {
    local key=$1 C=$2 size=$3 list=$4 mode=$5 t tag rc extra=""
    tag="hf-$(basename "$C" .json)-$size-$mode"
    t=$(cap "${HF_TIMEOUT:-420}")
    if [ "$t" = 0 ]; then
      for b in $list; do printf 'transformers\t%s:%s\t%s\tskipped\ttime budget used up\n' "$mode" "$key" "$b" >> "$TSV"; done
      return
    fi
    [ "$mode" = best ] && extra="--stop-at-oom"
    # shellcheck disable=SC2086
    timeout "$t" python3 scripts/gpu/vl_bench_transformers.py --config "$C" --image-size "$size" \
        --batch "$(echo $list | tr ' ' ,)" --samples-per-batch "$SPB" --new-tokens 128 --prefill $extra \
        --json "$R/$tag.json" > "$R/$tag.log" 2>&1
    rc=$?
    python3 - "$R/$tag.json" "$key" "$mode" "$rc" "$t" "$list" >> "$TSV" <<'PY'
import json, sys
path, key, mode, rc, t, wanted = sys.argv[1:7]
try:
    runs = {r["batch"]: r for r in json.load(open(path))["runs"]}
except (OSError, ValueError, KeyError):
    runs = {}
stopped = False
for b in map(int, wanted.split()):
    r = runs.get(b)
    if r is None:
        if stopped:
            continue  # not tried after a failure (--stop-at-oom)
        why = ("timeout", f"killed after {t}s") if rc in ("124", "137") else ("error", f"exit {rc}, no result")
        print(f"transformers	{mode}:{key}	{b}	{why[0]}	{why[1]}")
        stopped = True
    elif "error" in r:
        status = "oom" if r["error"].startswith("OOM") else "error"
        print(f"transformers	{mode}:{key}	{b}	{status}	{r['error'][:160]}")
        stopped = mode == "best"
    else:
        print(f"transformers	{mode}:{key}	{b}	ok	")
PY
    grep -E 'samples/s|OOM|Error' "$R/$tag.log" | grep -v '^ ' | tail -8
  }
  for shape in $SHAPES; do
    case "$shape" in 8b) C=configs/models/qwen3-vl-8b.json ;; *) C=configs/models/qwen3-vl-30b-a3b.json ;; esac
    for size in $SIZES; do
      key="$(basename "$C" .json)@${size}px"
      # The same batches for both engines, in this call.
      for b in $BATCHES; do fleet_at "$key" "$C" "$size" "$b" list || true; done
      hf_at "$key" "$C" "$size" "$BATCHES" list
      if [ "${BEST:-0}" = 1 ]; then
        # Each engine's best batch that fits: larger batches until one fails.
        for b in $(best_list); do fleet_at "$key" "$C" "$size" "$b" best || break; done
        hf_at "$key" "$C" "$size" "$(best_list)" best
      fi
    done
  done
  python3 scripts/gpu/pair_results.py judge "$R" > "$R/pairs.log" 2>&1 || tail -20 "$R/pairs.log"
  cat "$R/pairs.md" 2>/dev/null
  cp "$R/pairs.md" "$R/pairs.json" "$OUT/" 2>/dev/null
  ;;
esac
# A second run in the same call keeps the first's archive: vl_$WHAT[_$TAG][_2, _3, ...].tgz.
name="vl_$WHAT${TAG:+_$TAG}"
n=1
while [ -e "$OUT/$name.tgz" ]; do n=$((n + 1)); name="vl_$WHAT${TAG:+_$TAG}_$n"; done
tar -C "$OUT" -czf "$OUT/$name.tgz" "vl_$WHAT"
echo "archive: $OUT/$name.tgz"
rm -rf "$R"
ls -la "$OUT"
