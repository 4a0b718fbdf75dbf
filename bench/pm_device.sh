#!/bin/bash
# Everything the GPU machine runs for the PM-sampling figures (docs/capture.md quotes them):
# the probe (API, metrics, coexistence with Kineto, clock mapping, PM-only overhead), a real
# `aiprof run` capture of GPT-2 training with 100 µs counters and its analysis, and the agent's
# overhead per --what level. Run from the repo root with OUT set; wheels in $WHL (msgspec).
set -u
export PYTHONUNBUFFERED=1
if [ -n "${WHL:-}" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/*.whl; fi
export PYTHONPATH=$PWD/src:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
L="$OUT/log.txt"
PROBE_ROUNDS=5 PROBE_STEPS=10 timeout 120 python3 bench/pm_probe.py > /tmp/probe.log 2>&1; echo "probe rc=$?"
cat /tmp/probe.log >> "$L"; tail -c 2500 /tmp/probe.log
mkdir -p /tmp/keep
rm -rf /tmp/caps
STEPS=40 timeout 80 python3 -m aiprof run --skip 10 -n 3 --what kernels,hw --hw-pm-interval-us 100 --out /tmp/caps --capture-id gpt2pm -- \
    python3 bench/gpt_train.py steps > /tmp/run.log 2>&1; echo "run rc=$?"; tail -5 /tmp/run.log; cat /tmp/run.log >> "$L"
d=/tmp/caps/gpt2pm/rank0
ls -la $d
python3 -c "import json,sys; m=json.load(open('$d/meta.json')); print(json.dumps({k: m['hw'][k] for k in ('sources','notes')})); pm=m['hw'].get('pm') or {}; print(json.dumps({k: pm.get(k) for k in ('ok','error','rows','gap_us','stats','stop_ms','setup_ms','columns')}, default=str)); print('mapping', (pm.get('clock') or {}).get('mapping')); print('export', m.get('export')); print('steps', m['steps']['before_median_ms'], m['steps']['during_ms'])"
timeout 45 python3 -m aiprof analyze /tmp/caps/gpt2pm --out /tmp/keep > /tmp/analyze.txt 2>&1; echo "analyze rc=$?"
cat /tmp/analyze.txt >> "$L"
grep -A18 "Kernel families" /tmp/analyze.txt | cut -c1-240
grep -i "SM_ARRAY_IDLE\|SMs idle\|SM active" /tmp/analyze.txt | head -5
python3 -c "import json; r=json.load(open('/tmp/keep/report.json')); c=r['ranks'][0].get('counters') or {}; print(json.dumps({k: c.get(k) for k in ('samples','interval_us','alignment','matmul','not_matmul','during_kernels','outside_kernels')}, default=str)[:3000])"
timeout 20 python3 -m aiprof export /tmp/caps/gpt2pm --format chrome -o /tmp/gpt2pm.json > /tmp/export.log 2>&1; echo "export rc=$?"; tail -2 /tmp/export.log
python3 -c "import json; t=json.load(open('/tmp/gpt2pm.json')); ev=t['traceEvents'] if isinstance(t,dict) else t; c=[e for e in ev if e.get('ph')=='C' and 'pm_' in e.get('name','')]; print('chrome pm counter events', len(c), sorted({e['name'] for e in c})[:20])"
timeout 125 python3 bench/overhead.py --levels kernels,hw,hw-nopm --rounds 3 --steps 20 --active 8 --pretouch-gb 16 --out /tmp/ovh > /tmp/overhead.log 2>&1; echo "overhead rc=$?"
tail -12 /tmp/overhead.log; cat /tmp/overhead.log >> "$L"; cp /tmp/ovh/overhead.json /tmp/keep/ 2>/dev/null
cp -r /tmp/caps/gpt2pm/rank0 /tmp/keep/; (cd /tmp/keep && tar czf "$OUT/keep.tgz" .)
ls -la "$OUT"
