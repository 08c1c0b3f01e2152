set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p /tmp/lt $R/graphs && xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
for t in gemv_kernel_matches_its_twin norm_gemv_kernel_gives_the_unfused_ops_bits gemv_swiglu_kernel_gives_the_unfused_bits moe_gemv_kernel_matches_its_twin; do
  timeout 100 /tmp/lt/fleet_models --test-threads 1 --exact ops::linear::kernel_tests::$t >> $R/graphs/test_lib_gemv.txt 2>&1; echo "$t rc $?"
done
grep -E "^test |test result|panicked" $R/graphs/test_lib_gemv.txt
OUT=$R/graphs PART=graphs TESTS=0 BATCHES=1 \
  MODES="continuous-sync8 continuous-sync8-noswiglu continuous-sync8@2 continuous-sync8-noswiglu@2" \
  ROLLOUT_MODES=" " bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
python3 - $R/graphs <<'PY'
import json,glob,sys,os,tarfile
d=sys.argv[1]
t=glob.glob(d+'/*.tgz')
if t: tarfile.open(t[0]).extractall('/tmp/xx')
for f in sorted(glob.glob('/tmp/xx/*.json')):
    try:
        j=json.load(open(f)); print(os.path.basename(f), [(r.get('batch'), round(r.get('decode_tok_s',0),1), (r.get('paged') or {}).get('graphs_captured')) for r in j['runs']])
    except Exception as e: print(f, 'unparsed', e)
PY
