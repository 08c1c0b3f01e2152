set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p $R/profile
M=l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__inst_executed.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed
OUT=$R/profile SHAPES="7b:32" PROMPT=512 TAG=skinny FLEET_SKINNY_GEMM=1 NCU_METRICS=$M \
  bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
head -8 $R/profile/decode_7b_b32_skinny.txt
OUT=$R/profile SHAPES="7b:32" PROMPT=512 TAG=cublas NCU_METRICS=$M \
  bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
head -8 $R/profile/decode_7b_b32_cublas.txt
(cd $R && tar czf profile.tgz profile && rm -r profile)
