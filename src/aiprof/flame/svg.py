"""Interactive flame graphs: a self-contained SVG (like flamegraph.pl) or an HTML page holding
several (GPU / CPU / differential) with a toggle. Click zooms, "Search" highlights frames that
match a regular expression and shows the matched share; ``?s=REGEX`` in the URL searches at load.

Colours say what a frame is: Python (yellow), torch op / annotation (orange), CUDA runtime
call (light brown, outlined: the CPU/GPU boundary), GPU kernel (green), memcpy/memset (blue),
communication kernel (purple). A differential graph is coloured by change instead: red grew,
blue shrank (intensity relative to the largest change).
"""
from __future__ import annotations

import hashlib
import html
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Sequence

from aiprof.flame.profile import GPU_PREFIX, Profile
from aiprof.termtext import visible
from aiprof.trace import classify

FRAME_H = 16
WIDTH = 1200
_PAD = 10
_TOP = 64
_BOTTOM = 30
# frames narrower than this share of the total are not drawn (flamegraph.pl's minwidth)
MIN_SHARE = 2e-5

KINDS = {
    "python": "rgb(232,190,60)",
    "op": "rgb(240,140,60)",
    "runtime": "rgb(200,160,120)",
    "gpu": "rgb(80,180,80)",
    "memory": "rgb(80,140,230)",
    "communication": "rgb(160,90,210)",
    "other": "rgb(190,190,190)",
}
LEGEND = [("Python", "python"), ("torch op", "op"), ("CUDA call (CPU|GPU)", "runtime"),
          ("GPU kernel", "gpu"), ("memcpy/memset", "memory"), ("communication", "communication")]
_PY = re.compile(r"\.py\(\d+\)|^<built-in|^<frozen|^<module>")


def frame_kind(name: str) -> str:
    """What a frame is, from its text: the builders give each kind a recognisable form."""
    if name.startswith(GPU_PREFIX):
        k = name[len(GPU_PREFIX):]
        if k.startswith(("Memcpy", "Memset")):
            return "memory"
        if classify.kernel_class(k) == classify.COMMUNICATION:
            return "communication"
        return "gpu"
    if _PY.search(name):
        return "python"
    if name.startswith(("cuda", "cu")) and name[2:3].isalpha() and not name.startswith("cudnn"):
        return "runtime"
    if name.startswith("["):
        return "other"
    return "op"


@dataclass
class _Node:
    name: str
    depth: int
    weight: int = 0
    base: int = 0
    children: dict[str, "_Node"] = field(default_factory=dict)


def _tree(p: Profile) -> _Node:
    root = _Node("all", 0)
    base = p.base.tolist() if p.base is not None else [0] * len(p.stacks)
    for s, w, b in zip(p.stacks, p.weights.tolist(), base):
        node = root
        node.weight += w
        node.base += b
        for f in s:
            c = node.children.get(f)
            if c is None:
                c = node.children[f] = _Node(f, node.depth + 1)
            c.weight += w
            c.base += b
            node = c
    return root


def _esc(s: str) -> str:
    # frame names come from the trace: markup escaped, and control characters (which XML forbids:
    # one would make the standalone .svg unreadable) shown as escapes such as \x1b
    return html.escape(visible(s))


def _fmt(v: float, unit: str) -> str:
    if unit != "nanoseconds":
        return f"{int(v):,} samples"
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:.3f} s"
    if a >= 1e6:
        return f"{v / 1e6:.3f} ms"
    if a >= 1e3:
        return f"{v / 1e3:.1f} us"
    return f"{int(v)} ns"


def _diff_colour(delta: int, scale: float) -> str:
    if scale <= 0 or delta == 0:
        return "rgb(250,250,250)"
    v = int(210 * min(1.0, abs(delta) / scale))
    return f"rgb(255,{250 - v},{250 - v})" if delta > 0 else f"rgb({250 - v},{250 - v},255)"


