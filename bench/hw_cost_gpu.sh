#!/bin/bash
# Where `--what hw` costs GPT-2 training under kernel tracing: (1) each NVML/GPM/psutil source
# polled every 100 ms with every segment under torch.profiler (bench/hw_sources_cost.py
# --kineto); (2) aiprof captures with kernels, kernels+hw and kernels+PM at 100 µs, one process
# each (bench/pm_overhead.py; the GPM and NVLink reads pause while PM samples). GPU 0 only.
# Run from the repo root with OUT set; wheels (msgspec) in $WHL (default .whl/x2).
. "$(dirname "$0")/x2_common.sh"
export CUDA_VISIBLE_DEVICES=0
say "hw sources under kineto"
[ "${HW_SECONDS:-200}" = 0 ] || timeout ${HW_SECONDS:-200} python3 bench/hw_sources_cost.py --kineto --rounds ${HW_ROUNDS:-3} --steps 30 --out $OUT/hw_sources_kineto.json \
    2> $OUT/hw_sources_kineto.log; echo "rc=$?"
say "pm_overhead ${PM_OVH_MODES:-kernels,kernels+hw,kernels+pm}"
python3 bench/pm_overhead.py ${PM_OVH_PREWARM:+--prewarm} --modes ${PM_OVH_MODES:-kernels,kernels+hw,kernels+pm} --rounds ${PM_OVH_ROUNDS:-6} \
    --max-seconds ${PM_OVH_SECONDS:-300} --out $OUT/pm_overhead2.json 2> $OUT/pm_overhead2.log; echo "rc=$?"
grep -v "^round" $OUT/pm_overhead2.log | tail -3; grep "^round" $OUT/pm_overhead2.log | cut -c1-160
say done
