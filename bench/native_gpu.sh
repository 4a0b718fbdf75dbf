#!/bin/bash
# One device run for issue 16 (docs/capture.md, "Native data: figures"): probe cost, and
# `aiprof attach --probe-file default` into a running DDP GPT-2 (1 rank: one GPU lent).
cd .dev/native 2>/dev/null || true; pwd
set -x
S=/tmp/site; mkdir -p $S/frida
cp -r whl/frida16/* $S/frida/ && xz -dc whl/_frida.abi3.so.xz > $S/frida/_frida.abi3.so
python3 -m pip install -q --no-index --no-deps --target $S whl/*.whl
export PYTHONPATH=$S:$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import frida, msgspec, torch; print('frida', frida.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 60 python3 bench/probe_cost.py --calls 200000 --json $OUT/probe_cost.json
cd /tmp && W=/tmp/w && mkdir -p $W
python3 $OLDPWD/examples/ddp_gpt2.py --seconds 110 --step-times $W/steps.log --buckets $OUT/buckets.json > $W/job.log 2>&1 &
JOB=$!  # the job bounds itself (--seconds)
for i in $(seq 1 90); do [ -f $W/steps.log ] && [ $(wc -l < $W/steps.log) -ge 60 ] && break; sleep 1; done
grep -l nccl /proc/$JOB/maps >/dev/null && grep -o '/[^ ]*libnccl[^ ]*' /proc/$JOB/maps | sort -u
echo "attach_unix_ns $(date +%s%N)" > $OUT/times.txt
timeout 150 python3 -m aiprof attach $JOB --probe-file default --skip 30 --iterations 5 --what kernels --out /tmp/cap --capture-id gpu --timeout 120 > $OUT/attach.log 2>&1
echo "attach_done_unix_ns $(date +%s%N)" >> $OUT/times.txt
sleep 20  # steps with the probes in and no profiler: the overhead figure (steps.log)
echo "trigger_unix_ns $(date +%s%N)" >> $OUT/times.txt
timeout 100 python3 -m aiprof trigger --pid $JOB --probe-file default --skip 5 --iterations 3 --what kernels,syscalls --out /tmp/cap --capture-id gpusys --timeout 80 >> $OUT/attach.log 2>&1
echo "trigger_done_unix_ns $(date +%s%N)" >> $OUT/times.txt
wait $JOB
tail -3 $W/job.log
cp $W/steps.log $OUT/steps.log
ls -la /tmp/cap/*/rank0
tar -C /tmp/cap -czf $OUT/capture.tgz .
ls -la $OUT
