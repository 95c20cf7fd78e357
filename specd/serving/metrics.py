"""Prometheus metrics in the text exposition format (hand-written: no runtime dependency).

Event metrics (histograms, counters) are recorded by ``Metrics.on_step``, an ``AsyncEngine``
listener that runs in the engine thread; request refusals by the servers (``count_error``) on the
event loop. Every metric has a single writer thread, so no locks. Gauges (queues, KV blocks, speculation
totals) are read from the engine when ``/metrics`` is scraped.

Inter-token latency is per output token: a step that emits n tokens for a request, t seconds after its
previous emission, records n observations of t / n (speculation makes several tokens share one step).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable

TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(d: dict) -> str:
    if not d:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in d.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(d.keys(), esc)) + "}"


class Histogram:
    def __init__(self, buckets: Iterable[float]):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last = +Inf overflow
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += n
        self.sum += v * n
        self.count += n

    def lines(self, name: str, labels: dict) -> list:
        out, acc = [], 0
        for b, c in zip(self.bounds + (math.inf,), self.counts):
            acc += c
            out.append(f"{name}_bucket{_labels({**labels, 'le': _fmt(b)})} {acc}")
        out.append(f"{name}_count{_labels(labels)} {self.count}")
        out.append(f"{name}_sum{_labels(labels)} {_fmt(self.sum)}")
        return out


class Metrics:
    """All the daemon's metrics. ``engine_getter()`` returns the Engine (None while loading)."""

    def __init__(
        self,
        engine_getter: Callable[[], object | None],
        ready_getter: Callable[[], bool] = lambda: True,
        loop_getter: Callable[[], object | None] = lambda: None,
        connections_getter: Callable[[], int] = lambda: 0,
        log_request: Callable | None = None,
    ):
        self.engine_getter = engine_getter
        self.ready_getter = ready_getter
        self.loop_getter = loop_getter  # the AsyncEngine (step errors, watchdog state)
        self.connections_getter = connections_getter
        self.log_request = log_request  # f(RequestOutput) for finished requests (engine thread)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.step_time = Histogram(STEP_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished: dict = {}  # finish_reason -> count
        self.errors: dict = {}  # error code -> count (refusals, event-loop thread)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self._last_emit: dict = {}  # request id -> monotonic time of its previous emission

    # engine thread ------------------------------------------------------------------------------
    def on_step(self, outputs: list, step_seconds: float) -> None:
        self.steps += 1
        self.step_time.observe(step_seconds)
        now = time.monotonic()
        for out in outputs:
            seq = out.seq
            rid = out.request_id
            n = len(out.token_ids)
            if n:
                prev = self._last_emit.get(rid)
                if prev is None:
                    ft = seq.first_token_time if seq.first_token_time is not None else now
                    self.ttft.observe(max(0.0, ft - seq.arrival))
                    if n > 1:  # tokens that arrived with the first one: zero latency after it
                        self.itl.observe(0.0, n - 1)
                else:
                    self.itl.observe((now - prev) / n, n)
                self._last_emit[rid] = now
                self.generation_tokens += n
            if out.finished:
                self._last_emit.pop(rid, None)
                r = out.finish_reason or "unknown"
                self.finished[r] = self.finished.get(r, 0) + 1
                self.prompt_tokens += seq.num_prompt
                if seq.finish_time is not None:
                    self.e2e.observe(max(0.0, seq.finish_time - seq.arrival))
                if self.log_request is not None:
                    self.log_request(out)

    # event loop ---------------------------------------------------------------------------------
    def count_error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def render(self) -> bytes:
        lines: list = []

        def metric(name, kind, help_, samples):
            if kind == "counter":  # text format 0.0.4: the family is named with the _total suffix
                name += "_total"
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, v in samples:
                lines.append(f"{name}{_labels(labels)} {_fmt(v)}")

        def hist(name, help_, h):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} histogram")
            lines.extend(h.lines(name, {}))

        eng = self.engine_getter()
        metric(
            "specd_ready",
            "gauge",
            "1 when serving (models loaded, not draining)",
            [({}, 1 if self.ready_getter() else 0)],
        )
        metric("specd_websocket_connections", "gauge", "open websocket connections", [({}, self.connections_getter())])
        if eng is not None:
            sch = eng.scheduler
            running = {"interactive": 0, "batch": 0}
            for s in list(sch.running):
                running[s.priority] = running.get(s.priority, 0) + 1
            try:
                waiting = sch.queue_lengths()
            except RuntimeError:  # mutated mid-iteration by the engine thread
                waiting = {"interactive": 0, "batch": 0}
            metric(
                "specd_requests_running",
                "gauge",
                "requests in the running batch",
                [({"priority": k}, v) for k, v in running.items()],
            )
            metric(
                "specd_requests_waiting",
                "gauge",
                "requests waiting to be scheduled",
                [({"priority": k}, v) for k, v in waiting.items()],
            )
            t_used, d_used = eng.kv_blocks_used()
            used = [({"cache": "target"}, t_used)]
            total = [({"cache": "target"}, eng.cache.pool.num_blocks)]
            if eng.draft_cache is not None:
                used.append(({"cache": "draft"}, d_used))
                total.append(({"cache": "draft"}, eng.draft_cache.pool.num_blocks))
            metric("specd_kv_blocks_used", "gauge", "KV cache blocks allocated", used)
            metric("specd_kv_blocks_total", "gauge", "KV cache blocks in the pool", total)
            st = eng.stats
            drafts = st.drafted_per_depth[0] if st.drafted_per_depth else 0
            metric(
                "specd_spec_decode_num_drafts", "counter", "verification steps that had draft tokens", [({}, drafts)]
            )
            metric("specd_spec_decode_num_draft_tokens", "counter", "draft tokens proposed", [({}, st.draft_tokens)])
            metric(
                "specd_spec_decode_num_accepted_tokens", "counter", "draft tokens accepted", [({}, st.accepted_tokens)]
            )
            metric(
                "specd_spec_decode_num_accepted_tokens_per_pos",
                "counter",
                "draft tokens accepted at each tree depth (position 0 = first draft token)",
                [
                    ({"position": str(i)}, st.accepted_per_depth[i] if i < len(st.accepted_per_depth) else 0)
                    for i in range(max(len(st.accepted_per_depth), len(st.drafted_per_depth)))
                ],
            )
            metric(
                "specd_spec_decode_verify_steps",
                "counter",
                "target verification steps (all requests)",
                [({}, st.steps)],
            )
            metric(
                "specd_preemptions", "counter", "running requests preempted for KV space", [({}, sch.num_preemptions)]
            )
            metric(
                "specd_spec_budget",
                "gauge",
                "draft tokens granted in the last step (all requests)",
                [({}, sch.last_spec_budget)],
            )
            metric(
                "specd_spec_depth",
                "gauge",
                "draft depth the adaptive policy chose for the last step",
                [({}, getattr(sch, "last_depth", 0))],
            )
            rate = _prefix_hit_rate(eng)
            if rate is not None:
                metric(
                    "specd_prefix_cache_hit_rate",
                    "gauge",
                    "prompt tokens served from the prefix cache / prompt tokens",
                    [({}, rate)],
                )
        metric("specd_engine_steps", "counter", "engine steps that emitted outputs", [({}, self.steps)])
        ae = self.loop_getter()
        if ae is not None:
            metric(
                "specd_engine_step_errors",
                "counter",
                "exceptions that escaped an engine step (every active request failed)",
                [({}, ae.num_step_errors)],
            )
            metric(
                "specd_engine_healthy",
                "gauge",
                "1 while the engine completes steps (/readyz, /healthz and the systemd watchdog follow it)",
                [({}, 1 if ae.unhealthy_reason() is None else 0)],
            )
        _health_metrics(metric, eng)
        hist("specd_engine_step_seconds", "duration of one engine step", self.step_time)
        hist("specd_time_to_first_token_seconds", "request arrival to its first token", self.ttft)
        hist("specd_inter_token_latency_seconds", "latency per output token after the first", self.itl)
        hist("specd_e2e_request_latency_seconds", "request arrival to its last token", self.e2e)
        metric(
            "specd_requests",
            "counter",
            "finished requests by finish reason",
            [({"finish_reason": k}, v) for k, v in sorted(self.finished.items())] or [({"finish_reason": "stop"}, 0)],
        )
        metric(
            "specd_request_errors",
            "counter",
            "refused requests and protocol errors by code",
            [({"code": k}, v) for k, v in sorted(self.errors.items())],
        )
        metric("specd_prompt_tokens", "counter", "prompt tokens of finished requests", [({}, self.prompt_tokens)])
        metric("specd_generation_tokens", "counter", "generated tokens", [({}, self.generation_tokens)])
        return "\n".join(lines).encode() + b"\n"


