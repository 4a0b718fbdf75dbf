#!/bin/bash
# Issue 33 item 2: a PM sampler process beside a job on the same GPU (bench/pm_sidecar_probe.py).
# 1. cuInit only (no context), 2. a CUDA context of its own; each while the job runs Kineto
# captures in its own process every few seconds. Prints the report of each run.
. "$(dirname "$0")/x2_common.sh"
P=bench/pm_sidecar_probe.py
for init in ${INITS:-cuinit context}; do
  say "sampler init=$init beside a job with Kineto captures"
  python3 $P job --seconds ${JOBS:-34} --log $K/job_$init.jsonl --kineto-every ${KEVERY:-5} > $K/job_$init.out 2>&1 &
  J=$!
  sleep 6
  timeout 60 python3 $P sampler --init $init --windows ${WINDOWS:-6} --seconds 2 --pause 2 --log $K/s_$init.jsonl > $K/s_$init.out 2>&1
  echo "sampler rc=$?"; tail -3 $K/s_$init.out
  wait $J; echo "job rc=$?"; tail -3 $K/job_$init.out
  python3 $P report --job $K/job_$init.jsonl --sampler $K/s_$init.jsonl
done
cp $K/s_*.jsonl $OUT/ 2>/dev/null; say done
