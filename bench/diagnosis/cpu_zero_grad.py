"""A wide MLP trained on the CPU whose gradients are zeroed instead of set to None:
ZEROED_GRADS's pair, small enough for a 2-core machine. No profiling code, like a user's script.

    aiprof run --skip 20 --iterations 3 --what python --out OUT --capture-id fault \\
        -- python bench/diagnosis/cpu_zero_grad.py --fault --seconds 6
    (the same without --fault: the fix; --accum 2: two backward passes per step)
    python bench/diagnosis/cpu_zero_grad.py --fault --steps 60      (unprofiled: ms per step)

``optimizer.zero_grad(set_to_none=False)`` writes zeros into every gradient each step, and the
next backward then adds into them (``AccumulateGrad`` -> ``aten::add_``) instead of taking its
result as the gradient. With ``set_to_none=True`` (PyTorch's default since 2.0) neither runs.
Wide layers and a small batch make the gradients' memory traffic a visible share of the step.
"""
from __future__ import annotations

import torch
from cpu_job import options, train
from torch import nn

WIDTH = 1024
LAYERS = 6
BATCH = 8


def main() -> int:
    ap = options(__doc__, "--fault", "zero_grad(set_to_none=False)")
    ap.add_argument("--accum", type=int, default=1, help="backward passes per step (gradient accumulation)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH)

    def step() -> None:
        opt.zero_grad(set_to_none=not args.fault)
        for _ in range(args.accum):  # the later passes add into the first one's gradients either way
            loss = model(x).square().mean()
            loss.backward()
        opt.step()
    return train(step, args)


if __name__ == "__main__":
    raise SystemExit(main())
