"""Real CPU captures of a tiny transformers model generating, serving (continuous batching) and
training, made once per test session by scripts/capture_serving.py (torch.profiler, no GPU)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MODES = ("generate", "generate_nostack", "generate_steps", "train", "cb", "cb_stall")



@pytest.fixture(scope="session")
def captures(tmp_path_factory) -> Path:
    """Folder with MODE.json.gz and MODE.truth.json for every mode."""
    out = tmp_path_factory.mktemp("serving")
    env = dict(os.environ, PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error")
    p = subprocess.run([sys.executable, str(HERE / "scripts" / "capture_serving.py"), str(out), *MODES],
                       check=False, capture_output=True, text=True, timeout=900, env=env)
    missing = [m for m in MODES if not (out / f"{m}.truth.json").exists()]
    assert not missing, f"capture failed for {missing}: {p.stderr[-3000:]}"
    return out
