"""Which parts of a JSON schema the grammar cannot hold a reply to, found before anything compiles.

A grammar (a context-free language over the reply's text) holds most of JSON Schema exactly: types,
``properties`` / ``required`` / ``additionalProperties``, ``patternProperties``, ``propertyNames``,
``enum`` / ``const``, ``anyOf``, bounds on numbers, strings, items and properties, ``pattern`` and
``format`` (measured keyword by keyword on xgrammar: docs/benchmarks.md, "Session 23"). Some keywords
say what a value must *not* be, or tie one part of a value to another, which no context-free grammar
can: ``not``, ``if`` / ``then`` / ``else``, ``dependencies`` / ``dependentRequired`` /
``dependentSchemas``, ``uniqueItems``, ``contains`` (with ``minContains`` / ``maxContains``), and
``oneOf`` whose branches may overlap (a grammar can say "one of these", not "exactly one"). The
library compiles such schemas with those keywords relaxed (``oneOf`` as ``anyOf``, the rest not
enforced), so a reply may break them. It also keeps one branch of an ``allOf`` that specd cannot
merge into one object (``specd.structured.allof``: strings, numbers, objects defining a property
twice), and checks only some ``format`` s (``FORMATS``; ``iri``, ``idn-email``, ``regex`` ... are
free text).

:func:`unenforced` lists where a schema uses them (``keyword at /json/pointer``). A request with
``strict: true`` whose schema has any is refused (as OpenAI's strict mode refuses keywords it does
not support); without ``strict`` the schema is taken with those keywords relaxed (docs/protocol.md).

``oneOf`` counts as enforced when its branches are provably disjoint: their ``type`` sets do not
meet (``integer`` is a ``number``), or their ``const`` / ``enum`` values do not, or every branch is
an object that requires one common property whose ``const`` / ``enum`` values do not meet (a
discriminator). Local ``$ref`` s (``#/$defs/...``, ``#/definitions/...``) are followed one level for
this test.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from specd.structured.errors import GrammarError

__all__ = ["refuse_unenforced", "unenforced"]

FORMATS = ("email", "date-time", "date", "time", "duration", "uri", "uri-reference", "uri-template", "uuid",
           "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer")  # fmt: skip
RELAXED = ("not", "if", "dependencies", "dependentRequired", "dependentSchemas", "contains", "minContains",
           "maxContains")  # fmt: skip
# keywords whose value is one subschema / a map or list of subschemas (the walk descends into them)
ONE = ("additionalProperties", "items", "additionalItems", "propertyNames", "unevaluatedProperties")
MANY = ("properties", "patternProperties", "$defs", "definitions")
LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")


def unenforced(schema) -> list:
    """Where ``schema`` uses keywords the grammar relaxes: ``["oneOf at /properties/pet", ...]``
    (iterative: any nesting depth), after the ``allOf`` merge that compiling does."""
    from specd.structured.allof import merge_object_allof

    schema = merge_object_allof(schema)
    out = []
    stack = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, Mapping):
            continue
        out += [f"{k} at {path or '/'}" for k in RELAXED if k in node]
        if node.get("uniqueItems") is True:
            out.append(f"uniqueItems at {path or '/'}")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:  # (one the merge left)
            out.append(f"allOf at {path or '/'}")
        if "format" in node and node["format"] not in FORMATS:
            out.append(f"format {node['format']} at {path or '/'}")
        if isinstance(node.get("oneOf"), list) and not _disjoint(node["oneOf"], schema):
            out.append(f"oneOf at {path or '/'}")
        stack += _children(node, path)
    return sorted(out)


def _children(node: Mapping, path: str) -> list:
    kids = [(node[k], f"{path}/{k}") for k in ONE if isinstance(node.get(k), Mapping)]
    for k in MANY:
        if isinstance(node.get(k), Mapping):
            kids += [(v, f"{path}/{k}/{_escape(name)}") for name, v in node[k].items()]
    for k in LISTS:
        if isinstance(node.get(k), list):
            kids += [(v, f"{path}/{k}/{i}") for i, v in enumerate(node[k])]
    return kids


def _escape(name) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _resolve(branch, root):
    """A branch with a local ``$ref`` replaced by its target (one level), else the branch."""
    ref = branch.get("$ref") if isinstance(branch, Mapping) else None
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return branch
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            return branch
        node = node[part]
    return node


def _types(b) -> set | None:
    t = b.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
    if types is not None and "number" in types:
        types.add("integer")  # (an integer is a number)
    return types


def _values(b) -> set | None:
    """The values a branch allows when it lists them (``const`` / ``enum``), as JSON texts (numbers
    as floats: ``1`` and ``1.0`` are one value), else None."""
    if "const" in b:
        return {_value_key(b["const"])}
    if isinstance(b.get("enum"), list):
        return {_value_key(v) for v in b["enum"]}
    return None


def _value_key(v) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = float(v)
    return json.dumps(v, sort_keys=True)


def _pairwise_disjoint(sets: list) -> bool:
    seen: set = set()
    for s in sets:
        if s is None or seen & s:
            return False
        seen |= s
    return True


def _disjoint(branches: list, root) -> bool:
    bs = [_resolve(b, root) for b in branches]
    if not all(isinstance(b, Mapping) for b in bs):
        return False
    if _pairwise_disjoint([_types(b) for b in bs]) or _pairwise_disjoint([_values(b) for b in bs]):
        return True
    return any(_pairwise_disjoint([_tag(b, k) for b in bs]) for k in _common_required(bs))


def _common_required(bs: list) -> set:
    if not all(_types(b) == {"object"} for b in bs):  # (a discriminator tells objects apart)
        return set()
    req = [set(r) for r in (b.get("required") for b in bs) if isinstance(r, list)]
    return set.intersection(*req) if len(req) == len(bs) and req else set()


def _tag(b, key) -> set | None:
    props = b.get("properties")
    prop = props.get(key) if isinstance(props, Mapping) else None
    return _values(prop) if isinstance(prop, Mapping) else None


def refuse_unenforced(schema, field: str) -> None:
    """``GrammarError`` (``invalid_schema``) naming the first few places where ``schema`` uses a keyword
    the grammar relaxes: what ``strict: true`` asks for."""
    found = unenforced(schema)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        msg = (
            f"{field}: strict: the grammar cannot hold a reply to {', '.join(found[:3])}{more}; "
            "without strict these keywords are relaxed (oneOf as anyOf, the others not enforced)"
        )
        raise GrammarError("invalid_schema", msg, field)
