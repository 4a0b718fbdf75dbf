"""`aiprof flame CAPTURE... -o FILE`: AI flame graph (GPU, CPU, both, or differential)."""
from __future__ import annotations

import argparse
import json
import sys

from aiprof.cli.inputs import add_capture_option
from aiprof.errors import AiprofError, UsageError
from aiprof.export.files import atomic_open
from aiprof.flame import folded, lacks, pyspy, speedscope, stacks, svg
from aiprof.flame.profile import Profile, diff

FORMATS = ("svg", "html", "folded", "speedscope")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("flame", help="AI flame graph: Python → torch op → CUDA call → GPU kernel, width = time",
                       description="Build a flame graph from a capture. GPU graph: every kernel/memcpy/memset "
                                   "under the Python frames, torch ops and CUDA call that launched it, weighted "
                                   "by GPU time. CPU graph: host frames weighted by exclusive host time.")
    p.add_argument("paths", nargs="*", metavar="CAPTURE", help="trace file(s) or capture directory")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="output file; the format follows the suffix (.svg, .html, .folded/.txt, .json) unless --format")
    p.add_argument("--format", choices=FORMATS, help="output format (default: from the file suffix)")
    p.add_argument("--what", choices=("gpu", "cpu", "both", "native"), default="gpu",
                   help="GPU time, host time, or both (html: a toggle; speedscope: two profiles); native: the "
                        "capture's sampled native+Python stacks (native.folded, from --what native) (default gpu)")
    p.add_argument("--rank", type=int, help="one rank (default: all ranks merged)")
    p.add_argument("--split-ranks", action="store_true", help="keep ranks apart under a 'rank N' root frame")
    p.add_argument("--step", type=int, help="only this step (number as in the report, e.g. 3 for ProfilerStep#3)")
    p.add_argument("--diff", metavar="OTHER", help="differential against another capture (OTHER is the baseline)")
    p.add_argument("--diff-step", type=int, metavar="T", help="differential against step T of the same capture")
    p.add_argument("--pyspy", metavar="FILE", help="render py-spy output (raw/speedscope/aiprof stacks JSON) "
                                                   "as a CPU flame graph instead of a capture")
    p.add_argument("--title", help="title of the SVG/HTML")
    p.add_argument("--no-cache", action="store_true", help="re-parse even when a cached store exists")
    add_capture_option(p)
    p.set_defaults(func=run)


def _format(args: argparse.Namespace) -> str:
    if args.format:
        return args.format
    out = args.output.lower()
    for suffix, fmt in ((".svg", "svg"), (".html", "html"), (".htm", "html"), (".folded", "folded"),
                        (".txt", "folded"), (".json", "speedscope")):
        if out.endswith(suffix):
            return fmt
    raise UsageError(f"cannot tell the format from {args.output!r}: use --format {'|'.join(FORMATS)}")


def profiles(args: argparse.Namespace) -> list[Profile]:
    """The profile(s) the arguments ask for."""
    if args.pyspy:
        if args.paths or args.diff or args.diff_step is not None or args.step is not None:
            raise UsageError("--pyspy renders py-spy output alone (no CAPTURE, --diff or --step)")
        return [pyspy.read(args.pyspy)]
    if not args.paths:
        raise UsageError("give a CAPTURE (trace files or a capture directory), or --pyspy FILE")
    if args.diff and args.diff_step is not None:
        raise UsageError("--diff and --diff-step exclusive: compare with another capture or another step")
    if args.diff_step is not None and args.step is None:
        raise UsageError("--diff-step T compares --step S with step T: give --step too")
    if args.what == "native":
        if args.diff or args.diff_step is not None or args.step is not None:
            raise UsageError("--what native has no --diff or --step (py-spy samples carry no step)")
        return [native_profile(args.paths, args.rank)]
    from aiprof.trace.store import open_capture

    cap = open_capture(args.paths, use_cache=not args.no_cache, capture=args.capture)
    whats = ["gpu", "cpu"] if args.what == "both" else [args.what]
    out = []
    empty: list[str] = []
    for what in whats:
        new = stacks.build(cap, what, rank=args.rank, step=args.step, split_ranks=args.split_ranks)
        if args.diff:
            other = open_capture([args.diff], use_cache=not args.no_cache)
            base = stacks.build(other, what, rank=args.rank, step=args.step, split_ranks=args.split_ranks)
            new = diff(base, new, name=f"{what.upper()} {' '.join(args.paths)} vs {args.diff}")
        elif args.diff_step is not None:
            base = stacks.build(cap, what, rank=args.rank, step=args.diff_step, split_ranks=args.split_ranks)
            new = diff(base, new, name=f"{what.upper()} step {args.step} vs step {args.diff_step}")
        if not new.stacks:
            empty.append(f"{what.upper()} graph: {lacks.empty_graph_reason(cap, what, args.rank, args.step)}")
        out.append(new)
    refuse_empty(empty, len(out))
    note = lacks.python_note(cap, "stacks")
    if note:
        print(f"aiprof: note: {note}", file=sys.stderr)
    return out


def refuse_empty(empty: list[str], total: int) -> None:
    """No graph to draw: one-line error (nothing written); some of several empty: a warning each."""
    if empty and len(empty) == total:
        raise AiprofError("nothing to draw: " + "; ".join(empty))
    for why in empty:
        print(f"aiprof: warning: empty {why}", file=sys.stderr)


def native_profile(paths: list[str], rank: int | None = None) -> Profile:
    """The sampled native stacks (py-spy --native, Python frames merged in) of a capture's ranks,
    each under a 'rank N' root frame when there are several."""
    import glob
    import os
    import re

    from aiprof.flame.profile import merge

    files: list[tuple[int, str]] = []
    for p in paths:
        cands = [p] if p.endswith(".folded") else (glob.glob(os.path.join(p, "native.folded"))
                                                   + glob.glob(os.path.join(p, "rank*", "native.folded")))
        for f in cands:
            m = re.search(r"rank(\d+)", f)
            files.append((int(m.group(1)) if m else 0, f))
    files = sorted(set(f for f in files if rank is None or f[0] == rank))
    if not files:
        raise UsageError("no native.folded in the capture: record it with aiprof run/attach --what native")
    profs = [pyspy.read(f) for _, f in files]
    if len(profs) == 1:
        return profs[0]
    return merge([pr.prefixed(f"rank {r}") for (r, _), pr in zip(files, profs)], name="native stacks")


def run(args: argparse.Namespace) -> int:
    fmt = _format(args)
    profs = profiles(args)
    if len(profs) > 1 and fmt in ("svg", "folded"):
        raise UsageError(f"--what both needs several graphs in one file: use .html or speedscope .json, not {fmt}")
    if fmt == "speedscope" and any(p.is_diff for p in profs):
        raise UsageError("speedscope has no differential view: use .svg, .html or .folded with --diff")
    with atomic_open(args.output, "w") as f:
        if fmt == "folded":
            folded.write(profs[0], f)
        elif fmt == "speedscope":
            json.dump(speedscope.document(profs), f)
        elif fmt == "svg":
            f.write(svg.render_svg(profs[0], title=args.title))
        else:
            f.write(svg.render_html(profs, title=args.title or "aiprof flame graph"))
    for p in profs:
        unit = "ms" if p.unit == "nanoseconds" else "samples"
        total = p.total / 1e6 if p.unit == "nanoseconds" else p.total
        print(f"{p.name}: {len(p.stacks)} stacks, total {total:,.3f} {unit}" if unit == "ms"
              else f"{p.name}: {len(p.stacks)} stacks, {total:,} {unit}", file=sys.stderr)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
