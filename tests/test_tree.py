"""Tests for specd.sampling.tree and specd.config: DraftTree structure, masks, positions, static tree choices."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.config import TreeChoices, static_tree_choices
from specd.sampling.tree import DraftTree

# 5 (0) -> 7 (1) -> 3 (3)
#       -> 9 (2)
EX = DraftTree.from_parents([5, 7, 9, 3], [-1, 0, 0, 1])


def test_example_structure():
    assert EX.num_nodes == len(EX) == 4
    assert EX.tokens.dtype == torch.int64 and EX.tokens.tolist() == [5, 7, 9, 3]
    assert EX.parents.tolist() == [-1, 0, 0, 1]
    assert EX.depths.tolist() == [0, 1, 1, 2]
    assert EX.max_depth == 2
    assert EX.children == [[1, 2], [3], [], []]
    assert EX.positions(10).tolist() == [10, 11, 11, 12]
    assert EX.positions(0).dtype == torch.int64
    assert EX.path_to(3) == [0, 1, 3] and EX.path_to(0) == [0] and EX.path_to(-1) == [0, 1, 3]
    want = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(EX.ancestor_mask(), want)
    assert EX.ancestor_mask() is EX.ancestor_mask()  # cached
    assert EX.is_leaf(2) and not EX.is_leaf(1)
    with pytest.raises(IndexError):
        EX.path_to(4)


def test_chain():
    t = DraftTree.chain(4, [8, 15, 16])
    assert t.token_list == [4, 8, 15, 16] and t.parent_list == [-1, 0, 1, 2]
    assert torch.equal(t.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert t.positions(3).tolist() == [3, 4, 5, 6]
    root = DraftTree.chain(2)
    assert root.num_nodes == 1 and root.max_depth == 0 and root.children == [[]]
    assert torch.equal(root.ancestor_mask(), torch.ones(1, 1, dtype=torch.bool))
    assert DraftTree.chain(1, torch.tensor([2, 3])).token_list == [1, 2, 3]


def test_tensor_inputs():
    t = DraftTree.from_parents(torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([-1, 0, 0]))
    assert t.tokens.dtype == torch.int64 and t.token_list == [1, 2, 3]
    assert t.children == [[1, 2], [], []]


@pytest.mark.parametrize(
    "tokens,parents",
    [
        ([], []),  # no root
        ([1, 2], [0, 0]),  # parents[0] must be -1
        ([1, 2, 3], [-1, 0]),  # length mismatch
        ([1, 2, 3], [-1, 2, 0]),  # parent after child
        ([1, 2, 3], [-1, 1, 0]),  # self parent
        ([1, 2, 3], [-1, 0, -1]),  # second root
        ([1, 2, 3], [-1, 0, 7]),  # out of range
    ],
)
def test_invalid_parents_rejected(tokens, parents):
    with pytest.raises(ValueError):
        DraftTree.from_parents(tokens, parents)


def test_invalid_shapes_rejected():
    with pytest.raises(ValueError):
        DraftTree.from_parents(torch.zeros(2, 2, dtype=torch.int64), [-1, 0])


def test_static_tree_choices():
    c = static_tree_choices([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    assert isinstance(c, TreeChoices)
    assert c.parents == [-1, 0, 0, 1, 1, 2]
    assert c.ranks == [-1, 0, 1, 0, 1, 0]
    assert c.paths == [(), (0,), (1,), (0, 0), (0, 1), (1, 0)]
    # any input order, lists allowed, explicit root allowed: BFS order out
    c2 = static_tree_choices([[1, 0], [0, 1], (), [0], [0, 0], [1]])
    assert c2 == c
    t = DraftTree.from_parents([0] * len(c.parents), c.parents)
    assert t.depth_list == [len(p) for p in c.paths]
    assert static_tree_choices([]).parents == [-1]
    deep = static_tree_choices([(0,), (0, 0), (0, 0, 0), (2,)])
    assert deep.parents == [-1, 0, 0, 1, 3] and deep.ranks == [-1, 0, 2, 0, 0]


@pytest.mark.parametrize(
    "spec",
    [
        [(0, 0)],  # missing prefix (0,)
        [(0,), (0, 1, 0)],  # missing prefix (0, 1)
        [(0,), (0,)],  # duplicate
        [(0,), (-1,)],  # negative rank
        [(0,), (0.5,)],  # not an int
        [5],  # not a sequence
    ],
)
def test_static_tree_choices_invalid(spec):
    with pytest.raises(ValueError):
        static_tree_choices(spec)


def test_sibling_table():
    t = DraftTree.from_parents([0, 4, 4, 6, 5], [-1, 0, 0, 2, 0])
    internal, kid_tokens, index, most, fewest = t.sibling_table()
    assert internal == [0, 2]
    assert kid_tokens == [[4, -1, 5], [6]]  # the repeated 4 is marked -1
    assert index == [0, -1, 1, -1, -1]
    assert (most, fewest) == (3, 1)
    assert DraftTree.chain(1).sibling_table() == ([], [], [-1], 0, 0)


@st.composite
def trees(draw):
    n = draw(st.integers(1, 40))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    return DraftTree.from_parents(tokens, parents)


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(0, 10_000))
def test_random_trees_consistent(t, ctx):
    n = t.num_nodes
    mask = t.ancestor_mask()
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    depths = t.depths.tolist()
    for i in range(n):
        path = t.path_to(i)
        assert path[0] == 0 and path[-1] == i
        assert all(t.parent_list[b] == a for a, b in zip(path, path[1:]))
        assert mask[i].nonzero().flatten().tolist() == path  # mask row = root..i path
        assert depths[i] == len(path) - 1
        assert t.children[i] == [c for c in range(n) if t.parent_list[c] == i]
    assert torch.equal(t.positions(ctx), torch.tensor(depths) + ctx)
    assert t.max_depth == max(depths)
    # the mask is lower-triangular (parents precede children) and each row's ancestors are
    # exactly the parent's row plus itself
    assert torch.equal(mask, mask.tril())
    for i in range(1, n):
        want = mask[t.parent_list[i]].clone()
        want[i] = True
        assert torch.equal(mask[i], want)


def test_top1_run_counts_the_leading_first_children_of_an_accepted_path():
    from specd.sampling.tree import top1_run

    #        0
    #      1   2        (1: the root's first child)
    #     3 4   5       (3: 1's first child; 5: 2's first child)
    #     6             (6: 3's first child)
    tree = DraftTree([0, 10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 2, 3])
    assert top1_run(tree, [1, 3, 6]) == 3  # the top-1 chain itself
    assert top1_run(tree, [1, 4]) == 1  # second choice at depth 2: a chain would have stopped there
    assert top1_run(tree, [2, 5]) == 0  # second choice at depth 1
    assert top1_run(tree, []) == 0
