"""Names from a trace are text on every page of the UI (issue 31, item 2): a real trace whose
kernel, op, Python frame, module, annotation, process, thread and device names are XSS payloads
(tests/hostile_trace.py), served by the real app and driven in headless Chromium with
``alert``/``confirm``/``prompt`` hooked. Every page is opened, every table's name cells hovered
(Tabulator tooltips), the kernel charts' tooltips shown, the timeline searched and the flame
graph hovered; no payload may run or become an element, and each must read as the text it is."""
from __future__ import annotations

import re

import pytest

from aiprof.trace.store import open_capture
from tests import hostile_trace as H
from tests.ui.conftest import _serve, open_page

PAGES = ["overview", "steps", "tables", "ranks", "timeline", "flame", "memory", "serving"]

# in every frame, before the page's own scripts: a payload that runs records itself here
HOOK = """
window.__alerts = [];
for (const k of ['alert', 'confirm', 'prompt']) window[k] = (m) => { window.__alerts.push(k + ': ' + String(m)); };
"""

# elements or attributes that only a name parsed as markup would have made (a script element of a
# payload holds just its alert call; the static report's data script holds them as strings)
INJECTED = """() => [...document.querySelectorAll('img[src="x"], svg[onload], [onerror], [onload], a[href^="javascript:"]')]
  .map((e) => e.outerHTML).concat([...document.querySelectorAll('script:not([src])')]
  .filter((s) => s.textContent.trim().startsWith('alert(')).map((s) => s.outerHTML))"""


@pytest.fixture(scope="module")
def hostile_app(tmp_path_factory):
    path = H.write(tmp_path_factory.mktemp("hostile") / "hostile.json.gz", H.XSS)
    server, th, s = _serve([path])
    yield s
    server.should_exit = True
    th.join(10)


@pytest.fixture
def hooked(page):
    """The test's tab with the hook installed (every frame, every navigation) and real dialogs
    recorded too, should anything reach the browser's own alert."""
    page.add_init_script(HOOK)
    page.dialogs = []
    page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))
    return page


def _clean(page) -> None:
    """No payload ran, in the page or any frame, and none became an element."""
    assert not page.dialogs, page.dialogs
    for fr in page.frames:
        assert fr.evaluate("() => window.__alerts || []") == [], fr.url
        assert fr.evaluate(INJECTED) == [], fr.url


def _hover_name_cell(page, table: str, name: str) -> str:
    """Hover the name cell of ``name``'s row in a Tabulator table; the tooltip's text."""
    # the row in view (the tables are virtualised), then its cell found by the text it shows (the
    # kernels' cleaned name): a locator, re-resolved should Tabulator redraw the rows meanwhile
    shown = page.evaluate(
        """async ([t, n]) => { const row = window.__aiprof.tables[t].getRows().find((r) => r.getData().name === n);
             await row.scrollTo(); return row.getCell('name').getElement().textContent; }""", [table, name])
    cell = page.locator(f"#t-{table} .tabulator-cell[tabulator-field='name']").filter(
        has_text=re.compile("^" + re.escape(shown) + "$"))
    # a shown tooltip stays until another cell is hovered (which replaces it) or a click: mark the
    # current one, then wait for the one this hover makes
    page.eval_on_selector_all(".tabulator-tooltip", "ts => ts.forEach((t) => { t.dataset.seen = '1'; })")
    cell.hover()
    return page.wait_for_selector(".tabulator-tooltip:not([data-seen])", state="visible").text_content()


def _hover_bar(page, chart: str, index: int) -> str:
    """Move the mouse onto bar ``index`` of a horizontal bar chart; the chart's text (its tooltip)."""
    sel = f"#c-{chart}"
    page.locator(sel).scroll_into_view_if_needed()
    x, y = page.evaluate(
        f"""() => {{ const c = window.__aiprof.charts[{chart!r}];
              return [c.convertToPixel({{xAxisIndex: 0}}, 0) + 4, c.convertToPixel({{yAxisIndex: 0}}, {index})]; }}""")
    box = page.locator(sel).bounding_box()
    page.mouse.move(box["x"] + x, box["y"] + y)
    # the axis tooltip is a div inside the chart's element, written by the formatter
    page.wait_for_function(f"() => document.querySelector({sel!r}).innerText.includes('\\n')")
    return page.inner_text(sel)


