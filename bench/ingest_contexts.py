"""The README's Python snippet, run as users run it: a script without a ``__main__`` guard,
``python - < script.py`` and a Jupyter notebook cell; on a trace large enough for parallel ingest.

Before aiprof started its own ingest workers (aiprof.trace.workers), multiprocessing's spawned
workers re-ran such a script (BrokenProcessPool) or could not re-import ``<stdin>``. Each run
here must ingest with the workers (``meta["ingest_workers"]``), run the script's top level
exactly once, and build the report. Prints MB/s of the ingest (``open_capture``) per context::

    python bench/ingest_contexts.py                 # ~200 MB trace, 2 workers
    python bench/ingest_contexts.py --size-mb 300 --workers 4

The runners are also used by tests/trace/test_api_contexts.py on a smaller trace.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The README's lines (``from aiprof... ; cap = open_capture([...]); kernels = ...; report = ...``)
# at top level, with a marker line that counts how often the top level runs.
SNIPPET = """\
import json, time
with open({marker!r}, "a") as _m:
    _m.write("top level ran\\n")
from aiprof.trace.store import open_capture
from aiprof.pipeline import build_report

t0 = time.perf_counter()
cap = open_capture([{trace!r}])
t1 = time.perf_counter()
kernels = cap.ranks[0].kernels            # numpy columns: ts, dur, name, stream, cls, ...
report = build_report(cap)                # plain dict
t2 = time.perf_counter()
print("RESULT " + json.dumps({{"ingest_s": t1 - t0, "report_s": t2 - t1, "kernels": len(kernels),
                              "workers": cap.ranks[0].meta["ingest_workers"], "schema": report["schema"],
                              "steps": len(report["ranks"][0]["steps"])}}))
"""


def _env(cache: str, workers: int) -> dict:
    env = dict(os.environ, AIPROF_CACHE_DIR=cache, AIPROF_INGEST_WORKERS=str(workers), AIPROF_PROGRESS="never")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _result(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"no RESULT line in the output:\n{out[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run_script(trace: Path, work: Path, workers: int = 2, timeout: float = 600) -> dict:
    """A top-level script file, no ``if __name__ == "__main__":`` guard."""
    marker = work / "script.runs"
    script = work / "readme_snippet.py"
    script.write_text(SNIPPET.format(trace=str(trace), marker=str(marker)))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=work, timeout=timeout,
                         env=_env(str(work / "cache-script"), workers), check=False)
    if res.returncode != 0:
        raise RuntimeError(f"script exited {res.returncode}:\n{res.stderr[-3000:]}")
    return {**_result(res.stdout), "top_level_runs": marker.read_text().count("\n"), "stderr": res.stderr}


def run_stdin(trace: Path, work: Path, workers: int = 2, timeout: float = 600) -> dict:
    """``python - < script.py``: the main module is ``<stdin>``, which nothing can re-import."""
    marker = work / "stdin.runs"
    code = SNIPPET.format(trace=str(trace), marker=str(marker))
    res = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, cwd=work, timeout=timeout,
                         env=_env(str(work / "cache-stdin"), workers), check=False)
    if res.returncode != 0:
        raise RuntimeError(f"python - exited {res.returncode}:\n{res.stderr[-3000:]}")
    return {**_result(res.stdout), "top_level_runs": marker.read_text().count("\n"), "stderr": res.stderr}


def run_notebook(trace: Path, work: Path, workers: int = 2, timeout: float = 600) -> dict:
    """A notebook cell executed by a real IPython kernel (nbclient + ipykernel)."""
    import nbclient
    import nbformat

    marker = work / "notebook.runs"
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(SNIPPET.format(trace=str(trace), marker=str(marker))))
    env = _env(str(work / "cache-notebook"), workers)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(work)}})
        client.execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    outputs = nb.cells[0].get("outputs", [])
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")
    errs = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stderr")
    return {**_result(text), "top_level_runs": marker.read_text().count("\n"), "stderr": errs}


RUNNERS = {"script without guard": run_script, "python - < script.py": run_stdin, "Jupyter kernel": run_notebook}


def make_trace(path: Path, size_mb: int) -> int:
    """Write a ~size_mb MB Kineto trace (bench/ingest.py's generator: replicated real H200 steps)."""
    spec = importlib.util.spec_from_file_location("bench_ingest", ROOT / "bench" / "ingest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.generate(path, size_mb)["bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=200, help="size of the generated JSON (default 200)")
    ap.add_argument("--workers", type=int, default=2, help="AIPROF_INGEST_WORKERS for the runs (default 2)")
    ap.add_argument("--dir", default=None, help="where to write the trace (default: a temporary folder)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aiprof-contexts-", dir=args.dir) as d:
        work = Path(d)
        trace = work / f"trace_{args.size_mb}mb.json"
        t = time.perf_counter()
        nbytes = make_trace(trace, args.size_mb)
        mb = nbytes / 1e6
        print(f"generated {trace.name}: {mb:,.0f} MB in {time.perf_counter() - t:.1f} s; "
              f"AIPROF_INGEST_WORKERS={args.workers}; {os.cpu_count()} CPUs", flush=True)
        print(f"{'context':24s} {'ok':>3s} {'workers':>7s} {'top-level runs':>14s} {'ingest s':>8s} {'MB/s':>7s} "
              f"{'report s':>8s} {'kernels':>9s}", flush=True)
        failed = 0
        for name, run in RUNNERS.items():
            sub = work / name.split()[0]
            sub.mkdir()
            try:
                r = run(trace, sub, workers=args.workers)
            except Exception as exc:  # noqa: BLE001 - report and go on with the other contexts
                failed += 1
                print(f"{name:24s} FAILED: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}")
                continue
            ok = r["workers"] == args.workers and r["top_level_runs"] == 1
            failed += not ok
            print(f"{name:24s} {'yes' if ok else 'NO':>3s} {r['workers']:7d} {r['top_level_runs']:14d} "
                  f"{r['ingest_s']:8.2f} {mb / r['ingest_s']:7.1f} {r['report_s']:8.2f} {r['kernels']:9,d}", flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
