"""The engine's forwards through the graph runner (``--cuda-graphs``, ``specd.engine.step_graphs``):
the target's step (decode rows, chains and tree verification), the draft model's and the feature
head's forwards, captured when the engine is built, replayed per step, eager outside the buckets.

On a CPU the stand-in graph (``specd.model.graphs.RecordedGraph``: the closure recorded at capture
and replayed on the same static buffers; here strict: a capture whose forward reads a tensor on the
host fails, as a CUDA capture would) takes the place of CUDA graphs through the engine's test hook
``step_graphs.STAND_IN``; the engine runs the Triton backend under the interpreter (padded rows past
the last request, as on CUDA). Small buckets (batch 2, 16 target tokens, 8 draft rows, contexts to
64 tokens) keep the interpreted captures few. On a GPU the same tests build CUDA engines whose
start-up captures real CUDA graphs (eval/gpu_check.sh, graphs stage).

Shown: greedy output through the graphs == the eager engine's, token for token, for plain decoding,
chain and tree verification, the draft model and the feature head; with the batch-invariant kernels
(forced onto CPU tensors) the invariant variant is the one captured and replayed, and speculative
output through it == plain output through it; replays, eager steps and padding counted per forward
and reported in the engine snapshot and ``/metrics``; a CPU engine takes no graphs unless asked, and
``on`` refuses there, saying why.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import specd_kernels as sk  # noqa: E402
from specd.config import EngineConfig, SchedulerConfig, SpecConfig  # noqa: E402
from specd.engine import step_graphs  # noqa: E402
from specd.engine.client import snapshot_of  # noqa: E402
from specd.engine.engine import Engine  # noqa: E402
from specd.engine.sequence import SpecParams  # noqa: E402
from specd.model.graphs import GraphedModel, RecordedGraph  # noqa: E402
from specd.model.loader import LoadError  # noqa: E402
from specd.sampling.params import SamplingParams  # noqa: E402
from tests.conftest import DRAFT, TARGET  # noqa: E402

pytestmark = pytest.mark.timeout(900)
PROMPTS = ("Once upon a time, there was a little", "The cat and the dog")
# 8 tokens: the first prompt's 10 + 8 cross a 16-token KV block (each step under the interpreter costs ~1 s)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SPEC = dict(adaptive=False, tree_budget=5, tree_topk=2, tree_depth=3, num_draft_tokens=3)
# on a GPU the same tests run real CUDA graphs of compiled kernels (eval/gpu_check.sh's graphs stage)
DEVICE = torch.device("cuda" if (torch.cuda.is_available() and not sk.interpreting()) else "cpu")


class StrictGraph(RecordedGraph):
    """The stand-in graph, failing a capture whose closure reads a tensor's values on the host (a CUDA
    capture would fail on the sync, or bake in a value of the capture's padding-only step)."""

    READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")

    def capture(self, fn):
        saved = {n: getattr(torch.Tensor, n) for n in self.READS}

        def refuse(name):
            def read(t, *a, **kw):
                raise AssertionError(f"a captured forward reads a tensor on the host (Tensor.{name})")

            return read

        try:
            for n in self.READS:
                setattr(torch.Tensor, n, refuse(n))
            return super().capture(fn)
        finally:
            for n, f in saved.items():
                setattr(torch.Tensor, n, f)


def test_the_strict_stand_in_sees_host_reads():
    with pytest.raises(AssertionError, match=r"Tensor.item"):
        StrictGraph().capture(lambda: torch.ones(2) * torch.ones(2).sum().item())
    with pytest.raises(AssertionError, match=r"Tensor.__bool__"):
        StrictGraph().capture(lambda: torch.ones(2) if torch.ones(1) > 0 else None)
    assert StrictGraph().capture(lambda: torch.ones(2) * 3).tolist() == [3.0, 3.0]  # (restored afterwards)


@pytest.fixture
def stand_in(monkeypatch):
    """Engines built in this test capture at small buckets (with the CPU stand-in where there is no GPU)."""
    pytest.importorskip("triton")
    for name, value in (("GRAPH_MAX_BATCH", 2), ("GRAPH_MAX_TOKENS", 16), ("DRAFT_MAX_TOKENS", 8),
                        ("GRAPH_MAX_CONTEXT", 64)):  # fmt: skip
        monkeypatch.setattr(step_graphs, name, value)
    if DEVICE.type == "cpu":
        monkeypatch.setattr(step_graphs, "STAND_IN", StrictGraph)


@pytest.fixture(scope="module")
def pair(shared_pair):
    """The shared stories260K pair on the test's device (fp32)."""
    if DEVICE.type == "cpu":
        return shared_pair
    from specd.model.loader import load_model

    return load_model(TARGET, "cuda", "float32"), load_model(DRAFT, "cuda", "float32")