def test_every_page_shows_trace_names_as_text(hooked, hostile_app):
    page, url = hooked, hostile_app.url
    for route in PAGES:
        open_page(page, url, route)
        _clean(page)

    # overview: the device name, the annotation picker, the kernel charts' tooltips (HTML formatters)
    open_page(page, url, "overview")
    assert H.XSS["device"] in page.inner_text("#kpis")
    assert H.XSS["annotation"] in page.eval_on_selector_all("#ann option", "os => os.map(o => o.textContent).join('|')")
    for chart in ("kernel-time", "kernel-calls"):
        shown = [_hover_bar(page, chart, i) for i in (0, 1)]
        assert any(H.XSS["kernel_gemm"] in t for t in shown) and any(H.XSS["kernel_mul"] in t for t in shown), shown
        page.mouse.move(1, 1)
    _clean(page)

    # tables: each name cell's tooltip is the raw name, as text; the link box lists names as text
    open_page(page, url, "tables")
    for table, keys in (("kernels", ("kernel_gemm", "kernel_mul")), ("ops", ("op_mm", "op_mul")),
                        ("python", ("frame", "module"))):
        for k in keys:
            assert _hover_name_cell(page, table, H.XSS[k]) == H.XSS[k]
        _clean(page)
    for k in ("op_mm", "op_mul", "frame", "module"):
        assert H.XSS[k] in page.inner_text("#t-ops" if k.startswith("op") else "#t-python")
    page.locator("#t-python .tabulator-row", has_text=H.XSS["frame"]).first.click()
    page.wait_for_selector("#link-box:not(.hidden)")
    box = page.inner_text("#link-box")
    assert H.XSS["frame"] in box and H.XSS["op_mm"] in box and H.XSS["kernel_gemm"] in box, box
    _clean(page)

    # steps: the step diff names kernels and host events
    open_page(page, url, "steps")
    page.click("#default-diff")
    page.wait_for_selector("#diff-table")
    assert any(H.XSS[k] in page.inner_text("#diff-panel") for k in ("kernel_gemm", "kernel_mul", "op_mm", "frame"))
    _clean(page)

    # timeline: search hits, the selected event's details, its launching op
    open_page(page, url, "timeline")
    for k in ("annotation", "op_mul", "kernel_gemm"):
        page.fill("#tl-search", H.XSS[k])
        page.press("#tl-search", "Enter")
        page.wait_for_function("n => { const e = document.querySelector('#tl-sel-name'); return e && e.textContent === n; }",
                               arg=H.XSS[k])
        assert H.XSS[k] in page.inner_text("#tl-results")
    assert page.inner_text("#tl-op a") == H.XSS["op_mm"]  # the gemm's launching op
    _clean(page)

    # flame graph (an iframe of flame.html): frame labels and the hover details
    open_page(page, url, "flame")
    fr = page.frame_locator("#flame-frame")
    g = fr.locator("#pane0 g.f", has=fr.locator("title", has_text=H.XSS["frame"])).first
    g.hover()
    details = fr.locator("#pane0 text.details")
    details.filter(has_text=H.XSS["frame"]).wait_for()
    assert details.text_content().startswith(H.XSS["frame"] + " (")
    assert fr.locator("#pane0 g.f title", has_text=H.XSS["kernel_mul"]).count() >= 1
    _clean(page)


def test_static_html_report_shows_names_as_text(hooked, hostile_app, tmp_path):
    """`aiprof analyze --html`: the overview inlined in one file, opened from disk."""
    from aiprof.server import static_report

    path = H.write(tmp_path / "hostile.json.gz", H.XSS)
    out = static_report.write(open_capture([str(path)]), str(tmp_path / "report.html"))
    html = open(out, encoding="utf-8").read()
    for k in ("kernel_mul", "annotation", "device"):  # inlined as JSON, never as markup
        assert H.XSS[k] not in html
    assert html.count("</script>") == 2  # the data's and the app's, none from a name
    page = hooked
    page.goto(f"file://{out}")
    page.wait_for_function("() => document.querySelector('#page')?.dataset.ready")
    assert page.get_attribute("#page", "data-ready") == "1", page.inner_text("#page")
    assert H.XSS["device"] in page.inner_text("#kpis")
    shown = [_hover_bar(page, "kernel-time", i) for i in (0, 1)]
    assert any(H.XSS["kernel_mul"] in t for t in shown), shown
    _clean(page)
