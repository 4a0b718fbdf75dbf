#!/bin/bash
# Two NVLink H200s: (1) 2-rank DDP GPT-2 under `aiprof run --what kernels,hw --hw-pm-interval-us
# 100` with PM sampling in local rank 0 only (hwmon.pm_refused): NVLink counters during the
# all-reduces, and does the job live; (2)-(3) does a 2-rank job exit after a kernels capture,
# with CUPTI left attached (TEARDOWN_CUPTI=0, the job's choice) and with aiprof's teardown.
. "$(dirname "$0")/x2_common.sh"
cap() {  # name pm_us job_seconds port timeout
  say "aiprof run $1 (pm ${2} us, job ${3} s, TEARDOWN_CUPTI=${TEARDOWN_CUPTI:-unset})"
  timeout $5 python3 -m aiprof run --skip 20 -n 5 --what kernels,hw --hw-pm-interval-us $2 --out /tmp/cap --capture-id $1 -- \
      python3 -m torch.distributed.run --nproc_per_node 2 --master_port $4 examples/ddp_gpt2.py --seconds $3 \
      --step-times $K/$1_steps{rank}.log --buckets $K/$1_buckets.json > $K/$1.log 2>&1; echo "$1 rc=$? after $(( $(date +%s) - T0 )) s"
  grep -E "SIGSEGV|exitcode|steps$|aiprof:" $K/$1.log | tail -4
  for r in 0 1; do [ -f /tmp/cap/$1/rank$r/meta.json ] && python3 -c "
import json; m=json.load(open('/tmp/cap/$1/rank$r/meta.json')); pm=(m.get('hw') or {}).get('pm') or {}
print('  rank $r pm ok', pm.get('ok'), 'rows', pm.get('rows'), 'gap', pm.get('gap_us'), 'err', str(pm.get('error'))[:90], 'teardown', m.get('cupti_teardown'))"; done
}
cap pm2 100 30 29671 80
TEARDOWN_CUPTI=0 cap keep_cupti 0 20 29672 60
cap teardown 0 20 29673 60
(cd /tmp && tar czf $OUT/cap.tgz cap keep); ls -la $OUT; say done
