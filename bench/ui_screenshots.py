"""The screenshots of docs/ui.md, taken in Debian's headless Chromium from the real fixtures.

    .venv/bin/python bench/ui_screenshots.py [--out docs/img]

Each capture is copied to a temporary folder first (ingest writes its store beside a trace).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
TL = "window.__aiprof.timeline"


def _serve(paths: list[Path]):
    import uvicorn

    from aiprof.server.app import create_app
    from aiprof.server.data import CaptureData
    from aiprof.trace.store import open_capture

    data = CaptureData(open_capture([str(p) for p in paths], show_progress=False))
    data.report()
    server = uvicorn.Server(uvicorn.Config(create_app(data), host="127.0.0.1", port=0, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.02)
    return server, data, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/"


def _pm_capture(root: Path) -> Path:
    """A capture of the recorded PM samples, as tests/analysis/test_counters.py builds it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pm_capture", ROOT / "tests" / "analysis" / "test_counters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cap, _ = mod.make_capture(root, mod._rec())
    return cap


def _open(page, url: str, route: str) -> None:
    page.goto(url + "#/" + route)
    page.wait_for_function(f"() => document.querySelector('#page').dataset.ready === '1'"
                           f" && document.querySelector('#page').dataset.page === '{route.split('?')[0]}'", timeout=120_000)
    page.wait_for_timeout(400)


def _settle(page) -> None:
    page.wait_for_function(f"() => {TL}.S.pending === null")
    page.wait_for_timeout(300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--only", choices=["all", "pm"], default="all", help="pm: only the GPU-counters timeline")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    tmp = Path(tempfile.mkdtemp(prefix="aiprof-shots-"))
    copies = {}
    for name, files in (("ddp2", ["ddp2_slow1_rank0.json.gz", "ddp2_slow1_rank1.json.gz"]),
                        ("gpt2", ["gpt2_train_stall.json.gz"])):
        d = tmp / name
        d.mkdir()
        for f in files:
            shutil.copy(DATA / f, d / f)
        copies[name] = sorted(d.iterdir())
    shutil.copytree(DATA / "ddp4_hw", tmp / "ddp4_hw")
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS, headless=True)

        def page(width=1500, height=1000):
            pg = browser.new_page(viewport={"width": width, "height": height})
            pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            pg.on("pageerror", lambda e: errors.append(str(e)))
            return pg

        # --- CUPTI PM samples recorded on an H100 (tests/data/pm): the GPU counters on the timeline
        server, data, url = _serve([_pm_capture(tmp / "pm")])
        pg = page(1500, 800)
        _open(pg, url, "timeline")
        for lane in data.index(data.rank(0)).lanes:
            if lane.group == "host":
                pg.evaluate(f"() => {TL}.toggle('r0:p{lane.proc}:t{lane.thread}', false)")
        pg.evaluate(f"() => {TL}.toggle('r0:pm', true)")
        _settle(pg)
        pg.screenshot(path=str(out / "ui_timeline_pm.png"))
        pg.close()
        server.should_exit = True
        if args.only == "pm":
            browser.close()
            shutil.rmtree(tmp, ignore_errors=True)
            return

        # --- the real 2-rank DDP capture: dashboard, ranks, the 2-rank timeline
        server, data, url = _serve(copies["ddp2"])
        pg = page()
        _open(pg, url, "overview")
        pg.screenshot(path=str(out / "ui_overview_ddp.png"), full_page=True)
        _open(pg, url, "ranks")
        pg.screenshot(path=str(out / "ui_ranks_ddp.png"), full_page=True)
        pg.close()
        pg = page(1700, 1000)
        _open(pg, url, "timeline")
        for r in (0, 1):  # host threads closed (one row each), so that both ranks' GPUs fit
            for lane in data.index(data.rank(r)).lanes:
                if lane.group == "host":
                    pg.evaluate(f"() => {TL}.toggle('r{r}:p{lane.proc}:t{lane.thread}', false)")
        m = data.matched()
        j = int(m.caused_ns.argmax())  # the collective rank 1 was latest for
        ev = next(c for c in data.collectives(0, 1e13, 2000)["collectives"] if c["id"] == j)
        e0 = next(p for p in ev["ranks"] if p["rank"] == 0)["event"]
        pg.evaluate(f"() => {TL}.select(0, '{e0['source']}', {e0['row']})")
        a = min(p["start"] for p in ev["ranks"])
        pg.evaluate(f"() => {TL}.setView({a - 12_000_000}, {a + 18_000_000})")
        _settle(pg)
        pg.screenshot(path=str(out / "ui_timeline_ddp2.png"))
        pg.close()
        server.should_exit = True

        # --- GPT-2 on one H200: dashboard, a kernel with its launch and op on the timeline
        server, data, url = _serve(copies["gpt2"])
        pg = page()
        _open(pg, url, "overview")
        pg.screenshot(path=str(out / "ui_overview.png"), full_page=True)
        _open(pg, url, "timeline")
        pg.fill("#tl-search", "cutlass_75_tensorop_bf16_s1688gemm_bf16_128x128_tn")
        pg.press("#tl-search", "Enter")
        pg.wait_for_selector("#tl-op")
        _settle(pg)
        pg.screenshot(path=str(out / "ui_timeline_kernel.png"))
        pg.close()
        server.should_exit = True

        # --- 4 H200s with NVML samples: the Memory page
        server, data, url = _serve([tmp / "ddp4_hw"])
        pg = page()
        _open(pg, url, "memory?rank=2")
        pg.screenshot(path=str(out / "ui_memory_nvml.png"), full_page=True)
        pg.close()
        server.should_exit = True
        browser.close()
    shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        sys.exit(f"console errors: {errors[:5]}")
    print(f"wrote {', '.join(p.name for p in sorted(out.glob('ui_*.png')))} in {out}")


if __name__ == "__main__":
    main()
