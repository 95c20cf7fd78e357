"""specd.structured: constraint specs from requests, the compiler (cache, bounds), the matcher's rollback and
forced tokens, draft-tree masks, logits masking, tool-call grammars and the tool-call parser.

Every grammar is compiled for the built-in model's vocabulary (SmolLM2-135M-Instruct, 49,152 tokens);
references are xgrammar's own matcher replayed from scratch, pure-torch masking and a small JSON-schema
checker (and ``jsonschema`` where it is installed: a dev dependency).
"""

from __future__ import annotations

import json
import random
import re
import time

import pytest
import torch
import xgrammar as xgr

from specd.structured import (
    CompilerConfig,
    GrammarCompiler,
    GrammarError,
    GrammarLimits,
    GrammarSpec,
    ToolCallParser,
    Vocabulary,
    apply_bitmask_,
    builtin_vocabulary,
    grammar_spec,
    pack,
    parse_tool_calls,
    prune_tree,
    text_format_spec,
    tools_system_prompt,
    tree_masks,
    unpack,
)
from tests.conftest import SHARED

try:  # a dev dependency: where it is installed, replies are checked by it too
    import jsonschema
except ImportError:  # pragma: no cover
    jsonschema = None

pytestmark = pytest.mark.timeout(300)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "pet"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return builtin_vocabulary()


@pytest.fixture(scope="module")
def compiler(vocab) -> GrammarCompiler:
    return GrammarCompiler(vocab, CompilerConfig(compile_timeout_s=30))


@pytest.fixture(scope="module")
def closing(vocab) -> torch.Tensor:
    """[V] bool: tokens holding a quote or a closing bracket (the walks favour them, so replies end)."""
    raw = vocab.info.decoded_vocab
    out = torch.zeros(vocab.size, dtype=torch.bool)
    for i, b in enumerate(raw):
        out[i] = any(c in b for c in (b'"', b"}", b"]"))
    return out


def schema_spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", schema)


def lib_mask(grammar, tokens: list) -> torch.Tensor:
    """xgrammar's own matcher, fresh, replaying ``tokens``: the [V] bool mask after them."""
    m = xgr.GrammarMatcher(grammar.compiled)
    for t in tokens:
        assert m.accept_token(t)
    bm = xgr.allocate_token_bitmask(1, grammar.vocab.size)
    m.fill_next_token_bitmask(bm)
    return unpack(bm, grammar.vocab.size)[0]


def walk(matcher, rng: torch.Generator, closing: torch.Tensor, max_tokens: int = 1500) -> list:
    """Greedy masked walk: argmax of random logits (+2 on ``closing`` tokens) under the mask, until a
    stop token is consumed; returns the tokens (the stop token included)."""
    out = []
    for _ in range(max_tokens):
        logits = torch.randn(matcher.vocab.size, generator=rng) + 2.0 * closing
        logits[~matcher.allowed()] = float("-inf")
        t = int(logits.argmax())
        assert matcher.advance(t)
        out.append(t)
        if matcher.is_terminated():
            return out
    raise AssertionError(f"no end after {max_tokens} tokens")


# a small JSON-schema check (the keywords of the schemas the walks use) ------------------------------
TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
KEYWORDS = {"type", "properties", "required", "additionalProperties", "enum", "const", "items", "minItems"}
KEYWORDS |= {"maxItems", "minLength", "maxLength", "minimum", "maximum", "pattern", "format"}
KEYWORDS |= {"description", "title", "default", "examples", "$schema"}


def valid(v, s: dict) -> bool:
    t = s.get("type")
    if t is not None and not any(TYPES[x](v) for x in (t if isinstance(t, list) else [t])):
        return False
    if ("enum" in s and v not in s["enum"]) or ("const" in s and v != s["const"]):
        return False
    if isinstance(v, str):
        n = len(v)
        if (
            n < s.get("minLength", 0)
            or n > s.get("maxLength", n)
            or ("pattern" in s and not re.search(s["pattern"], v))
        ):
            return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if v < s.get("minimum", v) or v > s.get("maximum", v):
            return False
    if isinstance(v, list):
        n = len(v)
        if n < s.get("minItems", 0) or n > s.get("maxItems", n):
            return False
        return all(valid(x, s.get("items", {})) for x in v)
    if isinstance(v, dict):
        props = s.get("properties", {})
        if not set(s.get("required", [])) <= set(v):
            return False
        extra = s.get("additionalProperties", True)
        for k, x in v.items():
            sub = props.get(k, extra)
            if sub is False or (isinstance(sub, dict) and not valid(x, sub)):
                return False
    return True


