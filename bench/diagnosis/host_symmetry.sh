#!/usr/bin/env bash
# Is a coupled job's straggler under the profiler the profiler's doing? (docs/findings.md, "Coupled
# ranks under the profiler"). A multi-rank v3 job (SPEC, NPROC ranks) run ROUNDS times unprofiled and
# ROUNDS times under `aiprof run --skip 10 --iterations 3` (as the v3 captures were made), each rank
# logging per step its host wall time and every thread's CPU time (v3_job.py --step-log). Printed per
# rank and run, over the unprofiled window [10, 30) or the captured steps [10, 13): the median wall
# and main-thread CPU ms a step, and the busiest threads' CPU ms a step.
#   run: NPROC=4 ROUNDS=3 SPEC=fsdp_units:fault@48 bash bench/diagnosis/host_symmetry.sh
#   (carry .whl; WHL=.whl/v3 holds msgspec); with $OUT set the captures come back for `aiprof analyze`
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHL:-.whl/v3}"/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD/src:/tmp/site
SPEC=${SPEC:-fsdp_units:fault@48}
c=${SPEC%%:*}; r=${SPEC#*:}; v=${r%%@*}; b=${r#*@}
N=${NPROC:-4}; K=/tmp/hostsym; rm -rf $K; mkdir -p $K
JOB="bench/diagnosis/v3_job.py --case $c --variant $v --batch $b"
for round in $(seq 1 "${ROUNDS:-2}"); do
  timeout 200 torchrun --standalone --nproc-per-node $N $JOB --steps 20 --step-log $K/plain$round > $K/plain$round.log 2>&1 \
    || tail -n 5 $K/plain$round.log
  timeout 300 python3 -m aiprof run --skip 10 --iterations 3 --what kernels,python,shapes --out $K/caps \
    --capture-id prof$round -- torchrun --standalone --nproc-per-node $N $JOB --steps 6 --step-log $K/prof$round \
    > $K/prof$round.log 2>&1 || tail -n 5 $K/prof$round.log
done
python3 - "$K" <<'PY'
import glob, json, statistics as st, sys
k = sys.argv[1]


def busy(d, a, b):
    """CPU ms per step of each thread name over steps [a, b), the busiest first."""
    t0, t1 = d["threads"][a], d["threads"][b]
    out = {}
    for tid, ns in t1.items():
        name = d["names"].get(tid, "?")
        out[name] = out.get(name, 0.0) + (ns - t0.get(tid, 0)) / 1e6 / (b - a)
    return sorted(out.items(), key=lambda kv: -kv[1])


for path in sorted(glob.glob(f"{k}/*.rank*.json")):
    d = json.load(open(path))
    name = path.rsplit("/", 1)[1]
    # unprofiled: the window [10, 30); profiled: the captured iterations 10-12 (--skip 10 --iterations 3)
    a, b = (10, 30) if name.startswith("plain") else (10, 13)
    w, c = d["wall_ms"][a:b], d["cpu_ms"][a:b]
    top = ", ".join(f"{n} {v:.1f}" for n, v in busy(d, a, b)[:4])
    print(f"{name:18s} wall {st.median(w):7.2f} main-thread cpu {st.median(c):6.2f} ms/step; threads' cpu ms/step: {top}")
PY
# the captures and their step logs, for `aiprof analyze` elsewhere
if [ -n "${OUT:-}" ]; then
  for c in $K/caps/prof*; do tar czf $OUT/$(basename $c).tgz -C $K caps/$(basename $c) $(cd $K && ls $(basename $c).rank*.json); done
fi
