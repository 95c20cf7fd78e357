"""Self-distillation prompts of several kinds (``specd.training.data.task_prompts``): built from
public, non-evaluation text, counted as asked, deterministic per seed; bad ``--tasks`` specs are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specd.training.data import ARTICLE, DOC_QUESTIONS, TRANSLATE, parse_counts, second_round_prompts, task_prompts

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


@pytest.mark.skipif(not GSM8K.exists(), reason="../shared/data missing")
def test_article_requests_quote_gsm8k_stories():
    recs = _records()
    out = task_prompts(recs, None, {"article": 6}, seed=3)
    assert len(out) == 6
    stories = {r["question"] for r in recs}
    assert all(p.startswith("Write a short news article based on this story: ") for p in out)
    assert all(p.split(": ", 1)[1] in stories for p in out)


def test_second_round_prompts_quote_the_first_rounds_replies():
    article = "Town opens a new library. " * 12  # over 200 characters: long enough to quote
    pairs = [
        (ARTICLE.format("a story"), article),
        (ARTICLE.format("another story"), "Too short."),  # not quoted
        (TRANSLATE.format("German") + "Tom has 3 apples and buys 4 more.", "Tom hat 3 Äpfel und kauft 4 weitere."),
        (TRANSLATE.format("French") + "It rains all day in the city.", "Il pleut toute la journée en ville."),
        ("Write a short poem about the sea.", "Waves " * 60),  # not an article: never quoted
    ]
    counts = {"summarize_own": 5, "rag_own": 1, "translate_back": 5}
    out = second_round_prompts(pairs, counts, seed=1)
    assert sorted(p for p in out if p.startswith("Summarize: ")) == ["Summarize: " + article.strip()]  # no repeats
    rag = [p for p in out if p.startswith(article.strip() + "\n\n")]
    assert len(rag) == 1 and rag[0].split("\n\n")[1] in DOC_QUESTIONS
    assert sorted(p for p in out if p.startswith("Translate ")) == [
        "Translate French to English: Il pleut toute la journée en ville.",
        "Translate German to English: Tom hat 3 Äpfel und kauft 4 weitere.",
    ]
    assert len(out) == 4
    assert out == second_round_prompts(pairs, counts, seed=1)
    assert second_round_prompts(pairs[4:], counts, seed=1) == []  # nothing to quote: none
    assert parse_counts("article=2,summarize_own=1,rag_own=1,translate_back=1")["rag_own"] == 1
