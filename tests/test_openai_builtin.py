"""The built-in real chat model (SmolLM2-135M-Instruct with its draft, as `make run` serves it) over every
surface: greedy text over HTTP (the official ``openai`` client), over specd's websocket and over the
Responses WebSocket mode equals the in-process engine's; a second turn via ``previous_response_id``
gets its whole first turn from the prefix cache (ChatML: the first prompt and reply are a token prefix)."""

from __future__ import annotations

import json

import openai
import orjson
import pytest
from conftest import serve_args, ws_collect
from websockets.sync.client import connect

from specd.model import builtin

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"),
]

QUESTION = "Name the capital of France."
N = 24


@pytest.fixture(scope="module")
def served():
    """(server, in-process reference text) on one built-in engine (the reference runs first)."""
    from specd.cli import engine_config
    from specd.engine.engine import Engine
    from specd.serving.app import ServerThread
    from specd.serving.request_build import build_request

    args = serve_args(num_blocks=128)
    args.target = str(builtin.builtin_gguf())
    args.draft = str(builtin.draft_path()) if builtin.draft_path() else None
    engine = Engine(engine_config(args))
    msgs = [{"role": "user", "content": QUESTION}]
    b = build_request(engine.tokenizer, messages=msgs, max_tokens=N, temperature=0.0)
    ref = engine.output_text(engine.generate([b.prompt_ids], b.params, b.spec)[0])
    srv = ServerThread(args, engine).start(timeout=300)
    yield srv, ref
    srv.stop()


def test_greedy_text_is_the_same_over_http_both_websockets_and_in_process(served):
    srv, ref = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="k", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    msgs = [{"role": "user", "content": QUESTION}]
    http = client.chat.completions.create(model=model, messages=msgs, max_tokens=N, temperature=0)
    sse = client.chat.completions.create(model=model, messages=msgs, max_tokens=N, temperature=0, stream=True)
    sse_text = "".join(c.choices[0].delta.content or "" for c in sse if c.choices)
    with connect(f"ws://127.0.0.1:{srv.port}/ws") as ws:
        ws.send(
            orjson.dumps({"type": "generate", "id": "q", "messages": msgs, "max_tokens": N, "temperature": 0}).decode()
        )
        deltas, done = ws_collect(ws, "q", timeout=120)
    with client.responses.connect() as conn:
        conn.response.create(model=model, input=QUESTION, max_output_tokens=N, temperature=0)
        final = next(e for e in conn if e.type in ("response.completed", "response.incomplete", "error"))
        assert final.type != "error", final
        first = final.response
        # second turn on the same connection: the first prompt and reply come from the prefix cache
        conn.response.create(
            model=model, input="And of Germany?", previous_response_id=first.id, max_output_tokens=8, temperature=0
        )
        second = next(e for e in conn if e.type in ("response.completed", "response.incomplete", "error")).response
    assert "Paris" in ref
    assert http.choices[0].message.content == sse_text == "".join(d["text"] for d in deltas) == ref
    assert first.output_text == ref
    turn1 = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > turn1
    assert second.usage.input_tokens_details.cached_tokens >= 16 * (turn1 // 16) - 16, (second.usage, turn1)


def test_parse_and_a_tool_round_trip_on_the_chat_model(served):
    """The README's example on the real model: ``parse`` with a pydantic model, then a tool round trip
    (its ChatML template does not render tools: they go into the system message, the call and its result
    into the conversation as text)."""
    from typing import Literal

    from pydantic import BaseModel

    from specd.serving.request_build import build_request
    from specd.structured import grammar_spec

    class City(BaseModel):
        name: str
        country: str
        continent: Literal["Africa", "Americas", "Asia", "Europe", "Oceania"]

    srv, _ = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="k", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name == "Paris" and city.continent == "Europe"
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": params}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice="required", temperature=0
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
    ]
    r2 = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0, max_tokens=16)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    keep = ("role", "content", "tool_calls", "tool_call_id")
    b = build_request(
        srv.app.ae.tokenizer,
        messages=[{k: v for k, v in m.items() if k in keep} for m in messages],
        max_tokens=16,
        grammar=grammar_spec({"tools": tools}),
    )
    text = srv.app.ae.tokenizer.decode(b.prompt_ids)
    assert r2.usage.prompt_tokens == len(b.prompt_ids)
    assert text.startswith("<|im_start|>system\nYou can call these functions") and call.function.arguments in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
