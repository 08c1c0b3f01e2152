#!/usr/bin/env bash
# Where one stage of a real job spends its GPU time, kernel by kernel: ncu (duration, DRAM bytes
# and tensor-pipe activity of each launch) over the n-th call of one named stage only
# (FLEET_CUDA_PROFILE_STAGE=<stage>@<n> with `ncu --profile-from-start off`; stages: every
# FLEET_PROFILE stage name, e.g. gen.prefill, plus train.micro_step and gen.decode: a decode
# call of paged generation, one step or a burst), then
# scripts/gpu/kernel_times.py sums it by kernel.
#
#   NAME=update STAGE=train.micro_step@3 bash scripts/gpu/profile_stage.sh <command...>
#
# Writes $OUT/kernels_$NAME.txt (the summary), $OUT/ncu_$NAME.csv.xz (every launch) and
# $OUT/job_$NAME.log (the job's own output).
# METRICS overrides the metric list (gpu__time_duration.sum alone is the fastest). The clocks
# run free (`--clock-control none`, NCU_CLOCKS) as in a real run: ncu's default locks them to
# base, which understates bandwidth-bound kernels (profiles before 2026-11-28 ran so).
set -u
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
NAME="${NAME:?a name for the outputs}"
STAGE="${STAGE:?stage[@n]}"
OUT="${OUT:-$PWD/out_profile}"
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
M="${METRICS:-gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active}"
# The table goes to its own file (--log-file), not mixed with the job's stdout.
FLEET_CUDA_PROFILE_STAGE="$STAGE" timeout "${NCU_TIMEOUT:-400}" "$NCU" --profile-from-start off --clock-control "${NCU_CLOCKS:-none}" \
  --csv --print-units base --metrics "$M" --log-file "$OUT/ncu_$NAME.csv" "$@" \
  > "$OUT/job_$NAME.log" 2> "$OUT/ncu_$NAME.err"
echo "ncu rc $? $(grep -c '^"' "$OUT/ncu_$NAME.csv") lines"
tail -3 "$OUT/ncu_$NAME.err"
cat "$OUT/ncu_$NAME.err" >> "$OUT/job_$NAME.log"; rm -f "$OUT/ncu_$NAME.err"
python3 "$(dirname "$0")/kernel_times.py" "$OUT/ncu_$NAME.csv" --top "${TOP:-45}" | tee "$OUT/kernels_$NAME.txt"
xz -T8 -f "$OUT/ncu_$NAME.csv"