def test_the_small_checker_refuses_what_it_should():
    assert valid({"name": "a", "age": 3, "pet": "cat"}, PERSON)
    assert not valid({"name": "a", "age": 3.5, "pet": "cat"}, PERSON)
    assert not valid({"name": "a", "pet": "cat"}, PERSON)
    assert not valid({"name": "a", "age": 3, "pet": "cow"}, PERSON)
    assert not valid({"a": "xyz"}, {"properties": {"a": {"maxLength": 2}}})
    assert not valid({"b": 1}, {"properties": {}, "additionalProperties": False})


def _keywords(schema) -> set:
    """Schema keywords used anywhere (property names are not keywords)."""
    out, stack = set(), [schema]
    while stack:
        s = stack.pop()
        if isinstance(s, dict):
            out |= set(s)
            stack.extend((s.get("properties") or {}).values())
            stack.extend(x for x in (s.get("items"), s.get("additionalProperties")) if isinstance(x, dict))
    return out


def sample_schemas(per_category: int) -> list:
    """The first schemas of each JSONSchemaBench category that use only the checker's keywords."""
    rows = [json.loads(line) for line in (SHARED / "data" / "jsonschemabench" / "schemas.jsonl").open()]
    picked: dict = {}
    for r in rows:
        if _keywords(r["schema"]) <= KEYWORDS and len(picked.setdefault(r["category"], [])) < per_category:
            picked[r["category"]].append(r)
    return [r for rs in picked.values() for r in rs]


# the matcher ------------------------------------------------------------------------------------
def test_masks_equal_the_librarys_own_matcher_replayed_from_scratch(compiler, closing):
    g = compiler.compile(schema_spec(PERSON))
    m = g.matcher()
    tokens = walk(m, torch.Generator().manual_seed(1), closing)
    m.rollback(len(tokens))
    for i, t in enumerate(tokens):
        assert torch.equal(m.allowed(), lib_mask(g, tokens[:i])), f"position {i}"
        assert m.advance(t)
    assert m.is_terminated() and m.num_tokens == len(tokens)
    allowed = m.allowed()  # after the end: the stop token only
    assert allowed.sum() == 1 and allowed[g.vocab.stop_ids[0]]


def test_random_advance_and_rollback_match_a_fresh_replay(compiler, vocab):
    g = compiler.compile(schema_spec(PERSON))
    m, kept, rng = g.matcher(), [], random.Random(3)
    for step in range(120):
        op = rng.random()
        if op < 0.55:
            ids = m.allowed().nonzero().view(-1).tolist()
            t = rng.choice(ids)
            assert m.advance(t)
            kept.append(t)
        elif op < 0.7:
            forbidden = (~m.allowed()).nonzero().view(-1).tolist()
            assert not m.advance(rng.choice(forbidden))  # refused: nothing changes
            assert not m.advance(vocab.size + 5)  # out of range: refused too
        else:
            n = rng.randint(0, len(kept))
            m.rollback(n)
            del kept[len(kept) - n :]
        assert m.num_tokens == len(kept)
        fresh = g.matcher()
        assert all(fresh.advance(t) for t in kept)
        assert torch.equal(m.bitmask(), fresh.bitmask()), f"step {step}"
        assert m.is_terminated() == fresh.is_terminated()
    with pytest.raises(ValueError):
        m.rollback(len(kept) + 1)


