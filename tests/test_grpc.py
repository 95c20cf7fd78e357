"""The gRPC front end, end to end on loopback: a real Engine on the shared tiny pair, stepped by the
AsyncEngine thread, served by ``start_grpc_server`` in an asyncio loop of its own thread; the tests
are plain (sync) grpc clients."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specd.config import CacheConfig, EngineConfig
from specd.engine.engine import Engine, RequestError
from specd.sampling.params import SamplingParams
from specd.serving.async_engine import AsyncEngine
from specd.serving.grpc_server import start_grpc_server
from specd.serving.proto.specd.v1 import specd_pb2 as pb
from specd.serving.proto.specd.v1 import specd_pb2_grpc
from specd.serving.request_build import build_request, prompt_ids_from, summarize

pytestmark = pytest.mark.timeout(120)

PROMPT = "Once upon a time, there was a little girl named Lily."
DEADLINE = 30.0  # seconds, every client call


def make_engine(pair) -> Engine:
    t, d = pair
    cfg = EngineConfig(
        target=str(t.path),
        draft=str(d.path),
        device="cpu",
        dtype="float32",
        cache=CacheConfig(block_size=16, num_blocks=96),
    )
    return Engine(cfg, target=t, draft=d)


def off_main_thread(fn, *args):
    """Run ``fn`` on a worker thread, as the daemon runs its engine. (On a loaded 2-core box, torch's
    OpenMP pool makes CPU forwards on the main thread many times slower than on a worker thread.)"""
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(fn, *args).result(120)


class Daemon:
    """AsyncEngine + gRPC server(s) on an event loop in a background thread."""

    def __init__(self, engine: Engine, max_queue: int = 16, api_key=None):
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-test-loop", daemon=True)
        self.thread.start()
        self.ae = AsyncEngine(engine, max_queue=max_queue)
        self.call(self.ae.start())
        self.servers = []
        self.server = self.add_server(api_key)

    def call(self, coro, timeout: float = DEADLINE):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add_server(self, api_key=None):
        server = self.call(start_grpc_server(self.ae, "127.0.0.1", 0, api_key=api_key))
        self.servers.append(server)
        return server

    def channel(self, server=None) -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{(server or self.server).port}")

    def wait_idle(self, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.engine.has_work() and self.ae.num_requests == 0:
                return
            time.sleep(0.01)
        raise AssertionError("engine did not go idle")

    def close(self) -> None:
        for s in self.servers:
            self.call(s.stop(0))
        self.call(self.ae.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def daemon(shared_pair):
    d = Daemon(make_engine(shared_pair))
    yield d
    d.close()


@pytest.fixture(scope="module")
def ref_engine(shared_pair):
    """An in-process engine for reference outputs (not the daemon's: step() belongs to one thread)."""
    return make_engine(shared_pair)


@pytest.fixture(scope="module")
def stub(daemon):
    with daemon.channel() as ch:
        yield specd_pb2_grpc.SpecdStub(ch)


def collect(responses):
    deltas, done = [], None
    for r in responses:
        assert done is None, "nothing may follow Done"
        if r.HasField("delta"):
            deltas.append(r.delta)
        else:
            done = r.done
    assert done is not None, "stream ended without Done"
    return deltas, done


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value


# --- streaming -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode",
    [pb.SPECULATION_MODE_UNSPECIFIED, pb.SPECULATION_MODE_CHAIN, pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_HYBRID],
    ids=["auto", "chain", "off", "hybrid"],
)
def test_greedy_stream_matches_engine_generate(ref_engine, daemon, stub, mode):
    ids = ref_engine.tokenizer(PROMPT)["input_ids"]
    spec = {
        pb.SPECULATION_MODE_UNSPECIFIED: "auto",
        pb.SPECULATION_MODE_CHAIN: "chain",
        pb.SPECULATION_MODE_OFF: "off",
        pb.SPECULATION_MODE_HYBRID: "hybrid",
    }[mode]
    ref = off_main_thread(
        ref_engine.generate,
        [ids],
        SamplingParams(temperature=0.0, max_tokens=60),
        build_request(ref_engine.tokenizer, prompt=PROMPT, speculation={"mode": spec}).spec,
    )[0]

    req = pb.GenerateRequest(
        id="r1", prompt=PROMPT, max_tokens=60, temperature=0.0, speculation=pb.Speculation(mode=mode)
    )
    responses = list(stub.Generate(req, timeout=DEADLINE))
    assert all(r.id == "r1" for r in responses)
    deltas, done = collect(responses)
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert all(d.token_ids for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == ref.output_ids
    assert "".join(d.text for d in deltas) == ref_engine.output_text(ref)
    assert done.finish_reason == ref.finish_reason
    assert done.usage.prompt_tokens == len(ids)
    assert done.usage.completion_tokens == len(ref.output_ids)
    assert done.spec.steps >= len(deltas) >= 1  # one Delta per step, merged when steps outran the stream
    if spec == "off":
        assert done.spec.draft_tokens == 0 and done.spec.mean_accepted_length == 1.0
    else:  # one Delta per step, several tokens per step when drafts are accepted
        assert done.spec.draft_tokens > 0
        assert done.spec.mean_accepted_length == pytest.approx(
            1 + done.spec.accepted_tokens / done.spec.steps, abs=1e-3
        )
        assert sum(len(d.token_ids) for d in deltas) == done.spec.steps + done.spec.accepted_tokens
    assert 0 <= done.timing.queue_ms <= done.timing.ttft_ms <= done.timing.total_ms
    assert done.timing.total_ms > 0
    daemon.wait_idle()
    assert daemon.engine.kv_blocks_used() == (0, 0)


def test_penalties_reach_the_engine(ref_engine, daemon, stub):
    """presence / frequency / repetition penalties and min_p: the engine's penalized greedy reply; a
    bad value is INVALID_ARGUMENT naming the field."""
    kw = {"presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.25, "min_p": 0.1}
    ids = ref_engine.tokenizer(PROMPT)["input_ids"]
    ref = off_main_thread(ref_engine.generate, [ids], SamplingParams(temperature=0.0, max_tokens=40, **kw))[0]
    plain = off_main_thread(ref_engine.generate, [ids], SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert ref.output_ids != plain.output_ids
    deltas, _ = collect(
        stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=40, temperature=0.0, **kw), timeout=DEADLINE)
    )
    assert [t for d in deltas for t in d.token_ids] == ref.output_ids
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=4, frequency_penalty=-2.5), timeout=DEADLINE))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "frequency_penalty" in ei.value.details()


