#!/usr/bin/env bash
# Data-parallel gspo-train on nvidia-h200-x2 (issue 12, item 6), in parts:
#
#   bw     NCCL all-reduce from fleet's own collective (gspo-train --bench-all-reduce) beside
#          torch.distributed's, same sizes and nccl-tests' busbw definition
#   curves the embedded default in bf16 on 1 GPU and on 2 GPUs with the same global batch
#   nodes  two launcher invocations (--nnodes 2 over 127.0.0.1, one GPU each) vs one node of two
#   tput   Qwen2.5-0.5B and 1.5B shapes (random weights, configs/gspo/bench.toml): 1 GPU, 2 GPUs
#          with the same global batch, 2 GPUs with the per-GPU batch kept (--scale-lr linear)
#   contention  the 0.5B shape alone, as two independent runs at once, and data-parallel
#   kill   a 2-GPU 0.5B run: rank 1 killed (SIGKILL) mid-run, then a run with rank 1 stopped
#          (SIGSTOP): seconds until rank 0 exits, and its error
#
# Carried: dist/carry/gspo-train.xz (scripts/cuda/build.sh -p gspo-train, stripped, xz) and
# COMMIT. Run from the repo root:
#
#     PARTS="bw curves nodes tput kill" bash scripts/gpu/run_gspo_dp.sh
#
# Writes $OUT/dp_summary.json (every figure) and $OUT/dp.tgz (logs, metrics, plots' inputs).
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT="${OUT:-$PWD/out_dp}"
W="${WORK:-/tmp/dp}"
PARTS="${PARTS:-bw curves nodes tput kill}"
CURVE_STEPS="${CURVE_STEPS:-200}"
TPUT_STEPS="${TPUT_STEPS:-16}"
SHAPES="${SHAPES:-0.5b 1.5b}"
R="$OUT/dp"
mkdir -p "$R" "$W"
exec > >(tee -a "$R/log.txt") 2>&1
BIN="$W/gspo-train"
xz -dc dist/carry/gspo-train.xz > "$BIN" && chmod +x "$BIN"
export FLEET_COMMIT="$(cat COMMIT 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$R/gpus.txt"
nvidia-smi topo -m > "$R/topo.txt" 2>&1
echo "commit $FLEET_COMMIT; parts: $PARTS"
has() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
stamp() { echo "== $* ($(date +%T))"; }
# Each run under a time limit, so one stuck run cannot take the whole call.
lim() { local s="$1"; shift; timeout --kill-after=5 "$s" "$@"; }

if has bw; then
  stamp "all-reduce: fleet"
  lim 120 "$BIN" --nproc-per-node 2 --master-port 29611 --bench-all-reduce 1GiB --output-dir "$W/ar" \
    > "$R/all_reduce_fleet.txt" 2>&1
  echo "exit $?"; cat "$R/all_reduce_fleet.txt" | grep -v "^\[rank 1\]"
  cp "$W/ar/all_reduce_perf.json" "$R/all_reduce_fleet.json" 2>/dev/null
  stamp "all-reduce: torch.distributed"
  lim 150 python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29612 \
    scripts/gpu/torch_all_reduce_perf.py --max-bytes $((1 << 30)) --out "$R/all_reduce_torch.json" \
    > "$R/all_reduce_torch.txt" 2>&1
  echo "exit $?"; grep -v Warning "$R/all_reduce_torch.txt" | tail -24
fi

if has curves; then
  stamp "curves: embedded default, bf16, $CURVE_STEPS steps, 1 GPU"
  rm -rf "$W/c1" "$W/c2"
  CUDA_VISIBLE_DEVICES=0 lim 200 "$BIN" --output-dir "$W/c1" --max-steps "$CURVE_STEPS" --dtype bf16 \
    > "$R/curve-1gpu.log" 2>&1; echo "exit $?"; tail -3 "$R/curve-1gpu.log"
  stamp "curves: 2 GPUs, same global batch"
  lim 200 "$BIN" --nproc-per-node 2 --master-port 29613 --output-dir "$W/c2" --max-steps "$CURVE_STEPS" \
    --dtype bf16 > "$R/curve-2gpu.log" 2>&1; echo "exit $?"; grep -v "^\[rank 1\]" "$R/curve-2gpu.log" | tail -12
  cp "$W/c1/metrics.jsonl" "$R/curve-1gpu.metrics.jsonl"; cp "$W/c2/metrics.jsonl" "$R/curve-2gpu.metrics.jsonl"
fi

