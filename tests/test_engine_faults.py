"""One bad request never breaks the engine: validation at the edge, atomic steps, honest health.

- The reproducer of the outage (``top_k = 2**63`` over the websocket): refused at the edge, naming
  the field; with validation bypassed, the request fails alone and the engine is intact.
- Fault injection: an exception raised as each stage starts (draft, forward, verify, commit, emit)
  for one request ends that request alone with ``finish_reason: "error"``; every other request
  produces exactly its clean run's tokens (greedy and seeded sampling); no KV block is held after;
  health and metrics count the failure by stage.
- Scheduling failures: back-off (no spinning), every request failed after 3 in a row, unhealthy
  after ``max_failed_steps``; ``/readyz`` and ``/healthz`` 503 and the daemon exits 1 after
  ``--unhealthy-exit-s``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
import pytest
from websockets.sync.client import connect

from specd.engine.chaos import STEP_STAGES, FaultInjector, InjectedFault, Req, canary, check_clean, run_case, with_hook
from specd.engine.engine import FAIL_ALL_AFTER, RequestError
from specd.engine.health import RateLimitedLog, backoff_s, unhealthy_reason
from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams
from tests.conftest import http_status, metrics_text, serve_args, serve_engine, ws_collect

pytestmark = pytest.mark.timeout(300)

TREE, CHAIN, OFF = SpecParams("tree"), SpecParams("chain"), SpecParams("off")


@pytest.fixture(scope="module")
def engine(shared_pair):
    # small prefill chunks: a long prompt is mid-prefill when its batch fails
    return serve_engine(shared_pair, num_blocks=256, prefill_chunk=16)


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    long = " ".join(["Once upon a time, there was a little girl named Lily who liked to play."] * 4)
    return {
        "short": tok("Once upon a time")["input_ids"],
        "dog": tok("The dog ran to the")["input_ids"],
        "long": tok(long)["input_ids"],
    }


@pytest.fixture(scope="module")
def canary_ref(shared_pair, prompts):
    """The canary's output on a fresh engine."""
    return canary(serve_engine(shared_pair, num_blocks=256, prefill_chunk=16), prompts["short"])


def _greedy(n=10):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _innocents(prompts) -> list:
    """Requests of fixed speculation modes (so a clean run is reproducible token for token)."""
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    return [
        Req("g-tree", prompts["dog"], _greedy(), TREE),
        Req("g-chain", prompts["short"], _greedy(), CHAIN),
        Req("s-tree", prompts["dog"], sampled, TREE),
        Req("g-long", prompts["long"], _greedy(6), OFF),
        Req("s-off", prompts["short"], sampled, OFF),
    ]


