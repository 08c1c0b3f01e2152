set -u
mkdir -p /tmp/lt && xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
timeout 200 /tmp/lt/fleet_models --test-threads 1 ops::linear::kernel_tests > $OUT/test_lib_linear.txt 2>&1; echo "rc $?"
grep -E "^test |test result|panicked" $OUT/test_lib_linear.txt
