"""The soak (``python -m eval load soak``, eval/soak.py) as a test: N concurrent streaming clients
against `specd serve` started as a subprocess on the shared stories260K pair; zero lost/duplicated/
reordered deltas, streamed text == in-process greedy text, zero errors, flat server RSS after
warm-up, every KV block freed, exit 0.

Default suite: 4 clients for 15 s (about 40 s with start-up; ~400 requests on 2 cores, 10x the floor
asserted). `-m slow`: 8 clients for 5 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import DRAFT, ROOT, TARGET


def run_soak(tmp_path, clients: int, minutes: float) -> dict:
    out = tmp_path / "soak.json"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SPECD_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")
    }
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "eval",
        "load",
        "soak",
        "--target",
        str(TARGET),
        "--draft",
        str(DRAFT),
        "--clients",
        str(clients),
        "--minutes",
        str(minutes),
        "--json",
        str(out),
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=minutes * 60 + 300)
    report = r.stdout[-4000:] + r.stderr[-4000:]
    assert out.exists(), f"no summary (rc {r.returncode}):\n{report}"
    s = json.loads(out.read_text())
    print("\n".join(ln for ln in r.stdout.splitlines() if not ln.startswith("{")))
    assert r.returncode == 0 and s["ok"], f"soak failed: {s['checks']}\n{report}"
    return s


@pytest.mark.timeout(420)
def test_soak_short(tmp_path):
    s = run_soak(tmp_path, clients=4, minutes=0.25)
    assert s["errors"] == {} and s["violations"] == 0 and s["disconnects"] == 0
    assert s["requests"] >= 40 and s["tokens"] > 0
    assert s["reference"] == "in-process Engine.generate" and s["reference_pairs"] == 32
    assert set(s["modes"]) == {"off", "chain", "tree", "auto"}
    assert s["kv_blocks_used_after"] == [0, 0] and s["server_exit_status"] == 0
    assert s["checks"]["rss_flat"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_long(tmp_path):
    s = run_soak(tmp_path, clients=8, minutes=5)
    assert s["errors"] == {} and s["violations"] == 0 and s["requests"] >= 500
