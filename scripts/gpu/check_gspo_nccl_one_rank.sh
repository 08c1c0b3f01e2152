#!/usr/bin/env bash
# The NCCL path of data-parallel gspo-train on a one-GPU machine: a world of one rank (NCCL
# communicator of one, in-place all-reduce and broadcast on candle's stream) must train exactly
# like a plain run. Carried: dist/carry/gspo-train.xz. Writes $OUT/nccl-one-rank.txt.
set -u
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/nccl1; mkdir -p $W
xz -dc dist/carry/gspo-train.xz > $W/gspo-train; chmod +x $W/gspo-train
$W/gspo-train --output-dir $W/plain --max-steps 40 --dtype f32 > $W/plain.log 2>&1; echo "plain: exit $?"
RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \
  $W/gspo-train --output-dir $W/rank --max-steps 40 --dtype f32 > $W/rank.log 2>&1; echo "one rank: exit $?"
grep -E "Distributed|Backend|Device" $W/rank.log
python3 - "$W" <<'PY'
import json, sys
w = sys.argv[1]
a = [json.loads(l) for l in open(f"{w}/plain/metrics.jsonl")]
b = [json.loads(l) for l in open(f"{w}/rank/metrics.jsonl")]
same = all(x[k] == y[k] for x, y in zip(a, b) for k in ("reward", "loss", "grad_norm"))
print(f"steps {len(a)} / {len(b)}; reward, loss, grad_norm identical: {same}")
print("reward first/last 5:", sum(r['reward'] for r in a[:5]) / 5, sum(r['reward'] for r in a[-5:]) / 5)
PY
