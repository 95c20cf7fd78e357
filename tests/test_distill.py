"""Tests for specd.training (draft distillation: data, draft, loop, export, the recipe and its CLI)
and the built-in demo pair in models/demo/.

CPU only, fast: one short distillation run (~20 s) on the shared stories260K target.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from specd.training.cli import add_distill_args  # noqa: E402
from specd.training.data import TokenStream, load_corpus_texts, self_generate  # noqa: E402
from specd.training.distill import distill  # noqa: E402
from specd.training.draft import build_draft  # noqa: E402
from specd.training.loop import greedy_agreement, kd_loss  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"
DEMO = REPO / "models" / "demo"

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------------
# unit tests
# ------------------------------------------------------------------------------------------------


def test_kd_loss_zero_for_identical_and_matches_manual():
    torch.manual_seed(0)
    t = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    out = kd_loss(t.clone(), t, labels, kl_weight=1.0, ce_weight=0.0)
    assert out["kl"].abs().item() < 1e-6
    d = torch.randn(2, 5, 11, requires_grad=True)
    out = kd_loss(d, t, labels, kl_weight=1.0, ce_weight=0.5)
    pt = torch.softmax(t, -1)
    kl = (pt * (torch.log_softmax(t, -1) - torch.log_softmax(d, -1))).sum(-1).mean()
    ce = torch.nn.functional.cross_entropy(d.reshape(-1, 11), labels.reshape(-1))
    assert torch.allclose(out["kl"], kl, atol=1e-5)
    assert torch.allclose(out["ce"], ce, atol=1e-5)
    assert torch.allclose(out["loss"], kl + 0.5 * ce, atol=1e-5)
    out["loss"].backward()
    assert d.grad is not None and torch.isfinite(d.grad).all()
    # masked positions do not count
    labels2 = labels.clone()
    labels2[:, 3:] = -100
    m = kd_loss(d.detach(), t, labels2, kl_weight=1.0, ce_weight=0.0)["kl"]
    kl_m = (pt * (torch.log_softmax(t, -1) - torch.log_softmax(d.detach(), -1))).sum(-1)[:, :3].mean()
    assert torch.allclose(m, kl_m, atol=1e-5)


def test_load_corpus_texts_formats(tmp_path):
    p = tmp_path / "c.jsonl"
    recs = [
        {"text": "plain text"},
        {"question": "What is 2+2?", "answer": "4"},
        {"turns": ["hi", "hello there"]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    ]
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    docs = load_corpus_texts(p)
    assert docs[0] == "plain text"
    assert "What is 2+2?" in docs[1] and "4" in docs[1]
    assert "hi" in docs[2] and "hello there" in docs[2]
    assert "a" in docs[3] and "b" in docs[3]
    txt = tmp_path / "c.txt"
    txt.write_text("one two three")
    assert load_corpus_texts(txt) == ["one two three"]


def test_cli_args():
    p = argparse.ArgumentParser()
    add_distill_args(p)
    a = p.parse_args(["--target", "T", "--out", "O", "--layers", "2", "--hidden-size", "128", "--steps", "10"])
    assert (a.target, a.out, a.layers, a.hidden_size, a.steps, a.corpus) == ("T", "O", 2, 128, 10, None)


# ------------------------------------------------------------------------------------------------
# real distillation on stories260K
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories_target():
    if not (STORIES / "config.json").is_file():
        pytest.fail(f"{STORIES} not present (the shared models are a required input)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    target = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    return target, tok


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, stories_target):
    out = tmp_path_factory.mktemp("draft")
    # A 260K-param model: one thread is as fast as two and does not fight other processes.
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = _distill(out)
    finally:
        torch.set_num_threads(n_threads)
    return out, res


def _distill(out):
    return distill(
        STORIES,
        out,
        steps=150,
        seq_len=64,
        batch_size=16,
        lr=3e-3,
        seed=0,
        device="cpu",
        self_generate_samples=192,
        save_dtype="float32",
        progress=False,
        log=lambda s: None,
    )


def test_distill_output_loads_and_generates(distilled, stories_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, res = distilled
    target, _ = stories_target
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (out / name).is_file(), name
    draft = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert draft.config.model_type == "llama"
    assert draft.config.num_hidden_layers == 1
    assert draft.config.hidden_size == target.config.hidden_size
    assert draft.config.vocab_size == target.config.vocab_size
    # embeddings / LM head were copied from the target and frozen
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    ids = tok("Once upon a time", return_tensors="pt")["input_ids"]
    g = draft.generate(ids, max_new_tokens=8, do_sample=False)
    assert g.shape[1] > ids.shape[1]
    assert res.heldout_agreement_after > res.heldout_agreement_before


def test_distilled_beats_random_draft(distilled, stories_target):
    from transformers import AutoModelForCausalLM

    out, _ = distilled
    target, tok = stories_target
    # held-out text: fresh samples from the target with a seed the training data did not use
    held = torch.tensor(self_generate(target, tok, n_samples=16, length=129, batch_size=16, seed=12345))
    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rand, _ = build_draft(target, layers=1, copy_embeddings=False, copy_layers=False, seed=1)
    rand.eval()
    a_draft = greedy_agreement(draft, target, held)
    a_rand = greedy_agreement(rand, target, held)
    print(f"greedy agreement: distilled {a_draft:.3f}, random {a_rand:.3f}")
    assert a_draft > 0.35, a_draft
    assert a_draft > a_rand + 0.25, (a_draft, a_rand)


def test_token_stream_windows():
    s = TokenStream(torch.arange(100))
    tr, he = s.split(0.1)
    assert len(tr) + len(he) == 100 and len(he) == 10
    w = tr.windows(9)
    assert w.shape == (9, 10)
    b = tr.batch(4, 9, torch.Generator().manual_seed(0))
    assert b.shape == (4, 10)
    assert torch.equal(b[:, 1:] - b[:, :-1], torch.ones(4, 9, dtype=torch.long))


# ------------------------------------------------------------------------------------------------
# the built-in demo pair
# ------------------------------------------------------------------------------------------------


def _demo_ready() -> bool:
    return all(
        (DEMO / n / "model.safetensors").is_file() and (DEMO / n / "tokenizer.json").is_file()
        for n in ("target", "draft")
    )


def test_demo_pair_loads_and_chat_template_renders():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    msgs = [{"role": "user", "content": "Tom has 3 apples and buys 2 more. How many apples does he have?"}]
    toks = {}
    models = {}
    for name in ("target", "draft"):
        d = DEMO / name
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["model_type"] == "llama"
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert text == "<|bos|><|user|>" + msgs[0]["content"] + "<|end|><|assistant|>"
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]
        assert ids[0, 0].item() == tok.bos_token_id
        assert ids[0, -1].item() == tok.convert_tokens_to_ids("<|assistant|>")
        end_id = tok.convert_tokens_to_ids("<|end|>")
        assert tok.eos_token == "<|end|>"
        eos = model.generation_config.eos_token_id
        assert end_id in (eos if isinstance(eos, list) else [eos])
        g = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert g.shape[1] > ids.shape[1]
        toks[name], models[name] = tok, model
    assert toks["target"].get_vocab() == toks["draft"].get_vocab()
    assert models["target"].config.vocab_size == models["draft"].config.vocab_size
    assert models["target"].config.num_hidden_layers >= 4 and models["target"].config.hidden_size >= 256
    assert models["draft"].config.num_hidden_layers == 1
    size = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert size <= 16 * 2**20, size


def test_specd_serves_the_distilled_draft_losslessly(distilled):
    """The distilled draft plugs into specd: greedy speculative output == target-only output."""
    from specd.config import EngineConfig, SpecConfig
    from specd.engine.engine import Engine
    from specd.engine.sequence import SpecParams
    from specd.sampling.params import SamplingParams

    out, _ = distilled
    eng = Engine(EngineConfig(target=str(STORIES), draft=str(out), spec=SpecConfig(adaptive=False)))
    prompts = [eng.tokenizer(p)["input_ids"] for p in ("Once upon a time", "The little dog", "Sue had a red hat.")]
    params = SamplingParams(temperature=0, max_tokens=48)
    ref = [s.output_ids for s in eng.generate(prompts, params, SpecParams(mode="off"))]
    for mode in ("chain", "tree"):
        got = eng.generate(prompts, params, SpecParams(mode=mode))
        assert [s.output_ids for s in got] == ref
        assert sum(s.stats.accepted_tokens for s in got) > 0  # the distilled draft is really accepted
    assert eng.kv_blocks_used() == (0, 0)
