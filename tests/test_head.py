"""EAGLE-style feature heads (specd.model.head, specd.speculation.head, specd.training.head).

On the tiny stories260K target with a head trained for a few seconds: greedy output with
``--spec head`` equals plain decoding (batch 1 and a mixed batch); sampled output follows the
target's distribution; the features kept per request after a partial acceptance equal a fresh
prefill's; the paged drafting forward and the training-time test compute the same rows;
``specd distill --kind head`` beats an untrained head; an EAGLE-3 layout loads as the same head.
On the built-in model with the committed head: greedy output equals plain decoding.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from specd.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specd.engine.engine import Engine
from specd.engine.kv_cache import KVCache
from specd.engine.sequence import SpecParams
from specd.model import builtin
from specd.model.attention import CpuAttention, TorchAttention, build_metadata
from specd.model.eagle3 import save_eagle3
from specd.model.head_files import load_head, save_head
from specd.model.qkernel import kernel
from specd.model.quant import QuantLinear
from specd.sampling.params import SamplingParams
from specd.sampling.probs import logits_to_probs
from specd.training.data import pick_vocab
from specd.training.head import head_agreement, new_head, target_features, train_head
from tests.conftest import TARGET
from tests.test_spec_sampling import assert_follows

pytestmark = pytest.mark.timeout(600)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
STARTS = ["Once upon a time", "The dog", "Lily saw", "Tom wanted", "One day, a", "The sun", "Mom said", "A big bird"]


def _features(lm, tokens: list, layers: tuple) -> torch.Tensor:
    """Fresh prefill of ``tokens``: the target's features of every position, fp32 [n, F]."""
    c = lm.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(tokens) // 16 + 2, 16, torch.float32, lm.device)
    s = cache.new_seq()
    s.reserve(len(tokens))
    meta = build_metadata([len(tokens)], [0], [s.blocks], s.slots(0, len(tokens)), 16, lm.device)
    caps = dict.fromkeys(layers)
    lm.model(torch.tensor(tokens), torch.arange(len(tokens)), cache.kv, meta, None, caps)
    return torch.cat([caps[i] for i in layers], dim=-1)


@pytest.fixture(scope="module")
def replies(shared_pair):
    """The tiny target's own sampled continuations of story starts: [(tokens, prompt length)]."""
    target, _ = shared_pair
    eng = Engine(EngineConfig(target=str(TARGET), dtype="float32"), target=target)
    prompts = [eng.tokenizer(w)["input_ids"] for w in STARTS] * 6
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=60) for i in range(len(prompts))]
    return [(s.tokens[:], s.num_prompt) for s in eng.generate(prompts, params, SpecParams("off"))]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, shared_pair, replies):
    target, _ = shared_pair
    d2t = pick_vocab(replies, 256, [2], 512)
    t2d = torch.full((512,), -100, dtype=torch.long)
    t2d[d2t] = torch.arange(d2t.numel())
    head = new_head(target, d2t)
    feats = target_features(target, replies, head.layers)
    train_head(head, feats, t2d, steps=60, batch=8, lr=3e-3, ttt=3)
    out = tmp_path_factory.mktemp("head")
    save_head(head, out, {"test": True}, dtype=torch.float32)
    return out


def _engine(target, head_dir, **spec):
    spec = {"mode": "head", "tree_budget": 8, "tree_topk": 3, "tree_depth": 4, "adaptive": False, **spec}
    return Engine(
        EngineConfig(
            target=str(TARGET),
            head=str(head_dir),
            dtype="float32",
            spec=SpecConfig(**spec),
            scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=4096),
        ),
        target=target,
    )


