"""The engine client: the one narrow interface every front end (websocket, HTTP, gRPC) uses.

A front end never touches an ``Engine``: it holds an ``EngineClient`` and

- validates a request against ``client.limits`` (the context, the KV cache, the vocabulary) and
  tokenizes it with ``client.tokenizer`` (no compute, nothing queued);
- ``submit(prompt_ids, params, spec, priority, request_id, sink, tenant)``: the request's stream is pushed to
  ``sink`` on the event loop, one ``RequestOutput`` per engine step (tokens, text, the request's
  running speculation stats in ``out.seq.stats``; ``finished`` on the last) or a ``RequestError`` that
  ends it; ``generate(...)`` is the same stream pulled as an async iterator; ``tenant`` (a digest of
  the caller's API key) scopes what the engine may draft from (``specd.speculation.suffix``);
- ``abort(request_id)``: the stream ends with ``finish_reason: "cancelled"`` within one engine step,
  and the request's KV blocks are freed in that step;
- ``snapshot()``: an ``EngineSnapshot`` (queues, KV blocks in use, speculation totals, health) as of
  at most ~50 ms ago while the engine works, or as it went idle (what ``/metrics`` and ``/readyz`` read);
  ``unhealthy_reason()`` None while the engine completes steps;
- ``drain(deadline_s)`` then ``stop()`` at shutdown.

One implementation, ``specd.serving.engine_client.AsyncEngine``, serves it over an ``EngineLink``:
the engine stepping in a thread of this process (``specd.engine.loop.ThreadLink``) or in a child
process (``specd.serving.engine_proc.ProcessLink``). Both run the same ``specd.engine.loop.EngineLoop``
(one failure policy, one hand-off policy) and deliver the same ``Batch``es.

``snapshot_of`` and ``limits_of`` are the only readers of the engine's scheduler and caches outside
``Engine`` itself; they live here, in the engine package, so that nothing above it does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from specd.engine.engine import RequestError, RequestOutput, validate_request
from specd.engine.sequence import SpecParams, SpecStats
from specd.sampling.params import SamplingParams

__all__ = [
    "Batch",
    "EngineClient",
    "EngineLimits",
    "EngineLink",
    "EngineSnapshot",
    "RequestError",
    "RequestOutput",
    "StreamSink",
    "limits_of",
    "snapshot_of",
]

StreamSink = Callable[[Any], None]  # called with a RequestOutput or a RequestError that ends the stream


@dataclass(frozen=True)
class EngineLimits:
    """What a front end needs to refuse a request before it reaches the engine (no compute)."""

    max_model_len: int
    block_size: int
    num_blocks: int
    draft_num_blocks: int | None
    vocab_size: int
    has_draft: bool
    threads: int = 0

    def validate(self, prompt_ids: list, params: SamplingParams) -> None:
        """``RequestError`` (``too_long`` / ``invalid_request``) for a request that can never run."""
        validate_request(prompt_ids, params, self.max_model_len, self.block_size, self.num_blocks, self.vocab_size)


def limits_of(engine, threads: int = 0) -> EngineLimits:
    """An ``Engine``'s limits (read once, after it is built)."""
    dc = engine.draft_cache
    return EngineLimits(
        max_model_len=engine.max_model_len,
        block_size=engine.cache.block_size,
        num_blocks=engine.cache.pool.num_blocks,
        draft_num_blocks=dc.pool.num_blocks if dc is not None else None,
        vocab_size=engine.vocab_size,
        has_draft=engine.drafter is not None,
        threads=threads,
    )


