"""Unit tests of the serving pieces without sockets: message validation, metrics text, AsyncEngine."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from specd.engine.requests import SAMPLING_FIELDS
from specd.serving import protocol as P
from specd.serving import request_build as RB
from specd.structured.errors import CODES as GRAMMAR_CODES

pytestmark = pytest.mark.timeout(60)


def gen(**kw):
    return {"type": "generate", "id": "r", "prompt": "hi", **kw}


def test_parse_generate_defaults_and_fields():
    r = P.parse_generate(gen())
    assert (r.id, r.prompt, r.messages, r.max_tokens, r.priority) == ("r", "hi", None, None, "interactive")
    assert r.params.temperature == 1.0 and r.spec.mode == "auto"
    r = P.parse_generate(
        {
            "type": "generate",
            "id": "x",
            "messages": [{"role": "user", "content": "a", "name": "n"}],
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "seed": 9,
            "stop": "\n",
            "stop_token_ids": [2],
            "ignore_eos": True,
            "logprobs": 2,
            "logit_bias": {"7": -1},
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.25,
            "min_p": 0.05,
            "priority": "batch",
            "speculation": {"mode": "chain", "max_draft_tokens": 4},
            "future_field": 1,
        }
    )
    assert r.messages == [{"role": "user", "content": "a"}] and r.max_tokens == 5
    assert {f: getattr(r.params, f) for f in SAMPLING_FIELDS if f != "max_tokens"} == dict(
        temperature=0.0,
        top_p=0.5,
        top_k=3,
        seed=9,
        stop=("\n",),
        stop_token_ids=(2,),
        ignore_eos=True,
        logprobs=2,
        logit_bias=((7, -1.0),),
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.25,
        min_p=0.05,
    )
    assert (r.spec.mode, r.spec.max_draft_tokens, r.priority) == ("chain", 4, "batch")
    p = r.sampling(prompt_tokens=1, max_model_len=64)
    assert p.max_tokens == 5 and p.stop == ("\n",) and p.logprobs == 2
    # no max_tokens: the default once the prompt's length is known (min(256, context - prompt))
    assert P.parse_generate(gen()).sampling(prompt_tokens=10, max_model_len=64).max_tokens == 54


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=math.inf),
        dict(temperature=True),
        dict(top_p=1.5),
        dict(max_tokens=0),
        dict(seed=1.0),
        dict(stop=["a"] * 17),
        dict(stop_token_ids=[1, "2"]),
        dict(ignore_eos="yes"),
        dict(priority=None or 3),
        dict(priority=[]),
        dict(priority={}),
        dict(speculation={"mode": "tree", "max_draft_tokens": 1000}),
        dict(id=""),
        dict(id="x" * 257),
        dict(prompt=""),
        dict(prompt=None),
    ],
)
def test_parse_generate_rejects(bad):
    with pytest.raises(P.ProtocolError) as ei:
        P.parse_generate(gen(**bad))
    assert ei.value.code == "invalid_request"


def test_decode_errors():
    for frame, code in (
        ("{", "invalid_json"),
        ("3", "invalid_json"),
        ('{"type": 1}', "invalid_request"),
        (b"{}", "invalid_request"),
    ):
        with pytest.raises(P.ProtocolError) as ei:
            P.decode(frame)
        assert ei.value.code == code
    assert P.decode('{"type": "cancel", "id": "a"}') == {"type": "cancel", "id": "a"}
    assert set(P.ERROR_CODES) == {
        "invalid_json",
        "invalid_request",
        "unknown_type",
        "too_long",
        "overloaded",
        "shutting_down",
        "unauthorized",
        "duplicate_id",
        "message_too_large",
        "internal",
        *GRAMMAR_CODES,  # a constraint refused (specd.structured.GrammarError's codes, as they are)
    }


def test_error_codes_are_documented():
    from conftest import ROOT

    doc = (ROOT / "docs" / "protocol.md").read_text()
    for code in P.ERROR_CODES:
        assert f"`{code}`" in doc, code


class _Tok:
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [1] + [ord(c) % 50 + 3 for c in text]}


def test_encode_prompt_without_chat_template_joins_contents():
    tok = _Tok()
    r = P.parse_generate(
        {
            "type": "generate",
            "id": "a",
            "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "yz"}],
        }
    )
    assert RB.encode_prompt(tok, r.messages, r.prompt) == tok("x\nyz")["input_ids"]


def test_histogram_and_render_parse():
    from prometheus_client.parser import text_string_to_metric_families

    from specd.serving.metrics import Histogram, Metrics

    h = Histogram((0.1, 1.0))
    h.observe(0.05)
    h.observe(0.5, 3)
    h.observe(5.0)
    assert h.counts == [1, 3, 1] and h.count == 5 and h.sum == pytest.approx(6.55)
    m = Metrics(lambda: None)
    m.count_error("overloaded")
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert fams["specd_request_errors"].samples[0].labels == {"code": "overloaded"}
    assert fams["specd_time_to_first_token_seconds"].type == "histogram"


# AsyncEngine over a fake engine ----------------------------------------------------------------------
class FakeOut:
    def __init__(self, rid, toks, finished, reason=None, num_output=0, error=None):
        from types import SimpleNamespace

        self.request_id, self.token_ids, self.text = rid, toks, "x" * len(toks)
        self.finished, self.finish_reason, self.error = finished, reason, error
        self.logprobs = None
        self.seq = SimpleNamespace(num_output=num_output)


class FakeEngine:
    """Emits one token per step per request, ``n`` tokens each; abort -> a cancelled output. Has the
    public surface the engine loop, ``snapshot_of`` and ``limits_of`` read."""

    max_model_len = 64
    tokenizer = None
    vocab_size = 100
    drafter = draft_cache = None

    def __init__(self, n=5, fail_at=None):
        from types import SimpleNamespace

        from specd.engine.sequence import SpecStats

        self.n, self.fail_at = n, fail_at
        self.reqs, self.inbox, self.lock = {}, [], threading.Lock()
        self.steps = 0
        self.scheduler = SimpleNamespace(
            running=[], queue_lengths=lambda: {"interactive": 0, "batch": 0}, num_preemptions=0, last_spec_budget=0
        )
        self.scheduler.last_depth = 0
        self.health = SimpleNamespace(consecutive_failed=0)
        self.cache = SimpleNamespace(block_size=16, pool=SimpleNamespace(num_blocks=64))
        self.stats, self.num_steps = SpecStats(), 0

    def kv_blocks_used(self):
        return (len(self.reqs), 0)

    def prefix_cache_stats(self):
        return {"query_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0, "evictions": 0}

    def health_snapshot(self):
        return {"failed_steps": {}, "failed_requests": {}, "consecutive_failed": 0, "last_progress": time.monotonic()}

    def add_request(self, prompt, params, spec, priority, rid, tenant=None, grammar=None):
        from specd.engine.engine import RequestError

        if not prompt:
            raise RequestError("invalid_request", "prompt is empty")
        if prompt == [13]:  # refused by the engine itself (a race validation could not see)
            raise RequestError("too_long", "the KV cache shrank")
        with self.lock:
            self.inbox.append(("add", rid))

    def abort(self, rid):
        with self.lock:
            self.inbox.append(("abort", rid))

    def has_work(self):
        with self.lock:
            return bool(self.inbox or self.reqs)

    num_waiting = 0

    def has_new_requests(self):
        with self.lock:
            return bool(self.inbox)

    def fail_all(self, exc):
        outs = [FakeOut(rid, [], True, "error", error=f"{type(exc).__name__}: {exc}") for rid in self.reqs]
        self.reqs.clear()
        return outs

    def step(self):
        self.steps += 1
        with self.lock:
            inbox, self.inbox = self.inbox, []
        outs = []
        for op, rid in inbox:
            if op == "add":
                self.reqs[rid] = 0
            elif rid in self.reqs:
                del self.reqs[rid]
                outs.append(FakeOut(rid, [], True, "cancelled"))
        self.scheduler.running = [type("Q", (), {"request_id": r, "priority": "interactive"})() for r in self.reqs]
        if self.fail_at is not None and self.steps == self.fail_at:
            raise RuntimeError("boom")
        for rid in list(self.reqs):
            self.reqs[rid] += 1
            done = self.reqs[rid] >= self.n
            outs.append(FakeOut(rid, [7], done, "length" if done else None, self.reqs[rid]))
            if done:
                del self.reqs[rid]
        time.sleep(0.001)
        return outs


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def req(rid: str, prompt_ids: list):
    """A request for the fake engines (their outputs do not depend on its parameters)."""
    from specd.engine.commands import Submit
    from specd.sampling.params import SamplingParams

    return Submit(rid, prompt_ids, SamplingParams(max_tokens=8))


def test_async_engine_streams_overload_and_abort():
    from specd.engine.engine import RequestError
    from specd.serving.async_engine import AsyncEngine

    async def main():
        fe = FakeEngine(n=5)
        ae = AsyncEngine(fe, max_queue=2)
        await ae.start()
        assert ae.ready and ae.watchdog_ok()
        outs = [o async for o in ae.generate(req("a", [1]))]
        assert sum(len(o.token_ids) for o in outs) == 5 and outs[-1].finished and ae.num_requests == 0
        assert all(o.token_ids for o in outs) and not any(o.finished for o in outs[:-1])
        # overloaded at once
        fe.n = 100_000
        g1, g2 = ae.generate(req("b", [1])), ae.generate(req("c", [1]))
        await g1.__anext__()
        await g2.__anext__()
        with pytest.raises(RequestError) as ei:
            await ae.generate(req("d", [1])).__anext__()
        assert ei.value.code == "overloaded"
        # engine validation error passes through
        await g1.aclose()  # consumer leaves: the request is aborted in the engine
        with pytest.raises(RequestError) as ei:
            await ae.generate(req("e", [])).__anext__()
        assert ei.value.code == "invalid_request"
        await g2.aclose()
        fe.n = 5
        for _ in range(100):
            if not fe.has_work():
                break
            await asyncio.sleep(0.01)
        assert not fe.reqs

        # cancellation of the consuming task aborts too
        async def consume():
            async for _ in ae.generate(req("f", [1])):
                await asyncio.sleep(10)

        t = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        for _ in range(100):
            if not fe.has_work():
                break
            await asyncio.sleep(0.01)
        assert not fe.reqs and ae.num_requests == 0
        await ae.drain(1.0)
        assert not ae.ready
        with pytest.raises(RequestError) as ei:
            await ae.generate(req("g", [1])).__anext__()
        assert ei.value.code == "shutting_down"
        await ae.stop()

    run(main())


def test_a_request_the_engine_refuses_on_arrival_ends_with_its_error():
    """The engine loop's add may still refuse (validation raced): the stream ends with that error,
    not admitted, nothing is left behind, and the next request runs."""
    from specd.engine.engine import RequestError
    from specd.serving.async_engine import AsyncEngine

    async def main():
        ae = AsyncEngine(FakeEngine(n=3), max_queue=4)
        await ae.start()
        with pytest.raises(RequestError) as ei:
            [o async for o in ae.generate(req("r", [13]))]
        assert ei.value.code == "too_long" and not getattr(ei.value, "admitted", False) and ae.num_requests == 0
        outs = [o async for o in ae.generate(req("r", [1]))]
        assert outs[-1].finish_reason == "length"
        await ae.stop()

    run(main())


def test_async_engine_merges_outputs_that_queued_behind_a_slow_consumer():
    """A consumer that falls behind gets everything queued meanwhile as one output (fewer messages
    exactly when sending is the bottleneck); nothing is lost, and an error still ends the stream."""
    from specd.serving.async_engine import AsyncEngine

    async def main():
        fe = FakeEngine(n=40)
        ae = AsyncEngine(fe, max_queue=8)
        await ae.start()
        outs = []
        async for o in ae.generate(req("slow", [1])):
            outs.append(o)
            await asyncio.sleep(0.01)  # ~10 engine steps per message
        assert sum(len(o.token_ids) for o in outs) == 40 and "".join(o.text for o in outs) == "x" * 40
        assert len(outs) < 20 and max(len(o.token_ids) for o in outs) > 1
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        await ae.stop()

    run(main())


def test_async_engine_step_exception_fails_running_requests():
    from specd.engine.engine import RequestError
    from specd.serving.async_engine import AsyncEngine

    async def main():
        fe = FakeEngine(n=50, fail_at=3)
        ae = AsyncEngine(fe, max_queue=8)
        await ae.start()
        got = []
        with pytest.raises(RequestError) as ei:
            async for o in ae.generate(req("a", [1])):
                got.append(o)
        assert ei.value.code == "internal" and getattr(ei.value, "admitted", False) and "boom" in str(ei.value)
        assert len(got) == 2
        outs = [o async for o in ae.generate(req("b", [1]))]
        assert outs[-1].finish_reason == "length" and ae.num_step_errors == 1
        await ae.stop()

    run(main())


def test_async_engine_drain_deadline_aborts_and_idle_thread_sleeps():
    from specd.serving.async_engine import AsyncEngine

    async def main():
        fe = FakeEngine(n=10_000)
        ae = AsyncEngine(fe, max_queue=8)
        await ae.start()
        await asyncio.sleep(0.2)
        idle_steps = fe.steps
        await asyncio.sleep(0.3)
        assert fe.steps == idle_steps == 0  # no busy stepping while idle
        outs = []

        async def consume():
            async for o in ae.generate(req("a", [1])):
                outs.append(o)

        t = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        await ae.drain(0.1)
        await t
        assert outs[-1].finish_reason == "cancelled"
        await ae.stop()

    run(main())


def _limits():
    from specd.engine.commands import EngineLimits

    return EngineLimits(
        max_model_len=64, block_size=16, num_blocks=64, draft_num_blocks=None, vocab_size=100, has_draft=False
    )


_LIMITS = _limits()


class FakeRemote:
    """An ``EngineLink`` like ``ProcessLink``'s (the event loop reads a pipe; no engine thread), over a
    socketpair the test writes to: ``push`` queues outputs / a failed step / death and makes the pipe
    readable; the link's reader turns what is queued into ``Batch``es."""

    relaying = True
    tokenizer = None
    max_model_len = 64
    limits = _LIMITS
    engine = None

    def __init__(self):
        import socket

        self.r, self.w = socket.socketpair()
        self.items, self.err, self.alive = [], None, True
        self.reader_attached = False
        self.aborted = []

    def start(self, loop, deliver, died):
        self.loop, self.deliver, self.died = loop, deliver, died
        loop.add_reader(self.r.fileno(), self._on_readable)
        self.reader_attached = True

    def _on_readable(self):
        from specd.engine.commands import Batch

        self.r.recv(4096)
        items, self.items = self.items, []
        err, self.err = self.err, None
        self.deliver(Batch(items, None, [err] if err else []))
        if not self.alive:
            self.loop.remove_reader(self.r.fileno())
            self.died("engine process died")

    def send(self, cmd):
        from specd.engine.commands import Cancel

        if isinstance(cmd, Cancel):
            self.aborted.append(cmd.request_id)

    def wake(self):
        pass

    def detach(self):
        pass

    def close(self):
        self.r.close()
        self.w.close()

    def push(self, outs=None, err=None, dead=False):
        if outs is not None:
            from specd.engine.commands import Step

            self.items.append(Step(outs, 0.001))
        self.err = err
        if dead:
            self.alive = False
        self.w.send(b"x")