def test_forced_tokens_on_fixed_keys(compiler, vocab):
    m = compiler.compile(schema_spec(PERSON)).matcher()
    assert m.forced_text() == '{"name": "'
    forced = m.forced_tokens(16)
    # the encoding of '{"name": "' less its last token ' "', which a longer token (' "a', ...) extends
    assert forced == vocab.encode('{"name":') and vocab.decode(forced) == '{"name":'
    assert m.num_tokens == 0 and torch.equal(m.allowed(), m.allowed())
    assert m.forced_tokens(2) == forced[:2] and m.forced_tokens(0) == []
    for t in vocab.encode('{"name": "Bo"'):
        assert m.advance(t)
    assert m.forced_text() == ', "age": '
    assert vocab.decode(m.forced_tokens(16)) == ', "age":'
    for t in vocab.encode(', "age": 7'):
        assert m.advance(t)
    assert m.forced_tokens(16) == []  # more digits or the comma: no single continuation
    for t in vocab.encode(', "pet": "c'):
        assert m.advance(t)
    tail = m.forced_tokens(16)  # the enum's tail: 'at"}'
    assert vocab.decode(tail) and 'at"}'.startswith(vocab.decode(tail))
    for t in tail:
        assert m.advance(t)


def test_lazily_built_masks_equal_the_eagerly_compiled_ones(compiler, vocab, closing):
    lazy = GrammarCompiler(vocab, CompilerConfig(lazy_masks=True))
    for r in sample_schemas(1):
        eager_m = compiler.compile(schema_spec(r["schema"])).matcher()
        lazy_m = lazy.compile(schema_spec(r["schema"])).matcher()
        tokens = walk(eager_m, torch.Generator().manual_seed(2), closing)
        eager_m.rollback(len(tokens))
        for t in tokens:
            assert torch.equal(lazy_m.bitmask(), eager_m.bitmask()), r["id"]
            assert lazy_m.advance(t) and eager_m.advance(t)
        assert lazy_m.is_terminated()


def test_padded_vocabulary_ids_are_never_allowed(vocab):
    wide = Vocabulary.from_tokenizer(vocab.tokenizer, size=vocab.size + 128)
    g = GrammarCompiler(wide).compile(GrammarSpec("regex", r"[a-z ]{0,40}"))
    m = g.matcher()
    for t in wide.encode("hello there"):
        a = m.allowed()
        assert a.shape == (wide.size,) and not a[vocab.size :].any() and a[: vocab.size].sum() > 100
        assert m.advance(t)
    assert not m.advance(vocab.size + 3)
    logits = torch.zeros(1, wide.size)
    apply_bitmask_(logits, m.bitmask().unsqueeze(0))
    assert torch.isinf(logits[0, vocab.size :]).all()


def test_sample_schemas_greedy_walks_decode_to_valid_json(compiler, vocab, closing):
    schemas = sample_schemas(2)
    assert len(schemas) == 8
    for r in schemas:
        g = compiler.compile(schema_spec(r["schema"]))
        for seed in range(2):
            tokens = walk(g.matcher(), torch.Generator().manual_seed(seed), closing)
            assert tokens[-1] in vocab.stop_ids
            value = json.loads(vocab.decode(tokens[:-1]))
            assert valid(value, r["schema"]), (r["id"], value)
            if jsonschema is not None:
                jsonschema.validate(value, r["schema"])


# draft trees --------------------------------------------------------------------------------------
def random_tree(m, rng: random.Random, n: int) -> tuple:
    """A tree of n nodes under the matcher's state: mostly allowed tokens, some forbidden ones."""
    parents, tokens, states = [-1], [0], [[]]
    for i in range(1, n):
        p = rng.randrange(i)
        path = states[p]
        for t in path:
            assert m.advance(t)
        allowed = m.allowed().nonzero().view(-1).tolist()
        m.rollback(len(path))
        t = rng.choice(allowed) if allowed and rng.random() < 0.8 else rng.randrange(m.vocab.size)
        parents.append(p)
        tokens.append(t)
        states.append([*path, t])
    return parents, tokens, states


def test_tree_masks_equal_per_path_replays_and_pruning_keeps_the_live_nodes(compiler, vocab):
    g = compiler.compile(schema_spec(PERSON))
    m, rng = g.matcher(), random.Random(5)
    for t in vocab.encode('{"name": "Al'):
        assert m.advance(t)
    before = m.bitmask().clone()
    for _ in range(3):
        parents, tokens, paths = random_tree(m, rng, 24)
        bm, alive = tree_masks(m, parents, tokens)
        assert bm.shape == (24, vocab.words) and alive[0]
        assert torch.equal(m.bitmask(), before) and m.num_tokens == 5  # the matcher is left as it was
        for i, path in enumerate(paths):
            replay = g.matcher()
            ok = all(replay.advance(t) for t in vocab.encode('{"name": "Al') + path)
            assert alive[i] == (ok and (i == 0 or alive[parents[i]])), f"node {i}"
            want = replay.bitmask() if alive[i] else torch.zeros(vocab.words, dtype=torch.int32)
            assert torch.equal(bm[i], want), f"node {i}"
        new_parents, new_tokens, kept = prune_tree(parents, tokens, alive)
        assert kept == [i for i in range(24) if alive[i]] and new_tokens == [tokens[i] for i in kept]
        assert all(kept[new_parents[j]] == parents[kept[j]] for j in range(1, len(kept)))


