"""Units of the OpenAI-compatible surface without a server: body parsing into the shared request
arguments, the error mapping, the response store's bounds and key isolation, auth namespaces."""

from __future__ import annotations

import pytest

from specd.engine.engine import RequestError
from specd.serving.auth import Auth
from specd.serving.openai_errors import APIError, from_request_error
from specd.serving.openai_params import parse_chat, parse_completion, parse_response
from specd.serving.response_store import ResponseStore, StoredResponse

M = "m"
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
_FLAT = {"type": "function", "name": "f", "parameters": {"type": "object"}}  # (the Responses API's shape)


def _refused(fn, body) -> APIError:
    with pytest.raises(APIError) as ei:
        fn(body, M)
    return ei.value


def test_chat_body_maps_to_the_shared_request_arguments():
    p = parse_chat(
        {
            "model": M,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "temperature": 0,
            "seed": 3,
            "stop": "\n",
            "n": 1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "repetition_penalty": 1.1,
            "min_p": 0.05,
            "stream": True,
            "stream_options": {"include_usage": True},
            "speculation": {"mode": "off"},
            "top_k": 4,
            "user": "ignored",
        },
        M,
    )
    assert p.engine["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert p.engine["max_tokens"] == 7  # max_completion_tokens wins over the older max_tokens
    assert (p.engine["temperature"], p.engine["seed"], p.engine["stop"], p.engine["top_k"]) == (0.0, 3, "\n", 4)
    assert [p.engine[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")] == [
        0.5,
        -0.25,
        1.1,
        0.05,
    ]
    assert p.engine["speculation"] == {"mode": "off"} and p.stream and p.include_usage


@pytest.mark.parametrize(
    "change,param,code",
    [
        ({"model": None}, "model", "invalid_value"),
        ({"messages": "hi"}, "messages", "invalid_value"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "unsupported_parameter"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "invalid_value"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", "invalid_value"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "unsupported_parameter",
        ),
        ({"temperature": True}, "temperature", "invalid_value"),
        ({"temperature": float("inf")}, "temperature", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": 2.0}, "max_tokens", "invalid_value"),
        ({"n": 9}, "n", "invalid_value"),
        ({"logprobs": 1}, "logprobs", "invalid_value"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "invalid_value"),
        ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
        ({"min_p": -0.1}, "min_p", "invalid_value"),
        ({"logit_bias": {"1": 200}}, "logit_bias", "invalid_value"),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"function_call": "auto"}, "function_call", "unsupported_parameter"),
        ({"tools": [{"type": "function"}]}, "tools", "invalid_tools"),
        ({"tools": [{"type": "web_search"}]}, "tools", "invalid_tools"),
        (
            {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "invalid_tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "invalid_tools"),
        ({"tools": [_TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_tools"),
        ({"tools": [_TOOL, _TOOL]}, "tools", "invalid_tools"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "invalid_response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
            "response_format.json_schema.name",
            "invalid_response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{"}}},
            "response_format.json_schema.schema",
            "invalid_schema",
        ),
        ({"response_format": {"type": "json_object"}, "tools": [_TOOL]}, "tools", "conflicting_constraints"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "invalid_response_format"),
        ({"guided_choice": []}, "guided_choice", "invalid_response_format"),
        ({"stop": [1]}, "stop", "invalid_value"),
        ({"speculation": "tree"}, "speculation", "invalid_value"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ],
)
def test_chat_body_refusals_name_the_field(change, param, code):
    e = _refused(parse_chat, {"model": M, "messages": [{"role": "user", "content": "x"}], **change})
    assert (e.status, e.param, e.code) == (400, param, code), (e.status, e.param, e.code, str(e))


def test_another_model_is_404():
    e = _refused(parse_chat, {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]})
    assert (e.status, e.code, e.param) == (404, "model_not_found", "model")


def test_completion_prompts_and_default_max_tokens():
    assert parse_completion({"model": M, "prompt": "hi"}, M).engine["prompt"] == "hi"
    assert parse_completion({"model": M, "prompt": ["hi"]}, M).engine["prompt"] == "hi"
    assert parse_completion({"model": M, "prompt": [1, 2]}, M).engine["prompt_ids"] == [1, 2]
    assert parse_completion({"model": M, "prompt": [[1, 2]]}, M).engine["prompt_ids"] == [1, 2]
    assert parse_completion({"model": M, "prompt": "hi"}, M).engine["max_tokens"] == 16
    for bad in ([], ["a", "b"], [1, "2"], [True], 5):
        assert _refused(parse_completion, {"model": M, "prompt": bad}).param == "prompt"
    for field, value in (("echo", True), ("suffix", "x"), ("best_of", 2)):
        assert _refused(parse_completion, {"model": M, "prompt": "x", field: value}).code == "unsupported_parameter"


def test_response_input_forms_and_echoed_fields():
    p = parse_response(
        {
            "model": M,
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
                {"role": "assistant", "content": "a"},
            ],
            "instructions": "sys",
            "previous_response_id": "resp_1",
            "store": False,
            "max_output_tokens": 9,
            "metadata": {"k": "v"},
        },
        M,
    )
    assert p.engine["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert (p.instructions, p.previous_response_id, p.store, p.engine["max_tokens"]) == ("sys", "resp_1", False, 9)
    assert p.echo["metadata"] == {"k": "v"} and p.echo["max_output_tokens"] == 9
    assert parse_response({"model": M, "input": "hi"}, M).engine["messages"] == [{"role": "user", "content": "hi"}]
    for change, param in (
        ({"input": ""}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.name"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}, "tools": [_FLAT]}, "tools"),
        ({"input": "x", "tools": [_FLAT], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
        ({"input": "x", "background": True}, "background"),
    ):
        assert _refused(parse_response, {"model": M, **change}).param == param


def test_engine_refusals_map_to_openai_statuses():
    cases = {
        "invalid_request": (400, "invalid_value"),
        "too_long": (400, "context_length_exceeded"),
        "overloaded": (429, "overloaded"),
        "shutting_down": (503, "shutting_down"),
        "unauthorized": (401, "invalid_api_key"),
        "internal": (500, "internal"),
    }
    for code, (status, oai) in cases.items():
        e = from_request_error(RequestError(code, "m"))
        assert (e.status, e.code) == (status, oai)
        assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    assert from_request_error(RequestError("overloaded", "x")).headers == {"Retry-After": "1"}
    loading = from_request_error(RequestError("overloaded", "the server is not ready yet (models loading)"))
    assert (loading.status, loading.code) == (503, "model_loading")


def _entry(rid: str, chars: int = 10) -> StoredResponse:
    return StoredResponse(rid, {"id": rid}, ({"role": "user", "content": "x" * chars},))


def test_store_bounds_per_key_in_all_and_in_bytes():
    s = ResponseStore(max_entries=5, max_per_key=3, max_bytes=10_000)
    for i in range(4):
        s.put("a", _entry(f"a{i}"))
    assert s.get("a", "a0") is None and [s.get("a", f"a{i}") is not None for i in (1, 2, 3)] == [True] * 3
    s.get("a", "a1")  # recently used: survives the next evictions
    for i in range(3):
        s.put("b", _entry(f"b{i}"))
    assert len(s) == 5 and s.get("a", "a1") is not None and s.get("a", "a2") is None
    big = ResponseStore(max_entries=100, max_per_key=100, max_bytes=3 * _entry("x", 1000).nbytes)
    for i in range(5):
        big.put("k", _entry(f"r{i}", 1000))
    assert len(big) == 3 and big.nbytes <= big.max_bytes and big.get("k", "r4") is not None
    big.put("k", _entry("huge", 10_000))  # larger than the whole budget: not kept
    assert big.get("k", "huge") is None and len(big) == 3


def test_store_keys_never_see_each_other():
    s = ResponseStore()
    s.put(Auth.namespace("key-a"), _entry("r1"))
    assert s.get(Auth.namespace("key-b"), "r1") is None and not s.delete(Auth.namespace("key-b"), "r1")
    assert s.get(Auth.namespace("key-a"), "r1") is not None and s.delete(Auth.namespace("key-a"), "r1")
    assert Auth.namespace(None) == Auth.namespace("") != Auth.namespace("key-a")


def test_bearer_and_key_checks():
    auth = Auth("s3cret", "")
    assert auth.bearer({"authorization": "Bearer s3cret"}) == "s3cret"
    assert auth.bearer({"authorization": "Basic abc"}) == "" and auth.bearer({}) is None
    assert auth.key_ok("s3cret") and not auth.key_ok("nope") and not auth.key_ok(None)
    assert Auth(None).key_ok(None) and Auth("").key_ok("anything")


def test_usage_speculation_by_proposer_only_when_several():
    from types import SimpleNamespace

    from specd.engine.sequence import SpecStats
    from specd.serving.openai_format import usage

    st = SpecStats()
    st.record(4, 4, 2, "draft")
    seq = SimpleNamespace(num_prompt=5, num_output=3, stats=st, cached_prefix_tokens=0)
    seq.arrival = seq.scheduled_time = seq.first_token_time = seq.finish_time = None
    assert "by_proposer" not in usage(seq)["speculation"]
    st.record(2, 2, 1, "ngram")
    by = usage(seq)["speculation"]["by_proposer"]
    assert set(by) == {"draft", "ngram"} and by["draft"]["accepted_tokens"] == 2 and by["ngram"]["draft_tokens"] == 2
