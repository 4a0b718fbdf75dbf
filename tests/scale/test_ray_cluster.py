"""`aiprof analyze --cluster` on a real Ray head (`ray start --head`, a subprocess: tests/scale/rayhead.py),
with Ray's token authentication on (Ray >= 2.59 turns it on where a token exists) and off. Each
head has one CPU; its Ray Client server listens on a free port (ray://127.0.0.1:PORT).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiprof.pipeline import build_report
from aiprof.trace.store import find_trace_files, open_capture
from tests.deps import need
from tests.scale.rayhead import Head, analyze, child_env, ray_home, start_head

need("ray")

@pytest.fixture(scope="module")
def token_home(tmp_path_factory) -> Path:
    """A home with a Ray token in ~/.ray/auth_token, as `ray.init()` or `ray get-auth-token
    --generate` leave it."""
    return ray_home(tmp_path_factory.mktemp("client"), uuid.uuid4().hex)


@pytest.fixture(scope="module")
def auth_head(tmp_path_factory, token_home) -> Iterator[Head]:
    """A head with Ray's default where a token exists: RAY_AUTH_MODE unset, token auth on."""
    yield from start_head(tmp_path_factory.mktemp("auth_head"), child_env(token_home))


@pytest.fixture(scope="module")
def open_head(tmp_path_factory, token_home) -> Iterator[Head]:
    """A head without authentication (RAY_AUTH_MODE=disabled), though its home has a token."""
    yield from start_head(tmp_path_factory.mktemp("open_head"), child_env(token_home, RAY_AUTH_MODE="disabled"))


def _in_process(ddp2_dir: Path) -> dict:
    return json.loads(json.dumps(build_report(open_capture(find_trace_files([str(ddp2_dir)])))))


def _first_but_gelu(rep: dict) -> dict:
    """The first cause but UNFUSED_POINTWISE and MISALIGNED_MATMUL: the ddp2 fixture's GPT-2 writes
    its GELU out (transformers' "gelu_new") and has a vocabulary of 50257 (its LM head's matmuls
    on cuBLAS's slow path), on both ranks, priced level with the straggler."""
    return next(c for c in rep["causes"] if c["code"] not in ("UNFUSED_POINTWISE", "MISALIGNED_MATMUL"))


def test_cluster_with_token_auth(auth_head, token_home, ddp2_dir):
    """--cluster HOST:PORT with RAY_AUTH_MODE unset: aiprof finds ~/.ray/auth_token, sends it, and
    the report on the cluster is the in-process one (two ranks: rank 1 the straggler)."""
    p = analyze(child_env(token_home), str(ddp2_dir), "--cluster", auth_head.address, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout)
    assert rep == _in_process(ddp2_dir)
    assert [s["straggler_rank"] for s in rep["cross_rank"]["stragglers"]] == [1]
    assert _first_but_gelu(rep)["code"] == "STRAGGLER" and _first_but_gelu(rep)["rank"] == 1


def test_ray_address_with_token_auth(auth_head, token_home, ddp2_dir):
    """$RAY_ADDRESS instead of --cluster (with --engine ray: two ranks stay in-process otherwise)."""
    p = analyze(child_env(token_home, RAY_ADDRESS=auth_head.address), str(ddp2_dir), "--engine", "ray", "--json",
                 "--stats", str(ddp2_dir.parent / "stats.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout) == _in_process(ddp2_dir)
    assert json.loads((ddp2_dir.parent / "stats.json").read_text())["engine"] == "ray"


def test_cluster_without_auth(open_head, token_home, tmp_path, ddp2_dir):
    """A head without authentication: reached by a client that has a token (sent, ignored) and by
    one that has none."""
    for home in (token_home, ray_home(tmp_path, None)):
        p = analyze(child_env(home), str(ddp2_dir), "--cluster", open_head.address, "--json")
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout) == _in_process(ddp2_dir)


def test_token_head_without_a_token_is_one_line(auth_head, tmp_path, ddp2_dir):
    """A client with no token: one line naming what to set, exit 2, no traceback."""
    p = analyze(child_env(ray_home(tmp_path, None)), str(ddp2_dir), "--cluster", auth_head.address)
    assert p.returncode == 2, p.stderr[-3000:]
    (line,) = p.stderr.strip().splitlines()  # Ray's own retry warnings are kept out
    assert line.startswith(f"aiprof: error: the Ray cluster at {auth_head.address} refused this client")
    assert "$RAY_AUTH_TOKEN" in line
    assert p.stdout == ""


def test_auth_mode_token_without_a_token_is_one_line(auth_head, tmp_path, ddp2_dir):
    """RAY_AUTH_MODE=token set by the user but no token anywhere: said before connecting."""
    p = analyze(child_env(ray_home(tmp_path, None), RAY_AUTH_MODE="token"), str(ddp2_dir), "--cluster", auth_head.address)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "aiprof: error: RAY_AUTH_MODE=token but no Ray token was found: set $RAY_AUTH_TOKEN or "
        "$RAY_AUTH_TOKEN_PATH to the cluster's token (the head's ~/.ray/auth_token)"]


def test_ray_client_with_token_auth(auth_head, token_home, ddp2_dir):
    """--cluster ray://HOST:PORT (Ray Client) with RAY_AUTH_MODE unset: aiprof turns token auth on
    as for a GCS address, Ray Client sends the token on every gRPC call, the head's client server
    accepts it, and the report is the in-process one."""
    p = analyze(child_env(token_home), str(ddp2_dir), "--cluster", auth_head.client, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout)
    assert rep == _in_process(ddp2_dir)
    assert _first_but_gelu(rep)["code"] == "STRAGGLER" and _first_but_gelu(rep)["rank"] == 1


def test_ray_client_without_auth(open_head, token_home, ddp2_dir):
    """Ray Client to a head without authentication, from a client that has a token (sent, ignored)."""
    p = analyze(child_env(token_home), str(ddp2_dir), "--cluster", open_head.client, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout) == _in_process(ddp2_dir)


def test_ray_client_without_a_token_is_one_line(auth_head, tmp_path, ddp2_dir):
    """Ray Client with no token to a head with token auth: every ping is UNAUTHENTICATED, Ray gives
    up after its retries (~30 s), and aiprof says what to set in one line, exit 2."""
    p = analyze(child_env(ray_home(tmp_path, None)), str(ddp2_dir), "--cluster", auth_head.client)
    assert p.returncode == 2, p.stderr[-3000:]
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"aiprof: error: the Ray cluster at {auth_head.client} refused this client")
    assert "$RAY_AUTH_TOKEN" in line and "Ray Client port" in line
    assert p.stdout == ""
