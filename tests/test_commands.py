"""The engine boundary as typed commands (``specd.engine.commands``), both links in one module
(``specd.engine.links``) and one request validation (``specd.engine.requests``):

- every message round-trips through pickle and the process link's pipe, equal and frozen;
- a ``Submit`` reaches the engine unchanged through the thread link's queue and the process link's
  pipe, a test-only sampling field included (a ``SamplingParams`` subclass: nothing in the links or
  the commands knows its fields), and the engine's outputs come back equal;
- a real engine process streams exactly what the engine thread and the engine itself produce for a
  request that sets every sampling field;
- every ``SamplingParams`` field is read by name by every front end (websocket, OpenAI, gRPC);
- a bad value is refused by the one validation with the same code and message over the websocket,
  HTTP and gRPC.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import socket
import threading
import time

import orjson
import pytest
from conftest import serve_args, ws_collect

from specd.engine.commands import (
    Batch,
    Cancel,
    EngineLimits,
    EngineSnapshot,
    LoadFailed,
    Ready,
    Refused,
    SeqState,
    Snapshot,
    Start,
    Step,
    Stop,
    Submit,
)
from specd.engine.requests import SAMPLING_FIELDS, RequestError, sampling_params
from specd.engine.sequence import SpecParams, SpecStats
from specd.sampling.params import SamplingParams

pytestmark = pytest.mark.timeout(180)

# a valid value other than the default for every SamplingParams field (a new field needs one here)
SAMPLES = {
    "temperature": 0.8,
    "top_p": 0.9,
    "top_k": 20,
    "seed": 7,
    "max_tokens": 12,
    "stop": ("zq",),
    "stop_token_ids": (5,),
    "ignore_eos": True,
    "logprobs": 2,
    "logit_bias": ((5, -2.0),),
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "min_p": 0.1,
}


@dataclasses.dataclass(frozen=True)
class TypicalPParams(SamplingParams):
    """A sampling parameter the links and commands have never heard of (test only)."""

    typical_p: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.typical_p <= 1.0:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")


def test_samples_cover_every_sampling_field():
    assert set(SAMPLES) == set(SAMPLING_FIELDS)
    default = SamplingParams()
    assert all(SAMPLES[f] != getattr(default, f) for f in SAMPLES)


def _limits() -> EngineLimits:
    return EngineLimits(
        max_model_len=64, block_size=16, num_blocks=32, draft_num_blocks=8, vocab_size=100, has_draft=True
    )


def _messages() -> list:
    from specd.config import EngineConfig

    sub = Submit("r1", [3, 4, 5], TypicalPParams(typical_p=0.05, **SAMPLES), SpecParams("tree", 8), "batch", "tenant-x")
    stats = SpecStats()
    stats.record(4, 2, 1, "draft")
    state = SeqState("batch", SpecParams("chain"), 3, 2, 1.0, 1.5, 2.0, 3.0, 1, "stop", None, 16, stats)
    rec = ("r1", [7, 8], "ab", True, "stop", state, [(-0.5, [(7, -0.5)]), (-1.0, [])])  # (links.RECORD)
    snap = EngineSnapshot(kv_used=(3, 1), stats=stats, steps=9, health={"consecutive_failed": 0}, time=5.0)
    batch = Batch([Step([rec], 0.001), Step([], 0.002)], snap, ["RuntimeError: x"], [Refused("r2", "too_long", "m")])
    return [
        sub,
        Cancel("r1"),
        Snapshot(),
        Stop(),
        Start(EngineConfig(target="t", device="cpu"), 20, 0.002),
        Ready(_limits()),
        LoadFailed("no such folder"),
        batch,
        Batch(snapshot=EngineSnapshot()),  # a heartbeat
    ]


def test_every_message_round_trips_through_pickle_and_the_pipe_frozen():
    from specd.engine.links import Pipe

    msgs = _messages()
    for m in msgs:
        assert pickle.loads(pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)) == m, m
        assert dataclasses.is_dataclass(m) and type(m).__dataclass_params__.frozen, type(m)
        name = dataclasses.fields(m)[0].name if dataclasses.fields(m) else None
        if name is not None:
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(m, name, None)
    r, w = os.pipe()
    reader, writer = Pipe(r, reader=True), Pipe(w, reader=False)
    for m in msgs:
        writer.send(m)
    writer.close()
    got = []
    while not reader.eof:
        reader.wait(5.0)
        got += reader.read()
    reader.close()
    assert got == msgs
    assert got[0].params.typical_p == 0.05 and type(got[0].params) is TypicalPParams


def test_submit_checks_what_it_carries():
    p = SamplingParams()
    s = Submit("a", [1, 2], p)
    assert s.prompt_ids == (1, 2) and s.spec == SpecParams() and s.priority == "interactive" and s.tenant is None
    for rid in ("", None, 3):
        with pytest.raises(RequestError) as ei:
            Submit(rid, [1], p)
        assert ei.value.code == "invalid_request"
    with pytest.raises(RequestError) as ei:
        Submit("a", [1], p, priority="urgent")
    assert (ei.value.code, ei.value.field) == ("invalid_request", "priority")
    with pytest.raises(TypeError):
        Submit("a", [1], {"temperature": 0})
    with pytest.raises(TypeError):
        Submit("a", [1], p, tenant=5)
    # the limits: one function (requests.validate_request) behind EngineLimits and Engine.validate
    with pytest.raises(RequestError) as ei:
        _limits().validate(Submit("a", [1] * 60, p))  # + 256 max_tokens > 64
    assert (ei.value.code, ei.value.field) == ("too_long", "max_tokens")
    with pytest.raises(RequestError) as ei:
        _limits().validate(Submit("a", [1, 100], SamplingParams(max_tokens=4)))
    assert (ei.value.code, ei.value.field) == ("invalid_request", "prompt")


def _grammar():
    from specd.structured import grammar_spec

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    return grammar_spec({"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False})


def test_a_grammar_travels_in_a_submit_and_is_checked():
    from specd.structured import GrammarSpec

    g = _grammar()
    sub = Submit("g", [1, 2], SamplingParams(), grammar=g)
    back = pickle.loads(pickle.dumps(sub, protocol=pickle.HIGHEST_PROTOCOL))
    assert isinstance(back.grammar, GrammarSpec) and back.grammar.canonical() == g.canonical()
    assert back.grammar.value.functions[0].name == "f" and back.grammar.value.parallel is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.grammar.kind = "regex"
    with pytest.raises(TypeError):
        Submit("g", [1], SamplingParams(), grammar={"type": "json_object"})


# both links over a spy engine --------------------------------------------------------------------
class FakeSeq:
    """What the links read of a request's sequence."""

    def __init__(self, prompt_ids, params, spec, priority):
        self.params, self.spec, self.priority, self.num_prompt = params, spec, priority, len(prompt_ids)
        self.num_output = self.num_preemptions = self.cached_prefix_tokens = 0
        self.arrival, self.scheduled_time, self.first_token_time, self.finish_time = time.monotonic(), None, None, None
        self.finish_reason = self.error = None
        self.stats = SpecStats()


