"""The one engine loop: steps an ``Engine`` and hands its outputs to the client, in a thread of the
server process or in the engine's own process (``specd.engine.links``: ``ThreadLink``, ``ProcessLink``).

``EngineLoop.run()`` takes commands from an inlet (``Submit`` / ``Cancel`` / ``Snapshot`` / ``Stop`` /
``CheckGrammar``, ``specd.engine.commands``), steps the engine while it has work and hands ``Batch``es
to an outlet. The same code in both places means one policy for both:

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
  while steps emit nothing (long prefills), so the client can tell a busy engine from a stuck one;
- **idle work** (``idle``: the warm-up's row timings, ``specd.engine.warmup.Seeding.step``): while the
  engine has nothing to do, one short piece at a time instead of sleeping, the inlet read between
  pieces, until it says it is finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from specd.engine.client import snapshot_of
from specd.engine.commands import Batch, Cancel, CheckGrammar, GrammarChecked, Refused, Snapshot, Step, Stop, Submit
from specd.engine.health import RateLimitedLog, backoff_s
from specd.engine.requests import RequestError

log = logging.getLogger("specd.engine_loop")

__all__ = ["DEFAULT_STREAM_INTERVAL_S", "EngineLoop", "HandOff"]

DEFAULT_STREAM_INTERVAL_S = 0.002
IDLE_WAIT_S = 0.5  # an idle loop wakes this often to check its inlet (no busy-wait)
CHECK_WAIT_S = 0.005  # ... and this often while a CheckGrammar compiles
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


def _urgent(outs: list) -> bool:
    """A first token or a finished request among a step's outputs (they never wait)."""
    return any(o.finished or (o.token_ids and o.seq.num_output == len(o.token_ids)) for o in outs)


class EngineLoop:
    """Steps ``engine`` until a ``stop`` command, the inlet closing or the outlet failing.

    ``inlet``: ``take()`` -> commands, ``wait(timeout)``, ``closed``. ``outlet(batch) -> bool``: False
    once the client is gone. ``pack(outputs)``: what a step's outputs travel as (identity in a thread;
    wire records to a parent process: ``specd.engine.links.pack_outputs``), called as the step ends.
    Only ``run()``'s thread touches the engine."""

    def __init__(
        self,
        engine,
        inlet,
        outlet: Callable[[Batch], bool],
        interval_s: float,
        pack=None,
        snapshot=None,
        idle: Callable[[], bool] | None = None,
    ):
        self.engine = engine
        self.idle = idle  # work for idle moments, one short piece per call (False: finished)
        self.inlet = inlet
        self.outlet = outlet
        self.handoff = HandOff(interval_s)
        self.pack = pack or (lambda outs: outs)
        self.snapshot = snapshot or snapshot_of
        self.failures = 0  # exceptions that escaped Engine.step() in a row
        self._held: list = []  # [Step] (packed outputs) not handed over yet
        self._errors: list = []
        self._refused: list = []
        self._checks: list = []  # (check_id, Future[Grammar]) of CheckGrammar commands not answered yet
        self._checked: list = []  # [GrammarChecked] to hand over
        self._force = False  # a snapshot was asked for
        self._last_snap = float("-inf")
        self._last_sent = time.monotonic()
        self._errlog = RateLimitedLog(log)

    def run(self) -> None:
        eng = self.engine
        while True:
            if not eng.has_work():
                self._answer_checks()
                if not self.flush():  # anything held goes out before the loop sleeps
                    return
                if self.idle is None or self._checks:
                    self.inlet.wait(CHECK_WAIT_S if self._checks else IDLE_WAIT_S)
                else:
                    self._idle_piece()
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

    def _idle_piece(self) -> None:
        """One piece of the idle work (then the inlet is read again: a request waits for one piece at
        most); a piece that fails is logged and ends the idle work (serving goes on without it)."""
        assert self.idle is not None
        try:
            more = self.idle()
        except Exception as e:  # noqa: BLE001 - background work never stops the loop
            log.error("idle work failed (%s: %s); dropped", type(e).__name__, e, exc_info=e)
            more = False
        if not more:
            self.idle = None

    def _apply(self, cmds: list) -> bool:
        """Commands in arrival order; False on ``Stop``."""
        eng = self.engine
        for cmd in cmds:
            if isinstance(cmd, Submit):
                try:
                    ids, rid, g = list(cmd.prompt_ids), cmd.request_id, cmd.grammar
                    eng.add_request(ids, cmd.params, cmd.spec, cmd.priority, rid, tenant=cmd.tenant, grammar=g)
                except (RequestError, ValueError) as e:  # the client validated: only races land here
                    self._refused.append(Refused(cmd.request_id, getattr(e, "code", "invalid_request"), str(e)))
            elif isinstance(cmd, CheckGrammar):
                self._check(cmd)
            elif isinstance(cmd, Cancel):
                eng.abort(cmd.request_id)
            elif isinstance(cmd, Snapshot):
                self._force = True
            elif isinstance(cmd, Stop):
                return False
            else:  # a caller's bug: say so, keep serving everyone else
                log.error("ignored a message that is not an engine command: %.200r", cmd)
        return True

    def _check(self, cmd: CheckGrammar) -> None:
        """Start compiling a ``CheckGrammar``'s grammar in the engine's compiler (its cache)."""
        try:
            self._checks.append((cmd.check_id, self.engine.constraints.compile(cmd.grammar)))
        except Exception as e:  # noqa: BLE001 - e.g. no tokenizer: this check's answer, not the loop's end
            self._checked.append(GrammarChecked(cmd.check_id, "invalid_request", f"{type(e).__name__}: {e}"))

    def _answer_checks(self) -> None:
        """The compiled (or refused) grammars of ``CheckGrammar`` commands, into the next batch."""
        left = []
        for cid, fut in self._checks:
            if not fut.done():
                left.append((cid, fut))
                continue
            e = fut.exception()
            if e is None:
                self._checked.append(GrammarChecked(cid))
            else:  # (a GrammarError: code, message, field)
                code, msg = getattr(e, "code", "invalid_grammar"), getattr(e, "message", str(e))
                self._checked.append(GrammarChecked(cid, code, msg, getattr(e, "field", None)))
        self._checks = left

    def _step(self) -> bool:
        """One engine step with the failure policy; False once the outlet fails."""
        eng = self.engine
        self._answer_checks()
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
            self._held.append(Step(self.pack(outs), now - t0))
        wait = backoff_s(max(self.failures, eng.health.consecutive_failed))
        steady = eng.has_work() and not eng.num_waiting and not eng.has_new_requests()
        due = bool(outs) and self.handoff.now(now, now - t0, _urgent(outs), steady)
        beat = not outs and now - self._last_sent >= HEARTBEAT_S
        if (due or wait or beat or self._errors or self._checked) and not self.flush(snapshot=bool(wait or beat)):
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
        if not (self._held or self._errors or self._refused or self._checked or force):
            return True
        self._force = False
        now = time.monotonic()
        snap = None
        if force or now - self._last_snap >= SNAPSHOT_EVERY_S or not self.engine.has_work():
            snap, self._last_snap = self.snapshot(self.engine, self.failures), now
        batch = Batch(self._held, snap, self._errors, self._refused, self._checked)
        self._held, self._errors, self._refused, self._checked = [], [], [], []
        self._last_sent = now
        return self.outlet(batch)
