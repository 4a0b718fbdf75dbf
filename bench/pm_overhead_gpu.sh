#!/bin/bash
# Issue 15's overhead figures on the GPU machine: bench/pm_overhead.py (one process per
# measurement: none, the PM sampler alone, kernel tracing, + NVML/GPM, + PM at 100 µs), as many
# rounds as fit in PM_OVH_SECONDS. Run from the repo root with OUT set; wheels (msgspec) in
# $WHL (default .whl/pm).
. "$(dirname "$0")/x2_common.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
say "pm_overhead"
CUDA_VISIBLE_DEVICES=0 python3 bench/pm_overhead.py --rounds ${PM_OVH_ROUNDS:-8} --max-seconds ${PM_OVH_SECONDS:-470} \
    --out $OUT/pm_overhead.json 2> $OUT/pm_overhead.log; echo "rc=$?"
tail -n 45 $OUT/pm_overhead.log
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader
say done