def test_greedy_head_equals_plain_decoding_alone_and_in_a_mixed_batch(shared_pair, head_dir):
    target, _ = shared_pair
    eng = _engine(target, head_dir)
    prompts = [eng.tokenizer(w)["input_ids"] for w in STARTS[:4] + ["Sam and Ben went to the", "The little girl"]]
    plain = [s.output_ids for s in eng.generate(prompts, GREEDY, SpecParams("off"))]
    for p, want in zip(prompts, plain):  # batch 1, trees
        assert eng.generate([p], GREEDY, SpecParams("head"))[0].output_ids == want
    chain = _engine(target, head_dir, mode="chain")
    for p, want in zip(prompts[:2], plain):  # batch 1, chains
        assert chain.generate([p], GREEDY, SpecParams("chain"))[0].output_ids == want
    modes = ["head", "off", "auto", "tree", "chain", "ngram"]
    seqs = [eng.add_request(p, GREEDY, SpecParams(m)) for p, m in zip(prompts, modes)]
    while any(not s.finished for s in seqs):
        eng.step()
    assert [s.output_ids for s in seqs] == plain
    head_row = eng.stats.by_proposer["head"]
    assert head_row[2] > 0.2 * head_row[0], "the head's drafts were hardly accepted: the test proves little"
    assert chain.stats.by_proposer["head"][2] > 0
    assert eng.kv_blocks_used() == (0, 0) and chain.kv_blocks_used() == (0, 0)


