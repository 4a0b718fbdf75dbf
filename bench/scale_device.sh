#!/bin/bash
# bench/scale.py on a lent many-core machine, before and after: the 1,024-rank targets of issue 34.
# Carry .whl (bench/scale_bundle.py: a slim Ray, jsonschema's, msgspec's and isal's wheels) and .dev/base
# (the baseline's src/: `git archive REV src | tar -x -C .dev/base`); the working tree and carry
# must fit 64 MiB: leave tests/data out but for the templates (git sparse-checkout).
# Usage: bash bench/scale_device.sh [TEMPLATE RANKS WORKERS [TASKSET_CPUS]]
set -u
T=${1:-ddp2}; N=${2:-1024}; W=${3:-16,64}; CPUS=${4:-}; WARM=${WARM-1}  # WARM= : no warm runs
HEAD=${HEAD-}  # HEAD=1 : also runs on a Ray head started once (bench/scale.py --head)
BASE=${BASE-.dev/base/src}  # BASE= : no baseline runs
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ ! -d /tmp/site/ray ]; then
  mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -2 && tar -xJf .whl/ray-*-slim-*.tar.xz -C /tmp/site
fi
export PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0
echo "cpus $(nproc); $(free -g | awk '/Mem:/{print $2}') GB; $(python3 -c 'import ray; print("ray", ray.__version__)')"
lscpu | grep -E "^(Model name|Thread|Core|Socket|CPU\(s\)|NUMA node\(s\)|CPU max MHz)" | tr -s ' '
PIN=(); [ -n "$CPUS" ] && PIN=(taskset -c "$CPUS")  # a smaller machine: the job sees only these CPUs
"${PIN[@]}" python3 bench/scale.py --template "$T" --ranks "$N" --local-max 0 --workers "$W" ${BASE:+--compare "$BASE"} ${WARM:+--warm} ${HEAD:+--head} \
  --work /tmp/scale --keep --timeout "${RUN_TIMEOUT:-240}" --out "$OUT/$T${CPUS:+_cpus$CPUS}" 2>&1 | grep -v "WARNING\|warn(" | tee -a "$OUT/scale_$T.txt"
