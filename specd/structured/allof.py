"""Object ``allOf`` merged before compiling: xgrammar only partly supports ``allOf`` (it warns "allOf
with multiple options is still ongoing" and may keep one branch), so a schema extending an object
with ``{"allOf": [{"$ref": "#/definitions/base"}, {"properties": {...}, "required": [...]}]}`` got
replies missing the extension's required keys (JSONSchemaBench o41639: ``'horse' is a required
property``). Where every branch is a plain object schema (after resolving local ``$ref``s), the
branches are merged into one object: the union of their properties and required keys, the other
keywords of the enclosing schema kept. Anything else (a property both branches define differently,
``additionalProperties`` in a branch, branches that are not objects) is left as it was.

Example::

    {"allOf": [{"$ref": "#/definitions/pet"}, {"properties": {"age": {"type": "integer"}}, "required": ["age"]}],
     "definitions": {"pet": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}
    -> {"type": "object", "properties": {"name": ..., "age": ...}, "required": ["name", "age"], "definitions": ...}
"""

from __future__ import annotations

from typing import Any

__all__ = ["merge_object_allof"]

MERGEABLE = {"type", "properties", "required", "title", "description", "$ref"}  # a branch's keywords
KEPT = {"definitions", "$defs", "$schema", "$id", "title", "description"}  # the enclosing schema's, kept


def merge_object_allof(schema: Any) -> Any:
    """``schema`` with every mergeable object ``allOf`` merged, down to a nesting depth of 64 (new
    dicts and lists where anything changes below them; the input is never changed)."""
    try:
        return _walk(schema, schema, 0)
    except RecursionError:  # (the limits checked nesting already; never fail a compile here)
        return schema


def _walk(node: Any, root: Any, depth: int) -> Any:
    if depth > 64:
        return node
    if isinstance(node, list):
        return [_walk(x, root, depth + 1) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _walk(v, root, depth + 1) for k, v in node.items()}
    branches = out.get("allOf")
    if not isinstance(branches, list) or not branches or set(out) - MERGEABLE - KEPT - {"allOf"}:
        return out
    own = {k: out[k] for k in ("type", "properties", "required") if k in out}  # the schema's own object part
    merged = _merge([_resolve(b, root) for b in branches] + ([own] if own else []))
    if merged is None:
        return out
    return {**{k: v for k, v in out.items() if k in KEPT}, **merged}


def _resolve(branch: Any, root: Any, hops: int = 0) -> Any:
    """A branch with its local ``$ref`` followed (``#/definitions/x``, ``#/$defs/x``); None if not local."""
    if not isinstance(branch, dict) or "$ref" not in branch:
        return branch
    ref = branch["$ref"]
    if hops > 8 or not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    target: Any = root
    for part in ref[2:].split("/"):
        if not isinstance(target, dict) or part not in target:
            return None
        target = target[part]
    rest = {k: v for k, v in branch.items() if k != "$ref"}
    resolved = _resolve(target, root, hops + 1)
    if not isinstance(resolved, dict):
        return None
    return {**resolved, **rest} if rest else resolved


def _merge(branches: list) -> dict | None:
    """One object schema for all ``branches``, or None where they are not all plain objects."""
    props: dict = {}
    required: list = []
    for b in branches:
        if not isinstance(b, dict) or set(b) - MERGEABLE or b.get("type", "object") != "object":
            return None
        for name, sub in (b.get("properties") or {}).items():
            if name in props and props[name] != sub:
                return None
            props[name] = sub
        required += [r for r in b.get("required") or [] if r not in required]
    out: dict = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    return out
