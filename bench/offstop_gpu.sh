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
t0=$(date +%s.%N)
python3 -c "import torch; from aiprof.agent import offstop; print('stopper', offstop.build())" 2>&1 | tail -2
echo "build s: $(echo "$(date +%s.%N) - $t0" | bc)"
timeout 400 python3 bench/capture_stall.py --model gpt2 --rounds ${ROUNDS:-3} --out /tmp/cs --keep > /tmp/cs.log 2>&1
echo "capture_stall rc=$?"
grep -v "^round .* done" /tmp/cs.log | tail -40
cp /tmp/cs/capture_stall.json "$OUT/" 2>/dev/null
d=$(ls -d /tmp/cs/captures/r0-offthread 2>/dev/null)
if [ -n "$d" ]; then
  timeout 90 python3 -c "
import json, sys
from aiprof.trace.store import open_capture
c = open_capture('$d', use_cache=False)
r = c.ranks[0]
print('rows after capture end dropped:', r.meta.get('rows_after_capture_end'), 'kernels kept:', len(r.table('kernels')))
print('stop:', r.meta['capture'].get('stop'))
"
  timeout 90 python3 -m aiprof analyze "$d" 2>&1 | head -30
fi
ls -la "$OUT"
