"""The OpenAI-compatible surface against a live daemon (loopback, the shared stories260K pair), driven by
the official ``openai`` package: chat (JSON and SSE), completions, models, responses over HTTP and over
the Responses WebSocket mode (``client.responses.connect()``) with ``previous_response_id``, usage,
and every refusal in OpenAI's error shape and status. Greedy text equals the in-process engine's."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import openai
import orjson
import pytest
from conftest import serve_args, serve_engine, ws_collect
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

pytestmark = [
    pytest.mark.timeout(120),
    # the SDK's own websocket client (openai/_websocket_connection.py) trips a websockets deprecation
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"),
]

MODEL = "stories260K"
PROMPT = "Once upon a time"
LONG = "Lily and Tom went to the park. They saw a big tree and a little dog. The dog was happy and ran around. " * 2
N = 24
PENALIZED = {"presence_penalty": 0.6, "frequency_penalty": 0.9, "repetition_penalty": 1.2, "min_p": 0.05}


@pytest.fixture(scope="module")
def engine(shared_pair):
    return serve_engine(shared_pair, num_blocks=512)


def _greedy(engine, n=N, **kw):
    """(text, token ids) of the in-process engine for a request built like the server builds it."""
    from specd.serving.request_build import build_request

    b = build_request(engine.tokenizer, max_tokens=n, temperature=0.0, max_model_len=engine.max_model_len, **kw)
    seq = engine.generate([b.prompt_ids], b.params, b.spec)[0]
    return engine.output_text(seq), seq.output_ids


@pytest.fixture(scope="module")
def reference(engine):
    return {
        "chat": _greedy(engine, messages=[{"role": "user", "content": PROMPT}]),
        "prompt": _greedy(engine, prompt=PROMPT),
        "long": _greedy(engine, messages=[{"role": "user", "content": LONG}]),
        "penalized": _greedy(engine, messages=[{"role": "user", "content": LONG}], **PENALIZED),
    }


@pytest.fixture(scope="module")
def server(engine, reference):
    from specd.serving.app import ServerThread

    srv = ServerThread(serve_args(num_blocks=512, max_message_bytes=8192), engine).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="anything", max_retries=0, timeout=60)


def wait_idle(server, timeout=20.0) -> bool:
    eng, ae = server.app.ae.engine, server.app.ae
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not eng.has_work() and ae.num_requests == 0 and eng.kv_blocks_used() == (0, 0):
            return True
        time.sleep(0.02)
    return False


def post(server, path, body, headers=None) -> tuple:
    """(status, parsed JSON body, headers) of a raw POST (bytes bodies are sent as they are)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.port}{path}",
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read()), e.headers


def assert_openai_error(body, status_code=None, code=None):
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body


# models, chat, completions ---------------------------------------------------------------------------
def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "specd"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_non_streaming_equals_in_process_greedy(client, reference):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=N, temperature=0
    )
    text, ids = reference["chat"]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == len(ids) and r.usage.total_tokens == r.usage.prompt_tokens + len(ids)
    spec = r.usage.model_extra["speculation"]
    assert set(spec) == {"steps", "draft_tokens", "accepted_tokens", "mean_accepted_length"} and spec["steps"] >= 1


def test_chat_streaming_with_usage(client, reference):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_completion_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["chat"][0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_prompt(client, reference, engine):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == reference["prompt"][0]
    ids = engine.tokenizer(PROMPT)["input_ids"]
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=N, temperature=0)
    assert r2.choices[0].text == reference["prompt"][0] and r2.usage.prompt_tokens == len(ids)
    parts = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == reference["prompt"][0]
    assert parts[-1].choices[0].finish_reason == "length"
    default = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0)  # OpenAI's default: 16
    assert default.usage.completion_tokens == 16


def test_speculation_extension_and_seeded_sampling(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=N, temperature=0)
    off = client.chat.completions.create(**kw, extra_body={"speculation": {"mode": "off"}})
    tree = client.chat.completions.create(**kw, extra_body={"speculation": {"mode": "tree"}})
    assert off.usage.model_extra["speculation"]["draft_tokens"] == 0
    assert tree.usage.model_extra["speculation"]["draft_tokens"] > 0
    assert off.choices[0].message.content == tree.choices[0].message.content  # lossless
    # a seed fixes a sample (for a fixed speculation shape: the adaptive one draws differently)
    kw.update(temperature=0.9, seed=7, top_p=0.95, extra_body={"top_k": 40, "speculation": {"mode": "off"}})
    a, b = (client.chat.completions.create(**kw).choices[0].message.content for _ in range(2))
    assert a == b


