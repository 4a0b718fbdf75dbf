"""Which files are which rank: traces made by real torch.profiler (CPU) in a child process.

* a trace without a rank of its own is numbered by its place on the command line, and that
  number never reaches its cached store (``analyze B`` then ``analyze A B`` works);
* files of one ``tensorboard_trace_handler`` worker are captures of one process, not ranks.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aiprof.trace.store import find_trace_files, open_capture, store_dir_for, tensorboard_name

SCRIPT = Path(__file__).resolve().parent / "scripts" / "tb_cycles.py"
NOTE = "several captures of one process"


def _aiprof(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiprof", *args], capture_output=True, text=True, timeout=300)


def _profile(*args: str) -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.fixture(scope="session")
def made(tmp_path_factory) -> Path:
    """Two processes: the first writes 2 cycles into one/ (and one cycle each into ranks/rank0 and
    ranks/rank1 as worker "trainer"), the second 1 cycle into two/."""
    d = tmp_path_factory.mktemp("tb")
    _profile(str(d / "one"), "2", str(d / "ranks"))
    _profile(str(d / "two"), "1")
    return d


def _copy(files: list[Path], to: Path) -> list[Path]:
    to.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy(f, to / f.name)) for f in files]


def _worker(p: Path) -> str:
    return tensorboard_name(str(p))[0]


def test_torch_names_its_files_as_expected(made):
    one = sorted((made / "one").iterdir())
    assert len(one) == 2 and all(tensorboard_name(str(f)) for f in one)
    assert len({_worker(f) for f in one}) == 1  # one worker ({host}_{pid}), two time stamps
    (two,) = (made / "two").iterdir()
    assert _worker(two) != _worker(one[0])


def test_cycles_of_one_process_are_one_rank(made, tmp_path):
    old, new = _copy(sorted((made / "one").iterdir(), key=lambda f: tensorboard_name(str(f))[1]), tmp_path / "log")
    res = _aiprof("analyze", str(tmp_path / "log"), "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert [r["rank"] for r in rep["ranks"]] == [0] and rep["capture"]["world_size"] == 1
    notes = [ln for ln in res.stderr.splitlines() if NOTE in ln]
    assert len(notes) == 1 and new.name in notes[0] and "2 of 2" in notes[0] and "--capture" in notes[0]
    # --capture picks the older one
    res = _aiprof("analyze", str(tmp_path / "log"), "--capture", "1", "--json")
    assert res.returncode == 0, res.stderr
    assert old.name in res.stderr and "1 of 2" in res.stderr
    assert [r["rank"] for r in json.loads(res.stdout)["ranks"]] == [0]
    cap = open_capture(str(tmp_path / "log"), capture=1)
    assert [Path(r.source).name for r in cap.ranks] == [old.name]


@pytest.mark.parametrize("n, says", [(3, "has 2 captures"), (0, "numbered from 1")])
def test_capture_out_of_range_is_one_line(made, tmp_path, n, says):
    _copy(sorted((made / "one").iterdir()), tmp_path / "log")
    res = _aiprof("analyze", str(tmp_path / "log"), "--capture", str(n))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().startswith("aiprof: error: --capture") and says in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_capture_without_several_captures_is_refused(made, tmp_path):
    (two,) = _copy(list((made / "two").iterdir()), tmp_path / "log")
    res = _aiprof("analyze", str(two), "--capture", "2")
    assert res.returncode == 2 and "no worker here has several captures" in res.stderr


def test_workers_of_one_folder_stay_ranks(made, tmp_path):
    """Two processes in one log folder: two ranks; the first one's two cycles still count once."""
    log = tmp_path / "log"
    _copy(sorted((made / "one").iterdir()) + list((made / "two").iterdir()), log)
    files = find_trace_files([str(log)])
    assert len(files) == 2 and len({_worker(Path(f)) for f in files}) == 2
    res = _aiprof("analyze", str(log), "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert [r["rank"] for r in rep["ranks"]] == [0, 1] and rep["capture"]["world_size"] == 2
    assert sum(NOTE in ln for ln in res.stderr.splitlines()) == 1


def test_one_worker_name_with_distinct_ranks_stays_ranks(made):
    """A custom worker name shared by ranks (rank0/, rank1/): the ranks they name win."""
    files = find_trace_files([str(made / "ranks")])
    assert len(files) == 2 and {_worker(Path(f)) for f in files} == {"trainer"}
    cap = open_capture(files)
    assert [r.rank for r in cap.ranks] == [0, 1] and {r.meta["rank_from"] for r in cap.ranks} == {"file name"}


def _plain_pair(made: Path, to: Path) -> tuple[Path, Path]:
    """Two real traces that name no rank, under names that are not tensorboard_trace_handler's."""
    to.mkdir()
    a = Path(shutil.copy(sorted((made / "one").iterdir())[0], to / "A.json.gz"))
    b = Path(shutil.copy(next((made / "two").iterdir()), to / "B.json.gz"))
    return a, b


def test_rank_by_order_is_not_cached(made, tmp_path):
    a, b = _plain_pair(made, tmp_path / "t")
    res = _aiprof("analyze", str(b), "--json")
    assert res.returncode == 0, res.stderr
    assert [r["rank"] for r in json.loads(res.stdout)["ranks"]] == [0]
    stored = json.loads((Path(store_dir_for(str(b))) / "meta.json").read_text())
    assert stored["rank"] is None and stored["rank_from"] == "order"
    res = _aiprof("analyze", str(a), str(b), "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert [r["rank"] for r in rep["ranks"]] == [0, 1] and rep["capture"]["world_size"] == 2
    # and in the other order, from the two caches now: B is rank 0
    cap = open_capture([str(b), str(a)])
    assert [Path(r.source).name for r in cap.ranks] == ["B.json.gz", "A.json.gz"]


def test_stale_store_with_rank_by_order_is_renumbered(made, tmp_path):
    """Stores written before this fix hold the order number as the rank: it is re-derived."""
    a, b = _plain_pair(made, tmp_path / "t")
    open_capture([str(b)])
    meta_path = Path(store_dir_for(str(b))) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["rank"] = 0  # what the earlier ingest cached for `analyze B`
    meta_path.write_text(json.dumps(meta))
    cap = open_capture([str(a), str(b)])
    assert [(r.rank, Path(r.source).name) for r in cap.ranks] == [(0, "A.json.gz"), (1, "B.json.gz")]
    assert json.loads(meta_path.read_text())["rank"] == 0  # reused as it is (same source): not rewritten


@pytest.mark.parametrize("name, want", [
    ("node1.cluster.local_4242.1795671329230203753.pt.trace.json.gz", ("node1.cluster.local_4242", 1795671329230203753)),
    ("trainer.17.pt.trace.json", ("trainer", 17)),
    ("rank0.json.gz", None),
    ("vm_5648.pt.trace.json", None),
])
def test_tensorboard_names_with_dotted_hosts(name, want):
    assert tensorboard_name(f"/logs/{name}") == want
