"""`aiprof analyze PATH...`: ingest traces (cached) and print the report."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import sys
import time

from aiprof.cli import gates
from aiprof.cli.inputs import add_capture_option
from aiprof.errors import AiprofError
from aiprof.report import json_report, text
from aiprof.scale import engines
from aiprof.scale.job_report import capture_report
from aiprof.trace.store import find_trace_files, open_capture, progress_wanted


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="analyse traces or a capture directory and print the report",
                       description="Analyse torch.profiler/Kineto traces (.json, .json.gz; one per rank, "
                                   "or a capture directory) and report steps, GPU time breakdown, "
                                   "kernels and the causes of lost time.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace file(s) or capture directory")
    p.add_argument("--json", action="store_true", help="print the JSON report (schema aiprof.report/2) instead of text")
    p.add_argument("--out", metavar="DIR", help="also write report.json and report.txt into DIR")
    p.add_argument("--html", metavar="FILE", help="also write the UI's overview as one self-contained HTML file")
    p.add_argument("--entry", metavar="NAME", help="function/annotation that marks one iteration "
                                                  "(when the trace has no ProfilerStep)")
    p.add_argument("--top", type=int, default=15, help="how many kernels to list (default 15)")
    p.add_argument("--no-cache", action="store_true",
                   help="re-parse and re-analyse: ignore the stores and per-rank results of earlier runs")
    add_capture_option(p)
    p.add_argument("--engine", choices=engines.ENGINES, default="auto",
                   help=f"where the ranks are analysed: local (this process; the same report), "
                        f"ray (rank by rank on Ray), "
                        f"auto (Ray from {engines.RAY_MIN_RANKS} ranks or with --cluster; default)")
    p.add_argument("--cluster", metavar="ADDRESS", help="analyse on this Ray cluster (ray://HOST:PORT; "
                                                       "default: $RAY_ADDRESS, else a local Ray that aiprof starts)")
    p.add_argument("--workers", type=int, metavar="N", help="CPUs of the local Ray aiprof starts (default: all)")
    p.add_argument("--stats", metavar="FILE", help="write the run's cost as JSON: engine, wall time, "
                                                  "driver peak RSS, driver and worker CPU")
    p.add_argument("--fail-on", choices=("high", "medium"), metavar="SEVERITY",
                   help=f"CI gate: exit {gates.GATE_EXIT} (after writing every output) when a cause of this "
                        "severity or worse is found: high, or medium (medium or high) (default: never)")
    p.add_argument("--progress-file", metavar="FILE", help="keep FILE updated with the progress as JSON "
                                                          "(phase, done, total; what `aiprof server` shows)")
    p.set_defaults(func=run)


def _progress():
    """A progress callback drawing one bar per phase on stderr, or None when not wanted (stderr
    not a terminal; $AIPROF_PROGRESS=always|never overrides)."""
    mode = os.environ.get("AIPROF_PROGRESS", "auto")
    if mode == "never" or (mode != "always" and not sys.stderr.isatty()):
        return None, None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    ids: dict[str, int] = {}

    def update(phase: str, done: int, total: int) -> None:
        if phase not in ids:
            ids[phase] = bar.add_task(phase, total=total)
        bar.update(ids[phase], completed=done)

    return bar, update


class ProgressFile:
    """The progress as JSON in a file, replaced whole on each change (a reader never sees half a
    file): ``{"engine", "ranks", "phase", "done", "total", "phases": {phase: [done, total]}}``;
    at most every WRITE_EVERY_S seconds, and always when a phase completes."""

    WRITE_EVERY_S = 0.5  # a thousand tasks finishing need not write a thousand files

    def __init__(self, path: str, engine: str, ranks: int) -> None:
        self.path, self.last = path, 0.0
        self.state: dict = {"engine": engine, "ranks": ranks, "phase": "", "done": 0, "total": 0, "phases": {}}

    def __call__(self, phase: str, done: int, total: int) -> None:
        self.state.update(phase=phase, done=done, total=total)
        self.state["phases"][phase] = [done, total]
        now = time.monotonic()
        if done < total and now - self.last < self.WRITE_EVERY_S:
            return
        self.last = now
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.state, f)
        os.replace(tmp, self.path)


@contextlib.contextmanager
def _stdout_to_stderr():
    """Meanwhile, this process's stdout (sys.stdout and fd 1) goes to stderr: stdout is the report's
    (`--json`), but Ray's driver prints the cluster's events (a task retried after its node was
    lost) on sys.stdout, from a thread of its own (ray._private.worker.listen_error_messages)."""
    sys.stdout.flush()
    saved, saved_fd = sys.stdout, os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout = saved


def _both(*fns):
    fns = [f for f in fns if f is not None]
    if not fns:
        return None
    return lambda *a: [f(*a) for f in fns]


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.html:  # before any work or output: the page is built by the UI's server code
        try:
            from aiprof.server import static_report  # noqa: F401
        except ModuleNotFoundError as exc:
            raise AiprofError(f"--html needs the 'ui' extra ({exc.name} is missing): pip install 'aiprof[ui]'") from None
    files = find_trace_files(args.paths, args.capture)
    kind = engines.choose(args.engine, len(files), args.cluster)
    t = time.perf_counter()
    if kind == "ray" and not engines.ray_available():  # finds it; the engine imports it if a task is to run
        kind = engines.without_ray(len(files), args.cluster)
    driver: dict[str, float] = {"import_ray_s": time.perf_counter() - t}  # the driver's own steps' wall s (--stats)
    pfile = ProgressFile(args.progress_file, kind, len(files)) if args.progress_file else None
    eng = None
    if kind == "local":
        if pfile:
            pfile("ingest", 0, len(files))
        cap = open_capture(files, use_cache=not args.no_cache)
        if pfile:
            pfile("ingest", len(files), len(files))
            pfile("analyse", 0, 1)
        # analysing a large capture takes about as long as ingesting it: the phase gets a bar too
        bar, update = _progress() if progress_wanted(files) else (None, None)
        if bar is not None:
            phase = f"analyse {len(cap.ranks)} rank(s)"
            with bar:
                update(phase, 0, 1)
                report = capture_report(cap, entry=args.entry, top=args.top)
                update(phase, 1, 1)
        else:
            report = capture_report(cap, entry=args.entry, top=args.top)
        if pfile:
            pfile("analyse", 1, 1)
    else:
        from aiprof.scale.job_report import build_job_report

        bar, update = _progress()
        # the embedded Ray starts with the first phase that has tasks to run (none when every
        # result is kept from an earlier run): its start is a phase of the progress too
        on_start = _both(update, pfile) if kind == "ray" else None
        with (_stdout_to_stderr() if kind == "ray" else contextlib.nullcontext()), \
                (bar if bar is not None else contextlib.nullcontext()), \
                engines.make(kind, args.cluster, args.workers, on_start) as eng:
            report = build_job_report(files, eng, args.entry, args.top, not args.no_cache,
                                      _both(update, pfile), driver, reuse=True, keep=True)
            driver["import_ray_s"] += getattr(eng, "import_s", 0.0)
            driver["engine_start_s"] = getattr(eng, "start_s", 0.0)
            t = time.perf_counter()
        driver["engine_stop_s"] = time.perf_counter() - t
        cap = None
    blob = None
    if args.json:  # encoded before the stats are written: its cost is the driver's
        t = time.perf_counter()
        blob = json_report.encode(report)
        driver["encode_s"] = time.perf_counter() - t
    if args.stats:
        _write_stats(args.stats, kind, len(files), time.perf_counter() - t0, eng, driver)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        json_report.write(report, os.path.join(args.out, "report.json"))
        buf = io.StringIO()
        text.render(report, file=buf)
        with open(os.path.join(args.out, "report.txt"), "w") as f:
            f.write(buf.getvalue())
    if args.html:
        from aiprof.server.static_report import write as write_html

        # the overview inlines every rank's timeline: read here from the stores (cached)
        write_html(cap or open_capture(files), args.html, report=report, entry=args.entry)
    if blob is not None:
        sys.stdout.write(blob.decode() + "\n")
    else:
        text.render(report)
        if args.out:
            print(f"\nwrote {os.path.join(args.out, 'report.json')} and report.txt")
        if args.html:
            print(f"wrote {args.html}")
    if args.fail_on:
        why = gates.fail_on_message(report, args.fail_on)
        if why:
            print(f"aiprof: {why}", file=sys.stderr)
            return gates.GATE_EXIT
    return 0


def _write_stats(path: str, kind: str, n: int, wall_s: float, eng, driver: dict[str, float]) -> None:
    """The run's cost (docs/scale.md): the driver's own peak RSS and CPU, the tasks' CPU, the
    wall seconds of the driver's own steps."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    st = eng.stats if eng is not None else None
    out = {"engine": kind, "ranks": n, "wall_s": round(wall_s, 3),
           "driver_peak_rss_mb": round(me.ru_maxrss / 1024.0, 1),  # Linux: kB
           "driver_cpu_s": round(me.ru_utime + me.ru_stime, 3),
           # in this process: the ingest workers it started; on Ray: the tasks' own CPU
           "worker_cpu_s": round(st.worker_cpu_s if st else kids.ru_utime + kids.ru_stime, 3),
           "phases": st.by_phase if st else {},
           # to the microsecond: a step of a small job takes under a millisecond, and one that
           # ran is never written as 0
           "driver": {k: round(v, 6) for k, v in driver.items()}}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
