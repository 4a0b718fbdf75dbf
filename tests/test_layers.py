"""Imports only go down: every import in src/aiprof (module level or inside a function, since a
lazy import is a dependency all the same) goes to a part on the same floor or a lower one.

The floors, lowest first (docs/architecture.md, "Layers"). A part may import any part on a
lower floor and parts of its own package; two parts on one floor do not import each other.
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "aiprof"

FLOORS: list[tuple[str, ...]] = [
    ("__init__", "errors", "npx", "records", "termtext"),  # ground: standard library and numpy only
    ("hardware", "tools"),  # the device table, the external programs
    ("trace",),  # readers, tables, the store
    ("native",),  # the native sidecar (spawned by the agent, read by the CLI)
    ("protocol",),  # capture requests and file columns: what the agent and the aiprof side agree on
    ("analysis",),  # facts: pure functions over the tables
    ("diagnosis",),  # symptoms, causes, the what-if replay
    ("pipeline",),  # the report's stages
    ("scale",),  # where the per-rank stages run
    ("flame",),
    ("export",),
    ("report",),  # renderers
    ("api",),  # the Python/DataFrame API (aiprof.open): tables, the report as objects, notebook views
    ("server",),  # the service and its client
    ("agent",),  # inside the profiled process; a client of the server (uplink)
    ("attach",),  # getting the agent in
    ("cli",),
    ("__main__",),
]
FLOOR = {part: i for i, parts in enumerate(FLOORS) for part in parts}
# The one import that may go up: the package's facade, `aiprof.open`, imported lazily by
# aiprof/__init__.py on first use (so `import aiprof` inside a user's job stays light).
FACADE = {("__init__", "api")}


def _part(module: str) -> str | None:
    """The part of aiprof a dotted module name belongs to (None: not aiprof)."""
    bits = module.split(".")
    if bits[0] != "aiprof":
        return None
    return bits[1] if len(bits) > 1 else "__init__"


def imported_parts(source: str) -> list[tuple[int, str]]:
    """(line, part) of every aiprof import in ``source`` (absolute imports: the project uses no
    relative ones)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "aiprof":  # from aiprof import X: X is the part (or a name of __init__)
                out += [(node.lineno, a.name if a.name in FLOOR else "__init__") for a in node.names]
            elif (p := _part(node.module)) is not None:
                out.append((node.lineno, p))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, p) for a in node.names if (p := _part(a.name)) is not None]
    return out


def back_up_imports(part: str, source: str, where: str) -> list[str]:
    """The imports of ``source`` (in ``part``) that go to a higher floor or across its own."""
    return [f"{where}:{line}: {part} (floor {FLOOR[part]}) imports {to} (floor {FLOOR[to]})"
            for line, to in imported_parts(source)
            if to != part and FLOOR[to] >= FLOOR[part] and (part, to) not in FACADE]


def _modules():
    for p in sorted(SRC.rglob("*.py")):
        rel = p.relative_to(SRC)
        yield (rel.parts[0] if len(rel.parts) > 1 else rel.stem), p


def test_every_part_has_a_floor():
    assert {part for part, _ in _modules()} <= FLOOR.keys()


def test_imports_only_go_down():
    bad = [b for part, p in _modules() for b in back_up_imports(part, p.read_text(), str(p.relative_to(SRC.parent)))]
    assert bad == []


def test_a_back_up_import_is_caught():
    """The check itself: analysis importing the diagnosis (as analysis/report.py once did), lazily
    or not, and two parts of one floor importing each other, are reported."""
    assert back_up_imports("analysis", "from aiprof.diagnosis import engine\n", "x.py") == [
        "x.py:1: analysis (floor 5) imports diagnosis (floor 6)"]
    assert len(back_up_imports("native", "def f():\n    import aiprof.attach.stacks\n", "x.py")) == 1
    assert len(back_up_imports("errors", "from aiprof import npx\n", "x.py")) == 1
    assert back_up_imports("pipeline", "from aiprof import __version__\nfrom aiprof.analysis import ranks\n", "x.py") == []