def engine(pair, graphs: str, head=None, max_seqs: int = 2, **spec) -> Engine:
    target, draft = pair
    cfg = EngineConfig(
        target=str(TARGET), draft=None if head else str(DRAFT), head=head, dtype="float32",
        device=str(target.device.type), attention_backend="triton", cuda_graphs=graphs,
        spec=SpecConfig(**{**SPEC, **spec}),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=256),
    )  # fmt: skip
    return Engine(cfg, target=target, draft=None if head else draft)


def prompts(eng: Engine) -> list:
    return [eng.tokenizer(p)["input_ids"] for p in PROMPTS]


def run(eng: Engine, mode: str, ps=None, params=GREEDY) -> list:
    return [s.output_ids for s in eng.generate(ps or prompts(eng), params, SpecParams(mode=mode))]


@pytest.fixture(scope="module")
def eager_outputs(pair):
    """The eager Triton engine's greedy outputs per mode (what the graphs must reproduce)."""
    eng = engine(pair, "off")
    assert not isinstance(eng.target.model, GraphedModel) and eng.drafter.graphs is None
    return {mode: run(eng, mode) for mode in ("off", "chain", "tree")}


def test_the_target_step_and_the_draft_model_replay_token_identically(pair, eager_outputs, stand_in):
    eng = engine(pair, "auto")
    assert isinstance(eng.target.model, GraphedModel) and eng.drafter.graphs is not None
    runners = eng.target.model.runners  # (CUDA, batch_invariant auto: the invariant and the cuBLAS variant)
    assert {ops.enabled for ops, _ in runners} == ({False} if DEVICE.type == "cpu" else {True, False})
    assert all(layers == () and r.stats()["graphs"] == 16 for (_, layers), r in runners.items())  # 9 + 7 masked
    assert eng.drafter.graphs.stats()["graphs"] == 12  # 7 + 5 masked
    before = snapshot_of(eng).graphs
    assert before["target"]["replays"] == before["draft"]["replays"] == 0
    seen = {}
    for mode in ("off", "chain", "tree"):
        assert run(eng, mode) == eager_outputs[mode], mode
        seen[mode] = snapshot_of(eng).graphs
    t_off, t_chain, t_tree = (seen[m]["target"] for m in ("off", "chain", "tree"))
    assert t_off["replays"] > 0 and t_off["eager_steps"] > 0  # decode rows replayed; the 2-prompt prefill (>16) eager
    assert set(t_off["by_bucket"]) == {"2x2"}  # plain decoding of two requests: the 2x2 bucket only
    assert seen["off"]["draft"]["replays"] == 0  # no drafting without speculation
    assert t_chain["replays"] > t_off["replays"] and seen["chain"]["draft"]["replays"] > 0
    masked = {k for k in t_tree["by_bucket"] if k.endswith("+mask")}
    assert masked and not {k for k in t_chain["by_bucket"] if k.endswith("+mask")}  # trees, and only trees, masked
    assert seen["tree"]["draft"]["by_bucket"] != seen["chain"]["draft"]["by_bucket"]
    assert t_tree["padded_tokens"] > 0  # 2 x (1 + up to 5 nodes) in a 2x16 bucket
    assert eng.kv_blocks_used() == (0, 0)


def test_steps_beyond_the_buckets_run_eagerly_with_the_same_output(pair, eager_outputs, stand_in):
    """Three requests decoding together (the buckets hold two): every step eager, the output unchanged."""
    eager = engine(pair, "off", max_seqs=4)
    graphed = engine(pair, "auto", max_seqs=4)
    ps = prompts(graphed) + [graphed.tokenizer("Tom had a big red ball")["input_ids"]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)  # (every step alike: a few show it)
    assert run(graphed, "off", ps, params) == run(eager, "off", ps, params)
    s = snapshot_of(graphed).graphs["target"]
    assert (s["replays"], s["eager_steps"]) == (0, graphed.num_steps) and graphed.num_steps >= params.max_tokens


def test_the_feature_head_and_the_target_features_replay_token_identically(pair, stand_in, tmp_path):
    """A (random) feature head: the target's captured variant returns the features the head reads,
    the head's levels replay with their hidden inputs as static rows."""
    from specd.model.head_files import save_head
    from specd.training.head import new_head

    torch.manual_seed(0)
    save_head(new_head(pair[0], torch.arange(256)), tmp_path, {"test": True}, dtype=torch.float32)
    want = run(engine(pair, "off", head=str(tmp_path), mode="head"), "head")
    eng = engine(pair, "auto", head=str(tmp_path), mode="head")
    layers = next(iter(eng.target.model.runners))[1]
    assert layers == tuple(eng.drafter.capture)
    assert eng.drafter.graphs.cfg.row_width == eng.drafter.model.cfg.hidden_size
    assert run(eng, "head") == want
    s = snapshot_of(eng).graphs
    assert s["target"]["replays"] > 0 and s["draft"]["replays"] > 0
    assert eng.stats.draft_tokens > 0


