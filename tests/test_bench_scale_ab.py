"""``python -m eval bench scale --ab NAME=TREE ...``: specd trees' plain steps compared in alternating
processes (eval/bench_scale.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import eval.bench_scale as bs

ROOT = Path(__file__).resolve().parents[1]


def test_trees_step_in_their_own_processes_and_compare(tmp_path):
    """Each tree's process loads the file with that tree's code and times real steps; the first tree is
    the reference of the ratio column; the table shows every pass."""
    path = bs.write_f16(tmp_path / "tiny-f16.gguf", bs.SHAPES["tiny"], std=0.02, seed=1)
    trees = bs.parse_trees([f"a={ROOT}", f"b={ROOT}"])
    a = argparse.Namespace(threads=[1], passes=1, batch=2, tokens=5)
    rows = bs.ab_rows(trees, path, a)
    assert [(r["tree"], r["threads"], r["batch"]) for r in rows] == [("a", 1, 2), ("b", 1, 2)]
    assert all(len(r["step_ms"]) == 1 and all(ms > 0 for ms in r["step_ms"]) for r in rows)
    assert rows[0]["vs_first"] == 1.0 and rows[1]["vs_first"] > 0
    md = bs.ab_table(rows)
    assert md.count("| tiny-f16.gguf | 1 | 2 |") == 2 and "1.000x" in md


def test_bad_trees_and_failing_children_are_one_line_errors(tmp_path):
    with pytest.raises(SystemExit, match="expected NAME=TREE"):
        bs.parse_trees([str(ROOT)])
    with pytest.raises(SystemExit, match="expected NAME=TREE"):
        bs.parse_trees([f"x={tmp_path}"])
    with pytest.raises(SystemExit, match="the step timing failed"):
        bs.ab_step(ROOT, tmp_path / "missing.gguf", 1, 1, 4)
