"""The engine client: the one narrow interface every front end (websocket, HTTP, gRPC) uses.

A front end never touches an ``Engine``: it holds an ``EngineClient`` and

- validates a request (``specd.engine.requests``; ``client.limits``: the context, the KV cache, the
  vocabulary) and tokenizes it with ``client.tokenizer`` (no compute, nothing queued);
- ``submit(req, sink)`` with a ``Submit`` (``specd.engine.commands``: prompt ids, ``SamplingParams``,
  ``SpecParams``, priority, request id, tenant, grammar): the request's stream is pushed to ``sink`` on the
  event loop, one ``RequestOutput`` per engine step (tokens, text, the request's running speculation
  stats in ``out.seq.stats``; ``finished`` on the last) or a ``RequestError`` that ends it;
  ``generate(req)`` is the same stream pulled as an async iterator; ``tenant`` (a digest of the
  caller's API key) scopes what the engine may draft from (``specd.speculation.suffix``);
- ``check_grammar(spec)``: compile a request's ``GrammarSpec`` as the engine will (cached), raising
  its ``GrammarError`` before the request is submitted (a front end's refusal precedes its answer);
- ``abort(request_id)``: the stream ends with ``finish_reason: "cancelled"`` within one engine step,
  and the request's KV blocks are freed in that step;
- ``snapshot()``: an ``EngineSnapshot`` (queues, KV blocks in use, speculation totals, health) as of
  at most ~50 ms ago while the engine works, or as it went idle (what ``/metrics`` and ``/readyz`` read);
  ``unhealthy_reason()`` None while the engine completes steps;
- ``drain(deadline_s)`` then ``stop()`` at shutdown.

One implementation, ``specd.serving.async_engine.AsyncEngine``, serves it over an ``EngineLink``
(``specd.engine.links``): the engine stepping in a thread of this process (``ThreadLink``) or in a
child process (``ProcessLink``). Both run the same ``specd.engine.loop.EngineLoop`` (one failure
policy, one hand-off policy), take the same commands and deliver the same ``Batch``es
(``specd.engine.commands``).

``snapshot_of`` and ``limits_of`` are the only readers of the engine's scheduler and caches outside
``Engine`` itself; they live here, in the engine package, so that nothing above it does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from specd.engine.commands import Batch, Command, EngineLimits, EngineSnapshot, Submit
from specd.engine.output import RequestOutput
from specd.engine.sequence import SpecStats

__all__ = ["EngineClient", "EngineLink", "StreamSink", "limits_of", "snapshot_of"]

StreamSink = Callable[[Any], None]  # called with a RequestOutput or a RequestError that ends the stream


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
        stop_ids=tuple(sorted(getattr(engine, "eos_ids", ()))),
    )


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
        graphs=_graph_stats(engine),
    )


def _graph_stats(engine) -> dict:
    # (imported here: step_graphs loads torch and the model, which only the engine's side has loaded)
    from specd.engine.step_graphs import graph_stats

    return graph_stats(engine)


@runtime_checkable
class EngineLink(Protocol):
    """Where the engine loop runs (a thread of this process, or a child process: ``specd.engine.links``),
    how commands (``Submit``, ``Cancel``, ``Snapshot``) reach it and ``Batch``es come back."""

    relaying: bool  # the event loop reads the engine's pipe (child process), no engine thread here

    @property
    def tokenizer(self) -> Any: ...

    @property
    def limits(self) -> EngineLimits: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    def start(self, loop, deliver: Callable[[Batch], None], died: Callable[[str], None]) -> None: ...

    def send(self, cmd: Command) -> None: ...

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

    def submit(self, req: Submit, sink: StreamSink) -> None: ...

    async def check_grammar(self, spec: Any) -> None: ...

    def generate(self, req: Submit) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def snapshot(self) -> EngineSnapshot: ...

    def unhealthy_reason(self) -> str | None: ...

    async def drain(self, deadline_s: float) -> None: ...

    async def stop(self) -> None: ...
