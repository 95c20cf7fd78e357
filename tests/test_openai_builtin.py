"""The built-in real chat model (SmolLM2-135M-Instruct with its draft, as `make run` serves it) over every
surface: greedy text over HTTP (the official ``openai`` client), over specd's websocket and over the
Responses WebSocket mode equals the in-process engine's; a second turn via ``previous_response_id``
gets its whole first turn from the prefix cache (ChatML: the first prompt and reply are a token prefix)."""

from __future__ import annotations

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
