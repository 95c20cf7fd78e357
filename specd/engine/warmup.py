"""Pay first-call costs before a server reports ready, and measure what verification rows cost.

``seed_costs``: where a step is memory-bound (a 1-8B model on a CPU reads every weight once per step),
verifying 8 rows costs ~1.4x one row, so speculating deep pays from the first request; the engine's
cost model would only learn it by exploring widths by doubling. The warm-up times the target's forward
(with its logits) over 1, 2, 4, ... 32 rows after a short context, in the engine's policy clock,
within a time budget, and seeds ``SpecPolicy.costs`` with them (``CostModel.seed``), each priced as
the engine's measured plain step plus what the extra rows added to the forward. Only costs change:
how much is drafted, never what is accepted.
"""

from __future__ import annotations

import statistics
import time

import torch

ROW_WIDTHS = (1, 2, 4, 8, 16, 32)  # verification rows timed at start-up
SEED_BUDGET_S = 3.0  # start-up seconds the row timings may take (widths left are not seeded)


def warm_up(engine, seed: bool = True) -> None:
    """A short greedy and a sampled generation: first-call costs (allocations, kernel compilation)
    are paid before the server reports ready; then (``seed``, an adaptive policy on one process)
    the row costs are measured and seeded (``seed_costs``). Speculation totals are reset afterwards."""
    from specd.engine.sequence import SpecStats
    from specd.sampling.params import SamplingParams

    tok = engine.tokenizer
    ids = list(tok("Hello")["input_ids"]) if tok is not None else [0]
    ids = ids or [0]
    engine.generate(
        [ids, ids],
        [
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=0),
        ],
    )
    if seed and engine.policy.spec.adaptive and engine.tp is None:
        seed_costs(engine, ids)
    engine.stats = SpecStats()
    engine.num_steps = 0


def seed_costs(engine, ids: list, widths=ROW_WIDTHS, budget_s: float = SEED_BUDGET_S) -> dict:
    """Measure a batch-1 plain step through the engine and the target's forward over ``widths``
    rows (``row_costs``), and seed the engine's cost model: W rows cost the plain step plus
    ``forward(W) - forward(1)``. Returns the seeded {rows: seconds} (empty when fewer than three
    widths fit in ``budget_s``)."""
    from specd.sampling.params import SamplingParams
    from specd.speculation.request import SpecParams

    engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), SpecParams(mode="off"))
    costs = engine.policy.costs
    costs.at_context(0)
    plain = costs.plain_cost(1)
    fwd = row_costs(engine.target.model, engine.cache.kv.dtype, engine.backend, widths, budget_s=budget_s)
    if plain is None or len(fwd) < 3:
        return {}
    seeded = {w: plain + max(0.0, s - fwd[1]) for w, s in fwd.items()}
    costs.seed(1, seeded)
    return seeded


@torch.inference_mode()
def row_costs(
    model, kv_dtype, backend, widths=ROW_WIDTHS, context: int = 32, reps: int = 3, budget_s: float | None = None,
    clock=None,
) -> dict:  # fmt: skip
    """{W: seconds} of one forward of ``model`` (a ``LlamaModel``) with its logits over W rows after
    ``context`` tokens (random ids; the median of ``reps`` after one untimed call) in a scratch KV
    cache of ``kv_dtype``; ``clock``: default the engine's on this device (this thread's CPU time
    on a CPU, wall time with a synchronize on a GPU). Widths are timed in order while ``budget_s``
    allows: a width whose timing would overrun it (priced from the last one, in proportion to the
    rows) is not started, so the warm-up stays within its budget (it took 5.1 s of a 3 s one at 1.7B)."""
    from specd.engine.kv_cache import KVCache
    from specd.model.attention import build_metadata

    c, dev = model.cfg, next(iter(model.buffers())).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    clock = clock or (time.thread_time if dev.type == "cpu" else time.perf_counter)
    bs, n = 16, context + max(widths)
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, -(-n // bs) + 1, bs, kv_dtype, dev)
    seq = cache.new_seq()
    seq.reserve(n)
    gen = torch.Generator().manual_seed(0)

    def forward(w: int, start: int) -> None:
        ids = torch.randint(0, c.vocab_size, (w,), generator=gen).to(dev)
        meta = build_metadata([w], [start], [seq.blocks], seq.slots(start, start + w), bs, dev)
        model.compute_logits(model(ids, torch.arange(start, start + w, device=dev), cache.kv, meta, backend))
        sync()

    forward(context, 0)
    out, t_end = {}, time.perf_counter() + (budget_s if budget_s is not None else float("inf"))
    last = None  # (rows, wall seconds) of the last width's timing
    for w in widths:
        if last is not None and time.perf_counter() + last[1] * w / last[0] > t_end:
            break  # (timing w would overrun the budget: a forward costs at most in proportion to its rows)
        t0 = time.perf_counter()
        times = []
        for _ in range(reps + 1):
            t = clock()
            forward(w, context)
            times.append(clock() - t)
        out[w] = statistics.median(times[1:])
        last = (w, time.perf_counter() - t0)
    return out
