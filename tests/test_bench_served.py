"""``python -m eval bench served`` (eval/bench_served.py): specd serve vs llama-server as a user runs them.
The tool itself runs here on the built-in GGUF without llama-server (``--no-llama``): both specd servers
start, stream every timed request in full and get a rate; the rate's arithmetic and its refusals are
checked on their own."""

from __future__ import annotations

import socket

import pytest

from eval import bench_served as S
from specd.model.builtin import builtin_gguf


def test_the_rate_counts_the_tokens_after_the_first_chunk():
    assert S.decode_rate([10.0, 10.5, 11.0], 11) == pytest.approx(10.0)  # 10 tokens in 1 s
    for bad in ([], [1.0], [2.0, 2.0]):
        with pytest.raises(RuntimeError):
            S.decode_rate(bad, 8)


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        S.parse_args(["--target", str(tmp_path / "none.gguf")])
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        S.parse_args(["--target", str(builtin_gguf()), "--tokens", "1"])
    assert S.main(["--target", str(builtin_gguf()), "--llama-tools", str(tmp_path)]) == 2
    assert "make bench-deps" in capsys.readouterr().err


def _free_pair() -> int:
    """A port p with p + 1 free too (the tool's two specd servers use both)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def test_specd_servers_stream_every_request_and_get_a_rate(capsys):
    port = _free_pair()
    argv = ["--target", str(builtin_gguf()), "--no-llama", "--threads", "1", "--rounds", "1", "--requests", "1"]
    assert S.main([*argv, "--tokens", "12", "--port", str(port)]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and "tok/s" not in ln]
    assert len(rows) == 2 and "(defaults)" in rows[0] and "--spec-mode off" in rows[1]
    assert all(float(r.split("|")[4]) > 0 for r in rows), rows
