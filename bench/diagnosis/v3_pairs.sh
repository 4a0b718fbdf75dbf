#!/usr/bin/env bash
# The v3 diagnosis pairs (issue 28) on a lent 4-GPU machine, as a user would run them:
#   1. each single-GPU pair timed unprofiled, ROUNDS alternating rounds of fault / fix (one process
#      per run), four pairs at a time, one GPU each;
#   2. each variant captured with `aiprof run --skip 10 --iterations 3 --what kernels,python,shapes`
#      (the stall's fault also with --what kernels: no Python stacks);
#   3. the 4-rank jobs (DDP with one rank's sequences twice as long, healthy DDP = its fix, healthy
#      FSDP2) timed and captured the same way under torchrun.
# On fewer GPUs: CASES="gc ckpt" picks single-GPU pairs, NPROC=2 runs the distributed jobs on 2.
# A case written CASE:VARIANT (e.g. ckpt:fix) is only captured, in that variant, not timed
# (stall:nostack: only the capture without Python stacks);
# TIME_SINGLE=0 captures the single-GPU cases without timing them again.
# Results: $OUT/caps-<case>.tar (that case's capture folders, logs and timing runs; split into
# caps-<case>.tar.aa, .ab, ... over 15 MB: `cat caps-X.tar.* | tar xf -`), each written
# as soon as its case is done, so that a call cut off at its limit still brings back the cases it
# finished; the timings, one JSON line per run, are printed at the end (and in the tars).
# A capture whose job has written its trace (meta.json on every rank) but has not exited GRACE s
# later is stopped: SIGABRT first (PYTHONFAULTHANDLER=1: every thread's Python stack into its
# log), then SIGKILL. Seen on 4 H100s (2026-11-26): the captures ckpt_fix, launch_fault and
# fileread_fix wrote a complete capture (meta.json) and then never exited, `aiprof run` waiting in
# Popen.wait on the job; fileread_fault, launch_fix, stall_fault_nostack and the 4-rank ones exited.
#   run: bash bench/diagnosis/v3_pairs.sh        (carry .whl; WHL=.whl/v3 holds msgspec)
set -u
T0=$(date +%s)
say() { echo "== $* ($(( $(date +%s) - T0 )) s)"; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHL:-.whl/v3}"/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD/src:/tmp/site
ROUNDS=${ROUNDS:-3}
# PHASE=single|multi|all: a lent call lasts at most 10 minutes, so the two phases can run apart
PHASE=${PHASE:-all}
JOB=bench/diagnosis/v3_job.py
K=/tmp/v3-$PHASE; rm -rf $K; mkdir -p $K/caps $K/times
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

steps_of() { case $1 in stall) echo 3;; ckpt) echo 8;; *) echo 20;; esac; }

ms_of() { python3 -c "import json,sys; print('%.1f' % json.load(open(sys.argv[1]))['ms_per_step'])" "$1" 2>/dev/null || echo '?'; }
# pack NAME FILES...: $OUT/NAME.tar, or NAME.tar.aa, .ab, ... where it is over 15 MB (a lent call
# brings back at most 8 files of 16 MiB each: the 4-rank FSDP capture with stacks was 18 MB)
pack() {
  local n=$1; shift
  tar cf $OUT/$n.tar "$@"
  if [ "$(stat -c %s $OUT/$n.tar)" -gt $((15 << 20)) ]; then split -b 15m $OUT/$n.tar $OUT/$n.tar. && rm $OUT/$n.tar; fi
}
# cap ID NRANKS LOG CMD...: run an `aiprof run` command in its own process group (see above)
cap() {
  local id=$1 nr=$2 log=$3 pid wd; shift 3
  PYTHONFAULTHANDLER=1 setsid "$@" > "$log" 2>&1 &
  pid=$!
  ( t=0 d=0; while sleep 2; do t=$((t + 2))
      [ "$(ls $K/caps/$id/rank*/meta.json 2>/dev/null | wc -l)" -ge "$nr" ] && d=$((d + 2))
      if [ $d -ge "${GRACE:-20}" ] || [ $t -ge "${CAP_MAX:-300}" ]; then
        echo "HUNG $id: after ${t} s, capture written ${d} s ago and not exited: SIGABRT, SIGKILL" | tee -a "$log"
        # the job(s) first, while `aiprof run` (the group's leader) still copies their stderr to the log
        for p in $(pgrep -g $pid); do [ "$p" != $pid ] && kill -ABRT $p 2>/dev/null; done
        sleep 3; kill -ABRT $pid 2>/dev/null; sleep 2; kill -KILL -- -$pid 2>/dev/null; exit
      fi
    done ) &
  wd=$!
  wait $pid || echo "FAILED capture $id (rc $?)"
  kill $wd 2>/dev/null
}
# the launch case compiles: log recompiles and any 'skipping cudagraphs' (TORCH_LOGS)
tlogs() { [ "$1" = launch ] && echo TORCH_LOGS=recompiles,perf_hints || echo AIPROF_V3=1; }