def test_sampled_head_speculation_follows_the_targets_distribution(shared_pair, head_dir):
    """Chi-square on the first three tokens (top-k 4): the second step drafts with the head (the
    step that finishes the prompt cannot: the features of its last chunk do not exist yet)."""
    target, _ = shared_pair
    eng = _engine(target, head_dir)
    prompt = eng.tokenizer("Once upon a time, there was a")["input_ids"]
    temp, topk = 1.0, 4

    def probs(tokens):
        c = target.config
        cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, 8, 16, torch.float32, target.device)
        s = cache.new_seq()
        s.reserve(len(tokens))
        meta = build_metadata([len(tokens)], [0], [s.blocks], s.slots(0, len(tokens)), 16, target.device)
        h = target.model(torch.tensor(tokens), torch.arange(len(tokens)), cache.kv, meta)
        lg = target.model.compute_logits(h[-1:])
        return logits_to_probs(lg, torch.tensor([temp]), torch.tensor([topk]), torch.tensor([1.0]))[0].double()

    joint = {}
    p1 = probs(prompt)
    for x1 in torch.nonzero(p1).flatten().tolist():
        p2 = probs(prompt + [x1])
        for x2 in torch.nonzero(p2).flatten().tolist():
            p3 = probs(prompt + [x1, x2])
            for x3 in torch.nonzero(p3).flatten().tolist():
                joint[(x1, x2, x3)] = float(p1[x1] * p2[x2] * p3[x3])
    n = 3000
    params = [SamplingParams(temperature=temp, top_k=topk, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    seqs = eng.generate([prompt] * n, params, SpecParams("head"))
    assert eng.stats.by_proposer["head"][2] > 0.2 * n  # the head's drafts were really accepted
    assert_follows(joint, [s.output_ids for s in seqs], tv_bound=0.08)
    assert eng.kv_blocks_used() == (0, 0)


def test_kept_features_after_partial_acceptance_equal_a_fresh_prefill(shared_pair, head_dir):
    target, _ = shared_pair
    eng = _engine(target, head_dir)
    layers = eng.capture
    seq = eng.add_request(eng.tokenizer("The dog ran to the")["input_ids"], GREEDY, SpecParams("head"))
    partial = 0
    while not seq.finished:
        drafted, accepted = seq.stats.draft_tokens, seq.stats.accepted_tokens
        eng.step()
        if seq.finished or seq.hidden is None:
            continue
        d_draft, d_acc = seq.stats.draft_tokens - drafted, seq.stats.accepted_tokens - accepted
        partial += d_draft > d_acc  # some drafts rejected, their rows must be gone
        nc = seq.num_computed
        assert seq.hidden_start == seq.draft_computed and seq.hidden_start + seq.hidden.shape[0] == nc
        fresh = _features(target, seq.tokens[:nc], layers)[seq.hidden_start : nc]
        torch.testing.assert_close(seq.hidden, fresh, atol=2e-4, rtol=1e-4)
    assert partial >= 2 and seq.stats.accepted_tokens > 0


def test_paged_drafting_rows_equal_the_training_time_test(shared_pair, head_dir):
    """Step 0 of ``unroll`` = the catch-up rows over the paged cache; step 1 = a depth-1 tree node
    (its parent's output hidden state, attending to the committed rows and itself)."""
    target, _ = shared_pair
    head = load_head(head_dir, target)
    toks = target.tokenizer("Once upon a time, there was a little dog")["input_ids"]
    n = len(toks) - 2  # rows 0..n-1 (row p: features of p, token p + 1); step 1 needs token p + 2
    feats = _features(target, toks, head.layers)[:n]
    ids = torch.tensor(toks)
    with torch.no_grad():
        steps = head.unroll(feats[None], ids[None, 1 : n + 2], 2)
    c = head.cfg
    cache = KVCache(1, c.num_kv_heads, c.head_dim, 8, 16, torch.float32, target.device)
    s = cache.new_seq()
    s.reserve(n + 1)
    meta = build_metadata([n], [0], [s.blocks], s.slots(0, n), 16, target.device)
    out = head(ids[1 : n + 1], torch.arange(n), head.fuse(feats), cache.kv, meta, TorchAttention())
    torch.testing.assert_close(out, steps[0][0], atol=1e-4, rtol=1e-4)
    p = n - 1  # a depth-1 child of the root row p: position p + 1, token p + 2, slot n
    meta = build_metadata([1], [n], [s.blocks], s.slots(n, n + 1), 16, target.device)
    child = head(ids[p + 2 : p + 3], torch.tensor([p + 1]), out[p : p + 1], cache.kv, meta, TorchAttention())
    torch.testing.assert_close(child[0], steps[1][0, p], atol=1e-4, rtol=1e-4)
    lg = head.compute_logits(out)
    assert torch.isinf(lg[:, [i for i in range(512) if i not in set(head.d2t.tolist())]]).all()


def test_bf16_autocast_training_learns_as_fp32_does(shared_pair, replies):
    target, _ = shared_pair
    d2t = pick_vocab(replies, 256, [2], 512)
    t2d = torch.full((512,), -100, dtype=torch.long)
    t2d[d2t] = torch.arange(d2t.numel())
    layers = new_head(target, d2t).layers
    feats, held = target_features(target, replies[:-8], layers), target_features(target, replies[-8:], layers)
    base = head_agreement(new_head(target, d2t), held, t2d)[0]
    heads = []
    for bf16 in (False, True):
        head = new_head(target, d2t)
        train_head(head, feats, t2d, steps=30, batch=8, lr=3e-3, ttt=2, bf16=bf16)
        assert all(p.dtype == torch.float32 for p in head.parameters())  # master weights stay fp32
        assert head_agreement(head, held, t2d)[0] > base + 0.05
        heads.append(head.fc.weight.detach().clone())
    assert not torch.equal(heads[0], heads[1])  # the bf16 run really computed in bf16


def test_head_agreement_counts_tokens_outside_the_vocabulary_as_misses(shared_pair, replies, head_dir):
    target, _ = shared_pair
    trained = load_head(head_dir, target)
    head = new_head(target, trained.d2t[:96])  # the trained body over its 96 most used tokens
    head.load_state_dict({k: v.float() for k, v in trained.state_dict().items()})
    t2d = torch.full((512,), -100, dtype=torch.long)
    t2d[head.d2t] = torch.arange(head.d2t.numel())
    held = target_features(target, replies[:8], head.layers)
    masked, every = head_agreement(head, held, t2d, 2), head_agreement(head, held, t2d, 2, oov_miss=True)
    labels = [tok for t, p, _ in held for tok in t[max(p, 2) :]]  # step 0 predicts tokens p + 2 onwards
    n_in = sum(int(t2d[tok]) != -100 for tok in labels)
    assert 0 < n_in < len(labels), "every label in the vocabulary: the test proves nothing"
    assert masked[0] * n_in == pytest.approx(every[0] * len(labels))  # the same hits over more positions
    assert every[0] < masked[0] and every[1] < masked[1]


def test_distill_kind_head_beats_an_untrained_head(tmp_path, shared_pair, replies):
    from specd.training.cli import main

    target, _ = shared_pair
    data = tmp_path / "replies.json"
    data.write_text(json.dumps(replies))
    out = tmp_path / "trained"
    args = ["--kind", "head", "--target", str(TARGET), "--out", str(out), "--data-in", str(data)]
    assert main([*args, "--draft-vocab", "256", "--steps", "40", "--batch-size", "8", "--lr", "3e-3"]) == 0
    meta = json.loads((out / "config.json").read_text())["specd_head"]
    assert meta["heldout_top1_agreement"][0] > meta["heldout_top1_agreement_before"][0] + 0.05
    trained = load_head(out, target)
    untrained = new_head(target, trained.d2t, init=False)
    save_head(untrained, tmp_path / "untrained", dtype=torch.float32)
    t2d = torch.full((512,), -100, dtype=torch.long)
    t2d[trained.d2t] = torch.arange(trained.d2t.numel())
    held = target_features(target, replies[:8], trained.layers)
    assert head_agreement(trained, held, t2d)[0] > head_agreement(untrained, held, t2d)[0] + 0.1
    mal = []
    for folder in (out, tmp_path / "untrained"):  # acceptance in the engine, same prompts
        eng = _engine(target, folder)
        eng.generate([eng.tokenizer(w)["input_ids"] for w in STARTS[:4]], GREEDY, SpecParams("head"))
        mal.append(eng.stats.mean_accepted_length)
    assert mal[0] > mal[1] + 0.3, mal


def test_an_eagle3_checkpoint_loads_as_the_same_head(tmp_path, shared_pair, head_dir):
    target, _ = shared_pair
    native = load_head(head_dir, target)
    save_eagle3(native, tmp_path / "eagle3", dtype=torch.float32)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "eagle3" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "lm_head.weight"} <= names
    assert {"d2t", "t2d", "norm.weight", "midlayer.mlp.gate_proj.weight"} <= names
    with safe_open(str(tmp_path / "eagle3" / "model.safetensors"), framework="pt") as f:
        offsets = f.get_tensor("d2t")
    assert torch.equal(offsets + torch.arange(offsets.numel()), native.d2t)  # EAGLE stores offsets
    e3 = load_head(tmp_path / "eagle3", target)
    assert e3.layers == native.layers and torch.equal(e3.d2t, native.d2t)
    for (name, a), (_, b) in zip(native.state_dict().items(), e3.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(e3.head_rows, native.head_rows)  # its own lm_head = the target's rows here
    outs = []
    for folder in (head_dir, tmp_path / "eagle3"):
        eng = _engine(target, folder)
        seqs = eng.generate([eng.tokenizer(w)["input_ids"] for w in STARTS[:3]], GREEDY, SpecParams("head"))
        outs.append(([s.output_ids for s in seqs], eng.stats.as_dict()["accept_len_hist"]))
    assert outs[0] == outs[1]  # the same drafts, accepted alike


@pytest.mark.skipif(kernel() is None, reason="specd's CPU kernel is not built here")
@pytest.mark.parametrize("act_int8", [False, True])
def test_a_head_drafting_through_the_cpu_kernel_computes_the_float_heads_rows(shared_pair, head_dir, act_int8):
    """``use_kernel``: int8 projections give the float head's rows to int8 precision and (nearly
    always) its top draft token; training's float weights are untouched."""
    target, _ = shared_pair
    ref, head = load_head(head_dir, target), load_head(head_dir, target)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    head.use_kernel(act_int8)
    assert set(head.ops) == {"fc", "qkv", "o", "gate_up", "down"}
    assert all(isinstance(op, QuantLinear) and op.act_int8 == act_int8 for op in head.ops.values())
    toks = target.tokenizer("Once upon a time, there was a little dog who liked to run in the park")["input_ids"]
    n = len(toks) - 1
    feats = _features(target, toks, head.layers)[:n]
    outs, children = [], []
    cpu = CpuAttention(kernel())
    assert head.fused is not None  # the layer as one C call with the kernel's attention backend
    for h, backend in ((ref, TorchAttention()), (head, TorchAttention()), (head, cpu)):
        c = h.cfg
        cache = KVCache(1, c.num_kv_heads, c.head_dim, 8, 16, torch.float32, target.device)
        s = cache.new_seq()
        s.reserve(n + 1)
        meta = build_metadata([n], [0], [s.blocks], s.slots(0, n), 16, target.device)
        ids, pos = torch.tensor(toks[1 : n + 1]), torch.arange(n)
        outs.append(h(ids, pos, h.fuse(feats), cache.kv, meta, backend))
        # a depth-1 tree node below the last row: its parent's output, attending to the rows and itself
        meta = build_metadata(
            [1],
            [n],
            [s.blocks],
            s.slots(n, n + 1),
            16,
            target.device,
            tree_masks=[torch.ones((1, 1), dtype=torch.bool)],
            seq_lens=[n + 1],
        )
        children.append(h(torch.tensor([5]), torch.tensor([n]), outs[-1][n - 1 : n], cache.kv, meta, backend))
    torch.testing.assert_close(outs[2], outs[1], atol=2e-4, rtol=1e-4)  # C layer == the same ops in torch
    torch.testing.assert_close(children[2], children[1], atol=2e-4, rtol=1e-4)
    err = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert 0 < err < 0.05, err  # quantized (not the float path), and close to it
    top = [h.compute_logits(o).argmax(-1) for h, o in zip((ref, head), outs)]
    assert (top[0] == top[1]).float().mean() >= 0.8
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in before.items())


@pytest.mark.skipif(
    not builtin.builtin_gguf().exists() or builtin.head_path() is None, reason="built-in model or head missing"
)
@pytest.mark.parametrize("act_quant", ["none", "int8"])
def test_builtin_head_greedy_equals_plain(act_quant):
    eng = Engine(
        EngineConfig(
            target=str(builtin.builtin_gguf()),
            head=str(builtin.head_path()),
            dtype="float32",
            act_quant=act_quant,
            cache=CacheConfig(num_blocks=256),
            spec=SpecConfig(mode="head", adaptive=False),
        )
    )
    if kernel() is not None:  # the quantized target's head drafts through the same kernel
        ops = eng.drafter.model.ops
        assert ops and all(op.act_int8 == (act_quant == "int8") for op in ops.values())
    tok = eng.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in ("What is the capital of France?", "Tom has 3 apples and buys 4 more. How many apples?")
    ]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain = [s.output_ids for s in eng.generate(prompts, params, SpecParams("off"))]
    assert [s.output_ids for s in eng.generate(prompts, params, SpecParams("head"))] == plain
    assert eng.stats.by_proposer["head"][2] > 0


