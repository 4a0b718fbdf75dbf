import time
def inner(n):
    s = 0
    for i in range(n): s += i * i
    return s
def outer():
    t = time.time()
    while time.time() - t < 1.5:
        inner(20000); time.sleep(0.001)
outer()
