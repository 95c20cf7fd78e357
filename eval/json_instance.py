"""One plausible JSON instance per JSON schema, for timing grammar matchers along a valid document.

:func:`instance` walks the schema and picks, at every node, the first value that obviously satisfies
it: ``const``, the first ``enum`` entry, the required properties of an object in the schema's
declared order (the order grammar libraries enforce), ``minItems`` items (at least one) of an array,
a string of ``minLength`` (a canned value for ``format``), a number inside ``minimum`` /
``maximum``. It gives up (:class:`NoInstance`) where satisfying the schema needs real search: a
string ``pattern``, ``not``, unresolvable ``$ref``, nesting deeper than ``MAX_DEPTH``. Whatever it
returns is only a candidate: the grammar libraries decide whether it is valid (eval.grammar_libs
keeps an instance only when both accept it).

    >>> instance({"type": "object", "properties": {"b": {"enum": ["x"]}, "a": {"type": "integer",
    ...          "minimum": 3}}, "required": ["a", "b"]})
    {'b': 'x', 'a': 3}
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 16
FORMATS = {
    "date-time": "2024-01-02T03:04:05Z",
    "date": "2024-01-02",
    "time": "03:04:05Z",
    "email": "a@example.com",
    "uri": "https://example.com/a",
    "uri-reference": "https://example.com/a",
    "url": "https://example.com/a",
    "uuid": "123e4567-e89b-12d3-a456-426614174000",
    "ipv4": "10.0.0.1",
    "ipv6": "::1",
    "hostname": "example.com",
}


class NoInstance(Exception):
    """The schema needs more than the first obvious value (a pattern, ``not``, a deep recursion)."""


def instance(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """A candidate instance of ``schema`` (``root``: the document ``$ref`` pointers resolve in)."""
    root = schema if root is None else root
    if depth > MAX_DEPTH:
        raise NoInstance("too deep")
    if schema is True or schema == {}:
        return "x"
    if not isinstance(schema, dict):
        raise NoInstance("not a schema")
    if "$ref" in schema:
        return instance(_resolve(schema["$ref"], root), root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    if "not" in schema:
        raise NoInstance("not")
    if "allOf" in schema:
        return instance(_merge(schema, root), root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            rest = {k: v for k, v in schema.items() if k != key}
            return instance({**rest, **schema[key][0]}, root, depth + 1)
    return _typed(schema, _type_of(schema), root, depth)


def _resolve(ref: str, root: Any) -> Any:
    if not ref.startswith("#"):
        raise NoInstance(f"remote $ref {ref}")
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise NoInstance(f"unresolved $ref {ref}")
        node = node[part]
    return node


def _merge(schema: dict, root: Any) -> dict:
    """``allOf`` folded into one schema (properties merged, required united; enough for the sample)."""
    out = {k: v for k, v in schema.items() if k != "allOf"}
    for sub in schema["allOf"]:
        sub = _resolve(sub["$ref"], root) if isinstance(sub, dict) and "$ref" in sub else sub
        if not isinstance(sub, dict):
            continue
        for k, v in sub.items():
            if k == "properties":
                out["properties"] = {**out.get("properties", {}), **v}
            elif k == "required":
                out["required"] = list(dict.fromkeys([*out.get("required", []), *v]))
            else:
                out.setdefault(k, v)
    return out


def _type_of(schema: dict) -> str:
    t = schema.get("type")
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), t[0] if t else None)
    if t:
        return t
    if "properties" in schema or "required" in schema or "additionalProperties" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return "string"


def _typed(schema: dict, t: str, root: Any, depth: int) -> Any:
    if t == "object":
        return _object(schema, root, depth)
    if t == "array":
        return _array(schema, root, depth)
    if t == "string":
        return _string(schema)
    if t in ("integer", "number"):
        return _number(schema, t == "integer")
    if t == "boolean":
        return True
    if t == "null":
        return None
    raise NoInstance(f"type {t!r}")


def _object(schema: dict, root: Any, depth: int) -> dict:
    props = schema.get("properties", {})
    required = schema.get("required", [])
    out = {k: instance(v, root, depth + 1) for k, v in props.items() if k in required}
    extra = schema.get("additionalProperties", True)
    for k in required:
        if k not in out:
            out[k] = instance(extra if isinstance(extra, dict) else {}, root, depth + 1)
    return out


def _array(schema: dict, root: Any, depth: int) -> list:
    if schema.get("maxItems") == 0:
        return []
    n = max(int(schema.get("minItems", 1)), 1)
    prefix = schema.get("prefixItems") or (schema["items"] if isinstance(schema.get("items"), list) else [])
    items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
    return [instance(prefix[i] if i < len(prefix) else items, root, depth + 1) for i in range(n)]


def _string(schema: dict) -> str:
    if "pattern" in schema:
        raise NoInstance("pattern")
    if schema.get("format") in FORMATS:
        return FORMATS[schema["format"]]
    lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
    n = max(lo, 3) if hi is None else max(lo, min(3, int(hi)))
    return "a" * n


def _number(schema: dict, integer: bool) -> int | float:
    if "multipleOf" in schema:
        raise NoInstance("multipleOf")
    step = 1 if integer else 0.5
    v: float = 1 if integer else 1.5
    lo, lo_excl = _bound(schema, "minimum", "exclusiveMinimum")
    hi, hi_excl = _bound(schema, "maximum", "exclusiveMaximum")
    if lo is not None and (v < lo or (lo_excl and v == lo)):
        v = lo + step if lo_excl else lo
    if hi is not None and (v > hi or (hi_excl and v == hi)):
        v = hi - step if hi_excl else hi
    return int(v) if integer else float(v)


def _bound(schema: dict, inclusive: str, exclusive: str) -> tuple[float | None, bool]:
    """A numeric bound and whether it is exclusive (draft 4's boolean ``exclusiveMinimum`` is a flag)."""
    v = schema.get(exclusive)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v, True
    w = schema.get(inclusive)
    if isinstance(w, (int, float)) and not isinstance(w, bool):
        return w, v is True
    return None, False