if has nodes; then
  stamp "nodes: one node of two"
  rm -rf "$W/n1" "$W/n2"
  lim 120 "$BIN" --nproc-per-node 2 --master-port 29614 --output-dir "$W/n1" --max-steps 60 --dtype bf16 \
    --set save_steps=60 > "$R/nodes-one.log" 2>&1; echo "exit $?"
  stamp "nodes: two launchers, --nnodes 2 over 127.0.0.1"
  pids=()
  for node in 0 1; do
    lim 120 "$BIN" --nproc-per-node 1 --nnodes 2 --node-rank "$node" --master-addr 127.0.0.1 \
      --master-port 29615 --gpu-ids "$node" --output-dir "$W/n2" --max-steps 60 --dtype bf16 \
      --set save_steps=60 > "$R/nodes-two-$node.log" 2>&1 &
    pids+=($!)
  done
  # Not a bare `wait`: it would also wait for the tee of this script's output.
  for p in "${pids[@]}"; do wait "$p"; echo "launcher exit $?"; done
  grep -h "Distributed\|Number of" "$R/nodes-two-0.log" | head -4
  cp "$W/n1/metrics.jsonl" "$R/nodes-one.metrics.jsonl"; cp "$W/n2/metrics.jsonl" "$R/nodes-two.metrics.jsonl"
  (cd "$W/n1" && find . -name model.safetensors -exec sha256sum {} \;) | tee "$R/nodes-one.sha256"
  (cd "$W/n2" && find . -name model.safetensors -exec sha256sum {} \;) | tee "$R/nodes-two.sha256"
fi

ckpt() { # shape -> random checkpoint dir
  local d="$W/q$1"
  [ -f "$d/config.json" ] || python3 scripts/gpu/make_random_checkpoint.py \
    --config "configs/models/qwen2.5-$1.json" --out "$d" --tokenizer-from tests/fixtures/qwen2-tiny \
    --dtype bf16 > "$R/make-$1.log" 2>&1
  echo "$d"
}
if has tput || has kill || has contention; then
  [ -f "$W/prompts.jsonl" ] || python3 scripts/gpu/make_gspo_prompts.py --out "$W/prompts.jsonl" --n 512
fi

if has tput; then
  for shape in $SHAPES; do
    c=$(ckpt "$shape")
    common=(--config configs/gspo/bench.toml --model "$c" --dataset "$W/prompts.jsonl" --dtype bf16
            --max-steps "$TPUT_STEPS")
    stamp "tput $shape: 1 GPU"
    rm -rf "$W/t-$shape-"*
    CUDA_VISIBLE_DEVICES=0 lim 240 "$BIN" "${common[@]}" --output-dir "$W/t-$shape-1" \
      > "$R/tput-$shape-1.log" 2>&1; echo "exit $?"
    stamp "tput $shape: 2 GPUs, same global batch"
    lim 240 "$BIN" --nproc-per-node 2 --master-port 29616 "${common[@]}" --output-dir "$W/t-$shape-2fixed" \
      > "$R/tput-$shape-2fixed.log" 2>&1; echo "exit $?"
    stamp "tput $shape: 2 GPUs, per-GPU batch kept (--scale-lr linear)"
    lim 240 "$BIN" --nproc-per-node 2 --master-port 29617 "${common[@]}" --scale-lr linear \
      --output-dir "$W/t-$shape-2linear" > "$R/tput-$shape-2linear.log" 2>&1; echo "exit $?"
    # The single-GPU run again: generation times of one shape differed by 20% between calls,
    # so the reference is taken before and after the two-GPU runs.
    stamp "tput $shape: 1 GPU again"
    CUDA_VISIBLE_DEVICES=0 lim 240 "$BIN" "${common[@]}" --output-dir "$W/t-$shape-1again" \
      > "$R/tput-$shape-1again.log" 2>&1; echo "exit $?"
    for v in 1 2fixed 2linear 1again; do
      cp "$W/t-$shape-$v/metrics.jsonl" "$R/tput-$shape-$v.metrics.jsonl" 2>/dev/null
      grep -h "^batch:\|\[rank 0\] batch:" "$R/tput-$shape-$v.log" | head -1
    done
  done
fi

