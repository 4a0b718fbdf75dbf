"""A job whose loop calls entry_target.Engine._loop_body, then exits with code 3:
``--new-kwarg`` calls it with the keyword its newer version added. Prints what it computed."""
import sys
import time

import torch

from entry_target import Engine


def main() -> int:
    torch.set_num_threads(1)
    eng, x = Engine(), torch.ones(8, 16)
    kw = {"use_inference_mode": True} if "--new-kwarg" in sys.argv else {}
    total = 0.0
    for _ in range(int(sys.argv[1])):
        total += eng._loop_body(x, **kw)
        time.sleep(0.02)  # the agent wraps the entry from its control thread, polling 20 times a second
    print(f"total {total:.6f}", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
