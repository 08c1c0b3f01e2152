mkdir -p $OUT/p && OUT=$OUT/p SHAPES="7b:32" PROMPT=512 TAG=tma FLEET_SKINNY_GEMM=1 timeout 140 bash scripts/gpu/profile_decode.sh > /dev/null 2>&1; head -12 $OUT/p/decode_7b_b32_tma.txt
