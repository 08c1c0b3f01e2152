set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
mkdir -p /tmp/lt $R/graphs && xz -dc dist/carry/lib-tests.tar.xz | tar xf - -C /tmp/lt
ls /tmp/lt
for t in generation paged_generation paged_attention; do
  timeout 200 /tmp/lt/$t --test-threads 1 > $R/graphs/test_$t.txt 2>&1; echo "$t rc $?"
  grep -E "test result|FAILED|panicked" $R/graphs/test_$t.txt | head -5
done
# (the library tests were not carried: the sampler's GPU test is in generation)
OUT=$R/graphs PART=graphs TESTS=0 BATCHES=1,32 \
  MODES="continuous-sync8 continuous-sync8@2 continuous-sync8@3" \
  ROLLOUT_MODES="continuous-sync8" bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
python3 - $R/graphs <<'PY'
import json,glob,sys,os,tarfile
d=sys.argv[1]
t=glob.glob(d+'/*.tgz')
if t: tarfile.open(t[0]).extractall('/tmp/xx')
for f in sorted(glob.glob('/tmp/xx/*.json')):
    try:
        j=json.load(open(f)); print(os.path.basename(f), [(r.get('batch'), round(r.get('decode_tok_s',0),1), round(r.get('prefill_tok_s',0)), (r.get('paged') or {}).get('graphs_captured')) for r in j['runs']])
    except Exception as e: print(f, 'unparsed', e)
PY
for r in 1 2; do for mb in 512 256 128; do
  FLEET_PAGED_MIN_BLOCKS=$mb timeout 150 /tmp/fleet bench generate --config configs/models/qwen2.5-7b.json --batch 32 \
    --prompt-len 512 --new-tokens 128 --repeats 2 --batching continuous --num-scheduler-steps 8 \
    --json $R/graphs/minblocks_b32_${mb}_r$r.json 2>&1 | grep -E "decode" | head -1 | sed "s/^/b32 minblocks $mb r$r: /"
done; done
(cd $R/graphs && tar czf ../minblocks.tgz minblocks_*.json && rm minblocks_*.json)
mkdir -p $R/profile
OUT=$R/profile SHAPES="7b:1 7b:32" PROMPT=512 bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
head -14 $R/profile/decode_7b_b1.txt; head -24 $R/profile/decode_7b_b32.txt
cd $R/graphs && tar czf ../tests.tgz test_*.txt && rm test_*.txt
