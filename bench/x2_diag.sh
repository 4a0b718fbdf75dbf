#!/bin/bash
# Two NVLink H200s: `aiprof run --what kernels,hw` of 2-rank DDP GPT-2 with PM sampling (60 s
# job) and without (35 s job), then `aiprof attach` with the default probe file into both ranks
# of a running job (docs/capture.md, "Two ranks on two NVLink H200s"). WHL=.whl/x2 (frida, msgspec).
. "$(dirname "$0")/x2_common.sh"
run_pm() {  # name pm_us seconds
  say "run $1 pm=$2 job=$3 s"
  timeout 150 python3 -m aiprof run --skip 20 -n 5 --what kernels,hw --hw-pm-interval-us $2 --out /tmp/cap --capture-id $1 -- \
    python3 -m torch.distributed.run --nproc_per_node 2 --master_port $4 examples/ddp_gpt2.py --seconds $3 \
    --step-times $K/$1_steps{rank}.log --buckets $K/$1_buckets.json > $K/$1.log 2>&1; echo "run $1 rc=$?"
  grep -E "SIGSEGV|exitcode|steps$|aiprof" $K/$1.log | grep -v "^W" | tail -4
  for r in 0 1; do python3 -c "
import json; m=json.load(open('/tmp/cap/$1/rank$r/meta.json')); pm=(m.get('hw') or {}).get('pm') or {}
print('rank $r', 'pm ok', pm.get('ok'), 'rows', pm.get('rows'), 'gap', pm.get('gap_us'), 'err', pm.get('error'), 'export', m.get('export'), 'stop', m.get('stop'), 'teardown', m.get('cupti_teardown'))" 2>&1 | tail -1; done
}
run_pm pm60 100 60 29621
run_pm nopm35 0 35 29622
say "attach"
W=/tmp/w; mkdir -p $W
python3 -m torch.distributed.run --nproc_per_node 2 --master_port 29631 examples/ddp_gpt2.py --seconds 100 \
    --step-times $W/steps{rank}.log --buckets $K/buckets.json > $W/job.log 2>&1 &
JOB=$!
for i in $(seq 1 90); do [ -f $W/steps0.log ] && [ "$(wc -l < $W/steps0.log)" -ge 150 ] && break; sleep 1; done
PIDS=$(for p in $(pgrep -f "examples/ddp_gpt2.py --seconds 100"); do tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -q '^LOCAL_RANK=' && echo $p; done)
echo "ranks: $PIDS; steps so far: $(wc -l < $W/steps0.log)"
for p in $PIDS; do
  timeout 60 python3 -m aiprof attach $p --no-capture --timeout 50 > $K/inject_$p.log 2>&1; echo "inject $p rc=$?"; tail -2 $K/inject_$p.log
done
echo "attach_unix_ns $(date +%s%N)" > $K/times.txt
timeout 130 python3 -m aiprof attach $PIDS --probe-file default --skip 30 --iterations 5 --what kernels \
    --out /tmp/cap --capture-id probe2 --timeout 110 > $K/attach.log 2>&1; echo "attach rc=$?"
echo "attach_done_unix_ns $(date +%s%N)" >> $K/times.txt
tail -6 $K/attach.log
sleep 20
echo "hooked_end_unix_ns $(date +%s%N)" >> $K/times.txt
kill -TERM $JOB 2>/dev/null; wait $JOB
cp $W/steps*.log $W/job.log $K/
ls /tmp/cap/*/rank*
(cd /tmp && tar czf $OUT/cap.tgz cap) ; (cd /tmp && tar czf $OUT/keep.tgz keep)
ls -la $OUT; say done
