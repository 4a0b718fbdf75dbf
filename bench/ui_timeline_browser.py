"""Timeline pan/zoom response in a real browser on a generated 10 M-event capture.

The capture is bench/ui_timeline.py's synthetic rank (ops, one runtime launch per op, kernels
on 4 streams, 100 steps). Its report and timeline index are built first (what `aiprof ui` does
when the Overview and then the Timeline page open), then the app `aiprof ui` serves runs on
uvicorn at 127.0.0.1 and headless Chromium (Debian's, through Playwright) opens the Timeline.
A scripted user zooms with the wheel at random points and with w/s, pans with a/d, and fits
the whole trace with f when zoomed down to ~20 µs. Each interaction's latency is measured in
the page: from the input (the timeline's S.inputT, set by the wheel/key handler) to the end of
the first canvas redraw with the window the server computed for it (S.lastFrame.done). That
includes the front end's 25 ms debounce, the HTTP window and counter requests, JSON parsing
and drawing; the browser's compositing after the draw call is not included.

    .venv/bin/python bench/ui_timeline_browser.py [--events 10000000] [--interactions 100]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ui_timeline import stats, synthetic_rank

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--interactions", type=int, default=100)
    ap.add_argument("--width", type=int, default=1900, help="browser viewport width (px)")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--screenshot", default=None, help="save the last view as PNG")
    args = ap.parse_args()

    import uvicorn
    from playwright.sync_api import sync_playwright

    from aiprof.analysis import timeline
    from aiprof.analysis.report import build_report
    from aiprof.server.app import create_app, static_built
    from aiprof.server.data import CaptureData
    from aiprof.trace.store import Capture

    if not static_built():
        sys.exit("the front end is not built: run `make setup`")
    t = time.perf_counter()
    rt = synthetic_rank(args.events)
    cap = Capture([rt])
    print(f"generated {sum(len(rt.table(n)) for n in ('ops', 'runtime', 'kernels', 'annotations')):,} events "
          f"in {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    report = build_report(cap)
    print(f"report built in {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    tl = timeline.build_index(rt)
    print(f"LOD index: {tl.events:,} events in {len(tl.lanes)} lanes, built in {time.perf_counter() - t:.1f} s", flush=True)

    data = CaptureData(cap, report=report)
    server = uvicorn.Server(uvicorn.Config(create_app(data), host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/"

    rng = np.random.default_rng(1)
    lat, fetch, drawn, wall, px = [], [], [], [], set()
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": args.width, "height": 1000})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url + "#/timeline")
        page.wait_for_function("() => document.querySelector('#page').dataset.ready === '1'", timeout=600_000)
        page.wait_for_function("() => window.__aiprof.timeline.S.lastFrame !== null")
        box = page.locator("#tl-canvas").bounding_box()
        page.focus("#tl-canvas")
        left = 230  # the timeline's label gutter (LEFT in web/src/pages/timeline.js)
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
            px.add(page.evaluate("() => window.__aiprof.timeline.S.data.px"))
        if args.screenshot:
            page.screenshot(path=args.screenshot)
        browser.close()
    server.should_exit = True
    th.join(5)
    print(f"browser, input -> canvas redrawn with the new window: {stats(lat)}")
    print(f"  of which input -> window answer parsed (25 ms debounce + HTTP): {stats(fetch)}")
    print(f"  events drawn per view: median {int(np.median(drawn))}, max {max(drawn)}; plot width {sorted(px)} px")
    print(f"  as Playwright sees it (CDP round trips included): {stats(wall)}")
    if errors:
        print(f"console errors: {errors[:5]}")
        sys.exit(1)


if __name__ == "__main__":
    main()
