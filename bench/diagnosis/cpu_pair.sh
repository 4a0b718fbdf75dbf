#!/bin/bash
# A CPU diagnosis pair on this machine: JOB (a script with FLAG for the fault, without it the fix,
# `--steps N` printing its unprofiled ms per step, `--seconds S` training that long) timed
# unprofiled, ROUNDS alternating rounds of fault / fix, one process per run; then each variant
# captured with `aiprof run` as a user would, and analysed: the first cause and its predicted
# saving against the measured one, and whether CODE is reported anywhere. Captures land in OUT.
#   bash bench/diagnosis/cpu_pair.sh bench/diagnosis/cpu_zero_grad.py --fault ZEROED_GRADS
# EXTRA: arguments for both variants (e.g. EXTRA="--accum 2").
set -eu
cd "$(dirname "$0")/../.."
JOB=$1; FLAG=$2; CODE=$3
PY=${PY:-python3}; OUT=${OUT:-/tmp/$(basename "$JOB" .py)}; ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-80}; EXTRA=${EXTRA:-}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
for r in $(seq 1 "$ROUNDS"); do
  f=$($PY "$JOB" $FLAG $EXTRA --steps "$STEPS" | cut -d' ' -f1); x=$($PY "$JOB" $EXTRA --steps "$STEPS" | cut -d' ' -f1)
  echo "round $r: fault $f ms, fix $x ms"
done
rm -rf "$OUT"
for v in fault fix; do
  flag=""; [ $v = fault ] && flag=$FLAG
  $PY -m aiprof run --skip 20 --iterations 3 --what python --out "$OUT" --capture-id $v -- $PY "$JOB" $flag $EXTRA --seconds 6 2>&1 | tail -1
  $PY -m aiprof analyze "$OUT/$v" --json 2>/dev/null | CODE=$CODE V=$v $PY -c "
import json, os, sys
r = json.load(sys.stdin); c = (r.get('causes') or [None])[0]; code = os.environ['CODE']
print(os.environ['V'] + ': first cause', c and c['code'], 'saving', c and round(c['saving']['share'], 3),
      '|', code, 'anywhere:', any(x['code'] == code for x in r['causes'] + r.get('minor', [])))"
done
