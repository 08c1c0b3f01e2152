#!/usr/bin/env bash
# The whole GPU session of the foundation issue, in one command.
#
# Run from the repo root on the GPU machine, with the stripped CUDA binary carried at
# dist/cuda/fleet:
#
#     bash scripts/gpu/run_foundation.sh
#
# Steps (each guarded: a failure or timeout is logged and the next step still runs):
#   0. environment: nvidia-smi, git commit (or ./COMMIT), python/torch/transformers versions
#   1. fleet devices
#   2. parity: parity_bf16.py make (Qwen2.5-0.5B shape, random bf16 weights, HF logits)
#              -> fleet logits -> parity_bf16.py compare            (scratch under /tmp)
#   3. fleet bench generate   (Qwen2.5-7B shape, bf16, prompt 512, 128 new, BATCHES)
#   4. benches/transformers_generate.py with the same arguments and the same BATCHES
#   5. with BEST=1: each engine's best batch that fits, searched in this call: batches doubling
#      from BEST_FROM (default twice the largest of BATCHES) to BEST_MAX (default 512); fleet
#      one process per batch until one fails, transformers one process over the list (it
#      records an out-of-memory batch and goes on); outcomes in search.tsv
#   6. scripts/gpu/pair_results.py generate: fleet and transformers rows paired by batch, each
#      engine's best batch, and the limit of the work (scripts/gpu/limits.py)
#
# Results, all directly under $OUT (each far below 16 MiB):
#   log.txt  env.json  parity.json  bench_fleet.json  bench_transformers.json  pairs.md
#   pairs.json  (with BEST=1: bench_fleet-best-b<B>.json, bench_transformers-best.json,
#   search.tsv)
#
# There is a global time budget (BUDGET_S, default 530 s). Each step's `timeout` is the
# smaller of its own cap and the time that is left, so the script ends before a 600 s
# device limit even when a step hangs.
#
# You can override these variables (defaults in brackets): OUT [./out_foundation],
# FLEET [dist/cuda/fleet], PYTHON [python3], DEVICE [cuda], FLEET_DEVICE [cuda:0],
# SCRATCH [/tmp/fleet_foundation], BUDGET_S [530],
# PARITY_CONFIG [configs/models/qwen2.5-0.5b.json], BENCH_CONFIG [configs/models/qwen2.5-7b.json],
# PROMPT_LEN [512], NEW_TOKENS [128], BATCHES ["1 32"; commas or spaces; BATCH is an alias],
# N_SEQS [4], SEQ_LEN [128], PARITY [1; 0 skips the parity steps, e.g. to leave the call's time
# to BEST=1], BEST [0], BEST_FROM, BEST_MAX [512].
#
#   BATCHES="1 8 32" bash scripts/gpu/run_foundation.sh            # one comparison, same batches
#   PARITY=0 BEST=1 BATCHES="32" bash scripts/gpu/run_foundation.sh # and each engine's best batch
set -u

ORIG_LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
# No internet on the GPU machine: never let transformers/huggingface_hub try the hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false

OUT="${OUT:-$PWD/out_foundation}"
FLEET="${FLEET:-dist/cuda/fleet}"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
FLEET_DEVICE="${FLEET_DEVICE:-cuda:0}"
SCRATCH="${SCRATCH:-/tmp/fleet_foundation}"
BUDGET_S="${BUDGET_S:-530}"
PARITY_CONFIG="${PARITY_CONFIG:-configs/models/qwen2.5-0.5b.json}"
BENCH_CONFIG="${BENCH_CONFIG:-configs/models/qwen2.5-7b.json}"
PROMPT_LEN="${PROMPT_LEN:-512}"
NEW_TOKENS="${NEW_TOKENS:-128}"
BATCHES="${BATCHES:-${BATCH:-1 32}}"
BATCH=$(echo "$BATCHES" | tr ' ' ',' | tr -s ',' | sed 's/^,//; s/,$//')   # both engines take a comma list
PARITY="${PARITY:-1}"
BEST="${BEST:-0}"
BEST_MAX="${BEST_MAX:-512}"
N_SEQS="${N_SEQS:-4}"
SEQ_LEN="${SEQ_LEN:-128}"

