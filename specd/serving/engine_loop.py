"""``AsyncEngine``: the engine stepping in its own thread, streaming outputs to asyncio consumers.

The websocket and gRPC servers share one ``AsyncEngine``. ``Engine.step()`` runs in a dedicated thread
(a step is a blocking model forward; it must never run on the event loop). After each step the outputs
are handed to the event loop in ONE ``loop.call_soon_threadsafe`` call and fanned out to per-request
``asyncio.Queue``s; each ``generate()`` stream drains its own queue.

Usage (inside the event loop that called ``start()``)::

    ae = AsyncEngine(engine, max_queue=256)
    await ae.start()
    try:
        async for out in ae.generate(prompt_ids, SamplingParams(...), SpecParams(), "interactive", "r1"):
            ...  # out: RequestOutput (token_ids / text of one engine step - or of every step that
                 # queued up while the consumer was busy, merged; out.finished on the last)
    except RequestError as e:  # raised on the first iteration, before any compute:
        ...  # e.code: overloaded | shutting_down | too_long | invalid_request | duplicate_id | internal
    await ae.drain(30.0)  # SIGTERM: refuse new requests, let running ones finish, abort the rest
    await ae.stop()

A consumer that stops iterating (``break``, ``aclose()``, task cancelled because the client went away)
aborts its request in the engine; the engine frees its KV blocks on its next step. Wrap the stream in
``contextlib.aclosing(...)`` so that leaving the loop early (an exception in the body) closes it at
once rather than when the generator is garbage-collected.

With an engine process (``specd.serving.engine_proc.RemoteEngine``) there is no engine thread: the
event loop watches the process's pipe and relays its outputs to the streams directly.

A failing stage inside ``Engine.step()`` fails only the request(s) that caused it: the engine returns
their outputs with ``finish_reason: "error"``, which reach their streams as ``RequestError("internal")``
(``admitted``, with the failed ``seq`` attached). While steps keep failing the loop backs off (20 ms
doubling to 1 s) instead of spinning; ``unhealthy_reason()`` says when the engine cannot complete steps
(the servers' ``/readyz``, ``/healthz`` and systemd watchdog follow it). An exception escaping
``Engine.step()`` itself (a bug outside its stage isolation) fails every active request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

from specd.engine.engine import Engine, RequestError, RequestOutput
from specd.engine.health import DEFAULT_MAX_FAILED_STEPS, RateLimitedLog, backoff_s, unhealthy_reason
from specd.engine.sampling import SamplingParams
from specd.engine.sequence import SpecParams

log = logging.getLogger("specd.engine_loop")

__all__ = ["AsyncEngine", "RequestError", "RequestOutput"]


class _Sink:
    """A push consumer in ``_streams`` (which otherwise holds ``asyncio.Queue``s): same put_nowait."""

    __slots__ = ("put_nowait",)

    def __init__(self, fn):
        self.put_nowait = fn


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (tokens and text concatenated)."""
    return RequestOutput(a.request_id, a.token_ids + b.token_ids, a.text + b.text, b.finished, b.finish_reason, b.seq)


def _admitted(e: RequestError) -> RequestError:
    """Mark an error raised after the request was admitted (mid-stream) rather than refused."""
    e.admitted = True
    return e


def _failed(out: RequestOutput) -> RequestError:
    """A request the engine failed (``finish_reason: "error"``) as its stream's ``internal`` error;
    ``seq`` carries its usage and stats for the final message."""
    e = _admitted(RequestError("internal", out.error or "the engine failed while running the request"))
    e.seq = out.seq
    return e


_IDLE_WAIT_S = 0.5  # the idle thread wakes this often to refresh last_step_time (no busy-wait)
DEFAULT_STREAM_INTERVAL_S = 0.002


