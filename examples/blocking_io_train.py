"""A CPU training loop that reads every batch with a blocking read() on the training thread.

The data arrives through a named pipe from a producer process that serves one batch every
``--read-ms`` (a stand-in for slow storage: a network filesystem, an object store). The loop
itself has no profiling code. ``aiprof run --what kernels,python,syscalls`` shows the thread
blocked in read() on the pipe, and the root-cause model names it (SYSCALL_BLOCKED).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

PRODUCER = """
import os, sys, time
path, n, size, delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
with open(path, "wb", buffering=0) as f:
    blob = os.urandom(size)
    for _ in range(n):
        time.sleep(delay)   # the storage's latency for one batch
        f.write(blob)
"""


def load_shard(f, size: int) -> torch.Tensor:
    """Read one batch: blocks in read() until the producer has written it."""
    buf = bytearray()
    while len(buf) < size:
        chunk = f.read(size - len(buf))
        if not chunk:
            raise EOFError("producer ended")
        buf += chunk
    return torch.frombuffer(buf, dtype=torch.uint8)[: 64 * 256].float().view(64, 256) / 255.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--read-ms", type=float, default=60.0, help="producer latency per batch")
    ap.add_argument("--batch-bytes", type=int, default=1 << 16)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="aiprof-fifo-")
    path = os.path.join(d, "shard.fifo")
    os.mkfifo(path)
    prod = subprocess.Popen([sys.executable, "-c", PRODUCER, path, str(args.steps), str(args.batch_bytes),
                             str(args.read_ms / 1e3)])
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        with open(path, "rb", buffering=0) as f:
            for _ in range(args.steps):
                x = load_shard(f, args.batch_bytes)
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
    finally:
        prod.wait(timeout=30)
        os.unlink(path)
        os.rmdir(d)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
