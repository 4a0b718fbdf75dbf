#!/usr/bin/env bash
# The v3 diagnosis pairs (issue 28) on a lent 4-GPU machine, as a user would run them:
#   1. each single-GPU pair timed unprofiled, ROUNDS alternating rounds of fault / fix (one process
#      per run), four pairs at a time, one GPU each;
#   2. each variant captured with `aiprof run --skip 10 --iterations 3 --what kernels,python,shapes`
#      (the stall's fault also with --what kernels: no Python stacks);
#   3. the 4-rank jobs (DDP with one rank's sequences twice as long, healthy DDP = its fix, healthy
#      FSDP2) timed and captured the same way under torchrun.
# On fewer GPUs: CASES="gc ckpt" picks single-GPU pairs, NPROC=2 runs the distributed jobs on 2.
# Results: $OUT/times.jsonl (one line per timed run) and $OUT/caps-*.tar (the capture folders,
# split under 15 MB), analysed here by bench/diagnosis/validate_v3.py.
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

# one single-GPU case, on GPU $2: timing rounds, then the captures
pair() {
  local c=$1 g=$2 n; n=$(steps_of "$c")
  for r in $(seq 1 "$ROUNDS"); do
    for v in fault fix; do
      CUDA_VISIBLE_DEVICES=$g python3 $JOB --case "$c" --variant $v --steps "$n" --times $K/times/$c-$v-$r.json \
        > $K/times/$c-$v-$r.log 2>&1 || echo "FAILED timing $c $v $r"
    done
  done
  for v in fault fix; do
    CUDA_VISIBLE_DEVICES=$g python3 -m aiprof run --skip 10 --iterations 3 --what kernels,python,shapes \
      --out $K/caps --capture-id "${c}_$v" -- python3 $JOB --case "$c" --variant $v --steps 6 \
      > $K/caps/${c}_$v.log 2>&1 || echo "FAILED capture $c $v"
  done
  if [ "$c" = stall ]; then
    CUDA_VISIBLE_DEVICES=$g python3 -m aiprof run --skip 10 --iterations 3 --what kernels \
      --out $K/caps --capture-id stall_fault_nostack -- python3 $JOB --case stall --variant fault --steps 6 \
      > $K/caps/stall_fault_nostack.log 2>&1 || echo "FAILED capture stall nostack"
  fi
  say "pair $c done on GPU $g"
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
say "4-rank jobs"
TR="torchrun --standalone --nproc-per-node ${NPROC:-4}"
for r in $(seq 1 "$ROUNDS"); do
  for v in fault fix; do
    $TR $JOB --case ddp_uneven --variant $v --steps 20 --times $K/times/ddp_uneven-$v-$r.json \
      > $K/times/ddp_uneven-$v-$r.log 2>&1 || echo "FAILED timing ddp_uneven $v $r"
  done
done
$TR $JOB --case fsdp_healthy --variant fix --steps 20 --times $K/times/fsdp_healthy-fix-1.json \
  > $K/times/fsdp_healthy-fix-1.log 2>&1 || echo "FAILED timing fsdp"
for spec in ddp_uneven:fault ddp_uneven:fix fsdp_healthy:fix; do
  c=${spec%%:*} v=${spec##*:}
  python3 -m aiprof run --skip 10 --iterations 3 --what kernels,python,shapes --out $K/caps --capture-id "${c}_$v" \
    -- $TR $JOB --case "$c" --variant "$v" --steps 6 > $K/caps/${c}_$v.log 2>&1 || echo "FAILED capture $c $v"
done
say "captured"
fi

cat $K/times/*.json | python3 -c "import sys,json; [print(json.dumps(json.loads(l))) for l in sys.stdin.read().replace('}{','}\n{').splitlines()]" > $OUT/times.jsonl
wc -l $OUT/times.jsonl
tail -n 3 $K/times/*fault-1.log | head -60
for f in $K/caps/*.log; do echo "--- $f"; tail -n 4 "$f"; done
du -sh $K/caps/*/ 2>/dev/null
(cd $K && tar cf - caps | split -b 15m - $OUT/caps-)
ls -la $OUT
say "done"
