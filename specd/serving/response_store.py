"""Stored responses (the Responses API's ``store: true``), bounded in memory and kept per API key.

Each entry is a finished response object (what ``GET /v1/responses/{id}`` returns) and the
conversation it ends (its messages, the assistant's reply included), which a later request continues
with ``previous_response_id``. Entries live under the namespace of the key that created them
(``Auth.namespace``): a key never reads, continues or deletes another key's responses, and an unknown
id and another key's id look the same (404).

Bounds (least recently used first out): ``max_per_key`` entries per namespace, ``max_entries`` in
all, and ``max_bytes`` of message text in all (an entry counts its whole conversation, so a long
conversation cannot hide behind a small count). Nothing is written to disk; a restart forgets
everything.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["ResponseStore", "StoredResponse"]


@dataclass(frozen=True)
class StoredResponse:
    """``obj``: the response object; ``history``: the conversation it ends, as chat messages (an
    assistant's ``tool_calls`` and ``role: "tool"`` results included)."""

    id: str
    obj: dict
    history: tuple

    @property
    def nbytes(self) -> int:
        n = 512
        for m in self.history:
            n += len(m.get("content") or "") + len(m["role"]) + 16
            for c in m.get("tool_calls", ()):
                n += len(c["function"]["arguments"]) + len(c["function"]["name"]) + len(c["id"]) + 32
        return n


class ResponseStore:
    """LRU store of ``StoredResponse``s by (namespace, id); see the module docstring for the bounds."""

    def __init__(self, max_entries: int = 4096, max_per_key: int = 1024, max_bytes: int = 64 << 20):
        if min(max_entries, max_per_key, max_bytes) < 1:
            raise ValueError("response store bounds must be >= 1")
        self.max_entries, self.max_per_key, self.max_bytes = max_entries, max_per_key, max_bytes
        self._all: OrderedDict = OrderedDict()  # (ns, id) -> StoredResponse, oldest first
        self._per_key: dict = {}  # ns -> entries it holds
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._all)

    def put(self, ns: str, entry: StoredResponse) -> None:
        key = (ns, entry.id)
        if key in self._all:
            self._drop(key)
        if entry.nbytes > self.max_bytes:
            return  # (larger than the whole budget: not kept)
        self._all[key] = entry
        self._per_key[ns] = self._per_key.get(ns, 0) + 1
        self.nbytes += entry.nbytes
        while self._per_key[ns] > self.max_per_key:
            self._drop(next(k for k in self._all if k[0] == ns))
        while len(self._all) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._all)))

    def get(self, ns: str, rid: str) -> StoredResponse | None:
        entry = self._all.get((ns, rid))
        if entry is not None:
            self._all.move_to_end((ns, rid))
        return entry

    def delete(self, ns: str, rid: str) -> bool:
        if (ns, rid) not in self._all:
            return False
        self._drop((ns, rid))
        return True

    def _drop(self, key: tuple) -> None:
        entry = self._all.pop(key)
        self.nbytes -= entry.nbytes
        n = self._per_key[key[0]] - 1
        if n:
            self._per_key[key[0]] = n
        else:
            del self._per_key[key[0]]