class HandOff:
    """When the engine hands a step's outputs to the server's event loop: as the step ends, or
    together with the next step's (``interval_s``, ``specd serve --stream-interval-ms``).

    Each hand-off wakes the event loop. On sub-millisecond steps (a small model on a CPU) that
    wake-up is a visible share of the step: a pipe write that wakes a sleeping reader on another
    CPU costs the writer ~8 us on our 2-vCPU VM instead of ~0.4 us, and the whole hand-off ~20-30
    us. So outputs are held while the engine keeps stepping the same decodes, and only as long as
    the next step still ends within ``interval_s`` of the last hand-off: a held token is late by
    less than the interval. A request's first token and its last output go at once, and so does
    everything when the engine goes idle or new requests arrive (their prefill may make the next
    step long). With steps longer than the interval (GPUs, big models) every step goes as it ends;
    0 turns holding off.
    """

    def __init__(self, interval_s: float = DEFAULT_STREAM_INTERVAL_S):
        if not interval_s >= 0:
            raise ValueError(f"stream interval must be >= 0 seconds, got {interval_s!r}")
        self.interval = interval_s
        self.last = float("-inf")  # monotonic time of the last hand-off

    def now(self, t: float, step_seconds: float, urgent: bool, steady: bool) -> bool:
        """After a step that took ``step_seconds`` and ended at ``t``: hand its outputs (and any
        held ones) over now? ``urgent``: a first token or a finished request among them;
        ``steady``: the engine has more decode steps to run and no new requests to prefill."""
        if urgent or not steady or t + step_seconds - self.last >= self.interval:
            self.last = t
            return True
        return False