def test_engine_process_mode_relays_on_the_loop_and_fails_cleanly():
    """No engine thread: the loop reads the engine's pipe. Outputs reach their streams and the step
    listeners; a failed request's error output ends its stream with `internal`; a dead engine fails the rest,
    turns health red, and nothing hangs."""
    from specd.engine.engine import RequestError
    from specd.serving.async_engine import AsyncEngine

    async def main():
        fr = FakeRemote()
        ae = AsyncEngine(fr, max_queue=8, watchdog_timeout_s=0.3)
        seen = []
        ae.listeners.append(lambda outs, dt: seen.append((len(outs), dt)))
        await ae.start()
        assert ae.relaying and ae.engine is None and fr.reader_attached and ae.ready and ae.watchdog_ok()
        ga, gb = ae.generate(req("a", [1])), ae.generate(req("b", [1]))
        fa = asyncio.ensure_future(ga.__anext__())
        fb = asyncio.ensure_future(gb.__anext__())
        await asyncio.sleep(0.01)
        fr.push([FakeOut("a", [7], False), FakeOut("b", [8, 9], False)])
        assert (await fa).token_ids == [7] and (await fb).token_ids == [8, 9]
        assert seen == [(2, 0.001)]
        # a step that raised in the child: the child fails its requests (finish_reason "error"), the
        # stream ends with `internal` carrying the child's reason, and the relay counts the error
        fr.push([FakeOut("a", [], True, "error", error="forward failed: RuntimeError: boom")], err="boom")
        with pytest.raises(RequestError) as ei:
            await ga.__anext__()
        assert ei.value.code == "internal" and "boom" in str(ei.value) and ei.value.admitted
        assert ae.num_step_errors == 1 and ae.ready
        # silence while there is work = stuck
        await asyncio.sleep(0.4)
        assert not ae.watchdog_ok()
        # the engine process dies: the remaining stream fails, health is red, the loop stops reading
        fr.push(dead=True)
        with pytest.raises(RequestError) as ei:
            await gb.__anext__()
        assert ei.value.code == "internal" and not ae.ready and not ae.watchdog_ok() and not ae.relaying
        await ae.stop()

    run(main())


