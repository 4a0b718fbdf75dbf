"""A real trace whose names are chosen by an attacker (issue 31, item 2): the small H100 scenario
trace tests/data/scenarios/fp32_matmul.json.gz (2 kernels, 2 ops, Python frames, 3 steps) with
its kernel, op, Python frame, module, annotation, process, thread and device names replaced.
Everything else (timestamps, correlations, flows, steps) is untouched, so it analyses as before."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

SOURCE = Path(__file__).parent / "data" / "scenarios" / "fp32_matmul.json.gz"
GEMM = "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize256x128x8_stage3_warpsize4x2x1_ffma_aligna4_alignc4_execute_kernel__5x_cublas"
MUL = "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor"  # a prefix: the name goes on

# for the browser: each payload calls alert with its own number, so a failure says which one ran
XSS = {
    "kernel_gemm": '"><img src=x onerror=alert(1)>',
    "kernel_mul": "<script>alert(2)</script>",
    "op_mm": "<img src=x onerror=alert(3)>",
    "op_mul": '<a href="javascript:alert(4)">op</a>',
    "frame": '"><img src=x onerror=alert(5)>.py(155): <svg onload=alert(5)>',
    "module": "nn.Module: <img src=x onerror=alert(6)>_0",
    "annotation": "<img src=x onerror=alert(7)>",
    "process": "<img src=x onerror=alert(8)>",
    "thread": "<img src=x onerror=alert(9)>",
    "device": "<img src=x onerror=alert(10)>",
}

# for the terminal: rich markup (an unmatched closing tag raised MarkupError), a link, a colour, an
# OSC sequence (sets the window title) and CSI sequences (clear the screen); the first six are
# names the text report lists (top kernels, host hotspots, the device)
TERM = {
    "kernel_gemm": "gemm[/bold]",
    "kernel_mul": "[red]x",
    "op_mm": "a\x1b]0;pwned\x07b",
    "module": "nn.Module: [link=http://x]y[/link]_0",
    "frame": "evil.py(155): f\x1b[2J\x1b[Hcleared",
    "device": "dev[/bold]",
    "op_mul": "[link=http://x]z[/link]",
    "annotation": "ann[/]",
    "process": "p\x1b]0;pwned\x07",
    "thread": "t[/red]",
}


def write(path: Path, names: dict[str, str]) -> Path:
    """Write the renamed trace to ``path`` (.json.gz) and return it."""
    d = json.loads(gzip.decompress(SOURCE.read_bytes()))
    steps = {}
    for e in d["traceEvents"]:
        n, cat = e.get("name"), e.get("cat")
        if cat == "kernel":
            e["name"] = names["kernel_gemm"] if n == GEMM else names["kernel_mul"] if n.startswith(MUL) else n
        elif cat == "cpu_op":
            e["name"] = {"aten::mm": names["op_mm"], "aten::mul": names["op_mul"]}.get(n, n)
        elif cat == "python_function":
            e["name"] = {"capture.py(155): fp32_matmul": names["frame"], "capture.py(57): _profiled": names["module"]}.get(n, n)
        elif cat == "user_annotation" and n.startswith("ProfilerStep#"):
            steps[n] = e
        elif e.get("ph") == "M" and n == "process_name" and e.get("pid") == 402:
            e["args"]["name"] = names["process"]
        elif e.get("ph") == "M" and n == "thread_name" and e.get("tid") == 402:
            e["args"]["name"] = names["thread"]
    # a record_function annotation inside step 3 (the dashboard's annotation picker, the timeline)
    s3 = steps["ProfilerStep#3"]
    d["traceEvents"].append({"ph": "X", "cat": "user_annotation", "name": names["annotation"], "pid": s3["pid"],
                             "tid": s3["tid"], "ts": s3["ts"] + 10.0, "dur": 100.0, "args": {"External id": 1}})
    d["deviceProperties"][0]["name"] = names["device"]
    path.write_bytes(gzip.compress(json.dumps(d).encode()))
    return path