def render_svg(p: Profile, title: str | None = None, ident: str | None = None, standalone: bool = True) -> str:
    """The flame graph of ``p`` as SVG markup (with its script when ``standalone``)."""
    root = _tree(p)
    total = max(root.weight, 1)
    min_w = total * MIN_SHARE
    frames: list[tuple[_Node, int]] = []
    max_depth = 0
    max_delta = 0

    def walk(n: _Node, x: int) -> None:
        nonlocal max_depth, max_delta
        frames.append((n, x))
        max_depth = max(max_depth, n.depth)
        max_delta = max(max_delta, abs(n.weight - n.base))
        for name in sorted(n.children):  # alphabetical, as flamegraph.pl merges
            c = n.children[name]
            if c.weight >= min_w and c.weight > 0:
                walk(c, x)
            x += c.weight

    walk(root, 0)
    height = _TOP + (max_depth + 1) * FRAME_H + _BOTTOM
    ident = ident or "f" + hashlib.sha1((p.name + str(total)).encode()).hexdigest()[:8]
    diff = p.base is not None
    title = title or p.name
    esc = _esc
    sub = f"total {_fmt(root.weight, p.unit)}"
    if diff:
        sub += f" (baseline {_fmt(root.base, p.unit)}; width = new, red grew, blue shrank)"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" version="1.1" class="aiprof-flame" id="{ident}" '
        f'width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" data-width="{WIDTH}" '
        f'data-total="{total}" data-unit="{esc(p.unit)}" data-diff="{int(diff)}" '
        f'style="font-family:Verdana,sans-serif;font-size:12px;background:#fff">',
        '<style>g.f:hover rect{stroke:#000;stroke-width:0.5;cursor:pointer} text{pointer-events:none}'
        ' .ctl{cursor:pointer;fill:#225} .ctl:hover{text-decoration:underline}</style>',
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" style="font-size:17px">{esc(title)}</text>',
        f'<text x="{WIDTH / 2}" y="38" text-anchor="middle" fill="#555">{esc(sub)}</text>',
        f'<text class="ctl unzoom" x="{_PAD}" y="20" style="opacity:0.3">Reset Zoom</text>',
        f'<text class="ctl search" x="{WIDTH - _PAD}" y="20" text-anchor="end">Search</text>',
        f'<text class="matched" x="{WIDTH - _PAD}" y="{height - 10}" text-anchor="end"></text>',
        f'<text class="details" x="{_PAD}" y="{height - 10}"> </text>',
    ]
    if not diff:
        lx = _PAD
        for label, kind in LEGEND:
            out.append(f'<rect x="{lx}" y="46" width="10" height="10" fill="{KINDS[kind]}"/>'
                       f'<text x="{lx + 14}" y="55" style="font-size:11px">{esc(label)}</text>')
            lx += 14 + 7 * len(label) + 16
    for n, x in frames:
        y = height - _BOTTOM - (n.depth + 1) * FRAME_H
        share = 100.0 * n.weight / total
        tip = f"{n.name} ({_fmt(n.weight, p.unit)}, {share:.2f}%)"
        if diff:
            d = n.weight - n.base
            tip += f" baseline {_fmt(n.base, p.unit)}, change {'+' if d >= 0 else ''}{_fmt(d, p.unit)}"
            fill = _diff_colour(d, max_delta)
            kind = frame_kind(n.name)
        else:
            kind = frame_kind(n.name) if n.depth else "other"
            fill = KINDS[kind]
        # the CPU/GPU boundary: launch calls get a dark outline
        stroke = ' stroke="#402000" stroke-width="1"' if kind == "runtime" else ""
        out.append(
            f'<g class="f" data-x="{x}" data-w="{n.weight}" data-d="{n.depth}" data-k="{kind}">'
            f'<title>{esc(tip)}</title><rect x="0" y="{y}" width="0" height="{FRAME_H - 1}" rx="2" '
            f'fill="{fill}"{stroke}/><text x="0" y="{y + FRAME_H - 4}">{esc(n.name)}</text></g>')
    if standalone:
        out.append(f"<script><![CDATA[\n{_js()}\n(function(){{var f=aiprofFlame(document.getElementById('{ident}'));"
                   "var q=aiprofFlameQuery(); if(q) f.search(q);})();\n]]></script>")
    out.append("</svg>")
    return "\n".join(out)


def _js() -> str:
    return resources.files("aiprof.flame").joinpath("flame.js").read_text()


def render_html(profiles: Sequence[Profile], title: str = "aiprof flame graph") -> str:
    """One page with a flame graph per profile, a toggle between them and a search box."""
    esc = _esc
    svgs, buttons = [], []
    for i, p in enumerate(profiles):
        ident = f"flame{i}"
        svgs.append(f'<div class="pane" id="pane{i}" style="display:{"block" if i == 0 else "none"}">'
                    f'{render_svg(p, ident=ident, standalone=False)}</div>')
        buttons.append(f'<button onclick="show({i})" id="btn{i}">{esc(p.name)}</button>')
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>body{{font-family:Verdana,sans-serif;margin:12px}} button{{margin-right:6px;padding:4px 10px}}
button.on{{background:#335;color:#fff}} #q{{width:280px;padding:3px}} .bar{{margin-bottom:8px}}</style>
</head><body>
<div class="bar">{''.join(buttons)}
<input id="q" placeholder="search frames (regex), Enter" onkeydown="if(event.key==='Enter')find(this.value)">
<span id="pct"></span></div>
{''.join(svgs)}
<script>
{_js()}
var cur = 0, n = {len(profiles)};
function pane(i) {{ return aiprofFlame(document.getElementById('flame' + i)); }}
function show(i) {{
  for (var k = 0; k < n; k++) {{
    document.getElementById('pane' + k).style.display = k === i ? 'block' : 'none';
    document.getElementById('btn' + k).className = k === i ? 'on' : '';
  }}
  cur = i; var q = document.getElementById('q').value; if (q) find(q);
}}
function find(q) {{
  var p = pane(cur).search(q);
  document.getElementById('pct').textContent = q ? 'matched ' + p.toFixed(1) + '%' : '';
}}
for (var k = 0; k < n; k++) pane(k);
(function () {{
  var q = aiprofFlameQuery(), v = /[?&]v=(\\d+)/.exec(window.location.search);
  if (q) {{ document.getElementById('q').value = q; }}
  show(v ? Math.min(+v[1], n - 1) : 0);
}})();
</script></body></html>
"""
