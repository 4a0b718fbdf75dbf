"""A small MLP trained on the CPU with autograd's anomaly detection left on: ANOMALY_MODE's pair,
small enough for a 2-core machine. No profiling code, like a user's script.

    aiprof run --skip 20 --iterations 3 --what python --out OUT --capture-id fault \\
        -- python bench/diagnosis/cpu_anomaly.py --anomaly --seconds 6
    (the same without --anomaly: the fix)
    python bench/diagnosis/cpu_anomaly.py --anomaly --steps 60      (unprofiled: ms per step)

``torch.autograd.set_detect_anomaly(True)``: every forward op records its Python stack and every
backward output is checked for NaN (isnan(...)._is_any_true().item()).
"""
from __future__ import annotations

import torch
from cpu_job import options, train
from torch import nn

WIDTH = 256
LAYERS = 6
BATCH = 64


def main() -> int:
    args = options(__doc__, "--anomaly", "anomaly detection on").parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(LAYERS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH)
    if args.anomaly:
        torch.autograd.set_detect_anomaly(True)

    def step() -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return train(step, args)


if __name__ == "__main__":
    raise SystemExit(main())