def _health_metrics(metric, eng) -> None:
    """Failed steps and failed requests by stage (``specd.engine.health``), from the engine's snapshot."""
    fn = getattr(eng, "health_snapshot", None) if eng is not None else None
    snap = fn() if fn is not None else None
    if not snap:
        return
    metric(
        "specd_engine_failed_steps",
        "counter",
        "engine steps in which a stage raised, by stage",
        [({"stage": k}, v) for k, v in snap["failed_steps"].items()],
    )
    metric(
        "specd_engine_failed_requests",
        "counter",
        "requests ended with finish_reason error, by the stage that failed",
        [({"stage": k}, v) for k, v in snap["failed_requests"].items()],
    )
    metric(
        "specd_engine_consecutive_failed_steps",
        "gauge",
        "failed engine steps in a row (0 after a step that made progress)",
        [({}, snap["consecutive_failed"])],
    )


def _prefix_hit_rate(eng) -> float | None:
    s = getattr(eng, "prefix_cache_stats", None)
    if s is None:
        return None
    try:
        if callable(s):
            s = s()
        if isinstance(s, (int, float)):
            return float(s)
        if isinstance(s, dict):
            if "hit_rate" in s:
                return float(s["hit_rate"])
            q, h = s.get("queries", s.get("query_tokens")), s.get("hits", s.get("hit_tokens"))
        else:
            if hasattr(s, "hit_rate"):
                return float(s.hit_rate)
            q, h = getattr(s, "queries", None), getattr(s, "hits", None)
        if q is None or h is None:
            return None
        return float(h) / float(q) if q else 0.0
    except Exception:  # noqa: BLE001 - metrics must never break the scrape
        return None
