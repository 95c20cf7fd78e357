"""Paged KV cache writes and slot copies (the compaction after speculative verification).

Slots follow ``docs/architecture.md``: slot ``s`` is ``(block, offset) = divmod(s, block_size)``.

* :func:`write_kv` writes the K/V of ``T`` new tokens into one layer's cache
  ``kv_layer [2, NB, BS, KVH, D]`` at ``slot_mapping [T]``. Slots that are negative or
  ``>= NB * BS`` are skipped (negative = padding, as in vLLM).
* :func:`copy_slots` copies, for every layer and for both K and V of the full cache
  ``kv [L, 2, NB, BS, KVH, D]``, slot ``src[i]`` to slot ``dst[i]``, all pairs of all requests in one
  launch. Semantics are those of a *snapshot*: every pair reads the value its source slot had
  before the call, whatever the overlap between sources and destinations (the kernel reads all
  sources of its slice before writing any destination; with more pairs than fit in registers it
  goes through a temporary). Pairs with an out-of-range slot are skipped. Duplicate destinations
  are undefined (one of the writers wins), as in the reference.

Each ``copy_slots`` program owns a disjoint slice (one layer, K or V, a range of the
``KVH * D`` elements of a slot) of *every* slot, so programs never race with each other.
"""

from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES, HAS_TRITON, cdiv, check_dims, check_dtype, check_launchable, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=("T",))  # the step's token count: one compile for every count
    def _write_kv_kernel(
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        slot_ptr,
        T,
        num_slots,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cb,
        stride_cs,
        stride_ch,
        HEAD_DIM: tl.constexpr,
        E: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        pid_e = tl.program_id(1)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = offs_t < T
        slot = tl.load(slot_ptr + offs_t, mask=t_mask, other=-1).to(tl.int64)
        ok = t_mask & (slot >= 0) & (slot < num_slots)
        slot = tl.where(ok, slot, 0)
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        e_mask = offs_e < E
        h = offs_e // HEAD_DIM
        d = offs_e % HEAD_DIM
        m = ok[:, None] & e_mask[None, :]
        t64 = offs_t.to(tl.int64)
        k = tl.load(k_ptr + t64[:, None] * stride_kt + h[None, :] * stride_kh + d[None, :], mask=m, other=0.0)
        v = tl.load(v_ptr + t64[:, None] * stride_vt + h[None, :] * stride_vh + d[None, :], mask=m, other=0.0)
        dst = blk[:, None] * stride_cb + off[:, None] * stride_cs + h[None, :] * stride_ch + d[None, :]
        # upcast first: bf16 -> bf16 / fp16 -> bf16 conversions are exact this way on every backend
        tl.store(kc_ptr + dst, k.to(tl.float32).to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + dst, v.to(tl.float32).to(vc_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=("N",))
    def _copy_slots_kernel(
        kv_ptr,
        tmp_ptr,
        src_ptr,
        dst_ptr,
        N,
        num_slots,
        stride_lc,
        stride_tmp_lc,
        E: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_E: tl.constexpr,
        SINGLE_TILE: tl.constexpr,
    ):
        # kv viewed as [L*2, num_slots, E] (E = KVH * D contiguous per slot)
        lc = tl.program_id(0).to(tl.int64)
        pid_e = tl.program_id(1)
        offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        e_mask = offs_e < E
        base = kv_ptr + lc * stride_lc
        if SINGLE_TILE:
            offs_p = tl.arange(0, BLOCK_P)
            p_mask = offs_p < N
            src = tl.load(src_ptr + offs_p, mask=p_mask, other=-1).to(tl.int64)
            dst = tl.load(dst_ptr + offs_p, mask=p_mask, other=-1).to(tl.int64)
            ok = p_mask & (src >= 0) & (src < num_slots) & (dst >= 0) & (dst < num_slots)
            # no tl.where(ok, src, 0) clamp here: the masks keep skipped pairs off memory, and the
            # clamp trips a Triton 3.7.1 layout bug on CUDA for BLOCK_P 32/64 ("arith.select op
            # expected condition type to have the same shape", TritonGPURemoveLayoutConversions)
            m = ok[:, None] & e_mask[None, :]
            vals = tl.load(base + src[:, None] * E + offs_e[None, :], mask=m, other=0.0)
            tl.debug_barrier()  # every source of this slice is read before any write
            tl.store(base + dst[:, None] * E + offs_e[None, :], vals, mask=m)
        else:
            tbase = tmp_ptr + lc * stride_tmp_lc
            # phase 1: gather every source of this slice into the temporary
            for p0 in range(0, N, BLOCK_P):
                offs_p = p0 + tl.arange(0, BLOCK_P)
                p_mask = offs_p < N
                src = tl.load(src_ptr + offs_p, mask=p_mask, other=-1).to(tl.int64)
                ok = p_mask & (src >= 0) & (src < num_slots)
                src = tl.where(ok, src, 0)
                m = ok[:, None] & e_mask[None, :]
                vals = tl.load(base + src[:, None] * E + offs_e[None, :], mask=m, other=0.0)
                tl.store(tbase + offs_p.to(tl.int64)[:, None] * E + offs_e[None, :], vals, mask=m)
            tl.debug_barrier()
            # phase 2: scatter to the destinations
            for p0 in range(0, N, BLOCK_P):
                offs_p = p0 + tl.arange(0, BLOCK_P)
                p_mask = offs_p < N
                src = tl.load(src_ptr + offs_p, mask=p_mask, other=-1).to(tl.int64)
                dst = tl.load(dst_ptr + offs_p, mask=p_mask, other=-1).to(tl.int64)
                ok = p_mask & (src >= 0) & (src < num_slots) & (dst >= 0) & (dst < num_slots)
                dst = tl.where(ok, dst, 0)
                m = ok[:, None] & e_mask[None, :]
                vals = tl.load(tbase + offs_p.to(tl.int64)[:, None] * E + offs_e[None, :], mask=m, other=0.0)
                tl.store(base + dst[:, None] * E + offs_e[None, :], vals, mask=m)


_SLOT_DTYPES = (torch.int64, torch.int32)


def _floor_pow2(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def _check_write_kv(kv_layer, k, v, slot_mapping, what):
    check_dims("kv_layer", kv_layer, 5, what)
    check_dims("k", k, 3, what)
    check_dims("v", v, 3, what)
    check_dims("slot_mapping", slot_mapping, 1, what)
    check_dtype("kv_layer", kv_layer, FLOAT_DTYPES, what)
    check_dtype("k", k, FLOAT_DTYPES, what)
    check_dtype("v", v, FLOAT_DTYPES, what)
    check_dtype("slot_mapping", slot_mapping, _SLOT_DTYPES, what)
    if kv_layer.shape[0] != 2:
        raise ValueError(f"{what}: kv_layer must be [2, NB, BS, KVH, D], got {tuple(kv_layer.shape)}")
    _, NB, BS, KVH, D = kv_layer.shape
    T = k.shape[0]
    if tuple(k.shape) != (T, KVH, D) or tuple(v.shape) != (T, KVH, D):
        raise ValueError(f"{what}: k and v must be [T, KVH={KVH}, D={D}], got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape[0] != T:
        raise ValueError(f"{what}: slot_mapping must have T={T} entries, got {slot_mapping.shape[0]}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"{what}: k and v must be contiguous in the head dim (stride(2) == 1)")
    if kv_layer.stride(4) != 1:
        raise ValueError(f"{what}: kv_layer must be contiguous in the head dim (stride(4) == 1)")
    if not slot_mapping.is_contiguous():
        raise ValueError(f"{what}: slot_mapping must be contiguous")
    return T, NB, BS, KVH, D


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``k``/``v`` ``[T, KVH, D]`` into ``kv_layer [2, NB, BS, KVH, D]`` at ``slot_mapping [T]`` (in place)."""
    what = "write_kv"
    T, NB, BS, KVH, D = _check_write_kv(kv_layer, k, v, slot_mapping, what)
    check_launchable(kv_layer, k, v, slot_mapping, what=what)
    if T == 0:
        return
    for kernel, grid, args, kw in _write_kv_plan(kv_layer, k, v, slot_mapping):
        kernel[grid](*args, **kw)


def _write_kv_plan(kv_layer, k, v, slot_mapping) -> list:
    """``[(kernel, grid, args, kwargs)]`` of one :func:`write_kv` call (nothing launched; used by
    ``specd_kernels.aot`` on meta-device tensors). Tiles: up to 1024 of the ``KVH * D`` elements of
    a token by up to 4096 elements per program."""
    T = k.shape[0]
    _, NB, BS, KVH, D = kv_layer.shape
    kc, vc = kv_layer[0], kv_layer[1]
    E = KVH * D
    block_e = min(next_pow2(E), 1024)
    block_t = max(1, min(next_pow2(T), 4096 // block_e))
    grid = (cdiv(T, block_t), cdiv(E, block_e))
    args = (
        k,
        v,
        kc,
        vc,
        slot_mapping,
        T,
        NB * BS,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
    )
    kw = {"HEAD_DIM": D, "E": E, "BLOCK_SIZE": BS, "BLOCK_T": block_t, "BLOCK_E": block_e, "num_warps": 4}
    return [(_write_kv_kernel, grid, args, kw)]


def write_kv_ref(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Pure-torch reference of :func:`write_kv`."""
    T, NB, BS, KVH, D = _check_write_kv(kv_layer, k, v, slot_mapping, "write_kv_ref")
    slots = slot_mapping.long()
    ok = (slots >= 0) & (slots < NB * BS)
    if not bool(ok.all()):
        slots, k, v = slots[ok], k[ok], v[ok]
    blk, off = slots // BS, slots % BS
    kv_layer[0][blk, off] = k.to(kv_layer.dtype)
    kv_layer[1][blk, off] = v.to(kv_layer.dtype)


def _check_copy_slots(kv, src, dst, what):
    check_dims("kv", kv, 6, what)
    check_dtype("kv", kv, FLOAT_DTYPES, what)
    check_dims("src", src, 1, what)
    check_dims("dst", dst, 1, what)
    check_dtype("src", src, _SLOT_DTYPES, what)
    check_dtype("dst", dst, _SLOT_DTYPES, what)
    if kv.shape[1] != 2:
        raise ValueError(f"{what}: kv must be [L, 2, NB, BS, KVH, D], got {tuple(kv.shape)}")
    if src.shape[0] != dst.shape[0]:
        raise ValueError(f"{what}: src and dst must have the same length, got {src.shape[0]} and {dst.shape[0]}")
    if not kv.is_contiguous():
        raise ValueError(f"{what}: kv must be contiguous")
    if not src.is_contiguous() or not dst.is_contiguous():
        raise ValueError(f"{what}: src and dst must be contiguous")


def copy_slots(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, *, max_tile: int | None = None) -> None:
    """Copy every layer's K and V from slot ``src[i]`` to slot ``dst[i]`` of ``kv [L, 2, NB, BS, KVH, D]``.

    One launch for all pairs of all requests; snapshot semantics (see the module docstring).
    ``max_tile`` (elements held in registers per program) is a test knob forcing the temporary path.
    """
    what = "copy_slots"
    _check_copy_slots(kv, src, dst, what)
    check_launchable(kv, src, dst, what=what)
    N = src.shape[0]
    if N == 0 or kv.numel() == 0:
        return
    for kernel, grid, args, kw in _copy_slots_plan(kv, src, dst, max_tile):
        kernel[grid](*args, **kw)


def _copy_slots_plan(kv, src, dst, max_tile: int | None = None) -> list:
    """``[(kernel, grid, args, kwargs)]`` of one :func:`copy_slots` call (allocates the temporary
    of the many-pairs path, launches nothing; used by ``specd_kernels.aot``). One tile holds all
    pairs when ``next_pow2(N) * min(32, next_pow2(E))`` elements fit ``max_tile`` (16384)."""
    N = src.shape[0]
    L, _, NB, BS, KVH, D = kv.shape
    E = KVH * D
    num_slots = NB * BS
    flat = kv.view(L * 2, num_slots, E)
    max_tile = 16384 if max_tile is None else int(max_tile)
    n_p = next_pow2(N)
    e_p = next_pow2(E)
    if n_p * min(32, e_p) <= max_tile:
        single = True
        block_p = n_p
        block_e = _floor_pow2(max(1, min(e_p, max_tile // n_p)))
        tmp = flat  # dummy
        stride_tmp = 0
    else:
        single = False
        block_e = min(e_p, 256)
        block_p = _floor_pow2(max(1, min(n_p, max_tile // block_e)))
        tmp = torch.empty((L * 2, N, E), dtype=kv.dtype, device=kv.device)
        stride_tmp = tmp.stride(0)
    grid = (L * 2, cdiv(E, block_e))
    args = (flat, tmp, src, dst, N, num_slots, flat.stride(0), stride_tmp)
    kw = {"E": E, "BLOCK_P": block_p, "BLOCK_E": block_e, "SINGLE_TILE": single, "num_warps": 4}
    return [(_copy_slots_kernel, grid, args, kw)]


def copy_slots_ref(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Pure-torch reference of :func:`copy_slots` (snapshot semantics: gather, then scatter)."""
    _check_copy_slots(kv, src, dst, "copy_slots_ref")
    if src.shape[0] == 0:
        return
    L, _, NB, BS, KVH, D = kv.shape
    num_slots = NB * BS
    s, d = src.long(), dst.long()
    ok = (s >= 0) & (s < num_slots) & (d >= 0) & (d < num_slots)
    s, d = s[ok], d[ok]
    flat = kv.view(L, 2, num_slots, KVH, D)
    vals = flat[:, :, s].clone()
    flat[:, :, d] = vals
