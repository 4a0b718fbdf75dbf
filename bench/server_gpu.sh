#!/usr/bin/env bash
# The central service on a GPU host, end to end, in one bounded script (bench/README.md):
#   aiprof server  +  aiprof run --server -- torchrun --nproc-per-node N bench/ddp_train.py
#   -> aiprof trigger --server --job gpu --iterations 3 --auto-analyze   (same iterations on every rank)
#   -> aiprof trigger --server --job gpu --hang                          (stacks of every rank)
# Writes trigger.json, report.json, report.txt, hang.json, state.json, server.log, job.log under $OUT.
# Without a GPU it runs the CPU gloo job of the tests instead (a dry run of this script).
#   bash bench/server_gpu.sh            (OUT defaults to bench/out/server_gpu)
set -u
OUT=${OUT:-bench/out/server_gpu}
mkdir -p "$OUT"
NPROC=${NPROC:-2}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ] && ! $PY -c "import uvicorn, starlette" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
DATA=$(mktemp -d /tmp/aiprof-data-XXXX)
CAPS=$(mktemp -d /tmp/aiprof-caps-XXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; sleep 1; for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; }
trap cleanup EXIT

$PY -m aiprof server --data "$DATA" --port 0 >"$OUT/server.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -f "$DATA/server.json" ] && break; sleep 0.1; done
URL=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['url'])" "$DATA/server.json") || { cat "$OUT/server.log"; exit 1; }
export AIPROF_TOKEN=$(cat "$DATA/token")
echo "server $URL"

if $PY -c "import torch,sys; sys.exit(0 if torch.cuda.device_count() >= $NPROC else 1)" 2>/dev/null; then
  JOB=(env STEPS=${STEPS:-600} SLOW_RANK=1 $PY -m torch.distributed.run --standalone --nproc-per-node "$NPROC" bench/ddp_train.py)
else
  echo "no $NPROC GPUs: dry run with the CPU gloo job"
  JOB=($PY -m torch.distributed.run --standalone --nproc-per-node "$NPROC" tests/server/scripts/gloo_train.py --seconds 90 --stop-file "$CAPS/stop")
fi
setsid $PY -m aiprof run --server "$URL" --job gpu --out "$CAPS" -- "${JOB[@]}" >"$OUT/job.log" 2>&1 &
pids+=($!)

# wait until every rank has registered and stepped a few iterations (model build, NCCL init)
for _ in $(seq 240); do
  n=$($PY -m aiprof trigger --server "$URL" --list --json 2>/dev/null | $PY -c "
import json,sys; j=json.load(sys.stdin).get('gpu',[]); print(sum(1 for a in j if (a['steps'] or 0) >= 5))" 2>/dev/null)
  [ "${n:-0}" -ge "$NPROC" ] && break
  sleep 0.5
done
$PY -m aiprof trigger --server "$URL" --list | tee "$OUT/list.txt"

t0=$(date +%s%N)
$PY -m aiprof trigger --server "$URL" --job gpu --iterations 3 --what kernels,hw --auto-analyze --timeout 150 --json >"$OUT/trigger.json"
rc=$?
t1=$(date +%s%N)
echo "trigger exit $rc after $(( (t1 - t0) / 1000000 )) ms"
$PY - "$OUT/trigger.json" <<'EOF'
import json, sys
st = json.load(open(sys.argv[1]))
print("capture", st["capture_id"], "state", st["state"], "received", st.get("received"), "aligned", st.get("aligned"),
      "start_at", st.get("start_at"), "steps_by_rank", st.get("steps_by_rank"))
for f in ((st.get("analysis") or {}).get("summary") or {}).get("findings") or []:
    print(" ", f["severity"], f["code"], f["title"])
print("report:", st.get("url"))
EOF
CID=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['capture_id'])" "$OUT/trigger.json")
cp "$DATA/captures/$CID/report/report.json" "$DATA/captures/$CID/report/report.txt" "$OUT/" 2>/dev/null
cp "$DATA/captures/$CID/.state.json" "$OUT/state.json" 2>/dev/null
head -c 4000 "$OUT/report.txt" 2>/dev/null

$PY -m aiprof trigger --server "$URL" --job gpu --hang --json >"$OUT/hang.json"
echo "hang exit $? ; groups:"
$PY -c "import json,sys; r=json.load(open(sys.argv[1]))['result']; [print(' ', g['size'], 'rank(s)', g['ranks'], g['at']) for g in r['groups']]" "$OUT/hang.json"
touch "$CAPS/stop"
echo "captures kept locally by the agents:"; find "$CAPS" -name meta.json
exit $rc
