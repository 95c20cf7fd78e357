"""What crosses the engine boundary: every message between the engine client (on the server's event
loop) and the engine loop (``specd.engine.loop``, on a thread or in the engine process), as frozen
dataclasses that pickle for the process link (``specd.engine.links``).

client -> engine loop
    ``Submit``    a request: its id, prompt token ids, ``SamplingParams``, ``SpecParams``, priority,
                  tenant (a digest of the caller's API key: what drafting may read) and grammar (a
                  ``specd.structured.GrammarSpec`` the reply must match, or None; it pickles: frozen
                  dataclasses of JSON data)
    ``Cancel``    end a request (``finish_reason: "cancelled"``); its KV blocks are freed that step
    ``Snapshot``  send an ``EngineSnapshot`` now
    ``Stop``      leave the loop
    ``Start``     the engine process's first message: its ``EngineConfig``, log level, stream interval
engine loop -> client
    ``Ready`` / ``LoadFailed``  the engine process is up (its ``EngineLimits``) / could not load
    ``Batch``     the outputs of one or more engine ``Step``s, a snapshot or None, the exceptions that
                  escaped ``Engine.step()`` and the requests the engine ``Refused`` on arrival; a
                  batch without steps is a heartbeat (a snapshot while a long step runs, or idle);
                  from the engine process each output comes with the request's figures
                  (``SeqState``) on its first token and at its end

A request is validated once (``specd.engine.requests``): ``Submit`` checks what it carries beyond
the parameters' own checks (id, priority, types); ``EngineLimits.validate`` checks it against the
model. A new sampling parameter is a field of ``SamplingParams``: it travels inside ``Submit.params``
and nothing here changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specd.engine.requests import RequestError, check_priority, validate_request
from specd.engine.sequence import SpecParams, SpecStats
from specd.sampling.params import SamplingParams

__all__ = [
    "Batch",
    "Cancel",
    "CheckGrammar",
    "Command",
    "EngineLimits",
    "EngineSnapshot",
    "GrammarChecked",
    "LoadFailed",
    "Ready",
    "Refused",
    "SeqState",
    "Snapshot",
    "Start",
    "Step",
    "Stop",
    "Submit",
]


# client -> engine loop -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    """A request for the engine. ``prompt_ids`` is kept as a tuple (the engine gets a list);
    ``grammar``: a ``specd.structured.GrammarSpec`` or None (free text)."""

    request_id: str
    prompt_ids: tuple
    params: SamplingParams
    spec: SpecParams = SpecParams()
    priority: str = "interactive"
    tenant: str | None = None
    grammar: Any = None

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RequestError("invalid_request", f"request id must be a non-empty string, got {self.request_id!r:.80}")
        if not isinstance(self.params, SamplingParams) or not isinstance(self.spec, SpecParams):
            raise TypeError("Submit needs SamplingParams and SpecParams")
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise TypeError(f"tenant must be a string or None, got {type(self.tenant).__name__}")
        if self.grammar is not None:
            from specd.structured.spec import GrammarSpec  # (only a constrained request needs the library)

            if not isinstance(self.grammar, GrammarSpec):
                raise TypeError(f"grammar must be a GrammarSpec or None, got {type(self.grammar).__name__}")
        check_priority(self.priority)
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))


@dataclass(frozen=True)
class CheckGrammar:
    """Compile ``grammar`` (a ``GrammarSpec``) in the engine's own compiler and answer with a
    ``GrammarChecked`` in a later batch: how an engine process checks a request's grammar before
    its answer starts, so that each grammar is compiled once, where it is used (the compiler's cache
    then hands the ``Submit`` its grammar at once)."""

    check_id: int
    grammar: Any


@dataclass(frozen=True)
class GrammarChecked:
    """The answer to ``CheckGrammar``: ``code`` None when the grammar compiled, else the
    ``GrammarError``'s code, message and field."""

    check_id: int
    code: str | None = None
    message: str = ""
    field: str | None = None


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Snapshot:
    """Ask the engine loop for an ``EngineSnapshot`` in its next batch."""


@dataclass(frozen=True)
class Stop:
    """Leave the engine loop (the engine process then exits)."""


@dataclass(frozen=True)
class Start:
    """The engine process's first message: what to load and how to run."""

    cfg: Any  # specd.config.EngineConfig
    log_level: int
    stream_interval_s: float


Command = Submit | Cancel | Snapshot | Stop | CheckGrammar


# engine loop -> client -----------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineLimits:
    """What a front end needs to refuse a request before it reaches the engine (no compute);
    ``stop_ids``: the tokens that end a reply (a grammar compiled outside the engine must allow
    exactly these where the reply may end)."""

    max_model_len: int
    block_size: int
    num_blocks: int
    draft_num_blocks: int | None
    vocab_size: int
    has_draft: bool
    threads: int = 0
    stop_ids: tuple = ()

    def validate(self, req: Submit) -> None:
        """``RequestError`` (``too_long`` / ``invalid_request``) for a request that can never run."""
        validate_request(
            req.prompt_ids, req.params, self.max_model_len, self.block_size, self.num_blocks, self.vocab_size
        )


@dataclass(frozen=True)
class Ready:
    limits: EngineLimits


@dataclass(frozen=True)
class LoadFailed:
    message: str


def _empty_prefix() -> dict:
    return {"query_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0, "evictions": 0}


@dataclass(frozen=True)
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
    graphs: dict = field(default_factory=dict)  # CUDA graph counters per forward (specd.engine.step_graphs)


@dataclass(frozen=True)
class Refused:
    """A request the engine refused on arrival (a race its validation could not see)."""

    request_id: str
    code: str
    message: str


SEQ_FIELDS = (
    "priority",
    "spec",
    "num_prompt",
    "num_output",
    "arrival",
    "scheduled_time",
    "first_token_time",
    "finish_time",
    "num_preemptions",
    "finish_reason",
    "error",
    "cached_prefix_tokens",
    "stats",
)


@dataclass(frozen=True, slots=True)
class SeqState:
    """A request's figures as the engine process saw them (what the servers read of ``out.seq``)."""

    priority: str
    spec: SpecParams
    num_prompt: int
    num_output: int
    arrival: float
    scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    finish_reason: str | None
    error: str | None
    cached_prefix_tokens: int
    stats: SpecStats

    @classmethod
    def of(cls, seq) -> SeqState:
        return cls(*(getattr(seq, k) for k in SEQ_FIELDS))


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step's outputs and how long it took (``RequestOutput``s; in the engine process, its
    wire records until the parent decodes them: ``specd.engine.links``)."""

    outputs: list
    seconds: float


@dataclass(frozen=True)
class Batch:
    """What the engine loop hands its client at once: ``steps`` in order, a state snapshot or None,
    the exceptions that escaped ``Engine.step()`` since the last batch (``"Type: message"``; each failed
    every active request, whose error outputs are in ``steps``), and requests refused on arrival."""

    steps: list = field(default_factory=list)  # [Step]
    snapshot: EngineSnapshot | None = None
    errors: list = field(default_factory=list)  # [str]
    refused: list = field(default_factory=list)  # [Refused]
    checked: list = field(default_factory=list)  # [GrammarChecked]