def test_generate_spec_head_and_per_request_mode(shared_pair, head_dir, capsys):
    from specd.cli import main
    from specd.serving.request_build import speculation_params

    assert speculation_params({"mode": "head"}) == SpecParams("head")
    base = ["generate", "--target", str(TARGET), "--device", "cpu", "--dtype", "float32", "--raw", "--json"]
    base += ["--prompt", "Once upon a time", "--max-tokens", "24", "--ignore-eos"]
    assert main([*base, "--head", str(head_dir), "--spec", "head"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*base, "--spec", "off"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"] == plain["token_ids"] and out["stats"]["by_proposer"]["head"]["accepted_tokens"] > 0
    assert main([*base, "--spec", "head"]) != 0  # no head loaded: a one-line error, not a silent plain run
    assert "--spec head needs --head" in capsys.readouterr().err


def test_captured_features_are_the_hidden_states_entering_the_layers(shared_pair, hf_target):
    """The features are Hugging Face's ``hidden_states[i]`` (EAGLE-3's convention), not layer outputs."""
    target, _ = shared_pair
    toks = target.tokenizer("Once upon a time, there was a little dog")["input_ids"]
    layers = (1, 2, 4)
    ours = _features(target, toks, layers)
    with torch.no_grad():
        hs = hf_target(torch.tensor([toks]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i][0] for i in layers], dim=-1)
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_a_head_with_tensor_parallelism_is_refused_and_the_builtin_model_keeps_its_draft(tmp_path, monkeypatch):
    """Tensor-parallel ranks hand back no features: ``--head`` with TP > 1 is one clear LoadError, and
    the built-in model under TP falls back to its draft instead of picking the head it cannot run."""
    from argparse import Namespace

    from specd.engine.builder import load_head_for
    from specd.model.errors import LoadError
    from specd.options import fill_default_models

    with pytest.raises(LoadError, match="tensor-parallel"):
        cfg = EngineConfig(target=str(tmp_path), head=str(tmp_path), tensor_parallel_size=2)
        load_head_for(cfg, target=None, draft=None)
    monkeypatch.setattr(builtin, "ensure", lambda download: tmp_path)
    monkeypatch.setattr(builtin, "head_path", lambda: tmp_path / "head")
    monkeypatch.setattr(builtin, "draft_path", lambda: tmp_path / "draft")
    for tp, head, draft in ((1, "head", None), (2, None, "draft")):
        a = Namespace(target=None, draft=None, head=None, tensor_parallel_size=tp)
        fill_default_models(a)
        assert (a.head, a.draft) == (head and str(tmp_path / head), draft and str(tmp_path / draft))


def test_kept_features_grow_in_place_and_equal_concatenation():
    """The ledger keeps a request's features in a buffer grown by doubling (rows written after the
    kept ones), and the kept rows always equal plain concatenation, through drops (consumed by the
    head), rollbacks (a failed step) and a gap (a fresh start)."""
    from specd.engine.ledger import KVLedger
    from specd.engine.sequence import Sequence

    g = torch.Generator().manual_seed(3)
    seq = Sequence.__new__(Sequence)
    seq.hidden, seq.hidden_start, seq.hidden_buf, seq.draft_computed = None, 0, None, 0
    ref, start, pos = None, 0, 0
    buffers = set()
    for step in range(200):
        rows = torch.randn(1 + step % 3, 5, generator=g)
        if step % 17 == 16:  # the head consumed features up to here: the next keep drops them
            seq.draft_computed = pos - 2
        KVLedger._keep_hidden(seq, pos, rows)
        ref = rows if ref is None else torch.cat([ref, rows])
        pos += rows.shape[0]
        drop = min(seq.draft_computed - start, ref.shape[0])
        if drop > 0:
            ref, start = ref[drop:], start + drop
        if step % 23 == 22:  # a failed step: drop the last rows
            keep = max(ref.shape[0] - 2, 0)
            seq.hidden, ref, pos = seq.hidden[:keep], ref[:keep], start + keep
        assert seq.hidden_start == start and torch.equal(seq.hidden, ref), step
        buffers.add(seq.hidden_buf.data_ptr() if seq.hidden_buf is not None else None)
    assert len(buffers) < 20  # reallocated now and then, not every step
    KVLedger._keep_hidden(seq, pos + 5, torch.ones(2, 5))  # a gap: the kept rows start afresh
    assert seq.hidden_start == pos + 5 and torch.equal(seq.hidden, torch.ones(2, 5))


def test_eval_head_agreement_reports_per_category(tmp_path, head_dir):
    from eval import head_agreement as E

    prompts = tmp_path / "q.jsonl"
    rows = [("qa", "Once upon a time"), ("qa", "The dog ran"), ("rag", "Lily had a ball"), ("rag", "Tom saw a cat")]
    prompts.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in rows))
    out = tmp_path / "out"
    base = ["--target", str(TARGET), "--prompts", str(prompts), "--max-tokens", "24", "--act-quant", "none"]
    assert E.main([*base, "--heads", str(head_dir), "--steps", "2", "--out", str(out)]) == 0
    table = json.loads((out / "results.json").read_text())["agreement"][str(head_dir)]
    assert set(table) == {"qa", "rag"}
    for cell in table.values():
        assert cell["positions"] > 0 and len(cell["masked"]) == 2
        assert 0.2 < cell["unmasked"][0] <= cell["masked"][0] <= 1  # a trained head agrees, OOV only lowers it
    assert "qa" in (out / "summary.md").read_text()


def test_eval_head_costs_times_each_piece(tmp_path, head_dir):
    from eval import head_costs as E

    out = tmp_path / "out"
    args = ["--target", str(TARGET), "--head", str(head_dir), "--act-quant", "none", "--rows", "1,3"]
    assert E.main([*args, "--context", "20", "--reps", "5", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["target"]) == {"1", "3"}
    assert all(v > 0 for r in res["target"].values() for v in r.values())
    assert res["head"]["draft_vocab"] == 256 and res["head"]["layer_ms"] > 0 and res["head"]["logits_ms"] > 0
    calls = []
    cold = SimpleNamespace(sum=lambda: calls.append("evict"))  # the buffer read before each timed call
    assert E.median_ms(lambda: calls.append("f"), 4, cold) >= 0
    assert calls == ["f", "f"] + ["evict", "f"] * 4  # 2 warm calls, then each timed one after a sweep
