"""specd.model.graphs: bucketing, padding, static-buffer reuse, eager fallback and the memory bound of
the graph runner, on the CPU stand-in graph (the closure recorded at capture and replayed on the same
static buffers). The step closures here run the Triton kernels under the interpreter (they take
padded rows past the last request, as the CUDA step does): a layer of batch-invariant kernels over
a paged KV cache, whose real rows and KV writes must be bitwise those of the eager step, and the
shared stories260K model's forward.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import specd_kernels as sk
from specd.model.graphs import (
    GraphConfig,
    GraphRunner,
    RecordedGraph,
    StepInputs,
    default_buckets,
    fill,
    static_inputs,
)
from specd_kernels import batch_invariant as bi

DEVICE = torch.device("cuda" if (torch.cuda.is_available() and not sk.interpreting()) else "cpu")
BS = 4  # KV block size of these tests


def make_inputs(qlens, ctxs, tables, masks=None, *, vocab=50, seed=0) -> StepInputs:
    """A step of requests with ``qlens`` new tokens after ``ctxs`` cached ones; ``tables`` their block
    tables; ``masks`` per request None (causal) or a [q, q] ancestor mask (then a tree step)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(qlens)
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    pos, slots = [], []
    for q, c, tab in zip(qlens, ctxs, tables):
        for i in range(q):
            p = c + i
            pos.append(p)
            slots.append(tab[p // BS] * BS + p % BS)
    W = max(len(t) for t in tables)
    mask = None
    if masks is not None:
        mask = torch.zeros(T, max(qlens), dtype=torch.bool)
        for b, m in enumerate(masks):
            q = qlens[b]
            mask[qsl[b] : qsl[b + 1], :q] = torch.ones(q, q, dtype=torch.bool).tril() if m is None else m
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return StepInputs(
        input_ids=torch.randint(1, vocab, (T,), generator=g).to(DEVICE),
        positions=torch.tensor(pos, dtype=torch.int64, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(qsl, **i32),
        context_lens=torch.tensor(ctxs, **i32),
        seq_lens=torch.tensor([c + q for c, q in zip(ctxs, qlens)], **i32),
        block_tables=torch.tensor([t + [0] * (W - len(t)) for t in tables], **i32),
        tree_mask=None if mask is None else mask.to(DEVICE),
        max_query_len=max(qlens),
        max_seq_len=max(c + q for c, q in zip(ctxs, qlens)),
    )


class InvariantLayer:
    """A decoder layer's reductions as one step closure over a paged cache: embedding, RMSNorm, the
    q/k/v GEMM, the KV write, attention, the o GEMM with the residual, and an LM-head GEMM."""

    def __init__(self, *, d=32, heads=4, kvh=2, vocab=50, num_blocks=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.heads, self.kvh, self.hd = heads, kvh, d // heads

        def w(*shape):
            return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(DEVICE)

        self.embed, self.norm_w = w(vocab, d), 1 + w(d)
        self.w_qkv, self.w_o, self.head = w((heads + 2 * kvh) * self.hd, d), w(d, d), w(vocab, d)
        self.kv = torch.zeros(2, num_blocks, BS, kvh, self.hd, device=DEVICE)  # [2, NB, BS, KVH, D]
        self.calls = []  # the StepInputs objects the closure saw

    def __call__(self, inp: StepInputs) -> torch.Tensor:
        self.calls.append(inp)
        T, H, KVH, D = inp.num_tokens, self.heads, self.kvh, self.hd
        x = self.embed[inp.input_ids]  # [T, d]
        qkv = bi.matmul(bi.rms_norm(x, self.norm_w, 1e-5), self.w_qkv)  # [T, (H + 2 KVH) D]
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=1)
        sk.write_kv(self.kv, k.reshape(T, KVH, D).contiguous(), v.reshape(T, KVH, D).contiguous(), inp.slot_mapping)
        o = bi.attention(q.reshape(T, H, D).contiguous(), self.kv, inp.query_start_loc, inp.context_lens,
                         inp.seq_lens, inp.block_tables, inp.tree_mask, D**-0.5)  # fmt: skip
        x = bi.matmul(o.reshape(T, H * D), self.w_o, add=x)  # x + o @ W_o^T
        return bi.matmul(bi.rms_norm(x, self.norm_w, 1e-5), self.head)  # [T, vocab]


def prefill_cache(layer: InvariantLayer, ctxs, tables, seed=1):
    g = torch.Generator().manual_seed(seed)
    for c, tab in zip(ctxs, tables):
        for p in range(c):
            layer.kv[:, tab[p // BS], p % BS] = torch.randn(2, layer.kvh, layer.hd, generator=g).to(DEVICE)


def make_runner(step, buckets=((1, 1), (1, 4), (2, 2), (2, 8), (4, 4), (4, 16)), stand_in=False, **kw) -> GraphRunner:
    """A captured runner: CUDA graphs on a GPU, the stand-in elsewhere (or wherever ``stand_in``)."""
    cfg = GraphConfig(buckets=buckets, max_blocks=kw.pop("max_blocks", 4), block_size=BS,
                      max_region=kw.pop("max_region", 8), **kw)  # fmt: skip
    runner = GraphRunner(step, cfg, DEVICE, make_graph=RecordedGraph if (stand_in or DEVICE.type == "cpu") else None)
    runner.capture()
    return runner


# ---------------------------------------------------------------------------------------------
# buckets and buffers
# ---------------------------------------------------------------------------------------------


def test_default_buckets_and_config():
    assert default_buckets(4, 8) == ((1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8))
    cfg = GraphConfig(buckets=((2, 2), (1, 4)), max_blocks=2, block_size=BS, max_region=4)
    assert cfg.keys() == [(2, 2, False), (1, 4, False), (1, 4, True)]  # (no tree of one token a request)
    assert GraphConfig(buckets=((1, 1),), max_blocks=2, block_size=BS).keys() == [(1, 1, False)]  # no mask width
    for bad in (dict(buckets=((3, 2),)), dict(buckets=((1, 1),), max_blocks=0), dict(buckets=((1, 1),), masked=(2,))):
        with pytest.raises(ValueError):
            GraphConfig(**{"max_blocks": 2, "block_size": BS, **bad})


def test_bucket_choice():
    runner = make_runner(lambda inp: inp.input_ids.float()[:, None])
    pick = runner.bucket_for
    assert pick(make_inputs([1], [3], [[1]])) == (1, 1, False)  # a decode row
    assert pick(make_inputs([3], [3], [[1, 2]])) == (1, 4, False)
    assert pick(make_inputs([1, 1], [3, 5], [[1], [2, 3]])) == (2, 2, False)
    assert pick(make_inputs([1, 1, 1], [3, 5, 1], [[1], [2, 3], [4]])) == (4, 4, False)  # batch 3 -> 4
    assert pick(make_inputs([3, 2], [1, 1], [[1], [2]], masks=[None, None])) == (2, 8, True)  # a tree step
    assert pick(make_inputs([5], [3], [[1, 2]])) == (2, 8, False)  # 5 tokens of one request: 1x? none -> 2x8
    assert pick(make_inputs([8, 8], [0, 0], [[1, 2], [4, 5]])) == (4, 16, False)
    assert pick(make_inputs([1] * 5, [0] * 5, [[i] for i in range(1, 6)])) is None  # more rows than any bucket
    assert pick(make_inputs([17], [0], [[1, 2, 3, 4, 5]])) is None  # wider block table than captured
    assert pick(make_inputs([9], [0], [[1, 2, 3]], masks=[None])) is None  # mask wider than max_region
    assert pick(make_inputs([9, 8], [0, 0], [[1, 2, 3], [4, 5]])) is None  # more tokens than any bucket


def test_fill_pads_and_clears_what_a_wider_step_left():
    cfg = GraphConfig(buckets=((4, 8),), max_blocks=4, block_size=BS, max_region=6, pad_slot=-1)
    static = static_inputs((4, 8, True), cfg, DEVICE)
    wide = make_inputs([3, 2, 2], [1, 5, 0], [[1, 2], [3, 4, 5], [6]], masks=[None, None, None])
    fill(static, wide, cfg.pad_slot)
    narrow = make_inputs([2], [6], [[7, 8]], masks=[torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)])
    fill(static, narrow, cfg.pad_slot)
    assert static.input_ids[:2].tolist() == narrow.input_ids.tolist() and static.input_ids[2:].tolist() == [0] * 6
    assert static.positions.tolist() == [6, 7] + [0] * 6
    assert static.slot_mapping.tolist() == narrow.slot_mapping.tolist() + [-1] * 6
    assert static.query_start_loc.tolist() == [0, 2, 2, 2, 2]  # padded requests: no tokens
    assert static.context_lens.tolist() == [6, 0, 0, 0] and static.seq_lens.tolist() == [8, 0, 0, 0]
    assert static.block_tables.tolist() == [[7, 8, 0, 0]] + [[0] * 4] * 3
    want_mask = torch.zeros(8, 6, dtype=torch.bool)
    want_mask[:2, :2] = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    assert torch.equal(static.tree_mask.cpu(), want_mask)
    assert (static.max_query_len, static.max_seq_len) == (8, 16)  # the bucket's: grids cover any step


# ---------------------------------------------------------------------------------------------
# replay == eager on the real rows
# ---------------------------------------------------------------------------------------------

STEPS = [  # (qlens, ctxs, tables, masks): decode rows, a chunk next to a decode row, two trees
    ([1], [5], [[3, 7]], None),
    ([3, 1], [2, 9], [[1, 2], [4, 6, 9]], None),
    ([1, 1, 1], [4, 0, 7], [[2, 5], [8], [10, 11]], None),
    ([4, 3], [6, 3], [[1, 5, 12], [13, 14]], [[-1, 0, 0, 1], [-1, 0, 1]]),
]


def _masks(parents_list):
    if parents_list is None:
        return None
    out = []
    for parents in parents_list:
        n = len(parents)
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                m[i, j], j = True, parents[j]
        out.append(m)
    return out


@pytest.mark.parametrize("case", range(len(STEPS)))
def test_padded_replay_equals_the_eager_step_bitwise(case):
    """Real rows and every KV write of a replay in a padded bucket are the eager step's, bit for bit;
    the padded tokens write no KV (pad slot -1)."""
    qlens, ctxs, tables, parents = STEPS[case]
    inp = make_inputs(qlens, ctxs, tables, _masks(parents), seed=case)
    eager_layer, graph_layer = InvariantLayer(), InvariantLayer()
    for layer in (eager_layer, graph_layer):
        prefill_cache(layer, ctxs, tables)
    runner = make_runner(graph_layer)
    graph_layer.kv.copy_(eager_layer.kv)  # (capture ran padding-only steps: they wrote nothing)
    key = runner.bucket_for(inp)
    assert key is not None and (key[0], key[1]) != (inp.num_seqs, inp.num_tokens) or case == 0
    got = runner.run(inp)
    want = eager_layer(inp)
    assert got.shape == want.shape == (inp.num_tokens, 50)
    assert torch.equal(got, want)
    assert torch.equal(graph_layer.kv, eager_layer.kv)
    assert runner.stats()["padded_tokens"] == key[1] - inp.num_tokens


def test_static_buffers_are_reused_across_replays():
    layer = InvariantLayer()
    runner = make_runner(layer)
    key = (2, 8, False)
    out_ptr = runner.static_output(key).data_ptr()
    outs = []
    for seed, (qlens, ctxs, tables) in enumerate(
        (([3, 3], [2, 9], [[1, 2], [4, 6, 9]]), ([5, 2], [0, 1], [[1, 2], [3]]))
    ):
        inp = make_inputs(qlens, ctxs, tables, seed=seed)
        assert runner.bucket_for(inp) == key
        layer.calls.clear()
        outs.append(runner.run(inp))
        assert outs[-1].data_ptr() == out_ptr  # a view of the one static output
        # the stand-in replays the closure on the static inputs; a CUDA graph replays without calling it
        assert [c is runner.graphs[key].static for c in layer.calls] == ([True] if DEVICE.type == "cpu" else [])
    assert runner.stats()["by_bucket"] == {"2x8": 2}


def test_steps_beyond_the_buckets_run_eagerly():
    layer = InvariantLayer()
    runner = make_runner(layer, buckets=((1, 1), (2, 4)))
    inp = make_inputs([3, 3], [1, 2], [[1], [2, 3]], seed=3)  # 6 tokens > 4
    layer.calls.clear()
    out = runner.run(inp)
    assert layer.calls == [inp] and out.shape == (6, 50)
    s = runner.stats()
    assert (s["eager_steps"], s["replays"], s["graphs"]) == (1, 0, 3)  # 1x1, 2x4, 2x4+mask


def test_the_memory_bound_refuses_the_larger_buckets():
    def step(inp):
        return torch.zeros(inp.num_tokens, 1000, device=inp.input_ids.device)  # 4000 bytes a token

    full = make_runner(step, buckets=((1, 1), (1, 2), (2, 8)), masked=(False,), stand_in=True)
    per = {k: c.nbytes for k, c in full.graphs.items()}
    assert per[(1, 1, False)] < per[(1, 2, False)] < per[(2, 8, False)]
    bound = per[(1, 1, False)] + per[(1, 2, False)] + 1
    small = make_runner(step, buckets=((1, 1), (1, 2), (2, 8)), masked=(False,), pool_bytes=bound, stand_in=True)
    assert list(small.graphs) == [(1, 1, False), (1, 2, False)] and small.refused == [(2, 8, False)]
    assert small.used_bytes <= bound
    out = small.run(make_inputs([3], [0], [[1]]))  # 3 tokens: would have been the 2x8 bucket
    assert out.shape == (3, 1000) and small.stats()["eager_steps"] == 1
    assert "1 refused by the memory bound" in small.describe() and "2 captured" in small.describe()
    none = make_runner(step, buckets=((1, 1),), masked=(False,), pool_bytes=10, stand_in=True)  # buffers too big
    assert not none.graphs and none.refused == [(1, 1, False)]


def test_tuple_outputs_are_sliced_per_tensor():
    runner = make_runner(lambda inp: (inp.positions * 2, inp.input_ids[:, None].float()), buckets=((2, 4),))
    inp = make_inputs([2, 1], [3, 0], [[1, 2], [3]])
    a, b = runner.run(inp)
    assert a.tolist() == [6, 8, 0] and b.shape == (3, 1)


def test_the_model_forward_as_a_step():
    """The shared stories260K target's public forward (+ logits) as the step, with the Triton attention
    backend (interpreted here; a CUDA graph on a GPU): replayed rows == the eager step's (the fp32
    GEMMs see another row count, so within 1e-5 rather than bitwise), and the KV cache it writes likewise."""
    from conftest import TARGET

    from specd.model.attention import get_backend
    from specd.model.loader import load_model

    model = load_model(TARGET, DEVICE.type, "float32", with_tokenizer=False, progress=False).model
    cfg = model.cfg
    backend = get_backend("triton", DEVICE)

    def kv_cache():
        return torch.zeros(cfg.num_layers, 2, 12, BS, cfg.num_kv_heads, cfg.head_dim, device=DEVICE)

    caches = {"eager": kv_cache(), "graph": kv_cache()}

    def step_on(name):
        def step(inp):
            hidden = model.forward(inp.input_ids, inp.positions, caches[name], inp.to_metadata(BS), backend)
            return model.compute_logits(hidden)  # [T, vocab]

        return step

    runner = make_runner(step_on("graph"), buckets=((2, 8),), masked=(False,), max_blocks=3)
    prompt = make_inputs([5, 2], [0, 0], [[1, 2], [3]], vocab=cfg.vocab_size, seed=4)
    decode = make_inputs([1, 1], [5, 2], [[1, 2], [3]], vocab=cfg.vocab_size, seed=5)
    for inp in (prompt, decode):
        got = runner.run(inp).clone()
        want = step_on("eager")(inp)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(caches["graph"], caches["eager"], atol=1e-5, rtol=1e-5)
    assert runner.stats()["replays"] == 2 and "1 captured (2x8)" in runner.describe()


# ---------------------------------------------------------------------------------------------
# the device check's parts that run here
# ---------------------------------------------------------------------------------------------


def test_gpu_step_dry_run():
    """eval/gpu_step.py (the stages of eval/gpu_check.sh) on the CPU: every stage's smallest version
    (interpreted kernels, the stand-in graph, the shared pair) runs and its checks hold."""
    import subprocess
    import sys

    if DEVICE.type == "cuda":
        pytest.skip("the dry run is for machines without a GPU")
    r = subprocess.run([sys.executable, "-m", "eval.gpu_step", "all", "--dry-run"], capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for stage in ("kernels", "graphs", "identity", "speed", "shape8b"):
        assert f"dry run OK: {stage}" in r.stdout
    assert "kernels: invariant rows bitwise across row counts" in r.stdout
    assert "graphs: replay == eager" in r.stdout
    assert "invariant engine's attention: invariant(" in r.stdout
    assert "| 2 | ngram | 2/2 | 2/2 |" in r.stdout  # identity table: batch 2, prompt lookup == plain


def test_gpu_check_script_prelude(tmp_path):
    """eval/gpu_check.sh parses, and with no stage to run it finds the shared data and falls back to the
    demo pair when the built-in GGUF it is given fails its sha256 (a fake python stands in for CUDA's)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "eval", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'case "$2" in *"assert torch.cuda.is_available()"*) exit 0;; *get_device_name*) echo fake; exit 0;; esac\n'
        f'exec {os.environ.get("PYTHON", __import__("sys").executable)} "$@"\n'
    )
    fake.chmod(0o755)
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not the model")
    env = dict(os.environ, PY=str(fake), GPU_CHECK_STAGES="none", SPECD_GGUF=str(bad), GPU_CHECK_OUT=str(tmp_path),
               SPECD_SHARED=str(tmp_path))  # fmt: skip
    (tmp_path / "data" / "spec_bench").mkdir(parents=True)
    (tmp_path / "data" / "spec_bench" / "question.jsonl").write_text("{}\n")
    r = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"== shared data: {tmp_path}; prompts: {tmp_path}/data/spec_bench/question.jsonl" in r.stdout
    assert "== built-in model not found" in r.stdout and "the demo pair" in r.stdout


# ---------------------------------------------------------------------------------------------
# per-token rows (a feature head's hidden inputs) and the engine's GraphedModel
# ---------------------------------------------------------------------------------------------


def test_per_token_rows_are_copied_padded_and_bucketed_by_width():
    cfg = GraphConfig(buckets=((2, 4),), max_blocks=4, block_size=BS, row_width=3)
    static = static_inputs((2, 4, False), cfg, DEVICE)
    assert static.rows.shape == (4, 3) and static.rows.dtype == torch.float32
    inp = make_inputs([2, 1], [3, 0], [[1, 2], [3]])
    rows = torch.arange(9, dtype=torch.float32, device=DEVICE).view(3, 3) + 1
    static.rows.fill_(7.0)
    fill(static, StepInputs(**{**inp.__dict__, "rows": rows}), cfg.pad_slot)
    assert static.rows.tolist() == rows.tolist() + [[0.0, 0.0, 0.0]]
    runner = make_runner(lambda i: i.rows * 2, buckets=((2, 4),), masked=(False,), row_width=3)
    assert runner.bucket_for(StepInputs(**{**inp.__dict__, "rows": rows})) == (2, 4, False)
    assert runner.bucket_for(inp) is None  # no rows where the graph takes them: eager
    assert runner.bucket_for(StepInputs(**{**inp.__dict__, "rows": rows[:, :2]})) is None  # another width
    assert runner.run(StepInputs(**{**inp.__dict__, "rows": rows})).tolist() == (rows * 2).tolist()


def test_step_inputs_of_a_model_call_share_its_tensors():
    from specd.model.attention import build_metadata

    meta = build_metadata([2, 1], [3, 0], [[1, 2], [3]], [13, 14, 12], BS, DEVICE)
    ids, pos = torch.tensor([5, 6, 7], device=DEVICE), torch.tensor([3, 4, 0], device=DEVICE)
    inp = StepInputs.of(ids, pos, meta)
    assert inp.input_ids is ids and inp.slot_mapping is meta.slot_mapping and inp.block_tables is meta.block_tables
    assert (inp.num_seqs, inp.num_tokens, inp.max_query_len, inp.max_seq_len, inp.rows) == (2, 3, 2, 5, None)


class _SpyModel:
    """A model's call signature, recording calls; rows = positions * 10 (+ features: positions + layer)."""

    cfg = "the model's cfg"

    def __init__(self):
        self.calls = []

    def __call__(self, ids, pos, kv, meta, backend=None, capture=None, ops=None):
        self.calls.append((kv, ops))
        if capture is not None:
            for i in capture:
                capture[i] = (pos + i).float()[:, None]
        return (pos * 10).float()[:, None]

    def compute_logits(self, hidden, **kw):
        return hidden + 1


def test_a_graphed_model_replays_its_variants_and_runs_anything_else_eagerly():
    from specd.model import invariant
    from specd.model.graphs import GraphedModel

    model, kv, other_kv = _SpyModel(), torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    graphed = GraphedModel(model, kv, "backend", BS)
    cfg = GraphConfig(buckets=((2, 4),), max_blocks=4, block_size=BS, masked=(False,))
    inv = invariant.InvariantOps(True, devices=(DEVICE.type,))
    graphed.add(invariant.OFF, (), cfg, RecordedGraph)
    graphed.add(inv, (1, 3), cfg, RecordedGraph)
    inp = make_inputs([2, 1], [3, 0], [[1, 2], [3]])
    meta = inp.to_metadata(BS)
    model.calls.clear()
    assert graphed(inp.input_ids, inp.positions, kv, meta, "backend").tolist() == [[30.0], [40.0], [0.0]]
    caps = {1: None, 3: None}
    out = graphed(inp.input_ids, inp.positions, kv, meta, "backend", capture=caps, ops=inv)
    assert out.tolist() == [[30.0], [40.0], [0.0]] and caps[3].tolist() == [[6.0], [7.0], [3.0]]
    assert [ops for _, ops in model.calls] == [invariant.OFF, inv]  # the stand-in replays each variant's closure
    stats = {k: r.stats()["replays"] for k, r in graphed.runners.items()}
    assert stats == {(invariant.OFF, ()): 1, (inv, (1, 3)): 1}
    model.calls.clear()
    graphed(inp.input_ids, inp.positions, other_kv, meta, "backend")  # another cache (a cost probe): eager
    graphed(inp.input_ids, inp.positions, kv, meta, "another backend")
    graphed(inp.input_ids, inp.positions, kv, meta, "backend", capture={2: None})  # a variant not captured
    assert [c[0] is other_kv for c in model.calls] == [True, False, False]
    assert sum(r.stats()["replays"] for r in graphed.runners.values()) == 2
    assert graphed.cfg == "the model's cfg" and graphed.compute_logits(torch.ones(1)).tolist() == [2.0]
