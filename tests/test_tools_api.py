"""Structured outputs and tool calls at every door (issue 41, the API side), against a live daemon on the
shared stories260K pair, driven by the official ``openai`` client where there is one:

- ``client.chat.completions.parse`` with a pydantic model returns a parsed instance; a json_schema reply
  is the in-process engine's greedy reply under the same grammar, token for token;
- ``json_object``, vLLM's ``structured_outputs`` / ``guided_*`` on chat and completions;
- a tool round trip (``tool_choice: required`` -> ``tool_calls`` -> a ``role: tool`` result -> the next
  reply, whose prompt holds the call and the result); a named ``tool_choice``; ``auto`` leaves text free;
- streamed tool-call deltas are shaped as OpenAI's and reassemble to the non-streamed reply;
- Responses function calls over HTTP (JSON and SSE) and the WebSocket mode, continued with
  ``previous_response_id`` and a ``function_call_output`` (the stored conversation holds both);
- specd's websocket and gRPC with ``response_format`` and ``tools``;
- every bad constraint is refused before anything streams (400 / ``error`` / INVALID_ARGUMENT naming the
  problem), the compile included, in the engine thread's server and the engine process's.
"""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Literal

import grpc
import jsonschema
import openai
import orjson
import pytest
from conftest import serve_args, serve_engine, ws_collect
from pydantic import BaseModel, Field
from websockets.sync.client import connect

from specd.serving.proto.specd.v1 import specd_pb2 as pb
from specd.serving.proto.specd.v1 import specd_pb2_grpc
from specd.serving.request_build import build_request
from specd.structured import GrammarSpec, grammar_spec

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"),
]

MODEL = "stories260K"
PROMPT = "Once upon a time"
# tiny tools: the stories model's context is 512 tokens and its tokenizer writes JSON nearly a
# character a token, so one function's system prompt is ~260 tokens and a call ~50
WEATHER = {"type": "object", "properties": {"c": {"enum": ["a", "b"]}}, "required": ["c"]}
ZONE = {"type": "object", "properties": {"z": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["z"]}
TOOLS = [{"type": "function", "function": {"name": "w", "parameters": WEATHER}}]
TWO = [*TOOLS, {"type": "function", "function": {"name": "t", "parameters": ZONE}}]
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's tools
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TWO}
PET = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "happy": {"type": "boolean"}},
    "required": ["kind", "happy"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    happy: bool
    name: str = Field(max_length=8)


@pytest.fixture(scope="module")
def engine(shared_pair):
    return serve_engine(shared_pair, num_blocks=512)


@pytest.fixture(scope="module")
def ref(shared_pair):
    """The reference engine ``_greedy`` steps on the test's thread: not ``engine``, which the module's
    ``server`` steps on its own loop thread, and whose idle loop would step a request the test added
    to it too (a grammar waiting to be compiled counts as work): two threads stepping one engine
    gave a request a second, fresh grammar matcher mid-reply ("token ... is outside the request's
    grammar", once in a full run)."""
    return serve_engine(shared_pair, num_blocks=512)


@pytest.fixture(scope="module")
def server(engine):
    from specd.serving.app import ServerThread

    srv = ServerThread(serve_args(num_blocks=512, grpc_port=_free_port()), engine).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="k", max_retries=0, timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _greedy(engine, body: dict, n: int = 120, **kw) -> str:
    """The in-process engine's greedy reply to a request body's messages under its constraint."""
    g = grammar_spec(body)
    b = build_request(
        engine.tokenizer, max_tokens=n, temperature=0.0, max_model_len=engine.max_model_len, grammar=g, **kw
    )
    seq = engine.generate([b.prompt_ids], b.params, b.spec, grammar=g)[0]
    return engine.output_text(seq)


def _idle(server, timeout=20.0) -> bool:
    eng, ae = server.app.ae.engine, server.app.ae
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not eng.has_work() and ae.num_requests == 0 and eng.kv_blocks_used() == (0, 0):
            return ae.healthy()
        time.sleep(0.02)
    return False


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, **kw}


def _check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


