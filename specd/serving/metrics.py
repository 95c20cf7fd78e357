"""Prometheus metrics in the text exposition format (hand-written: no runtime dependency).

Event metrics (histograms, counters) are recorded by ``Metrics.on_step``, an ``EngineClient``
listener, and request refusals by the servers (``count_error``), all on the event loop: one writer
thread, no locks. Gauges and the engine's counters (queues, KV blocks, speculation totals, failed
steps) come from the client's latest ``EngineSnapshot`` when ``/metrics`` is scraped.

Every sample carries ``replica`` (``--replica``, default ``<hostname>:<port>``) so that a fleet's
series stay apart whatever the scraper adds (docs/operations.md, "Reading the fleet's metrics").

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
    """All the daemon's metrics. ``client_getter()`` returns the ``EngineClient`` (None while loading):
    gauges and engine counters come from its ``snapshot()``, health from ``unhealthy_reason()``."""

    def __init__(
        self,
        client_getter: Callable[[], object | None],
        ready_getter: Callable[[], bool] = lambda: True,
        connections_getter: Callable[[], int] = lambda: 0,
        log_request: Callable | None = None,
        replica_getter: Callable[[], str | None] = lambda: None,
    ):
        self.client_getter = client_getter
        self.replica_getter = replica_getter
        self.ready_getter = ready_getter
        self.connections_getter = connections_getter
        self.log_request = log_request  # f(RequestOutput) for finished requests (event loop)
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

    # engine steps (an EngineClient listener, on the event loop) ----------------------------------
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
        """The Prometheus text (format 0.0.4) of every metric."""
        replica = self.replica_getter()
        out = _Text({"replica": replica} if replica else {})
        client = self.client_getter()
        ready = [({}, int(self.ready_getter()))]
        out.metric("specd_ready", "gauge", "1 when serving (models loaded, not draining)", ready)
        out.metric(
            "specd_websocket_connections", "gauge", "open websocket connections", [({}, self.connections_getter())]
        )
        if client is not None:
            snap = client.snapshot()
            _engine_metrics(out, snap, client.limits)
            _spec_metrics(out, snap)
            _graph_metrics(out, getattr(snap, "graphs", None) or {})
        out.metric("specd_engine_steps", "counter", "engine steps that emitted outputs", [({}, self.steps)])
        if client is not None:
            _health_metrics(out, client)
        out.hist("specd_engine_step_seconds", "duration of one engine step", self.step_time)
        out.hist("specd_time_to_first_token_seconds", "request arrival to its first token", self.ttft)
        out.hist("specd_inter_token_latency_seconds", "latency per output token after the first", self.itl)
        out.hist("specd_e2e_request_latency_seconds", "request arrival to its last token", self.e2e)
        finished = [({"finish_reason": k}, v) for k, v in sorted(self.finished.items())]
        out.metric(
            "specd_requests",
            "counter",
            "finished requests by finish reason",
            finished or [({"finish_reason": "stop"}, 0)],
        )
        out.metric(
            "specd_request_errors",
            "counter",
            "refused requests and protocol errors by code",
            [({"code": k}, v) for k, v in sorted(self.errors.items())],
        )
        out.metric("specd_prompt_tokens", "counter", "prompt tokens of finished requests", [({}, self.prompt_tokens)])
        out.metric("specd_generation_tokens", "counter", "generated tokens", [({}, self.generation_tokens)])
        return "\n".join(out.lines).encode() + b"\n"


class _Text:
    """Exposition-format lines being built."""

    def __init__(self, base: dict):
        self.lines: list = []
        self.base = base  # labels of every sample (the replica)

    def metric(self, name: str, kind: str, help_: str, samples) -> None:
        if kind == "counter":  # text format 0.0.4: the family is named with the _total suffix
            name += "_total"
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, v in samples:
            self.lines.append(f"{name}{_labels({**self.base, **labels})} {_fmt(v)}")

    def hist(self, name: str, help_: str, h: Histogram) -> None:
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} histogram")
        self.lines.extend(h.lines(name, self.base))


def _engine_metrics(out: _Text, snap, limits) -> None:
    """Queues, KV blocks, scheduler counters and the prefix cache, from an ``EngineSnapshot``."""
    by_prio = lambda d: [({"priority": k}, v) for k, v in d.items()]  # noqa: E731
    out.metric("specd_requests_running", "gauge", "requests in the running batch", by_prio(snap.running))
    out.metric("specd_requests_waiting", "gauge", "requests waiting to be scheduled", by_prio(snap.waiting))
    used = [({"cache": "target"}, snap.kv_used[0])]
    total = [({"cache": "target"}, limits.num_blocks)]
    if limits.draft_num_blocks is not None:
        used.append(({"cache": "draft"}, snap.kv_used[1]))
        total.append(({"cache": "draft"}, limits.draft_num_blocks))
    out.metric("specd_kv_blocks_used", "gauge", "KV cache blocks allocated", used)
    out.metric("specd_kv_blocks_total", "gauge", "KV cache blocks in the pool", total)
    out.metric("specd_preemptions", "counter", "running requests preempted for KV space", [({}, snap.preemptions)])
    out.metric(
        "specd_spec_budget", "gauge", "draft tokens granted in the last step (all requests)", [({}, snap.spec_budget)]
    )
    out.metric(
        "specd_spec_depth", "gauge", "draft depth the adaptive policy chose for the last step", [({}, snap.depth)]
    )
    _prefix_metrics(out, snap.prefix)


def _prefix_metrics(out: _Text, prefix: dict) -> None:
    """The prefix cache: looked-up and served prompt tokens (counters: a fleet's hit rate is the ratio
    of their sums) and this replica's hit rate since it started."""
    for key, name, what in (
        ("query_tokens", "specd_prefix_cache_queries", "prompt tokens looked up in the prefix cache"),
        ("hit_tokens", "specd_prefix_cache_hits", "prompt tokens served from the prefix cache"),
    ):
        v = prefix.get(key) if isinstance(prefix, dict) else None
        if isinstance(v, (int, float)):
            out.metric(name, "counter", what, [({}, v)])
    rate = _prefix_hit_rate(prefix)
    if rate is not None:
        out.metric(
            "specd_prefix_cache_hit_rate",
            "gauge",
            "prompt tokens served from the prefix cache / prompt tokens",
            [({}, rate)],
        )


