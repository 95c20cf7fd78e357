"""Tensor parallelism for the target (``--tensor-parallel-size``, ``specd.engine.tensor_parallel``):
TP=2 over gloo on this CPU gives token-identical greedy output to TP=1 (fp32), plain and
speculative (draft-model chains and trees, prompt lookup), on the tiny stories260K pair and on the
built-in model (3 KV heads: an uneven split); a killed rank ends the engine and the daemon within a
bounded time with a clear reason; no worker process outlives its engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DRAFT, ROOT, TARGET, http_status

PROMPTS = [[1, 400, 30, 20], [1, 50, 60, 70, 80, 90, 100], [1, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]
KILL_BOUND_S = 30.0


def _cfg(tp: int, draft: bool = True, **kw):
    from specd.config import CacheConfig, EngineConfig, SpecConfig

    return EngineConfig(
        target=str(TARGET), draft=str(DRAFT) if draft else None, device="cpu", dtype="float32",
        tensor_parallel_size=tp, cache=CacheConfig(num_blocks=96), spec=SpecConfig(mode="tree", adaptive=False), **kw,
    )  # fmt: skip


def _run(engine, mode: str, prompts=PROMPTS, max_tokens: int = 32) -> list:
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [s.tokens[len(p) :] for s, p in zip(engine.generate(prompts, sp, SpecParams(mode=mode)), prompts)]


def _gone(pid: int) -> bool:
    """No such process (a zombie counts as alive: nobody reaped it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "X"


@pytest.fixture(scope="module")
def tiny_engines(shared_pair):
    """(TP=1 engine, TP=2 engine) on the stories260K pair (KVH 4: 2 per rank)."""
    from specd.engine.engine import Engine

    t, d = shared_pair
    one, two = Engine(_cfg(1), target=t, draft=d), Engine(_cfg(2), target=t, draft=d)
    yield one, two
    two.close()


@pytest.mark.parametrize("mode", ["off", "chain", "tree", "ngram"])
def test_tp2_greedy_equals_tp1_on_the_tiny_pair(tiny_engines, mode):
    one, two = tiny_engines
    tp = two.tp
    f0, c0, k0 = tp.forwards, tp.allreduce_calls, tp.kv_copies
    assert _run(two, mode) == _run(one, mode)
    # two all-reduces per layer per forward; each rank's cache holds its own 2 of the 4 KV heads
    assert tp.allreduce_calls - c0 == 2 * two.target.config.num_layers * (tp.forwards - f0) > 0
    assert two.cache.kv.shape[-2] == 2 and one.cache.kv.shape[-2] == 4
    if mode == "tree":  # partial acceptance off the first branch: KV compaction ran on every rank
        assert tp.kv_copies > k0
    if mode in ("chain", "tree"):
        st = two.stats
        assert 0 < st.accepted_tokens < st.draft_tokens  # a weak draft: partial acceptance and rollback


def test_lm_head_on_rank0_gives_the_same_tokens(shared_pair, tiny_engines):
    from specd.engine.engine import Engine

    one, _ = tiny_engines
    t, _ = shared_pair
    e = Engine(_cfg(2, draft=False, tensor_parallel_lm_head="rank0"), target=t)
    try:
        assert _run(e, "off", max_tokens=16) == _run(one, "off", max_tokens=16)
    finally:
        e.close()


def test_builtin_model_tp2_equals_tp1_fp32():
    """SmolLM2-135M: 9 query / 3 KV heads, so rank 0 owns 1 KV head (3 query heads), rank 1 owns 2."""
    from specd.engine.engine import Engine
    from specd.model import builtin
    from specd.model.loader import load_model

    path = builtin.ensure(download=False)
    t = load_model(path, "cpu", "float32", quantization="none", progress=False)
    tok = t.tokenizer
    prompts = [tok("The capital of France is")["input_ids"], tok("a b c a b c a b c a b")["input_ids"]]
    cfg = _cfg(1, draft=False)
    one = Engine(type(cfg)(**{**cfg.__dict__, "target": str(path)}), target=t)
    two = Engine(type(cfg)(**{**cfg.__dict__, "target": str(path), "tensor_parallel_size": 2}), target=t)
    try:
        assert two.cache.kv.shape[-2] == 1 and one.cache.kv.shape[-2] == 3
        for mode in ("off", "ngram"):
            assert _run(two, mode, prompts, 12) == _run(one, mode, prompts, 12)
        assert two.stats.accepted_tokens > 0  # prompt lookup drafted and was (partly) accepted
    finally:
        two.close()


def test_killed_rank_ends_the_engine_with_a_clear_error_and_no_orphans(shared_pair):
    from specd.engine.engine import Engine
    from specd.engine.tensor_parallel import RankFailure

    t, _ = shared_pair
    e = Engine(_cfg(2, draft=False), target=t)
    try:
        ref = _run(e, "off", max_tokens=8)
        assert len(ref[0]) == 8
        pid = e.tp.procs[0].pid
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while not e.has_work():  # the watcher notices while the engine idles
            assert time.monotonic() - t0 < KILL_BOUND_S
            time.sleep(0.05)
        with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) died \(killed by SIGKILL\)"):
            _run(e, "off", max_tokens=8)
        assert time.monotonic() - t0 < KILL_BOUND_S
        assert e.tp.failed is not None
    finally:
        e.close()
    assert _gone(pid)