# response_format -----------------------------------------------------------------------------------
def test_parse_with_a_pydantic_model(client, server):
    r = client.chat.completions.parse(**_chat(max_tokens=150), response_format=Pet)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop"
    assert Pet.model_validate_json(r.choices[0].message.content) == pet
    assert _idle(server)


def test_a_json_schema_reply_is_the_engines_greedy_reply_under_the_grammar(client, ref):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    r = client.chat.completions.create(**_chat(max_tokens=120), response_format=rf)
    text = r.choices[0].message.content
    assert text == _greedy(ref, {"response_format": rf}, messages=[{"role": "user", "content": PROMPT}])
    jsonschema.validate(json.loads(text), PET)
    s = client.chat.completions.create(**_chat(max_tokens=120), response_format=rf, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == text


def test_json_object_and_vllm_extensions_on_chat_and_completions(client, ref):
    jo = {"response_format": {"type": "json_object"}}
    r = client.chat.completions.create(**_chat(max_tokens=40), **jo)
    assert r.choices[0].message.content.startswith('{"')  # (the tiny model tells its story inside a string)
    assert r.choices[0].message.content == _greedy(ref, jo, n=40, messages=[{"role": "user", "content": PROMPT}])
    r = client.chat.completions.create(**_chat(max_tokens=20), extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(**_chat(max_tokens=20), extra_body={"structured_outputs": {"regex": "[a-c]{3}"}})
    assert re.fullmatch("[a-c]{3}", r.choices[0].message.content)
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body=jo)
    assert c.choices[0].text == _greedy(ref, jo, n=40, prompt=PROMPT) and c.choices[0].text.startswith('{"')
    so = {"structured_outputs": {"choice": ["A", "B"]}}
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, extra_body=so)
    assert c.choices[0].text in ("A", "B")


# tool calls ----------------------------------------------------------------------------------------
def test_a_tool_round_trip(client, engine):
    msgs = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(**_chat(max_tokens=100), tools=TOOLS, tool_choice="required")
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None and m.tool_calls
    for c in m.tool_calls:
        assert c.type == "function" and c.id.startswith("call_")
        _check_call(c.function.name, c.function.arguments)
    first = m.tool_calls[0]
    msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": first.id, "content": "sunny"}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=16, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length") and not r2.choices[0].message.tool_calls
    assert isinstance(r2.choices[0].message.content, str)
    # the second prompt is the conversation with the tools, the call and the result, as the server renders it
    checked = [{k: v for k, v in x.items() if k in ("role", "content", "tool_calls", "tool_call_id")} for x in msgs]
    b = build_request(engine.tokenizer, messages=checked, max_tokens=16, grammar=grammar_spec({"tools": TOOLS}))
    text = engine.tokenizer.decode(b.prompt_ids)
    assert r2.usage.prompt_tokens == len(b.prompt_ids)
    assert "<tool_response>\nsunny\n</tool_response>" in text and f'"name": "{first.function.name}"' in text
    assert "You can call these functions" in text and first.function.arguments in text


def test_a_named_tool_choice_calls_that_function(client):
    choice = {"type": "function", "function": {"name": "t"}}
    kw = _chat(max_tokens=60, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw, tools=TWO, tool_choice=choice)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["t"]
    assert 0 <= _check_call("t", calls[0].function.arguments)["z"] <= 9


def test_auto_leaves_free_text_free(client, ref):
    r = client.chat.completions.create(**_chat(max_tokens=24), tools=TOOLS, tool_choice="auto")
    body = {"tools": TOOLS, "tool_choice": "auto"}
    want = _greedy(ref, body, n=24, messages=[{"role": "user", "content": PROMPT}])
    assert "<tool_call>" not in want  # (the tiny model tells stories: the lazy grammar never triggers)
    assert r.choices[0].message.content == want and not r.choices[0].message.tool_calls


def _stream_calls(client, **kw) -> tuple:
    """(content, [(index, id, name, arguments)], finish reason) of a streamed reply, checking each
    tool-call delta's shape as OpenAI sends them."""
    calls, content, finish = {}, "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or []:
            if d.index not in calls:  # a call's first delta: id, type, name, empty arguments
                assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                calls[d.index] = [d.id, d.function.name, ""]
            else:  # then argument fragments only
                assert d.id is None and d.type is None and d.function.name is None and d.function.arguments
                calls[d.index][2] += d.function.arguments
    return content or None, [(i, *calls[i]) for i in sorted(calls)], finish


