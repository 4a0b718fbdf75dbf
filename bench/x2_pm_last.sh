#!/bin/bash
# Two NVLink H200s, PM sampling: (1) the sampler's overhead on single-GPU GPT-2 training with
# CUPTI kept attached between Kineto sessions (TEARDOWN_CUPTI=0: with Kineto's teardown a later
# PM setup in the process failed, docs/capture.md): none / sampler / Kineto / both, interleaved
# (bench/pm_probe.py); (2) 2-rank DDP GPT-2 with NCCL forced onto sockets under `aiprof run
# --what kernels,hw --hw-pm-interval-us 100`: what the NVLink counters read during all-reduces
# that do not use NVLink.
. "$(dirname "$0")/x2_common.sh"
say "1. pm_probe, TEARDOWN_CUPTI=0"
TEARDOWN_CUPTI=0 PROBE_ROUNDS=7 PROBE_STEPS=12 OUT=$K/probe CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/pm_probe.py > $K/probe.log 2>&1; echo "probe rc=$?"
python3 -c "
import json; r=json.load(open('$K/probe/probe.json')); print('gpt2', json.dumps(r.get('gpt2'))[:1200]); print('start errors', r.get('gpt2_start_errors')); print('errors', [e[-200:] for e in r.get('errors', [])])"
say "2. sockets + PM"
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 timeout 90 python3 -m aiprof run --skip 10 -n 3 --what kernels,hw \
    --hw-pm-interval-us 100 --out /tmp/cap --capture-id sockpm -- python3 -m torch.distributed.run --nproc_per_node 2 \
    --master_port 29681 examples/ddp_gpt2.py --seconds 25 --step-times $K/sock_steps{rank}.log --buckets /dev/null \
    > $K/sock.log 2>&1; echo "sock rc=$?"
grep -E "SIGSEGV|steps$|aiprof:" $K/sock.log | tail -3
for r in 0 1; do [ -f /tmp/cap/sockpm/rank$r/meta.json ] && python3 -c "
import json; m=json.load(open('/tmp/cap/sockpm/rank$r/meta.json')); pm=(m.get('hw') or {}).get('pm') or {}
print('  rank $r pm ok', pm.get('ok'), 'rows', pm.get('rows'), 'cols', pm.get('columns'), 'err', str(pm.get('error'))[:80])"; done
(cd /tmp && tar czf $OUT/last.tgz cap keep); ls -la $OUT; say done
