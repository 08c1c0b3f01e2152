set -u
export NCCL_NVLS_ENABLE=0
R=$OUT
OUT=$R/graphs PART=graphs SKINNY_TESTS="" BATCHES=1,32 \
  MODES="continuous-sync8 continuous-sync8-noswiglu continuous-sync8-nofold continuous-sync8@2 continuous-sync8-noswiglu@2 continuous-sync8-nofold@2" \
  ROLLOUT_MODES="continuous-sync8 continuous-sync8-nofold" bash scripts/gpu/run_paged_decode.sh > /dev/null 2>&1
grep -E "^== |^rc |test result|FAILED|panicked" $R/graphs/graphs.log | head -40
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
OUT=$R/prof_b1 SHAPES="7b:1" PROMPT=512 bash scripts/gpu/profile_decode.sh > /dev/null 2>&1
head -16 $R/prof_b1/decode_7b_b1.txt
