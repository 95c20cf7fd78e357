"""Issue #42 item 5: the shape-true random-weight GGUF files of ``python -m eval bench scale`` and its
table maths, llama.cpp's perplexity convention (``specd.engine.perplexity.llamacpp_nll``) against
transformers scoring the same tokens, and the cost model seeded with measured row costs (``auto``
drafts deeper where rows are cheap, from the first request).
"""

from __future__ import annotations

import copy
import math

import gguf
import numpy as np
import pytest
import torch
from conftest import DRAFT, TARGET

from eval import bench_scale as bs
from specd.config import EngineConfig, SpecConfig
from specd.engine.perplexity import llamacpp_nll
from specd.speculation.policy import SpecPolicy

ROWS = (1, 2, 4, 8, 16, 32)


# the files ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def builtin_tokenizer():
    """``bs.tokenizer_fields(49152)``: the built-in model's tokenizer, read once (gguf parses its
    49152 tokens and merges one by one: seconds)."""
    return bs.tokenizer_fields(49152)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory, builtin_tokenizer):
    path = tmp_path_factory.mktemp("scale") / "tiny-f16.gguf"
    assert bs.SHAPES["tiny"].vocab == 49152
    with pytest.MonkeyPatch.context() as mp:  # (the fields just read, not read again)
        mp.setattr(bs, "tokenizer_fields", lambda vocab, src=None: copy.deepcopy(builtin_tokenizer))
        return bs.write_f16(path, bs.SHAPES["tiny"], std=0.02, seed=1)


def test_written_file_has_the_shape_types_and_tokenizer(tiny_file, builtin_tokenizer):
    """Every tensor of the plan is in the file with its shape (ggml order: innermost first) and type
    (projections F16, norms F32), the metadata states the shape, and the tokenizer is the built-in's
    (49152 tokens, the same merges and flags)."""
    s = bs.SHAPES["tiny"]
    r = gguf.GGUFReader(str(tiny_file))
    got = {t.name: (tuple(int(x) for x in t.shape), t.tensor_type.name) for t in r.tensors}
    want = {n: (tuple(reversed(shape)), "F16" if half else "F32") for n, shape, half in bs.tensor_plan(s)}
    assert got == want and len(want) == 2 + 9 * s.layers  # tied: no output.weight
    meta = {k: f.contents() for k, f in r.fields.items()}
    assert meta["llama.embedding_length"] == s.hidden and meta["llama.block_count"] == s.layers
    assert meta["llama.attention.head_count_kv"] == s.kv_heads and meta["llama.feed_forward_length"] == s.intermediate
    src = builtin_tokenizer
    assert meta["tokenizer.ggml.tokens"] == src["tokenizer.ggml.tokens"] and len(src["tokenizer.ggml.tokens"]) == 49152
    assert meta["tokenizer.ggml.merges"] == src["tokenizer.ggml.merges"]
    w = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight").data.astype(np.float32)
    assert 0.015 < float(w.std()) < 0.025 and abs(float(w.mean())) < 0.002  # the requested scale


def test_tokenizer_padded_to_a_llama3_vocabulary():
    """A 128256-token shape gets the 49152 real tokens then reserved control tokens (type 3)."""
    f = bs.tokenizer_fields(128256)
    toks, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    assert len(toks) == len(types) == 128256 and len(set(toks)) == 128256
    assert toks[49152] == "<|reserved_special_token_0|>" and set(types[49152:]) == {3}
    with pytest.raises(SystemExit, match="smaller than"):
        bs.tokenizer_fields(1000)


def test_written_file_loads_in_specd_and_gives_finite_logits(tiny_file):
    """specd loads the file as `specd serve` does: the shape in its config, the built-in tokenizer's
    ids, finite logits of the vocabulary's width from its forward."""
    from specd.engine.perplexity import _window_logits
    from specd.model import builtin
    from specd.model.loader import load_model

    s = bs.SHAPES["tiny"]
    lm = bs.load_target(tiny_file)
    c = lm.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        s.hidden, s.layers, s.heads, s.kv_heads, s.vocab,
    )  # fmt: skip
    ref = load_model(builtin.builtin_gguf(), "cpu", "float32", progress=False)
    text = "To be, or not to be: that is the question."
    assert lm.tokenizer(text)["input_ids"] == ref.tokenizer(text)["input_ids"]
    lg = _window_logits(lm, lm.tokenizer(text)["input_ids"], 8)
    assert lg.shape[1] == s.vocab and torch.isfinite(lg).all() and lg.std() > 0


def test_published_parameter_counts():
    """The shapes are the real models': 1.71B, 3.21B and 8.03B parameters."""
    assert round(bs.SHAPES["1.7b"].params / 1e9, 2) == 1.71
    assert round(bs.SHAPES["3b"].params / 1e9, 2) == 3.21
    assert round(bs.SHAPES["8b"].params / 1e9, 2) == 8.03