def _spec_metrics(out: _Text, snap) -> None:
    """Speculation totals (vLLM's spec-decode names)."""
    st = snap.stats
    drafts = st.drafted_per_depth[0] if st.drafted_per_depth else 0
    out.metric("specd_spec_decode_num_drafts", "counter", "verification steps that had draft tokens", [({}, drafts)])
    out.metric("specd_spec_decode_num_draft_tokens", "counter", "draft tokens proposed", [({}, st.draft_tokens)])
    out.metric("specd_spec_decode_num_accepted_tokens", "counter", "draft tokens accepted", [({}, st.accepted_tokens)])
    depths = max(len(st.accepted_per_depth), len(st.drafted_per_depth))
    out.metric(
        "specd_spec_decode_num_accepted_tokens_per_pos",
        "counter",
        "draft tokens accepted at each tree depth (position 0 = first draft token)",
        [
            ({"position": str(i)}, st.accepted_per_depth[i] if i < len(st.accepted_per_depth) else 0)
            for i in range(depths)
        ],
    )
    out.metric(
        "specd_spec_decode_verify_steps", "counter", "target verification steps (all requests)", [({}, st.steps)]
    )
    by = sorted(st.by_proposer.items())
    for i, (name, what) in enumerate(
        (
            ("specd_spec_decode_proposer_steps", "verification steps with drafts from each proposer"),
            ("specd_spec_decode_proposer_draft_tokens", "draft tokens proposed, by proposer"),
            ("specd_spec_decode_proposer_accepted_tokens", "draft tokens accepted, by proposer"),
        )
    ):
        out.metric(name, "counter", what, [({"proposer": k}, row[i]) for k, row in by])


GRAPH_METRICS = (  # (key of specd.model.graphs.merged_stats, metric, kind, help)
    ("graphs", "specd_cuda_graphs", "gauge", "step widths captured as CUDA graphs at start-up, by forward"),
    ("refused", "specd_cuda_graphs_refused", "gauge", "bucketed widths the graph memory bound left eager"),
    ("memory_bytes", "specd_cuda_graph_memory_bytes", "gauge", "static buffers and graphs, by forward"),
    ("capture_s", "specd_cuda_graph_capture_seconds", "gauge", "time capturing the graphs at start-up"),
    ("replays", "specd_cuda_graph_replays", "counter", "forwards replayed from a captured graph"),
    ("eager_steps", "specd_cuda_graph_eager_steps", "counter", "forwards outside every captured bucket (eager)"),
    ("padded_tokens", "specd_cuda_graph_padded_tokens", "counter", "padding rows replayed up to the buckets"),
)


def _graph_metrics(out: _Text, graphs: dict) -> None:
    """The captured forwards' counters (``specd.engine.step_graphs.graph_stats``): one sample per
    forward (``target``, ``draft``); nothing where the engine runs eagerly."""
    if not graphs:
        return
    for key, name, kind, what in GRAPH_METRICS:
        out.metric(name, kind, what, [({"forward": f}, s.get(key, 0)) for f, s in sorted(graphs.items())])


def _health_metrics(out: _Text, client) -> None:
    """Step errors, health, and failed steps / requests by stage (``specd.engine.health``)."""
    out.metric(
        "specd_engine_step_errors",
        "counter",
        "exceptions that escaped an engine step (every active request failed)",
        [({}, client.num_step_errors)],
    )
    out.metric(
        "specd_engine_healthy",
        "gauge",
        "1 while the engine completes steps (/readyz, /healthz and the systemd watchdog follow it)",
        [({}, 1 if client.unhealthy_reason() is None else 0)],
    )
    snap = client.snapshot().health
    if not snap:
        return
    out.metric(
        "specd_engine_failed_steps",
        "counter",
        "engine steps in which a stage raised, by stage",
        [({"stage": k}, v) for k, v in snap["failed_steps"].items()],
    )
    out.metric(
        "specd_engine_failed_requests",
        "counter",
        "requests ended with finish_reason error, by the stage that failed",
        [({"stage": k}, v) for k, v in snap["failed_requests"].items()],
    )
    out.metric(
        "specd_engine_consecutive_failed_steps",
        "gauge",
        "failed engine steps in a row (0 after a step that made progress)",
        [({}, snap["consecutive_failed"])],
    )


def _prefix_hit_rate(prefix: dict) -> float | None:
    try:
        return float(prefix["hit_rate"])
    except (KeyError, TypeError, ValueError):  # metrics must never break the scrape
        return None
