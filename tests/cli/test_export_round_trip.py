"""`aiprof export --format chrome` reads back into `aiprof analyze` as the same report (real traces,
real CLI); several ranks in one file are refused with one line instead of read as one rank."""
from __future__ import annotations

import json
import shutil

from clisupport import DATA, aiprof


def _report(path: str) -> dict:
    res = aiprof("analyze", path, "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    rep["capture"].pop("sources")
    for r in rep["ranks"]:
        r.pop("source")
    return rep


def test_gpu_trace_round_trip(tmp_path):
    src = tmp_path / "gpt2.json.gz"
    shutil.copy(DATA / "gpt2_train_stall.json.gz", src)
    out = tmp_path / "export.json.gz"
    res = aiprof("export", str(src), "--format", "chrome", "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert " flow arrows" in res.stderr and " 0 flow arrows" not in res.stderr
    a, b = _report(str(src)), _report(str(out))
    ra, rb = a["ranks"][0], b["ranks"][0]
    # the numbers the report is made of come back exactly; sub-µs clipping of host frames (kept so
    # every row nests for viewers) may move a hotspot's exclusive time by a few µs, not more
    for key in ("window", "steps", "summary", "top_kernels", "device", "kernels", "activity", "memops"):
        assert rb[key] == ra[key], key
    assert rb["memory"]["peak_allocated_bytes"] == ra["memory"]["peak_allocated_bytes"]
    assert [(c["code"], c["severity"]) for c in b["causes"]] == [(c["code"], c["severity"]) for c in a["causes"]]


def test_multi_rank_export_is_refused_by_analyze(tmp_path):
    cap = tmp_path / "ddp2"
    cap.mkdir()
    for r in (0, 1):
        shutil.copy(DATA / f"ddp2_slow1_rank{r}.json.gz", cap / f"ddp2_slow1_rank{r}.json.gz")
    both = tmp_path / "both.json"
    assert aiprof("export", str(cap), "--format", "chrome", "-o", str(both)).returncode == 0
    res = aiprof("analyze", str(both))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--rank R" in res.stderr
    one = tmp_path / "rank1.json"
    assert aiprof("export", str(cap), "--format", "chrome", "--rank", "1", "-o", str(one)).returncode == 0
    rep = json.loads(aiprof("analyze", str(one), "--json").stdout)
    assert [r["rank"] for r in rep["ranks"]] == [1] and rep["capture"]["world_size"] == 2