def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_reply(client):
    """Parallel calls (a seeded sampled reply with two, speculation off: the same tokens both times)."""
    for seed in range(16):
        kw = _chat(max_tokens=200, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
        kw["extra_body"] = {"speculation": {"mode": "off"}}
        r = client.chat.completions.create(**kw)
        if len(r.choices[0].message.tool_calls) >= 2:
            break
    whole = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert len(whole) >= 2, whole
    content, streamed, finish = _stream_calls(client, **kw)
    assert [(name, args) for _, _, name, args in streamed] == whole
    assert [i for i, *_ in streamed] == list(range(len(whole)))
    assert finish == r.choices[0].finish_reason == "tool_calls" and content == r.choices[0].message.content
    one = _chat(max_tokens=200, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(client.chat.completions.create(**one).choices[0].message.tool_calls) == 1


def test_a_reply_cut_inside_a_call_is_the_same_streamed_or_not(client):
    """``max_tokens`` ending a reply inside a call: the call comes last with its arguments as far as they
    got, as OpenAI's (``finish_reason`` "length"), the same streamed and not; cut before the call's name,
    neither reports anything of it (no content from the format's text)."""
    kw = _chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    full = client.chat.completions.create(**kw, max_tokens=200)
    (call,) = full.choices[0].message.tool_calls
    n_full = full.usage.completion_tokens
    cuts = []
    for n in (3, *range(n_full - 24, n_full)):
        r = client.chat.completions.create(**kw, max_tokens=n)
        m = r.choices[0].message
        whole = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        content, streamed, finish = _stream_calls(client, **kw, max_tokens=n)
        assert r.choices[0].finish_reason == finish == "length" and m.content is None and content is None, n
        assert [(name, args) for _, _, name, args in streamed] == whole, n
        assert len(whole) <= 1 and all(name == "w" and call.function.arguments.startswith(a) for name, a in whole)
        cuts.append(whole[0][1] if whole else None)
    inside = [a for a in cuts if a and a != call.function.arguments]  # cut inside the arguments
    assert cuts[0] is None and inside and cuts[-1] == call.function.arguments, cuts  # (the last: the tag cut)
    for a in inside:
        with pytest.raises(ValueError):
            json.loads(a)


def test_n_choices_each_parse_their_own_calls(client):
    """``n`` = 2 sampled replies to a required tool: each choice its own calls and finish, streamed the
    same by ``index``."""
    kw = _chat(max_tokens=120, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, n=2)
    kw["extra_body"] = {"speculation": {"mode": "off"}}
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
        for call in c.message.tool_calls:
            _check_call(call.function.name, call.function.arguments)
    calls: dict = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                calls.setdefault((ch.index, d.index), ["", ""])
                calls[ch.index, d.index][0] += d.function.name or ""
                calls[ch.index, d.index][1] += d.function.arguments or ""
    want = {
        (i, k): [t.function.name, t.function.arguments]
        for i, c in enumerate(r.choices)
        for k, t in enumerate(c.message.tool_calls)
    }
    assert calls == want


# Responses API -------------------------------------------------------------------------------------
def _function_calls(resp) -> list:
    return [o for o in resp.output if o.type == "function_call"]


def test_responses_function_calls_over_http(client, server):
    first = client.responses.create(model=MODEL, input=PROMPT, tools=FLAT, tool_choice="required", temperature=0)
    calls = _function_calls(first)
    assert first.status == "completed" and calls and all(o.type == "function_call" for o in first.output)
    for c in calls:
        assert c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed"
        _check_call(c.name, c.arguments)
    out = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
    second = client.responses.create(
        model=MODEL, input=out, tools=FLAT, previous_response_id=first.id, temperature=0, max_output_tokens=12
    )
    assert second.output[0].type == "message" and second.output_text
    ns = server.app.front.auth.namespace("k")
    hist = server.app.responses.store.get(ns, second.id).history
    assert hist[0] == {"role": "user", "content": PROMPT}
    assert [c["function"]["arguments"] for c in hist[1]["tool_calls"]] == [c.arguments for c in calls]
    assert hist[2] == {"role": "tool", "content": "sunny", "tool_call_id": calls[0].call_id}
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt and calls, reused
    # streamed: OpenAI's function-call events, and the same calls
    events = list(
        client.responses.create(
            model=MODEL, input=PROMPT, tools=FLAT, tool_choice="required", temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert "response.output_item.added" in kinds and "response.function_call_arguments.delta" in kinds
    assert "response.content_part.added" not in kinds  # (no text: no message item)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(c.arguments for c in calls)
    final = events[-1].response
    assert events[-1].type == "response.completed" and [o.arguments for o in _function_calls(final)] == [
        c.arguments for c in calls
    ]


def test_responses_function_calls_over_the_websocket_mode(client):
    def turn(conn, **kw) -> tuple:
        conn.response.create(model=MODEL, temperature=0, tools=FLAT, **kw)
        kinds = []
        for event in conn:
            kinds.append(event.type)
            if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
                return event, kinds
        raise AssertionError(kinds)

    with client.responses.connect() as conn:
        ev, kinds = turn(conn, input=PROMPT, tool_choice={"type": "function", "name": "w"}, parallel_tool_calls=False)
        assert ev.type == "response.completed", ev
        calls = _function_calls(ev.response)
        assert [c.name for c in calls] == ["w"] and "response.output_item.done" in kinds
        out = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "rain"}]
        ev2, _ = turn(conn, input=out, previous_response_id=ev.response.id, max_output_tokens=8)
        assert ev2.type in ("response.completed", "response.incomplete") and ev2.response.output[0].type == "message"
        assert ev2.response.usage.input_tokens > ev.response.usage.input_tokens + ev.response.usage.output_tokens


def test_responses_text_format_json_schema(client):
    fmt = {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}
    r = client.responses.create(model=MODEL, input=PROMPT, text={"format": fmt}, temperature=0, max_output_tokens=120)
    jsonschema.validate(json.loads(r.output_text), PET)
    assert r.text.format.type == "json_schema"


# specd's websocket and gRPC ------------------------------------------------------------------------
def test_websocket_response_format_and_tools(server, ref):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
    with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
        base = {"type": "generate", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0}
        ws.send(orjson.dumps({**base, "id": "j", "max_tokens": 120, "response_format": rf}).decode())
        deltas, done = ws_collect(ws, "j")
        text = "".join(d["text"] for d in deltas)
        assert done["finish_reason"] == "stop" and text == _greedy(
            ref, {"response_format": rf}, messages=base["messages"]
        )
        ws.send(
            orjson.dumps({**base, "id": "t", "max_tokens": 160, "tools": TOOLS, "tool_choice": "required"}).decode()
        )
        _, done = ws_collect(ws, "t")
        assert done["finish_reason"] == "tool_calls" and done["content"] is None and done["tool_calls"]
        for c in done["tool_calls"]:
            _check_call(c["function"]["name"], c["function"]["arguments"])
        ws.send(orjson.dumps({**base, "id": "c", "max_tokens": 8, "guided_choice": ["left", "right"]}).decode())
        deltas, done = ws_collect(ws, "c")
        assert "".join(d["text"] for d in deltas) in ("left", "right") and "tool_calls" not in done
        ws.send(orjson.dumps({**base, "id": "bad", "structured_outputs": {"regex": "(("}}).decode())
        deltas, err = ws_collect(ws, "bad")
        assert not deltas and err["type"] == "error" and err["code"] == "invalid_regex"


def test_grpc_response_format_and_tools(server):
    def call(**kw) -> tuple:
        with grpc.insecure_channel(f"127.0.0.1:{server.app.grpc.port}") as ch:
            req = pb.GenerateRequest(
                id="g", messages=[pb.ChatMessage(role="user", content=PROMPT)], temperature=0, **kw
            )
            out = list(specd_pb2_grpc.SpecdStub(ch).Generate(req, timeout=60))
        return "".join(r.delta.text for r in out if r.HasField("delta")), out[-1].done

    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
    text, done = call(max_tokens=120, response_format=json.dumps(rf))
    assert done.finish_reason == "stop" and not done.tool_calls and not done.HasField("content")
    jsonschema.validate(json.loads(text), PET)
    text, done = call(max_tokens=160, tools=json.dumps(TOOLS), tool_choice="required")
    assert done.finish_reason == "tool_calls" and done.tool_calls and not done.HasField("content")
    assert [c.name for c in done.tool_calls] and all(
        _check_call(c.name, c.arguments) is not None for c in done.tool_calls
    )
    text, done = call(max_tokens=8, structured_outputs=pb.StructuredOutputs(choice=["up", "down"]))
    assert text in ("up", "down")
    tool_result = [
        pb.ChatMessage(role="user", content=PROMPT),
        pb.ChatMessage(
            role="assistant", tool_calls=list(done.tool_calls) or [pb.ToolCall(id="c", name="w", arguments="{}")]
        ),
        pb.ChatMessage(role="tool", content="noon", tool_call_id="c"),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{server.app.grpc.port}") as ch:
        req = pb.GenerateRequest(messages=tool_result, max_tokens=4, temperature=0, tools=json.dumps(TOOLS))
        assert list(specd_pb2_grpc.SpecdStub(ch).Generate(req, timeout=60))[-1].done.finish_reason in (
            "stop",
            "length",
            "tool_calls",
        )
        for kw, code in (
            ({"response_format": "{"}, "invalid_response_format"),
            ({"tools": json.dumps(TOOLS), "tool_choice": "w"}, "invalid_tools"),
            ({"structured_outputs": pb.StructuredOutputs(regex="((")}, "invalid_regex"),
        ):
            with pytest.raises(grpc.RpcError) as ei:
                list(specd_pb2_grpc.SpecdStub(ch).Generate(pb.GenerateRequest(prompt=PROMPT, **kw), timeout=60))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith(code + ":")


# refusals --------------------------------------------------------------------------------------------
REFUSED = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
        "invalid_schema",
    ),
    ({"structured_outputs": {"regex": "(("}}, "invalid_regex"),
    ({"guided_grammar": "root ::= missing"}, "invalid_grammar"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"allOf": [{"type": "string"}, {"type": "integer"}]}},
            }
        },
        "unsatisfiable_schema",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"enum": list(range(2000))}},
            }
        },
        "grammar_too_large",
    ),
    (  # strict: a keyword the grammar cannot hold a reply to (specd.structured.exactness)
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}},
            }
        },
        "invalid_schema",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "invalid_tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "conflicting_constraints"),
]