def test_step_bytes_skip_only_an_untied_embedding_table(tmp_path, monkeypatch):
    """A step reads every tensor but an untied token-embedding table (it reads one row of it); a tied
    table is the LM head and is read whole. (The files go without the tokenizer's 49152 strings:
    only tensors are counted, and writing and parsing those strings took most of this test.)"""
    monkeypatch.setattr(bs, "tokenizer_fields", lambda vocab, src=None: {})
    tied = bs.Shape("t", 32, 64, 1, 2, 1, 49152, True, 1e4)
    for s in (tied, bs.Shape("u", 32, 64, 1, 2, 1, 49152, False, 1e4)):
        p = bs.write_f16(tmp_path / f"{s.name}.gguf", s)
        sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(p)).tensors}
        skip = 0 if s.tied else sizes["token_embd.weight"]
        assert bs.step_bytes(p) == sum(sizes.values()) - skip
        assert sizes["token_embd.weight"] == 49152 * 32 * 2


def test_floor_fraction_and_ratio():
    """Floor time / step time: 1 GB at 20 GB/s is a 50 ms floor; 10 tok/s at batch 1 is a 100 ms step
    (0.5 of the floor's speed), 20 tok/s at batch 4 a 200 ms step (0.25); no rate, no fraction."""
    assert bs.floor_fraction(10**9, 20.0, 1, 10.0) == 0.5
    assert bs.floor_fraction(10**9, 20.0, 4, 20.0) == 0.25
    assert bs.floor_fraction(10**9, 20.0, 1, None) is None
    assert bs._times(1.5) == "1.50x" and bs._times(None) == "-"


def test_passes_merge_to_medians_and_per_pass_ratios():
    """Alternating passes: each rate's median, and the median of the ratios within each pass (a pass
    where the machine was busy slows both sides); a missing llama.cpp figure is left out."""
    passes = [
        {"specd": {1: 2.0, 4: 6.0}, "llama_bench_b1": 4.0, "llama_batched": {1: 4.0, 4: 8.0}},
        {"specd": {1: 1.0, 4: 3.0}, "llama_bench_b1": 1.0, "llama_batched": {1: 1.0, 4: 6.0}},
        {"specd": {1: 3.0, 4: 9.0}, "llama_bench_b1": None, "llama_batched": {}},
    ]
    m = bs.merge_passes(passes)
    assert m["specd"] == {1: 2.0, 4: 6.0} and m["llama_bench_b1"] == 2.5 and m["llama_batched"] == {1: 2.5, 4: 7.0}
    assert m["ratio_b1"] == 0.75 and m["ratio_b4"] == 0.62  # medians of (0.5, 1.0) and (0.75, 0.5)


def test_table_rows_and_bad_flags():
    """The table holds one row per file and thread count with the rows' multiples of one row;
    unknown sizes or formats are one-line errors."""
    run = {"threads": 2, "read_GBps": 20.0, "floor_ms": 50.0, "specd": {1: 10.0, 4: 30.0}, "llama_bench_b1": 12.5,
           "llama_batched": {1: 12.0, 4: 40.0}, "rows_ms": {w: 10.0 * (1 + 0.05 * (w - 1)) for w in ROWS},
           "auto_depth": {"0.6": 3, "0.8": 7}, "ratio_b1": 0.8, "ratio_b4": 0.75}  # fmt: skip
    md = bs.table([{"model": "M", "format": "q4_0", "step_bytes": 10**9, "runs": [run]}])
    assert "| M | q4_0 | 1.000 | 2 | 20.000 | 50.000 | 10.0 (0.5) | 12.5 (0.625) | 0.80x |" in md
    assert "| 30.0 (0.375) | 40.0 (0.5) | 0.75x | 1.05/1.15/1.35/1.75/2.55 | 3/7 |" in md
    with pytest.raises(SystemExit, match="unknown size"):
        bs.parse_args(["--sizes", "70b"])
    with pytest.raises(SystemExit, match="unknown format"):
        bs.parse_args(["--formats", "q3_x"])


# perplexity: llama.cpp's convention ----------------------------------------------------------
def _reference_nll(hf, ids: list, n_ctx: int, bos: int | None, chunks: int) -> tuple[float, int]:
    """llama-perplexity's scoring written out with transformers: per chunk of n_ctx ids (first id BOS
    when given), -log_softmax of the logits at n_ctx/2 .. n_ctx-2 at the next ids."""
    total, count = 0.0, 0
    for i in range(chunks):
        w = list(ids[i * n_ctx : (i + 1) * n_ctx])
        if bos is not None:
            w[0] = bos
        with torch.no_grad():
            lg = hf(torch.tensor([w])).logits[0].double()
        lp = torch.log_softmax(lg, -1)
        first = n_ctx // 2
        total -= sum(float(lp[p, w[p + 1]]) for p in range(first, n_ctx - 1))
        count += n_ctx - 1 - first
    return total, count