# Whether two processes slow each other down without any collective: the 0.5B shape alone on
# GPU 0, then two independent single-GPU runs at once (GPU 0 and GPU 1), with FLEET_PROFILE=1.
if has contention; then
  c=$(ckpt 0.5b)
  common=(--config configs/gspo/bench.toml --model "$c" --dataset "$W/prompts.jsonl" --dtype bf16
          --max-steps "$TPUT_STEPS")
  rm -rf "$W/x-"*
  stamp "contention: 0.5b alone on GPU 0"
  CUDA_VISIBLE_DEVICES=0 FLEET_PROFILE=1 lim 240 "$BIN" "${common[@]}" --output-dir "$W/x-alone" \
    > "$R/contention-alone.log" 2>&1; echo "exit $?"
  stamp "contention: two independent runs at once"
  CUDA_VISIBLE_DEVICES=0 FLEET_PROFILE=1 lim 240 "$BIN" "${common[@]}" --output-dir "$W/x-pair0" \
    > "$R/contention-pair0.log" 2>&1 &
  p0=$!
  CUDA_VISIBLE_DEVICES=1 FLEET_PROFILE=1 lim 240 "$BIN" "${common[@]}" --output-dir "$W/x-pair1" \
    > "$R/contention-pair1.log" 2>&1 &
  p1=$!
  wait "$p0"; wait "$p1"
  stamp "contention: 2 GPUs data-parallel, --scale-lr linear, profiled"
  FLEET_PROFILE=1 lim 240 "$BIN" --nproc-per-node 2 --master-port 29619 "${common[@]}" --scale-lr linear \
    --output-dir "$W/x-dp" > "$R/contention-dp.log" 2>&1; echo "exit $?"
  for v in alone pair0 pair1 dp; do
    cp "$W/x-$v/metrics.jsonl" "$R/contention-$v.metrics.jsonl" 2>/dev/null
    python3 -c "
import json,sys
m=[json.loads(l) for l in open(sys.argv[1])]
g=[x['generation_seconds'] for x in m if x['generation_seconds']>0][1:]
u=[x['update_seconds'] for x in m][4:]
print(sys.argv[2], 'generation s/batch', [round(v,2) for v in g], 'update s/step', round(sum(u)/max(len(u),1),3))" \
      "$R/contention-$v.metrics.jsonl" "$v" 2>/dev/null
    grep -h "profile" "$R/contention-$v.log" | grep -v "rank 1" | head -14
  done
  nproc; grep -m3 MHz /proc/cpuinfo
fi

# Runs the 2-GPU 0.5B training in the background, waits for its third step, sends rank 1 the
# signal, and times rank 0's exit.
kill_case() { # name signal
  local name="$1" sig="$2" c; c=$(ckpt 0.5b)
  rm -rf "$W/k-$name"
  "$BIN" --nproc-per-node 2 --master-port 29618 --config configs/gspo/bench.toml --model "$c" \
    --dataset "$W/prompts.jsonl" --dtype bf16 --max-steps 400 --dist-timeout 20 \
    --output-dir "$W/k-$name" > "$R/kill-$name.log" 2>&1 &
  local launcher=$! i
  for i in $(seq 1 600); do
    [ "$(wc -l < "$W/k-$name/metrics.jsonl" 2>/dev/null || echo 0)" -ge 3 ] && break
    sleep 0.2
  done
  local r0="" r1="" p
  for p in $(pgrep -f "$BIN"); do
    [ "$p" = "$launcher" ] && continue
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "FLEET_LAUNCHER=1" || continue
    tr '\0' '\n' < "/proc/$p/environ" | grep -qx "RANK=0" && r0=$p
    tr '\0' '\n' < "/proc/$p/environ" | grep -qx "RANK=1" && r1=$p
  done
  echo "launcher $launcher, rank 0 pid $r0, rank 1 pid $r1; $(wc -l < "$W/k-$name/metrics.jsonl") steps done"
  sleep 0.4  # into the next step
  local t0; t0=$(date +%s.%N)
  kill "-$sig" "$r1"
  for i in $(seq 1 1200); do kill -0 "$r0" 2>/dev/null || break; sleep 0.1; done
  local t1; t1=$(date +%s.%N)
  wait "$launcher"; local rc=$?
  local t2; t2=$(date +%s.%N)
  printf '{"case": "%s", "signal": "%s", "rank0_exit_after_s": %.2f, "launcher_exit_after_s": %.2f, "launcher_exit_code": %d}\n' \
    "$name" "$sig" "$(awk "BEGIN{print $t1 - $t0}")" "$(awk "BEGIN{print $t2 - $t0}")" "$rc" | tee "$R/kill-$name.json"
  grep -E "error|rank 1|killed|stopped" "$R/kill-$name.log" | grep -v "^\[rank 1\] *$" | tail -8
}
if has kill; then
  stamp "kill: SIGKILL rank 1"; kill_case dies KILL
  stamp "kill: SIGSTOP rank 1 (--dist-timeout 20)"; kill_case stalls STOP