# responses ---------------------------------------------------------------------------------------------
def test_responses_http_chain_stream_store(client, reference):
    first = client.responses.create(model=MODEL, input=LONG, max_output_tokens=N, temperature=0)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.output_text == reference["long"][0] and first.usage.output_tokens == N
    second = client.responses.create(
        model=MODEL, input="The dog", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    # the continued conversation's prompt starts with the first turn's: the prefix cache serves it
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16 * (first.usage.input_tokens // 16) - 16
    assert second.previous_response_id == first.id
    events = list(client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert ei.value.body["code"] == "previous_response_not_found"


def test_the_callers_key_is_its_tenant_in_the_engine(server):
    """Model-free drafting reads only the same key's earlier requests: every front end hands the
    engine the key's tenant (HTTP bearer, the websocket's header or auth message)."""
    from specd.serving.auth import Auth

    seen = []
    listener = lambda outs, dt: seen.extend(o.seq.tenant for o in outs if o.finished)  # noqa: E731
    server.call(lambda: server.app.ae.listeners.append(listener))
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="key-t", max_retries=0)
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        c.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2)
        headers = {"Authorization": "Bearer key-t"}
        with connect(f"ws://127.0.0.1:{server.port}/ws", additional_headers=headers) as ws:
            ws.send(orjson.dumps({"type": "generate", "id": "t", "prompt": PROMPT, "max_tokens": 2}).decode())
            ws_collect(ws, "t")
        with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:  # no key: no tenant
            ws.send(orjson.dumps({"type": "generate", "id": "u", "prompt": PROMPT, "max_tokens": 2}).decode())
            ws_collect(ws, "u")
    finally:
        server.call(lambda: server.app.ae.listeners.remove(listener))
    assert seen == [Auth.tenant("key-t")] * 3 + [None] and Auth.tenant("key-t") is not None


def test_stored_responses_belong_to_their_key(server):
    a = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="key-b", max_retries=0)
    r = a.responses.create(model=MODEL, input=PROMPT, max_output_tokens=4, temperature=0)
    assert a.responses.retrieve(r.id).id == r.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(r.id)
    unstored = a.responses.create(model=MODEL, input=PROMPT, max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)


def test_responses_websocket_mode_chains_and_cancels(client, reference):
    with client.responses.connect() as conn:
        conn.response.create(model=MODEL, input=LONG, max_output_tokens=N, temperature=0, store=False)
        events = _until_final(conn)
        assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
        first = events[-1].response
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reference["long"][0]
        # store=false: the connection itself keeps its last response for previous_response_id
        conn.response.create(model=MODEL, input="The dog", previous_response_id=first.id, max_output_tokens=4)
        second = _until_final(conn)[-1].response
        assert second.usage.input_tokens_details.cached_tokens >= 16 * (first.usage.input_tokens // 16) - 16
        # one response in flight; response.cancel ends it as incomplete (cancelled)
        long = {"type": "response.create", "model": MODEL, "input": PROMPT, "max_output_tokens": 400}
        conn.send_raw(orjson.dumps({**long, "ignore_eos": True}).decode())
        conn.response.create(model=MODEL, input=PROMPT, max_output_tokens=4)
        conn.send_raw('{"type":"response.cancel"}')  # (specd's extension: not in the SDK's event types)
        events = _until_final(conn, errors_ok=True)
        errors = [e for e in events if e.type == "error"]
        assert errors and errors[0].error.code == "response_already_in_flight" and errors[0].status == 400
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.incomplete_details.reason == "cancelled"
        assert events[-1].response.usage.output_tokens < 400


def _until_final(conn, errors_ok=False) -> list:
    out = []
    for e in conn:
        out.append(e)
        if e.type in ("response.completed", "response.incomplete", "response.failed"):
            return out
        if e.type == "error" and not errors_ok:
            raise AssertionError(e)
    raise AssertionError("connection closed")


# greedy text over every surface equals the in-process engine ----------------------------------------
def test_greedy_text_equal_over_http_both_websockets_and_in_process(server, client, reference):
    text = reference["chat"][0]
    messages = [{"role": "user", "content": PROMPT}]
    http = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0)
    with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
        gen = {"type": "generate", "id": "g", "messages": messages, "max_tokens": N, "temperature": 0}
        ws.send(orjson.dumps(gen).decode())
        deltas, done = ws_collect(ws, "g")
    with client.responses.connect() as conn:
        conn.response.create(model=MODEL, input=PROMPT, max_output_tokens=N, temperature=0)
        final = _until_final(conn)[-1].response
    assert http.choices[0].message.content == "".join(d["text"] for d in deltas) == final.output_text == text
    assert done["usage"]["completion_tokens"] == http.usage.completion_tokens == final.usage.output_tokens


