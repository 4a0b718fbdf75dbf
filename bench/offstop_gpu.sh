#!/bin/bash
# GPU run for the capture's end (issue 18 item 6, docs/capture.md "The end of a capture"):
# bench/capture_stall.py on GPT-2 (H200: ~61 ms/step) in every stop mode, then one kept
# off-thread capture analysed (rows the store dropped after the detach, the report's top).
# Run from the repo root with OUT set; wheels in $WHL (msgspec, for the analysis).
set -u
export PYTHONUNBUFFERED=1
if [ -n "${WHL:-}" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/msgspec*.whl; fi
export PYTHONPATH=$PWD/src:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
python3 -c "
import time, torch
from aiprof.agent import offstop
t = time.perf_counter(); p = offstop.build(); print('stopper', p, 'built in %.1f s' % (time.perf_counter() - t))" 2>&1 | tail -2
timeout 400 python3 bench/capture_stall.py --model gpt2 --rounds ${ROUNDS:-3} --out /tmp/cs --keep > /tmp/cs.log 2>&1
echo "capture_stall rc=$?"
grep -v "^round .* done" /tmp/cs.log | tail -40
cp /tmp/cs/capture_stall.json "$OUT/" 2>/dev/null
for m in offthread offthread-late auto; do
  d=/tmp/cs/captures/r0-$m
  [ -d "$d" ] || continue
  timeout 90 python3 -c "
from aiprof.trace.store import open_capture
r = open_capture('$d', use_cache=False).ranks[0]
print('$m: rows dropped after the capture end', r.meta.get('rows_after_capture_end'), '| kernels', len(r.table('kernels')), '| stop', r.meta['capture'].get('stop'))
"
  timeout 90 python3 -m aiprof analyze "$d" --json --out /tmp/an-$m > /dev/null 2>&1
  python3 -c "
import json; r = json.load(open('/tmp/an-$m/report.json'))
print('$m: kernels launched per step', [s['kernels_launched'] for s in r['ranks'][0]['steps']], 'GPU time launched us', [round(s['gpu_time_launched_us']) for s in r['ranks'][0]['steps']])
"
done
ls -la "$OUT"
