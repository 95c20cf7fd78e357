"""``python -m eval bench json``'s reply checks: complete replies, JSON, valid, and the invalid ones
explained by a keyword the grammar relaxes (``specd.structured.exactness``)."""

from types import SimpleNamespace

from eval.bench_constrained import check_replies, validator

TAGS = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
PLAIN = {"type": "array", "items": {"type": "integer"}, "maxItems": 1}


def test_check_replies_counts_complete_json_valid_and_relaxed_invalid():
    texts = {1: "[1, 1]", 2: "[1, 2]", 3: "[1, 2]", 4: "[1", 5: "[3]"}
    engine = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: texts[ids[0]]))
    rows = [({"schema": TAGS}, None), ({"schema": TAGS}, None), ({"schema": PLAIN}, None)]
    rows += [({"schema": PLAIN}, None), ({"schema": PLAIN}, None)]
    replies = [([1], "stop"), ([2], "stop"), ([3], "stop"), ([4], "stop"), ([5], "length")]
    got = check_replies(engine, rows, replies, validator())
    assert got == {"replies": 5, "complete": 4, "json": 3, "valid": 1, "invalid_relaxed": 1}