def test_handoff_holds_short_steps_within_the_interval_only():
    """HandOff: a step's outputs are held only while the next step still ends within the interval of
    the last hand-off; urgent outputs, an unsteady engine, long steps and interval 0 go at once."""
    from specd.engine.loop import HandOff

    h = HandOff(0.001)
    assert h.now(10.0, 0.0004, urgent=True, steady=True)  # first token: at once
    assert not h.now(10.0004, 0.0004, urgent=False, steady=True)  # next step ends at 10.0008: hold
    assert h.now(10.0008, 0.0004, urgent=False, steady=True)  # the next would end past 10.001: send
    assert not h.now(10.0010, 0.0001, urgent=False, steady=True)
    assert h.now(10.0011, 0.0001, urgent=False, steady=False)  # idle / new requests next: send
    assert not h.now(10.0012, 0.0001, urgent=False, steady=True)
    assert h.now(10.0013, 0.0001, urgent=True, steady=True)  # a finished request: send
    assert all(h.now(20.0 + k * 0.002, 0.002, urgent=False, steady=True) for k in range(5))  # long steps
    h0 = HandOff(0.0)
    assert all(h0.now(30.0 + k * 1e-5, 1e-5, urgent=False, steady=True) for k in range(5))
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError):
            HandOff(bad)


