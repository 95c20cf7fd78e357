"""The one engine loop: steps an ``Engine`` and hands its outputs to the client, in a thread of the
server process (``ThreadLink``) or in the engine's own process (``specd.serving.engine_proc``).

``EngineLoop.run()`` takes commands from an inlet (``add`` / ``abort`` / ``snapshot`` / ``stop``),
steps the engine while it has work and hands ``Batch``es to an outlet. The same code in both places
means one policy for both:

- **failures**: a stage that fails inside ``Engine.step()`` fails only its request (the engine ends it
  with ``finish_reason: "error"``); an exception that escapes ``Engine.step()`` (a bug outside the
  stage isolation) is logged (rate-limited), reported in the next batch's ``errors`` and fails every
  active request (``Engine.fail_all``). While steps keep failing the loop backs off (20 ms doubling
  to 1 s, ``specd.engine.health.backoff_s``) and sends a snapshot with each failure, so the client's
  health sees it at once;
- **hand-off** (``HandOff``): sub-millisecond steps' outputs are held for at most the stream
  interval; a first token, a request's end, new requests and going idle flush at once;
- **snapshots** (``specd.engine.client.snapshot_of``): at most every 50 ms with the outputs while
  busy, whenever the engine goes idle, on a ``snapshot`` command, and with a heartbeat every 0.25 s
  while steps emit nothing (long prefills), so the client can tell a busy engine from a stuck one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from specd.engine.client import Batch, EngineLimits, limits_of, snapshot_of
from specd.engine.engine import RequestError
from specd.engine.health import RateLimitedLog, backoff_s

log = logging.getLogger("specd.engine_loop")

__all__ = ["DEFAULT_STREAM_INTERVAL_S", "CommandQueue", "EngineLoop", "HandOff", "ThreadLink"]

DEFAULT_STREAM_INTERVAL_S = 0.002
IDLE_WAIT_S = 0.5  # an idle loop wakes this often to check its inlet (no busy-wait)
SNAPSHOT_EVERY_S = 0.05
HEARTBEAT_S = 0.25


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


class CommandQueue:
    """The loop's inlet in a thread: ``put`` from any thread, ``take`` / ``wait`` on the loop's."""

    def __init__(self):
        self._items: list = []
        self._lock = threading.Lock()
        self._event = threading.Event()
        self.closed = False

    def put(self, cmd: tuple) -> None:
        with self._lock:
            self._items.append(cmd)
        self._event.set()

    def wake(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)

    def take(self) -> list:
        with self._lock:
            items, self._items = self._items, []
            self._event.clear()
        return items

    def close(self) -> None:
        self.closed = True
        self._event.set()


def _urgent(outs: list) -> bool:
    """A first token or a finished request among a step's outputs (they never wait)."""
    return any(o.finished or (o.token_ids and o.seq.num_output == len(o.token_ids)) for o in outs)


