#!/bin/bash
# GPU demo of issue 5 on a 4-GPU machine (the device tool's nvidia-h200-x4), results in $OUT:
#  1. a 4-rank DDP capture where rank 2 is slow (bench/ddp_straggler.py) -> ddp4_slow2_rank*.json.gz
#  2. a live NCCL hang (tests/attach/scripts/hang_job.py, rank 1 stuck in load_batch) snapshotted
#     with `aiprof hang --job` -> hang_nccl.json, hang_nccl.txt
# Needs py-spy (and msgspec for the aiprof CLI) as wheels in .whl/.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/src:/tmp/site PATH=/tmp/site/bin:$PATH
log=$OUT/log.txt
{ nvidia-smi -L; python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count())'; py-spy --version; } 2>&1 | tee -a "$log"

echo "== 1. straggler capture" | tee -a "$log"
t0=$(date +%s)
timeout 240 python3 -m torch.distributed.run --nproc_per_node 4 --master_port 29511 bench/ddp_straggler.py \
    --slow-rank 2 --extra 40 --out "$OUT" 2>&1 | grep -v "^W" | tail -20 | tee -a "$log"
echo "capture took $(( $(date +%s) - t0 )) s" | tee -a "$log"
ls -l "$OUT" | tee -a "$log"

echo "== 2. NCCL hang" | tee -a "$log"
ready=$(mktemp -d)
TORCH_NCCL_BLOCKING_WAIT=1 setsid python3 -m torch.distributed.run --nproc_per_node 4 --master_port 29522 \
    tests/attach/scripts/hang_job.py --backend nccl --block-rank 1 --block-at 3 --ready-dir "$ready" \
    > "$OUT/hang_job_log.txt" 2>&1 &
job=$!
for i in $(seq 1 120); do [ "$(ls "$ready" | wc -l)" -ge 4 ] && break; sleep 1; done
echo "ranks ready after ~${i} s: $(ls "$ready")" | tee -a "$log"
sleep 5
t0=$(date +%s%N)
timeout 120 python3 -m aiprof hang --job --json > "$OUT/hang_nccl.json" 2>>"$log"; echo "hang rc=$?" | tee -a "$log"
echo "hang --json took $(( ($(date +%s%N) - t0) / 1000000 )) ms" | tee -a "$log"
timeout 120 python3 -m aiprof hang --job 2>&1 | tee "$OUT/hang_nccl.txt" | tee -a "$log"
kill -9 -- -$job 2>/dev/null; sleep 1

echo "== 3. analysis of the straggler capture" | tee -a "$log"
AIPROF_CACHE_DIR=/tmp/aipcache timeout 120 python3 -m aiprof analyze "$OUT"/ddp4_slow2_rank*.json.gz 2>&1 \
    | grep -A3 -E "STRAGGLER|ABNORMAL|Cross-rank|Clocks" | tee -a "$log"
echo done | tee -a "$log"
