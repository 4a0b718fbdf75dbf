#!/bin/bash
# Regenerates tests/data/pm_lead_h100: a 1-GPU GPT-2 (4 layers) capture of 3 iterations with PM
# counters, whose sampler (set up before the recording, issue 33) started before the first
# recorded step. Usage: WHL=.whl bash bench/pm_fixture.sh (results: $OUT/one.tgz)
. "$(dirname "$0")/x2_common.sh"
rm -rf /tmp/cap1
timeout 200 python3 -m aiprof run --skip 20 -n 3 --what kernels,hw --hw-pm-interval-us 100 --out /tmp/cap1 --capture-id one -- \
  python3 -m torch.distributed.run --nproc_per_node 1 --master_port 29841 examples/ddp_gpt2.py --seconds 20 --layers 4 \
  --step-times $K/s{rank}.log --buckets /dev/null > $K/one.log 2>&1; echo "rc=$?"
python3 -c "
import json; m=json.load(open('/tmp/cap1/one/rank0/meta.json')); pm=m['hw']['pm']
print({k: pm.get(k) for k in ('ok','rows','gap_us','setup_ms','prewarm_s','error')}, (m['started_unix_ns']-pm['started_unix_ns'])/1e6)"
python3 -m aiprof analyze /tmp/cap1/one --no-cache 2>&1 | grep -A3 "GPU counters" | cut -c1-220
ls -la /tmp/cap1/one/rank0; tar czf $OUT/one.tgz -C /tmp/cap1 one
