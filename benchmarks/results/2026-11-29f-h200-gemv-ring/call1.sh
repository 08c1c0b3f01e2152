set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p /tmp/lt $R/graphs $R/profile && xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
for t in gemv_kernel_matches_its_twin norm_gemv_kernel_gives_the_unfused_ops_bits gemv_swiglu_kernel_gives_the_unfused_bits moe_gemv_kernel_matches_its_twin; do
  timeout 100 /tmp/lt/fleet_models --test-threads 1 --exact ops::linear::kernel_tests::$t >> $R/graphs/test_lib_gemv.txt 2>&1; echo "$t rc $?"
done
grep -E "^test |test result|panicked" $R/graphs/test_lib_gemv.txt
OUT=$R/graphs PART=graphs TESTS=0 BATCHES=1 \
  MODES="continuous-sync8 continuous-sync8-noring continuous-sync8-ring36 continuous-sync8-ringall continuous-sync8@2 continuous-sync8-noring@2 continuous-sync8-ring36@2 continuous-sync8-ringall@2" \
  ROLLOUT_MODES=" " bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
python3 - $R/graphs <<'PY'
import json,glob,sys,os,tarfile
d=sys.argv[1]
t=glob.glob(d+'/*.tgz')
if t: tarfile.open(t[0]).extractall('/tmp/xx')
for f in sorted(glob.glob('/tmp/xx/*.json')+glob.glob(d+'/*.json')):
    try:
        j=json.load(open(f)); print(os.path.basename(f), [(r.get('batch'), round(r.get('decode_tok_s',0),1), (r.get('paged') or {}).get('graphs_captured')) for r in j['runs']])
    except Exception as e: print(f, 'unparsed', e)
PY
OUT=$R/profile SHAPES="7b:1" PROMPT=512 bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
cat $R/profile/decode_7b_b1.txt