# validation at the edge ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(top_k=2**63), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(temperature=101.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_tokens=2**63), "max_tokens"),
        (dict(stop=["x" * 257]), "stop"),
        (dict(stop=["a"] * 17), "stop"),
        (dict(stop_token_ids=[2**63]), "stop_token_ids"),
        (dict(stop_token_ids=list(range(257))), "stop_token_ids"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_validation_refuses_what_the_engine_cannot_represent(kw, field):
    from specd.serving import request_build as RB

    with pytest.raises(RequestError) as ei:
        RB.sampling_params(**{"max_tokens": 4, **kw})
    assert ei.value.code == "invalid_request" and field in str(ei.value)


def test_representable_extremes_are_accepted_and_normalized(engine, prompts):
    p = SamplingParams(top_k=2**63 - 1, seed=-1, temperature=1e-9, top_p=1e-300, max_tokens=2)
    assert p.seed == 2**64 - 1 and p.temperature == 0.0 and p.top_p == 1e-6
    with pytest.raises(RequestError) as ei:  # stop ids are checked against the vocabulary
        engine.validate(prompts["short"], SamplingParams(stop_token_ids=(engine.vocab_size,)))
    assert "stop_token_ids" in str(ei.value)
    # top_k at or above the vocabulary is off: the same seeded sample as top_k = 0
    outs = []
    for k in (0, engine.vocab_size, 2**63 - 1):
        sp = SamplingParams(temperature=1.0, top_k=k, seed=7, max_tokens=12, ignore_eos=True)
        outs.append(engine.generate([prompts["dog"]], sp, TREE)[0].output_ids)
    assert outs[0] == outs[1] == outs[2]


# the reproducer -------------------------------------------------------------------------------------
def test_reproducer_refused_over_the_websocket(engine, prompts):
    from specd.serving.app import ServerThread

    srv = ServerThread(serve_args(num_blocks=256), engine).start()
    try:
        a = {
            "type": "generate",
            "id": "a",
            "prompt": "Once upon a time",
            "max_tokens": 8,
            "temperature": 0,
            "speculation": {"mode": "tree"},
        }
        b = {
            "type": "generate",
            "id": "b",
            "prompt": "Once upon a time",
            "max_tokens": 4,
            "temperature": 1,
            "top_k": 9223372036854775808,
            "speculation": {"mode": "tree"},
        }
        with connect(f"ws://127.0.0.1:{srv.port}/ws") as ws:
            ws.send(orjson.dumps(a).decode())
            first, done = ws_collect(ws, "a")
            assert done["finish_reason"] == "length"
            ws.send(orjson.dumps(b).decode())
            _, err = ws_collect(ws, "b")
            assert err["type"] == "error" and err["code"] == "invalid_request" and "top_k" in err["message"]
            ws.send(orjson.dumps(a).decode())
            again, done = ws_collect(ws, "a")
            assert done["finish_reason"] == "length"
            assert [t for d in again for t in d["token_ids"]] == [t for d in first for t in d["token_ids"]]
        assert http_status(srv.port, "/readyz") == 200 and http_status(srv.port, "/healthz") == 200
    finally:
        srv.stop()


def test_reproducer_with_validation_bypassed_fails_alone(engine, prompts, canary_ref):
    """top_k = 2**63 forced past validation: it fails in its step alone; a request running beside
    it and every later request produce exactly their clean tokens; nothing leaks."""
    hostile = Req("b", prompts["short"], SamplingParams(temperature=1.0, max_tokens=4), TREE, hostile=("top_k", 2**63))
    beside = Req("a", prompts["short"], _greedy(12), TREE)
    res = run_case(engine, [beside, hostile])
    assert res.reasons == {"a": "length", "b": "error"} and "Overflow" in res.errors["b"]
    assert res.outputs["a"] == canary_ref
    check_clean(engine)
    for _ in range(3):
        assert canary(engine, prompts["short"]) == canary_ref
    check_clean(engine)


# fault injection -------------------------------------------------------------------------------------
@pytest.mark.parametrize("skip", [0, 2], ids=["first-step", "mid-request"])
@pytest.mark.parametrize("stage", STEP_STAGES)
def test_a_fault_in_any_stage_fails_only_its_request(engine, prompts, canary_ref, stage, skip):
    clean = run_case(engine, _innocents(prompts))
    assert all(r in ("length", "stop") for r in clean.reasons.values())
    culprit = Req("bad", prompts["dog"], SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True), TREE)
    inj = FaultInjector(stage, {"bad"}, skip=skip)  # with skip: it emits tokens first
    before = engine.health_snapshot()
    res = with_hook(engine, inj, lambda: run_case(engine, _innocents(prompts) + [culprit]))
    assert inj.fired >= 1
    assert res.reasons["bad"] == "error" and f"{stage} failed: InjectedFault" in res.errors["bad"]
    for r in _innocents(prompts):
        assert res.reasons[r.rid] == clean.reasons[r.rid] and res.outputs[r.rid] == clean.outputs[r.rid], r.rid
    after = engine.health_snapshot()
    assert after["failed_requests"][stage] == before["failed_requests"][stage] + 1
    assert after["failed_steps"][stage] > before["failed_steps"][stage] and after["consecutive_failed"] == 0
    check_clean(engine)
    assert canary(engine, prompts["short"]) == canary_ref


