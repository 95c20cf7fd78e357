"""Log-probabilities (issue #17): the engine's per-token log-probabilities equal transformers'
log-softmax of the target's logits on the same tokens, whatever the speculation (plain, chain,
tree: the rows come from the accepted path of the verification tree), for greedy and sampled
requests; the OpenAI routes render them in OpenAI's shapes (chat ``logprobs.content``, legacy
completions lists), streamed and whole, and through the official client."""

from __future__ import annotations

import openai
import orjson
import pytest
import torch
from conftest import serve_args, serve_engine
from test_openai import MODEL, post

from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams

pytestmark = pytest.mark.timeout(180)

PROMPTS = [[1, 403, 407, 261, 378], [1, 365, 167, 282, 395, 263], [1, 320, 326]]
N = 20
TOP = 4


@pytest.fixture(scope="module")
def engine(shared_pair):
    return serve_engine(shared_pair, num_blocks=512)


def _reference(hf_target, prompt: list, out: list) -> torch.Tensor:
    """transformers' log-softmax rows predicting each of ``out`` after ``prompt``: [len(out), V]."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = hf_target(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(out)], dim=-1)


def _run(engine, mode: str, **kw):
    params = SamplingParams(max_tokens=N, logprobs=TOP, ignore_eos=True, **kw)
    return engine.generate(PROMPTS, params, SpecParams(mode=mode, max_draft_tokens=4))


def _check_against(seq, ref: torch.Tensor, greedy: bool) -> None:
    assert seq.logprobs is not None and len(seq.logprobs) == len(seq.output_ids) == N
    for i, (tok, (lp, top)) in enumerate(zip(seq.output_ids, seq.logprobs)):
        assert lp == pytest.approx(ref[i, tok].item(), abs=2e-4), (i, tok)
        assert len(top) == TOP
        vals, ids = ref[i].topk(TOP)
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=2e-4)
        assert [t for t, _ in top][:1] == ids.tolist()[:1]
        if greedy:  # the emitted token is the target's argmax: the likeliest alternative
            assert top[0][0] == tok and top[0][1] == pytest.approx(lp, abs=1e-6)


@pytest.mark.parametrize("mode", ["off", "chain", "tree"])
def test_greedy_logprobs_equal_transformers_whatever_the_speculation(engine, hf_target, mode):
    seqs = _run(engine, mode, temperature=0.0)
    if mode != "off":  # speculation ran and was partly rejected: rows come from tree paths
        assert sum(s.stats.draft_tokens for s in seqs) > 0
    for prompt, seq in zip(PROMPTS, seqs):
        _check_against(seq, _reference(hf_target, prompt, seq.output_ids), greedy=True)


@pytest.mark.parametrize("mode", ["off", "tree"])
def test_sampled_logprobs_are_the_raw_target_distribution(engine, hf_target, mode):
    """Temperature, top-k, top-p shape what is sampled, not the reported log-probabilities (vLLM's
    default ``raw_logprobs``): they are the target's own log-softmax at each sampled token."""
    seqs = _run(engine, mode, temperature=0.9, top_k=40, seed=7)
    for prompt, seq in zip(PROMPTS, seqs):
        _check_against(seq, _reference(hf_target, prompt, seq.output_ids), greedy=False)


def test_logprobs_off_costs_nothing_and_bounds_are_checked(engine):
    seq = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert seq.logprobs is None
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    assert engine.kv_blocks_used() == (0, 0)


# ------------------------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def server(engine):
    from specd.serving.app import ServerThread

    srv = ServerThread(serve_args(num_blocks=512), engine).start()
    yield srv
    srv.stop()


# speculation off: whole vs streamed is compared bit for bit, and on this dense fp32 model a token's
# logits in a verification tree differ from a one-row decode's in the last bits (a repeated request
# would draft from the first through the suffix store)
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Once upon a time"}],
    "max_tokens": 16,
    "speculation": {"mode": "off"},
}


