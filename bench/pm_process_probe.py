"""Can CUPTI PM sampling run in a process of its own, beside the job that uses the GPU?

Issue 33: in the job's process a second PM session after Kineto finalised CUPTI fails
(cuptiPmSamplingGetCounterAvailability: CUPTI_ERROR_UNKNOWN, bench/pm_repeat.sh). A sampler
process per GPU would keep its own CUPTI for the whole job. This probe runs the sampler in this
process (no torch, no CUDA context of its own) for ``--windows`` windows of ``--seconds``, each a
new PM session, while another process trains on the same GPU, and prints per window the rows,
the achieved gap and the mean of each counter, so that a busy GPU shows (SM active > 0).

    python bench/pm_process_probe.py --device 0 --windows 3 --seconds 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between windows")
    ap.add_argument("--cuda-context", action="store_true", help="create a CUDA context first (torch)")
    args = ap.parse_args()
    import numpy as np

    if args.cuda_context:
        import torch

        torch.zeros(1, device=f"cuda:{args.device}")
    from aiprof.agent.pmsampling import PmSampler

    for w in range(args.windows):
        t0 = time.perf_counter()
        try:
            pm = PmSampler(args.device, 100)
            setup = time.perf_counter() - t0
            pm.start()
            time.sleep(args.seconds)
            got = pm.stop()
        except Exception as exc:  # noqa: BLE001 (the probe's answer)
            print(json.dumps({"window": w, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            time.sleep(args.pause)
            continue
        gaps = np.diff(got.t0.astype(np.int64)) / 1e3 if len(got.t0) > 1 else np.zeros(1)
        means = {c: round(float(got.values[:, j].mean()), 3) for j, c in enumerate(got.columns)} if len(got.t0) else {}
        print(json.dumps({"window": w, "setup_s": round(setup, 3), "rows": len(got.t0),
                          "gap_median_us": float(np.median(gaps)), "gap_p99_us": float(np.percentile(gaps, 99)),
                          "reset": pm.reset, "means": means}), flush=True)
        time.sleep(args.pause)
    return 0


if __name__ == "__main__":
    sys.exit(main())
