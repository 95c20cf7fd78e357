"""The GPU step at its floor (issue 43): batch-invariant kernels, graphs, greedy identity, an 8B-shaped step.

    python -m eval.gpu_step kernels    # invariant GEMM / RMSNorm / attention vs cuBLAS / torch / tree attention:
                                       # time, GB/s, row 0 bitwise across row counts (Llama-3.1-8B shapes)
    python -m eval.gpu_step graphs     # the engine's target step as its start-up captured it (--cuda-graphs on:
                                       # GraphedModel, the logits after it): replay == the eager step on the same
                                       # padded inputs (bitwise), real rows vs the unpadded eager step (bitwise
                                       # with the invariant ops), step time eager vs replayed; cuBLAS and invariant
    python -m eval.gpu_step identity   # the engine, greedy: every speculative mode's tokens == plain's, per prompt,
                                       # batch 1 and 8, invariant kernels on and off
    python -m eval.gpu_step speed      # the engine's tokens/s: plain / auto / head / ngram at batch 1, 4, 16
    python -m eval.gpu_step shape8b    # a random-weight Llama-3.1-8B-shaped bf16 step (forward + logits) at 1, 8 and
                                       # 32 decode rows and a 33-node tree vs its bandwidth floor; eager / graph,
                                       # cuBLAS / invariant
    python -m eval.gpu_step all        # each of them in turn

``--dry-run``: the smallest version of a stage on the CPU (kernels under the Triton interpreter, the
stand-in graph, the shared stories260K pair), no timings worth reading: it checks that the script
runs where there is no GPU (tests/test_graphs.py runs it).

Invariant ops in the model: the engine stages (identity, speed) use the engine's own setting
(``EngineConfig.batch_invariant``: the target pass hands ``specd.model.invariant``'s ops to
``LlamaModel.forward`` / ``compute_logits`` on CUDA) and its CUDA graphs (``--cuda-graphs``, buckets
up to ``--graph-tokens``); the graphs stage calls the engine's captured target with each ops variant,
the shape8b stage passes the ops to the forward itself (``model_step(..., ops)``); in a dry run they
are forced onto CPU tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPECD_SHARED", ROOT.parent / "shared"))
STAGES = ("kernels", "graphs", "identity", "speed", "shape8b")
DRY = "--dry-run" in sys.argv[1:]
LLAMA_8B = dict(
    architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=131072, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)  # fmt: skip
TINY = dict(LLAMA_8B, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------


def median_s(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, wall time elsewhere); a dry run: one call."""
    if DRY:
        warmup, iters = 0, 1
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(dev) -> float:
    """Bytes/s of a device-to-device copy (bytes read + written), the floor's ceiling."""
    n = (1 << 28) if dev.type == "cuda" else (1 << 22)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return 2 * n / median_s(lambda: b.copy_(a), 2, 10)


def table(header: list, rows: list) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    print(flush=True)


def us(s: float) -> str:
    return f"{s * 1e6:.1f}"


def ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


# ---------------------------------------------------------------------------------------------
# invariant ops for the model's forward (specd.model.invariant)
# ---------------------------------------------------------------------------------------------


def invariant_ops(dev):
    """The invariant ops on ``dev``'s tensors (CUDA; a dry run forces them onto the CPU)."""
    from specd.model.invariant import InvariantOps

    return InvariantOps(True, devices=(dev.type,))


def plain_ops():
    from specd.model.invariant import OFF

    return OFF


# ---------------------------------------------------------------------------------------------
# steps over a paged cache
# ---------------------------------------------------------------------------------------------


def ancestor_mask(parents: list) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j], j = True, parents[j]
    return m


