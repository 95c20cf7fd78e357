"""``AsyncEngine``: the ``EngineClient`` every front end uses, on the server's event loop.

It owns the request bookkeeping that is the same wherever the engine runs: admission (``max_queue``,
draining, duplicate ids, validation against the engine's limits), one stream per request (a pushed
``sink`` or a pulled async iterator), per-step listeners (metrics, request logs), drain and stop, and
health. The engine itself runs behind an ``EngineLink`` (``specd.engine.links``): ``ThreadLink`` (a
thread of this process; what ``AsyncEngine(engine)`` builds) or ``ProcessLink`` (a child process, the
default of ``specd serve``). Either way a request goes to the engine loop as a ``Submit`` and the loop
sends ``Batch``es (``specd.engine.commands``), which are applied here in one place (``_on_batch``).

Usage (inside the event loop that called ``start()``)::

    ae = AsyncEngine(engine, max_queue=256)
    await ae.start()
    try:
        async for out in ae.generate(Submit("r1", prompt_ids, SamplingParams(...))):
            ...  # out: RequestOutput (token_ids / text of one engine step - or of every step that
                 # queued up while the consumer was busy, merged; out.finished on the last)
    except RequestError as e:  # raised on the first iteration, before any compute:
        ...  # e.code: overloaded | shutting_down | too_long | invalid_request | duplicate_id | internal
    await ae.drain(30.0)  # SIGTERM: refuse new requests, let running ones finish, abort the rest
    await ae.stop()

A consumer that stops iterating (``break``, ``aclose()``, task cancelled because the client went away)
aborts its request; the engine frees its KV blocks on its next step. Wrap the stream in
``contextlib.aclosing(...)`` so that leaving the loop early closes it at once.

A request the engine failed (``finish_reason: "error"``) ends its stream with ``RequestError("internal")``
(``admitted``, with the failed ``seq`` attached), or with the grammar's code (``invalid_schema``, ...)
when the engine refused its grammar. ``check_grammar(spec)`` compiles a request's grammar before it is
submitted, so front ends refuse a bad one before their answer starts.

Health (``unhealthy_reason()``): the link is alive; requests are outstanding and nothing came back
for ``watchdog_timeout_s`` (a stuck step, a stopped process); ``max_failed_steps`` failed steps in a
row; queued work and no step completed within the watchdog timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from specd.engine.client import EngineLink, StreamSink
from specd.engine.commands import Batch, Cancel, EngineLimits, EngineSnapshot, Snapshot, Submit
from specd.engine.health import DEFAULT_MAX_FAILED_STEPS, unhealthy_reason
from specd.engine.links import ThreadLink
from specd.engine.loop import DEFAULT_STREAM_INTERVAL_S
from specd.engine.output import RequestOutput
from specd.engine.requests import RequestError

log = logging.getLogger("specd.async_engine")

__all__ = ["AsyncEngine", "RequestError", "RequestOutput", "RequestStream", "merge_outputs"]


class _Sink:
    """A push consumer in ``_streams`` (which otherwise holds ``asyncio.Queue``s): same put_nowait."""

    __slots__ = ("put_nowait",)

    def __init__(self, fn):
        self.put_nowait = fn


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (tokens and text concatenated)."""
    lps = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    toks, text = a.token_ids + b.token_ids, a.text + b.text
    return RequestOutput(a.request_id, toks, text, b.finished, b.finish_reason, b.seq, b.error, lps)


def _admitted(e: RequestError) -> RequestError:
    """Mark an error raised after the request was admitted (mid-stream) rather than refused."""
    e.admitted = True
    return e


def grammar_code(message: str | None) -> str | None:
    """The ``GrammarError`` code an engine error (``"<code>: <message>"``) starts with, else None."""
    from specd.structured.errors import CODES

    code = (message or "").partition(":")[0]
    return code if code in CODES else None


def _failed(out: RequestOutput) -> RequestError:
    """A request the engine failed as its stream's error: ``internal``, or the grammar's code when the
    engine refused its grammar (``"<code>: <message>"``); ``seq`` carries its usage."""
    msg = out.error or "the engine failed while running the request"
    code = grammar_code(msg)
    e = _admitted(RequestError(code or "internal", msg.partition(": ")[2] if code else msg))
    e.seq = out.seq
    return e