@pytest.mark.parametrize("fields,code", REFUSED, ids=[c for _, c in REFUSED])
def test_a_bad_constraint_is_a_400_before_the_stream_starts(client, server, fields, code):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as ei:
            client.chat.completions.create(**_chat(max_tokens=8), stream=stream, extra_body=fields)
        err = ei.value.body
        assert ei.value.status_code == 400 and err["code"] == code and err["param"], err
    assert _idle(server)


def test_the_engine_process_constrains_and_refuses_alike(ref):
    """The default daemon (an engine process): the engine process checks each grammar for the server
    (``CheckGrammar``: compiled once, there) and constrains the reply."""
    from specd.serving.app import ServerThread

    srv = ServerThread(serve_args(num_blocks=256)).start()
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="k", max_retries=0, timeout=120)
        rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
        r = c.chat.completions.create(**_chat(max_tokens=120), response_format=rf)
        assert r.choices[0].message.content == _greedy(
            ref, {"response_format": rf}, messages=[{"role": "user", "content": PROMPT}]
        )
        r = c.chat.completions.create(**_chat(max_tokens=160), tools=TOOLS, tool_choice="required")
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls
        with pytest.raises(openai.BadRequestError) as ei:
            c.chat.completions.create(**_chat(max_tokens=8), extra_body={"guided_regex": "(("})
        assert ei.value.body["code"] == "invalid_regex"
        assert srv.app.ae.healthy()
    finally:
        srv.stop()


