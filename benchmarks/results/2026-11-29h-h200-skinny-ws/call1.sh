# The kernel test, paged_generation with the skinny GEMM on, the 7B at 8/32/64 rows both ways
# and the rollout shape: 2026-11-29g's call 6 script, run as it is with this call's build.
bash benchmarks/results/2026-11-29g-h200-skinny-pipe/call6.sh
