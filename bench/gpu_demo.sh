#!/usr/bin/env bash
# The GPU demonstrations of issue 4, for the device machine (2 GPUs). Writes under $OUT.
#   bash bench/gpu_demo.sh attach|ddp|overhead ...
# Expects: wheels in .whl/ (py-spy, pyinjector, msgspec), python3 with torch + transformers.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH
command -v cc >/dev/null || command -v gcc >/dev/null || export AIPROF_SHIM=$PWD/.whl/shim-prebuilt.so
AIP="env PYTHONPATH=/tmp/site:$PWD/src python3 -m aiprof"
CAP=/tmp/caps; mkdir -p $CAP
for part in "$@"; do
case $part in
attach)
  echo "== attach: GPT-2 forever loop, started without aiprof"
  env -u PYTHONPATH python3 bench/gpt_train.py forever > /tmp/gpt.log 2>&1 &
  PID=$!
  for i in $(seq 240); do grep -q "^step 50 " /tmp/gpt.log && break; sleep 0.5; done
  tail -2 /tmp/gpt.log
  time $AIP attach $PID --iterations 3 --what kernels,python,hw --out $CAP --capture-id attach_gpt2 --json
  $AIP trigger --pid $PID -n 1 --what kernels --out $CAP --capture-id attach_light
  $AIP stacks $PID --json > $OUT/stacks_gpt2.json; echo "stacks rc=$? threads: $(grep -c '"os_thread_id"' $OUT/stacks_gpt2.json)"
  sleep 12; tail -3 /tmp/gpt.log
  kill $PID
  $AIP analyze $CAP/attach_gpt2 --json > $OUT/analyze_attach.json; echo "analyze rc=$?"
  $AIP analyze $CAP/attach_gpt2 | head -40
  python3 bench/check_capture.py $CAP/attach_gpt2 > $OUT/check_attach.json; cat $OUT/check_attach.json | head -60
  python3 bench/check_capture.py $CAP/attach_light | grep -E "gz_bytes|steps_in"
  cp $CAP/attach_light/rank0/trace.json.gz $OUT/attach_light_trace.json.gz
  ;;
ddp)
  echo "== aiprof run on torchrun, 2 ranks"
  time $AIP run --skip 10 --iterations 3 --what kernels,hw --out $CAP --capture-id ddp -- \
      torchrun --nproc-per-node 2 bench/ddp_train.py; echo "run rc=$?"
  python3 bench/check_capture.py $CAP/ddp > $OUT/check_ddp.json; grep -E '"rank|steps_in|meta_steps|gz_bytes|hw_sources' -A1 $OUT/check_ddp.json | head -40
  $AIP analyze $CAP/ddp --json > $OUT/analyze_ddp.json; echo "analyze rc=$?"
  $AIP analyze $CAP/ddp | head -40
  ;;
overhead)
  echo "== overhead"
  PYTHONPATH=/tmp/site:$PWD/src python3 bench/overhead.py --rounds 4 --steps 30 --pretouch-gb 16 --out /tmp/bench 2>&1 | grep -v -E "USDT|UserWarning|_warn_once|CPUAllocator"
  cp /tmp/bench/overhead.json $OUT/
  ;;
esac
done