def test_a_cpu_engine_takes_no_graphs_unless_asked_and_on_refuses(shared_pair):
    eng = engine(shared_pair, "auto")  # (no stand-in: a plain CPU engine)
    assert not isinstance(eng.target.model, GraphedModel) and eng.drafter.graphs is None
    assert snapshot_of(eng).graphs == {}
    with pytest.raises(LoadError, match="--cuda-graphs on: they need a CUDA device"):
        engine(shared_pair, "on")
    with pytest.raises(ValueError, match="cuda_graphs must be auto|on|off"):
        EngineConfig(target="x", cuda_graphs="yes")


def test_the_graph_counters_reach_metrics():
    from types import SimpleNamespace

    from specd.engine.commands import EngineSnapshot
    from specd.serving.metrics import _graph_metrics, _Text

    out = _Text({})
    stats = {"graphs": 18, "refused": 2, "memory_bytes": 4096, "capture_s": 1.5, "replays": 7, "eager_steps": 3,
             "padded_tokens": 11, "by_bucket": {"2x2": 7}}  # fmt: skip
    _graph_metrics(out, EngineSnapshot(graphs={"target": stats, "draft": dict(stats, replays=5)}).graphs)
    text = "\n".join(out.lines)
    assert 'specd_cuda_graph_replays_total{forward="target"} 7' in text
    assert 'specd_cuda_graph_replays_total{forward="draft"} 5' in text
    assert 'specd_cuda_graphs{forward="target"} 18' in text and 'specd_cuda_graphs_refused{forward="draft"} 2' in text
    assert 'specd_cuda_graph_eager_steps_total{forward="target"} 3' in text
    empty = _Text({})
    _graph_metrics(empty, SimpleNamespace(graphs={}).graphs)
    assert empty.lines == []


def test_the_flag_reaches_the_engine_config():
    from specd.options import engine_config, serve_parser

    assert engine_config(serve_parser().parse_args([])).cuda_graphs == "auto"
    assert engine_config(serve_parser().parse_args(["--cuda-graphs", "off"])).cuda_graphs == "off"


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random Llama (2 layers, hidden 64, vocabulary 128; saved by transformers, loaded by
    specd) op by op, as a bf16 model runs on a GPU, as target and as its own draft."""
    from specd.model.loader import load_model
    from tests.conftest import tiny_llama_folder

    path = tiny_llama_folder(tmp_path_factory)
    pair = []
    for _ in range(2):
        lm = load_model(path, DEVICE.type, "float32", progress=False, with_tokenizer=False)
        lm.model.FOLD_MAX_HIDDEN, lm.model._flat = 0, None
        pair.append(lm)
    return tuple(pair)


def test_batch_invariant_steps_replay_their_own_variant_and_speculation_equals_plain(tiny_pair, stand_in, monkeypatch):
    """``--batch-invariant on`` with the invariant kernels forced onto CPU tensors (in production only
    CUDA tensors take them): the builder captures the invariant variant only, target steps within its
    buckets replay it (a wider tree step runs eagerly), and greedy chain / tree output through the
    graphs == plain output through them."""
    from specd.model import invariant

    if DEVICE.type == "cpu":
        monkeypatch.setattr(invariant, "ON", invariant.InvariantOps(True, devices=("cpu",)))
    target, draft = tiny_pair
    cfg = EngineConfig(target=str(target.path), draft=str(draft.path), dtype="float32", device=DEVICE.type,
                       attention_backend="triton", batch_invariant="on", spec=SpecConfig(**SPEC),
                       scheduler=SchedulerConfig(2))  # fmt: skip
    eng = Engine(cfg, target=target, draft=draft)
    ((ops, _),) = eng.target.model.runners
    assert ops == invariant.ON
    ps = [[5, 17, 33, 2, 90], [7, 7, 64]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = [s.output_ids for s in eng.generate(ps, params, SpecParams(mode="off"))]
    for mode in ("chain", "tree"):
        assert [s.output_ids for s in eng.generate(ps, params, SpecParams(mode=mode))] == plain, mode
    s = snapshot_of(eng).graphs
    assert s["target"]["replays"] > 0 and any(k.endswith("+mask") for k in s["target"]["by_bucket"])
    assert eng.stats.accepted_tokens > 0


def test_where_graphs_cannot_run_says_why(shared_pair, monkeypatch):
    from types import SimpleNamespace

    from specd.model.attention import TorchAttention, TritonAttention

    model, cpu = shared_pair[0].model, torch.device("cpu")
    pytest.importorskip("triton")
    triton = TritonAttention()
    assert "need a CUDA device" in step_graphs.refusal(model, cpu, triton, None)
    monkeypatch.setattr(step_graphs, "STAND_IN", RecordedGraph)  # (as if on CUDA)
    assert step_graphs.refusal(model, cpu, triton, None) is None
    assert "triton attention backend (not torch)" in step_graphs.refusal(model, cpu, TorchAttention(), None)
    assert "tensor-parallel" in step_graphs.refusal(model, cpu, triton, object())
    assert "has no captured forward" in step_graphs.refusal(SimpleNamespace(), cpu, triton, None)
    monkeypatch.setattr(model, "windows", (None, 32) + model.windows[2:])
    assert "sliding windows" in step_graphs.refusal(model, cpu, triton, None)
