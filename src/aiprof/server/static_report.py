"""`aiprof analyze --html FILE`: the UI's overview as one self-contained HTML file (built JS, CSS
and the data inlined; nothing is fetched at view time)."""
from __future__ import annotations

import os
import tempfile

from aiprof.errors import AiprofError
from aiprof.server.app import STATIC_DIR, dumps, static_built
from aiprof.server.data import CaptureData
from aiprof.trace.store import Capture

ANNOTATIONS_INLINED = 10  # per rank: histograms of the most time-consuming annotations


def _inline(text: str) -> str:
    # a "</script" (or "<!--") inside inlined code or data would end the element early
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def _json_inline(data: bytes) -> str:
    # the data holds names from the trace: <, > and & as JSON escapes (the same string to JSON.parse
    # and to JS), so no name can close the script element or read as markup
    return data.decode().replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(capture: Capture, report: dict | None = None, entry: str | None = None) -> str:
    """The static overview page of a capture, as an HTML string."""
    if not static_built():
        raise AiprofError("the UI's front end is not built, so --html cannot inline it: run `make setup` "
                          "(npm ci && npm run build in web/)")
    data = CaptureData(capture, entry=entry)
    if report is not None:
        data._memo["report"] = report
    payload = {"meta": data.meta(), "overview": {}, "annotations": {}}
    for rt in capture.ranks:
        ov = data.overview(rt.rank, 15)
        payload["overview"][str(rt.rank)] = ov
        payload["annotations"][str(rt.rank)] = {a["name"]: data.annotation_hist(rt.rank, a["name"], 15)
                                                for a in ov["annotations"][:ANNOTATIONS_INLINED]}
    assets = os.path.join(STATIC_DIR, "assets")
    with open(os.path.join(assets, "app.js"), encoding="utf-8") as f:
        js = f.read()
    css = ""
    for name in sorted(os.listdir(assets)):
        if name.endswith(".css"):
            with open(os.path.join(assets, name), encoding="utf-8") as f:
                css += f.read()
    with open(os.path.join(STATIC_DIR, "index.html"), encoding="utf-8") as f:
        page = f.read()
    # drop the asset links of the served page; inline everything instead
    page = "\n".join(line for line in page.splitlines() if "assets/" not in line)
    head = (f"<style>{css}</style>\n<script>window.__AIPROF_STATIC__ = {_json_inline(dumps(payload))};</script>\n")
    body = f'<script type="module">{_inline(js)}</script>\n'
    return page.replace("</head>", head + "</head>").replace("</body>", body + "</body>")


def write(capture: Capture, path: str, report: dict | None = None, entry: str | None = None) -> str:
    """Write the static overview atomically; returns the path."""
    html = render(capture, report, entry)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(html)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a report is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
