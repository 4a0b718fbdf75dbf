"""Summarise a capture folder <out>/<capture-id>: per rank, steps, event kinds, clock, hw metrics.

    python bench/check_capture.py OUT/CAPTURE_ID [--json]
"""
import collections
import csv
import glob
import gzip
import json
import os
import sys


def summarise(cap: str) -> dict:
    ranks = {}
    for d in sorted(glob.glob(os.path.join(cap, "rank*"))):
        meta = json.load(open(os.path.join(d, "meta.json")))
        tr = json.load(gzip.open(os.path.join(d, "trace.json.gz")))
        ev = tr["traceEvents"]
        cats = collections.Counter(e.get("cat") for e in ev if e.get("ph") == "X")
        steps = sorted(int(e["name"].split("#")[1]) for e in ev if str(e.get("name", "")).startswith("ProfilerStep#"))
        hw = collections.Counter()
        hw_path = os.path.join(d, "hw.csv")
        if os.path.exists(hw_path):
            for row in csv.DictReader(open(hw_path)):
                hw[f"{row['device']}/{row['metric']}"] += 1
        ranks[os.path.basename(d)] = {
            "steps_in_trace": steps, "meta_steps": meta["steps"]["captured"], "mode": meta["mode"],
            "trace_gz_bytes": os.path.getsize(os.path.join(d, "trace.json.gz")),
            "event_cats": dict(cats.most_common(8)),
            "clock": {k: meta["clock"].get(k) for k in ("trace_minus_unix_us", "uncertainty_us")},
            "base_time_ns": tr.get("baseTimeNanoseconds"),
            "before_median_ms": meta["steps"]["before_median_ms"], "during_ms": meta["steps"]["during_ms"],
            "hw_sources": meta["hw"]["sources"], "hw_notes": meta["hw"]["notes"], "hw_metrics": dict(hw),
            "device": meta.get("device"), "versions": meta.get("versions"), "errors": meta.get("errors"),
            "rank": meta["rank"], "world_size": meta["world_size"],
        }
    return ranks


if __name__ == "__main__":
    print(json.dumps(summarise(sys.argv[1]), indent=1))
