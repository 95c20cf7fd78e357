"""Per-request state: tokens, cache block tables, sampling, speculation settings and stats."""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field

import torch

from specd.engine.detokenizer import IncrementalDetokenizer
from specd.engine.kv_cache import SeqBlocks
from specd.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


PRIORITIES = {"interactive": 0, "batch": 1}
# per request: auto = the server's default; chain / tree = the draft model (or the feature head);
# head = a tree drafted by the feature head; ngram = prompt lookup
SPEC_MODES = ("auto", "off", "chain", "tree", "head", "ngram", "hybrid")


@dataclass(frozen=True)
class SpecParams:
    """Per-request speculation: ``auto`` lets the scheduler decide; ``max_draft_tokens`` caps the tree."""

    mode: str = "auto"  # auto | off | chain | tree | head | ngram
    max_draft_tokens: int | None = None

    def __post_init__(self):
        if self.mode not in SPEC_MODES:
            raise ValueError(f"speculation.mode must be {'|'.join(SPEC_MODES)}, got {self.mode!r}")
        m = self.max_draft_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0 or m > 256):
            raise ValueError(f"speculation.max_draft_tokens must be an integer in 0..256, got {m!r}")


@dataclass
class SpecStats:
    steps: int = 0  # verification steps that emitted tokens
    draft_tokens: int = 0  # draft nodes proposed (excluding roots)
    accepted_tokens: int = 0  # draft tokens accepted
    emitted_tokens: int = 0
    accepted_per_depth: list = field(default_factory=list)  # [d] accepted draft tokens at depth d+1
    drafted_per_depth: list = field(default_factory=list)  # [d] steps that drafted at depth d+1
    accept_len_hist: list = field(default_factory=list)  # [a] steps that accepted exactly a drafts
    by_proposer: dict = field(default_factory=dict)  # proposer -> [steps, draft tokens, accepted tokens]

    def record(self, num_drafted: int, depth: int, accepted: int, proposer: str | dict | None = None) -> None:
        """One verification step. ``proposer``: who drafted its tree, or for a hybrid tree a dict
        (proposer -> [draft nodes, accepted tokens, ...]) splitting the step between them."""
        self.steps += 1
        parts = {proposer: [num_drafted, accepted]} if isinstance(proposer, str) else proposer or {}
        for name, (nodes, acc, *_) in parts.items():
            row = self.by_proposer.setdefault(name, [0, 0, 0])
            row[0] += 1
            row[1] += nodes
            row[2] += acc
        if not depth and not accepted and self.accept_len_hist:  # a plain decode step (the common case)
            self.draft_tokens += num_drafted
            self.accept_len_hist[0] += 1
            return
        self.draft_tokens += num_drafted
        self.accepted_tokens += accepted
        for lst, n in ((self.drafted_per_depth, depth), (self.accepted_per_depth, accepted)):
            while len(lst) < n:
                lst.append(0)
            for d in range(n):
                lst[d] += 1
        while len(self.accept_len_hist) <= accepted:
            self.accept_len_hist.append(0)
        self.accept_len_hist[accepted] += 1

    def merge(self, o: SpecStats) -> None:
        self.steps += o.steps
        self.draft_tokens += o.draft_tokens
        self.accepted_tokens += o.accepted_tokens
        self.emitted_tokens += o.emitted_tokens
        for name, (s, d, a) in o.by_proposer.items():
            row = self.by_proposer.setdefault(name, [0, 0, 0])
            row[0] += s
            row[1] += d
            row[2] += a
        for name in ("accepted_per_depth", "drafted_per_depth", "accept_len_hist"):
            a, b = getattr(self, name), getattr(o, name)
            while len(a) < len(b):
                a.append(0)
            for i, v in enumerate(b):
                a[i] += v

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted / steps: tokens per target forward, counting the bonus (vLLM's definition)."""
        return 1.0 + self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_per_depth": [
                round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_per_depth, self.drafted_per_depth)
            ],
            "accepted_per_depth": list(self.accepted_per_depth),
            "accept_len_hist": list(self.accept_len_hist),
            "by_proposer": {
                name: {
                    "steps": s,
                    "draft_tokens": d,
                    "accepted_tokens": a,
                    "mean_accepted_length": round(1.0 + a / s, 4) if s else 0.0,
                }
                for name, (s, d, a) in sorted(self.by_proposer.items())
            },
        }


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: SpecParams,
        priority: str = "interactive",
        arrival: float | None = None,
    ):
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be interactive|batch, got {priority!r}")
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.tokens: list[int] = list(prompt_ids)  # committed tokens (prompt + output)
        self.params = params
        self.spec = spec
        self.priority = priority
        self.prio = PRIORITIES[priority]
        self.arrival = time.monotonic() if arrival is None else arrival
        self.status = Status.WAITING
        self.num_computed = 0  # target: committed tokens whose KV is cached
        self.draft_computed = 0  # draft: same, in the draft cache (feature head: its rows, one behind)
        # feature head: the target's features of committed positions [hidden_start, num_computed)
        # not yet consumed by the head [n, F] (the ledger keeps and rolls them back)
        self.hidden: torch.Tensor | None = None
        self.hidden_start = 0
        self.hidden_buf: torch.Tensor | None = None  # storage ``hidden`` views, grown by doubling
        self.blocks: SeqBlocks | None = None
        self.draft_blocks: SeqBlocks | None = None
        self.generator: torch.Generator | None = None
        self.stats = SpecStats()
        self.finish_reason: str | None = None
        self.error: str | None = None  # why the engine failed it (finish_reason "error")
        self.detok: IncrementalDetokenizer | None = None
        self.sent_chars = 0  # characters of the output text already streamed (stop-string hold-back)
        self.stop_text: str | None = None  # final text when a stop string ended the request (the stop string cut off)
        self.logprobs: list | None = [] if params.logprobs is not None else None  # per output token
        self.first_token_time: float | None = None
        self.scheduled_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.wait_since = self.arrival  # when it last entered the waiting queue (starvation guard)
        self.last_step = -1  # scheduler step it last ran in (batch rotation)
        self.recent_accept: float = 0.6  # EMA of per-position acceptance (adaptive speculation prior)
        self.chain_accept: float = 0.6  # the same for its model drafts' top-1 chains (specd.speculation.policy)
        self.last_probe = -1  # scheduler step of its last adaptive-speculation probe
        self.spec_budget: int = 0  # draft tokens granted this step
        self.cached_prefix_tokens = 0  # prompt tokens served from the prefix cache
        self.pc_state = [0, 0]  # prefix cache: [target blocks registered, chained key]
        self.pc_draft_state = [0, 0]
        self.ngram_index = None  # prompt-lookup index (specd.speculation.ngram), built on first use
        self.tenant: str | None = None  # whose earlier requests it may draft from (the API key)
        self.ngram_accept: float = 0.5  # EMA of per-position acceptance of its prompt-lookup drafts
        # its recent prompt-lookup outcomes (accepted, drafted) (SpecPolicy.lookup_expected)
        self.lookup_outcomes: collections.deque = collections.deque(maxlen=16)
        self.lookup_cache: dict = {}  # d -> the policy's lookup_expected from these outcomes (cleared on a new one)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def in_prefill(self) -> bool:
        """True while more than the pending token is uncomputed."""
        return self.num_computed < len(self.tokens) - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