def test_engine_thread_mode_holds_outputs_but_streams_everything():
    """Engine-thread mode with a long interval: the loop is woken fewer times than there are steps,
    yet every request gets all its tokens in order and its end."""
    from specd.serving.async_engine import AsyncEngine

    eng = FakeEngine(n=12)

    async def main():
        ae = AsyncEngine(eng, stream_interval_s=0.05)
        await ae.start()
        results = {}

        async def one(rid):
            toks = []
            async for out in ae.generate(req(rid, [1])):
                toks += out.token_ids
            results[rid] = toks

        await asyncio.gather(*(one(f"r{i}") for i in range(3)))
        await ae.stop()
        return results, ae.num_batches  # (each hand-off wakes the event loop once at most)

    results, wakes = run(main())
    assert results == {f"r{i}": [7] * 12 for i in range(3)}
    assert wakes < eng.steps / 2, (wakes, eng.steps)


def test_pipe_frames_survive_partial_reads_and_close_is_idempotent():
    """links.Pipe: messages larger than one read arrive whole and in order; a reader sees
    end of file after the writer closes; closing twice never closes a reused descriptor."""
    import os

    from specd.engine.links import Pipe

    r, w = os.pipe()
    reader, writer = Pipe(r, reader=True), Pipe(w, reader=False)
    msgs = [("small", 1), ("big", "x" * 300_000), ("after", [1, 2, 3])]
    got = []

    def write_all():
        for m in msgs:
            writer.send(m)
        writer.close()

    t = threading.Thread(target=write_all)
    t.start()
    while not reader.eof:
        reader.wait(5.0)
        got += reader.read()
    t.join(5)
    assert got == msgs
    writer.close()  # again: a no-op
    other = os.open(os.devnull, os.O_RDONLY)  # may reuse the writer's old number
    try:
        writer.close()
        os.fstat(other)  # still open
    finally:
        os.close(other)
    with pytest.raises(OSError):
        writer.send(("late",))
    reader.close()


def test_done_frame_names_each_proposer_when_several():
    """``done.spec.by_proposer`` on the websocket, as ``usage.speculation.by_proposer`` over HTTP."""
    import orjson

    from specd.engine.sequence import Sequence, SpecParams
    from specd.sampling.params import SamplingParams
    from specd.serving import protocol as P

    seq = Sequence("r", [1, 2, 3], SamplingParams(), SpecParams())
    seq.stats.record(4, 2, 1, "ngram")
    one = orjson.loads(P.done("r", seq, "stop"))
    assert "by_proposer" not in one["spec"] and one["spec"]["accepted_tokens"] == 1
    seq.stats.record(3, 3, 3, "suffix")
    two = orjson.loads(P.done("r", seq, "stop"))["spec"]["by_proposer"]
    assert set(two) == {"ngram", "suffix"} and two["suffix"]["accepted_tokens"] == 3
