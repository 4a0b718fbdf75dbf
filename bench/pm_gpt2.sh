#!/bin/bash
# GPT-2 training with 100 µs CUPTI PM counters through the agent, long enough that the sampler's
# setup (~0.5 s) leaves most of the capture sampled: per-kernel-family counters (DRAM bandwidth
# of elementwise kernels vs GEMMs, tensor-pipe activity in matmuls vs elsewhere), the achieved
# interval, and the step times of the capture against those before it. Issue 15's GPT-2 figures.
# Run from the repo root with OUT set; wheels in $WHL (msgspec).
set -u
export PYTHONUNBUFFERED=1
if [ -n "${WHL:-}" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/msgspec*.whl; fi
export PYTHONPATH=$PWD/src:/tmp/site
rm -rf /tmp/pmcaps; mkdir -p /tmp/pmkeep
STEPS=${STEPS:-70} timeout 150 python3 -m aiprof run --skip 20 -n ${PM_ITERS:-20} --what kernels,hw --hw-pm-interval-us 100 \
    --out /tmp/pmcaps --capture-id gpt2pm -- python3 bench/gpt_train.py steps > /tmp/pmrun.log 2>&1; echo "run rc=$?"; tail -3 /tmp/pmrun.log
d=/tmp/pmcaps/gpt2pm/rank0
python3 -c "import json; m=json.load(open('$d/meta.json')); pm=m['hw'].get('pm') or {}; print(json.dumps({k: pm.get(k) for k in ('ok','error','rows','gap_us','setup_ms','stop_ms')}, default=str)); print('steps before', m['steps']['before_median_ms'], 'during', m['steps']['during_ms']); print('stop', m.get('stop'), 'export', m.get('export'))"
timeout 90 python3 -m aiprof analyze /tmp/pmcaps/gpt2pm --out /tmp/pmkeep > /tmp/pmanalyze.txt 2>&1; echo "analyze rc=$?"
grep -B1 -A18 "Kernel families" /tmp/pmanalyze.txt | cut -c1-230
grep -i "SM_ARRAY_IDLE" /tmp/pmanalyze.txt | head -3
python3 -c "import json; r=json.load(open('/tmp/pmkeep/report.json')); c=r['ranks'][0].get('counters') or {}; print(json.dumps({k: c.get(k) for k in ('samples','interval_us','alignment','matmul','not_matmul','during_kernels','outside_kernels')}, default=str)[:2500])"
cp /tmp/pmkeep/report.json "$OUT/pm_gpt2_report.json" 2>/dev/null; cp /tmp/pmanalyze.txt "$OUT/pm_gpt2_analyze.txt"
