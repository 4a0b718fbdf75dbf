"""The `aiprof ui` web app: a Starlette (ASGI) app serving a JSON API over one capture and the
built front end (web/ -> server/static/). Every endpoint is bounded: pixel and row limits are
clamped or refused with a 4xx, and timeline queries return level-of-detail summaries for the
visible window only (analysis/timeline.py), never the whole trace.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable

import msgspec
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from aiprof.errors import AiprofError
from aiprof.server.data import BadRequest, CaptureData
from aiprof.server.jsonapi import api_not_found, error_response

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")


def static_built() -> bool:
    """True when the front end has been built (``make setup`` runs ``npm ci && npm run build``)."""
    return os.path.isfile(os.path.join(STATIC_DIR, "index.html"))


def _enc(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


_encoder = msgspec.json.Encoder(enc_hook=_enc)


def _clean(obj: Any) -> Any:
    """NaN/inf are not JSON: write null (as the JSON report does)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def dumps(obj: Any) -> bytes:
    """Fast JSON for API answers (numpy-aware; NaN/inf become null)."""
    return _encoder.encode(_clean(obj))


class FastJSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def _arg(req: Request, name: str, conv: Callable = str, default: Any = ...) -> Any:
    v = req.query_params.get(name)
    if v is None or v == "":
        if default is ...:
            raise BadRequest(f"missing parameter {name!r}")
        return default
    try:
        return conv(v)
    except (TypeError, ValueError):
        raise BadRequest(f"bad value for {name!r}: {v!r}") from None


def _lanes_arg(v: str) -> list[int]:
    return [int(x) for x in v.split(",") if x.strip()][:4096]


def create_app(data: CaptureData) -> Starlette:
    """The ASGI app over one capture."""

    def api(fn: Callable[[Request], Any]) -> Callable:
        def endpoint(req: Request) -> Response:
            try:
                return FastJSON(fn(req))
            except BadRequest as exc:
                return error_response(str(exc), exc.status)
            except AiprofError as exc:
                return error_response(str(exc), 422)
        return endpoint

    rank = lambda q: _arg(q, "rank", int, None)  # noqa: E731
    routes = [
        Route("/api/meta", api(lambda q: data.meta())),
        Route("/api/report", api(lambda q: data.report())),
        Route("/api/overview", api(lambda q: data.overview(rank(q), _arg(q, "k", int, 15)))),
        Route("/api/annotation", api(lambda q: data.annotation_hist(rank(q), _arg(q, "name"), _arg(q, "bins", int, 20)))),
        Route("/api/steps", api(lambda q: data.steps(rank(q)))),
        Route("/api/serving", api(lambda q: data.serving(rank(q)))),
        Route("/api/diff", api(lambda q: data.diff(rank(q), _arg(q, "base", int), _arg(q, "compare", int)))),
        Route("/api/kernels", api(lambda q: data.kernels(rank(q), _arg(q, "limit", int, 5000)))),
        Route("/api/host", api(lambda q: data.host_table(rank(q), _arg(q, "kind"), _arg(q, "limit", int, 5000)))),
        Route("/api/links", api(lambda q: data.links(rank(q), _arg(q, "kind"), _arg(q, "name")))),
        Route("/api/ranks", api(lambda q: data.ranks())),
        Route("/api/timeline/lanes", api(lambda q: data.lanes(rank(q)))),
        Route("/api/timeline/window", api(lambda q: data.window(
            rank(q), _arg(q, "t0", float), _arg(q, "t1", float), _arg(q, "px", int, 1000),
            _arg(q, "lanes", _lanes_arg, None)))),
        Route("/api/timeline/counters", api(lambda q: data.counters(
            rank(q), _arg(q, "t0", float), _arg(q, "t1", float), _arg(q, "px", int, 1000)))),
        Route("/api/timeline/event", api(lambda q: data.event(rank(q), _arg(q, "source"), _arg(q, "row", int)))),
        Route("/api/timeline/search", api(lambda q: data.search(rank(q), _arg(q, "q"), _arg(q, "limit", int, 100)))),
        Route("/api/timeline/next", api(lambda q: data.next_event(rank(q), _arg(q, "source"), _arg(q, "row", int),
                                                                  _arg(q, "dir", int, 1)))),
        Route("/api/timeline/flows", api(lambda q: data.flows(rank(q), _arg(q, "t0", float), _arg(q, "t1", float),
                                                              _arg(q, "limit", int, 2000)))),
        Route("/api/timeline/collectives", api(lambda q: data.collectives(_arg(q, "t0", float), _arg(q, "t1", float),
                                                                          _arg(q, "limit", int, 500)))),
        Route("/api/memory", api(lambda q: data.memory(rank(q), _arg(q, "px", int, 1200)))),
        Route("/flame.html", _flame(data)),
        Route("/", _index),
        Route("/api/{rest:path}", api_not_found),
    ]
    if os.path.isdir(os.path.join(STATIC_DIR, "assets")):
        routes.append(Mount("/assets", StaticFiles(directory=os.path.join(STATIC_DIR, "assets")), name="assets"))
    app = Starlette(routes=routes)
    app.state.data = data
    return app


def _index(req: Request) -> Response:
    if not static_built():
        return HTMLResponse("<h1>aiprof UI not built</h1><p>Run <code>make setup</code> (it runs "
                            "<code>npm ci && npm run build</code> in web/). The JSON API under /api works.</p>",
                            status_code=503)
    with open(os.path.join(STATIC_DIR, "index.html"), encoding="utf-8") as f:
        return HTMLResponse(f.read())


def _flame(data: CaptureData) -> Callable:
    from aiprof.flame import stacks, svg

    def endpoint(req: Request) -> Response:
        try:
            rt = data.rank(_arg(req, "rank", int, None))
            step = _arg(req, "step", int, None)
            if step is not None and step not in [s["step"] for s in data.rank_report(rt.rank)["steps"]]:
                raise BadRequest(f"no step {step} on rank {rt.rank}")
            key = ("flame", rt.rank, step)
            html = data._once(key, lambda: svg.render_html(
                [stacks.gpu_profile(rt, step=step), stacks.cpu_profile(rt, step=step)],
                title=f"aiprof flame graph · rank {rt.rank}" + ("" if step is None else f" · step {step}")))
            return HTMLResponse(html)
        except BadRequest as exc:
            return error_response(str(exc), exc.status)
    return endpoint