def test_penalties_over_http_and_the_websocket_are_the_engines(server, client, reference):
    """OpenAI's presence / frequency penalties and vLLM's repetition_penalty / min_p reach the engine
    from every front end: the same greedy reply as in process, unlike the unpenalized one."""
    text = reference["penalized"][0]
    assert text != reference["long"][0]
    messages = [{"role": "user", "content": LONG}]
    extra = {k: v for k, v in PENALIZED.items() if k in ("repetition_penalty", "min_p")}
    http = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=N,
        temperature=0,
        presence_penalty=PENALIZED["presence_penalty"],
        frequency_penalty=PENALIZED["frequency_penalty"],
        extra_body=extra,
    )
    with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
        gen = {"type": "generate", "id": "p", "messages": messages, "max_tokens": N, "temperature": 0, **PENALIZED}
        ws.send(orjson.dumps(gen).decode())
        deltas, _ = ws_collect(ws, "p")
        ws.send(orjson.dumps({**gen, "id": "bad", "repetition_penalty": 0}).decode())
        bad = orjson.loads(ws.recv(timeout=30))
    assert http.choices[0].message.content == "".join(d["text"] for d in deltas) == text
    assert (bad["type"], bad["code"]) == ("error", "invalid_request") and "repetition_penalty" in bad["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, presence_penalty=2.5)
    assert ei.value.body["param"] == "presence_penalty"


# n choices --------------------------------------------------------------------------------------------------
def test_n_greedy_choices_are_the_greedy_reply(client, server, reference):
    text, ids = reference["chat"]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=N, temperature=0, n=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content == text for c in r.choices)
    assert r.usage.completion_tokens == 3 * len(ids) and r.usage.total_tokens == r.usage.prompt_tokens + 3 * len(ids)
    one = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=N, temperature=0
    )
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # (the prompt counted once)
    spec = r.usage.model_extra["speculation"]
    assert spec["steps"] >= 3 and spec["mean_accepted_length"] == pytest.approx(
        1 + spec["accepted_tokens"] / spec["steps"], abs=1e-3
    )
    assert wait_idle(server)