def test_a_fault_for_every_request_fails_them_all_and_the_engine_recovers(engine, prompts, canary_ref):
    reqs = _innocents(prompts)
    inj = FaultInjector("forward", {r.rid for r in reqs})
    res = with_hook(engine, inj, lambda: run_case(engine, reqs))
    assert set(res.reasons.values()) == {"error"}
    check_clean(engine)
    assert canary(engine, prompts["short"]) == canary_ref and engine.health_snapshot()["consecutive_failed"] == 0


# scheduling failures, back-off, health --------------------------------------------------------------
class _BrokenSchedule:
    def __init__(self, real):
        self.real, self.broken, self.calls = real, True, 0

    def __call__(self):
        self.calls += 1
        if self.broken:
            raise RuntimeError("scheduler bug")
        return self.real()


def test_schedule_failures_fail_everyone_after_three_then_recover(engine, prompts, canary_ref):
    broken = _BrokenSchedule(engine.scheduler.schedule)
    engine.scheduler.schedule = broken
    try:
        for r in _innocents(prompts)[:3]:
            engine.add_request(r.prompt, r.params, r.spec, request_id=r.rid)
        outs = [engine.step() for _ in range(FAIL_ALL_AFTER)]
        assert outs[:-1] == [[], []] and sorted(o.finish_reason for o in outs[-1]) == ["error"] * 3
        assert "schedule failed" in outs[-1][0].error
        snap = engine.health_snapshot()
        assert snap["consecutive_failed"] == FAIL_ALL_AFTER and snap["failed_requests"]["schedule"] >= 3
        assert unhealthy_reason(snap, time.monotonic(), False, FAIL_ALL_AFTER, 60.0) == "3 engine steps in a row failed"
        check_clean(engine)
    finally:
        broken.broken = False
        engine.scheduler.schedule = broken.real
    assert canary(engine, prompts["short"]) == canary_ref
    assert engine.health_snapshot()["consecutive_failed"] == 0


def test_failing_steps_back_off_instead_of_spinning(engine, prompts):
    """An exception escaping ``Engine.step()`` with work that cannot be failed: the loop backs off
    (a handful of steps a second, not thousands), turns unhealthy, and recovers when steps do."""
    from specd.serving.async_engine import AsyncEngine

    assert [backoff_s(n) for n in (0, 1, 2, 20)] == [0.0, 0.02, 0.04, 1.0]
    calls = [0]
    real_step, real_fail_all = engine.step, engine.fail_all

    def bad_step():
        calls[0] += 1
        raise RuntimeError("engine bug")

    async def main():
        ae = AsyncEngine(engine, max_queue=8, max_failed_steps=3)
        await ae.start()
        engine.step, engine.fail_all = bad_step, lambda exc, stage="step": []
        engine.add_request(prompts["short"], _greedy(), TREE, request_id="stuck")
        ae.wake()
        await asyncio.sleep(1.0)
        assert 3 <= calls[0] <= 10 and ae.num_step_errors == calls[0]
        assert ae.unhealthy_reason().endswith("engine steps in a row failed")
        engine.step, engine.fail_all = real_step, real_fail_all
        engine.abort("stuck")
        for _ in range(300):
            if not engine.has_work() and ae.unhealthy_reason() is None:
                break
            await asyncio.sleep(0.01)
        assert ae.unhealthy_reason() is None
        await ae.stop()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.step, engine.fail_all = real_step, real_fail_all
    check_clean(engine)


