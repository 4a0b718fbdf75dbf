#!/usr/bin/env bash
# Does a job under `aiprof run` fail to exit after a capture (seen on 4 H100s, 2026-11-26: 3 of 7
# single-GPU captures wrote a complete capture, then the job never exited)? Runs the v3 job in
# lanes, one per GPU, each capture ending 6 steps before the job does (so the job exits while
# the capture's export may still run), in three variants:
#   default   as a user runs it
#   offstop0  AIPROF_OFFSTOP=0: the profiler stopped by torch's stop_trace on the training thread
#   long      the job runs 300 more steps after the capture (the export is long done at exit)
# A job alive GRACE s after its meta.json appeared is hung: its native and Python stacks are dumped
# (py-spy dump --native, carried in .whl/bin; cuda-gdb's backtrace of every thread), then killed.
#   run: bash bench/diagnosis/exit_hang.sh   (carry .whl)
set -u
T0=$(date +%s)
say() { echo "== $* ($(( $(date +%s) - T0 )) s)"; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/v3/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD/src:/tmp/site
K=/tmp/exit_hang; rm -rf $K; mkdir -p $K
PYSPY=$PWD/.whl/bin/py-spy; chmod +x $PYSPY 2>/dev/null
RUNS=${RUNS:-3}
GRACE=${GRACE:-25}
NGPU=$(nvidia-smi -L | wc -l)

one() {  # one VARIANT GPU K
  local v=$1 g=$2 k=$3 id="${1}_g${2}_$3" steps=6 envs=""
  [ "$v" = offstop0 ] && envs="AIPROF_OFFSTOP=0"
  [ "$v" = long ] && steps=300
  env $envs CUDA_VISIBLE_DEVICES=$g PYTHONFAULTHANDLER=1 setsid python3 -m aiprof run --skip 10 --iterations 3 \
    --what kernels,python,shapes --out $K/caps --capture-id $id -- python3 bench/diagnosis/v3_job.py --case healthy \
    --variant fix --steps $steps > $K/$id.log 2>&1 &
  local pid=$! t=0 d=0
  while kill -0 $pid 2>/dev/null; do
    sleep 1; t=$((t + 1))
    [ -f $K/caps/$id/rank0/meta.json ] && d=$((d + 1))
    if [ $d -ge $GRACE ] || [ $t -ge 240 ]; then
      local job; job=$(pgrep -P $pid | head -1)
      echo "HUNG $id after $t s (meta.json $d s ago); job pid $job" | tee -a $K/summary.txt
      { echo "--- py-spy $id"; timeout 30 $PYSPY dump --native --pid $job 2>&1;
        echo "--- cuda-gdb $id"; timeout 60 cuda-gdb -batch -p $job -ex "thread apply all bt" 2>&1 | grep -v "^\[New\|^Reading" | head -300;
      } > $K/stacks_$id.txt 2>&1
      kill -ABRT $job 2>/dev/null; sleep 3; kill -KILL -- -$pid 2>/dev/null
      break
    fi
  done
  wait $pid 2>/dev/null; local rc=$?
  echo "$id rc=$rc t=${t}s meta=$([ -f $K/caps/$id/rank0/meta.json ] && echo yes || echo no)" | tee -a $K/summary.txt
}

for v in ${VARIANTS:-default offstop0 long}; do
  say "variant $v"
  for g in $(seq 0 $((NGPU - 1))); do
    ( for k in $(seq 1 $RUNS); do one $v $g $k; done ) &
  done
  wait
done
say "done"
cat $K/summary.txt
grep -c HUNG $K/summary.txt
(cd $K && tar czf $OUT/exit_hang.tgz summary.txt stacks_*.txt *.log 2>/dev/null)
ls -la $OUT
