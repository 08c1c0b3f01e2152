# The committed build (257d54a): the 7B at batch 1 and 32, reads every 8, three runs, with
# transformers' default in the same call (run_paged_decode.sh PART=graphs), and the rollout shape.
set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
OUT=$R/graphs PART=graphs TESTS=0 BATCHES=1,32 \
  MODES="continuous-sync8 continuous-sync8@2 continuous-sync8@3" \
  ROLLOUT_MODES="continuous-sync8" timeout 330 bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
echo "rc $?"
python3 - $R/graphs <<'PY'
import json,glob,sys,os,tarfile
d=sys.argv[1]
for t in glob.glob(d+'/*.tgz'): tarfile.open(t).extractall('/tmp/xx')
for f in sorted(glob.glob('/tmp/xx/*.json')+glob.glob(d+'/*.json')):
    try:
        j=json.load(open(f)); print(os.path.basename(f), [(r.get('batch'), round(r.get('decode_tok_s',0),1), round(r.get('prefill_tok_s',0))) for r in j['runs']])
    except Exception as e: print(f, 'unparsed', e)
PY
