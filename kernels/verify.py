"""Greedy tree verification on the device: one program per request walks its draft tree.

Inputs (all requests' trees flattened, request ``b`` owning nodes
``node_offsets[b] .. node_offsets[b+1]-1``; node indices are *local* to a request, node 0 is the
root = the pending token, ``parents[root] = -1`` and ``parents[i] < i``):

* ``target_argmax`` ``[N]`` int: the target's greedy token after each node (argmax of its logits)
* ``tokens``        ``[N]`` int: each node's draft token (the root's is ignored)
* ``parents``       ``[N]`` int: local parent index
* ``node_offsets``  ``[B+1]`` int32 (CSR offsets of the requests' nodes)

Walk: ``cur = 0``; while some child ``c`` of ``cur`` has ``tokens[c] == target_argmax[cur]``, accept
the first such child (children in index order = the order they were drawn) and move there. Then
``next_token = target_argmax[cur]``; it is a *bonus* token iff ``cur`` has no child (a leaf), else a
correction.

Outputs: ``accept_len [B]`` int32 (accepted draft nodes, root excluded), ``path [B, max_nodes]``
int32 (local node indices of the accepted nodes in order, padded with -1), ``next_token [B]``
int64, ``is_bonus [B]`` bool (a request with no node gets length 0, next token -1, not bonus). ``max_nodes`` (python
int) must be >= every request's node count.
"""

from __future__ import annotations

import torch

from ._common import HAS_TRITON, check_dims, check_dtype, check_launchable, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _greedy_verify_kernel(
        target_ptr,
        tokens_ptr,
        parents_ptr,
        offs_ptr,
        len_ptr,
        path_ptr,
        next_ptr,
        bonus_ptr,
        stride_path,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        start = tl.load(offs_ptr + b).to(tl.int64)
        n = tl.load(offs_ptr + b + 1).to(tl.int64) - start
        idx = tl.arange(0, BLOCK)
        valid = idx < n
        par = tl.load(parents_ptr + start + idx, mask=valid, other=-2).to(tl.int32)
        tok = tl.load(tokens_ptr + start + idx, mask=valid, other=-1).to(tl.int64)
        tgt = tl.load(target_ptr + start + idx, mask=valid, other=-1).to(tl.int64)
        par = tl.where(idx == 0, -1, par)  # the root never matches as a child

        cur = tl.zeros([], dtype=tl.int32)
        length = tl.zeros([], dtype=tl.int32)
        done = n <= 0
        path = tl.full([BLOCK], -1, dtype=tl.int32)
        for _step in range(0, BLOCK):
            want = tl.sum(tl.where(idx == cur, tgt, 0), 0)  # target_argmax[cur]
            match = valid & (par == cur) & (tok == want)
            first = tl.min(tl.where(match, idx, BLOCK), 0)
            found = (first < BLOCK) & (done == 0)
            path = tl.where(found & (idx == length), first, path)
            length = tl.where(found, length + 1, length)
            cur = tl.where(found, first, cur)
            done = done | (found == 0)
        final_tgt = tl.sum(tl.where(idx == cur, tgt, 0), 0)
        has_child = tl.sum((valid & (par == cur)).to(tl.int32), 0) > 0
        tl.store(len_ptr + b, length)
        tl.store(path_ptr + b.to(tl.int64) * stride_path + idx, path, mask=idx < stride_path)
        tl.store(next_ptr + b, final_tgt)
        tl.store(bonus_ptr + b, ((has_child == 0) & (n > 0)).to(tl.int8))


_INT = (torch.int32, torch.int64)


def _check(target_argmax, tokens, parents, node_offsets, what):
    for name, t in (("target_argmax", target_argmax), ("tokens", tokens), ("parents", parents)):
        check_dims(name, t, 1, what)
        check_dtype(name, t, _INT, what)
        if not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous")
    check_dims("node_offsets", node_offsets, 1, what)
    check_dtype("node_offsets", node_offsets, (torch.int32,), what)
    N = target_argmax.shape[0]
    if tokens.shape[0] != N or parents.shape[0] != N:
        raise ValueError(f"{what}: target_argmax, tokens and parents must have the same length")
    if node_offsets.shape[0] < 1:
        raise ValueError(f"{what}: node_offsets must have B+1 >= 1 entries")
    return node_offsets.shape[0] - 1


def greedy_verify(
    target_argmax: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    node_offsets: torch.Tensor,
    max_nodes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton greedy tree walk; returns ``(accept_len, path, next_token, is_bonus)``."""
    what = "greedy_verify"
    B = _check(target_argmax, tokens, parents, node_offsets, what)
    check_launchable(target_argmax, tokens, parents, node_offsets, what=what)
    dev = target_argmax.device
    max_nodes = max(1, int(max_nodes))
    accept_len = torch.zeros(B, dtype=torch.int32, device=dev)
    path = torch.full((B, max_nodes), -1, dtype=torch.int32, device=dev)
    next_token = torch.zeros(B, dtype=torch.int64, device=dev)
    is_bonus = torch.zeros(B, dtype=torch.int8, device=dev)
    if B == 0:
        return accept_len, path, next_token, is_bonus.bool()
    for kernel, grid, args, kw in _greedy_verify_plan(
        target_argmax, tokens, parents, node_offsets, (accept_len, path, next_token, is_bonus)
    ):
        kernel[grid](*args, **kw)
    return accept_len, path, next_token, is_bonus.bool()


def _greedy_verify_plan(target_argmax, tokens, parents, node_offsets, outs) -> list:
    """``[(kernel, grid, args, kwargs)]`` of one :func:`greedy_verify` call (launches nothing; used
    by ``specd_kernels.aot``): one single-warp program per request, ``BLOCK`` = the node capacity
    ``path.shape[1]`` rounded up to a power of two >= 16."""
    accept_len, path, next_token, is_bonus = outs
    args = (target_argmax, tokens, parents, node_offsets, accept_len, path, next_token, is_bonus, path.stride(0))
    kw = {"BLOCK": max(16, next_pow2(path.shape[1])), "num_warps": 1}
    return [(_greedy_verify_kernel, (node_offsets.shape[0] - 1,), args, kw)]


def greedy_verify_ref(
    target_argmax: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    node_offsets: torch.Tensor,
    max_nodes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-python reference of :func:`greedy_verify`."""
    B = _check(target_argmax, tokens, parents, node_offsets, "greedy_verify_ref")
    dev = target_argmax.device
    tg, tk, pa, of = (x.tolist() for x in (target_argmax, tokens, parents, node_offsets))
    max_nodes = max(1, int(max_nodes))
    accept_len = torch.zeros(B, dtype=torch.int32)
    path = torch.full((B, max_nodes), -1, dtype=torch.int32)
    next_token = torch.zeros(B, dtype=torch.int64)
    is_bonus = torch.zeros(B, dtype=torch.bool)
    for b in range(B):
        s, e = of[b], of[b + 1]
        n = e - s
        if n <= 0:
            next_token[b] = -1
            continue
        children = [[] for _ in range(n)]
        for i in range(1, n):
            children[pa[s + i]].append(i)
        cur, acc = 0, []
        while True:
            want = tg[s + cur]
            nxt = next((c for c in children[cur] if tk[s + c] == want), None)
            if nxt is None:
                break
            acc.append(nxt)
            cur = nxt
        accept_len[b] = len(acc)
        path[b, : len(acc)] = torch.tensor(acc, dtype=torch.int32)
        next_token[b] = tg[s + cur]
        is_bonus[b] = not children[cur]
    return accept_len.to(dev), path.to(dev), next_token.to(dev), is_bonus.to(dev)