def step_inputs(qlens, ctxs, block_size: int, dev, *, tree: bool = False, vocab: int = 1000, seed: int = 0):
    """``StepInputs`` of ``len(qlens)`` requests laid out in consecutive blocks from block 1: request b
    has ``ctxs[b]`` cached tokens and ``qlens[b]`` new ones, causal or (``tree``) a random tree whose
    node i sits at position ctx + depth(i), slot ctx + i."""
    from specd.model.graphs import StepInputs

    g = torch.Generator().manual_seed(seed)
    pos, slots, tables, masks, nxt = [], [], [], [], 1
    for q, c in zip(qlens, ctxs):
        nb = -(-(c + q) // block_size)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, q)] if tree else None
        depth = [0] * q
        for i in range(1, q):
            depth[i] = depth[parents[i]] + 1 if tree else i
        pos += [c + d for d in depth]
        slots += [tables[-1][(c + i) // block_size] * block_size + (c + i) % block_size for i in range(q)]
        masks.append(ancestor_mask(parents) if tree else None)
    T, W = sum(qlens), max(len(t) for t in tables)
    mask = None
    if tree:
        mask = torch.zeros(T, max(qlens), dtype=torch.bool)
        row = 0
        for q, m in zip(qlens, masks):
            mask[row : row + q, :q] = m
            row += q
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    i32 = dict(dtype=torch.int32, device=dev)
    return StepInputs(
        input_ids=torch.randint(1, vocab, (T,), generator=g).to(dev), positions=torch.tensor(pos, device=dev),
        slot_mapping=torch.tensor(slots, device=dev), query_start_loc=torch.tensor(qsl, **i32),
        context_lens=torch.tensor(list(ctxs), **i32),
        seq_lens=torch.tensor([c + q for c, q in zip(ctxs, qlens)], **i32),
        block_tables=torch.tensor([t + [0] * (W - len(t)) for t in tables], **i32),
        tree_mask=None if mask is None else mask.to(dev), max_query_len=max(qlens),
        max_seq_len=max(c + q for c, q in zip(ctxs, qlens)),
    )  # fmt: skip


def blocks_needed(qlens, ctxs, block_size: int) -> int:
    return 1 + sum(-(-(c + q) // block_size) for q, c in zip(qlens, ctxs))


def random_cache(cfg, num_blocks: int, block_size: int, dtype, dev) -> torch.Tensor:
    """[layers, 2, blocks, block_size, KV heads, head_dim] of random keys and values."""
    shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return torch.randn(shape, dtype=dtype, device=dev)


def model_step(model, kv, backend, block_size: int, ops=None):
    """The closure a graph captures: forward + logits of every row -> [T, vocab] fp32, through ``ops``
    (``specd.model.invariant.InvariantOps``; None: the ordinary ops). A graph bakes in its ops: one
    capture per ops setting."""
    ops = ops if ops is not None else plain_ops()

    def step(inp):
        hidden = model.forward(inp.input_ids, inp.positions, kv, inp.to_metadata(block_size), backend, ops=ops)
        return model.compute_logits(hidden, ops=ops)

    return step


def device_and_dtype(a):
    if a.dry_run:
        return torch.device("cpu"), torch.float32
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --dry-run")
    return torch.device("cuda"), torch.bfloat16


# ---------------------------------------------------------------------------------------------
# stage: kernels
# ---------------------------------------------------------------------------------------------

GEMMS_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
            "lm_head": (128256, 4096)}  # fmt: skip


def gemm_rows(a, dev, dtype) -> list:
    """Per GEMM and row count: cuBLAS vs the invariant GEMM (us), the invariant's weight GB/s, and
    whether row 0 keeps its bits between 1 row and the largest row count (invariant / cuBLAS)."""
    from specd_kernels import batch_invariant as bi

    shapes = {"proj": (48, 64), "lm_head": (300, 64)} if a.dry_run else GEMMS_8B
    counts = (1, 3) if a.dry_run else (1, 8, 32)
    out = []
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, dtype=dtype) * K**-0.5
        x = torch.randn(max(counts), K, device=dev, dtype=dtype)
        inv_bits = torch.equal(bi.matmul(x[:1], w)[0], bi.matmul(x, w)[0])
        cub_bits = torch.equal(F.linear(x[:1], w)[0], F.linear(x, w)[0])
        for m in counts:
            xm = x[:m].contiguous()
            t_c = median_s(lambda xm=xm, w=w: F.linear(xm, w), 3, a.iters)
            t_i = median_s(lambda xm=xm, w=w: bi.matmul(xm, w), 3, a.iters)
            out.append((name, f"{N}x{K}", m, us(t_c), us(t_i), f"{t_c / t_i:.2f}",
                        f"{N * K * w.element_size() / t_i / 1e9:.0f}", f"{inv_bits} / {cub_bits}"))  # fmt: skip
    return out


def attention_rows(a, dev, dtype) -> list:
    """The invariant attention vs the tree-attention kernel on 8B heads (32 / 8, D 128), block 16."""
    import specd_kernels as sk
    from specd_kernels import batch_invariant as bi

    H, KVH, D, bs = (4, 2, 16, 16) if a.dry_run else (32, 8, 128, 16)
    ctx = 40 if a.dry_run else 2048
    out = []
    for B, q, tree in ((1, 1, False), (1, 33 if not a.dry_run else 5, True), (8 if not a.dry_run else 2, 1, False)):
        inp = step_inputs([q] * B, [ctx] * B, bs, dev, tree=tree)
        kv = torch.randn(2, blocks_needed([q] * B, [ctx] * B, bs), bs, KVH, D, device=dev, dtype=dtype)
        qt = torch.randn(inp.num_tokens, H, D, device=dev, dtype=dtype)
        args = (qt, kv, inp.query_start_loc, inp.context_lens, inp.seq_lens, inp.block_tables, inp.tree_mask, D**-0.5)
        t_ta = median_s(
            lambda args=args, inp=inp: sk.tree_attention(*args, inp.max_query_len, inp.max_seq_len), 3, a.iters
        )
        t_bi = median_s(lambda args=args: bi.attention(*args), 3, a.iters)
        diff = bi.attention(*args).float() - sk.tree_attention(*args, inp.max_query_len, inp.max_seq_len).float()
        out.append((f"B={B} q={q}{' tree' if tree else ''} ctx={ctx}", us(t_ta), us(t_bi), f"{t_ta / t_bi:.2f}",
                    f"{diff.abs().max().item():.2e}"))  # fmt: skip
    return out


def stage_kernels(a) -> int:
    from specd_kernels import batch_invariant as bi

    dev, dtype = device_and_dtype(a)
    print(f"## batch-invariant kernels ({dev.type}, {str(dtype).removeprefix('torch.')}, median of {a.iters})\n")
    rows = gemm_rows(a, dev, dtype)
    table(["GEMM", "N x K", "rows", "cuBLAS us", "invariant us", "speed vs cuBLAS", "invariant GB/s",
           "row 0 bitwise 1 vs max rows (inv / cuBLAS)"], rows)  # fmt: skip
    one = [r for r in rows if r[2] == 1]
    if one and not a.dry_run:  # a decode step's GEMMs at batch 1: 32 layers of 4 + the head
        per = {r[0]: (float(r[3]), float(r[4])) for r in one}
        tot = [sum(per[n][i] * (1 if n == "lm_head" else 32) for n in per) for i in (0, 1)]
        print(f"8B decode step's GEMMs at batch 1: cuBLAS {tot[0] / 1e3:.2f} ms, invariant {tot[1] / 1e3:.2f} ms "
              f"= {tot[0] / tot[1]:.2f}x cuBLAS's speed (goal >= 0.8x)\n")  # fmt: skip
    D = 64 if a.dry_run else 4096
    w = torch.randn(D, device=dev, dtype=dtype)
    norm_rows = []
    for m in (1, 32):
        x = torch.randn(m, D, device=dev, dtype=dtype)
        t_t = median_s(lambda x=x: F.rms_norm(x.float(), (D,), w.float(), 1e-5).to(dtype), 3, a.iters)
        t_i = median_s(lambda x=x: bi.rms_norm(x, w, 1e-5), 3, a.iters)
        bits = torch.equal(bi.rms_norm(x[:1], w, 1e-5)[0], bi.rms_norm(x, w, 1e-5)[0])
        norm_rows.append((D, m, us(t_t), us(t_i), bits))
    table(["RMSNorm D", "rows", "torch (fp32) us", "invariant us", "row 0 bitwise"], norm_rows)
    table(["attention", "tree_attention us", "invariant us", "speed vs tree_attention", "max |diff|"],
          attention_rows(a, dev, dtype))  # fmt: skip
    bad = [r for r in rows if not r[7].startswith("True")] + [r for r in norm_rows if not r[4]]
    print("kernels: invariant rows bitwise across row counts" if not bad else f"kernels: NOT invariant: {bad}")
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------
# stage: graphs
# ---------------------------------------------------------------------------------------------


def load_target(a, dev, dtype):
    """The stage's model: ``--target`` (bf16 on CUDA), the shared stories260K model in a dry run."""
    from specd.model.loader import load_model

    path = SHARED / "models" / "stories260K" if a.dry_run else a.target
    lm = load_model(path, dev.type, str(dtype).removeprefix("torch."), progress=False, with_tokenizer=False)
    if a.dry_run:  # op by op, as a bf16 model on a GPU runs (the folded fp32 path bypasses linear / addmm)
        lm.model.FOLD_MAX_HIDDEN = 0
    return lm


def graph_cases(a) -> list:
    """(name, qlens, ctxs, tree) of the steps the graphs stage replays."""
    if a.dry_run:
        return [("decode B=2", [1, 1], [9, 4], False), ("tree 5", [5], [9], True)]
    c = a.context
    return [("decode B=1", [1], [c], False), ("decode B=4", [1] * 4, [c] * 4, False),
            ("decode B=16", [1] * 16, [c] * 16, False), ("tree 33, B=1", [33], [c], True),
            ("tree 17, B=4", [17] * 4, [c] * 4, True)]  # fmt: skip


def small_graphs(a) -> None:
    """The engine's graph buckets for the identity / speed stages (``--graph-tokens``: each engine's
    start-up captures one graph per bucket); in a dry run the CPU stand-in graph and a few small
    buckets (interpreted kernels)."""
    from specd.engine import step_graphs
    from specd.model.graphs import RecordedGraph

    step_graphs.GRAPH_MAX_TOKENS = min(step_graphs.GRAPH_MAX_TOKENS, a.graph_tokens)
    step_graphs.DRAFT_MAX_TOKENS = min(step_graphs.DRAFT_MAX_TOKENS, a.graph_tokens)
    if a.dry_run:
        step_graphs.STAND_IN, step_graphs.GRAPH_MAX_BATCH, step_graphs.GRAPH_MAX_CONTEXT = RecordedGraph, 2, 64


def graph_engine(a, lm, need_blocks: int):
    """The engine whose start-up captures the target's step (``--cuda-graphs on``, the default buckets,
    ``batch_invariant auto``: the cuBLAS and the invariant variant), its KV cache random."""
    from specd.config import CacheConfig, EngineConfig, SchedulerConfig
    from specd.engine.engine import Engine
    from specd.model.graphs import RecordedGraph

    if a.dry_run:
        small_graphs(a)
    cfg = EngineConfig(target=str(lm.path), device=str(lm.device), attention_backend="triton", cuda_graphs="on",
                       batch_invariant="auto", cache=CacheConfig(num_blocks=need_blocks),
                       scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256))  # fmt: skip
    engine = Engine(cfg, target=lm)
    engine.cache.kv.normal_()
    if a.dry_run:  # (no CUDA: the builder captured the cuBLAS variant only; the invariant one forced, at the
        graphed = engine.target.model  # cases' buckets: an interpreted invariant forward takes seconds)
        cfg0 = next(iter(graphed.runners.values())).cfg
        graphed.add(invariant_ops(lm.device), (), dataclasses.replace(cfg0, buckets=((2, 2), (1, 8))), RecordedGraph)
    return engine


def graph_rows(a, engine, ops, dev) -> list:
    """Each case through the engine's captured target (``GraphedModel``, then the logits eagerly, as
    the target pass runs it) against the model run eagerly: the same padded inputs (bitwise), the real
    unpadded step, and the time of both."""
    graphed = engine.target.model
    model, kv, backend, bs = graphed.model, engine.cache.kv, engine.backend, engine.cache.block_size
    runner = graphed.runners[(ops, ())]
    kw = {"ops": ops}

    def eager(inp):
        return model.compute_logits(model(inp.input_ids, inp.positions, kv, inp.to_metadata(bs), backend, **kw), **kw)

    def replay(inp):
        return model.compute_logits(graphed(inp.input_ids, inp.positions, kv, inp.to_metadata(bs), backend, **kw), **kw)

    rows = []
    for name, q, c, tree in graph_cases(a):
        inp = step_inputs(q, c, bs, dev, tree=tree, vocab=model.cfg.vocab_size)
        key = runner.bucket_for(inp)
        got = replay(inp).clone()
        same = eager(runner.graphs[key].static)[: inp.num_tokens] if key else got
        real = eager(inp)
        t_e = median_s(lambda inp=inp: eager(inp), 2, a.iters)
        t_g = median_s(lambda inp=inp: replay(inp), 2, a.iters)
        rows.append((name, "eager" if key is None else f"{key[0]}x{key[1]}{'+mask' if key[2] else ''}",
                     torch.equal(got, same), torch.equal(got, real), f"{(got - real).abs().max().item():.2e}",
                     f"{(got.argmax(-1) == real.argmax(-1)).float().mean().item():.3f}", ms(t_e), ms(t_g),
                     f"{t_e / t_g:.1f}x"))  # fmt: skip
    return rows


def stage_graphs(a) -> int:
    dev, dtype = device_and_dtype(a)
    lm = load_target(a, dev, dtype)
    need = max(blocks_needed(q, c, 16) for _, q, c, _ in graph_cases(a)) + 1
    engine = graph_engine(a, lm, need)
    for line in engine_graph_lines(engine):
        print(line, flush=True)
    bad = 0
    for label, ops in (("cuBLAS + tree attention", plain_ops()), ("invariant ops", invariant_ops(dev))):
        print(f"\n## graphs: the engine's target step, {lm.path.name} {str(dtype).removeprefix('torch.')} on "
              f"{dev.type}, {label}\n")  # fmt: skip
        rows = graph_rows(a, engine, ops, dev)
        table(["step", "bucket", "replay == eager, same padded inputs", "replay == eager unpadded (bitwise)",
               "max |replay - eager unpadded|", "argmax agree", "eager ms", "graph ms", "speedup"], rows)  # fmt: skip
        bad += sum(not r[2] for r in rows) + (sum(not r[3] for r in rows) if ops.enabled else 0)
    print("graphs: replay == eager" if not bad else f"graphs: {bad} mismatches")
    return 1 if bad else 0


def engine_graph_lines(engine) -> list:
    """The engine's captured target runners, one line each (the builder logs the same)."""
    return [f"captured at start-up ({'invariant' if ops.enabled else 'default'} ops): {r.describe()}"
            for (ops, _), r in engine.target.model.runners.items()]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# stages: identity and speed (the engine)
# ---------------------------------------------------------------------------------------------


def engine_modes(a, has_head: bool) -> list:
    """(label, harness Mode, uses the head) of the speculative modes under test."""
    from eval.harness.modes import Mode

    if a.dry_run:
        return [("chain", Mode.parse("chain:3"), False), ("ngram", Mode.parse("ngram:4"), False)]
    out = [("chain", Mode.parse("chain:4"), False), ("tree", Mode.parse("tree:16"), False)]
    if has_head:
        out.append(("head", Mode.parse("tree:32"), True))
    return out + [("ngram", Mode.parse("ngram:8"), False), ("auto", Mode.parse("auto"), has_head)]


def build_engine(a, pair, mode, use_head: bool, invariant: str, batch: int):
    from specd.config import CacheConfig, EngineConfig, SchedulerConfig
    from specd.engine.engine import Engine

    target, draft = pair
    drafts = mode.kind not in ("off", "ngram")
    head = a.head if (drafts and use_head) else None
    use_draft = draft if (drafts and head is None) else None
    cfg = EngineConfig(
        target=str(target.path), draft=str(use_draft.path) if use_draft is not None else None, head=head,
        device=str(target.device), spec=mode.spec_config(), batch_invariant=invariant, cuda_graphs=a.cuda_graphs,
        scheduler=SchedulerConfig(max_num_seqs=max(batch, 1), enable_prefix_cache=False),
        cache=CacheConfig(memory_bytes=(64 << 20) if a.dry_run else (2 << 30)),
    )  # fmt: skip
    return Engine(cfg, target=target, draft=use_draft)  # (its target pass picks the ops by batch_invariant)


def generate_all(engine, ids_list: list, batch: int, max_tokens: int, mode) -> tuple:
    """(output ids per prompt, seconds, engine steps) of greedy runs in groups of ``batch``."""
    from specd.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs, t0, steps0 = [], time.perf_counter(), engine.num_steps
    for i in range(0, len(ids_list), batch):
        outs += [s.output_ids for s in engine.generate(ids_list[i : i + batch], params, mode.spec_params())]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return outs, time.perf_counter() - t0, engine.num_steps - steps0


def load_pair_and_prompts(a, dev, dtype, n: int, max_tokens: int) -> tuple:
    from eval import harness as H

    target = SHARED / "models" / "stories260K" if a.dry_run else a.target
    draft = SHARED / "models" / "stories260K-draft-1L64" if a.dry_run else a.draft
    pair = H.load_pair(target, draft, dev.type, str(dtype).removeprefix("torch."), "none")
    prompts = SHARED / "data" / "spec_bench" / "question.jsonl" if a.dry_run else a.prompts
    _, ids, _ = H.first_turns(prompts, pair[0], max_tokens, limit=n)
    return pair, ids


def identity_runs(a, pair, ids, setting: str, t_end: float) -> list:
    """Rows (setting, batch, mode, == plain same batch, == plain batch 1, tok/s) for one invariant
    setting; runs start only before ``t_end``."""
    from eval.harness.modes import Mode

    rows, ref1 = [], None
    for batch in a.batches:
        plain = Mode.parse("off")
        ref, secs, _ = generate_all(build_engine(a, pair, plain, False, setting, batch), ids, batch, a.max_tokens,
                                    plain)  # fmt: skip
        ref1 = ref if ref1 is None else ref1
        n = len(ids)
        rows.append((setting, batch, "plain", f"{n}/{n}", f"{sum(x == y for x, y in zip(ref, ref1))}/{n}",
                     f"{sum(map(len, ref)) / secs:.1f}"))  # fmt: skip
        for label, mode, use_head in engine_modes(a, a.head is not None):
            if time.perf_counter() > t_end:
                rows.append((setting, batch, label, "skipped (budget)", "", ""))
                continue
            engine = build_engine(a, pair, mode, use_head, setting, batch)
            outs, secs, _ = generate_all(engine, ids, batch, a.max_tokens, mode)
            same = sum(x == y for x, y in zip(outs, ref))
            rows.append((setting, batch, label, f"{same}/{n}", f"{sum(x == y for x, y in zip(outs, ref1))}/{n}",
                         f"{sum(map(len, outs)) / secs:.1f}"))  # fmt: skip
    return rows


def stage_identity(a) -> int:
    dev, dtype = device_and_dtype(a)
    if not a.dry_run:  # (a dry run's engines are eager: the graphs stage runs the stand-in)
        small_graphs(a)
    n, t_end = (2 if a.dry_run else a.num_prompts), time.perf_counter() + a.budget_s
    pair, ids = load_pair_and_prompts(a, dev, dtype, n, a.max_tokens)
    how = "the engine's own (batch_invariant)"
    print(f"## greedy identity: {pair[0].path.name} + {'head ' + str(a.head) if a.head else pair[1].path.name}, "
          f"{len(ids)} prompts x {a.max_tokens} tokens, {str(dtype).removeprefix('torch.')} on {dev.type}; "
          f"invariant kernels: {how}; CUDA graphs: {a.cuda_graphs} (steps to {a.graph_tokens} tokens)\n")  # fmt: skip
    rows = []
    for setting in a.settings:
        rows += identity_runs(a, pair, ids, setting, t_end)
    table(["batch_invariant", "batch", "mode", "== plain (same batch)", "== plain batch 1", "tok/s"], rows)
    if a.dry_run:
        print("invariant engine's attention:", engine_invariant_attention(a, pair))
    bad = [r for r in rows if r[0] == "on" and "/" in r[3] and (r[3].split("/")[0] != r[3].split("/")[1])]
    if "on" in a.settings:
        print("identity: every mode == plain with invariant kernels" if not bad else f"identity: {len(bad)} differ")
    return 1 if (bad and "on" in a.settings) else 0


def engine_invariant_attention(a, pair) -> str:
    """The attention an engine with ``batch_invariant on`` runs in a CUDA step with a greedy row: its
    target pass's ops (``stages.step_ops_kwargs``) wrapped around its backend (a dry run checks the
    wiring on the CPU, where no step takes the kernels)."""
    from eval.harness.modes import Mode
    from specd.engine.stages import step_ops_kwargs

    engine = build_engine(a, pair, Mode.parse("off"), False, "on", 1)
    ops = step_ops_kwargs(engine.target.model, torch.device("cuda"), engine.cfg.batch_invariant, True).get("ops")
    if ops is None:
        return f"{engine.backend.name} (the ordinary ops: NOT wired)"
    return f"{ops.backend(engine.backend).name} (target_pass on CUDA, batch_invariant on, a greedy row)"


def stage_speed(a) -> int:
    from eval.harness.modes import Mode

    dev, dtype = device_and_dtype(a)
    if not a.dry_run:
        small_graphs(a)
    batches = (1, 2) if a.dry_run else (1, 4, 16)
    pair, ids = load_pair_and_prompts(a, dev, dtype, max(batches) if a.dry_run else max(16, a.num_prompts), 0)
    modes = [("plain", Mode.parse("off"), False), ("auto", Mode.parse("auto"), a.head is not None),
             ("ngram", Mode.parse("ngram:8"), False)]  # fmt: skip
    if a.head is not None:
        modes.insert(2, ("head", Mode.parse("tree:32"), True))
    print(f"## speed: {pair[0].path.name}, greedy, {a.speed_tokens} tokens, {str(dtype).removeprefix('torch.')} "
          f"on {dev.type} (batch_invariant off; CUDA graphs {a.cuda_graphs}, steps up to {a.graph_tokens} tokens; "
          "JIT warmed up first)\n")  # fmt: skip
    rows = []
    for b in batches:
        group = ids[: max(b, 4)] if b == 1 else ids[:b]
        for label, mode, use_head in modes:
            engine = build_engine(a, pair, mode, use_head, "off", b)
            generate_all(engine, group[:b], b, 8, mode)  # warm-up: compiles
            outs, secs, steps = generate_all(engine, group, b, a.speed_tokens, mode)
            tokens = sum(map(len, outs))
            rows.append((b, label, f"{tokens / secs:.1f}", f"{tokens / max(steps, 1) / b:.2f}",
                         ms(secs / max(steps, 1))))  # fmt: skip
    table(["batch", "mode", "tok/s", "tokens per step per row", "ms per step"], rows)
    return 0


# ---------------------------------------------------------------------------------------------
# stage: an 8B-shaped step
# ---------------------------------------------------------------------------------------------


def random_llama(cfg, dev, dtype, max_positions: int):
    """A LlamaModel of ``cfg``'s shape with random weights (normal, std 0.02; norms 1), built on the device."""
    from specd.model.llama import LlamaModel, Rotary

    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions).to(dtype)  # no memory until to_empty
    model = model.to_empty(device=dev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.rotary = Rotary(cfg, max_positions).to(dev)
    return model.eval()


def shape_cases(a) -> list:
    if a.dry_run:
        return [("1 row", [1], False), ("2 rows", [1, 1], False), ("tree 5", [5], True)]
    return [("1 row", [1], False), ("8 rows", [1] * 8, False), ("32 rows", [1] * 32, False),
            ("tree 33 (1 request)", [33], True)]  # fmt: skip


def stage_shape8b(a) -> int:
    from specd.config import ModelConfig
    from specd.model.attention import get_backend
    from specd.model.graphs import GraphConfig, GraphRunner

    dev, dtype = device_and_dtype(a)
    cfg = ModelConfig(**(TINY if a.dry_run else LLAMA_8B))
    ctx, bs = (20 if a.dry_run else a.context), 16
    model = random_llama(cfg, dev, dtype, ctx + 128)
    cases = shape_cases(a)
    need = max(blocks_needed(q, [ctx] * len(q), bs) for _, q, _ in cases)
    kv = random_cache(cfg, need, bs, dtype, dev)
    bw = copy_bandwidth(dev)
    w_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv.element_size()
    print(
        f"## {'tiny' if a.dry_run else 'Llama-3.1-8B'}-shaped random weights, {str(dtype).removeprefix('torch.')}, "
        f"context {ctx}: weights {w_bytes / 1e9:.2f} GB, copy bandwidth {bw / 1e9:.0f} GB/s (read + write)\n"
    )
    backend = get_backend("triton", dev)
    buckets = tuple(sorted({(len(q), sum(q)) for _, q, _ in cases}, key=lambda x: (x[1], x[0])))
    rows = {name: [name] for name, _, _ in cases}
    for label, ops in (("cuBLAS", None), ("invariant", invariant_ops(dev))):
        step = model_step(model, kv, backend, bs, ops)  # (one capture per ops setting)
        gcfg = GraphConfig(buckets=buckets, max_blocks=need, block_size=bs, max_region=40, pool_bytes=8 << 30)
        runner = GraphRunner(step, gcfg, dev)
        runner.capture()
        print(f"{label}: {runner.describe()}", flush=True)
        for name, q, tree in cases:
            inp = step_inputs(q, [ctx] * len(q), bs, dev, tree=tree, vocab=cfg.vocab_size)
            rows[name] += [ms(median_s(lambda inp=inp, step=step: step(inp), 2, a.iters)),
                           ms(median_s(lambda inp=inp, r=runner: r.run(inp), 2, a.iters))]  # fmt: skip
    out = []
    for name, q, _ in cases:
        floor = (w_bytes + len(q) * ctx * kv_tok) / bw  # every weight and cached K/V read once
        out.append(rows[name] + [ms(floor), f"{float(rows[name][2]) / (floor * 1e3):.1f}x"])
    table(["step", "eager cuBLAS ms", "graph cuBLAS ms", "eager invariant ms", "graph invariant ms", "floor ms",
           "graph cuBLAS / floor"], out)  # fmt: skip
    return 0


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=(*STAGES, "all"))
    ap.add_argument("--dry-run", action="store_true", help="the smallest version on the CPU (Triton interpreter)")
    ap.add_argument("--target", default=str(ROOT / "models" / "demo" / "target"), help="model folder or GGUF file")
    ap.add_argument("--draft", default=str(ROOT / "models" / "demo" / "draft"))
    ap.add_argument("--head", default=None, help="feature head folder (head and auto modes), e.g. models/smollm2-head")
    ap.add_argument("--prompts", default=str(SHARED / "data" / "spec_bench" / "question.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64, help="identity: tokens per prompt")
    ap.add_argument("--speed-tokens", type=int, default=128, help="speed: tokens per prompt")
    ap.add_argument("--batches", default="1,8", help="identity: batch sizes")
    ap.add_argument("--settings", default="on,off", help="identity: batch_invariant settings to run")
    ap.add_argument("--context", type=int, default=512, help="graphs / shape8b: cached tokens per request")
    ap.add_argument("--graph-pool-gb", type=int, default=4)
    ap.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=("auto", "on", "off"),
        help="identity / speed: the engines' --cuda-graphs (auto: on for CUDA)",
    )
    ap.add_argument("--graph-tokens", type=int, default=64,
                    help="identity / speed: tokens of the largest captured step (the capture at each engine's "
                    "start costs one graph per bucket; wider steps run eagerly)")  # fmt: skip
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=150.0, help="identity: start no run after this")
    a = ap.parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",") if x]
    a.settings = [x for x in a.settings.split(",") if x]
    if a.dry_run:  # (an invariant engine run is interpreted kernel by kernel: minutes; its wiring is checked)
        a.batches, a.settings, a.iters, a.max_tokens, a.speed_tokens = [1, 2], ["off"], 2, 6, 6
        a.graph_tokens = 8
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    torch.manual_seed(0)
    stages = STAGES if a.stage == "all" else (a.stage,)
    rc = 0
    for s in stages:
        t0 = time.perf_counter()
        rc |= {"kernels": stage_kernels, "graphs": stage_graphs, "identity": stage_identity, "speed": stage_speed,
               "shape8b": stage_shape8b}[s](a)  # fmt: skip
        print(f"({s}: {time.perf_counter() - t0:.1f} s)\n", flush=True)
        if a.dry_run:
            print(f"dry run OK: {s}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
