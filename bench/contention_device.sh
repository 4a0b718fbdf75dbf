#!/bin/bash
# bench/cpu_contention.py on a lent many-core machine (carry .whl as for bench/scale_device.sh).
set -u
if [ ! -d /tmp/site/ray ]; then
  mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site:$PWD/src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 - <<'PY'
import sys; sys.path.insert(0, "bench")
from pathlib import Path
import scale
d, _ = scale.build("ddp2", 2, Path("/tmp/scale"))
print("built", d)
PY
python3 bench/cpu_contention.py --procs ${PROCS:-16,32,64} --rank /tmp/scale/ddp2_n2/rank00000.json.gz | tee "$OUT/contention.txt"
