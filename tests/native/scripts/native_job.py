"""A CPU training loop that calls a C library (through ctypes) and reads its batch from a pipe
with a blocking read() on the training thread, for the native-tracing tests.

argv: LIBNAT STEPS. The pipe's writer is a thread that answers each request for a batch
WRITE_MS later (a storage latency), so every read() of the loop waits about that long.
"""
import ctypes
import os
import sys
import threading
import time

import torch

WRITE_MS = 40  # the batch's "storage latency": the training thread waits in read() for it
lib = ctypes.CDLL(sys.argv[1])
lib.nat_add.restype = ctypes.c_uint64
steps = int(sys.argv[2])
r, w = os.pipe()
req_r, req_w = os.pipe()


def writer() -> None:
    while os.read(req_r, 1):
        time.sleep(WRITE_MS / 1e3)
        os.write(w, b"x" * 4096)


threading.Thread(target=writer, daemon=True).start()
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def load_batch() -> torch.Tensor:
    os.write(req_w, b"?")
    data = os.read(r, 4096)  # blocks until the writer delivers
    return torch.full((8, 16), float(len(data)))


for step in range(steps):
    for i in range(5):
        lib.nat_add(step, 1, 2, 3, 4, 5, i)
    x = load_batch()
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
print("job done", flush=True)
