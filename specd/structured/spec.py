"""``GrammarSpec``: what one request asks its reply to match, before anything is compiled.

A spec is one of these *kinds* (``value`` is what each carries):

==============  ==========================================================================
``json_object`` any JSON object (OpenAI JSON mode); ``value`` is None
``json_schema`` a JSON value valid under a JSON schema; ``value`` the schema (a dict)
``regex``       text matching a regular expression (vLLM ``regex``); ``value`` the pattern
``choice``      exactly one of a few strings (vLLM ``choice``); ``value`` a tuple of str
``grammar``     text in an EBNF grammar (vLLM ``grammar``, GBNF-style); ``value`` the grammar
``tool_calls``  tool calls in the documented text format (:mod:`specd.structured.tools`),
                ``value`` a :class:`~specd.structured.tools.ToolCallSpec`
==============  ==========================================================================

``canonical()`` is the spec as compact JSON text (keys kept in the request's order: a JSON schema's
property order is the order its reply writes them in, so two schemas that differ only in that
order are two grammars); the compiler's cache key is a hash of it together with the tokenizer's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from specd.structured.errors import GrammarError

__all__ = ["KINDS", "GrammarSpec"]

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "tool_calls")


@dataclass(frozen=True, eq=False)
class GrammarSpec:
    """One request's constraint; ``field`` names the request field it came from (for error messages)."""

    kind: str
    value: Any = None
    field: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; one of {', '.join(KINDS)}")

    def payload(self) -> Any:
        """The value as plain JSON data (a tool-call spec as its dict)."""
        to_json = getattr(self.value, "to_json", None)
        return to_json() if callable(to_json) else self.value

    def canonical(self) -> str:
        """Compact JSON of ``{"kind", "value"}``, keys in their given order; a value too deeply nested
        to serialize is refused (``grammar_too_large``)."""
        try:
            return json.dumps({"kind": self.kind, "value": self.payload()}, separators=(",", ":"), ensure_ascii=False)
        except RecursionError:
            raise GrammarError("grammar_too_large", "the constraint is nested too deeply", self.field) from None
        except (TypeError, ValueError) as e:
            raise GrammarError("invalid_response_format", f"the constraint is not JSON data: {e}", self.field) from None

    def key(self, salt: str = "", canonical: str | None = None) -> str:
        """sha256 of the canonical spec (``canonical``: already computed) and ``salt`` (the tokenizer's
        fingerprint and compile options)."""
        h = hashlib.sha256((self.canonical() if canonical is None else canonical).encode())
        h.update(b"\0" + salt.encode())
        return h.hexdigest()
