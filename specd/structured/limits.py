"""``GrammarLimits``: the size bounds a constraint must fit before anything compiles it, and the checks.

Compile time grows with a schema's size, nesting and enumerations (on the built-in vocabulary:
a 20,000-entry enum takes ~11 s, 200 nested objects ~5 s), so :func:`check` refuses, cheaply and
without recursion, what is over the bounds (``grammar_too_large``) and the schemas that obviously
admit no value (``unsatisfiable_schema``); :class:`~specd.structured.compiler.GrammarCompiler`
calls it before compiling, and bounds compile time on top (``compile_timeout_s``).

The defaults sit well above the JSONSchemaBench sample (at most 28 KB, nesting 23, 504 enum entries).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specd.structured.errors import GrammarError
from specd.structured.spec import GrammarSpec

__all__ = ["GrammarLimits", "check"]


@dataclass(frozen=True)
class GrammarLimits:
    """``max_bytes``: canonical spec size; ``max_depth``: JSON nesting of the spec; ``max_enum``:
    entries of one ``enum`` / ``choice`` list; ``max_tools``: functions in one tool list."""

    max_bytes: int = 256 * 1024
    max_depth: int = 64
    max_enum: int = 1024
    max_tools: int = 128

    def __post_init__(self):
        for name in ("max_bytes", "max_depth", "max_enum", "max_tools"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")


def _walk(value, limits: GrammarLimits, field: str | None) -> None:
    """Nesting depth and enum sizes, iteratively (a hostile spec may nest 100,000 deep)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limits.max_depth:
            raise GrammarError("grammar_too_large", f"the schema nests deeper than {limits.max_depth} levels", field)
        if isinstance(v, Mapping):
            enum = v.get("enum")
            if isinstance(enum, list) and len(enum) > limits.max_enum:
                raise GrammarError(
                    "grammar_too_large", f"an enum has {len(enum)} entries (at most {limits.max_enum})", field
                )
            _unsatisfiable(v, field)
            stack.extend((w, depth + 1) for w in v.values())
        elif isinstance(v, list):
            stack.extend((w, depth + 1) for w in v)


def _types(schema) -> set | None:
    if not isinstance(schema, Mapping) or "type" not in schema:
        return None
    t = schema["type"]
    got = set(t) if isinstance(t, list) else {t}
    return {"number", "integer"} if got == {"number"} else got


def _unsatisfiable(schema: Mapping, field: str | None) -> None:
    """The schemas that obviously admit nothing: ``not: {}``, ``allOf`` branches of disjoint types."""
    if schema.get("not") in ({}, True):
        raise GrammarError("unsatisfiable_schema", "the schema has 'not: {}', which no value satisfies", field)
    all_of = schema.get("allOf")
    if isinstance(all_of, list):
        common = _types(schema)
        for sub in all_of:
            t = _types(sub)
            if t is not None:
                common = t if common is None else common & t
        if common is not None and not common:
            raise GrammarError("unsatisfiable_schema", "the schema's allOf requires types no value has at once", field)


def check(spec: GrammarSpec, limits: GrammarLimits) -> str:
    """``spec``'s canonical text (:meth:`GrammarSpec.canonical`); :class:`GrammarError` when it is over
    a bound or obviously unsatisfiable. Nesting is checked first, without recursion."""
    if spec.kind == "choice" and len(spec.value) > limits.max_enum:
        raise GrammarError("grammar_too_large", f"{len(spec.value)} choices (at most {limits.max_enum})", spec.field)
    if spec.kind == "tool_calls" and len(spec.value.functions) > limits.max_tools:
        n = len(spec.value.functions)
        raise GrammarError("grammar_too_large", f"{n} tools (at most {limits.max_tools})", spec.field)
    _walk(spec.payload(), limits, spec.field)
    canonical = spec.canonical()
    size = len(canonical.encode())
    if size > limits.max_bytes:
        msg = f"the constraint is {size} bytes (at most {limits.max_bytes})"
        raise GrammarError("grammar_too_large", msg, spec.field)
    return canonical