class SpyEngine:
    """Records what the engine loop hands it; each added request emits one token per step, ``n`` each."""

    max_model_len, vocab_size, tokenizer, drafter, draft_cache = 64, 100, None, None, None

    def __init__(self, n: int = 2):
        from types import SimpleNamespace

        self.n, self.added, self.aborted, self.live, self.grammars = n, [], [], {}, []
        self.lock = threading.Lock()
        self.cache = SimpleNamespace(block_size=16, pool=SimpleNamespace(num_blocks=32))
        self.scheduler = SimpleNamespace(
            running=[], queue_lengths=lambda: {"interactive": 0, "batch": 0}, num_preemptions=0, last_spec_budget=0
        )
        self.scheduler.last_depth = 0
        self.health = SimpleNamespace(consecutive_failed=0)
        self.stats, self.num_steps, self.num_waiting = SpecStats(), 0, 0

    def add_request(self, prompt_ids, params, spec, priority, request_id, tenant=None, grammar=None):
        with self.lock:
            self.added.append((prompt_ids, params, spec, priority, request_id, tenant))
            self.grammars.append(grammar)
            self.live[request_id] = FakeSeq(prompt_ids, params, spec, priority)

    def abort(self, request_id):
        with self.lock:
            self.aborted.append(request_id)
            self.live.pop(request_id, None)

    def has_work(self):
        with self.lock:
            return bool(self.live)

    def has_new_requests(self):
        return False

    def step(self):
        from specd.engine.output import RequestOutput

        outs = []
        with self.lock:
            for rid, seq in list(self.live.items()):
                seq.num_output += 1
                done = seq.num_output >= self.n
                lps = [(-0.25, [(9, -0.25)])] if seq.params.logprobs is not None else None
                outs.append(RequestOutput(rid, [9], "t", done, "length" if done else None, seq, None, lps))
                if done:
                    seq.finish_reason = "length"
                    del self.live[rid]
        self.num_steps += 1
        return outs

    def kv_blocks_used(self):
        return (0, 0)

    def prefix_cache_stats(self):
        return {"query_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0, "evictions": 0}

    def health_snapshot(self):
        return {"failed_steps": {}, "failed_requests": {}, "consecutive_failed": 0, "last_progress": time.monotonic()}


def _run_loop(engine, inlet, outlet) -> threading.Thread:
    from specd.engine.loop import EngineLoop

    t = threading.Thread(target=EngineLoop(engine, inlet, outlet, 0.0).run, daemon=True)
    t.start()
    return t


def _check_received(spy: SpyEngine, sub: Submit) -> None:
    assert len(spy.added) == 1
    ids, params, spec, priority, rid, tenant = spy.added[0]
    assert (ids, spec, priority, rid, tenant) == (
        list(sub.prompt_ids),
        sub.spec,
        sub.priority,
        sub.request_id,
        sub.tenant,
    )
    assert type(params) is TypicalPParams and params == sub.params and params.typical_p == 0.05
    assert all(getattr(params, f) == getattr(sub.params, f) for f in SAMPLING_FIELDS)


def test_a_submit_reaches_the_engine_unchanged_through_the_thread_link():
    from specd.serving.async_engine import AsyncEngine

    spy = SpyEngine(n=3)
    sub = Submit("t1", [1, 2, 3], TypicalPParams(typical_p=0.05, **SAMPLES), SpecParams("chain", 4), "batch", "k")

    async def main():
        ae = AsyncEngine(spy, max_queue=4)
        await ae.start()
        outs = [o async for o in ae.generate(sub)]
        snap = await ae.refresh_snapshot()
        await ae.stop()
        return outs, snap

    outs, snap = asyncio.run(asyncio.wait_for(main(), 30))
    _check_received(spy, sub)
    assert [t for o in outs for t in o.token_ids] == [9] * 3 and outs[-1].finish_reason == "length"
    assert [lp for o in outs for lp in o.logprobs] == [(-0.25, [(9, -0.25)])] * 3
    assert outs[0].seq.params is sub.params  # (in a thread the engine's own objects come back)
    assert snap.steps == 3  # a Snapshot command answered with the engine's state


def _parent_end(cmd_w: int, out_r: int):
    """A ``ProcessLink`` without a child process (the test runs the child's loop on a thread)."""
    from specd.engine.links import Pipe, ProcessLink, RemoteGrammars

    link = ProcessLink.__new__(ProcessLink)
    link._cmd, link._out = Pipe(cmd_w, reader=False), Pipe(out_r, reader=True)
    link._send_lock, link._seqs, link._dead = threading.Lock(), {}, None
    link._grammars = RemoteGrammars(link.send)
    return link


def _child_end(engine):
    """The engine loop of a child process, on a thread, over fresh pipes: (thread, parent link, pipes)."""
    from specd.engine.links import Pipe, PipeInlet, encode_batch, pack_outputs
    from specd.engine.loop import EngineLoop

    cmd_r, cmd_w = os.pipe()
    out_r, out_w = os.pipe()
    child_in, child_out = Pipe(cmd_r, reader=True), Pipe(out_w, reader=False)
    loop = EngineLoop(engine, PipeInlet(child_in), lambda b: child_out.send(encode_batch(b)) or True, 0.0, pack_outputs)
    t = threading.Thread(target=loop.run, daemon=True)
    t.start()
    link = _parent_end(cmd_w, out_r)
    return t, link, (child_in, child_out, link._cmd, link._out)


class CountingConstraints:
    """Grammar checks as an engine's ``Constraints.compile`` answers them: a settled future per spec
    (a refusal for a regex), counted."""

    def __init__(self):
        self.specs = []

    def compile(self, spec):
        from concurrent.futures import Future

        from specd.structured import GrammarError

        self.specs.append(spec)
        fut = Future()
        if spec.kind == "regex":
            fut.set_exception(GrammarError("invalid_regex", "regex: unclosed group", "response_format"))
        else:
            fut.set_result(object())
        return fut


def test_a_grammar_is_checked_once_in_the_engine_process():
    """The server's check of a request's grammar travels to the engine process's compiler
    (``CheckGrammar``) and its answer back in a batch: compiled (None) or the refusal with its code,
    message and field; the server process compiles nothing. A check pending when the engine
    process dies fails as ``internal``."""

    from types import SimpleNamespace

    from specd.engine.links import RemoteGrammars
    from specd.structured import GrammarError, GrammarSpec

    spy = SpyEngine(n=1)
    spy.constraints = CountingConstraints()
    t, link, pipes = _child_end(spy)
    ok, bad = GrammarSpec("json_object", None), GrammarSpec("regex", "(x")
    futs = [link.grammar_compiler().submit(g) for g in (ok, bad)]
    end = time.monotonic() + 20
    while not all(f.done() for f in futs) and time.monotonic() < end:
        link._out.wait(1.0)
        for msg in link.read_raw():
            link.decode(msg)
    assert futs[0].result(0) is None
    err = futs[1].exception(0)
    assert isinstance(err, GrammarError) and (err.code, err.field) == ("invalid_regex", "response_format")
    assert err.message == "regex: unclosed group"
    assert [g.kind for g in spy.constraints.specs] == ["json_object", "regex"]
    link.send(Stop())
    t.join(10)
    pending = link.grammar_compiler().submit(ok)  # (nobody answers: the loop has stopped)
    assert not pending.done()
    died = []
    link._loop, link._died = None, died.append
    link.proc = SimpleNamespace(poll=lambda: 1)  # (the child is gone: its end of the pipe closes)
    pipes[1].close()
    link._on_readable()
    assert died and isinstance(pending.exception(0), RequestError) and pending.exception(0).code == "internal"
    link._grammars = RemoteGrammars(link.send, link._why_dead)  # (as ProcessLink builds it)
    late = link.grammar_compiler().submit(ok)  # sent to a dead process: failed at once, never hangs
    assert isinstance(late.exception(0), RequestError) and "engine process" in str(late.exception(0))
    for p in pipes:
        p.close()


def test_requests_being_checked_count_against_max_queue():
    """A grammar check holds a place in ``max_queue``: with two checks compiling, a third request
    (checked or not) is ``overloaded``; once they finish, requests are admitted again."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from specd.serving.async_engine import AsyncEngine
    from specd.structured import GrammarSpec

    slow: list = []

    def submit(spec):
        slow.append(Future())
        return slow[-1]

    spy = SpyEngine(n=1)
    spy.constraints = SimpleNamespace(compiler=SimpleNamespace(submit=submit))
    g = GrammarSpec("json_object", None)

    async def main():
        ae = AsyncEngine(spy, max_queue=2)
        await ae.start()
        checks = [asyncio.ensure_future(ae.check_grammar(g)) for _ in range(2)]
        while len(slow) < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(RequestError) as third_check:
            await ae.check_grammar(g)
        with pytest.raises(RequestError) as submit:
            ae.stream(Submit("x", [1], SamplingParams(max_tokens=1)))
        for f in slow:
            f.set_result(None)
        await asyncio.gather(*checks)
        outs = [o async for o in ae.generate(Submit("y", [1], SamplingParams(max_tokens=1)))]
        await ae.stop()
        with pytest.raises(RequestError) as stopped:
            await ae.check_grammar(g)
        return third_check.value.code, submit.value.code, outs, stopped.value.code

    third, sub, outs, stopped = asyncio.run(asyncio.wait_for(main(), 30))
    assert third == sub == "overloaded" and outs[-1].finished and stopped == "shutting_down"


def test_a_grammar_reaches_the_engine_through_both_links():
    """The thread link hands the engine the very spec; the process link's wire an equal one."""
    from specd.serving.async_engine import AsyncEngine

    g = _grammar()
    spy = SpyEngine(n=1)

    async def main():
        ae = AsyncEngine(spy, max_queue=4)
        await ae.start()
        outs = [o async for o in ae.generate(Submit("t", [1, 2], SamplingParams(max_tokens=4), grammar=g))]
        await ae.stop()
        return outs

    assert asyncio.run(asyncio.wait_for(main(), 30))[-1].finished
    assert spy.grammars == [g]  # (in a thread: the same object)
    spy = SpyEngine(n=1)
    t, link, pipes = _child_end(spy)
    link.send(Submit("p", [1, 2], SamplingParams(max_tokens=4), grammar=g))
    link.send(Submit("q", [1, 2], SamplingParams(max_tokens=4)))
    link.send(Stop())
    t.join(10)
    assert not t.is_alive() and len(spy.grammars) == 2 and spy.grammars[1] is None
    assert spy.grammars[0] is not g and spy.grammars[0].canonical() == g.canonical()
    for p in pipes:
        p.close()


def test_a_submit_reaches_the_engine_unchanged_through_the_process_link_wire():
    """The process link's code on both ends of real OS pipes (``ProcessLink.send`` / ``decode``,
    the child's ``PipeInlet``, ``pack_outputs`` / ``encode_batch``), in one process instead of two."""
    from specd.engine.links import RECORD

    spy = SpyEngine(n=2)
    sub = Submit("p1", [4, 5], TypicalPParams(typical_p=0.05, **SAMPLES), SpecParams("tree", 16), "interactive", "k2")
    t, link, pipes = _child_end(spy)
    link.send(sub)
    link.send(Snapshot())
    outs, snaps, end = [], [], time.monotonic() + 20
    while not (outs and outs[-1].finished and snaps) and time.monotonic() < end:
        link._out.wait(1.0)
        for msg in link.read_raw():
            assert type(msg) is tuple and all(len(r) == len(RECORD) for records, _ in msg[0] for r in records)
            b = link.decode(msg)
            outs += [o for s in b.steps for o in s.outputs]
            snaps += [b.snapshot] if b.snapshot is not None else []
    link.send(Cancel("gone"))
    link.send(Stop())
    t.join(10)
    assert not t.is_alive()  # Stop ends the loop
    _check_received(spy, sub)
    assert spy.aborted == ["gone"]
    assert [o.token_ids for o in outs] == [[9], [9]] and outs[-1].finish_reason == "length"
    assert all(o.logprobs == [(-0.25, [(9, -0.25)])] for o in outs)
    seq = outs[-1].seq  # a RemoteSeq with the child's figures
    assert (seq.num_prompt, seq.num_output, seq.priority, seq.spec) == (2, 2, "interactive", sub.spec)
    assert snaps and isinstance(snaps[0], EngineSnapshot)
    for p in pipes:
        p.close()


# a real engine process --------------------------------------------------------------------------
def test_the_engine_process_streams_what_the_engine_thread_and_the_engine_produce(shared_pair):
    """A request that sets every sampling field (seeded sampling, top-k / top-p, a stop token id,
    log-probabilities, ignore_eos, max_tokens): the engine process, the engine thread and the engine
    called directly give the same tokens, text and finish; both links the same log-probabilities."""
    from specd.cli import engine_config
    from specd.engine.engine import Engine
    from specd.engine.links import ProcessLink
    from specd.serving.async_engine import AsyncEngine

    cfg = engine_config(serve_args(num_blocks=128))
    t, d = shared_pair
    eng = Engine(cfg, target=t, draft=d)
    ids = eng.tokenizer("Once upon a time")["input_ids"]
    params = SamplingParams(**{**SAMPLES, "stop": ("zq",), "stop_token_ids": (eng.vocab_size - 1,)})
    spec = SpecParams("tree")
    direct = eng.generate([ids], params, spec)[0]
    want = (direct.output_ids, eng.output_text(direct), direct.finish_reason)
    assert len(direct.output_ids) == SAMPLES["max_tokens"]

    async def through(link_or_engine):
        ae = AsyncEngine(link_or_engine, max_queue=4)
        await ae.start()
        try:
            outs = [o async for o in ae.generate(Submit("s", ids, params, spec))]
        finally:
            await ae.stop()
        toks = [x for o in outs for x in o.token_ids]
        lps = [x for o in outs for x in (o.logprobs or [])]
        return (toks, "".join(o.text for o in outs), outs[-1].finish_reason), lps

    thread, thread_lps = asyncio.run(asyncio.wait_for(through(eng), 60))
    proc, proc_lps = asyncio.run(asyncio.wait_for(through(ProcessLink(cfg)), 120))
    assert thread == want and proc == want
    assert len(thread_lps) == len(want[0]) and all(len(alts) == 2 for _, alts in thread_lps)
    assert _close(proc_lps, thread_lps)


def test_an_engine_process_checks_and_follows_a_grammar(shared_pair):
    """Through a real engine process: a bad grammar is refused by the check (a GrammarError with its
    code, before any request), a schema is checked there (the server holds no compiler of its own)
    and the constrained reply equals the engine's own."""
    from specd.cli import engine_config
    from specd.engine.engine import Engine
    from specd.engine.links import ProcessLink, RemoteGrammars
    from specd.serving.async_engine import AsyncEngine
    from specd.structured import GrammarError, GrammarSpec

    cfg = engine_config(serve_args(num_blocks=128))
    eng = Engine(cfg, *shared_pair)
    ids = eng.tokenizer("Once upon a time")["input_ids"]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    g, params = GrammarSpec("json_schema", schema), SamplingParams(temperature=0, max_tokens=24)
    want = eng.generate([ids], params, SpecParams("tree"), grammar=g)[0].output_ids

    async def through(link):
        ae = AsyncEngine(link, max_queue=4)
        await ae.start()
        try:
            with pytest.raises(GrammarError) as bad:
                await ae.check_grammar(GrammarSpec("regex", "(unclosed"))
            await ae.check_grammar(g)
            outs = [o async for o in ae.generate(Submit("s", ids, params, SpecParams("tree"), grammar=g))]
            return bad.value.code, isinstance(ae._compiler, RemoteGrammars), [t for o in outs for t in o.token_ids]
        finally:
            await ae.stop()

    code, remote, got = asyncio.run(asyncio.wait_for(through(ProcessLink(cfg)), 120))
    assert code == "invalid_regex" and remote and got == want


def _close(a: list, b: list, tol: float = 1e-5) -> bool:
    """Equal per-token log-probabilities (ids equal, values within ``tol``)."""
    assert len(a) == len(b)
    for (lp1, alts1), (lp2, alts2) in zip(a, b):
        assert abs(lp1 - lp2) <= tol and [i for i, _ in alts1] == [i for i, _ in alts2]
        assert all(abs(v1 - v2) <= tol for (_, v1), (_, v2) in zip(alts1, alts2))
    return True


# the front ends ---------------------------------------------------------------------------------
def test_every_sampling_field_is_read_by_name_at_every_door():
    """The websocket, OpenAI (chat, completions, responses) and gRPC parsers hand every
    ``SamplingParams`` field through by name (gRPC: every field its proto has)."""
    from specd.serving import openai_params as O
    from specd.serving import protocol as P
    from specd.serving import request_build as RB
    from specd.serving.grpc_server import _to_engine_args
    from specd.serving.proto.specd.v1 import specd_pb2 as pb

    want = SamplingParams(**SAMPLES)
    ws = P.parse_generate({"type": "generate", "id": "a", "prompt": "x", **{k: _json(v) for k, v in SAMPLES.items()}})
    assert ws.sampling(1, 64) == want
    ids = {"prompt_ids": [1, 2]}
    body = {"model": "m", **{k: _json(v) for k, v in SAMPLES.items()}}
    comp = O.parse_completion({**body, "prompt": [1, 2]}, "m").engine
    assert RB.build_request(None, **comp).params == want
    chat = O.parse_chat(
        {**body, "logprobs": True, "top_logprobs": 2, "messages": [{"role": "user", "content": "x"}]}, "m"
    )
    assert RB.build_request(None, **{**chat.engine, "messages": None, **ids}).params == want
    rbody = {k: v for k, v in body.items() if k not in ("logprobs", "max_tokens")}
    resp = O.parse_response({**rbody, "max_output_tokens": SAMPLES["max_tokens"], "input": "x"}, "m")
    assert RB.build_request(None, **{**resp.engine, "messages": None, **ids}).params == dataclasses.replace(
        want,
        logprobs=None,  # (no log-probabilities on /v1/responses)
    )
    proto = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    on_grpc = {k: v for k, v in SAMPLES.items() if k in proto}
    assert set(SAMPLES) - set(on_grpc) == {"logprobs", "logit_bias"}  # what gRPC does not carry (yet)
    args = _to_engine_args(pb.GenerateRequest(prompt="x", **{k: _json(v) for k, v in on_grpc.items()}))
    no_grpc = dataclasses.replace(want, logprobs=None, logit_bias=())
    assert RB.build_request(None, **{**args, "prompt": None, **ids}).params == no_grpc


def _json(v):
    return list(v) if isinstance(v, tuple) else v


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(shared_pair):
    from specd.cli import engine_config
    from specd.engine.engine import Engine
    from specd.serving.app import ServerThread

    a = serve_args(num_blocks=128, grpc_port=_free_port())
    t, d = shared_pair
    srv = ServerThread(a, Engine(engine_config(a), target=t, draft=d)).start()
    srv.grpc_port = a.grpc_port
    yield srv
    srv.stop()


def _ws_error(port: int, fields: dict) -> tuple:
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/ws") as ws:
        ws.send(orjson.dumps({"type": "generate", "id": "bad", "prompt": "Once", **fields}).decode())
        _, err = ws_collect(ws, "bad", timeout=30)
    assert err["type"] == "error", err
    return err["code"], err["message"]


def _http_error(server, fields: dict) -> tuple:
    import urllib.error
    import urllib.request

    body = orjson.dumps({"model": server.app.front.model_name, "prompt": "Once", **fields})
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=30)
    err = orjson.loads(ei.value.read())["error"]
    return ei.value.code, err["code"], err["param"], err["message"]