def _events(raw: bytes) -> list:
    return [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


def test_chat_logprobs_whole_and_streamed(server):
    st, raw, _ = post(server, "/v1/chat/completions", {**CHAT, "temperature": 0, "logprobs": True, "top_logprobs": 3})
    assert st == 200
    body = orjson.loads(raw)
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert bytes(b for e in content for b in e["bytes"]).decode() == choice["message"]["content"]
    for e in content:
        assert len(e["top_logprobs"]) == 3 and e["logprob"] <= 0
        assert e["top_logprobs"][0]["token"] == e["token"] and e["top_logprobs"][0]["logprob"] == e["logprob"]
        assert [t["logprob"] for t in e["top_logprobs"]] == sorted(
            (t["logprob"] for t in e["top_logprobs"]), reverse=True
        )
    body_s = {**CHAT, "temperature": 0, "logprobs": True, "top_logprobs": 3, "stream": True}
    st, raw, _ = post(server, "/v1/chat/completions", body_s)
    streamed = [
        e
        for ev in _events(raw)
        if ev["choices"] and ev["choices"][0]["logprobs"]
        for e in ev["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content


def test_chat_logprobs_zero_alternatives_and_off(server):
    st, raw, _ = post(server, "/v1/chat/completions", {**CHAT, "logprobs": True})
    content = orjson.loads(raw)["choices"][0]["logprobs"]["content"]
    assert st == 200 and content and all(e["top_logprobs"] == [] for e in content)
    st, raw, _ = post(server, "/v1/chat/completions", CHAT)
    assert st == 200 and orjson.loads(raw)["choices"][0]["logprobs"] is None


def test_completions_logprobs_legacy_shape(server):
    req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    st, raw, _ = post(server, "/v1/completions", req)
    choice = orjson.loads(raw)["choices"][0]
    lp = choice["logprobs"]
    assert st == 200 and "".join(lp["tokens"]) == choice["text"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 12
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(12)]
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(v) and top.get(tok) == pytest.approx(v)
    st, raw, _ = post(server, "/v1/completions", {**req, "stream": True})
    chunks = [ev["choices"][0]["logprobs"] for ev in _events(raw) if ev["choices"][0]["logprobs"]]
    assert sum((c["tokens"] for c in chunks), []) == lp["tokens"]
    assert sum((c["text_offset"] for c in chunks), []) == lp["text_offset"]


def test_official_client_reads_logprobs(server):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)


@pytest.mark.parametrize(
    "path,change,param",
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/responses", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_logprobs_are_400_naming_the_field(server, path, change, param):
    body = {"model": MODEL, "max_tokens": 4, **change}
    body.update({"messages": CHAT["messages"]} if path == "/v1/chat/completions" else {})
    body.update({"prompt": "x"} if path == "/v1/completions" else {})
    body.update({"input": "x"} if path == "/v1/responses" else {})
    st, got, _ = post(server, path, body)
    assert st == 400 and got["error"]["param"] == param, got


def test_websocket_deltas_carry_logprobs_by_token_id(server, shared_pair):
    """specd's own protocol: ``logprobs: N`` in ``generate``; each delta carries, per token id,
    ``[logprob, [[id, logprob], ...]]``, equal to the engine's own; bad values are refused. (The
    reference is an engine of its own: ``server``'s loop thread steps ``engine`` whenever it has work,
    a request this test added to it included.)"""
    from conftest import ws_collect
    from websockets.sync.client import connect

    from specd.serving.request_build import build_request

    msgs = [{"role": "user", "content": "Once upon a time"}]
    engine = serve_engine(shared_pair, num_blocks=64)
    b = build_request(engine.tokenizer, messages=msgs, max_tokens=12, temperature=0.0, logprobs=3)
    ref = engine.generate([b.prompt_ids], b.params, b.spec)[0]
    with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
        req = {"type": "generate", "id": "lp", "messages": msgs, "max_tokens": 12, "temperature": 0, "logprobs": 3}
        ws.send(orjson.dumps(req).decode())
        deltas, done = ws_collect(ws, "lp")
        assert done["type"] == "done"
        got = [e for d in deltas for e in d["logprobs"]]
        assert all(len(d["logprobs"]) == len(d["token_ids"]) for d in deltas)
        assert [t for d in deltas for t in d["token_ids"]] == ref.output_ids
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in ref.logprobs], abs=1e-5)
        assert [[t for t, _ in alts] for _, alts in got] == [[t for t, _ in alts] for _, alts in ref.logprobs]
        ws.send(orjson.dumps({**req, "id": "bad", "logprobs": 21}).decode())
        err = orjson.loads(ws.recv(timeout=30))
        assert err["type"] == "error" and err["id"] == "bad" and "logprobs" in err["message"]
        ws.send(orjson.dumps({**req, "id": "none", "logprobs": None}).decode())
        deltas, _ = ws_collect(ws, "none")
        assert all("logprobs" not in d for d in deltas)