def test_tree_masks_example_from_the_docstring(vocab):
    g = GrammarCompiler(vocab).compile(GrammarSpec("choice", ("ab",)))
    a, b = vocab.encode("a")[0], vocab.encode("b")[0]
    x = vocab.encode("x")[0]
    bm, alive = tree_masks(g.matcher(), [-1, 0, 0, 1], [0, a, x, b])
    assert alive == [True, True, False, True]
    rows = unpack(bm, vocab.size)
    ab = vocab.encode("ab")
    assert len(ab) == 1 and rows[0].nonzero().view(-1).tolist() == sorted([a, ab[0]])  # "a" or the token "ab"
    assert rows[1].nonzero().view(-1).tolist() == [b]
    assert not rows[2].any() and rows[3].nonzero().view(-1).tolist() == list(vocab.stop_ids)
    with pytest.raises(ValueError):
        tree_masks(g.matcher(), [-1, 1], [0, a])
    with pytest.raises(ValueError):
        prune_tree([-1, 0, 1], [0, a, b], [True, False, True])


# logits masking ---------------------------------------------------------------------------------
@pytest.mark.parametrize("native", [True, False], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size,width", [(100, 100), (100, 131), (128, 128), (77, 60)])
def test_apply_bitmask_matches_masked_fill(dtype, vocab_size, width, native, monkeypatch):
    import specd.structured.masks as masks_mod

    if not native:  # the torch path (no CPU kernel, or not fp32 on the CPU)
        monkeypatch.setattr(masks_mod, "_native", lambda *a: False)
    g = torch.Generator().manual_seed(vocab_size + width)
    allowed = torch.rand(5, vocab_size, generator=g) < 0.3  # [5, V]
    bm = pack(allowed)  # [5, ceil(V/32)]
    assert torch.equal(unpack(bm, vocab_size), allowed)
    logits = torch.randn(5, width, generator=g).to(dtype)
    ref = logits.clone()
    cov = min(width, vocab_size)
    ref[:, :cov] = ref[:, :cov].masked_fill(~allowed[:, :cov], float("-inf"))
    ref[:, bm.shape[1] * 32 :] = float("-inf")  # past the bitmask's words: forbidden
    if width > vocab_size:
        ref[:, vocab_size:] = float("-inf")  # pack leaves bits past V at 0
    assert torch.equal(apply_bitmask_(logits.clone(), bm), ref)
    rows = torch.tensor([3, 0])
    some = logits.clone()
    apply_bitmask_(some, bm[rows], rows=rows)
    assert torch.equal(some[rows], ref[rows]) and torch.equal(some[[1, 2, 4]], logits[[1, 2, 4]])
    for span in (range(1, 4), range(0, 5, 2)):  # a view of rows 1-3; every other row
        some = logits.clone()
        apply_bitmask_(some, bm[list(span)], rows=span)
        rest = [i for i in range(5) if i not in span]
        assert torch.equal(some[list(span)], ref[list(span)]) and torch.equal(some[rest], logits[rest])
    with pytest.raises(ValueError):
        apply_bitmask_(logits.clone(), bm[:2])
    free = torch.full_like(bm, -1)  # every token allowed: only columns past the words are forbidden
    out = apply_bitmask_(logits.clone(), free)
    assert torch.equal(out[:, : free.shape[1] * 32], logits[:, : free.shape[1] * 32])
    assert torch.isinf(out[:, free.shape[1] * 32 :]).all()


# the compiler -------------------------------------------------------------------------------------
def test_the_cache_returns_the_same_compiled_grammar(vocab):
    c = GrammarCompiler(vocab)
    a = c.submit(schema_spec(PERSON))
    b = c.submit(schema_spec(json.loads(json.dumps(PERSON))))  # an equal copy
    assert a is b and a.result() is b.result() and c.cached() == 1
    reordered = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}
    other = c.compile(schema_spec(reordered))  # property order is output order: another grammar
    assert other is not a.result() and c.cached() == 2
    assert other.matcher().forced_text() == '{"pet": "'
    assert GrammarCompiler(vocab).compile(schema_spec(PERSON)) is not a.result()  # per compiler


