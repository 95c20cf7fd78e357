"""Per-request state: tokens, cache block tables, sampling, speculation settings and stats."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from specd.engine.detokenizer import IncrementalDetokenizer
from specd.engine.kv_cache import SeqBlocks
from specd.sampling.params import SamplingParams
from specd.speculation.request import SpecParams, SpecState, SpecStats

if TYPE_CHECKING:
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


PRIORITIES = {"interactive": 0, "batch": 1}


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
        self.spec_budget: int = 0  # draft tokens granted this step
        self.cached_prefix_tokens = 0  # prompt tokens served from the prefix cache
        self.pc_state = [0, 0]  # prefix cache: [target blocks registered, chained key]
        self.pc_draft_state = [0, 0]
        self.tenant: str | None = None  # whose earlier requests it may draft from (the API key)
        self.spec_state = SpecState()  # the policy's and proposers' state (specd.speculation.request)
        self.grammar = None  # its constraint (a specd.structured.GrammarSpec), or None
        self.matcher = None  # its grammar state once compiled (specd.structured.Matcher; the ledger's)

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
