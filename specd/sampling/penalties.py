"""Repetition, frequency and presence penalties on the rows the target verifies for one request.

Every row of a request's draft tree predicts the token after its node, so its penalties count the
reply as far as that node: the tokens the reply holds (``output``; the pending root among them once
the reply has begun) plus the draft tokens on the node's path below the root (its ancestors and
itself). Plain decoding penalizes its one row with the reply so far; after a speculative step
accepted a path, the next row is penalized with exactly the tokens that row of the tree counted.
The processed logits of every verified row are those plain decoding would compute at that place,
bit for bit (the same elementwise float32 operations on the same counts), so greedy output equals
plain decoding's and the rejection sampler reproduces the penalized distribution.

As vLLM applies them (``vllm/model_executor/layers/utils.py: apply_penalties``), in this order:

- ``repetition_penalty`` r (Hugging Face's ``RepetitionPenaltyLogitsProcessor``, CTRL): a token of
  the prompt or of the reply so far has its logit divided by r when positive, else multiplied by r;
- ``frequency_penalty`` f: minus f times the token's count in the reply so far;
- ``presence_penalty`` p: minus p for a token the reply holds at all.

Worked example: prompt ``[5]``, reply so far ``[7, 7]`` (the root is the second 7), a draft tree
root -> 9 -> 7. Row 0 counts {7: 2}, row 1 (after 9) {7: 2, 9: 1}, row 2 (after 9, 7) {7: 3, 9: 1};
with f = 0.5 every row's token 7 loses 0.5 per count, and with r the rows' tokens 5, 7 (and 9 from
row 1 on) are divided or multiplied by r.

Only the tokens a request has seen are touched: the rows' columns of those tokens are gathered,
penalized and written back (a few hundred columns, not the vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.sampling.params import SamplingParams
from specd.sampling.tree import DraftTree

__all__ = ["penalize_", "penalize_rows_", "penalized_reference"]


def penalize_(
    logits: torch.Tensor, row0: int, tree: DraftTree, params: SamplingParams, prompt: Sequence, output: Sequence
) -> None:
    """Penalize ``logits[row0 : row0 + tree.num_nodes]`` (the request's rows, node i at ``row0 + i``)
    in place for ``params`` (a no-op unless ``params.penalized``). ``prompt`` / ``output``: the
    request's prompt and reply token ids so far."""
    if not params.penalized:
        return
    paths: list[list[int]] = [[]]  # node i: the draft tokens from below the root down to it
    for i in range(1, tree.num_nodes):
        paths.append(paths[tree.parent_list[i]] + [tree.token_list[i]])
    penalize_rows_(logits, range(row0, row0 + tree.num_nodes), paths, params, prompt, output)


def penalize_rows_(
    logits: torch.Tensor,
    rows: Sequence[int],
    paths: Sequence[Sequence[int]],
    params: SamplingParams,
    prompt: Sequence,
    output: Sequence,
    columns: torch.Tensor | None = None,
) -> None:
    """Penalize ``logits[rows[k]]`` in place as the row after the reply ``output + paths[k]``.
    ``columns`` (a drafter whose logits cover a reduced vocabulary): [target vocabulary] int64, each
    token's logits column or -1 (tokens without one are not penalized); None: columns are token ids."""
    if not params.penalized or not len(rows):
        return
    if len(paths) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(paths)} paths")
    rep = params.repetition_penalty != 1
    if columns is not None:
        output, prompt = _mapped(columns, output), _mapped(columns, prompt)
        paths = [_mapped(columns, p) for p in paths]
    seen = _seen(paths, prompt if rep else (), output, logits.shape[1])
    if seen is None:
        return
    cols, counts, in_prompt = seen
    dev = logits.device
    if isinstance(rows, range) and rows.step == 1:
        block, at_r = logits[rows.start : rows.stop], None  # [R, V] a view
    else:
        at_r = torch.as_tensor(list(rows), dtype=torch.int64, device=dev)
        block = logits.index_select(0, at_r)  # [R, V] a copy, written back below
    at_c = cols.to(dev)
    sub = block.index_select(1, at_c).float()  # [R, U]
    counts = counts.to(dev)
    if rep:
        hit = (counts > 0) | in_prompt.to(dev)[None, :]
        r = params.repetition_penalty
        sub = torch.where(hit, torch.where(sub > 0, sub / r, sub * r), sub)
    if params.frequency_penalty != 0:
        sub = sub - params.frequency_penalty * counts
    if params.presence_penalty != 0:
        sub = sub - params.presence_penalty * (counts > 0).float()
    block.index_copy_(1, at_c, sub.to(logits.dtype))
    if at_r is not None:
        logits.index_copy_(0, at_r, block)


def _seen(paths: Sequence[Sequence[int]], prompt: Sequence, output: Sequence, vocab: int) -> tuple | None:
    """The columns the rows touch (those of ``output``, the paths and ``prompt``; [U] sorted), the
    reply's count of each per row ([R, U] float32: ``output``'s plus the row's path) and whether the
    prompt holds it ([U] bool); None when there is none."""
    flat = [t for p in paths for t in p]
    n_out, n_path = len(output), len(flat)
    seen = torch.tensor([*output, *flat, *prompt], dtype=torch.int64)
    if not len(seen):
        return None
    cols, idx = seen.unique(return_inverse=True)
    if int(cols[-1]) >= vocab or int(cols[0]) < 0:
        raise ValueError(f"token {int(cols[-1])} is outside the logits' {vocab} columns")
    counts = torch.zeros((len(paths), len(cols)), dtype=torch.float32)
    if n_out:
        counts += torch.bincount(idx[:n_out], minlength=len(cols)).float()
    if n_path:  # each path token counts in its row
        pairs_r = [k for k, p in enumerate(paths) for _ in p]
        counts.index_put_((torch.tensor(pairs_r), idx[n_out : n_out + n_path]), torch.ones(n_path), accumulate=True)
    in_prompt = torch.zeros(len(cols), dtype=torch.bool)
    in_prompt[idx[n_out + n_path :]] = True
    return cols, counts, in_prompt


def _mapped(columns: torch.Tensor, ids: Sequence) -> list:
    """``ids`` as logits columns, those without one left out."""
    if not len(ids):
        return []
    c = columns[torch.as_tensor(list(ids), dtype=torch.int64)]
    return c[c >= 0].tolist()


def penalized_reference(logits: torch.Tensor, params: SamplingParams, prompt: Sequence, history: Sequence):
    """One row [V] penalized the plain way (dense counts of ``history``, the reply so far): the
    reference :func:`penalize_` is tested against."""
    out = logits.float().clone()
    vocab = out.shape[0]
    counts = torch.bincount(torch.tensor(list(history), dtype=torch.int64), minlength=vocab).float()[:vocab]
    if params.repetition_penalty != 1:
        hit = counts > 0
        if prompt:
            hit[torch.tensor(list(prompt))] = True
        r = params.repetition_penalty
        out = torch.where(hit, torch.where(out > 0, out / r, out * r), out)
    out = out - params.frequency_penalty * counts
    return out - params.presence_penalty * (counts > 0).float()
