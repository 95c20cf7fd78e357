"""``GrammarError``: why a constraint is refused, as a protocol error code and a one-line message.

Every refusal in :mod:`specd.structured` (a malformed ``response_format``, an invalid or unsatisfiable
schema, a schema over the size bounds, a compile that ran past ``compile_timeout_s``, a bad tool list)
is a ``GrammarError``; the server turns it into an HTTP 400 (``{"error": {"code": code, "message":
message, "param": field}}``) and the websocket / gRPC front ends into their own error message.
"""

from __future__ import annotations

__all__ = ["CODES", "GrammarError"]

CODES = (
    "invalid_response_format",  # response_format / structured_outputs / guided_* malformed
    "invalid_schema",  # the JSON schema is not one the library accepts (or not a schema at all)
    "unsatisfiable_schema",  # the schema (or grammar) admits no output at all
    "invalid_regex",
    "invalid_grammar",
    "invalid_tools",  # tools / tool_choice / parallel_tool_calls malformed
    "conflicting_constraints",  # two ways of constraining the same reply
    "grammar_too_large",  # over a size bound: bytes, nesting depth, enum / choice entries
    "compile_timeout",  # compiling took longer than compile_timeout_s
)


class GrammarError(ValueError):
    """A constraint refused; ``code`` is one of :data:`CODES`, ``field`` the request field at fault."""

    def __init__(self, code: str, message: str, field: str | None = None):
        if code not in CODES:
            raise ValueError(f"unknown GrammarError code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    def __repr__(self) -> str:
        return f"GrammarError({self.code!r}, {self.message!r})"

    def to_dict(self) -> dict:
        """The OpenAI error body's ``error`` object."""
        return {"code": self.code, "message": self.message, "param": self.field, "type": "invalid_request_error"}
