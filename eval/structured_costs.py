"""What specd.structured's per-step work costs on the built-in vocabulary (49,152 tokens), one thread.

- ``tree_masks``: the masks of every node of a draft tree of N nodes (a random tree under a JSON
  schema's grammar, 80% of its tokens allowed), from inside a string value and from a key;
- ``apply_bitmask_``: -inf into the forbidden logits of R rows of fp32 logits;
- ``forced_tokens(16)`` at a fixed key, and one ``advance`` + ``rollback(1)``.

Medians (and the fastest) of ``--reps`` timings, in microseconds.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m eval.structured_costs [--reps 200]
"""

from __future__ import annotations

import argparse
import random
import time

from eval import harness as H

COMMAND = "costs masks"  # python -m eval costs masks (this module's ``main``)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "pet"],
}
STATES = {"in a string": '{"name": "Al', "after a key": '{"name": "Al", "age": 3'}


def timed(fn, reps: int) -> tuple:
    """``(median, fastest)`` microseconds of ``fn()`` over ``reps`` calls (after one warm-up)."""
    fn()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t0) * 1e6)
    return H.median(xs), min(xs)


def random_tree(m, rng: random.Random, n: int) -> tuple:
    """``(parents, tokens)``: n nodes under the matcher's state, 80% of them allowed tokens."""
    parents, tokens, paths = [-1], [0], [[]]
    for i in range(1, n):
        p = rng.randrange(i)
        for t in paths[p]:
            m.advance(t)
        allowed = m.allowed().nonzero().view(-1).tolist()
        m.rollback(len(paths[p]))
        t = rng.choice(allowed) if allowed and rng.random() < 0.8 else rng.randrange(m.vocab.size)
        parents.append(p)
        tokens.append(t)
        paths.append([*paths[p], t])
    return parents, tokens


def tree_rows(grammar, reps: int) -> list:
    from specd.structured import tree_masks

    rows = []
    for state, prefix in STATES.items():
        m = grammar.matcher()
        for t in grammar.vocab.encode(prefix):
            assert m.advance(t)
        for n in (8, 32, 64):
            parents, tokens = random_tree(m, random.Random(n), n)
            med, best = timed(lambda m=m, p=parents, t=tokens: tree_masks(m, p, t), reps)
            rows.append((f"tree_masks, {n} nodes, {state}", med, best))
    return rows


def other_rows(grammar, reps: int) -> list:
    import torch

    from specd.structured import apply_bitmask_, full_bitmask

    rows = []
    for r in (1, 8, 32, 64):
        logits = torch.randn(r, grammar.vocab.size)  # [R, V]
        bm = full_bitmask(r, grammar.vocab.size)
        bm[:, ::3] = 0x0F0F0F0F  # a mixed mask
        med, best = timed(lambda lg=logits, b=bm: apply_bitmask_(lg, b), reps)  # idempotent: the same logits
        rows.append((f"apply_bitmask_, {r} rows", med, best))
    m = grammar.matcher()
    med, best = timed(lambda: m.forced_tokens(16), reps)
    rows.append(("forced_tokens(16) at the first key", med, best))
    t = m.allowed().nonzero().view(-1)[0].item()
    med, best = timed(lambda: (m.advance(t), m.rollback(1)), reps)
    rows.append(("advance + rollback(1)", med, best))
    return rows


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    H.set_threads(1)
    from specd.structured import GrammarCompiler, GrammarSpec, builtin_vocabulary

    grammar = GrammarCompiler(builtin_vocabulary()).compile(GrammarSpec("json_schema", SCHEMA))
    rows = tree_rows(grammar, args.reps) + other_rows(grammar, args.reps)
    print("| work | median (us) | fastest (us) |\n|---|---|---|")
    for name, med, best in rows:
        print(f"| {name} | {med:.1f} | {best:.1f} |")
    return rows


if __name__ == "__main__":
    main()
