#!/bin/bash
# bench/scale.py on a lent many-core machine, before and after: the 1,024-rank targets of issue 34.
# Carry .whl/ray (Ray 2.60 for Python 3.12 without its Java jars, web dashboard, RLlib and LLM
# packages, and jsonschema's wheels), .whl/v3 (msgspec) and .dev/base (the baseline's src/, from
# `git archive REV src | tar -x -C .dev/base`). Usage: bash bench/scale_device.sh [TEMPLATE RANKS WORKERS]
set -u
T=${1:-ddp2}; N=${2:-1024}; W=${3:-16,64}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/ray/*.whl .whl/v3/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0
echo "cpus $(nproc); $(free -g | awk '/Mem:/{print $2}') GB; $(python3 -c 'import ray; print("ray", ray.__version__)')"
python3 bench/scale.py --template "$T" --ranks "$N" --local-max 0 --workers "$W" --compare .dev/base/src --warm \
  --work /tmp/scale --keep --timeout 240 --out "$OUT" 2>&1 | grep -v "WARNING\|warn(" | tee "$OUT/scale_$T.txt"
