"""Shared test fixtures: real H200 traces (copied from the project's fixtures into tests/data).

Ingest writes a cache folder beside its input, so tests get copies in a temporary folder.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


def _copy(tmp_path_factory, *names: str) -> Path:
    d = tmp_path_factory.mktemp("traces")
    for n in names:
        shutil.copy(DATA / n, d / n)
    return d


@pytest.fixture(scope="session")
def gpt2_stall(tmp_path_factory) -> Path:
    """GPT-2 training, 1 H200; step 3 has an 80 ms sleep in get_batch (GPU idles)."""
    return _copy(tmp_path_factory, "gpt2_train_stall.json.gz") / "gpt2_train_stall.json.gz"


@pytest.fixture(scope="session")
def ddp2_dir(tmp_path_factory) -> Path:
    """GPT-2 DDP on 2 H200s; rank 1 does extra matmuls every step (the straggler)."""
    return _copy(tmp_path_factory, "ddp2_slow1_rank0.json.gz", "ddp2_slow1_rank1.json.gz")


@pytest.fixture(scope="session")
def memsnap(tmp_path_factory) -> Path:
    """torch.cuda.memory._snapshot() of the GPT-2 stall run."""
    return _copy(tmp_path_factory, "gpt2_train_stall_memsnap.pickle.gz") / "gpt2_train_stall_memsnap.pickle.gz"


@pytest.fixture(scope="session")
def ddp4_dir(tmp_path_factory) -> Path:
    """4-layer GPT-2 DDP on 4 H200s; rank 2 runs 40 extra matmuls per step (the straggler)."""
    return _copy(tmp_path_factory, *(f"ddp4_slow2_rank{r}.json.gz" for r in range(4)))
