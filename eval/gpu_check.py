"""Time paged tree attention on a GPU for verification-shaped problems.

Compares, per problem (batch x tree tokens x context x head dim, bf16, 32 query / 8 KV heads,
block size 16, shuffled block tables, random trees):

* ``triton``      specd_kernels.tree_attention (paged, reads K/V through the block tables)
* ``torch ref``   specd_kernels.tree_attention_ref (python loop per request; skipped when large)
* ``sdpa``        torch.nn.functional.scaled_dot_product_attention with an explicit boolean mask,
                  on K/V already gathered into contiguous [B, KVH, S, D] tensors (gather not timed)
* ``gather+sdpa`` the same including the gather from the paged cache

Prints a Markdown table: median time (CUDA events, after warmup) and achieved bandwidth
(bytes of K/V the problem has to read once / time), plus max |triton - sdpa| as a sanity check.
Stops starting new problems once ``--budget-s`` is spent (the rows left are listed as skipped).

``--dry-run`` builds the smallest problem on the CPU and runs it under the Triton interpreter
(no timing), to check that this script works where there is no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="smallest problem on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--trees", default="8,32,64")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new problems after this")
    ap.add_argument(
        "--ref-max-tokens",
        type=int,
        default=64 * 2048,
        help="skip the torch reference when batch * context exceeds this",
    )
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


if "--dry-run" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported

ARGS = parse_args([])  # defaults; main() parses the command line

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import specd_kernels as sk  # noqa: E402


def random_tree_mask(n, gen):
    """Ancestor mask of a random tree with parents[i] < i (node 0 the root)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def build_problem(batch, tree, ctx, head_dim, *, heads, kv_heads, block_size, dtype, device, seed):
    """Verification step: every request has `ctx` cached tokens and a `tree`-node draft tree."""
    gen = torch.Generator().manual_seed(seed)
    seq = ctx + tree
    nblk = -(-seq // block_size)
    num_blocks = batch * nblk + 1
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # shuffled, block 0 unused
    block_tables = perm[: batch * nblk].view(batch, nblk).to(torch.int32)
    kv_layer = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    q = torch.randn(batch * tree, heads, head_dim, device=device, dtype=dtype)
    mask1 = random_tree_mask(tree, gen)
    tree_mask = mask1.repeat(batch, 1)  # [T, tree]
    qsl = torch.arange(0, batch + 1, dtype=torch.int32) * tree
    args = dict(
        q=q,
        kv_layer=kv_layer,
        query_start_loc=qsl.to(device),
        context_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), seq, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        tree_mask=tree_mask.to(device),
        scale=head_dim**-0.5,
        max_query_len=tree,
        max_seq_len=seq,
    )
    return args, mask1.to(device)


