# Sourced by the bench/x2_*.sh device scripts (two NVLink GPUs): timing, NCCL's multicast off
# (the lent machines require it), the carried wheels (WHL, default .whl/x2: msgspec, frida)
# installed into /tmp/site, aiprof from the working tree, results kept under $K.
set -u
T0=$(date +%s)
say() { echo "== $* ($(( $(date +%s) - T0 )) s)"; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHL:-.whl/x2}"/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD/src:/tmp/site
K=/tmp/keep; mkdir -p $K