def _empty_prefix() -> dict:
    return {"query_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0, "evictions": 0}


@dataclass
class EngineSnapshot:
    """The engine's state at one moment (``time``, monotonic): running and waiting requests by
    priority, KV blocks in use (target, draft), speculation totals, scheduler counters, prefix-cache
    stats, engine steps, ``EngineHealth.snapshot()`` and the loop's escaped step failures in a row."""

    running: dict = field(default_factory=lambda: {"interactive": 0, "batch": 0})
    waiting: dict = field(default_factory=lambda: {"interactive": 0, "batch": 0})
    kv_used: tuple = (0, 0)
    stats: SpecStats = field(default_factory=SpecStats)
    preemptions: int = 0
    spec_budget: int = 0
    depth: int = 0
    prefix: dict = field(default_factory=_empty_prefix)
    steps: int = 0
    health: dict | None = None
    loop_failures: int = 0
    time: float = 0.0


def snapshot_of(engine, loop_failures: int = 0) -> EngineSnapshot:
    """A copy of ``engine``'s state (call it on the thread that steps the engine)."""
    sch = engine.scheduler
    running = {"interactive": 0, "batch": 0}
    for s in sch.running:
        running[s.priority] = running.get(s.priority, 0) + 1
    stats = SpecStats()
    stats.merge(engine.stats)  # a copy: the engine keeps adding to its own
    return EngineSnapshot(
        running=running,
        waiting=dict(sch.queue_lengths()),
        kv_used=tuple(engine.kv_blocks_used()),
        stats=stats,
        preemptions=sch.num_preemptions,
        spec_budget=sch.last_spec_budget,
        depth=sch.last_depth,
        prefix=dict(engine.prefix_cache_stats()),
        steps=engine.num_steps,
        health=engine.health_snapshot(),
        loop_failures=loop_failures,
        time=time.monotonic(),
    )


@dataclass
class Batch:
    """What the engine loop hands its client at once: the outputs of one or more steps, each with its
    duration (``steps``: ``[(list[RequestOutput], seconds)]``, in order), a state snapshot or None,
    the exceptions that escaped ``Engine.step()`` since the last batch (``"Type: message"``; each
    failed every active request, whose error outputs are in ``steps``), and requests the engine
    refused on arrival (``(request_id, code, message)``: races validation could not see)."""

    steps: list = field(default_factory=list)
    snapshot: EngineSnapshot | None = None
    errors: list = field(default_factory=list)
    refused: list = field(default_factory=list)


@runtime_checkable
class EngineLink(Protocol):
    """Where the engine loop runs (a thread of this process, or a child process) and how commands
    reach it and batches come back. Commands: ``("add", rid, prompt_ids, params, spec, priority,
    tenant)``, ``("abort", rid)``, ``("snapshot",)``."""

    relaying: bool  # the event loop reads the engine's pipe (child process), no engine thread here

    @property
    def tokenizer(self) -> Any: ...

    @property
    def limits(self) -> EngineLimits: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    def validate(self, prompt_ids: list, params: SamplingParams) -> None: ...

    def start(self, loop, deliver: Callable[[Batch], None], died: Callable[[str], None]) -> None: ...

    def send(self, cmd: tuple) -> None: ...

    def wake(self) -> None: ...

    def detach(self) -> None: ...

    def close(self) -> None: ...


class EngineClient(Protocol):
    """The interface of the engine for front ends (see the module docstring). All methods are called
    on the event loop that ``start()``-ed the client, except ``abort`` (any thread)."""

    listeners: list  # f(outputs: list[RequestOutput], step_seconds: float) per engine step, on the loop

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def limits(self) -> EngineLimits: ...

    @property
    def ready(self) -> bool: ...

    @property
    def draining(self) -> bool: ...

    @property
    def num_requests(self) -> int: ...

    def validate(self, prompt_ids: list, params: SamplingParams) -> None: ...

    def submit(
        self,
        prompt_ids: list,
        params: SamplingParams,
        spec: SpecParams,
        priority: str,
        request_id: str,
        sink: StreamSink,
        tenant: str | None = None,
    ) -> None: ...

    def generate(
        self,
        prompt_ids: list,
        params: SamplingParams,
        spec: SpecParams = SpecParams(),
        priority: str = "interactive",
        request_id: str | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def snapshot(self) -> EngineSnapshot: ...

    def unhealthy_reason(self) -> str | None: ...

    async def drain(self, deadline_s: float) -> None: ...

    async def stop(self) -> None: ...