def gather_dense(args, batch, tree, ctx):
    """K/V of every request gathered to contiguous [B, KVH, S, D]."""
    kv = args["kv_layer"]
    bs = kv.shape[2]
    seq = ctx + tree
    pos = torch.arange(seq, device=kv.device)
    blocks = args["block_tables"].long()[:, pos // bs]  # [B, S]
    offs = (pos % bs)[None, :].expand(batch, seq)
    k = kv[0][blocks, offs].permute(0, 2, 1, 3)  # [B, KVH, S, D]
    v = kv[1][blocks, offs].permute(0, 2, 1, 3)
    return k.contiguous(), v.contiguous()


def sdpa_attention(q, k, v, attn_mask, batch, tree, scale):
    heads, d = q.shape[1], q.shape[2]
    qd = q.view(batch, tree, heads, d).transpose(1, 2)  # [B, H, tree, D]
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(batch * tree, heads, d)


def dense_mask(mask1, ctx):
    tree = mask1.shape[0]
    m = torch.ones(tree, ctx + tree, dtype=torch.bool, device=mask1.device)
    m[:, ctx:] = mask1
    return m[None, None]  # broadcast over batch and heads


def time_cuda(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def fmt_t(t):
    return "skipped" if t is None else f"{t * 1e6:.1f}"


def fmt_bw(nbytes, t):
    return "" if t is None else f"{nbytes / t / 1e9:.0f}"


def dry_run():
    assert sk.interpreting(), "dry run needs the Triton interpreter"
    args, mask1 = build_problem(
        1,
        8,
        512,
        64,
        heads=ARGS.heads,
        kv_heads=ARGS.kv_heads,
        block_size=ARGS.block_size,
        dtype=torch.bfloat16,
        device="cpu",
        seed=ARGS.seed,
    )
    t0 = time.time()
    out = sk.tree_attention(**args)
    t_tri = time.time() - t0
    ref = sk.tree_attention_ref(**args)
    k, v = gather_dense(args, 1, 8, 512)
    sd = sdpa_attention(args["q"].float(), k.float(), v.float(), dense_mask(mask1, 512), 1, 8, args["scale"])
    e_ref = (out.float() - ref.float()).abs().max().item()
    e_sdpa = (out.float() - sd).abs().max().item()
    print("| problem | triton (interpreter) s | max abs err vs ref | max abs err vs sdpa |")
    print("|---|---|---|---|")
    print(f"| B=1 tree=8 ctx=512 d=64 bf16 | {t_tri:.2f} | {e_ref:.3g} | {e_sdpa:.3g} |")
    ok = e_ref < 3e-2 and e_sdpa < 3e-2
    print("dry run OK" if ok else "dry run FAILED")
    return 0 if ok else 1


def run_problem(b: int, t: int, c: int, d: int, dtype, dev) -> float:
    """Time one problem (Triton, torch reference, sdpa, gather+sdpa), print its row; the max abs error
    of Triton vs sdpa. Its tensors are freed on return."""
    torch.cuda.empty_cache()
    args, mask1 = build_problem(
        b,
        t,
        c,
        d,
        heads=ARGS.heads,
        kv_heads=ARGS.kv_heads,
        block_size=ARGS.block_size,
        dtype=dtype,
        device=dev,
        seed=ARGS.seed,
    )
    nbytes = 2 * b * (c + t) * ARGS.kv_heads * d * args["kv_layer"].element_size()
    out = torch.empty_like(args["q"])
    t_tri = time_cuda(lambda: sk.tree_attention(**args, out=out), ARGS.warmup, ARGS.iters)
    t_ref = None
    if b * c <= ARGS.ref_max_tokens:
        t_ref = time_cuda(lambda: sk.tree_attention_ref(**args), 1, max(3, ARGS.iters // 5))
    k, v = gather_dense(args, b, t, c)
    am = dense_mask(mask1, c)
    t_sdpa = time_cuda(lambda: sdpa_attention(args["q"], k, v, am, b, t, args["scale"]), ARGS.warmup, ARGS.iters)
    t_gs = time_cuda(
        lambda: sdpa_attention(args["q"], *gather_dense(args, b, t, c), am, b, t, args["scale"]),
        2,
        max(5, ARGS.iters // 3),
    )
    sk.tree_attention(**args, out=out)
    err = (out.float() - sdpa_attention(args["q"], k, v, am, b, t, args["scale"]).float()).abs().max().item()
    print(
        f"| {b} | {t} | {c} | {d} | {fmt_t(t_tri)} | {fmt_bw(nbytes, t_tri)} | {fmt_t(t_ref)} "
        f"| {fmt_t(t_sdpa)} | {fmt_bw(nbytes, t_sdpa)} | {fmt_t(t_gs)} | {err:.3g} |",
        flush=True,
    )
    return err


def main(argv=None):
    global ARGS
    ARGS = parse_args(argv)
    if ARGS.dry_run:
        return dry_run()
    if not torch.cuda.is_available():
        print("no CUDA device; use --dry-run", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    problems = [
        (b, t, c, d)
        for d in ints(ARGS.head_dims)
        for c in ints(ARGS.contexts)
        for b in ints(ARGS.batches)
        for t in ints(ARGS.trees)
    ]
    print(
        f"# tree attention, {torch.cuda.get_device_name()}, bf16, H={ARGS.heads} KVH={ARGS.kv_heads} "
        f"block={ARGS.block_size}, median of {ARGS.iters} (warmup {ARGS.warmup}), times in us, "
        f"bandwidth = K/V bytes of the problem / time in GB/s\n"
    )
    print(
        "| B | tree | ctx | D | triton us | GB/s | torch ref us | sdpa us | GB/s | gather+sdpa us "
        "| max abs err tri-sdpa |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    t_start = time.time()
    skipped = []
    failures = 0
    for b, t, c, d in problems:
        if time.time() - t_start > ARGS.budget_s:
            skipped.append((b, t, c, d))
            continue
        failures += not run_problem(b, t, c, d, dtype, dev) < 5e-2  # NaN counts as a failure
    print()
    print(f"torch ref skipped where B*ctx > {ARGS.ref_max_tokens} (python loop per request, too slow).")
    if skipped:
        print(
            f"time budget ({ARGS.budget_s:.0f}s) spent; not run: "
            + ", ".join(f"B={b}/tree={t}/ctx={c}/D={d}" for b, t, c, d in skipped)
        )
    print(f"total {time.time() - t_start:.0f}s; {failures} problem(s) with max abs err >= 5e-2")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
