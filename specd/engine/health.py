"""Engine health: which stages fail, whether the engine still completes steps, and quiet error logs.

Vocabulary (used by the engine, the servers and ``/metrics``):

- a **stage** is one part of ``Engine.step()``: ``schedule``, ``draft``, ``forward`` (the target's
  forward pass), ``verify``, ``commit`` (KV compaction and per-request bookkeeping), ``emit``
  (tokens, stop conditions, text) and ``policy`` (feeding the adaptive speculation cost model);
  ``step`` counts what escaped ``Engine.step()`` outside them (a bug; every active request fails);
- a **failed request** ended with ``finish_reason: "error"`` because a stage raised while running it
  (the engine isolates it from the rest of the batch, see ``Engine.step``);
- a **failed step** is a step in which a stage raised and no request completed its work;
- the engine is **unhealthy** while ``max_failed_steps`` steps in a row have failed, or while work is
  queued and no step has completed for ``progress_timeout_s``. The servers report it (``/readyz`` and
  ``/healthz`` 503, no systemd watchdog ping) and exit after a bounded time in that state.

Example: a request with a sampling parameter the engine cannot represent fails in ``verify`` alone;
the other requests of its batch finish their step in a smaller batch. ``failed_requests["verify"]``
and ``failed_steps["verify"]`` count one each; the step still made progress, so the engine stays
healthy. A target model that raises for every batch fails every step: after ``max_failed_steps`` of
them the engine is unhealthy until a step completes again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

STAGES = ("schedule", "draft", "forward", "verify", "commit", "emit", "policy", "step")
DEFAULT_MAX_FAILED_STEPS = 5


def backoff_s(consecutive_failures: int) -> float:
    """Seconds to wait before the next step after ``consecutive_failures`` failed steps in a row:
    0, then 20 ms doubling up to 1 s (a failing engine never spins a core)."""
    if consecutive_failures <= 0:
        return 0.0
    return min(1.0, 0.01 * 2 ** min(consecutive_failures, 10))


class EngineHealth:
    """Counters the engine keeps as it steps (one thread); ``snapshot()`` is what servers read."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.failed_steps = dict.fromkeys(STAGES, 0)  # steps in which this stage raised
        self.failed_requests = dict.fromkeys(STAGES, 0)  # requests ended with "error", by stage
        self.consecutive_failed = 0  # failed steps in a row (0 after any step that made progress)
        self.stage_failures = 0  # stages that raised, in all (the engine compares it across a step)
        self.last_progress = clock()  # when a step last completed work, or found none to do

    def request_failed(self, stage: str) -> None:
        self.failed_requests[stage] += 1

    def stage_failed(self, stage: str) -> None:
        self.failed_steps[stage] += 1
        self.stage_failures += 1

    def step_ended(self, progressed: bool, failed: bool) -> None:
        """After every step: ``progressed`` = some request completed its work (or there was none to
        do); ``failed`` = some stage raised."""
        if progressed or not failed:
            self.consecutive_failed = 0
            self.last_progress = self.clock()
        else:
            self.consecutive_failed += 1

    def snapshot(self) -> dict:
        """A picklable copy (sent by the engine process with its state snapshots)."""
        return {
            "failed_steps": dict(self.failed_steps),
            "failed_requests": dict(self.failed_requests),
            "consecutive_failed": self.consecutive_failed,
            "last_progress": self.last_progress,
        }


def unhealthy_reason(
    snap: dict | None, now: float, has_work: bool, max_failed_steps: int, progress_timeout_s: float
) -> str | None:
    """None while an engine with health ``snap`` (``EngineHealth.snapshot()``) completes steps, else
    why not, in one line. ``now`` and ``snap["last_progress"]`` are ``time.monotonic()`` readings
    (system-wide on Linux, so an engine process's snapshot compares with the server's clock)."""
    if not snap:
        return None
    n = snap["consecutive_failed"]
    if max_failed_steps > 0 and n >= max_failed_steps:
        return f"{n} engine steps in a row failed"
    idle_for = now - snap["last_progress"]
    if has_work and idle_for > progress_timeout_s:
        return f"no engine step completed for {idle_for:.1f} s while requests are queued"
    return None


class RateLimitedLog:
    """Logs each distinct error at most once per ``interval_s``: the first occurrence in full (with
    its traceback), the repeats counted and reported in one line when the key next logs.

    ``key`` identifies "the same error" (stage + exception type + message, say); at most
    ``max_keys`` keys are remembered (the oldest is forgotten first).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 256,
    ):
        self.log = logger
        self.interval = interval_s
        self.clock = clock
        self.max_keys = max_keys
        self._seen: dict = {}  # key -> [window start, repeats suppressed in this window]

    def error(self, key: str, msg: str, *args, exc_info=None, extra=None) -> bool:
        """Log (True) or count (False) one occurrence."""
        now = self.clock()
        st = self._seen.get(key)
        if st is not None and now - st[0] < self.interval:
            st[1] += 1
            return False
        if st is not None and st[1]:
            self.log.error(msg + " (and %d more times in the last %.0f s)", *args, st[1], now - st[0], extra=extra)
        else:
            self.log.error(msg, *args, exc_info=exc_info, extra=extra)
        if st is None and len(self._seen) >= self.max_keys:
            self._seen.pop(next(iter(self._seen)))
        self._seen[key] = [now, 0]
        return True
