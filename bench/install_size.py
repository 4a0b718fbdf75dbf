"""What `pip install aiprof` puts on disk, with and without its extras (docs/install.md).

    python -m pip wheel --no-deps -w dist .        # builds the web UI too (node 20 + npm)
    python bench/install_size.py dist/aiprof-0.1.0-py3-none-any.whl [--extras ,ui,scale]

For each extras set: a fresh venv (this Python's `-m venv`), `pip install WHEEL[extras]` from the
configured indexes, then the disk usage of its site-packages (as `du` counts it: allocated blocks,
hard links once) minus that of an empty venv's, and the largest packages in it. The venvs are
temporary and removed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MiB = 1024 * 1024
TOP_SHOWN = 6  # largest top-level entries of site-packages listed per install
PIP_TIMEOUT_S = 1800  # one install; Ray's wheel alone is ~70 MB to fetch on a cold cache


def du(path: Path) -> int:
    """Bytes allocated under ``path``, like `du -s --block-size=1` (each inode once)."""
    seen, total = set(), 0
    for d, dirs, files in os.walk(path):
        for name in dirs + files:
            st = os.lstat(os.path.join(d, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def site_packages(venv: Path) -> Path:
    (sp,) = venv.glob("lib/python*/site-packages")
    return sp


def make_venv(root: Path, env: dict) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, env=env, timeout=PIP_TIMEOUT_S)
    return root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path, help="the aiprof wheel to install")
    ap.add_argument("--extras", default=",ui,scale",
                    help="comma-separated extras sets to measure, '' = none (default ',ui,scale')")
    args = ap.parse_args(argv)
    if not args.wheel.is_file() or not zipfile.is_zipfile(args.wheel) or args.wheel.suffix != ".whl":
        print(f"install_size: {args.wheel} is not a wheel file", file=sys.stderr)
        return 2
    # nothing of a checkout or of this venv on the installs' path
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    with tempfile.TemporaryDirectory(prefix="aiprof-size-") as tmp:
        empty_sp = site_packages(make_venv(Path(tmp) / "empty", env))
        empty, bundled = du(empty_sp), {p.name for p in empty_sp.iterdir()}  # pip (+ setuptools before 3.12)
        print(f"python {sys.version.split()[0]}; empty venv's site-packages: {empty / MiB:.1f} MiB (subtracted)")
        for extras in args.extras.split(","):
            spec = f"{args.wheel.resolve()}[{extras}]" if extras else str(args.wheel.resolve())
            venv = make_venv(Path(tmp) / f"v-{extras or 'base'}", env)
            r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", spec],
                               capture_output=True, text=True, env=env, timeout=PIP_TIMEOUT_S)
            if r.returncode != 0:
                print(f"install_size: pip install {spec} failed (exit {r.returncode}):\n{r.stderr[-3000:]}",
                      file=sys.stderr)
                return 1
            sp = site_packages(venv)
            sizes = sorted(((du(p), p.name) for p in sp.iterdir()
                            if not p.name.endswith(".dist-info") and p.name not in bundled),
                           reverse=True)
            total = du(sp) - empty
            top = ", ".join(f"{n} {s / MiB:.1f}" for s, n in sizes[:TOP_SHOWN])
            label = f"aiprof[{extras}]" if extras else "aiprof"
            print(f"{label}: {total / MiB:.1f} MiB installed  (largest, MiB: {top})", flush=True)
            freeze = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze", "--all"], capture_output=True,
                                    text=True, env=env, timeout=PIP_TIMEOUT_S).stdout.splitlines()
            print(f"  resolved: {' '.join(f for f in freeze if not f.startswith('aiprof'))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