def nested(depth: int) -> dict:
    root: dict = {"type": "object"}
    node = root
    for _ in range(depth):
        node["properties"] = {"a": {"type": "object"}}
        node["required"] = ["a"]
        node = node["properties"]["a"]
    return root


def refusal(compiler, spec, bound: float = 2.0) -> GrammarError:
    t0 = time.perf_counter()
    fut = compiler.submit(spec)
    err = fut.exception(timeout=bound)
    assert time.perf_counter() - t0 < bound and isinstance(err, GrammarError), err
    return err


@pytest.mark.parametrize(
    "schema,code,words",
    [
        (nested(100_000), "grammar_too_large", "deeper than 64"),
        ({"enum": list(range(100_000))}, "grammar_too_large", "100000 entries"),
        ({"type": "strnig"}, "invalid_schema", "strnig"),
        ({"properties": {"a": {"$ref": "#/definitions/missing"}}, "required": ["a"]}, "invalid_schema", "missing"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "unsatisfiable_schema", "range"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "unsatisfiable_schema", "allOf"),
        ({"not": {}}, "unsatisfiable_schema", "not"),
        ({"type": "string", "pattern": "(a"}, "invalid_schema", "parenthesis"),
    ],
)
def test_pathological_schemas_are_refused_within_the_bound(compiler, schema, code, words):
    err = refusal(compiler, GrammarSpec("json_schema", schema, "response_format.json_schema.schema"))
    assert err.code == code and words in err.message, err.message
    assert err.field == "response_format.json_schema.schema" and err.to_dict()["code"] == code


def test_bad_regexes_grammars_and_tool_schemas_are_refused(compiler):
    assert refusal(compiler, GrammarSpec("regex", "[a-")).code == "invalid_regex"
    assert refusal(compiler, GrammarSpec("grammar", "root ::= missing_rule")).code == "invalid_grammar"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    err = refusal(compiler, grammar_spec({"tools": [bad], "tool_choice": "required"}))
    assert err.code == "invalid_tools" and "'f'" in err.message
    assert refusal(compiler, GrammarSpec("choice", tuple(map(str, range(2000))))).code == "grammar_too_large"


def test_a_slow_compile_times_out_without_blocking_the_caller_or_the_next_compile(vocab):
    bound = 0.3
    c = GrammarCompiler(
        vocab, CompilerConfig(compile_timeout_s=bound, workers=1, limits=GrammarLimits(max_depth=10**6))
    )
    deep = schema_spec(nested(250))  # ~2 s to compile on one core (growing with the square of the depth)
    t0 = time.perf_counter()
    slow = c.submit(deep)
    assert time.perf_counter() - t0 < 0.1  # submit returns at once
    err = slow.exception(timeout=bound + 1)
    assert isinstance(err, GrammarError) and err.code == "compile_timeout" and "0.3 s" in err.message
    assert time.perf_counter() - t0 < bound + 0.3
    # the timed-out compile (still running) handed its one worker slot on: the next compile does not
    # wait for it (it would run past its own bound if it did)
    assert c.compile(schema_spec({"type": "integer"})).matcher().allowed().any()
    assert c.submit(deep) is slow  # the refusal is cached