def test_chat_messages_and_stop_strings(daemon, stub):
    tok = daemon.engine.tokenizer
    msgs = [pb.ChatMessage(role="user", content="Once upon a time")]
    deltas, done = collect(
        stub.Generate(pb.GenerateRequest(messages=msgs, max_tokens=12, temperature=0.0), timeout=DEADLINE)
    )
    # the tiny pair's tokenizer has no chat template: the content is the raw prompt
    assert done.usage.prompt_tokens == len(tok("Once upon a time")["input_ids"])
    assert done.usage.completion_tokens == sum(len(d.token_ids) for d in deltas) > 0
    text = "".join(d.text for d in deltas)
    # a stop string cut from that greedy text: the output ends right before it
    words = text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    deltas, done = collect(
        stub.Generate(pb.GenerateRequest(messages=msgs, max_tokens=12, temperature=0.0, stop=[stop]), timeout=DEADLINE)
    )
    assert done.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == text[: text.index(stop)]


def test_defaults_stop_token_ids_ignore_eos(daemon, stub):
    n_prompt = len(daemon.engine.tokenizer(PROMPT)["input_ids"])
    # unset max_tokens: min(256, context - prompt), as on the websocket
    deltas, done = collect(
        stub.Generate(pb.GenerateRequest(prompt=PROMPT, temperature=0.0, ignore_eos=True), timeout=DEADLINE)
    )
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == min(256, daemon.engine.max_model_len - n_prompt)
    out = [t for d in deltas for t in d.token_ids]
    # stop_token_ids: generation ends with the first occurrence of the stop token
    stop_id = out[5]
    deltas, done = collect(
        stub.Generate(
            pb.GenerateRequest(
                prompt=PROMPT, temperature=0.0, ignore_eos=True, max_tokens=40, stop_token_ids=[stop_id]
            ),
            timeout=DEADLINE,
        )
    )
    assert done.finish_reason == "stop"
    assert [t for d in deltas for t in d.token_ids] == out[: out.index(stop_id) + 1]


