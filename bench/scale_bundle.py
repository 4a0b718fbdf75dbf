"""Pack what bench/scale.py needs on a machine without internet into .whl/ (git-ignored).

The GPU machines have Python 3.12 with numpy, pyarrow, rich and most of Ray's own needs, but
not Ray, jsonschema (and its three needs), msgspec or isal. Ray's wheel is 79 MB and the working tree
that travels is limited to 64 MiB, so Ray travels as a slimmed tarball of its installed files:
without the Java jar (ray/jars, 33 MB: Java workers), the libraries aiprof does not use (rllib,
tune, train, serve, data, llm), the dashboard's web front end, and with its binaries stripped of
symbols, compressed with xz. The rest travels as wheels. Usage (here, with internet)::

    python3 bench/scale_bundle.py                 # Python 3.12 manylinux x86_64 -> .whl/
    python3 bench/scale_bundle.py --python 3.11   # for this machine (to test the bundle)

and there::

    mkdir -p /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
        --upgrade --target /tmp/site .whl/*.whl && tar -xJf .whl/ray-*-slim-*.tar.xz -C /tmp/site && \\
        export PYTHONPATH=/tmp/site:$PWD/src
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAY = "ray==2.60.0"
# Ray's and aiprof's needs that the GPU image lacks (its package list: device KINDS.md)
WHEELS = ["jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
          "msgspec==0.22.0", "isal==1.9.1",
          "click==8.5.1"]  # `ray start` (bench/scale.py --head), in case the image lacks it
# Parts of Ray that `import ray`, ray.init and remote tasks never load
DROP = ("ray/jars/", "ray/rllib/", "ray/tune/", "ray/train/", "ray/serve/", "ray/data/", "ray/llm/",
        "ray/dashboard/client/")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def download(specs: list[str], dest: Path, python: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + specs, check=True)


def slim_ray(wheel: Path, out: Path) -> None:
    """Ray's installed files minus DROP, binaries stripped, as a .tar.xz to extract into a site dir."""
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                if info.filename.startswith(DROP):
                    continue
                path = z.extract(info, tmp)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(path, mode)
        strip = shutil.which("strip")
        for p in Path(tmp).rglob("*"):
            if strip and p.is_file() and (p.suffix == ".so" or os.access(p, os.X_OK)) and \
                    p.read_bytes()[:4] == b"\x7fELF":
                subprocess.run([strip, "--strip-unneeded", str(p)], check=False)
        with tarfile.open(out, "w:xz", preset=9) as t:
            for p in sorted(Path(tmp).iterdir()):
                t.add(p, arcname=p.name)


def _project(name: str) -> str:
    """A wheel's or requirement's project name, normalised (rpds_py-1.whl, rpds-py==1 -> rpds-py)."""
    base = name.split("==")[0] if "==" in name else name.split("-")[0]  # wheels spell "-" in names "_"
    return base.lower().replace("_", "-")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default="3.12", help="the target machine's Python (default 3.12)")
    ap.add_argument("--dest", default=str(ROOT / ".whl"))
    args = ap.parse_args()
    dest = Path(args.dest)
    dest.mkdir(exist_ok=True)
    tag = "cp" + args.python.replace(".", "")
    with tempfile.TemporaryDirectory() as tmp:
        download([RAY], Path(tmp), args.python)
        wheel = next(Path(tmp).glob("ray-*.whl"))
        out = dest / f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}-slim-{tag}.tar.xz"
        slim_ray(wheel, out)
    have = {_project(p.name) for p in dest.glob("*.whl")}
    want = [w for w in WHEELS if _project(w) not in have]  # one version of each: two stop pip
    if want:
        download(want, dest, args.python)
    total = 0
    for p in sorted(dest.iterdir()):
        total += p.stat().st_size
        print(f"{p.stat().st_size / 2**20:7.1f} MiB  {p.name}")
    print(f"{total / 2**20:7.1f} MiB  in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
