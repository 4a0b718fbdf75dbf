#!/bin/bash
# Issue 33 item 2: a PM sampler in a process of its own (bench/pm_process_probe.py) beside a
# GPT-2 job on GPU 0 that runs under `aiprof run` and is captured (kernels, Kineto) while the
# sampler samples: does the sampler get counters session after session, does the job survive?
# Then the idle GPU 1 as the control. Then the step-time cost (bench/pm_overhead.py: no agent,
# kernels only, kernels + PM counters; ROUNDS alternating rounds) on GPU 0.
. "$(dirname "$0")/x2_common.sh"
say "job on GPU 0 under aiprof run"
rm -rf /tmp/pcap
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m aiprof run --out /tmp/pcap -- python3 -m torch.distributed.run \
  --nproc_per_node 1 --master_port 29811 examples/ddp_gpt2.py --seconds 40 --step-times $K/p_steps{rank}.log \
  --buckets /dev/null > $K/pjob.log 2>&1 &
JOB=$!
for i in $(seq 1 120); do sleep 1; [ "$(wc -l < $K/p_steps0.log 2>/dev/null || echo 0)" -ge 20 ] && break; done
echo "training after $i s"
python3 bench/pm_process_probe.py --device 0 --windows 4 --seconds 2 > $K/probe_busy.log 2>&1 &
PROBE=$!
for c in 1 2; do sleep 2; timeout 60 python3 -m aiprof trigger -n 5 --what kernels --out /tmp/pcap --capture-id k$c --timeout 40 2>&1 | tail -1; done
wait $PROBE; echo "probe rc=$?"; cat $K/probe_busy.log | cut -c1-600
say "idle GPU 1 (control), with a CUDA context of the probe's own"
python3 bench/pm_process_probe.py --device 1 --windows 2 --seconds 1 --cuda-context 2>&1 | cut -c1-600
wait $JOB; echo "job rc=$?"; grep -E "SIGSEGV|Segmentation|exitcode" $K/pjob.log | head -3
say "step-time cost: none, kernels, kernels+pm"
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 bench/pm_overhead.py --modes none,kernels,kernels+pm --rounds ${ROUNDS:-3} \
  --max-seconds 300 --out $OUT/pm_overhead.json 2> $K/pm_overhead.log; echo "rc=$?"
tail -n 25 $K/pm_overhead.log
cp $K/probe_busy.log $K/pjob.log $K/pm_overhead.log $OUT/ 2>/dev/null; say done
