"""Drafting from earlier requests (SuffixDecoding-style): what followed the current context's most
recent n-gram in the recent outputs of the daemon, for the same tenant only.

When a request finishes, its tokens (prompt and output) join its tenant's store; a later request of
that tenant whose own context has no prompt-lookup match (``ngram.py``) looks its last n-gram up
there. Agents and chat UIs repeat themselves across requests (the same tool call, the same
boilerplate, a regenerated answer), which is where this pays.

Bounds: at most ``max_tokens_per_tenant`` stored tokens per tenant (oldest documents evicted
first) and ``max_tenants`` tenants (least recently used evicted), so memory is O(max_tenants x
max_tokens_per_tenant x n sizes). Isolation: a tenant (the request's API key, or None for
requests without one) only ever reads its own documents.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class SuffixConfig:
    max_tokens_per_tenant: int = 65536
    max_tenants: int = 64
    min_n: int = 3  # shortest n-gram matched (across requests a longer match is needed)
    max_n: int = 6


class _TenantStore:
    """One tenant's documents and the n-gram index over them: ``{ngram: deque[(doc, end)]}``."""

    def __init__(self, sizes: range):
        self.sizes = sizes
        self.docs: collections.OrderedDict[int, list] = collections.OrderedDict()
        self.index: dict[tuple, collections.deque] = {}
        self.tokens = 0

    def add(self, doc_id: int, tokens: list) -> None:
        self.docs[doc_id] = tokens
        self.tokens += len(tokens)
        for end in range(1, len(tokens)):
            for n in self.sizes:
                if end >= n:
                    self.index.setdefault(tuple(tokens[end - n : end]), collections.deque()).append((doc_id, end))

    def evict_oldest(self) -> None:
        doc_id, tokens = self.docs.popitem(last=False)
        self.tokens -= len(tokens)
        for end in range(1, len(tokens)):
            for n in self.sizes:
                if end >= n:
                    key = tuple(tokens[end - n : end])
                    q = self.index.get(key)
                    while q and q[0][0] == doc_id:  # a document's entries are the oldest in each deque
                        q.popleft()
                    if q is not None and not q:
                        del self.index[key]

    def continuation(self, context: list, max_tokens: int) -> list:
        """What followed the longest n-gram ending ``context`` in the most recent document holding it."""
        L = len(context)
        for n in reversed(self.sizes):
            if L < n:
                continue
            q = self.index.get(tuple(context[L - n :]))
            if q:
                doc_id, end = q[-1]
                return self.docs[doc_id][end : end + max_tokens]
        return []


class SuffixStore:
    """Recent requests' tokens per tenant, bounded; thread-safe (the engine thread writes and reads)."""

    def __init__(self, cfg: SuffixConfig | None = None):
        self.cfg = cfg or SuffixConfig()
        if not 1 <= self.cfg.min_n <= self.cfg.max_n:
            raise ValueError("suffix store: need 1 <= min_n <= max_n")
        self._tenants: collections.OrderedDict = collections.OrderedDict()
        self._next_doc = 0
        self._lock = threading.Lock()

    def add(self, tenant: str | None, tokens: list) -> None:
        """Store a finished request's tokens (the most recent ``max_tokens_per_tenant`` of them)."""
        cap = self.cfg.max_tokens_per_tenant
        tokens = list(tokens[-cap:])
        if len(tokens) < 2:
            return
        with self._lock:
            store = self._tenants.pop(tenant, None)
            if store is None:
                store = _TenantStore(range(self.cfg.min_n, self.cfg.max_n + 1))
            self._tenants[tenant] = store  # most recently used last
            while len(self._tenants) > self.cfg.max_tenants:
                self._tenants.popitem(last=False)
            store.add(self._next_doc, tokens)
            self._next_doc += 1
            while store.tokens > cap:
                store.evict_oldest()

    def continuation(self, tenant: str | None, context: list, max_tokens: int) -> list:
        with self._lock:
            store = self._tenants.get(tenant)
            return store.continuation(context, max_tokens) if store is not None else []

    def stats(self) -> dict:
        with self._lock:
            return {"tenants": len(self._tenants), "tokens": sum(s.tokens for s in self._tenants.values())}