def test_a_grammar_is_a_frozen_picklable_spec():
    import pickle

    g = grammar_spec({"tools": TOOLS, "tool_choice": "required"})
    assert isinstance(g, GrammarSpec) and pickle.loads(pickle.dumps(g)).canonical() == g.canonical()


# units: prompt rendering, stream shaping -------------------------------------------------------------
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments.c }}{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}{% if m.name %} ({{ m.name }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "hi"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": "b"}'}}],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    {"role": "tool", "content": "windy", "tool_call_id": "c1"},
]


def _with_template(engine, template: str):
    import copy

    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = template
    return tok


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_objects(engine):
    from specd.serving import chat_render as CR
    from specd.serving.request_build import encode_prompt

    tok = _with_template(engine, TOOL_TEMPLATE)
    assert CR.renders_tools(tok) and not CR.renders_tools(_with_template(engine, PLAIN_TEMPLATE))
    spec = grammar_spec({"tools": TOOLS}).value
    text = tok.decode(encode_prompt(tok, CONVERSATION, None, spec))
    assert 'TOOLS [{"type": "function", "function": {"name": "w"' in text
    assert "<assistant>CALL w b" in text  # the arguments reached the template as an object
    assert "<tool>sunny (w)" in text and "You can call" not in text


def test_a_template_without_tools_gets_them_as_text(engine):
    from specd.serving.request_build import encode_prompt

    tok = _with_template(engine, PLAIN_TEMPLATE)
    spec = grammar_spec({"tools": TOOLS, "tool_choice": "required"}).value
    text = tok.decode(encode_prompt(tok, CONVERSATION, None, spec))
    call = '<tool_call>\n{"name": "w", "arguments": {"c": "b"}}\n</tool_call>'
    assert text.index("<system>You can call these functions") < text.index("<user>hi")
    assert "You must call a function." in text and f"<assistant>{call}\n" in text
    assert "<user><tool_response>\nsunny\n</tool_response>\n<tool_response>\nwindy\n</tool_response>\n" in text
    assert text.count("<user>") == 2  # (two results, one turn)


def test_tool_deltas_are_shaped_as_openais():
    from specd.serving.openai_routes import tool_deltas, tool_finish
    from specd.structured import ToolCallParser

    p = ToolCallParser(ids=lambda i: f"call_{i}")
    call = '<tool_call>\n{{"name": "w", "arguments": {{"c": "{}"}}}}\n</tool_call>'
    reply = "ok\n" + call.format("a") + "\n" + call.format("b")
    deltas = tool_deltas(p.feed(reply)) + tool_deltas(p.finish())
    assert deltas == [
        {"content": "ok"},
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "w", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"c": "a"}'}}]},
        {"tool_calls": [{"index": 1, "id": "call_1", "type": "function", "function": {"name": "w", "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": '{"c": "b"}'}}]},
    ]
    assert tool_finish("stop", p.calls) == "tool_calls" and tool_finish("length", p.calls) == "length"
    assert tool_finish("stop", []) == "stop"