# request fields -------------------------------------------------------------------------------------
def test_response_format_and_vllm_fields_become_specs():
    assert grammar_spec({}) is None and grammar_spec({"response_format": {"type": "text"}}) is None
    s = grammar_spec({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    assert s.kind == "json_schema" and s.value == PERSON and s.field == "response_format.json_schema.schema"
    s = grammar_spec({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True}}})
    assert s.kind == "json_object"
    assert text_format_spec({"type": "json_schema", "name": "p", "schema": PERSON}).value == PERSON
    assert grammar_spec({"structured_outputs": {"regex": "a+"}}).value == "a+"
    assert grammar_spec({"structured_outputs": {"json": json.dumps(PERSON)}}).value == PERSON
    assert grammar_spec({"structured_outputs": {"grammar": 'root ::= "x"'}}).kind == "grammar"
    assert grammar_spec({"structured_outputs": {"json_object": True, "disable_fallback": True}}).kind == "json_object"
    assert grammar_spec({"guided_choice": ["a", "b", "a"]}).value == ("a", "b")
    assert grammar_spec({"guided_regex": "[0-9]+"}).field == "guided_regex"
    assert grammar_spec({"tools": [WEATHER], "tool_choice": "none"}) is None
    t = grammar_spec({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert t.kind == "tool_calls" and (t.value.choice, t.value.name) == ("named", "add")
    assert [f.name for f in t.value.allowed] == ["add"]
    flat_tools = [{"type": "function", **ADD["function"]}]  # the Responses API's tool layout
    r = grammar_spec({"tools": flat_tools, "tool_choice": {"type": "function", "name": "add"}})
    assert r.value.name == "add" and r.value.functions[0].parameters == ADD["function"]["parameters"]
    auto = {**ADD, "function": {**ADD["function"], "name": "auto"}}  # a function named like a choice
    named = grammar_spec({"tools": [WEATHER, auto], "tool_choice": {"type": "function", "function": {"name": "auto"}}})
    assert named.value.choice == "named" and [f.name for f in named.value.allowed] == ["auto"]


@pytest.mark.parametrize(
    "body,code,field",
    [
        ({"response_format": {"type": "yaml"}}, "invalid_response_format", "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "invalid_response_format", None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
            "invalid_schema",
            None,
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "invalid_response_format", "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "invalid_response_format", None),
        ({"structured_outputs": {"json": "{not json"}}, "invalid_schema", "structured_outputs.json"),
        ({"guided_choice": []}, "invalid_response_format", "guided_choice"),
        ({"guided_choice": ["a", 3]}, "invalid_response_format", "guided_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "invalid_tools", "tools"),
        ({"tools": [WEATHER, WEATHER]}, "invalid_tools", "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "invalid_tools", None),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "invalid_tools", "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "invalid_tools", "parallel_tool_calls"),
        ({"tool_choice": "required"}, "invalid_tools", "tool_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "conflicting_constraints", None),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "conflicting_constraints", None),
    ],
)
def test_malformed_constraint_fields_are_refused_with_their_field(body, code, field):
    with pytest.raises(GrammarError) as e:
        grammar_spec(body)
    assert e.value.code == code and e.value.message
    if field is not None:
        assert e.value.field == field


# tool calls ---------------------------------------------------------------------------------------
def chunks(text: str, rng: random.Random) -> list:
    """``text`` cut at random places (inside tags and JSON strings included)."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def streamed(text: str, rng: random.Random) -> tuple:
    """Feed ``text`` in random chunks; ``(content or None, [(id, name, arguments)], deltas)``."""
    p = ToolCallParser(ids=lambda i: f"call_{i}")
    content, calls, deltas = "", {}, []
    for piece in [*chunks(text, rng), None]:
        d = p.feed(piece) if piece is not None else p.finish()
        content += d.content
        for c in d.tool_calls:
            deltas.append(c.to_openai())
            if c.id is not None:
                assert c.index == len(calls) and c.arguments == ""
                calls[c.index] = [c.id, c.name, ""]
            calls[c.index][2] += c.arguments
    done = [[x.id, x.name, x.arguments] for x in p.calls]
    assert done == list(calls.values())[: len(done)] and len(calls) - len(done) <= p.cut  # (+ one cut short)
    return content or None, [tuple(v) for v in calls.values()], deltas


def flat(parsed: tuple) -> tuple:
    content, calls = parsed
    return content, [(c.id, c.name, c.arguments) for c in calls]


TEXTS = [
    "Plain text, no calls. <tool is not a tag> <tool_call",
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris\\" {", "unit": "C"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": [1, {"x": "]"}], "b": 2}}\n</tool_call>\n',
    "x <tool_call>not json</tool_call> y",
    '  <tool_call>\n{"name": "a\\"b", "arguments": {}}\n</tool_call>  tail text  ',
    '<tool_call>\n{"name": "w", "arguments": {"s": "</tool_call> <tool_call> {"}}\n</tool_call> after',
]
CUT = [  # replies cut short (max_tokens): (text, content, [(name, arguments so far)], the last call cut)
    ('Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b"', "Let me look.", [("add", '{"a": 1, "b"')],
     True),
    (TEXTS[1] + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci', None,
     [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"ci')], True),
    (TEXTS[1][:-4], None, [("add", '{"a": 1, "b": 2}')], True),  # the arguments closed, the tag not
    ('<tool_call>\n{"name": "add", "arguments": ', None, [("add", "")], True),
    (TEXTS[1] + "\nHi <tool_call>\n{\"na", "Hi", [("add", '{"a": 1, "b": 2}')], False),  # cut before the name:
    ("x <tool_call>not json</tool_call> y <tool_", "x <tool_call>not json</tool_call> y <tool_", [], False),
    ('<tool_call>{"name": "w", "arguments": {"text": "use <tool_call> tags', None,  # (tags inside strings)
     [("w", '{"text": "use <tool_call> tags')], True),
    ('<tool_call>{"name": "a", "arguments": {"s": "</tool_call> is the tag", "t": 1', None,
     [("a", '{"s": "</tool_call> is the tag", "t": 1')], True),
]  # fmt: skip


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_tool_calls_reassemble_to_the_non_streamed_parse(text):
    want = flat(parse_tool_calls(text, ids=lambda i: f"call_{i}"))
    for seed in range(25):
        content, calls, deltas = streamed(text, random.Random(seed))
        assert (content, calls) == want, seed
        for d in deltas:  # OpenAI's delta shapes: the first of a call names it, the rest carry arguments
            assert set(d) in ({"index", "id", "type", "function"}, {"index", "function"})


@pytest.mark.parametrize("text, content, calls, cut", CUT)
def test_a_reply_cut_inside_a_call_parses_alike_streamed_or_not(text, content, calls, cut):
    """Cut short inside a call, the non-streamed parse reports what the stream sent: the call last, its
    arguments as far as they got, ``complete`` False (OpenAI's calls cut by ``max_tokens``); cut before
    the call's name, nothing of it (the stream sent nothing). The finish reason stays the engine's
    (``length``; not ``tool_calls`` after a stop string either)."""
    from specd.serving.openai_routes import tool_finish
    from specd.serving.protocol import tool_reply

    got_content, got = parse_tool_calls(text, ids=lambda i: f"call_{i}")
    assert (got_content, [(c.name, c.arguments) for c in got]) == (content, calls)
    assert [c.complete for c in got] == [True] * (len(calls) - cut) + [False] * cut
    assert [c.index for c in got] == list(range(len(got)))
    for seed in range(25):
        assert streamed(text, random.Random(seed))[:2] == flat((got_content, got)), seed
    assert tool_finish("length", got) == "length"
    assert tool_finish("stop", got) == ("stop" if cut or not got else "tool_calls")
    assert tool_finish("stop", [c for c in got if c.complete], cut=cut) == tool_finish("stop", got)  # (streamed)
    finish, fields = tool_reply(text, "stop")
    assert finish == ("stop" if cut or not got else "tool_calls") and fields["content"] == content
    assert [c["function"]["arguments"] for c in fields["tool_calls"]] == [a for _, a in calls]
    p = ToolCallParser()
    p.feed(text)
    p.finish()
    assert p.cut == cut
    # tool_choice required / named: nothing but calls, so text outside them (a tag cut short) is no content
    assert parse_tool_calls(text, ids=lambda i: f"call_{i}", free_text=False) == (None, got)
    q = ToolCallParser(ids=lambda i: f"call_{i}", free_text=False)
    assert [q.feed(text).content, q.finish().content] == ["", ""] and q.calls == [c for c in got if c.complete]


def test_the_non_streamed_parse_reads_calls_and_content():
    content, calls = parse_tool_calls(TEXTS[2], ids=lambda i: f"id{i}")
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0].arguments) == {"city": 'Pa}ris" {', "unit": "C"}
    assert calls[1].arguments == '{"a": [1, {"x": "]"}], "b": 2}'
    assert calls[0].to_openai() == {
        "id": "id0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": calls[0].arguments},
    }
    assert parse_tool_calls(TEXTS[3]) == ("x <tool_call>not json</tool_call> y", [])
    assert parse_tool_calls(" \n ") == (None, [])
    cut = ToolCallParser()
    cut.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert cut.finish().incomplete and cut.calls == []


def tool_spec(choice, parallel: bool) -> GrammarSpec:
    return grammar_spec({"tools": [WEATHER, ADD], "tool_choice": choice, "parallel_tool_calls": parallel})


@pytest.mark.parametrize("parallel", [False, True])
def test_required_and_named_tool_choice_give_well_formed_calls(compiler, vocab, closing, parallel):
    for choice, names in (
        ("required", {"get_weather", "add"}),
        ({"type": "function", "function": {"name": "add"}}, {"add"}),
    ):
        g = compiler.compile(tool_spec(choice, parallel))
        m = g.matcher()
        assert m.forced_text().startswith('<tool_call>\n{"name": "')  # no text before the call
        for seed in range(3):
            tokens = walk(g.matcher(), torch.Generator().manual_seed(seed), closing)
            text = vocab.decode(tokens[:-1])
            content, calls = parse_tool_calls(text)
            assert content is None and 1 <= len(calls) and (parallel or len(calls) == 1), text
            assert {c.name for c in calls} <= names
            for c in calls:
                params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}[c.name]
                assert valid(json.loads(c.arguments), params), c
            ids = flat(parse_tool_calls(text, ids=lambda i: f"call_{i}"))
            assert streamed(text, random.Random(seed))[:2] == ids


def test_auto_tool_choice_is_free_until_the_opening_tag(compiler, vocab, closing):
    g = compiler.compile(tool_spec("auto", False))
    m = g.matcher()
    assert m.allowed().sum() > 40_000 and m.forced_text() == ""  # free text: almost every token
    assert m.allowed()[vocab.stop_ids[0]] and m.can_end()  # a reply without a call may end
    for t in vocab.encode("Checking the weather. <tool_call>"):
        assert m.advance(t)
    assert m.forced_text() == '\n{"name": "'
    for t in vocab.encode('\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "'):
        assert m.advance(t)
    assert not m.advance(vocab.encode("K")[0])  # the enum C | F
    tail = walk(m, torch.Generator().manual_seed(0), closing)
    m.rollback(1)  # the stop token: without parallel_tool_calls the reply ends after one call
    assert m.allowed().nonzero().view(-1).tolist() == list(vocab.stop_ids)
    full = "Checking the weather. <tool_call>" + '\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "'
    full += vocab.decode(tail[:-1])
    content, calls = parse_tool_calls(full)
    assert content == "Checking the weather." and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments)["city"] == "Oslo"


def test_the_tools_system_prompt_names_the_tools_and_the_format():
    spec = tool_spec("required", True).value
    text = tools_system_prompt(spec)
    assert "get_weather" in text and "add" in text and "<tool_call>" in text and "</tool_call>" in text
    assert "must call a function" in text and "several calls" in text
    assert "must call add" in tools_system_prompt(
        tool_spec({"type": "function", "function": {"name": "add"}}, False).value
    )


def test_object_allof_is_merged_so_every_branchs_required_keys_hold(compiler, vocab):
    """An object extended through ``allOf`` (a ``$ref`` base + its own properties) needs the keys of
    both branches: the library alone kept one branch (a sample reply lacked the extension's key)."""
    from specd.structured.allof import merge_object_allof

    base = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    more = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    schema = {
        "definitions": {"pet": base},
        "type": "object",
        "properties": {"a": {"$ref": "#/definitions/pet"}, "b": {"allOf": [{"$ref": "#/definitions/pet"}, more]}},
        "required": ["a", "b"],
    }
    b = merge_object_allof(schema)["properties"]["b"]
    assert b == {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"]}  # fmt: skip
    assert "allOf" in schema["properties"]["b"]  # the request's own schema is not changed
    clash = {"allOf": [base, {"properties": {"name": {"type": "integer"}}}]}
    assert merge_object_allof(clash) == clash  # a property both define differently: left to the library

    def accepts(text: str) -> bool:
        m = compiler.compile(schema_spec(schema)).matcher()
        return all(m.advance(t) for t in vocab.encode(text)) and m.can_end()

    assert accepts('{"a": {"name": "x"}, "b": {"name": "y", "age": 3}}')
    assert not accepts('{"a": {"name": "x"}, "b": {"name": "y"}}')  # b's "age" is required
