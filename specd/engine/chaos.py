"""Hostile request mixes and fault injection for the engine, in process.

Used by ``tests/test_engine_faults.py`` (fault injection per stage, the hypothesis fuzz) and by
``eval/hostile.py`` (the figure in docs/operations.md). The oracle, after every case:

- every request ends exactly once (``stop``, ``length``, ``cancelled`` or ``error``);
- no KV block is held (``kv_blocks_used() == (0, 0)``, pool invariants hold) and the engine holds
  no request;
- a fixed greedy canary request produces exactly the tokens a fresh engine produces.

A *hostile* request carries a value that validation refuses (say ``top_k = 2**63``), forced into its
parameters after validation, as a hole in validation would let through: it exercises the engine's
step isolation, not the validation. An *injected fault* raises ``InjectedFault`` as a stage starts
for one chosen request (``FaultInjector``, installed as ``Engine.fault_hook``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from specd.engine.engine import Engine, RequestError
from specd.engine.sequence import SpecParams
from specd.sampling.params import SamplingParams

STEP_STAGES = ("draft", "forward", "verify", "commit", "emit")  # the stages a request runs through

# (field, value) pairs validation refuses, to force into a request's params after validation
HOSTILE_VALUES = (
    ("top_k", 2**63),
    ("top_k", -(2**63) - 1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", -1.0),
    ("top_p", 0.0),
    ("top_p", float("nan")),
    ("top_k", 1.5),
    ("stop_token_ids", (2**64,)),
    ("max_tokens", 2**70),
    ("temperature", 1e-40),
)


class InjectedFault(RuntimeError):
    """Raised by ``FaultInjector``."""


class FaultInjector:
    """``Engine.fault_hook``: raises ``InjectedFault`` when ``stage`` starts with one of the
    ``targets`` request ids among its requests, after letting the first ``skip`` such starts pass
    (every time, or ``times`` times)."""

    def __init__(self, stage: str, targets, times: int | None = None, skip: int = 0):
        self.stage, self.targets, self.times, self.skip = stage, set(targets), times, skip
        self.fired = 0

    def __call__(self, stage: str, seqs: list) -> None:
        if stage != self.stage or (self.times is not None and self.fired >= self.times):
            return
        if any(s.request_id in self.targets for s in seqs):
            if self.skip > 0:
                self.skip -= 1
                return
            self.fired += 1
            raise InjectedFault(f"injected fault in {stage}")


@dataclass
class Req:
    """One request of a case: added before step ``add_at``, cancelled before step ``abort_at``."""

    rid: str
    prompt: list
    params: SamplingParams
    spec: SpecParams = SpecParams()
    priority: str = "interactive"
    add_at: int = 0
    abort_at: int | None = None
    hostile: tuple | None = None  # (field, value) forced into params after validation


@dataclass
class CaseResult:
    outputs: dict = field(default_factory=dict)  # rid -> output token ids
    reasons: dict = field(default_factory=dict)  # rid -> finish reason ("refused:<code>" if refused)
    errors: dict = field(default_factory=dict)  # rid -> the engine's error message
    steps: int = 0


def _add(engine: Engine, r: Req, res: CaseResult) -> None:
    try:
        seq = engine.add_request(list(r.prompt), r.params, r.spec, r.priority, r.rid)
    except RequestError as e:
        res.reasons[r.rid] = f"refused:{e.code}"
        return
    if r.hostile is not None:
        object.__setattr__(seq.params, r.hostile[0], r.hostile[1])
    res.outputs[r.rid] = []


def run_case(engine: Engine, reqs: list, max_steps: int = 5000) -> CaseResult:
    """Run the requests to their ends, adding and cancelling them at their steps."""
    res = CaseResult()
    pending = sorted(reqs, key=lambda r: r.add_at)
    aborts = {r.rid: r.abort_at for r in reqs if r.abort_at is not None}
    step = 0
    while pending or engine.has_work():
        while pending and pending[0].add_at <= step:
            _add(engine, pending.pop(0), res)
        for rid in [k for k, at in aborts.items() if at <= step]:
            engine.abort(rid)
            del aborts[rid]
        for out in engine.step():
            res.outputs.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                if out.request_id in res.reasons:
                    raise AssertionError(f"request {out.request_id} ended twice")
                res.reasons[out.request_id] = out.finish_reason
                if out.error:
                    res.errors[out.request_id] = out.error
        step += 1
        if step > max_steps:
            raise AssertionError(f"the engine did not finish the case in {max_steps} steps")
    res.steps = step
    missing = [r.rid for r in reqs if r.rid not in res.reasons]
    if missing:
        raise AssertionError(f"requests never ended: {missing}")
    return res


def _pick(rng: random.Random, edges: list, lo, hi):
    """An edge value half of the time, else uniform in [lo, hi]."""
    if rng.random() < 0.5:
        return rng.choice(edges)
    return rng.uniform(lo, hi) if isinstance(lo, float) else rng.randint(lo, hi)


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    """Sampling parameters over the whole accepted range, edges often."""
    return SamplingParams(
        temperature=_pick(rng, [0.0, 1e-9, 1e-5, 0.7, 1.0, 100.0], 0.0, 100.0),
        top_p=_pick(rng, [1.0, 1e-300, 1e-6, 0.5, 0.95], 1e-12, 1.0),
        top_k=_pick(rng, [-1, 0, 1, 2, 50, vocab - 1, vocab, 2**63 - 1], -1, 2**63 - 1),
        seed=None if rng.random() < 0.3 else rng.randint(-(2**70), 2**70),
        max_tokens=rng.randint(1, 12),
        stop=tuple(
            "".join(rng.choice(" abcdeloTt.,!\n\u00e9\u4e2d") for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(0, 3))
        ),
        stop_token_ids=tuple(rng.randrange(vocab) for _ in range(rng.randint(0, 3))),
        ignore_eos=rng.random() < 0.5,
    )


def random_case(rng: random.Random, vocab: int, max_requests: int = 5) -> tuple:
    """(requests, fault): 1..max_requests requests with random parameters, speculation, priority,
    prompt (random token ids), arrival and cancellation steps, a hostile value one time in four;
    fault = (stage, index of the target request, starts to let pass) or None, half of the time."""
    reqs = []
    for i in range(rng.randint(1, max_requests)):
        spec = SpecParams(rng.choice(["auto", "off", "chain", "tree"]), rng.choice([None, 0, 1, 4, 16]))
        reqs.append(
            Req(
                f"f{i}",
                [rng.randrange(vocab) for _ in range(rng.randint(1, 60))],
                random_params(rng, vocab),
                spec,
                rng.choice(["interactive", "batch"]),
                rng.randint(0, 6),
                rng.choice([None, None, rng.randint(0, 14)]),
                rng.choice(HOSTILE_VALUES) if rng.random() < 0.25 else None,
            )
        )
    fault = None
    if rng.random() < 0.5:
        fault = (rng.choice(STEP_STAGES), rng.randrange(len(reqs)), rng.randint(0, 3))
    return reqs, fault


def run_checked(engine: Engine, reqs: list, fault: tuple | None, canary_prompt: list, canary_ref: list) -> dict:
    """One case and its oracle (module docstring); AssertionError on a violation. Returns counts."""
    target = reqs[fault[1]].rid if fault else None
    hook = FaultInjector(fault[0], {target}, skip=fault[2]) if fault else None
    res = with_hook(engine, hook, lambda: run_case(engine, reqs))
    innocent = 0
    for r in reqs:
        reason = res.reasons[r.rid]
        assert reason in ("stop", "length", "cancelled", "error") or reason.startswith("refused:"), reason
        if r.hostile is None and r.rid != target:
            innocent += 1
            assert reason != "error", f"{r.rid} failed without cause: {res.errors.get(r.rid)}"
            assert len(res.outputs.get(r.rid, [])) <= r.params.max_tokens
    check_clean(engine)
    assert canary(engine, canary_prompt) == canary_ref, "the canary's output changed"
    return {
        "requests": len(reqs),
        "hostile": sum(r.hostile is not None for r in reqs),
        "innocent": innocent,
        "faults_fired": hook.fired if hook else 0,
        "failed": sum(v == "error" for v in res.reasons.values()),
    }


def check_clean(engine: Engine) -> None:
    """No request held, no KV block held, pool invariants intact (AssertionError otherwise)."""
    assert engine.kv_blocks_used() == (0, 0), f"KV blocks leaked: {engine.kv_blocks_used()}"
    engine.cache.pool.check()
    if engine.draft_cache is not None:
        engine.draft_cache.pool.check()
    assert not engine.seqs and not engine.scheduler.running and not engine.scheduler.waiting


def canary(engine: Engine, prompt: list, max_tokens: int = 12, mode: str = "tree") -> list:
    """The canary's greedy output on ``engine`` (run alone)."""
    seq = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), SpecParams(mode)
    )[0]
    assert seq.finish_reason == "length", f"canary ended with {seq.finish_reason}: {seq.error}"
    return seq.output_ids


def with_hook(engine: Engine, hook: Callable | None, fn: Callable):
    """``fn()`` with ``engine.fault_hook = hook``, the previous hook restored afterwards."""
    old, engine.fault_hook = engine.fault_hook, hook
    try:
        return fn()
    finally:
        engine.fault_hook = old