@pytest.mark.parametrize("bos", [None, 1])
def test_llamacpp_convention_equals_transformers(shared_pair, hf_target, bos):
    """specd's llama.cpp-convention NLL on the stories260K model equals transformers' logits scored the
    same way (second half of each chunk, BOS replacing each chunk's first id or not), token counts
    included; too few ids for two chunks is a one-line error."""
    lm = shared_pair[0]
    ids = torch.randint(3, lm.config.vocab_size, (3 * 64 + 17,), generator=torch.Generator().manual_seed(0)).tolist()
    got = llamacpp_nll(lm, ids, 64, bos, chunks=None, chunk=24)
    want = _reference_nll(hf_target, ids, 64, bos, 3)
    assert got[1] == want[1] == 3 * 31 and len(got[2]) == 3 and math.isclose(sum(got[2]), got[0])
    assert math.isclose(got[0], want[0], rel_tol=1e-5)
    assert llamacpp_nll(lm, ids, 64, bos, chunks=2)[1] == 62  # --chunks 2
    with pytest.raises(ValueError, match="at least 2 x ctx"):
        llamacpp_nll(lm, ids[:100], 64)


# the cost model, seeded ----------------------------------------------------------------------
def _costs(one_ms: float, per_row: float) -> dict:
    """{rows: seconds} of a step: one row costs ``one_ms``, each further one ``per_row`` of it."""
    return {w: one_ms / 1e3 * (1 + per_row * (w - 1)) for w in ROWS}


# 1.7B Q4_0 on a CPU, memory-bound (issue #42: 2/4/8 rows 1.07/1.17/1.44x); 135M, compute-bound (5 rows 2x)
CHEAP, DEAR = _costs(60.0, 0.06), _costs(6.0, 0.25)


def _policy(costs: dict | None, t_draft: float = 0.0) -> SpecPolicy:
    p = SpecPolicy(SpecConfig(mode="chain", num_draft_tokens=16, tree_depth=16), has_draft=True)
    p.costs.observe_plain(1, (costs or CHEAP)[1])
    if costs is not None:
        p.costs.seed(1, costs)
    p.costs.t_draft = t_draft
    p.step = 1  # (not a probe step)
    return p


def test_seeded_widths_price_verification():
    """Seeded widths are what verification costs (a plain step's measured cost kept), the line
    between them is their least-squares fit, and the fit is trusted up to twice the widest."""
    p = _policy(CHEAP)
    c = p.costs
    for w in ROWS[1:]:
        assert c.verify_cost(w - 1, 1, CHEAP[1]) == pytest.approx(CHEAP[w])
    assert c.t_per_token == pytest.approx(0.06 * 0.060) and c.t_target == pytest.approx(0.060 * 0.94)
    assert c.verify_cost(63, 1, CHEAP[1]) == pytest.approx(c.t_target + 64 * c.t_per_token)  # within 2 x 32
    with pytest.raises(ValueError, match="2\\+ widths"):
        c.seed(1, {1: 0.01, 2: 0.011})


def test_auto_drafts_deeper_where_rows_are_cheap():
    """At the same acceptance, a policy seeded with memory-bound row costs drafts much deeper than one
    seeded with compute-bound costs; unseeded, its first draft is the 2-token probe whatever the
    costs. (Costs only: what is accepted does not depend on them.)"""
    depths = {a: (_policy(CHEAP).choose_depth([a]), _policy(DEAR).choose_depth([a])) for a in (0.6, 0.7, 0.8, 0.9)}
    assert all(cheap > dear >= 1 for cheap, dear in depths.values()), depths
    assert depths[0.8][0] >= 2 * depths[0.8][1] and depths[0.9][0] >= 2 * depths[0.9][1] + 2, depths
    assert _policy(None).choose_depth([0.8]) == 2
    assert _policy(DEAR).choose_depth([0.2]) == 0  # low acceptance on dear rows: no drafting


def test_warm_up_seeds_the_engine(shared_pair):
    """`specd serve`'s warm-up times 1..32 rows and seeds the engine's cost model: every width priced
    (as seen twice), never below the measured plain step, the line fitted; no seeding when the
    policy is not adaptive."""
    from specd.engine.engine import Engine
    from specd.engine.warmup import warm_up

    target, draft = shared_pair
    cfg = EngineConfig(target=str(TARGET), draft=str(DRAFT), spec=SpecConfig(mode="chain"))
    eng = Engine(cfg, target=target, draft=draft)
    warm_up(eng)
    c = eng.policy.costs
    c.at_context(0)
    plain = c.plain_cost(1)
    assert plain is not None and c.t_target is not None
    for w in ROWS[1:]:
        s, seen = c.t_width[(1, w)]
        assert seen >= 2 and s >= plain
    off = Engine(EngineConfig(target=str(TARGET), spec=SpecConfig(mode="chain", adaptive=False)), target=target)
    warm_up(off)
    off.policy.costs.at_context(0)
    assert (1, 32) not in off.policy.costs.t_width
