"""Step time before and after one torch.profiler capture, without aiprof (needs a GPU).

    python bench/cupti_after.py none                    # no capture: the drift of the job itself
    python bench/cupti_after.py prof                    # one capture, TEARDOWN_CUPTI as the job has it
    TEARDOWN_CUPTI=1 python bench/cupti_after.py prof   # CUPTI detached at stop (what the agent sets)

GPT-2 124M (transformers, random weights), bf16 autocast, fused AdamW, batch 8 x 512, one GPU:
30 warm-up steps, 150 timed, a 5-step torch.profiler capture (CPU + CUDA), 300 timed; prints the
medians and their ratio. Figures: docs/capture.md, "After a capture".
"""
from __future__ import annotations

import os
import statistics as st
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

WARMUP, BEFORE, CAPTURED, AFTER, SETTLE = 30, 150, 5, 300, 20  # steps; SETTLE: left out after the capture


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "prof"
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config()).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, 50257, (8, 512), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", torch.bfloat16):
            loss = m(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(n: int) -> list[float]:
        out = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            out.append((time.perf_counter() - t) * 1e3)
        return out

    timed(WARMUP)
    before = st.median(timed(BEFORE))
    if mode != "none":
        p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
        p.start()
        for _ in range(CAPTURED):
            step()
        p.stop()
    after = st.median(timed(AFTER)[SETTLE:])
    print(f"{mode:10s} TEARDOWN_CUPTI={os.environ.get('TEARDOWN_CUPTI')} before {before:.2f} ms  after {after:.2f} ms  "
          f"ratio {after / before:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
