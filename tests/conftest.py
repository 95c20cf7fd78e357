"""Test set-up. TRITON_INTERPRET must be set before anything imports triton."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
try:
    import torch as _torch

    # tiny models: one thread avoids pool contention (2 threads were 10-30x slower on a busy 2-core box)
    _torch.set_num_threads(1)

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except Exception:  # pragma: no cover
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECD_SHARED", ROOT.parent / "shared"))
TARGET = SHARED / "models" / "stories260K"
DRAFT = SHARED / "models" / "stories260K-draft-1L64"


def _kernels_dir() -> Path:
    from specd.model.errors import cache_dir

    return cache_dir() / "kernels"


KERNELS = _kernels_dir()  # the real cache's built CPU kernels (read before any test points SPECD_CACHE_DIR away)


def private_cache(tmp_path: Path, monkeypatch) -> Path:
    """``SPECD_CACHE_DIR`` set to a fresh ``tmp_path/cache`` (models, converted folders, timings) whose
    ``kernels/`` is the real cache's: the CPU kernel, keyed by its source's hash, is built once, not
    once per test or subprocess (a build is ~15 s of one core)."""
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    KERNELS.mkdir(parents=True, exist_ok=True)
    if not (cache / "kernels").is_symlink():
        (cache / "kernels").symlink_to(KERNELS)
    monkeypatch.setenv("SPECD_CACHE_DIR", str(cache))
    return cache


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow soak/load tests")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("SPECD_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: opt in with --runslow or SPECD_SLOW=1 (make test-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_pair():
    """(target LoadedModel, draft LoadedModel) for the shared stories260K pair, loaded once."""
    from specd.model.loader import load_model

    return load_model(TARGET, "cpu", "float32"), load_model(DRAFT, "cpu", "float32")


@pytest.fixture(scope="session")
def hf_target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(TARGET)).eval()


def tiny_llama_folder(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, hidden 64, 4/2 heads, vocabulary 128, seed 0) saved by transformers."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny_llama")
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def serve_args(num_blocks: int = 512, log_level: str = "warning", **kw):
    """`specd serve` arguments for an in-process server on the shared pair (loopback, free ports)."""
    from specd.cli import build_parser

    a = build_parser().parse_args(
        [
            "serve",
            "--target",
            str(TARGET),
            "--draft",
            str(DRAFT),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--num-blocks",
            str(num_blocks),
            "--port",
            "0",
            "--grpc-port",
            "0",
            "--log-level",
            log_level,
        ]
    )
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def serve_engine(shared_pair, **kw):
    """An Engine configured like `specd serve` with ``serve_args(**kw)``, on the shared loaded pair."""
    from specd.cli import engine_config
    from specd.engine.engine import Engine

    t, d = shared_pair
    return Engine(engine_config(serve_args(**kw)), target=t, draft=d)


def http_status(port: int, path: str):
    """HTTP status of GET http://127.0.0.1:port/path (None when nothing answers)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def http_get(port: int, path: str) -> tuple:
    """(status, body bytes) of GET http://127.0.0.1:port/path."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metrics_text(port: int) -> str:
    """GET /metrics with every sample's ``replica`` label checked (it is this daemon's default,
    ``<hostname>:<port>``) and removed, so tests can match the other labels exactly."""
    import re
    import socket

    status, body = http_get(port, "/metrics")
    assert status == 200, body
    text = body.decode()
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    want = f'{{replica="{socket.gethostname()}:{port}"'
    assert samples and all(ln.split(" ")[0].count(want) == 1 for ln in samples), samples[:3]
    return re.sub(r'\{replica="[^"]*"([,}])', lambda m: "{" if m.group(1) == "," else "", text)


def ws_collect(ws, rid, timeout=60.0):
    """All websocket frames for request ``rid`` up to its done/error (others are skipped):
    (deltas, final frame). ``ws``: a websockets sync client connection."""
    import time

    import orjson

    deltas, end = [], time.monotonic() + timeout
    while True:
        m = orjson.loads(ws.recv(timeout=max(0.1, end - time.monotonic())))
        if m.get("id") != rid:
            continue
        if m["type"] == "delta":
            deltas.append(m)
        else:
            return deltas, m