def _grpc_error(port: int, fields: dict) -> tuple:
    import grpc

    from specd.serving.proto.specd.v1 import specd_pb2 as pb
    from specd.serving.proto.specd.v1 import specd_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        with pytest.raises(grpc.RpcError) as ei:
            list(specd_pb2_grpc.SpecdStub(ch).Generate(pb.GenerateRequest(prompt="Once", **fields), timeout=30))
    return ei.value.code(), ei.value.details()


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -1.0), ("top_p", 0.0), ("top_k", -5), ("max_tokens", 0), ("stop", [""]), ("stop", ["a"] * 17)],
)
def test_a_bad_value_is_refused_in_one_place_alike_at_every_door(server, field, value):
    import grpc

    with pytest.raises(RequestError) as ei:
        sampling_params(**{field: value})
    msg = str(ei.value)
    assert ei.value.field == field and field in msg
    assert _ws_error(server.port, {field: value}) == ("invalid_request", msg)
    assert _http_error(server, {field: value}) == (400, "invalid_value", field, msg)
    assert _grpc_error(server.grpc_port, {field: value}) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"invalid_request: {msg}",
    )


@pytest.mark.parametrize(
    "so,code",
    [
        ({"regex": "(("}, "invalid_regex"),  # refused by the compiler
        ({"regex": "a", "choice": ["b"]}, "invalid_response_format"),  # refused as the request is read
        ({"json": '{"type": "object", "properties": {"a": {"not": {}}}, "required": ["a"]}'}, "unsatisfiable_schema"),
    ],
)
def test_a_bad_constraint_is_refused_alike_at_every_door(server, so, code):
    import grpc

    from specd.serving.proto.specd.v1 import specd_pb2 as pb

    ws_code, msg = _ws_error(server.port, {"structured_outputs": so})
    status, oai_code, param, http_msg = _http_error(server, {"structured_outputs": so})
    assert ws_code == oai_code == code and (status, http_msg) == (400, msg) and param.startswith("structured_outputs")
    assert _grpc_error(server.grpc_port, {"structured_outputs": pb.StructuredOutputs(**so)}) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{code}: {msg}",
    )


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"priority": "urgent"}, "priority"),
        ({"speculation": {"mode": "wide"}}, "speculation"),
        ({"speculation": {"max_draft": 3}}, "speculation"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_fields_grpc_cannot_carry_are_refused_alike_over_websocket_and_http(server, fields, param):
    code, msg = _ws_error(server.port, fields)
    assert code == "invalid_request" and param in msg
    assert _http_error(server, fields) == (400, "invalid_value", param, msg)


def test_a_grammar_the_engine_cannot_check_is_a_grammar_error_through_the_thread_link():
    """An engine without a tokenizer cannot build a grammar: the thread link's check says so as the
    engine process's answer does (``invalid_grammar``), not as an internal error."""
    from specd.engine.constraints import Constraints
    from specd.serving.async_engine import AsyncEngine
    from specd.structured import GrammarError, GrammarSpec

    spy = SpyEngine(n=1)
    spy.constraints = Constraints(None, 100, [])

    async def main():
        ae = AsyncEngine(spy, max_queue=2)
        await ae.start()
        try:
            with pytest.raises(GrammarError) as e:
                await ae.check_grammar(GrammarSpec("json_object", None, "response_format"))
            return e.value
        finally:
            await ae.stop()

    err = asyncio.run(asyncio.wait_for(main(), 30))
    assert err.code == "invalid_grammar" and "tokenizer" in err.message and err.field == "response_format"