class EngineLoop:
    """Steps ``engine`` until a ``stop`` command, the inlet closing or the outlet failing.

    ``inlet``: ``take()`` -> commands, ``wait(timeout)``, ``closed``. ``outlet(batch) -> bool``: False
    once the client is gone. ``pack(outputs)``: what a step's outputs travel as (identity in a thread;
    picklable tuples to a parent process), called as the step ends. Only ``run()``'s thread touches
    the engine."""

    def __init__(self, engine, inlet, outlet: Callable[[Batch], bool], interval_s: float, pack=None, snapshot=None):
        self.engine = engine
        self.inlet = inlet
        self.outlet = outlet
        self.handoff = HandOff(interval_s)
        self.pack = pack or (lambda outs: outs)
        self.snapshot = snapshot or snapshot_of
        self.failures = 0  # exceptions that escaped Engine.step() in a row
        self._held: list = []  # [(packed outputs, step seconds)] not handed over yet
        self._errors: list = []
        self._refused: list = []
        self._force = False  # a snapshot was asked for
        self._last_snap = float("-inf")
        self._last_sent = time.monotonic()
        self._errlog = RateLimitedLog(log)

    def run(self) -> None:
        eng = self.engine
        while True:
            if not eng.has_work():
                if not self.flush():  # anything held goes out before the loop sleeps
                    return
                self.inlet.wait(IDLE_WAIT_S)
            cmds = self.inlet.take()
            if not self._apply(cmds) or self.inlet.closed:
                self.flush()
                return
            busy = eng.has_work()
            # new work (its prefill may make the next step long) or going idle: hand over what is held
            if (cmds or eng.num_waiting or eng.has_new_requests() or not busy) and not self.flush():
                return
            if busy and not self._step():
                return

    def _apply(self, cmds: list) -> bool:
        """Commands in arrival order; False on ``stop``."""
        eng = self.engine
        for cmd in cmds:
            op = cmd[0]
            if op == "add":
                _, rid, ids, params, spec, priority, tenant = cmd
                try:
                    eng.add_request(ids, params, spec, priority, rid, tenant=tenant)
                except (RequestError, ValueError) as e:  # the client validated: only races land here
                    self._refused.append((rid, getattr(e, "code", "invalid_request"), str(e)))
            elif op == "abort":
                eng.abort(cmd[1])
            elif op == "snapshot":
                self._force = True
            elif op == "stop":
                return False
        return True

    def _step(self) -> bool:
        """One engine step with the failure policy; False once the outlet fails."""
        eng = self.engine
        t0 = time.monotonic()
        try:
            outs = eng.step()
        except Exception as e:  # noqa: BLE001 - a bug outside the engine's stage isolation
            self.failures += 1
            outs = self._escaped(e)
        else:
            self.failures = 0
        now = time.monotonic()
        if outs:
            self._held.append((self.pack(outs), now - t0))
        wait = backoff_s(max(self.failures, eng.health.consecutive_failed))
        steady = eng.has_work() and not eng.num_waiting and not eng.has_new_requests()
        due = bool(outs) and self.handoff.now(now, now - t0, _urgent(outs), steady)
        beat = not outs and now - self._last_sent >= HEARTBEAT_S
        if (due or wait or beat or self._errors) and not self.flush(snapshot=bool(wait or beat)):
            return False
        if wait:  # steps keep failing: back off instead of spinning a core (a command wakes us)
            self.inlet.wait(wait)
        return True

    def _escaped(self, e: Exception) -> list:
        """The engine's state is unknown: every active request fails (their outputs are returned)."""
        self._errlog.error(f"step:{type(e).__name__}", "engine step failed: %s: %s", type(e).__name__, e, exc_info=e)
        self._errors.append(f"{type(e).__name__}: {e}")
        return self.engine.fail_all(e)

    def flush(self, snapshot: bool = False) -> bool:
        """Hand over what is held (with a snapshot when asked for, when idle, or 50 ms after the
        last one); False once the outlet fails."""
        force = snapshot or self._force
        if not (self._held or self._errors or self._refused or force):
            return True
        self._force = False
        now = time.monotonic()
        snap = None
        if force or now - self._last_snap >= SNAPSHOT_EVERY_S or not self.engine.has_work():
            snap, self._last_snap = self.snapshot(self.engine, self.failures), now
        batch = Batch(self._held, snap, self._errors, self._refused)
        self._held, self._errors, self._refused = [], [], []
        self._last_sent = now
        return self.outlet(batch)


class ThreadLink:
    """The engine loop in a thread of this process (``specd serve --engine-thread``, tests).

    Batches reach the event loop in ONE ``call_soon_threadsafe`` per hand-off; while the loop has
    not taken the previous hand-off yet, the next batch simply joins it (no second wake-up)."""

    relaying = False

    def __init__(self, engine, stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S):
        HandOff(stream_interval_s)  # (validates)
        self.engine = engine
        self.interval = stream_interval_s
        self.inlet = CommandQueue()
        self.thread: threading.Thread | None = None
        self._outbox: list = []
        self._lock = threading.Lock()
        self._posted = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Callable[[Batch], None] = lambda batch: None
        self._died: Callable[[str], None] = lambda msg: None
        self._limits: EngineLimits | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def limits(self) -> EngineLimits:
        if self._limits is None:
            self._limits = limits_of(self.engine)
        return self._limits

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def validate(self, prompt_ids: list, params) -> None:
        self.engine.validate(prompt_ids, params)

    def start(
        self, loop: asyncio.AbstractEventLoop, deliver: Callable[[Batch], None], died: Callable[[str], None]
    ) -> None:
        self._loop, self._deliver, self._died = loop, deliver, died
        self.thread = threading.Thread(target=self._run, name="specd-engine", daemon=True)
        self.thread.start()

    def send(self, cmd: tuple) -> None:
        self.inlet.put(cmd)

    def wake(self) -> None:
        self.inlet.wake()

    def detach(self) -> None:
        """Stop delivering batches (on the event loop, before ``close``)."""
        self._deliver = lambda batch: None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop and wait for the thread (blocking: call it off the event loop)."""
        self.inlet.close()
        t = self.thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout_s)

    def _run(self) -> None:
        try:
            EngineLoop(self.engine, self.inlet, self._outlet, self.interval).run()
        except BaseException as e:  # noqa: BLE001 - the thread is dying: fail everyone, don't hang them
            log.critical("engine thread died", exc_info=True)
            self._post(self._died, f"engine thread died: {type(e).__name__}: {e}")
            raise

    def _outlet(self, batch: Batch) -> bool:
        with self._lock:
            self._outbox.append(batch)
            wake = not self._posted
            self._posted = True
        if wake:
            self._post(self._take, None)
        return True

    def _take(self, _) -> None:
        with self._lock:
            batches, self._outbox = self._outbox, []
            self._posted = False
        for b in batches:
            self._deliver(b)

    def _post(self, fn: Callable, arg) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed (shutdown)
            pass
