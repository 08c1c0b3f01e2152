set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p /tmp/lt && xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
timeout 150 /tmp/lt/fleet_models --test-threads 1 ops::qkv_rope::kernel_tests > $R/test_qkv_rope.txt 2>&1; echo "rc $?"
grep -E "^test |test result|panicked" $R/test_qkv_rope.txt
