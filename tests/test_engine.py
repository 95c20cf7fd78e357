"""Target-only generation: transformers parity, batch invariance, stop conditions, the CLI."""

import json
import subprocess
import sys

import pytest
import torch

from specd.config import CacheConfig, EngineConfig, SchedulerConfig
from specd.engine.engine import Engine, RequestError
from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams
from tests.conftest import ROOT, TARGET

PROMPTS = [
    "Once upon a time, there was a little",
    "The dog",
    "Tom and Sue went to the big park to play with the ball",
    "One day",
    "Lily saw a bird in the sky. It was",
    "He",
    "The sun was hot and the",
    "A girl named Mia had a red",
]
OFF = SpecParams(mode="off")


@pytest.fixture(scope="module")
def engine(shared_pair):
    t, _ = shared_pair
    return Engine(EngineConfig(target=str(TARGET)), target=t)


def _ids(engine, prompts=PROMPTS):
    return [engine.tokenizer(p)["input_ids"] for p in prompts]


def test_greedy_equals_transformers(engine, hf_target):
    for ids in _ids(engine)[:4]:
        ref = hf_target.generate(
            torch.tensor([ids]), max_new_tokens=60, do_sample=False, eos_token_id=[2, 1], pad_token_id=0
        )[0, len(ids) :].tolist()
        seq = engine.generate([ids], SamplingParams(temperature=0, max_tokens=60), OFF)[0]
        assert seq.output_ids == ref
    assert engine.kv_blocks_used() == (0, 0)


def test_batch_invariance_greedy_and_seeded_sampling(engine):
    ids = _ids(engine)
    for params in (
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=40),
    ):
        alone = [engine.generate([x], params, OFF)[0].output_ids for x in ids]
        together = [s.output_ids for s in engine.generate(ids, params, OFF)]
        assert together == alone
    # a different seed gives a different sample (the seed is honoured)
    a = engine.generate(ids[:1], SamplingParams(temperature=1.0, seed=1, max_tokens=30), OFF)[0].output_ids
    b = engine.generate(ids[:1], SamplingParams(temperature=1.0, seed=2, max_tokens=30), OFF)[0].output_ids
    assert a != b


def test_requests_join_and_leave_a_running_batch(engine):
    ids = _ids(engine)
    params = SamplingParams(temperature=0, max_tokens=32)
    ref = [s.output_ids for s in engine.generate(ids, params, OFF)]
    seqs = []
    for i, x in enumerate(ids):  # a new request joins every other step
        seqs.append(engine.add_request(x, SamplingParams(temperature=0, max_tokens=10 + 3 * i), OFF))
        engine.step()
        engine.step()
    while engine.has_work():
        engine.step()
    for s, r in zip(seqs, ref):
        assert s.output_ids == r[: len(s.output_ids)] and len(s.output_ids) == s.params.max_tokens
    assert engine.kv_blocks_used() == (0, 0)


def test_stop_conditions(engine):
    ids = _ids(engine)[0]
    full = engine.generate([ids], SamplingParams(temperature=0, max_tokens=80), OFF)[0]
    text = engine.output_text(full)
    assert full.finish_reason == "length" and full.num_output == 80
    stop = text[30:36]
    s = engine.generate([ids], SamplingParams(temperature=0, max_tokens=80, stop=(stop,)), OFF)[0]
    assert s.finish_reason == "stop" and engine.output_text(s) == text[: text.find(stop)]
    tid = full.output_ids[5]
    s = engine.generate([ids], SamplingParams(temperature=0, max_tokens=80, stop_token_ids=(tid,)), OFF)[0]
    assert s.finish_reason == "stop" and s.output_ids == full.output_ids[: full.output_ids.index(tid) + 1]
    # EOS from generation_config (ids 2 and 1): a story ends with BOS -> stops
    long = engine.generate([ids], SamplingParams(temperature=0, max_tokens=400), OFF)[0]
    assert long.finish_reason == "stop" and long.output_ids[-1] in (1, 2)


def test_streamed_text_with_stop_strings_equals_final_text(engine):
    ids = _ids(engine)[2]
    full = engine.output_text(engine.generate([ids], SamplingParams(temperature=0, max_tokens=60), OFF)[0])
    stop = full[20:25]
    seq = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=60, stop=(stop,)), OFF)
    pieces = []
    while not seq.finished:
        for o in engine.step():
            if o.request_id == seq.request_id:
                pieces.append(o.text)
    assert "".join(pieces) == full[: full.find(stop)] == engine.output_text(seq)


def test_invalid_requests_are_refused_cleanly(engine):
    with pytest.raises(RequestError) as e:
        engine.add_request([1] * 500, SamplingParams(max_tokens=100))
    assert e.value.code == "too_long" and "prompt (500) + max_tokens (100) > context 512" in str(e.value)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams(max_tokens=5))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([1, 99999], SamplingParams(max_tokens=5))
    for bad in (dict(temperature=float("nan")), dict(max_tokens=-1), dict(top_p=0.0), dict(temperature=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert engine.kv_blocks_used() == (0, 0)


def test_kv_exhaustion_is_not_a_crash(shared_pair):
    t, _ = shared_pair
    eng = Engine(
        EngineConfig(
            target=str(TARGET),
            cache=CacheConfig(block_size=4, num_blocks=40),
            scheduler=SchedulerConfig(max_num_seqs=8),
        ),
        target=t,
    )
    ids = [eng.tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=60)
    ref = [Engine(EngineConfig(target=str(TARGET)), target=t).generate([x], params, OFF)[0].output_ids for x in ids]
    seqs = eng.generate(ids, params, OFF)  # 8 x ~75 tokens cannot all fit in 160 slots: preemption
    assert [s.output_ids for s in seqs] == ref
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv_blocks_used() == (0, 0)


def test_cli_generate_matches_reference_text():
    cmd = [
        sys.executable,
        "-m",
        "specd",
        "generate",
        "--target",
        str(TARGET),
        "--raw",
        "--prompt",
        "Once upon a time, there was a little",
        "--max-tokens",
        "200",
        "--temperature",
        "0",
        "--spec",
        "off",
        "--json",
    ]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout.strip().splitlines()[-1])
    ref_md = (TARGET / "stories260K.md").read_text()
    # the reference's greedy text (llama2.c run) begins with the prompt; our text is its continuation
    ref = ref_md.split("Once upon a time, there was a little", 1)[1].split("```")[0]
    first_line = d["text"].split("\n")[0]
    assert first_line and first_line.strip() in ref
    assert d["stats"]["steps"] > 0 and len(d["token_ids"]) == 200
    assert set(d) == {"text", "token_ids", "stats"}
    # the decode rate leaves prefill and the first step's one-off work out: above the whole call's rate
    assert d["stats"]["tokens_per_second"] > 200 / d["stats"]["seconds"] > 0


def test_serve_config_file_rejects_unknown_keys(tmp_path):
    from specd.cli import apply_env_and_toml, build_parser, subcommand_parser

    sub = subcommand_parser(build_parser(), "serve")
    good = tmp_path / "ok.toml"
    good.write_text("port = 9001\nmax_queue = 7\n")
    a = apply_env_and_toml(sub, ["--config", str(good), "--port", "9002"], "serve")
    assert a.port == 9002 and a.max_queue == 7  # flags win over the file
    bad = tmp_path / "bad.toml"
    bad.write_text("prot = 9001\n")
    with pytest.raises(SystemExit):
        apply_env_and_toml(sub, ["--config", str(bad)], "serve")