def test_a_rank_killed_mid_forward_fails_the_step_not_a_request(shared_pair):
    """Killed while rank 0 waits in a collective: RankFailure escapes the step (no request is blamed)."""
    from specd.engine.engine import Engine
    from specd.engine.tensor_parallel import RankFailure

    t, _ = shared_pair
    e = Engine(_cfg(2, draft=False), target=t)
    pid = e.tp.procs[0].pid
    real = e.tp.comm.reduce
    calls = []

    def reduce_then_kill(x):
        calls.append(1)
        if len(calls) == 3:
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        return real(x)

    e.tp.comm.reduce = reduce_then_kill
    try:
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1"):
            _run(e, "off", max_tokens=4)
        assert time.monotonic() - t0 < KILL_BOUND_S
        assert e.health.failed_requests["forward"] == 0
    finally:
        e.close()


def test_workers_exit_when_the_engine_closes(shared_pair):
    from specd.engine.engine import Engine

    t, _ = shared_pair
    e = Engine(_cfg(2, draft=False), target=t)
    procs = list(e.tp.procs)
    assert all(p.is_alive() for p in procs)
    e.close()
    assert [p.exitcode for p in procs] == [0] and all(_gone(p.pid) for p in procs)
    e.close()  # idempotent


def test_workers_exit_when_rank0_is_killed():
    """Rank 0's process killed outright (no close): its workers see end of file and exit."""
    code = (
        "import os, sys, time, torch\n"
        "from specd.engine.engine import Engine\n"
        "from tests.test_tensor_parallel import _cfg\n"
        "if __name__ == '__main__':\n"
        "    e = Engine(_cfg(2, draft=False))\n"
        "    print(e.tp.procs[0].pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(p.stdout.readline())
        p.kill()
        p.wait(10)
        end = time.monotonic() + KILL_BOUND_S
        while not _gone(worker):
            assert time.monotonic() < end, "worker outlived rank 0"
            time.sleep(0.1)
    finally:
        if p.poll() is None:
            p.kill()


def test_what_cannot_be_split_is_refused_in_one_line(shared_pair):
    from specd.config import EngineConfig
    from specd.engine.engine import Engine
    from specd.model.loader import LoadError, load_model
    from specd.model.tp_shard import check_shardable, plan, split

    with pytest.raises(ValueError, match="quantization int8 cannot be combined with --tensor-parallel-size 2"):
        EngineConfig(target="x", quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(target="x", tensor_parallel_size=0)
    t, _ = shared_pair
    with pytest.raises(ValueError, match="at least 8 KV heads; the target has 4"):
        check_shardable(t.config, 8)
    q = load_model(TARGET, "cpu", "float32", quantization="int8")
    with pytest.raises(LoadError, match="unquantized target weights"):
        Engine(_cfg(2, draft=False), target=q)
    assert split(3, 2) == [(0, 1), (1, 3)] and split(1536, 2) == [(0, 768), (768, 1536)]
    p1 = plan(t.config, 1, 2)  # H=8, KVH=4, I=172, V=512
    assert (p1.kv_heads, p1.q_heads, p1.inter, p1.vocab) == ((2, 4), (4, 8), (86, 172), (256, 512))


def test_the_option_reaches_the_engine_config(monkeypatch):
    from specd.options import apply_env_and_toml, engine_config, serve_parser

    a = apply_env_and_toml(serve_parser(), ["--target", "x", "--tensor-parallel-size", "2"], "serve")
    assert engine_config(a).tensor_parallel_size == 2
    monkeypatch.setenv("SPECD_TENSOR_PARALLEL_SIZE", "4")
    a = apply_env_and_toml(serve_parser(), ["--target", "x"], "serve")
    assert engine_config(a).tensor_parallel_size == 4


def _descendants(pid: int) -> set:
    """Every live process below ``pid`` (from /proc)."""
    kids: dict = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                st = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kids.setdefault(int(st[1]), []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _spawned_worker(pid: int) -> int | None:
    for c in _descendants(pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return c
    return None


def test_daemon_exits_non_zero_when_a_rank_is_killed(tmp_path):
    """`specd serve --tensor-parallel-size 2` (engine process, gloo workers below it): SIGKILL rank 1
    and the daemon logs why and exits 1 within the bound, leaving no process behind."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specd", "serve", "--target", str(TARGET), "--device", "cpu", "--dtype", "float32"]
    cmd += ["--num-blocks", "64", "--port", str(port), "--grpc-port", "0", "--tensor-parallel-size", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=f, start_new_session=True)
    try:
        end = time.monotonic() + 120
        while http_status(port, "/readyz") != 200:
            assert p.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.2)
        worker = _spawned_worker(p.pid)
        assert worker is not None, "no tensor-parallel worker below the daemon"
        tree = _descendants(p.pid)
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        rc = p.wait(KILL_BOUND_S)
        assert rc == 1 and time.monotonic() - t0 < KILL_BOUND_S
        text = log.read_text()
        assert "tensor-parallel rank 1" in text and "killed by SIGKILL" in text, text[-3000:]
        end = time.monotonic() + 10
        while not all(_gone(c) for c in tree):
            assert time.monotonic() < end, f"left behind: {[c for c in tree if not _gone(c)]}"
            time.sleep(0.1)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait(10)


def test_per_rank_threads_never_oversubscribe():
    from specd.engine.tensor_parallel import per_rank_threads

    assert per_rank_threads(None, 2, 2) == 1 and per_rank_threads(None, 2, 16) == 8
    assert per_rank_threads(None, 4, 2) == 1 and per_rank_threads(3, 2, 16) == 3
