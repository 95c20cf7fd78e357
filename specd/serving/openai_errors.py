"""OpenAI's error shape and statuses for the ``/v1`` routes.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with the status OpenAI uses:

- 400 ``invalid_request_error``: a malformed body (``invalid_json``), a bad field (``invalid_value``),
  a field the engine cannot honour (``unsupported_parameter``), prompt + max tokens over the
  context or the KV cache (``context_length_exceeded``), a constraint refused (the grammar's code:
  ``invalid_response_format``, ``invalid_schema``, ``unsatisfiable_schema``, ``invalid_regex``,
  ``invalid_grammar``, ``invalid_tools``, ``conflicting_constraints``, ``grammar_too_large``,
  ``compile_timeout``; ``param`` names the field);
- 401 ``invalid_request_error`` ``invalid_api_key``: missing or wrong ``Authorization: Bearer`` key;
- 404 ``invalid_request_error``: ``model_not_found``, ``response_not_found``,
  ``previous_response_not_found``;
- 413 ``invalid_request_error`` ``request_too_large``: a body over ``--max-message-bytes``;
- 429 ``rate_limit_error`` ``overloaded``: ``--max-queue`` requests admitted already (``Retry-After: 1``);
- 500 ``server_error`` ``internal``: the engine failed;
- 503 ``server_error``: ``model_loading`` (``Retry-After: 1``), ``shutting_down`` (``Retry-After: 5``).
"""

from __future__ import annotations

from specd.engine.requests import RequestError
from specd.serving.routes import JSONResponse
from specd.structured.errors import CODES as GRAMMAR_CODES

__all__ = ["APIError", "from_request_error", "error_response"]


class APIError(Exception):
    """A refusal in OpenAI's terms (``status``, ``type``, ``param``, ``code``; ``headers`` to add)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def from_request_error(e: RequestError, param: str | None = None) -> APIError:
    """The engine's / the validation's ``RequestError`` codes in OpenAI's terms (``param``: the
    refused field when the validation named one)."""
    msg, code = str(e), getattr(e, "code", "internal")
    if code == "invalid_request":
        return APIError(400, msg, param=param or getattr(e, "field", None), code="invalid_value")
    if code == "too_long":
        return APIError(400, msg, param=param or "messages", code="context_length_exceeded")
    if code == "overloaded" and "loading" in msg:
        return APIError(503, msg, "server_error", code="model_loading", headers={"Retry-After": "1"})
    if code == "overloaded":
        return APIError(429, msg, "rate_limit_error", code="overloaded", headers={"Retry-After": "1"})
    if code == "shutting_down":
        return APIError(503, msg, "server_error", code="shutting_down", headers={"Retry-After": "5"})
    if code == "unauthorized":
        return APIError(401, msg, code="invalid_api_key")
    if code in GRAMMAR_CODES:  # the engine refused the request's grammar (a compile timeout, ...)
        return APIError(400, msg, param=param or getattr(e, "field", None), code=code)
    return APIError(500, msg, "server_error", code="internal")


def error_response(e: APIError) -> JSONResponse:
    headers = dict(e.headers)
    if e.status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    return JSONResponse(e.body(), e.status, headers=headers)
