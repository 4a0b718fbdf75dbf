#!/bin/bash
# Which part of CUPTI PM sampling crashes a 2-rank DDP GPT-2 on two NVLink H200s at the end of
# a capture (SIGSEGV in both ranks, device runs of 2026-11-23): the job without aiprof (does
# it exit?), PM on one rank alone, PM on two ranks without the NVLink counters, PM on two ranks
# with every counter.
. "$(dirname "$0")/x2_common.sh"
ddp() { python3 -m torch.distributed.run --nproc_per_node $1 --master_port $2 examples/ddp_gpt2.py --seconds $3 --step-times $K/$4_steps{rank}.log --buckets /dev/null; }
say "plain job, 2 ranks, 15 s"
timeout 60 bash -c "$(declare -f ddp); K=$K; ddp 2 29651 15 plain" > $K/plain.log 2>&1; echo "plain rc=$? $(grep -c 'steps$' $K/plain.log) ranks said bye"
case_pm() {  # name nproc skip port
  say "aiprof run $1 (PM 100 us, $2 rank(s), AIPROF_PM_SKIP=${AIPROF_PM_SKIP:-})"
  timeout 90 python3 -m aiprof run --skip 20 -n 5 --what kernels,hw --hw-pm-interval-us 100 --out /tmp/cap --capture-id $1 -- \
      python3 -m torch.distributed.run --nproc_per_node $2 --master_port $3 examples/ddp_gpt2.py --seconds 25 \
      --step-times $K/$1_steps{rank}.log --buckets /dev/null > $K/$1.log 2>&1; echo "$1 rc=$?"
  grep -E "SIGSEGV|exitcode|steps$|aiprof:" $K/$1.log | tail -3
  for r in 0 1; do [ -f /tmp/cap/$1/rank$r/meta.json ] && python3 -c "
import json; m=json.load(open('/tmp/cap/$1/rank$r/meta.json')); pm=(m.get('hw') or {}).get('pm') or {}
print('  rank $r pm ok', pm.get('ok'), 'rows', pm.get('rows'), 'gap', pm.get('gap_us'), 'err', pm.get('error'), 'stop_ms', pm.get('stop_ms'), 'cols', len(pm.get('columns') or []))"; done
}
case_pm one 1 29661
AIPROF_PM_SKIP=pm_nvlink_tx_Bps,pm_nvlink_rx_Bps case_pm twonvl 2 29662
case_pm twoall 2 29663
(cd /tmp && tar czf $OUT/cap.tgz cap keep); ls -la $OUT; say done
