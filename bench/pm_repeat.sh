#!/bin/bash
# Issue 33: PM sampling on every rank, capture after capture, in one job. A DDP GPT-2 job of
# NPROC ranks runs under `aiprof run` (no capture options: the agents wait); `aiprof trigger`
# then asks for CAPTURES captures of ITERS iterations each, one after the other, with
# `--what kernels,hw` (PM at 100 µs: the default, or --hw-pm-interval-us 100 where it is not).
# Per capture and rank: PM ok, samples, median/p99 gap, set-up ms, whether the first recorded
# step had samples, CUPTI teardown; per run: the job's exit status and any crash. RUNS jobs.
# Each run's summary is appended to $OUT/summary.txt as it ends (a run cut by a time limit keeps
# the earlier ones).
# Usage: WHL=.whl NPROC=4 CAPTURES=3 CAPTURES1=10 ITERS=5 RUNS=1 [JOBENV="..."] bash bench/pm_repeat.sh
. "$(dirname "$0")/x2_common.sh"
NPROC=${NPROC:-4}; CAPTURES=${CAPTURES:-10}; ITERS=${ITERS:-5}; RUNS=${RUNS:-1}; JOBENV=${JOBENV:-}
CAPTURES1=${CAPTURES1:-$CAPTURES}  # the first run's captures (the others': CAPTURES)
say "GPUs"; nvidia-smi --query-gpu=index,name --format=csv,noheader | tr '\n' ';'; echo
pm_summary() {  # capture dir
  python3 - "$1" <<'PY'
import json, sys, glob, os
for meta in sorted(glob.glob(os.path.join(sys.argv[1], "*", "rank*", "meta.json"))):
    m = json.load(open(meta)); pm = (m.get("hw") or {}).get("pm") or {}
    cap = meta.split("/")[-3]; r = meta.split("/")[-2]
    gap = pm.get("gap_us") or {}
    # PM running this long before the recording started (> 0: the first recorded step has samples)
    lead = round((m["started_unix_ns"] - pm["started_unix_ns"]) / 1e6, 1) if pm.get("started_unix_ns") and m.get("started_unix_ns") else None
    st = m["steps"]["captured"]
    print(f"{cap:>4} {r:>5} steps={st[0] if st else None}..{st[-1] if st else None} ok={pm.get('ok')} rows={pm.get('rows')} gap_med={gap.get('median')} gap_p99={gap.get('p99')} "
          f"prewarm_s={pm.get('prewarm_s')} setup_ms={pm.get('setup_ms')} pm_lead_ms={lead} delayed={m.get('start_delayed')} sampler_cpu_s={((pm.get('stats') or {}).get('sampler_process') or {}).get('cpu_s')} parts={pm.get('setup_parts_ms')} "
          f"teardown={(m.get('cupti_teardown') or {}).get('teardown')} err={str(pm.get('error'))[:100]} errors={m.get('errors')}")
PY
}
for run in $(seq 1 $RUNS); do
  n_caps=$CAPTURES; [ "$run" = 1 ] && n_caps=$CAPTURES1
  # seconds of training: the captures fit in it (a capture with PM takes ~8 s: a 4 s lead, 5 steps, the export)
  SECONDS_JOB=${SECONDS_JOB_FIXED:-$((15 + n_caps * 9))}
  say "run $run: $NPROC ranks, $n_caps captures of $ITERS iterations"
  rm -rf /tmp/cap; mkdir -p /tmp/cap
  env $JOBENV timeout $((SECONDS_JOB + 150)) python3 -m aiprof run --out /tmp/cap -- \
    python3 -m torch.distributed.run --nproc_per_node $NPROC --master_port $((29700 + run)) examples/ddp_gpt2.py \
    --seconds $SECONDS_JOB --step-times $K/r${run}_steps{rank}.log --buckets /dev/null > $K/r$run.log 2>&1 &
  JOB=$!
  # the job trains (20 steps on rank 0: past model build, NCCL set-up, the first slow steps)
  for i in $(seq 1 120); do sleep 1; [ "$(wc -l < $K/r${run}_steps0.log 2>/dev/null || echo 0)" -ge 20 ] && break; done
  echo "training after $i s"
  for c in $(seq 1 $n_caps); do
    timeout 90 python3 -m aiprof trigger -n $ITERS --what kernels,hw ${PMOPT:-} --out /tmp/cap --capture-id c$c --timeout 60 > $K/r${run}_t$c.log 2>&1
    echo "capture c$c rc=$? ($(( $(date +%s) - T0 )) s) $(grep -c 'failed' $K/r${run}_t$c.log) failed"
  done
  wait $JOB; rc=$?
  { echo "run $run job rc=$rc"
    grep -E "SIGSEGV|Segmentation|exitcode|Traceback|aiprof: (error|warning)" $K/r$run.log | head -5
    [ "$rc" = 0 ] || { echo "-- the job's last lines:"; grep -v "^USDT" $K/r$run.log | tail -30 | cut -c1-300; }
    pm_summary /tmp/cap; } | tee -a $OUT/summary.txt
  if [ "$run" = 1 ]; then
    last=${ANALYZE:-$(ls /tmp/cap | sort -V | tail -1)}  # the capture analysed: by default the job's last
    say "aiprof analyze of capture $last (every rank)"
    python3 -m aiprof analyze /tmp/cap/$last --no-cache > $OUT/analyze_$last.txt 2>&1; echo "analyze rc=$?"
    grep -B1 -A12 "GPU counters\|Collectives ·" $OUT/analyze_$last.txt | cut -c1-200 | head -60
  fi
done
(cd /tmp && tar czf $OUT/pm_repeat_logs.tgz keep 2>/dev/null); say done