# one single-GPU case, on GPU $2: timing rounds, then the captures; c:v = capture variant v only
pair() {
  local c=${1%%:*} g=$2 n vs="fault fix" tag=${1/:/_}; n=$(steps_of "$c")
  if [ "$1" != "$c" ]; then vs=${1##*:}; [ "$vs" = nostack ] && vs=""; elif [ "${TIME_SINGLE:-1}" = 1 ]; then
  for r in $(seq 1 "$ROUNDS"); do
    for v in fault fix; do
      env "$(tlogs "$c")" CUDA_VISIBLE_DEVICES=$g python3 $JOB --case "$c" --variant $v --steps "$n" --times $K/times/$c-$v-$r.json \
        > $K/times/$c-$v-$r.log 2>&1 || echo "FAILED timing $c $v $r"
      say "$c $v round $r: $(ms_of $K/times/$c-$v-$r.json) ms/step"
    done
  done
  fi
  for v in $vs; do
    cap "${c}_$v" 1 $K/caps/${c}_$v.log env "$(tlogs "$c")" CUDA_VISIBLE_DEVICES=$g python3 -m aiprof run --skip 10 \
      --iterations 3 --what kernels,python,shapes --out $K/caps --capture-id "${c}_$v" \
      -- python3 $JOB --case "$c" --variant $v --steps 6
    say "captured ${c}_$v: $(tail -n 1 $K/caps/${c}_$v.log)"
  done
  if [ "$c" = stall ]; then
    cap stall_fault_nostack 1 $K/caps/stall_fault_nostack.log env CUDA_VISIBLE_DEVICES=$g python3 -m aiprof run \
      --skip 10 --iterations 3 --what kernels --out $K/caps --capture-id stall_fault_nostack \
      -- python3 $JOB --case stall --variant fault --steps 6
    say "captured stall_fault_nostack: $(tail -n 1 $K/caps/stall_fault_nostack.log)"
  fi
  [ "$c" = launch ] && grep -hE "launch fix|skipping cudagraphs|ecompil" $K/times/launch-fix-*.log $K/caps/launch_fix.log 2>/dev/null | head -20
  (cd $K && pack caps-$tag caps/${c}_* $(ls times/$c-* 2>/dev/null))
  say "pair $1 done on GPU $g"
}

if [ "$PHASE" != multi ]; then
say "single-GPU pairs"
# CASES (default all six) spread over the GPUs there are, one lane of pairs per GPU
NGPU=$(nvidia-smi -L | wc -l)
read -r -a CS <<< "${CASES:-gc healthy ckpt print stall fileread}"
for g in $(seq 0 $((NGPU - 1))); do
  ( for i in "${!CS[@]}"; do [ $((i % NGPU)) -eq "$g" ] && pair "${CS[$i]}" "$g"; done ) &
done
wait
fi

if [ "$PHASE" != single ]; then
say "multi-GPU jobs"
launcher() { echo "env $nenv torchrun --standalone --nproc-per-node $n"; }
# MULTI: the jobs timed (alternating, ROUNDS rounds) and captured (MULTI="": none), CASE:VARIANT each, or
# CASE:VARIANT@B with B sequences per rank for that job alone (its ids get a _bB suffix)
read -r -a MS <<< "${MULTI-ddp_uneven:fault ddp_uneven:fix fsdp_healthy:fix}"
# TIMED: the ones timed (default: all of MULTI); BATCH: sequences per rank (48: GPU-bound)
read -r -a TS <<< "${TIMED:-${MS[*]}}"
# spec CASE:VARIANT[@B][^N] -> c, v, b (the batch flags), n (processes: N, default NPROC) and id
# (the capture's and timings' name); ^1 runs a one-process job (DataParallel) under torchrun
# A trailing ~sockets runs the job with NCCL kept off NVLink and shared memory (its collectives over
# NET/Socket, as between hosts without InfiniBand); its ids get a _sockets suffix
SOCKETS_ENV="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1"
parse() { local s=$1; n=${NPROC:-4}; nenv=""; local sfx=""
  if [ "${s%~sockets}" != "$s" ]; then nenv=$SOCKETS_ENV; sfx=_sockets; s=${s%~sockets}; fi
  if [ "${s#*^}" != "$s" ]; then n=${s##*^}; s=${s%^*}; fi
  c=${s%%:*}; local r=${s#*:}; v=${r%%@*}; id=${c}_$v; b=${BATCH:+--batch $BATCH}
  if [ "$r" != "$v" ]; then b="--batch ${r#*@}"; id=${id}_b${r#*@}; fi; id=$id$sfx; }
timings() {
  for r in $(seq 1 "$ROUNDS"); do
    for spec in "${TS[@]}"; do
      parse "$spec"
      timeout 150 $(launcher) $JOB --case "$c" --variant "$v" --steps 20 $b --times $K/times/$id-$r.json \
        > $K/times/$id-$r.log 2>&1 || { echo "FAILED timing $id $r"; tail -n 5 $K/times/$id-$r.log; }
      say "$id round $r: $(ms_of $K/times/$id-$r.json) ms/step"
    done
  done
}
captures() {
  for spec in "${MS[@]}"; do
    parse "$spec"
    cap "$id" "$n" $K/caps/$id.log python3 -m aiprof run --skip 10 --iterations 3 \
      --what kernels,python,shapes --out $K/caps --capture-id "$id" -- $(launcher) $JOB --case "$c" --variant "$v" --steps 6 $b
    (cd $K && pack caps-$id caps/$id caps/$id.log $(ls times/$id-* 2>/dev/null))
    say "captured $id: $(tail -n 1 $K/caps/$id.log)"
  done
}
# CAPTURE_FIRST=1: the captures before the timings (a call cut off at its limit keeps them)
# WARMUP=1: one untimed run of the first TIMED job first (a call's first run is its slowest: v3b
# ddp_unused, 27.9 against 25.0 ms; the fsdp_reshard capture made first calibrated to 70.1 ms, 59.3 timed)
if [ "${WARMUP:-0}" = 1 ]; then parse "${TS[0]}"; timeout 150 $(launcher) $JOB --case "$c" --variant "$v" --steps 20 $b \
  > $K/times/warmup.log 2>&1; say "warm-up run $id done"; fi
if [ "${CAPTURE_FIRST:-0}" = 1 ]; then captures; timings; else timings; captures; fi
fi

echo "== times (one JSON line per timed run)"
cat $K/times/*.json 2>/dev/null | python3 -c "import sys,json; [print(json.dumps(json.loads(l))) for l in sys.stdin.read().replace('}{','}\n{').splitlines()]"
tail -n 3 $K/times/*fault-1.log | head -60
for f in $K/caps/*.log; do echo "--- $f"; tail -n 4 "$f"; done
du -sh $K/caps/*/ 2>/dev/null
ls -la $OUT
say "done"
