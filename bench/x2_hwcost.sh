#!/bin/bash
# Two NVLink H200s: (1) which NVML/GPM/psutil source of `--what hw` costs GPT-2 training its
# step time (bench/hw_sources_cost.py on GPU 0); (2) 2-rank DDP GPT-2 under `aiprof run --what
# kernels,hw --hw-pm-interval-us 100`: does local rank 0 now sample all the counters its chip
# accepts (13 on this machine) with rank 1 no longer resolving them at the same time.
. "$(dirname "$0")/x2_common.sh"
say "hw sources"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/hw_sources_cost.py --rounds ${HW_ROUNDS:-4} --steps 30 --out $OUT/hw_sources.json 2> $K/hw_sources.log; echo "rc=$?"
tail -3 $K/hw_sources.log
say "2-rank PM capture"
rm -rf /tmp/cap ~/.cache/aiprof/pm-metrics-*
timeout 120 python3 -m aiprof run --skip 20 -n 5 --what kernels,hw --hw-pm-interval-us 100 --out /tmp/cap --capture-id pm2 -- \
    python3 -m torch.distributed.run --nproc_per_node 2 --master_port 29681 examples/ddp_gpt2.py --seconds 25 \
    --step-times $K/pm2_steps{rank}.log > $K/pm2.log 2>&1; echo "pm2 rc=$? after $(( $(date +%s) - T0 )) s"
grep -E "SIGSEGV|exitcode|steps$|aiprof:" $K/pm2.log | tail -4
for r in 0 1; do [ -f /tmp/cap/pm2/rank$r/meta.json ] && python3 -c "
import json; m=json.load(open('/tmp/cap/pm2/rank$r/meta.json')); pm=(m.get('hw') or {}).get('pm') or {}
print('rank $r pm ok', pm.get('ok'), 'rows', pm.get('rows'), 'gap', pm.get('gap_us'), 'setup_ms', pm.get('setup_ms'), 'err', str(pm.get('error'))[:120])
print('  columns', len(pm.get('columns') or []), pm.get('columns'))"; done
cp $K/hw_sources.log $K/pm2.log $OUT/ 2>/dev/null
say done
