"""Self-distillation prompts of several kinds (``specd.training.data.task_prompts``): built from
public, non-evaluation text, counted as asked, deterministic per seed; bad ``--tasks`` specs are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specd.training.data import parse_counts, task_prompts

GSM8K = Path(__file__).resolve().parents[1].parent / "shared/data/gsm8k/train.jsonl"
SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared/data/tinyshakespeare/input.txt"


def _records(n: int = 50) -> list:
    return [json.loads(line) for line in GSM8K.read_text().splitlines()[:n]]


def test_parse_counts_reads_kinds_and_refuses_unknown_ones():
    assert parse_counts("write=3, translate=2,code=1") == {"write": 3, "translate": 2, "code": 1}
    assert parse_counts(None) == {} and parse_counts("") == {}
    for bad in ("poetry=3", "write=x", "write"):
        with pytest.raises(ValueError, match="--tasks"):
            parse_counts(bad)


@pytest.mark.skipif(not GSM8K.exists() or not SHAKESPEARE.exists(), reason="../shared/data missing")
def test_task_prompts_counts_sources_and_seed():
    recs = _records()
    counts = {"write": 4, "code": 3, "translate": 5, "summarize": 2, "passage_qa": 2, "rewrite": 3}
    out = task_prompts(recs, str(SHAKESPEARE), counts, seed=1)
    assert len(out) == sum(counts.values())
    assert sum(p.startswith("Translate the following text into") for p in out) == 5
    assert sum(p.startswith("Summarize the following passage") for p in out) == 2
    assert sum(p.startswith("Read the passage and answer") for p in out) == 2
    assert sum(p.startswith("Here is a problem and a worked solution") for p in out) == 3
    text = SHAKESPEARE.read_text()
    for p in out:
        if p.startswith("Summarize"):
            lines = p.split("\n\n", 1)[1].split("\n")
            assert len(lines) == 16 and all(ln in text for ln in lines)  # quoted from the file
        if p.startswith("Translate"):
            assert p.split("\n\n", 1)[1] in {r["question"] for r in recs}
    assert out == task_prompts(recs, str(SHAKESPEARE), counts, seed=1)
    assert out != task_prompts(recs, str(SHAKESPEARE), counts, seed=2)
    assert task_prompts(recs, None, {"summarize": 3}, seed=1) == []  # no passages file: none of that kind
