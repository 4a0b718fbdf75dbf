"""`aiprof ui` in a real browser: overview load time and timeline pan/zoom frame time.

Two captures:

* ``--trace-mb N`` (issue 17's case): a Kineto JSON of about N MB made by replicating the
  profiled steps of a real H200 GPT-2 trace (bench/ingest.py's ``generate``: every copy shifted
  past the previous one, with fresh ids), ingested once into its store (what `aiprof ui` does the
  first time; timed and reported, not part of the figures below);
* ``--events N`` (default): bench/ui_timeline.py's synthetic rank of N events (ops, one runtime
  launch per op, kernels on 4 streams, 100 steps), to load the timeline's level-of-detail path.

The app `aiprof ui` serves runs on uvicorn at 127.0.0.1 and Debian's headless Chromium (driven
by Playwright) opens it at a 1900 px wide window.

**Overview**: ``--overview-loads`` page loads of ``#/overview``, each in a fresh browser context
(nothing cached), timed in the page from navigation start to the first paint after the page
says it rendered (``window.__aiprof.readyAt``, then two animation frames): the first load
includes the analysis (`build_report`, as when `aiprof ui` has just started), the others reuse
it (the app keeps it, like a user coming back).

**Timeline**: 100 scripted interactions after 5 warm-up ones: wheel zoom at random points,
`w`/`s`, `a`/`d`, `f` when zoomed below 20 µs. Each is timed in the page from the input (the
timeline's S.inputT, set by the wheel/key handler) to the end of the first canvas redraw with the
window the server computed for it (S.lastFrame.done): the front end's 25 ms debounce, the HTTP
window/counter requests, JSON parsing and drawing; the compositor's work after the draw call is
not included (the Playwright-side figure bounds it from above).

    .venv/bin/python bench/ui_timeline_browser.py --trace-mb 100
    .venv/bin/python bench/ui_timeline_browser.py --traces tests/data/ddp2_slow1_rank*.json.gz
    .venv/bin/python bench/ui_timeline_browser.py [--events 10000000] [--interactions 100]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ui_timeline import stats, synthetic_rank

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ROOT = Path(__file__).resolve().parents[1]
# in the page: first paint after the page said it rendered
PAINTED = ("() => new Promise((res) => requestAnimationFrame(() => requestAnimationFrame(() => "
           "res({ ready: window.__aiprof.readyAt, painted: performance.now() }))))")


def _serve(data):
    import uvicorn

    from aiprof.server.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(data), host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.02)
    return server, th, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/"


def _capture(args):
    """(capture, report or None, description) for the chosen source."""
    from aiprof.trace.store import Capture, open_capture

    if args.traces:
        tmp = Path(args.dir) / "ui_traces"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for t in args.traces:  # a copy: ingest writes its store beside the trace
            shutil.copy(t, tmp / Path(t).name)
        cap = open_capture(sorted(str(p) for p in tmp.iterdir()), show_progress=False)
        print(f"{len(cap.ranks)} rank(s) from {', '.join(args.traces)}", flush=True)
        return cap, None, None
    if args.trace_mb:
        from ingest import generate

        d = Path(args.dir)
        d.mkdir(parents=True, exist_ok=True)
        trace = d / f"ui_{args.trace_mb}mb.json"
        if not trace.exists():
            t = time.perf_counter()
            info = generate(trace, args.trace_mb)
            print(f"generated {trace}: {info['bytes'] / 1e6:,.0f} MB, {info['events']:,} events "
                  f"({info['copies']} copies of the real trace's steps) in {time.perf_counter() - t:.1f} s", flush=True)
        shutil.rmtree(str(trace) + ".aiprof", ignore_errors=True)
        t = time.perf_counter()
        cap = open_capture([str(trace)], show_progress=False)
        print(f"ingested once into its store in {time.perf_counter() - t:.1f} s "
              f"({trace.stat().st_size / 1e6:,.0f} MB of JSON; rows {cap.ranks[0].meta['rows']})", flush=True)
        cap = open_capture([str(trace)], show_progress=False)  # what `aiprof ui` does from then on
        return cap, None, trace
    t = time.perf_counter()
    rt = synthetic_rank(args.events)
    print(f"generated {sum(len(rt.table(n)) for n in ('ops', 'runtime', 'kernels', 'annotations')):,} events "
          f"in {time.perf_counter() - t:.1f} s", flush=True)
    return Capture([rt]), "build", None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace-mb", type=int, default=0, help="a Kineto JSON of this size from the real GPT-2 steps")
    ap.add_argument("--traces", nargs="+", default=None, help="real trace files instead (e.g. the 2-rank DDP fixture)")
    ap.add_argument("--dir", default=str(ROOT / "bench" / "out"), help="where to write the generated trace")
    ap.add_argument("--events", type=int, default=10_000_000, help="synthetic rank size (without --trace-mb)")
    ap.add_argument("--interactions", type=int, default=100)
    ap.add_argument("--overview-loads", type=int, default=10)
    ap.add_argument("--width", type=int, default=1900, help="browser viewport width (px)")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--screenshot", default=None, help="save the last timeline view as PNG")
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    from aiprof.analysis import timeline
    from aiprof.pipeline import build_report
    from aiprof.server.app import static_built
    from aiprof.server.data import CaptureData

    if not static_built():
        sys.exit("the front end is not built: run `make setup`")
    cap, report, _ = _capture(args)
    rt = cap.ranks[0]
    if report == "build":  # synthetic: its report and index first, as the old figures did
        t = time.perf_counter()
        report = build_report(cap)
        print(f"report built in {time.perf_counter() - t:.1f} s", flush=True)
    data = CaptureData(cap, report=report)
    server, th, url = _serve(data)

    errors: list[str] = []
    watch = lambda pg: (pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None),
                        pg.on("pageerror", lambda e: errors.append(str(e))))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS, headless=True)
        # ---- overview: fresh context per load (no HTTP cache, no JS cache)
        loads = []
        for i in range(args.overview_loads):
            ctx = browser.new_context(viewport={"width": args.width, "height": 1000})
            page = ctx.new_page()
            watch(page)
            t = time.perf_counter()
            page.goto(url + "#/overview")
            page.wait_for_function("() => document.querySelector('#page').dataset.ready === '1'", timeout=600_000)
            f = page.evaluate(PAINTED)
            loads.append((f["painted"], f["ready"], 1000 * (time.perf_counter() - t)))
            ctx.close()
        # ---- timeline
        t = time.perf_counter()
        tls = [timeline.build_index(r) for r in cap.ranks]
        tl = tls[0]
        print(f"LOD index: {sum(x.events for x in tls):,} events in {sum(len(x.lanes) for x in tls)} lanes of "
              f"{len(tls)} rank(s), built in {time.perf_counter() - t:.1f} s", flush=True)
        rng = np.random.default_rng(1)
        lat, fetch, drawn, wall, px = [], [], [], [], set()
        page = browser.new_page(viewport={"width": args.width, "height": 1000})
        watch(page)
        page.goto(url + "#/timeline")
        page.wait_for_function("() => document.querySelector('#page').dataset.ready === '1'", timeout=600_000)
        page.wait_for_function("() => window.__aiprof.timeline.S.lastFrame !== null")
        box = page.locator("#tl-canvas").bounding_box()
        page.focus("#tl-canvas")
        left = 250  # the timeline's label column (LEFT in web/src/pages/timeline.js)
        span_full = tl.end_ns - tl.start_ns
        for i in range(args.interactions + 5):  # the first 5 warm the page up and are not counted
            seq = page.evaluate("() => window.__aiprof.timeline.S.lastFrame.seq")
            v = page.evaluate("() => window.__aiprof.timeline.view")
            x = box["x"] + left + rng.random() * (box["width"] - left - 20)
            page.mouse.move(x, box["y"] + 60)
            r = rng.random()
            t = time.perf_counter()
            if v["t1"] - v["t0"] < 20_000:
                page.keyboard.press("f")  # back to the whole trace
            elif v["t1"] - v["t0"] > 0.9 * span_full or r < 0.4:
                page.mouse.wheel(0, -300)  # zoom in at the pointer
            elif r < 0.55:
                page.keyboard.press("w")
            elif r < 0.65:
                page.keyboard.press("s")
            elif r < 0.8:
                page.keyboard.press("a")
            else:
                page.keyboard.press("d")
            page.wait_for_function(f"() => window.__aiprof.timeline.S.lastFrame.seq > {seq}"
                                   " && window.__aiprof.timeline.S.pending === null", timeout=30_000)
            w = 1000 * (time.perf_counter() - t)
            f = page.evaluate("() => window.__aiprof.timeline.S.lastFrame")
            if i < 5:
                continue
            lat.append(f["done"] - f["input"])
            fetch.append(f["fetched"] - f["input"])
            drawn.append(f["events"])
            wall.append(w)
            px.add(page.evaluate("() => window.__aiprof.timeline.data().px"))
        if args.screenshot:
            page.screenshot(path=args.screenshot)
        browser.close()
    server.should_exit = True
    th.join(5)
    first, rest = loads[0], loads[1:]
    print(f"overview, navigation -> painted: first load (analysis included) {first[0]:.0f} ms "
          f"(page ready {first[1]:.0f} ms; Playwright {first[2]:.0f} ms)")
    if rest:
        print(f"overview, navigation -> painted, report built, fresh browser context each: {stats([x[0] for x in rest])}")
        print(f"  as Playwright sees it (goto + waits): {stats([x[2] for x in rest])}")
    print(f"timeline, input -> canvas redrawn with the new window: {stats(lat)}")
    print(f"  of which input -> window answer parsed (25 ms debounce + HTTP): {stats(fetch)}")
    print(f"  events drawn per view: median {int(np.median(drawn))}, max {max(drawn)}; plot width {sorted(px)} px")
    print(f"  as Playwright sees it (CDP round trips included): {stats(wall)}")
    if errors:
        print(f"console errors: {errors[:5]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