class RequestStream:
    """An admitted request's outputs as an async iterator: what queued up while the consumer was
    busy comes merged into one ``RequestOutput``; the last has ``finished`` set, or a ``RequestError``
    ends it. ``close()`` (idempotent) aborts the request unless it has ended; its KV blocks are
    freed in the engine's next step."""

    def __init__(self, ae: AsyncEngine, request_id: str, q: asyncio.Queue):
        self.ae, self.request_id, self._q = ae, request_id, q
        self.ended = False
        self._pending = None  # an error that ends the stream after the output merged before it

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.ended:
            raise StopAsyncIteration
        q = self._q
        item, self._pending = (self._pending if self._pending is not None else await q.get()), None
        while not q.empty() and not isinstance(item, BaseException) and not item.finished:
            nxt = q.get_nowait()
            if isinstance(nxt, BaseException):
                self._pending = nxt
                break
            item = merge_outputs(item, nxt)
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    def _end(self) -> None:
        self.ended = True
        if self.ae._streams.get(self.request_id) is self._q:
            del self.ae._streams[self.request_id]

    def close(self) -> None:
        if not self.ended:  # consumer went away (break / cancelled / disconnect): free the KV
            self.ae.abort(self.request_id)
            self._end()


class AsyncEngine:
    """``EngineClient`` over an ``EngineLink``. Create, ``start()``, ``stop()`` on ONE event loop.

    ``engine``: an ``Engine`` (stepped by a ``ThreadLink``) or an ``EngineLink``.
    ``max_queue``: admitted requests (waiting + running, not finished) at most; the next one is
    refused at once with ``RequestError("overloaded")``.
    ``watchdog_timeout_s``: how long requests may be outstanding with nothing coming back from the
    engine (no output, no heartbeat) before it counts as stuck.
    ``max_failed_steps``: failed steps in a row after which the engine is unhealthy (0: never).
    """

    def __init__(
        self,
        engine,
        max_queue: int = 256,
        watchdog_timeout_s: float = 30.0,
        stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S,
        max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS,
    ):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.link = engine if isinstance(engine, EngineLink) else ThreadLink(engine, stream_interval_s)
        self.max_queue = max_queue
        self.watchdog_timeout_s = watchdog_timeout_s
        self.max_failed_steps = max_failed_steps
        self.listeners: list[Callable[[list, float], None]] = []
        self.num_step_errors = 0  # exceptions that escaped Engine.step() (each failed every active request)
        self.num_batches = 0  # hand-offs received from the engine loop (each one event-loop wake-up)
        self.last_progress = time.monotonic()  # last batch received or request submitted
        self._streams: dict = {}  # request id -> asyncio.Queue or _Sink (event-loop thread only)
        self._snap = EngineSnapshot()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self._draining = False
        self._stopping = False
        self._compiler = None  # the link's GrammarCompiler, once a request had a grammar
        self._checking = 0  # requests whose grammar is being checked (check_grammar): they count as queued
        self._compiler_ready: asyncio.Future | None = None

    # lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.last_progress = time.monotonic()
        self.link.start(self._loop, self._on_batch, self._on_dead)
        self.link.send(Snapshot())

    async def drain(self, deadline_s: float) -> None:
        """Refuse new requests (``shutting_down``); wait up to ``deadline_s`` for the admitted ones to
        finish, then abort the rest (their streams end with finish_reason ``cancelled``)."""
        self._draining = True
        end = time.monotonic() + max(0.0, deadline_s)
        while self._streams and time.monotonic() < end:
            await asyncio.sleep(0.02)
        if self._streams:
            log.warning("drain deadline reached: cancelling %d request(s)", len(self._streams))
            for rid in list(self._streams):
                self.abort(rid)
            end = time.monotonic() + 5.0  # let the cancellations reach their consumers
            while self._streams and time.monotonic() < end and self._alive():
                await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """Stop the engine loop (and its process); any stream still open fails with ``shutting_down``."""
        self._draining = self._stopping = True
        if self._loop is not None:
            self.link.detach()
            await self._loop.run_in_executor(None, self.link.close)
        self._fail_all("shutting_down", "the server is shutting down")

    # state ---------------------------------------------------------------------------------------
    @property
    def engine(self):
        """The ``Engine`` when it steps in this process (tests read its public state), else None."""
        return getattr(self.link, "engine", None)

    @property
    def tokenizer(self):
        return self.link.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.link.max_model_len

    @property
    def limits(self) -> EngineLimits:
        return self.link.limits

    @property
    def relaying(self) -> bool:
        """True while the event loop reads an engine process's pipe (there is no engine thread)."""
        return self.link.relaying and self._dead is None and self._loop is not None

    def _alive(self) -> bool:
        return self._loop is not None and self._dead is None and self.link.alive

    @property
    def ready(self) -> bool:
        """Models loaded, engine loop running, not draining."""
        return self._alive() and not self._draining and not self._stopping

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_requests(self) -> int:
        """Admitted requests not finished yet (waiting + running)."""
        return len(self._streams)

    def snapshot(self) -> EngineSnapshot:
        return self._snap

    async def refresh_snapshot(self, timeout_s: float = 5.0) -> EngineSnapshot:
        """Ask the engine loop for a snapshot now; returns it once it has arrived (or the last one)."""
        before = self._snap
        self.link.send(Snapshot())
        end = time.monotonic() + timeout_s
        while self._snap is before and time.monotonic() < end and self._alive():
            await asyncio.sleep(0.005)
        return self._snap

    def watchdog_ok(self) -> bool:
        """The engine loop lives and is not stuck: with requests outstanding, something (outputs or a
        heartbeat) came back from it within ``watchdog_timeout_s``."""
        if not self._alive():
            return False
        return not self._streams or time.monotonic() - self.last_progress <= self.watchdog_timeout_s

    def unhealthy_reason(self) -> str | None:
        """None while the engine completes steps; else why not, in one line (``specd.engine.health``)."""
        if not self._alive():
            return "engine process or thread is not running"
        if not self.watchdog_ok():
            return f"an engine step has been running (or silent with work) for over {self.watchdog_timeout_s:g} s"
        s = self._snap
        h = dict(s.health) if s.health else {"consecutive_failed": 0, "last_progress": 0.0}
        h["consecutive_failed"] = max(h["consecutive_failed"], s.loop_failures)
        h["last_progress"] = max(h["last_progress"], self.last_progress)  # a fresh submit is not stuck
        now, busy = time.monotonic(), bool(self._streams)
        return unhealthy_reason(h, now, busy, self.max_failed_steps, self.watchdog_timeout_s)

    def healthy(self) -> bool:
        return self.unhealthy_reason() is None

    def wake(self) -> None:
        """Wake the engine loop now (after work was handed to the engine directly: tests)."""
        self.link.wake()

    # requests ------------------------------------------------------------------------------------
    async def generate(self, req: Submit) -> AsyncIterator[RequestOutput]:
        """Stream one request: one ``RequestOutput`` per engine step that emitted for it (outputs
        that queued up while the consumer was busy come merged); the last has ``finished`` set.
        Raises ``RequestError`` on the first iteration when the request is refused, or later
        (``internal`` if the engine failed, ``shutting_down`` on ``stop()``: ``admitted`` set)."""
        stream = self.stream(req)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def stream(self, req: Submit) -> RequestStream:
        """Admit a request now (``RequestError`` at once when refused) and return its stream: an async
        iterator like ``generate()``'s; ``close()`` aborts the request unless it has finished."""
        q: asyncio.Queue = asyncio.Queue()
        self._admit(req, q)
        return RequestStream(self, req.request_id, q)

    def submit(self, req: Submit, sink: StreamSink) -> None:
        """Admit a request whose outputs are pushed: ``sink(item)`` runs on the event loop with each
        ``RequestOutput`` (the last has ``finished`` set) or an admitted ``RequestError`` that ends the
        stream. Raises ``RequestError`` at once when refused. ``abort()`` ends it (``cancelled``)."""
        self._admit(req, _Sink(sink))

    def _admit(self, req: Submit, stream) -> None:
        self._check_open()
        if req.request_id in self._streams:
            raise RequestError("duplicate_id", f"request id {req.request_id!r} is already running")
        self.link.limits.validate(req)  # too_long / invalid_request, before anything is queued
        self._streams[req.request_id] = stream
        self.last_progress = time.monotonic()
        self.link.send(req)

    def _check_open(self) -> None:
        """``shutting_down`` while stopping, draining or without a running engine; ``overloaded``
        past ``max_queue`` (``_check_room``)."""
        if self._stopping or self._draining:
            raise RequestError("shutting_down", "the server is shutting down")
        if not self._alive():
            raise RequestError("shutting_down", "the engine is not running")
        self._check_room()

    def _check_room(self) -> None:
        """``overloaded`` when ``max_queue`` requests are admitted or having their grammar checked."""
        held = len(self._streams) + self._checking
        if held >= self.max_queue:
            raise RequestError(
                "overloaded",
                f"server busy: {held} requests queued, running or compiling (max {self.max_queue}); retry later",
            )

    async def check_grammar(self, spec) -> None:
        """Compile ``spec`` (a ``GrammarSpec``) in the engine's compiler and wait for it, so that a
        refusal (``GrammarError``: invalid, unsatisfiable, too large, compile timeout) comes before the
        request starts; the grammar is cached there, ready for the request. A request being checked
        counts against ``max_queue`` (``overloaded`` past it), so a flood of schemas cannot queue
        compiles without bound. Refused like a request while the server shuts down."""
        from specd.structured.errors import GrammarError  # (a constrained request loaded the library)

        self._check_open()
        self._checking += 1
        try:
            if self._compiler is None:
                if self._compiler_ready is None:
                    loop = asyncio.get_running_loop()
                    self._compiler_ready = loop.run_in_executor(None, self.link.grammar_compiler)
                self._compiler = await asyncio.shield(self._compiler_ready)
            await asyncio.shield(asyncio.wrap_future(self._compiler.submit(spec)))
        except (GrammarError, RequestError):
            raise
        except Exception as e:  # noqa: BLE001 - (e.g. no tokenizer) as an engine process answers it
            raise GrammarError("invalid_grammar", f"{type(e).__name__}: {e}", spec.field) from None
        finally:
            self._checking -= 1

    def abort(self, request_id: str) -> None:
        """Cancel a request (any thread); its stream ends with finish_reason ``cancelled``."""
        self.link.send(Cancel(request_id))

    # batches from the engine loop (event loop) ---------------------------------------------------
    def _on_batch(self, b: Batch) -> None:
        self.num_batches += 1
        self.last_progress = time.monotonic()
        if b.snapshot is not None:
            self._snap = b.snapshot
        self.num_step_errors += len(b.errors)
        for r in b.refused:
            s = self._streams.pop(r.request_id, None)
            if s is not None:
                s.put_nowait(RequestError(r.code, r.message))
        for st in b.steps:
            if st.outputs:
                self._notify(st.outputs, st.seconds)
                self._dispatch(st.outputs)

    def _notify(self, outs: list, step_seconds: float) -> None:
        for f in self.listeners:
            try:
                f(outs, step_seconds)
            except Exception:  # noqa: BLE001 - a listener never stops the stream
                log.exception("step listener failed")

    def _dispatch(self, outs: list) -> None:
        streams = self._streams
        for out in outs:
            q = streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out if out.finish_reason != "error" else _failed(out))
                if out.finished:  # accounting must not wait for the consumer to resume
                    del streams[out.request_id]

    def _on_dead(self, msg: str) -> None:
        if self._dead is None:
            self._dead = msg
            log.critical("%s", msg)
        self._fail_all("internal", msg)

    def _fail_all(self, code: str, msg: str) -> None:
        for rid in list(self._streams):
            self._streams.pop(rid).put_nowait(_admitted(RequestError(code, msg)))
