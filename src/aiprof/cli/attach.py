"""``aiprof attach PID|NAME... [options]``: inject the agent into running Python processes and capture.

Injection: ``sys.remote_exec`` on Python 3.14+, else a tiny shim library loaded with pyinjector
(or gdb) that schedules the agent on the main thread. After injection the capture goes
through the same control channel as ``aiprof trigger`` (``--no-capture``: inject only).
"""
from __future__ import annotations

import argparse
import sys

from aiprof.cli.capture_options import add_capture_options, request_from_args
from aiprof.cli.server_options import add_server_options, agent_server_config
from aiprof.errors import AiprofError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("attach", help="inject the agent into running processes and capture",
                              description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="+", metavar="PID|NAME", help="process ids or names (matched against command lines)")
    add_capture_options(p, wait_default=5000)
    p.add_argument("--no-capture", action="store_true", help="only inject; capture later with aiprof trigger")
    p.add_argument("--method", choices=["remote_exec", "pyinjector", "frida", "gdb"], default=None, help="force an injection method")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the capture (default 120)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    add_server_options(p, "job id the agents register under (default: from the target's environment)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aiprof.protocol import runtime_dir
    from aiprof.attach.inject import inject_agent
    from aiprof.attach.procs import check_attachable, inspect_process, resolve_targets
    from aiprof.attach.trigger import find_agents, plan_requests
    from aiprof.agent.control import capture_all, socket_path, wait_for_socket
    from aiprof.cli.trigger import print_results

    req = request_from_args(args)
    pids = resolve_targets(args.targets)
    infos = [inspect_process(p) for p in pids]
    for info in infos:  # check all before touching any
        check_attachable(info)
    rt = runtime_dir()
    for info in infos:
        agent_rt = runtime_dir(info.uid)
        if wait_for_socket(socket_path(agent_rt, info.pid), 0):  # the capture request carries --entry
            print(f"pid {info.pid}: agent already running", file=sys.stderr)
            continue
        res = inject_agent(info, rt, agent_rt, entry=args.entry, method=args.method,
                           server=agent_server_config(args, req.out))
        print(f"pid {info.pid}: agent started via {res.method} (torch {res.status.get('torch')}, "
              f"Python {res.status.get('python')})", file=sys.stderr)
    if args.no_capture:
        return 0
    rt_dirs = sorted({runtime_dir(i.uid) for i in infos})
    agents = find_agents(pids, rt_dirs)
    missing = set(pids) - {a.pid for a in agents}
    if missing:
        raise AiprofError(f"agent not answering in pid(s) {', '.join(map(str, sorted(missing)))}")
    plans = plan_requests(agents, req)
    results = capture_all([a.endpoint for a in agents], plans, args.timeout)
    return print_results(results, args.json, req.capture_id)
