"""Check an `aiprof hang --json` result: ranks other than BLOCKED grouped in one collective from
the recorder, BLOCKED behind. Prints the verdict; exit 0 when it holds.

    python bench/check_hang.py hang.json --blocked 1 --world 4
"""
import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--blocked", type=int, default=1)
    ap.add_argument("--world", type=int, default=4)
    a = ap.parse_args()
    res = json.load(open(a.path))
    coll = res.get("collectives") or {}
    groups = coll.get("groups") or []
    others = [r for r in range(a.world) if r != a.blocked]
    print("source:", coll.get("source"), "pg:", coll.get("pg"), "top seq:", coll.get("top_seq"))
    for g in groups:
        print(f"  ranks {g['ranks']}: {g['label']} ({g['state']}, entry state {g.get('entry_state')})")
    for o in res.get("outliers", []):
        print(f"  outlier rank {o['rank']} ({o.get('kind')}): {o['reason']}")
    for p in sorted(res.get("processes", []), key=lambda p: p["rank"]):
        lc = p.get("last_collectives") or {}
        fr, py = lc.get("flight_recorder") or [], lc.get("python") or []
        print(f"  rank {p['rank']}: python {[(e['op'], e['seq'], e['state']) for e in py[-2:]]} "
              f"fr {[(e['op'], e['seq'], e['state']) for e in fr[-2:]]} fr_error {lc.get('fr_error')}")
    ok = (len(groups) == 2 and groups[0]["ranks"] == others and groups[0]["state"] == "waiting"
          and groups[1]["ranks"] == [a.blocked] and groups[1]["state"] == "behind"
          and [o["rank"] for o in res.get("outliers", [])] == [a.blocked])
    print("CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
