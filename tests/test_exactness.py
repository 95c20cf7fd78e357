"""Which JSON-schema keywords the grammar holds a reply to, measured on the library: every keyword
``specd.structured.exactness`` calls relaxed lets an invalid reply through the compiled grammar,
every keyword it calls enforced stops one; ``strict: true`` refuses the relaxed ones at the request
(chat ``response_format``, Responses ``text.format``, a strict function tool) and over HTTP."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specd.structured import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    builtin_vocabulary,
    grammar_spec,
    text_format_spec,
)
from specd.structured.exactness import unenforced
from tests.conftest import SHARED

AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
# keyword -> (a schema using it, a reply valid JSON that breaks only that keyword)
RELAXED = {
    "not": ({"type": "integer", "not": {"const": 3}}, "3"),
    "if": (
        {"type": "object", "properties": AB, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
        '{"a": 1}',
    ),
    "dependencies": (  # (a draft-7 keyword)
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": AB,
            "dependencies": {"a": ["b"]},
        },
        '{"a": 1}',
    ),
    "dependentRequired": ({"type": "object", "properties": AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1]"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "3"),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 3}, {"type": "integer", "maximum": 5}]}, "7"),
    "format regex": ({"type": "string", "format": "regex"}, '"(("'),  # (a format the library does not check)
}
ENFORCED = {
    "multipleOf": ({"type": "integer", "multipleOf": 5}, "7"),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
        '{"y": 1}',
    ),
    "propertyNames": (
        {"type": "object", "propertyNames": {"pattern": "^a"}, "additionalProperties": {"type": "integer"}},
        '{"b": 1}',
    ),
    "format": ({"type": "string", "format": "email"}, '"nope"'),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, "3"),
    "minProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, '{"a": 1}'),
    "oneOf of disjoint types": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    "oneOf of a discriminator": (
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}}, "required": ["k"]},
                {"$ref": "#/$defs/B"},
            ],
            "$defs": {"B": {"type": "object", "properties": {"k": {"enum": ["b"]}}, "required": ["k"]}},
        },
        '{"k": "c"}',
    ),
}


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(builtin_vocabulary())


def _grammar_takes(compiler, schema, text: str) -> bool:
    g = compiler.compile(GrammarSpec("json_schema", schema))
    m = g.matcher()
    return all(m.advance(t) for t in g.vocab.encode(text)) and m.can_end()


@pytest.mark.parametrize("name", RELAXED)
def test_relaxed_keywords_let_an_invalid_reply_through_and_are_listed(compiler, name):
    schema, bad = RELAXED[name]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(bad), schema, format_checker=jsonschema.FormatChecker())
    assert _grammar_takes(compiler, schema, bad)  # (the library relaxes it: were it enforced, drop it here)
    assert unenforced(schema) == [f"{name} at /"]


def test_an_object_allof_that_compiling_merges_is_enforced(compiler):
    schema = {"allOf": [{"type": "object", "properties": AB, "required": ["a"]}, {"required": ["b"]}]}
    assert unenforced(schema) == [] and not _grammar_takes(compiler, schema, '{"a": 1}')


@pytest.mark.parametrize("name", ENFORCED)
def test_enforced_keywords_stop_an_invalid_reply_and_are_not_listed(compiler, name):
    schema, bad = ENFORCED[name]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(bad), schema, format_checker=jsonschema.FormatChecker())
    assert not _grammar_takes(compiler, schema, bad)
    assert unenforced(schema) == []


def test_nested_places_are_named_by_their_pointer():
    schema = {
        "type": "object",
        "properties": {"a/b": {"type": "array", "items": {"not": {"type": "null"}}}, "c": {"$ref": "#/$defs/C"}},
        "$defs": {"C": {"type": "array", "uniqueItems": True}},
    }
    assert unenforced(schema) == ["not at /properties/a~1b/items", "uniqueItems at /$defs/C"]
    deep: dict = {"type": "integer", "not": {"const": 0}}
    for _ in range(5000):  # (no recursion limit: the walk is iterative)
        deep = {"type": "array", "items": deep}
    assert len(unenforced(deep)) == 1


def test_strict_refuses_relaxed_keywords_at_every_kind_of_request():
    schema = RELAXED["dependencies"][0]
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    with pytest.raises(GrammarError) as e:
        grammar_spec({"response_format": rf})
    assert e.value.code == "invalid_schema" and "dependencies at /" in e.value.message and "strict" in e.value.message
    assert e.value.field == "response_format.json_schema.schema"
    relaxed = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert grammar_spec({"response_format": relaxed}).value == schema  # (without strict: taken, relaxed)
    with pytest.raises(GrammarError) as e:
        text_format_spec({"type": "json_schema", "name": "x", "schema": schema, "strict": True})
    assert e.value.code == "invalid_schema"
    tool = {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
    with pytest.raises(GrammarError) as e:
        grammar_spec({"tools": [tool], "tool_choice": "required"})
    assert e.value.code == "invalid_tools" and "tools[0].function.parameters" in e.value.message
    tool["function"]["strict"] = False
    assert grammar_spec({"tools": [tool], "tool_choice": "required"}) is not None


def test_how_many_sample_schemas_strict_would_refuse():
    """The JSONSchemaBench sample: the share of schemas with a relaxed keyword (recorded in
    docs/benchmarks.md); strict refuses exactly those, the default takes them all."""
    rows = [json.loads(line) for line in (SHARED / "data/jsonschemabench/schemas.jsonl").read_text().splitlines()]
    flagged = [r["id"] for r in rows if unenforced(r["schema"])]
    assert 0 < len(flagged) < len(rows) * 0.2
