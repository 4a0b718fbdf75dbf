"""``aiprof trigger [options]``: ask every agent on this host to capture, wait for the outputs.

Agents are those of jobs started with ``aiprof run`` or attached with ``aiprof attach``.
``--list`` only shows them. With ``--server URL --job JOB`` the central service asks every
rank of the job, on any host, to capture the same iterations, collects and analyses the
captures and prints the report's link; ``--hang`` takes a stack snapshot of every rank
instead and prints the hang analysis (docs/server.md).
"""
from __future__ import annotations

import argparse
import json
import sys

from aiprof.cli.capture_options import add_capture_options, request_from_args
from aiprof.cli.server_options import add_server_options, server_token


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("trigger", help="ask running agents on this host to capture",
                              description=__doc__.splitlines()[0])
    add_capture_options(p, wait_default=5000)
    p.add_argument("--pid", type=int, action="append", default=None, help="only this agent (repeatable)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the outputs (default 120)")
    p.add_argument("--list", action="store_true", help="list the agents and their state, capture nothing")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    add_server_options(p, "with --server: the job whose ranks all capture (--list shows the jobs; "
                          "default: the only live one)")
    p.add_argument("--auto-analyze", action="store_true",
                   help="with --server: wait until the server has analysed the capture, print its causes and the link")
    p.add_argument("--hang", action="store_true",
                   help="with --server: stack snapshot of every rank of the job and hang analysis, no capture")
    p.set_defaults(func=run)


def print_results(results: dict[int, dict], as_json: bool, req_id: str) -> int:
    """Print one line per process; returns 0 if all succeeded, else 1."""
    if as_json:
        print(json.dumps({"capture_id": req_id, "results": {str(k): v for k, v in results.items()}}, indent=1))
    else:
        for pid, r in sorted(results.items()):
            if r.get("ok"):
                print(f"pid {pid}: {r.get('dir')}  (iterations {r.get('steps')})")
            else:
                print(f"pid {pid}: failed: {r.get('error')}")
    return 0 if results and all(r.get("ok") for r in results.values()) else 1


def run_server(args: argparse.Namespace) -> int:
    """``--server`` mode: the service drives every rank of a job."""
    from aiprof.analysis.hang import format_text
    from aiprof.termtext import visible_lines
    from aiprof.server.client import ServerClient
    from aiprof.server.remote import capture_job, hang_job, list_jobs, resolve_job

    client = ServerClient(args.server, server_token(args), timeout=15.0)
    if args.list:
        jobs = list_jobs(client)
        if args.json:
            print(json.dumps(jobs, indent=1))
        elif not jobs:
            print("no live jobs on the server", file=sys.stderr)
        for job, agents in sorted(jobs.items()) if not args.json else []:
            print(f"job {job}: {len(agents)} rank(s)")
            for a in agents:
                print(f"  rank {a['rank']}/{a['world_size']} {a['host']}:{a['pid']} {a['state']} steps={a['steps']} "
                      f"step_ms={a['step_ms']} heartbeat {a['last_seen_s']} s ago")
        return 0
    job = resolve_job(client, args.job)
    if args.hang:
        st = hang_job(client, job, timeout=min(args.timeout, 60.0))
        res = st.get("result") or {}
        if args.json:
            print(json.dumps(st, indent=1, default=str))
        elif st.get("state") == "failed":
            print(f"hang analysis failed: {st.get('error')}", file=sys.stderr)
        else:
            # the text comes from the service: shown, never interpreted by the terminal
            sys.stdout.write(visible_lines(res.get("text") or format_text(res)))
            if res.get("missing_ranks"):
                print(f"no stacks from rank(s) {', '.join(map(str, res['missing_ranks']))}")
        return 0 if st.get("state") == "analysed" else 1
    req = request_from_args(args)
    log = None if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    st = capture_job(client, job, req, args.auto_analyze, args.timeout, log, explicit_id=bool(args.capture_id))
    missing = st.get("missing") or []
    if args.json:
        print(json.dumps(st, indent=1, default=str))
    else:
        got = st.get("received") or []
        print(f"capture {st['capture_id']}: {st.get('state')}" + (" (timed out waiting)" if st.get("timed_out") else "")
              + f"; ranks received {', '.join(map(str, got)) or 'none'}"
              + (f"; missing {', '.join(map(str, missing))}" if missing else "")
              + ("" if st.get("aligned") in (None, True) else "; ranks recorded different iterations"))
        for r, res in sorted((st.get("results") or {}).items()):
            if res.get("ok") is False:
                print(f"  rank {r}: {res.get('error')}")
        summary = (st.get("analysis") or {}).get("summary") or {}
        for c in summary.get("causes") or []:
            print(f"  [{c['severity']}] {c['code']}  saves {c.get('per_step_ms', 0.0):.1f} ms/step  {c['title']}")
        if st.get("error"):
            print(f"  error: {st['error']}")
        print(f"report: {st.get('url')}")
    ok = st.get("state") == ("analysed" if args.auto_analyze else "uploaded") or st.get("state") == "analysed"
    return 0 if ok and not missing else 1


def run(args: argparse.Namespace) -> int:
    from aiprof.attach.trigger import find_agents, trigger

    if args.server:
        return run_server(args)
    if args.hang or args.auto_analyze:
        from aiprof.errors import UsageError

        raise UsageError("--hang and --auto-analyze need --server (locally: aiprof hang, aiprof analyze)")

    if args.list:
        agents = find_agents(args.pid)
        if args.json:
            print(json.dumps([a.status for a in agents], indent=1, default=str))
        elif not agents:
            print("no agents running", file=sys.stderr)
        for a in agents if not args.json else []:
            s = a.status
            print(f"pid {s['pid']} rank {s.get('rank')}/{s.get('world_size')} {s.get('state')} "
                  f"steps={s.get('steps')} step_ms={s.get('step_ms')} source={s.get('source')} origin={s.get('origin')}")
        return 0
    req = request_from_args(args)
    results = trigger(req, args.pid, args.timeout)
    return print_results(results, args.json, req.capture_id)
