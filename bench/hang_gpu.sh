#!/bin/bash
# One call on a 4-GPU machine (the device tool's nvidia-h200-x4); results in $OUT (<= 8 files):
#  a. a live 4-rank NCCL hang under `aiprof run` (tests/attach/scripts/hang_job.py, rank 1 stuck in
#     load_batch): `aiprof hang --job --json` must group ranks 0,2,3 in one collective from the
#     agents' recorder and name rank 1 behind -> hang_nccl_recorder.{json,txt}; then the same
#     with a DDP model (its all-reduce comes from C++: only torch's flight recorder sees it)
#     -> hang_ddp_recorder.json (skipped when little time is left)
#  b. `aiprof run --skip 5 --iterations 3 --what kernels,hw --hw-interval-ms 100` of a 4-rank DDP
#     job with a slow rank (bench/ddp_hw.py) -> ddp4_hw.tar.gz (rank<R>/{trace.json.gz,hw.csv,meta.json})
# Needs py-spy, msgspec, nvidia-ml-py as wheels in .whl/ (carry: [".whl"]).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site PATH=/tmp/site/bin:$PATH
log=$OUT/log.txt
{ nvidia-smi -L; python3 -c 'import torch, pynvml; print("torch", torch.__version__, torch.cuda.device_count(), "pynvml ok")'
  py-spy --version; } 2>&1 | tee -a "$log"

hang() {  # $1: name, $2...: extra hang_job.py args
  local name=$1; shift
  local ready rt job
  ready=$(mktemp -d /tmp/ready-XXXX); rt=$(mktemp -d /tmp/aiprt-XXXX)
  echo "== hang $name ($(( $(date +%s) - T0 )) s)" | tee -a "$log"
  AIPROF_RUNTIME_DIR=$rt setsid timeout 150 python3 -m aiprof run -- python3 -m torch.distributed.run \
      --nproc_per_node 4 --master_port $((29500 + RANDOM % 400)) tests/attach/scripts/hang_job.py --backend nccl \
      --block-rank 1 --block-at 3 --ready-dir "$ready" "$@" >> "$OUT/job_logs.txt" 2>&1 &
  job=$!
  for i in $(seq 1 90); do
    [ "$(ls "$ready" | wc -l)" -ge 4 ] && [ "$(ls "$rt" | grep -c '\.sock$')" -ge 4 ] && break; sleep 1
  done
  echo "ranks ready after ~${i} s: $(ls "$ready" | tr '\n' ' ') sockets: $(ls "$rt" | grep -c '\.sock$')" | tee -a "$log"
  sleep 4
  local t1=$(date +%s%N)
  AIPROF_RUNTIME_DIR=$rt timeout 60 python3 -m aiprof hang --job --json > "$OUT/hang_${name}_recorder.json" 2>>"$log"
  echo "hang rc=$? took $(( ($(date +%s%N) - t1) / 1000000 )) ms" | tee -a "$log"
  [ "$name" = nccl ] && AIPROF_RUNTIME_DIR=$rt timeout 60 python3 -m aiprof hang --job > "$OUT/hang_${name}_recorder.txt" 2>&1
  python3 bench/check_hang.py "$OUT/hang_${name}_recorder.json" --blocked 1 --world 4 2>&1 | tee -a "$log"
  kill -9 -- -$job 2>/dev/null
  for p in $(pgrep -f -- "$ready"); do kill -9 "$p" 2>/dev/null; done  # workers, should torchrun have moved them
  sleep 1
}

hang nccl

echo "== capture ($(( $(date +%s) - T0 )) s)" | tee -a "$log"
t1=$(date +%s)
SLOW_RANK=2 EXTRA=300 STEPS=16 timeout 150 python3 -m aiprof run --skip 5 --iterations 3 --what kernels,hw \
    --hw-interval-ms 100 --out /tmp/cap --capture-id ddp4_hw -- \
    python3 -m torch.distributed.run --nproc_per_node 4 --master_port 29611 bench/ddp_hw.py 2>&1 \
    | grep -v "^W" | tail -15 | tee -a "$log"
echo "capture took $(( $(date +%s) - t1 )) s" | tee -a "$log"
ls -l /tmp/cap/ddp4_hw/rank* 2>&1 | tee -a "$log"
python3 - <<'PY' 2>&1 | tee -a "$log"
import csv, glob, collections
for p in sorted(glob.glob("/tmp/cap/ddp4_hw/rank*/hw.csv")):
    rows = list(csv.reader(open(p)))
    head, body = rows[0], rows[1:]
    c = collections.Counter((r[1], r[2]) for r in body)
    ts = [float(r[0]) for r in body]
    print(p, head, len(body), "rows", "span_us", (max(ts) - min(ts)) if ts else None)
    print("   ", sorted(c.items())[:40])
PY
tar czf "$OUT/ddp4_hw.tar.gz" -C /tmp/cap ddp4_hw && ls -l "$OUT/ddp4_hw.tar.gz" | tee -a "$log"

left=$(( 270 - ($(date +%s) - T0) ))
if [ $left -gt 70 ]; then hang ddp --ddp; else echo "skipped the DDP hang: ${left} s left" | tee -a "$log"; fi
echo "done after $(( $(date +%s) - T0 )) s" | tee -a "$log"