def test_n_sampled_choices_are_the_seeded_requests_streamed_or_not(client, server):
    """Choice i of a seeded request is the request with seed + i; streamed, the chunks of the choices
    interleave by ``index`` and reassemble to the same texts, each with its own finish, then one
    usage chunk (summed) and ``[DONE]`` once."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=1.0)
    kw["extra_body"] = {"speculation": {"mode": "off"}}  # (a seed's draws depend on what was drafted)
    whole = client.chat.completions.create(**kw, n=3, seed=11)
    alone = [client.chat.completions.create(**kw, seed=11 + i).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in whole.choices] == alone and len(set(alone)) > 1
    texts, finishes, usage = ["", "", ""], [None] * 3, []
    for chunk in client.chat.completions.create(
        **kw, n=3, seed=11, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == alone and finishes == [c.finish_reason for c in whole.choices]
    assert len(usage) == 1 and usage[0].completion_tokens == whole.usage.completion_tokens
    body = {k: v for k, v in kw.items() if k != "extra_body"}
    status, raw, _ = post(server, "/v1/chat/completions", {**body, "n": 2, "stream": True})
    assert status == 200 and raw.count(b"data: [DONE]") == 1 and raw.rstrip().endswith(b"data: [DONE]")
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=2, logprobs=1)
    assert [c.index for c in comp.choices] == [0, 1] and comp.choices[0].text == comp.choices[1].text
    assert all(c.logprobs.text_offset[0] == 0 and len(c.logprobs.tokens) == 6 for c in comp.choices)
    assert wait_idle(server)


def test_a_client_leaving_an_n_stream_cancels_every_choice(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "n": 3, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", orjson.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.read(16).startswith(b"data: ")  # (the first choice chunk has come)
    conn.sock.close()  # (gone mid-stream: every choice is cancelled and its KV freed)
    conn.close()
    assert wait_idle(server)


def test_a_failed_choice_fails_the_request_and_frees_every_choice(server, engine):
    """One of ``n`` choices failing in the engine: a 500, the other choices cancelled, nothing held."""

    def hook(stage, seqs):
        if stage == "commit" and any(s.request_id.endswith("-1") for s in seqs):
            raise RuntimeError("injected")

    engine.fault_hook = hook
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "n": 3, "ignore_eos": True}
        status, got, _ = post(server, "/v1/completions", body)
    finally:
        engine.fault_hook = None
    assert status == 500 and got["error"]["message"], got
    assert wait_idle(server)


def test_n_out_of_range_is_a_400(client):
    for n, api in ((0, "chat"), (9, "chat"), (2, "responses")):
        with pytest.raises(openai.BadRequestError) as ei:
            if api == "chat":
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=n)
            else:
                client.responses.create(model=MODEL, input="x", extra_body={"n": n})
        assert ei.value.body["param"] == "n"


# refusals: OpenAI's error shape and statuses -------------------------------------------------------------
def test_errors_have_openai_shape_and_status(server, client):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    cases = [
        (b"{not json", 400, "invalid_json"),
        (b'["a list"]', 400, "invalid_json"),
        (b'{"model": "stories260K", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "invalid_json"),
        ({**chat, "model": "gpt-4o"}, 404, "model_not_found"),
        ({"messages": chat["messages"]}, 400, "invalid_value"),
        ({**chat, "messages": []}, 400, "invalid_value"),
        ({**chat, "messages": [{"role": "function", "content": "x"}]}, 400, "unsupported_parameter"),
        ({**chat, "messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_value"),  # (no tool_call_id)
        ({**chat, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400, "invalid_tools"),
        (
            {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": 3}}},
            400,
            "invalid_schema",
        ),
        ({**chat, "max_tokens": 100000}, 400, "context_length_exceeded"),
        ({**chat, "messages": [{"role": "user", "content": "word " * 1500}]}, 400, "context_length_exceeded"),
        ({**chat, "temperature": "hot"}, 400, "invalid_value"),
        ({**chat, "temperature": -1}, 400, "invalid_value"),
        ({**chat, "max_tokens": 0}, 400, "invalid_value"),
        ({**chat, "n": 9}, 400, "invalid_value"),
        ({**chat, "logprobs": True, "top_logprobs": 99}, 400, "invalid_value"),
        ({**chat, "stream_options": {"include_usage": True}}, 400, "invalid_value"),
        ({**chat, "messages": [{"role": "user", "content": "x" * 9000}]}, 413, "request_too_large"),
    ]
    for body, status, code in cases:
        st, got, _ = post(server, "/v1/chat/completions", body)
        assert st == status, (body if isinstance(body, bytes) else str(body)[:200], st, got)
        assert_openai_error(got, code=code)
    st, got, _ = post(server, "/v1/responses", {"model": MODEL, "input": 7})
    assert st == 400 and got["error"]["param"] == "input"
    st, got, _ = post(server, "/v1/completions", {"model": MODEL, "prompt": [[1, 2], [3]]})
    assert st == 400 and got["error"]["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=chat["messages"], max_tokens=100000)
    assert ei.value.status_code == 400 and ei.value.code == "context_length_exceeded"
    assert wait_idle(server)


def test_bad_key_is_401_everywhere(engine):
    from specd.serving.app import ServerThread

    srv = ServerThread(serve_args(num_blocks=512, api_key="s3cret"), engine).start()
    try:
        base = f"http://127.0.0.1:{srv.port}/v1"
        c = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as ei:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert ei.value.status_code == 401 and ei.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
        with pytest.raises(openai.AuthenticationError):
            c.responses.create(model=MODEL, input="x")
        for headers in ({}, {"Authorization": "Basic czNjcmV0"}):  # no key, another scheme
            st, got, hdr = post(srv, "/v1/completions", {"model": MODEL, "prompt": "x"}, headers)
            assert st == 401 and hdr["WWW-Authenticate"] == "Bearer"
            assert_openai_error(got, code="invalid_api_key")
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(InvalidStatus) as ei:
                connect(f"ws://127.0.0.1:{srv.port}/v1/responses", additional_headers=headers).__enter__()
            assert ei.value.response.status_code == 401
        good = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    finally:
        srv.stop()


def test_overloaded_is_429_with_retry_after_and_draining_503(engine):
    from specd.serving.app import ServerThread

    srv = ServerThread(serve_args(num_blocks=512, max_queue=1, drain_timeout=30.0), engine).start()
    try:
        long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(
            f"http://127.0.0.1:{srv.port}/v1/completions", data=orjson.dumps(long), method="POST"
        )
        with urllib.request.urlopen(req, timeout=30) as held:  # occupies the one admission slot
            assert held.readline().startswith(b"data: ")
            st, got, hdr = post(srv, "/v1/completions", {"model": MODEL, "prompt": PROMPT})
            assert st == 429 and hdr["Retry-After"] == "1"
            assert_openai_error(got, code="overloaded")
            assert got["error"]["type"] == "rate_limit_error"
            srv.app.front.draining = True
            st, got, hdr = post(
                srv, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            )
            assert st == 503 and hdr["Retry-After"] == "5"
            assert_openai_error(got, code="shutting_down")
            srv.app.front.draining = False
    finally:
        srv.stop()


def test_unknown_route_and_websocket_path(server):
    st, got, _ = post(server, "/v1/embeddings", {"model": MODEL})
    assert st == 404
    assert_openai_error(got, code="unknown_url")
    with pytest.raises(InvalidStatus) as ei:
        connect(f"ws://127.0.0.1:{server.port}/v1/chat/completions").__enter__()
    assert ei.value.response.status_code == 404
