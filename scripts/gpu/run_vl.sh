#!/usr/bin/env bash
# Qwen3-VL on the GPU machine: bf16 parity with transformers on real shapes, and judge speed of
# fleet and transformers in the same call. Carried: dist/carry/edit-score.xz (CUDA build).
#
#   WHAT=parity bash scripts/gpu/run_vl.sh      # 8B shape, and 30B-A3B shape with LAYERS30 layers
#   WHAT=speed8b bash scripts/gpu/run_vl.sh     # 8B: 512px batch 1 and 1024px batch 2, both engines
#   WHAT=speed30b bash scripts/gpu/run_vl.sh    # 30B-A3B: fleet batches, transformers batch 1
#   WHAT=kernels bash scripts/gpu/run_vl.sh     # fleet-models' GPU tests (carried test binary
#                                               # dist/carry/fleet-models-tests.xz): fused
#                                               # attention and MoE paths against references
#   WHAT=fleet RUNS="8b:1024:8:16:0 30b:1024:8:8:1" bash scripts/gpu/run_vl.sh
#                                               # fleet only: shape:size:batch:samples:profile
#   WHAT=hf HF_RUNS="8b:1024:2:4 30b:1024:1:2" bash scripts/gpu/run_vl.sh
#                                               # transformers only: shape:size:batch:samples
#
# Everything lands in $OUT/vl_$WHAT.tgz (logs, JSON reports, nvidia-smi).
set -u
WHAT="${WHAT:?parity, speed8b or speed30b}"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R="$OUT/vl_$WHAT"
mkdir -p "$R"
W=/tmp/vl_work
mkdir -p "$W"
BIN="$W/edit-score"
[ -x "$BIN" ] || { xz -dc dist/carry/edit-score.xz > "$BIN" && chmod +x "$BIN"; }
export FLEET_COMMIT="$(cat COMMIT 2>/dev/null || echo unknown)"
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
    FLEET_PROFILE="$prof" "$BIN" bench --config "$C" --image-size "$size" --batch "$batch" --samples "$samples" \
        --new-tokens 128 --json "$R/$tag.json" > "$R/$tag.log" 2>&1 || tail -20 "$R/$tag.log"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], round(d['samples_per_s'],3), 'samples/s', 'prefill', round(d['prefill_s'],2), 'decode', round(d['decode_s'],2), 'peak GiB', round(d['peak_used_bytes']/2**30,1))" "$R/$tag.json" "$tag" || true
  done
  ;;
hf)
  for run in ${HF_RUNS:?shape:size:batch:samples ...}; do
    IFS=: read -r shape size batch samples <<< "$run"
    case "$shape" in 8b) C=configs/models/qwen3-vl-8b.json ;; *) C=configs/models/qwen3-vl-30b-a3b.json ;; esac
    tag="hf-$shape-$size-b$batch"
    timeout "${HF_TIMEOUT:-240}" python3 scripts/gpu/vl_bench_transformers.py --config "$C" --image-size "$size" \
        --batch "$batch" --samples "$samples" --new-tokens 128 --json "$R/$tag.json" > "$R/$tag.log" 2>&1 \
        || tail -20 "$R/$tag.log"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], round(d['samples_per_s'],3), 'samples/s')" "$R/$tag.json" "$tag" || true
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
speed8b)
  C=configs/models/qwen3-vl-8b.json
  for run in "512:1:${S512:-4}" "1024:2:${S1024:-4}"; do
    IFS=: read -r size batch samples <<< "$run"
    FLEET_PROFILE=1 "$BIN" bench --config "$C" --image-size "$size" --batch "$batch" --samples "$samples" \
        --new-tokens 128 --json "$R/fleet-8b-$size-b$batch.json" > "$R/fleet-8b-$size-b$batch.log" 2>&1 \
        || tail -20 "$R/fleet-8b-$size-b$batch.log"
    "$BIN" bench --config "$C" --image-size "$size" --batch "${FLEET_BATCH:-8}" --samples "${FLEET_SAMPLES:-16}" \
        --new-tokens 128 --json "$R/fleet-8b-$size-b${FLEET_BATCH:-8}.json" > "$R/fleet-8b-$size-bbig.log" 2>&1 \
        || tail -20 "$R/fleet-8b-$size-bbig.log"
    python3 scripts/gpu/vl_bench_transformers.py --config "$C" --image-size "$size" --batch "$batch" \
        --samples "$samples" --new-tokens 128 --json "$R/hf-8b-$size-b$batch.json" > "$R/hf-8b-$size-b$batch.log" 2>&1 \
        || tail -20 "$R/hf-8b-$size-b$batch.log"
  done
  ;;
speed30b)
  C=configs/models/qwen3-vl-30b-a3b.json
  size="${IMAGE_SIZE:-1024}"
  for batch in ${FLEET_BATCHES:-8 32}; do
    FLEET_PROFILE="${PROFILE:-0}" "$BIN" bench --config "$C" --image-size "$size" --batch "$batch" \
        --samples "$((batch * ${BATCHES:-2}))" --new-tokens 128 --json "$R/fleet-30b-$size-b$batch.json" \
        > "$R/fleet-30b-$size-b$batch.log" 2>&1 || tail -20 "$R/fleet-30b-$size-b$batch.log"
  done
  if [ "${HF:-1}" = 1 ]; then
    timeout "${HF_TIMEOUT:-240}" python3 scripts/gpu/vl_bench_transformers.py --config "$C" --image-size "$size" \
        --batch 1 --samples "${HF_SAMPLES:-2}" --new-tokens 128 --json "$R/hf-30b-$size-b1.json" \
        > "$R/hf-30b-$size-b1.log" 2>&1 || tail -20 "$R/hf-30b-$size-b1.log"
  fi
  ;;
esac
tar -C "$OUT" -czf "$OUT/vl_$WHAT.tgz" "vl_$WHAT"
rm -rf "$R"
ls -la "$OUT"