class AsyncEngine:
    """Thread-stepped engine with asyncio streams. Create, ``start()``, ``stop()`` on ONE event loop.

    ``max_queue``: admitted requests (waiting + running, not yet finished) at most; the next one is
    refused at once with ``RequestError("overloaded")``.
    ``watchdog_timeout_s``: ``watchdog_ok()`` turns false once one step has run longer than this; it is
    also how long queued work may wait without any step completing before the engine is unhealthy.
    ``max_failed_steps``: failed steps in a row after which the engine is unhealthy (0: never).
    ``listeners``: callables ``f(outputs: list[RequestOutput], step_seconds: float)`` run in the engine
    thread after every step that produced outputs (metrics, request logs); exceptions are logged.
    """

    def __init__(
        self,
        engine: Engine,
        max_queue: int = 256,
        watchdog_timeout_s: float = 30.0,
        stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S,
        max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS,
    ):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.handoff = HandOff(stream_interval_s)  # engine-thread mode (an engine process has its own)
        self.engine = engine
        self.max_queue = max_queue
        self.watchdog_timeout_s = watchdog_timeout_s
        self.listeners: list[Callable[[list, float], None]] = []
        self._streams: dict[str, asyncio.Queue] = {}  # event-loop thread only
        self._outbox: list = []  # outputs handed from the engine thread, not dispatched yet
        self._out_lock = threading.Lock()
        self._posted = False  # a _dispatch_outbox call is scheduled on the loop
        self._reading = False  # engine process mode: the loop watches its pipe
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._draining = False
        self._step_started: float | None = None  # monotonic start of the step in progress
        self.last_step_time = time.monotonic()
        self.num_step_errors = 0  # exceptions that escaped Engine.step() (or failed steps the child reported)
        self.max_failed_steps = max_failed_steps
        self._failures = 0  # exceptions that escaped Engine.step() in a row
        self._errlog = RateLimitedLog(log)

    # lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None or self._reading:
            return
        self._loop = asyncio.get_running_loop()
        self.last_step_time = time.monotonic()
        if hasattr(self.engine, "read_ready"):  # an engine process: the loop reads its pipe, no thread
            self.engine.reader_attached = True
            self._loop.add_reader(self.engine.fileno(), self._on_engine_readable)
            self._reading = True
            return
        self._thread = threading.Thread(target=self._run, name="specd-engine", daemon=True)
        self._thread.start()

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
        """Stop the engine thread; any stream still open fails with ``shutting_down``."""
        self._draining = True
        self._stopping = True
        self._wake.set()
        self._stop_reading()
        t = self._thread
        if t is not None and t.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, t.join, 10.0)
        for q in list(self._streams.values()):
            q.put_nowait(_admitted(RequestError("shutting_down", "the server is shutting down")))
        self._streams.clear()

    # state ---------------------------------------------------------------------------------------
    def _alive(self) -> bool:
        if self._reading:  # an engine process reports its own liveness
            return self.engine.alive
        return self._thread is not None and self._thread.is_alive()

    @property
    def ready(self) -> bool:
        """Models loaded, engine thread running, not draining."""
        return self._alive() and not self._draining and not self._stopping

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_requests(self) -> int:
        """Admitted requests not finished yet (waiting + running)."""
        return len(self._streams)

    def watchdog_ok(self) -> bool:
        """The engine thread is alive and not stuck: no step has been running longer than
        ``watchdog_timeout_s`` and the loop completed a step or idled within that time."""
        if not self._alive():
            return False
        now = time.monotonic()
        if self._reading:  # the child reports every step: silence while it has work = stuck
            eng = self.engine
            return not eng.has_work() or now - max(eng.last_msg_time, eng.last_add_time) <= self.watchdog_timeout_s
        started = self._step_started
        if started is not None:
            return now - started <= self.watchdog_timeout_s
        return now - self.last_step_time <= self.watchdog_timeout_s + _IDLE_WAIT_S

    def unhealthy_reason(self) -> str | None:
        """None while the engine completes steps; else why not, in one line: dead, one step stuck
        past the watchdog timeout, ``max_failed_steps`` failed steps in a row, or queued work and no
        step completed within the watchdog timeout (``specd.engine.health``)."""
        if not self._alive():
            return "engine process or thread is not running"
        if not self.watchdog_ok():
            return f"an engine step has been running (or silent with work) for over {self.watchdog_timeout_s:g} s"
        if self.max_failed_steps > 0 and self._failures >= self.max_failed_steps:
            return f"{self._failures} engine steps in a row failed"
        eng = self.engine
        snap_fn = getattr(eng, "health_snapshot", None)
        snap = snap_fn() if snap_fn is not None else None
        return unhealthy_reason(snap, time.monotonic(), eng.has_work(), self.max_failed_steps, self.watchdog_timeout_s)

    def healthy(self) -> bool:
        return self.unhealthy_reason() is None

    # requests ------------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: list,
        params: SamplingParams,
        spec: SpecParams = SpecParams(),
        priority: str = "interactive",
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request: one ``RequestOutput`` per engine step that emitted for it; the last has
        ``finished`` set (finish_reason stop | length | cancelled). Raises ``RequestError`` on the first
        iteration when the request is refused, or later (``internal`` if the engine failed, ``shutting_down``
        on ``stop()``); such mid-stream errors carry ``admitted = True``."""
        q: asyncio.Queue = asyncio.Queue()
        rid = self._admit(prompt_ids, params, spec, priority, request_id, q)
        finished = False
        try:
            pending = None
            while True:
                item, pending = (pending if pending is not None else await q.get()), None
                # a consumer that fell behind (slow client, busy loop) gets what queued up meanwhile
                # as ONE output: fewer messages exactly when sending is the bottleneck
                while not q.empty() and not isinstance(item, BaseException) and not item.finished:
                    nxt = q.get_nowait()
                    if isinstance(nxt, BaseException):
                        pending = nxt  # an error ends the stream after what came before it
                        break
                    item = _merge(item, nxt)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:  # consumer went away (break / aclose / cancelled): free the KV
                self.abort(rid)
            if self._streams.get(rid) is q:
                del self._streams[rid]

    def submit(
        self,
        prompt_ids: list,
        params: SamplingParams,
        spec: SpecParams,
        priority: str,
        request_id: str,
        sink: Callable[[object], None],
    ) -> None:
        """Admit a request whose outputs are pushed instead of pulled: ``sink(item)`` is called on the
        event loop, from the same callback that fans out a step's outputs, with each ``RequestOutput``
        (the last has ``finished`` set) or an admitted ``RequestError`` that ends the stream. No task,
        queue or wake-up per output: the websocket server batches a step's frames per connection.
        Raises ``RequestError`` at once when the request is refused. To give up on the request, call
        ``abort()``: the sink then receives the ``cancelled`` output."""
        self._admit(prompt_ids, params, spec, priority, request_id, _Sink(sink))

    def _admit(self, prompt_ids, params, spec, priority, request_id, stream) -> str:
        if self._stopping or self._draining:
            raise RequestError("shutting_down", "the server is shutting down")
        if not self._alive() or self._loop is None:
            raise RequestError("shutting_down", "the engine is not running")
        if len(self._streams) >= self.max_queue:
            raise RequestError(
                "overloaded",
                f"server busy: {len(self._streams)} requests queued or running (max {self.max_queue}); retry later",
            )
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self._streams:
            raise RequestError("duplicate_id", f"request id {rid!r} is already running")
        self._streams[rid] = stream  # before add_request: the engine may emit before we get back here
        try:
            self.engine.add_request(list(prompt_ids), params, spec, priority, rid)
        except RequestError:
            self._streams.pop(rid, None)
            raise
        except ValueError as e:  # e.g. a bad priority
            self._streams.pop(rid, None)
            raise RequestError("invalid_request", str(e)) from None
        self._wake.set()
        return rid

    def abort(self, request_id: str) -> None:
        """Cancel a request (any thread); its stream ends with finish_reason ``cancelled``."""
        self.engine.abort(request_id)
        self._wake.set()

    # the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as e:  # noqa: BLE001 - the thread is dying: fail everyone, don't hang them
            log.critical("engine thread died", exc_info=True)
            self._post(self._fail_all, f"engine thread died: {type(e).__name__}: {e}")
            raise

    def _loop_forever(self) -> None:
        eng = self.engine
        self._failures = 0
        while not self._stopping:
            if not eng.has_work():
                self._hand_over()  # anything held goes out before the thread sleeps
                self.last_step_time = time.monotonic()
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            if eng.num_waiting or eng.has_new_requests():
                self._hand_over()  # a prefill may make the next step long
            t0 = time.monotonic()
            self._step_started = t0
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - a bug outside the engine's stage isolation
                self._failures += 1
                outs = self._escaped(e)
            else:
                self._failures = 0
            now = time.monotonic()
            self._step_started = None
            self.last_step_time = now
            if outs:
                self._notify(outs, now - t0)
                with self._out_lock:
                    self._outbox.extend(outs)
                urgent = any(o.finished or o.seq.num_output == len(o.token_ids) for o in outs)
                steady = eng.has_work() and not eng.num_waiting and not eng.has_new_requests()
                if self.handoff.now(now, now - t0, urgent, steady):
                    self._hand_over()
            wait = backoff_s(max(self._failures, self._consecutive_failed()))
            if wait:  # steps keep failing: back off instead of spinning a core
                self._hand_over()
                self._wake.wait(wait)
                self._wake.clear()

    def _consecutive_failed(self) -> int:
        h = getattr(self.engine, "health", None)
        return h.consecutive_failed if h is not None else 0

    def _escaped(self, e: Exception) -> list:
        """An exception escaped ``Engine.step()``: the engine's state is unknown, so every active
        request fails (their outputs are returned); the loop goes on (backing off)."""
        self.num_step_errors += 1
        self._errlog.error(f"step:{type(e).__name__}", "engine step failed: %s: %s", type(e).__name__, e, exc_info=e)
        return self.engine.fail_all(e)

    def _notify(self, outs: list, step_seconds: float) -> None:
        for f in self.listeners:
            try:
                f(outs, step_seconds)
            except Exception:  # noqa: BLE001 - a listener never stops the engine
                log.exception("step listener failed")

    def _hand_over(self) -> None:
        """Wake the loop for the outbox; while it has not taken the previous hand-off yet, the
        outputs simply join it (no second wake-up)."""
        with self._out_lock:
            wake = bool(self._outbox) and not self._posted
            self._posted = self._posted or wake
        if wake:
            self._post(self._dispatch_outbox, None)

    def _post(self, fn, arg) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed (shutdown)
            pass

    # event-loop side -----------------------------------------------------------------------------
    def _on_engine_readable(self) -> None:
        """Engine process mode: the child wrote; relay its outputs (listeners, then the streams)."""
        eng = self.engine
        while True:
            try:
                items = eng.read_ready()
            except Exception:  # noqa: BLE001 - never kill the loop's reader
                log.exception("reading the engine process failed")
                items = []
            now = time.monotonic()
            for outs, dt in items:
                self.last_step_time = now
                if outs:
                    self._notify(outs, dt)
                    self._dispatch(outs)
            err = eng.take_error()
            if err is not None:  # a step raised in the child (which fails its requests itself)
                self.num_step_errors += 1
                self._errlog.error(f"child:{err.split(':', 1)[0]}", "engine step failed: %s", err)
                if eng.has_buffered():  # messages after the failed step: relay them too, in order
                    continue
            break
        # (the pipe's end of file arrives as a read with no messages: only then ask about the process)
        if not items and not eng.alive:
            self._stop_reading()
            log.critical("engine process died")
            self._fail_all("engine process died")

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            try:
                self._loop.remove_reader(self.engine.fileno())
            except (OSError, ValueError, RuntimeError):
                pass

    def _dispatch_outbox(self, _) -> None:
        with self._out_lock:
            outs, self._outbox = self._outbox, []
            self._posted = False
        self._dispatch(outs)

    def _dispatch(self, outs: list) -> None:
        streams = self._streams
        for out in outs:
            q = streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out if out.finish_reason != "error" else _failed(out))
                if out.finished:  # accounting must not wait for the consumer to resume
                    del streams[out.request_id]

    def _fail_all(self, msg: str) -> None:
        for rid in list(self._streams):
            self._streams.pop(rid).put_nowait(_admitted(RequestError("internal", msg)))

    def _fail(self, arg) -> None:
        rids, msg = arg
        for rid in rids:
            q = self._streams.pop(rid, None)
            if q is not None:
                q.put_nowait(_admitted(RequestError("internal", msg)))
