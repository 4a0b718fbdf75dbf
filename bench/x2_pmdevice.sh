#!/bin/bash
# Issue 33: why two ranks of one host that both run CUPTI PM sampling crashed (SIGSEGV at the end
# of the capture, device runs of 2026-11-23). Hypothesis: the agent's own threads (the PM prewarm
# thread, the sampler's setup thread) start on CUDA device 0 whatever the job set on its thread,
# so on local rank 1 CUPTI worked against device 0, the GPU rank 0 samples. Checks: what device a
# new Python thread sees; which GPUs each rank's process holds a context on (nvidia-smi) while
# both sample; the crash with the code before (BASE, a src/ folder) and after the fix.
# Usage: BASE=.dev/pmbase/src WHL=.whl [CASES='one:1:1 two:2:5'] bash bench/x2_pmdevice.sh [ROUNDS]
#        (BASE= : this tree only)
. "$(dirname "$0")/x2_common.sh"
ROUNDS=${1:-1}; BASE=${BASE-}
say "GPUs"; nvidia-smi --query-gpu=index,uuid,name --format=csv,noheader
say "the CUDA device a new Python thread sees after the main thread's set_device(1)"
python3 - <<'PY'
import threading, torch
torch.cuda.set_device(1); torch.zeros(1, device="cuda")
seen = []
t = threading.Thread(target=lambda: seen.append(torch.cuda.current_device())); t.start(); t.join()
print("main thread:", torch.cuda.current_device(), " new thread:", seen[0])
PY
case_pm() {  # name src port nproc iters
  say "aiprof run $1 (src $2): $4 rank(s), PM 100 us on each (AIPROF_PM_ALL_RANKS=1), capture of $5 iteration(s)"
  rm -rf /tmp/cap/$1
  ( for i in $(seq 1 40); do sleep 2; echo "t=$((i*2)) $(nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader | tr '\n' ';')"; done ) > $K/$1.smi &
  SMI=$!
  # AIPROF_PM_ALL_RANKS=1: the rule "local rank 0 only" off in the code before the fix (the fix dropped it)
  AIPROF_PM_ALL_RANKS=1 PYTHONPATH=$2:/tmp/site timeout 120 python3 -m aiprof run --skip 20 -n $5 --what kernels,hw \
      --hw-pm-interval-us 100 --out /tmp/cap --capture-id $1 -- \
      python3 -m torch.distributed.run --nproc_per_node $4 --master_port $3 examples/ddp_gpt2.py --seconds ${SECONDS_JOB:-25} \
      --step-times $K/$1_steps{rank}.log --buckets /dev/null > $K/$1.log 2>&1; echo "$1 rc=$?"
  kill $SMI 2>/dev/null
  grep -E "SIGSEGV|exitcode|steps$|aiprof:" $K/$1.log | tail -4
  # which processes held a context on which GPU while the job ran (the most seen at once)
  awk -F';' '{print NF-1, $0}' $K/$1.smi | sort -n | tail -1 | cut -c1-400
  for r in 0 1; do [ -f /tmp/cap/$1/rank$r/meta.json ] && python3 -c "
import json; m=json.load(open('/tmp/cap/$1/rank$r/meta.json')); pm=(m.get('hw') or {}).get('pm') or {}
print('  rank $r pm device', pm.get('device'), 'ok', pm.get('ok'), 'rows', pm.get('rows'), 'gap', pm.get('gap_us'), 'err', pm.get('error'), 'waited_ms', pm.get('stop_waited_ms'), 'teardown', m.get('cupti_teardown') or (m.get('export') or {}).get('cupti_teardown'), 'errors', m.get('errors'))"; done
}
# CASES: "name:nproc:iters ..." (default: a 1-iteration capture, always shorter than the set-up)
for i in $(seq 1 $ROUNDS); do
  for c in ${CASES:-one:1:1 two:2:5}; do
    IFS=: read -r name nproc iters <<< "$c"
    [ -n "$BASE" ] && case_pm base_${name}$i "$BASE" $((29670 + i)) $nproc $iters
    case_pm fixed_${name}$i "$PWD/src" $((29680 + i)) $nproc $iters
  done
done
(cd /tmp && tar czf $OUT/pmdevice.tgz keep 2>/dev/null); say done