def test_health_endpoints_and_metrics_follow_failures(engine, prompts):
    from specd.serving.app import ServerThread

    srv = ServerThread(serve_args(num_blocks=256, max_failed_steps=2), engine).start()
    try:
        base = f"ws://127.0.0.1:{srv.port}/ws"
        msg = {
            "type": "generate",
            "prompt": "Once upon a time",
            "max_tokens": 6,
            "temperature": 0,
            "speculation": {"mode": "tree"},
        }
        engine.fault_hook = FaultInjector("verify", {f"ws{k}:r{i}" for k in range(8) for i in range(3)})
        with connect(base) as ws:
            for i in range(3):
                ws.send(orjson.dumps({**msg, "id": f"r{i}"}).decode())
                _, done = ws_collect(ws, f"r{i}")
                assert done["type"] == "done" and done["finish_reason"] == "error"
                assert done["error"]["code"] == "internal" and "verify failed" in done["error"]["message"]
        assert http_status(srv.port, "/readyz") == 503 and http_status(srv.port, "/healthz") == 503
        metrics = metrics_text(srv.port)
        assert 'specd_engine_failed_requests_total{stage="verify"}' in metrics and "specd_engine_healthy 0" in metrics
        assert 'specd_requests_total{finish_reason="error"} 3' in metrics
        engine.fault_hook = None
        with connect(base) as ws:  # a request that completes makes the engine healthy again
            ws.send(orjson.dumps({**msg, "id": "ok"}).decode())
            _, done = ws_collect(ws, "ok")
            assert done["finish_reason"] == "length"
        assert http_status(srv.port, "/readyz") == 200 and http_status(srv.port, "/healthz") == 200
    finally:
        engine.fault_hook = None
        srv.stop()


def test_daemon_exits_nonzero_after_staying_unhealthy(engine, prompts):
    """``App.main`` (what ``specd serve`` runs) returns 1 once the engine has been unhealthy for
    ``--unhealthy-exit-s``: systemd's ``Restart=`` brings up a fresh process."""
    from specd.engine.commands import Submit
    from specd.serving.app import App

    broken = _BrokenSchedule(engine.scheduler.schedule)
    app = App(serve_args(num_blocks=256, max_failed_steps=1, unhealthy_exit_s=0.3), engine)

    async def main():
        async def poke():
            while app.ae is None:
                await asyncio.sleep(0.01)
            engine.scheduler.schedule = broken
            app.ae.submit(Submit("x", prompts["short"], _greedy(), TREE), lambda item: None)

        t = asyncio.ensure_future(poke())
        rc = await asyncio.wait_for(app.main(), 60)
        await t
        return rc

    t0 = time.monotonic()
    try:
        assert asyncio.run(main()) == 1
    finally:
        engine.scheduler.schedule = broken.real
    assert time.monotonic() - t0 < 30
    check_clean(engine)


# quiet logs --------------------------------------------------------------------------------------
def test_repeated_errors_log_once_per_interval_with_a_count(caplog):
    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("specd.test"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="specd.test"):
        logged = [rl.error("k", "step failed: %s", "boom") for _ in range(1000)]
        now[0] = 11.0
        logged.append(rl.error("k", "step failed: %s", "boom"))
        logged.append(rl.error("other", "another failure"))
    assert logged.count(True) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["step failed: boom", "step failed: boom (and 999 more times in the last 11 s)", "another failure"]


def test_a_failing_stage_does_not_flood_the_log(engine, prompts, caplog):
    reqs = [Req(f"r{i}", prompts["short"], _greedy(4), TREE) for i in range(30)]
    with caplog.at_level(logging.ERROR, logger="specd.engine"):
        res = with_hook(engine, FaultInjector("draft", {r.rid for r in reqs}), lambda: run_case(engine, reqs))
    assert set(res.reasons.values()) == {"error"}
    assert len([r for r in caplog.records if "InjectedFault" in r.getMessage()]) <= 2
    check_clean(engine)


def test_fault_injector_fires_for_its_targets_in_its_stage_only():
    a, b = type("S", (), {"request_id": "a"})(), type("S", (), {"request_id": "b"})()
    inj = FaultInjector("verify", {"a"}, times=1, skip=1)
    inj("draft", [a])
    inj("verify", [b])
    inj("verify", [a])  # skipped once
    with pytest.raises(InjectedFault):
        inj("verify", [b, a])
    inj("verify", [a])  # fired its one time
    assert inj.fired == 1
