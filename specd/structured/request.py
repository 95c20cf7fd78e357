"""The one validation of a request's constraint fields: request body -> :class:`GrammarSpec` or None.

Read, in the names each protocol uses:

- OpenAI Chat Completions ``response_format``: ``{"type": "text"}`` (no constraint),
  ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}``; the Responses API's ``text.format`` is the same with the
  ``json_schema`` object's fields flattened into it (:func:`text_format_spec`);
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, or its JSON text), ``regex``,
  ``choice`` (a list of strings), ``grammar`` (EBNF), ``json_object: true``; plus the options
  ``disable_fallback`` / ``disable_any_whitespace`` / ``disable_additional_properties`` (accepted:
  specd has one backend and its JSON never has free whitespace or undeclared properties). vLLM's
  older top-level names ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
  (removed in vLLM 0.12) are read too;
- ``tools`` + ``tool_choice`` + ``parallel_tool_calls`` (:func:`specd.structured.tools.tool_call_spec`).

A request may constrain its reply one way only: two of these (say ``response_format`` json_schema and
``structured_outputs``, or ``tool_choice: "required"`` and a json_schema) are refused with
``conflicting_constraints``. Every refusal is a :class:`GrammarError` naming the field.

    >>> grammar_spec({"response_format": {"type": "json_object"}}).kind
    'json_object'
    >>> grammar_spec({"structured_outputs": {"choice": ["yes", "no"]}}).value
    ('yes', 'no')
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from specd.structured.errors import GrammarError
from specd.structured.exactness import refuse_unenforced
from specd.structured.spec import GrammarSpec
from specd.structured.tools import tool_call_spec

__all__ = ["grammar_spec", "response_format_spec", "structured_outputs_spec", "text_format_spec"]

SCHEMA_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
VLLM_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _bad(msg: str, field: str) -> GrammarError:
    return GrammarError("invalid_response_format", msg, field)


def _schema(v: Any, field: str) -> dict:
    """A JSON schema: an object, or JSON text of one (vLLM accepts both)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise GrammarError("invalid_schema", f"{field} is not valid JSON: {e}", field) from None
    if isinstance(v, bool):
        v = {} if v else {"not": {}}
    if not isinstance(v, Mapping):
        raise GrammarError("invalid_schema", f"{field} must be a JSON schema object", field)
    return dict(v)


def _json_schema(obj: Mapping, field: str) -> GrammarSpec:
    """The ``json_schema`` object's fields (``name`` required, ``schema`` optional: any JSON object)."""
    name = obj.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME_RE.match(name):
        raise _bad(f"{field}.name is required and must match [A-Za-z0-9_-]{{1,64}}", f"{field}.name")
    strict = obj.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{field}.strict must be a boolean", f"{field}.strict")
    if obj.get("schema") is None:
        return GrammarSpec("json_object", None, field)
    schema = _schema(obj["schema"], f"{field}.schema")
    if strict:  # (keywords a grammar cannot hold a reply to are refused, as OpenAI's strict mode does)
        refuse_unenforced(schema, f"{field}.schema")
    return GrammarSpec("json_schema", schema, f"{field}.schema")


def response_format_spec(rf: Any, field: str = "response_format") -> GrammarSpec | None:
    """Chat Completions ``response_format``."""
    if rf is None:
        return None
    if not isinstance(rf, Mapping):
        raise _bad(f"{field} must be an object with a 'type'", field)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", None, field)
    if kind == "json_schema":
        obj = rf.get("json_schema")
        if not isinstance(obj, Mapping):
            raise _bad(f"{field}.json_schema must be an object", f"{field}.json_schema")
        return _json_schema(obj, f"{field}.json_schema")
    raise _bad(f"{field}.type must be 'text', 'json_object' or 'json_schema', not {kind!r}", f"{field}.type")


def text_format_spec(fmt: Any, field: str = "text.format") -> GrammarSpec | None:
    """The Responses API's ``text.format`` (a json_schema format's fields are flat)."""
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        return _json_schema(fmt, field)
    return response_format_spec(fmt, field)


def _vllm(kind: str, v: Any, field: str) -> GrammarSpec:
    if kind == "json":
        return GrammarSpec("json_schema", _schema(v, field), field)
    if kind in ("regex", "grammar"):
        if not isinstance(v, str) or not v:
            raise _bad(f"{field} must be a non-empty string", field)
        return GrammarSpec(kind, v, field)
    if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, Sequence) or not v:
        raise _bad(f"{field} must be a non-empty list of strings", field)
    if not all(isinstance(c, str) and c for c in v):
        raise _bad(f"{field} must hold non-empty strings only", field)
    return GrammarSpec("choice", tuple(dict.fromkeys(v)), field)


def structured_outputs_spec(so: Any, field: str = "structured_outputs") -> GrammarSpec | None:
    """vLLM's ``structured_outputs`` object."""
    if so is None:
        return None
    if not isinstance(so, Mapping):
        raise _bad(f"{field} must be an object", field)
    unknown = sorted(k for k in so if k not in VLLM_KINDS and k not in VLLM_OPTIONS and k != "json_object")
    if unknown:
        known = ", ".join([*VLLM_KINDS, "json_object", *VLLM_OPTIONS])
        raise _bad(f"{field}.{unknown[0]} is not supported (supported: {known})", f"{field}.{unknown[0]}")
    given = [k for k in VLLM_KINDS if so.get(k) is not None]
    if so.get("json_object"):
        given.append("json_object")
    if len(given) != 1:
        raise _bad(f"{field} needs exactly one of json, regex, choice, grammar, json_object (got {given})", field)
    if given[0] == "json_object":
        return GrammarSpec("json_object", None, f"{field}.json_object")
    return _vllm(given[0], so[given[0]], f"{field}.{given[0]}")


def _legacy(body: Mapping) -> list:
    return [_vllm(kind, body[name], name) for name, kind in LEGACY.items() if body.get(name) is not None]


def grammar_spec(body: Mapping) -> GrammarSpec | None:
    """The constraint of a Chat Completions / Completions / websocket request body (None: free text)."""
    specs = [
        s
        for s in (
            response_format_spec(body.get("response_format")),
            structured_outputs_spec(body.get("structured_outputs")),
            *_legacy(body),
        )
        if s is not None
    ]
    tools = tool_call_spec(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    if tools is not None:
        specs.append(GrammarSpec("tool_calls", tools, "tools"))
    if len(specs) > 1:
        msg = f"the reply is constrained twice ({', '.join(s.field or s.kind for s in specs)}); use one"
        raise GrammarError("conflicting_constraints", msg, specs[1].field)
    return specs[0] if specs else None