def test_responses_items_stream_a_message_and_calls_in_order():
    from specd.serving.responses_items import OutputItems

    events = []
    items = OutputItems(
        "msg_1", lambda kind, **f: events.append((kind, f)) or (kind, f), grammar_spec({"tools": TOOLS}).value
    )
    assert items.start() == []
    reply = ["Sure.", '\n<tool_call>\n{"name": "w", ', '"arguments": {"c": "a"}}\n</tool_call>', ""]
    for i, piece in enumerate(reply):
        items.step(piece, last=i == len(reply) - 1)
    items.finish("completed")
    kinds = [k for k, _ in events]
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    out = items.output("completed")
    assert [o["type"] for o in out] == ["message", "function_call"] and out[0]["content"][0]["text"] == "Sure."
    assert out[1]["arguments"] == '{"c": "a"}' and out[1]["status"] == "completed" and events[4][1]["output_index"] == 1
    hist = items.history()
    assert hist["content"] == "Sure." and hist["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"c": "a"}'}
    cut = OutputItems("msg_2", lambda kind, **f: (kind, f), grammar_spec({"tools": TOOLS}).value)
    cut.step('<tool_call>\n{"name": "w", "arguments": {"c"', last=True)
    assert [o["status"] for o in cut.output("incomplete")] == ["incomplete"] and "tool_calls" not in cut.history()