fi

stamp "summary"
python3 - "$R" <<'EOF'
import json, sys
from pathlib import Path
r = Path(sys.argv[1]); out = {}
def load(p):
    p = r / p
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else None
for name in ("fleet", "torch"):
    p = r / f"all_reduce_{name}.json"
    if p.exists():
        d = json.loads(p.read_text())
        out[f"all_reduce_{name}"] = [{k: x[k] for k in ("bytes", "dtype", "time_us", "algbw", "busbw", "correct")} for x in d["rows"]]
a, b = load("curve-1gpu.metrics.jsonl"), load("curve-2gpu.metrics.jsonl")
if a and b:
    n = min(len(a), len(b))
    diff = lambda k: max(abs((a[i].get(k) or 0) - (b[i].get(k) or 0)) for i in range(n))
    mean = lambda m, k, s: sum(x.get(k) or 0 for x in m[s]) / max(len(m[s]), 1)
    out["curves"] = {"steps": [len(a), len(b)], "max_abs_diff": {k: diff(k) for k in ("reward", "loss", "grad_norm")},
                     "identical_steps": sum(a[i].get("reward") == b[i].get("reward") and a[i].get("loss") == b[i].get("loss") for i in range(n)),
                     "reward_first20_1gpu": mean(a, "reward", slice(0, 20)), "reward_last20_1gpu": mean(a, "reward", slice(-20, None)),
                     "reward_first20_2gpu": mean(b, "reward", slice(0, 20)), "reward_last20_2gpu": mean(b, "reward", slice(-20, None))}
a, b = load("nodes-one.metrics.jsonl"), load("nodes-two.metrics.jsonl")
if a and b:
    keys = ("reward", "loss", "grad_norm", "num_tokens")
    shas = [(r / f).read_text().split()[:1] for f in ("nodes-one.sha256", "nodes-two.sha256") if (r / f).exists()]
    out["nodes"] = {"steps": [len(a), len(b)], "metrics_identical": len(a) == len(b) and all(x[k] == y[k] for x, y in zip(a, b) for k in keys),
                    "checkpoint_sha256_identical": len(shas) == 2 and shas[0] == shas[1] and bool(shas[0])}
tput = {}
for f in sorted(r.glob("tput-*.metrics.jsonl")):
    shape, variant = f.name[len("tput-"):-len(".metrics.jsonl")].split("-")
    m = load(f.name)
    batches = {}
    for x in m:
        b = batches.setdefault(x["generation_batch"], [0.0, 0])
        b[0] += x["step_time"]; b[1] += 1
    later = [v for k, v in sorted(batches.items())[1:]]
    sec = sum(v[0] for v in later) / max(len(later), 1)
    log = (r / f"tput-{shape}-{variant}.log").read_text()
    completions = 64 * (2 if variant == "2linear" else 1)  # bench.toml: 16 per micro-batch x 4
    tput.setdefault(shape, {})[variant] = {"seconds_per_generation_batch": sec, "completions_per_generation_batch": completions,
                                           "completions_per_s": completions / sec if sec else None, "batches_timed": len(later),
                                           "reward_mean": sum(x.get("reward") or 0 for x in m) / len(m)}
for shape, v in tput.items():
    if "1again" in v and "1" in v:
        v["1_before_after"] = [v["1"]["completions_per_s"], v.pop("1again")["completions_per_s"]]
    if "1" in v and v["1"]["completions_per_s"]:
        for k in ("2fixed", "2linear"):
            if k in v and v[k]["completions_per_s"]:
                v[f"scaling_{k}"] = v[k]["completions_per_s"] / v["1"]["completions_per_s"]
out["throughput"] = tput
for name in ("dies", "stalls"):
    p = r / f"kill-{name}.json"
    if p.exists():
        out[f"kill_{name}"] = json.loads(p.read_text())
(r.parent / "dp_summary.json").write_text(json.dumps(out, indent=1))
print(json.dumps({k: v for k, v in out.items() if not k.startswith("all_reduce")}, indent=1))
for name in ("fleet", "torch"):
    for x in out.get(f"all_reduce_{name}", []):
        if x["bytes"] >= 1 << 26:
            print(name, x["dtype"], x["bytes"], "busbw", round(x["busbw"], 1), "GB/s")
EOF
tar -C "$OUT" -czf "$OUT/dp.tgz" dp && rm -rf "$R"
ls -la "$OUT"
