"""Fixtures for the native-tracing tests: a small C library and a driver program, built with the
system C compiler, run as real processes that the probe engine attaches to."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))

LIB = r"""
#include <stdint.h>
static char mem[64];
uint64_t nat_add(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e, uint64_t f, uint64_t g)
{ return a + b + c + d + e + f + g; }
int nat_alloc(void **out, uint64_t n) { *out = mem + (n % 64); return 0; }
int nat_fail(void **out) { (void) out; return 7; }
"""
LATE = r"""
#include <stdint.h>
uint64_t late_mul(uint64_t a, uint64_t b) { return a * b; }
"""
DRIVER = r"""
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
uint64_t nat_add(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);
int nat_alloc(void **, uint64_t);
int nat_fail(void **);
/* Commands on stdin, one a line: "add N" (N calls of nat_add and nat_alloc, one nat_fail),
   "late PATH N" (dlopen PATH, N calls of late_mul). Each answers "done <sum>". */
int main(void) {
  char line[4096]; uint64_t s = 0;
  printf("ready\n"); fflush(stdout);
  while (fgets(line, sizeof line, stdin)) {
    if (!strncmp(line, "add ", 4)) {
      long n = atol(line + 4);
      for (long i = 0; i < n; i++) { void *p; s += nat_add(i, 1, 2, 3, 4, 5, 6); nat_alloc(&p, (uint64_t) i); }
      void *q = 0; nat_fail(&q);
    } else if (!strncmp(line, "late ", 5)) {
      char path[4000]; long n = 0;
      if (sscanf(line + 5, "%3999s %ld", path, &n) != 2) continue;
      void *h = dlopen(path, RTLD_NOW);
      if (!h) { printf("error %s\n", dlerror()); fflush(stdout); continue; }
      uint64_t (*mul)(uint64_t, uint64_t) = (uint64_t (*)(uint64_t, uint64_t)) dlsym(h, "late_mul");
      for (long i = 0; i < n; i++) s += mul((uint64_t) i, 3);
    }
    printf("done %lu\n", (unsigned long) s); fflush(stdout);
  }
  return 0;
}
"""


@pytest.fixture(scope="session")
def native_bin(tmp_path_factory) -> dict[str, Path]:
    """{"lib", "late", "driver"}: the C library, a library loaded later, and the driver."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) on this machine")
    d = tmp_path_factory.mktemp("native")
    (d / "lib.c").write_text(LIB)
    (d / "late.c").write_text(LATE)
    (d / "driver.c").write_text(DRIVER)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "libnat.so"), str(d / "lib.c")], check=True)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "liblate.so"), str(d / "late.c")], check=True)
    subprocess.run([cc, "-O1", "-o", str(d / "driver"), str(d / "driver.c"), f"-L{d}", "-lnat",
                    f"-Wl,-rpath,{d}", "-ldl"], check=True)
    return {"lib": d / "libnat.so", "late": d / "liblate.so", "driver": d / "driver"}


class Driver:
    """The driver process: send a command, wait (bounded) for its answer."""

    def __init__(self, exe: Path) -> None:
        self.p = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.readline(30) == "ready"

    @property
    def pid(self) -> int:
        return self.p.pid

    def readline(self, timeout: float) -> str:
        import select

        assert self.p.stdout is not None
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        assert r, f"driver did not answer in {timeout} s"
        return self.p.stdout.readline().strip()

    def cmd(self, line: str, timeout: float = 60) -> str:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.readline(timeout)

    def close(self) -> None:
        if self.p.poll() is None:
            assert self.p.stdin is not None
            self.p.stdin.close()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=10)


@pytest.fixture
def driver(native_bin):
    d = Driver(native_bin["driver"])
    yield d
    d.close()


@pytest.fixture
def rt():
    """A private, short agent runtime folder (Unix socket paths must stay under 108 bytes)."""
    import tempfile

    d = tempfile.mkdtemp(prefix="aip-rt-")
    yield d
    shutil.rmtree(d, ignore_errors=True)
