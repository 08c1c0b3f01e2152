set -euo pipefail
cd /work/main
source scripts/cuda/env.sh
bash scripts/cuda/build.sh -p fleet
xz -T2 -6 -c dist/cuda/fleet > dist/carry/fleet.xz
echo ALL DONE