mkdir -p "$OUT"
rm -rf "$SCRATCH"
mkdir -p "$SCRATCH/steps"
LOG="$OUT/log.txt"
: > "$LOG"
STEPS_TSV="$SCRATCH/steps.tsv"
: > "$STEPS_TSV"
START=$(date +%s)

say() { echo "$*" | tee -a "$LOG"; }

# Python runs with the machine's own LD_LIBRARY_PATH, so that /usr/local/cuda/lib64 can
# never shadow the CUDA libraries that torch ships with. (An array, not a function:
# `timeout` can only run real commands.)
PYRUN=(env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" "$PY")

# run_step NAME CAP_SECONDS CMD...   -> appends "name rc seconds timeout" to steps.tsv
run_step() {
    local name=$1 cap=$2
    shift 2
    local now left t rc t0 t1 dur
    now=$(date +%s)
    left=$((START + BUDGET_S - now))
    t=$cap
    if [ "$left" -lt "$t" ]; then t=$left; fi
    if [ "$t" -lt 5 ]; then
        say "### [$name] SKIPPED: time budget used up"
        printf '%s\t%s\t%s\t%s\n' "$name" "skipped" "0" "0" >> "$STEPS_TSV"
        return 125
    fi
    say ""
    say "### [$name] start $(date -u +%H:%M:%SZ) (+$((now - START))s), timeout ${t}s: $*"
    t0=$(date +%s.%N)
    timeout --kill-after=10 "$t" "$@" 2>&1 | tee -a "$LOG" "$SCRATCH/steps/$name.txt"
    rc=${PIPESTATUS[0]}
    t1=$(date +%s.%N)
    dur=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        say "### [$name] TIMEOUT after ${dur}s (exit $rc)"
    else
        say "### [$name] exit=$rc (${dur}s)"
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$dur" "$t" >> "$STEPS_TSV"
    return "$rc"
}

write_env_json() {  # $1 = "partial" | "final"
    env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" "$PY" - "$1" "$SCRATCH" "$OUT/env.json" "$START" "$FLEET" <<'PYEOF' || echo '{"error": "env.json writer failed"}' > "$OUT/env.json"
import hashlib, json, os, socket, sys, time
state, scratch, out, start, fleet = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
def rd(p, limit=20000):
    try:
        with open(p, errors="replace") as f:
            return f.read()[-limit:]
    except OSError:
        return None
env = {"state": state, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
       "hostname": socket.gethostname(), "elapsed_s": round(time.time() - start, 1)}
for k in ("git_commit", "git_dirty_files", "nvidia_smi_query", "nvidia_smi_topo"):
    v = rd(os.path.join(scratch, k + ".txt"))
    env[k] = v.strip() if v is not None else None
try:
    env["python_env"] = json.loads(rd(os.path.join(scratch, "pyenv.json")) or "null")
except ValueError:
    env["python_env"] = rd(os.path.join(scratch, "pyenv.json"))
if os.path.exists(fleet):
    h = hashlib.sha256()
    with open(fleet, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    env["fleet_binary"] = {"path": fleet, "bytes": os.path.getsize(fleet), "sha256": h.hexdigest()}
else:
    env["fleet_binary"] = {"path": fleet, "missing": True}
dev = rd(os.path.join(scratch, "steps", "fleet_devices.txt"), 8000)
env["fleet_devices_output"] = dev
steps = []
for line in (rd(os.path.join(scratch, "steps.tsv")) or "").splitlines():
    p = line.split("\t")
    if len(p) == 4:
        steps.append({"step": p[0], "exit": int(p[1]) if p[1].lstrip("-").isdigit() else p[1],
                      "seconds": float(p[2]), "timeout_s": int(p[3])})
env["steps"] = steps
env["all_ok"] = bool(steps) and all(s["exit"] == 0 for s in steps)
env["vars"] = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES")}
with open(out, "w") as f:
    json.dump(env, f, indent=2)
PYEOF
}

# ------------------------------------------------------------------ 0. environment
say "=== fleet foundation GPU session: $(date -u +%FT%TZ) on ${HOSTNAME:-?} ; OUT=$OUT"
if git rev-parse HEAD > "$SCRATCH/git_commit.txt" 2>/dev/null; then
    git status --porcelain 2>/dev/null | wc -l > "$SCRATCH/git_dirty_files.txt"
elif [ -f COMMIT ]; then
    cat COMMIT > "$SCRATCH/git_commit.txt"
else
    echo "unknown (no .git, no COMMIT file)" > "$SCRATCH/git_commit.txt"
fi
say "commit: $(cat "$SCRATCH/git_commit.txt")"
if [ -f "$FLEET" ] && [ ! -x "$FLEET" ]; then chmod +x "$FLEET" 2>/dev/null; fi

run_step nvidia_smi 30 nvidia-smi
timeout 30 nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total,memory.used,driver_version,clocks.max.sm,power.limit,compute_mode,mig.mode.current \
    --format=csv > "$SCRATCH/nvidia_smi_query.txt" 2>&1
timeout 30 nvidia-smi topo -m > "$SCRATCH/nvidia_smi_topo.txt" 2>&1
run_step python_env 60 "${PYRUN[@]}" -c '
import json, platform, torch, transformers
d = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
     "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available(),
     "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
try:
    import safetensors, numpy
    d["safetensors"] = safetensors.__version__; d["numpy"] = numpy.__version__
except Exception as e:
    d["import_error"] = repr(e)
print(json.dumps(d))
json.dump(d, open("'"$SCRATCH"'/pyenv.json", "w"))
'
write_env_json partial

# ------------------------------------------------------------------ 1. fleet devices
run_step fleet_devices 30 "$FLEET" devices

# ------------------------------------------------------------------ 2. parity
PDIR="$SCRATCH/parity"
if [ "$PARITY" = 1 ]; then
run_step parity_make 110 "${PYRUN[@]}" scripts/gpu/parity_bf16.py make --config "$PARITY_CONFIG" --out "$PDIR" \
    --device "$DEVICE" --seed 0 --n-seqs "$N_SEQS" --seq-len "$SEQ_LEN"
if [ -f "$PDIR/ids.json" ] && [ -d "$PDIR/model" ]; then
    run_step fleet_logits 90 "$FLEET" logits --model "$PDIR/model" --ids-file "$PDIR/ids.json" \
        --dtype bf16 --device "$FLEET_DEVICE" --output "$PDIR/fleet_logits.safetensors"
else
    say "### [fleet_logits] SKIPPED: parity_make produced no model/ids"
    printf '%s\t%s\t%s\t%s\n' "fleet_logits" "skipped" "0" "0" >> "$STEPS_TSV"
fi
if [ -f "$PDIR/hf_logits.safetensors" ]; then
    # compare writes parity.json even when the fleet file is missing (HF baselines only, exit 2).
    run_step parity_compare 60 "${PYRUN[@]}" scripts/gpu/parity_bf16.py compare --dir "$PDIR" \
        --fleet "$PDIR/fleet_logits.safetensors" --json "$OUT/parity.json"
else
    say "### [parity_compare] SKIPPED: no HF reference logits"
    printf '%s\t%s\t%s\t%s\n' "parity_compare" "skipped" "0" "0" >> "$STEPS_TSV"
fi
fi  # PARITY
write_env_json partial

# ------------------------------------------------------------------ 3. fleet bench
run_step bench_fleet 130 "$FLEET" bench generate --config "$BENCH_CONFIG" --dtype bf16 \
    --prompt-len "$PROMPT_LEN" --new-tokens "$NEW_TOKENS" --batch "$BATCH" --json "$OUT/bench_fleet.json"

# ------------------------------------------------------------------ 4. transformers bench
run_step bench_transformers 130 "${PYRUN[@]}" benches/transformers_generate.py --config "$BENCH_CONFIG" --dtype bf16 \
    --prompt-len "$PROMPT_LEN" --new-tokens "$NEW_TOKENS" --batch "$BATCH" --device "$DEVICE" --seed 0 \
    --json "$OUT/bench_transformers.json"

# ------------------------------------------------------------------ 5. best batch per engine
SEARCH_TSV="$OUT/search.tsv"
if [ "$BEST" = 1 ]; then
    : > "$SEARCH_TSV"
    largest=$(echo "$BATCH" | tr ',' '\n' | sort -n | tail -1)
    b="${BEST_FROM:-$((largest * 2))}"
    BEST_LIST=""
    while [ "$b" -le "$BEST_MAX" ]; do BEST_LIST="$BEST_LIST $b"; b=$((b * 2)); done
    say "best-batch search over:$BEST_LIST"
    for b in $BEST_LIST; do   # fleet: one process per batch, until one fails
        run_step "best_fleet_b$b" 150 "$FLEET" bench generate --config "$BENCH_CONFIG" --dtype bf16 \
            --prompt-len "$PROMPT_LEN" --new-tokens "$NEW_TOKENS" --batch "$b" \
            --json "$OUT/bench_fleet-best-b$b.json"
        rc=$?
        if [ "$rc" = 0 ]; then status=ok; note=""
        elif [ "$rc" = 125 ]; then status=skipped; note="time budget used up"
        elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=timeout; note="step timeout"
        elif grep -qiE 'out of memory|OUT_OF_MEMORY' "$SCRATCH/steps/best_fleet_b$b.txt"; then
            status=oom; note=$(grep -iE -m1 'out of memory|OUT_OF_MEMORY' "$SCRATCH/steps/best_fleet_b$b.txt" | cut -c1-160)
        else status=error; note="exit $rc"; fi
        printf 'fleet\tbest\t%s\t%s\t%s\n' "$b" "$status" "$note" >> "$SEARCH_TSV"
        [ "$status" = ok ] || break
    done
    # transformers: one process over the list (an out-of-memory batch is recorded, the rest run)
    run_step best_transformers 300 "${PYRUN[@]}" benches/transformers_generate.py --config "$BENCH_CONFIG" \
        --dtype bf16 --prompt-len "$PROMPT_LEN" --new-tokens "$NEW_TOKENS" \
        --batch "$(echo "$BEST_LIST" | sed 's/^ *//' | tr ' ' ',')" --device "$DEVICE" --seed 0 \
        --json "$OUT/bench_transformers-best.json"
    rc=$?
    env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" "$PY" - "$OUT/bench_transformers-best.json" "$rc" "$BEST_LIST" >> "$SEARCH_TSV" <<'PYEOF'
import json, sys
path, rc, wanted = sys.argv[1], sys.argv[2], sys.argv[3].split()
try:
    runs = {r["batch"]: r for r in json.load(open(path))["runs"]}
except (OSError, ValueError, KeyError):
    runs = {}
for b in map(int, wanted):
    r = runs.get(b)
    if r is None:
        status = "timeout" if rc in ("124", "137") else ("skipped" if rc == "125" else "error")
        print(f"transformers	best	{b}	{status}	exit {rc}, no result")
    elif "error" in r:
        print(f"transformers	best	{b}	{'oom' if r['error'].startswith('OOM') else 'error'}	{r['error'][:160]}")
    else:
        print(f"transformers	best	{b}	ok	")
PYEOF
fi

# ------------------------------------------------------------------ 6. pairs
env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" "$PY" scripts/gpu/pair_results.py generate "$OUT" 2>&1 | tee -a "$LOG"

# ------------------------------------------------------------------ summary
write_env_json final
say ""
say "=== summary (+$(( $(date +%s) - START ))s)"
awk -F'\t' '{ printf "  %-20s exit=%-8s %7ss  (timeout %ss)\n", $1, $2, $3, $4 }' "$STEPS_TSV" | tee -a "$LOG"
ls -la "$OUT" | tee -a "$LOG"

# Keep log.txt under the 16 MiB limit on returned files.
if [ "$(stat -c %s "$LOG")" -gt 15000000 ]; then
    { head -c 2000000 "$LOG"; printf '\n\n...[log truncated]...\n\n'; tail -c 12000000 "$LOG"; } > "$SCRATCH/log.trunc"
    mv "$SCRATCH/log.trunc" "$LOG"
fi
# A best-batch step that fails is how the search ends (search.tsv says how), not a failure.
if awk -F'\t' '$1 !~ /^best_/ && $2 != "0" { bad = 1 } END { exit bad ? 0 : 1 }' "$STEPS_TSV"; then
    exit 1
fi
exit 0
