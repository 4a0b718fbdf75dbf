#!/bin/bash
# ANOMALY_MODE's pair on this machine (bench/diagnosis/cpu_anomaly.py): unprofiled ms per step of
# the fault (anomaly detection on) and the fix (off), ROUNDS alternating rounds, one process per
# run; then each captured with `aiprof run` as a user would, and analysed: the first cause and its
# predicted saving against the measured one. Captures land in OUT (default /tmp/cpu_anomaly).
set -eu
cd "$(dirname "$0")/../.."
PY=${PY:-python3}; OUT=${OUT:-/tmp/cpu_anomaly}; ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-80}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
job=bench/diagnosis/cpu_anomaly.py
for r in $(seq 1 $ROUNDS); do
  f=$($PY $job --anomaly --steps $STEPS | cut -d' ' -f1); x=$($PY $job --steps $STEPS | cut -d' ' -f1)
  echo "round $r: fault $f ms, fix $x ms"
done
rm -rf "$OUT"
for v in fault fix; do
  flag=""; [ $v = fault ] && flag=--anomaly
  $PY -m aiprof run --skip 20 --iterations 3 --what python --out "$OUT" --capture-id $v -- $PY $job $flag --seconds 6 2>&1 | tail -1
  $PY -m aiprof analyze "$OUT/$v" --json 2>/dev/null | $PY -c "
import json, sys
r = json.load(sys.stdin); c = (r.get('causes') or [None])[0]
print('$v: first cause', c and c['code'], 'saving', c and round(c['saving']['share'], 3),
      '| ANOMALY_MODE anywhere:', any(x['code'] == 'ANOMALY_MODE' for x in r['causes'] + r.get('minor', [])))"
done