def test_seeded_sampling_is_reproducible(daemon, stub):
    req = pb.GenerateRequest(
        prompt=PROMPT,
        max_tokens=24,
        temperature=0.8,
        top_p=0.9,
        top_k=40,
        seed=7,
        priority=pb.PRIORITY_BATCH,
        speculation=pb.Speculation(mode=pb.SPECULATION_MODE_TREE, max_draft_tokens=8),
    )
    a, _ = collect(stub.Generate(req, timeout=DEADLINE))
    b, _ = collect(stub.Generate(req, timeout=DEADLINE))
    # the tokens, not how they were grouped: how many a step accepts follows the drafting policy's
    # timings, which differ between runs; the seeded draws do not
    tokens = [[t for d in run for t in d.token_ids] for run in (a, b)]
    assert tokens[0] and tokens[0] == tokens[1]


def _slow_steps(engine, seconds):
    engine.step_hook = lambda e: time.sleep(seconds)


@pytest.mark.parametrize("how", ["cancel", "close_channel"])
def test_cancel_mid_stream_frees_kv(daemon, how):
    eng = daemon.engine
    _slow_steps(eng, 0.03)
    try:
        ch = daemon.channel()
        stub = specd_pb2_grpc.SpecdStub(ch)
        call = stub.Generate(
            pb.GenerateRequest(prompt=PROMPT, max_tokens=400, temperature=0.0, ignore_eos=True), timeout=DEADLINE
        )
        first = next(call)
        assert first.HasField("delta")
        assert eng.kv_blocks_used()[0] > 0
        if how == "cancel":
            call.cancel()
        else:
            ch.close()
        with pytest.raises(grpc.RpcError) as ei:
            for _ in call:
                pass
        assert ei.value.code() == grpc.StatusCode.CANCELLED
        daemon.wait_idle()
        assert eng.kv_blocks_used() == (0, 0)
        assert not eng.seqs
    finally:
        eng.step_hook = None
        ch.close()
    # still serving
    with daemon.channel() as ch2:
        _, done = collect(
            specd_pb2_grpc.SpecdStub(ch2).Generate(
                pb.GenerateRequest(prompt=PROMPT, max_tokens=4, temperature=0.0), timeout=DEADLINE
            )
        )
    assert done.usage.completion_tokens == 4


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, status, code",
    [
        (dict(prompt=PROMPT, temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (dict(prompt=PROMPT, temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (dict(prompt=PROMPT, top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (dict(prompt=PROMPT, max_tokens=-5), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (dict(prompt=PROMPT, max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (dict(), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (
            dict(prompt=PROMPT, messages=[pb.ChatMessage(role="user", content="x")]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_request",
        ),
        (dict(messages=[pb.ChatMessage(role="", content="x")]), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (dict(prompt=PROMPT, stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (
            dict(prompt=PROMPT, speculation=pb.Speculation(max_draft_tokens=1000)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid_request",
        ),
        (dict(prompt=PROMPT, priority=7), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (dict(prompt=PROMPT, stop=["a"] * 17), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (dict(prompt=PROMPT, id="x" * 257), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
        (dict(prompt=PROMPT * 40), grpc.StatusCode.OUT_OF_RANGE, "too_long"),
        (dict(prompt=PROMPT, max_tokens=600), grpc.StatusCode.OUT_OF_RANGE, "too_long"),
        (dict(prompt=PROMPT * 40, max_tokens=8), grpc.StatusCode.OUT_OF_RANGE, "too_long"),
    ],
)
def test_invalid_arguments(daemon, stub, kw, status, code):
    e = rpc_error(lambda: list(stub.Generate(pb.GenerateRequest(**kw), timeout=DEADLINE)))
    assert e.code() == status, e.details()
    assert e.details().startswith(code + ": ")
    assert ("specd-error-code", code) in tuple(e.trailing_metadata())
    assert daemon.engine.kv_blocks_used() == (0, 0)


def test_malformed_payload_is_rejected_and_server_keeps_serving(daemon, stub):
    with daemon.channel() as ch:
        raw = ch.unary_stream(
            "/specd.v1.Specd/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        for garbage in (b"\xff\xff\xff\xff\xff", b"\x1a\x02\xff\xfe", b"\x0a\x10short"):
            e = rpc_error(lambda garbage=garbage: list(raw(garbage, timeout=DEADLINE)))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.details().startswith("invalid_request: malformed GenerateRequest")
        # a well-formed request sent the same way works
        out = list(
            raw(pb.GenerateRequest(prompt=PROMPT, max_tokens=3, temperature=0.0).SerializeToString(), timeout=DEADLINE)
        )
        assert pb.GenerateResponse.FromString(out[-1]).done.usage.completion_tokens == 3
        e = rpc_error(lambda: ch.unary_unary("/specd.v1.Specd/Nope")(b"", timeout=DEADLINE))
        assert e.code() == grpc.StatusCode.UNIMPLEMENTED
    _, done = collect(stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=3), timeout=DEADLINE))
    assert done.usage.completion_tokens == 3


def test_api_key(daemon):
    server = daemon.add_server(api_key="s3cret")
    with daemon.channel(server) as ch:
        stub = specd_pb2_grpc.SpecdStub(ch)
        req = pb.GenerateRequest(prompt=PROMPT, max_tokens=3, temperature=0.0)
        for md in (None, (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
            e = rpc_error(lambda md=md: list(stub.Generate(req, metadata=md, timeout=DEADLINE)))
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            assert e.details().startswith("unauthorized: ")
        _, done = collect(stub.Generate(req, metadata=(("authorization", "Bearer s3cret"),), timeout=DEADLINE))
        assert done.usage.completion_tokens == 3
        # probes need no key
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_port_in_use_raises(daemon):
    with pytest.raises(RuntimeError, match="cannot bind"):
        daemon.call(start_grpc_server(daemon.ae, "127.0.0.1", daemon.server.port))


# --- health, reflection ----------------------------------------------------------------------------


def test_health_serving(daemon):
    with daemon.channel() as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", "specd.v1.Specd"):
            resp = h.Check(health_pb2.HealthCheckRequest(service=name), timeout=DEADLINE)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        e = rpc_error(lambda: h.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=DEADLINE))
        assert e.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_service(daemon):
    with daemon.channel() as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"specd.v1.Specd", "grpc.health.v1.Health"} <= services
        svc = descriptor_pool.DescriptorPool(db).FindServiceByName("specd.v1.Specd")
        m = svc.methods_by_name["Generate"]
        assert m.input_type.full_name == "specd.v1.GenerateRequest"
        assert m.output_type.full_name == "specd.v1.GenerateResponse"
        assert m.server_streaming and not m.client_streaming


def test_overloaded_then_draining(shared_pair):
    """A separate daemon (max_queue 1): the queue fills -> RESOURCE_EXHAUSTED; drain -> health
    NOT_SERVING and new calls UNAVAILABLE; the running request still completes."""
    d = Daemon(make_engine(shared_pair), max_queue=1)
    try:
        _slow_steps(d.engine, 0.02)
        with d.channel() as ch:
            stub, h = specd_pb2_grpc.SpecdStub(ch), health_pb2_grpc.HealthStub(ch)
            call = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=30, temperature=0.0), timeout=DEADLINE)
            assert next(call).HasField("delta")
            req = pb.GenerateRequest(prompt=PROMPT, max_tokens=3)
            e = rpc_error(lambda: list(stub.Generate(req, timeout=DEADLINE)))
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.details().startswith("overloaded: ")

            drain = asyncio.run_coroutine_threadsafe(d.ae.drain(20.0), d.loop)
            end = time.monotonic() + 5
            while (
                h.Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE).status
                != health_pb2.HealthCheckResponse.NOT_SERVING
            ):
                assert time.monotonic() < end, "health never turned NOT_SERVING"
                time.sleep(0.05)
            e = rpc_error(lambda: list(stub.Generate(req, timeout=DEADLINE)))
            assert e.code() == grpc.StatusCode.UNAVAILABLE and e.details().startswith("shutting_down: ")
            _, done = collect(call)
            assert done.usage.completion_tokens == 30 or done.finish_reason == "stop"
            drain.result(DEADLINE)
        assert d.engine.kv_blocks_used() == (0, 0)
    finally:
        d.engine.step_hook = None
        d.close()


def test_set_serving_hook(daemon):
    with daemon.channel() as ch:
        h = health_pb2_grpc.HealthStub(ch)

        def status():
            return h.Check(health_pb2.HealthCheckRequest(service="specd.v1.Specd"), timeout=DEADLINE).status

        async def flip(v):
            daemon.server.set_serving(v)
            await asyncio.sleep(0.05)

        daemon.call(flip(False))
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        daemon.call(flip(True))
        assert status() == health_pb2.HealthCheckResponse.SERVING


# --- the shared request builder --------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('system message must come first') }}{% endif %}"
    "{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_chat_template_end_to_end(daemon, stub):
    """Messages go through the tokenizer's chat template with add_generation_prompt=True."""
    tok = daemon.engine.tokenizer
    assert not getattr(tok, "chat_template", None)
    msgs = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat"}]
    tok.chat_template = CHAT_TEMPLATE
    try:
        want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert want == tok("system: Tell a story.\nuser: A cat\nassistant:", add_special_tokens=False)["input_ids"]
        assert prompt_ids_from(tok, messages=msgs) == want
        _, done = collect(
            stub.Generate(
                pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in msgs], max_tokens=3, temperature=0.0),
                timeout=DEADLINE,
            )
        )
        assert done.usage.prompt_tokens == len(want)
        # the template's own errors are the client's: invalid_request
        e = rpc_error(
            lambda: list(
                stub.Generate(
                    pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in msgs[::-1]], max_tokens=3),
                    timeout=DEADLINE,
                )
            )
        )
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "system message must come first" in e.details()
    finally:
        tok.chat_template = None


def test_request_build_validation(ref_engine):
    eng = ref_engine
    tok = eng.tokenizer
    r = build_request(
        tok,
        prompt=PROMPT,
        temperature=0.5,
        seed=3,
        stop="x",
        priority="batch",
        speculation={"mode": "chain", "max_draft_tokens": 4},
    )
    assert r.prompt_ids == tok(PROMPT)["input_ids"] and r.priority == "batch"
    assert r.params.temperature == 0.5 and r.params.seed == 3 and r.params.stop == ("x",)
    assert r.spec.mode == "chain" and r.spec.max_draft_tokens == 4
    for bad in (
        dict(prompt=PROMPT, priority="urgent"),
        dict(prompt=PROMPT, speculation={"mode": "wide"}),
        dict(prompt=PROMPT, speculation={"depth": 3}),
        dict(prompt=PROMPT, top_k=-2),
        dict(prompt=PROMPT, stop=[1]),
        dict(messages="hi"),
        dict(messages=[]),
        dict(messages=[{"role": "user", "content": 3}]),
        dict(prompt=3),
    ):
        with pytest.raises(RequestError) as ei:
            build_request(tok, **bad)
        assert ei.value.code == "invalid_request", bad
    seq = off_main_thread(eng.generate, [r.prompt_ids], SamplingParams(temperature=0.0, max_tokens=5))[0]
    s = summarize(seq)
    assert s["usage"] == {"prompt_tokens": len(r.prompt_ids), "completion_tokens": 5}
    assert set(s["spec"]) == {"steps", "draft_tokens", "accepted_tokens", "mean_accepted_length"}
    assert set(s["timing"]) == {"queue_ms", "ttft_ms", "total_ms"}
