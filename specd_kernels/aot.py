"""Ahead-of-time compile report of the specd_kernels Triton kernels for CUDA sm_80 and sm_90a.

No GPU is needed. For every configuration the launchers choose over a matrix of real problems
(head_dim 64/128, GQA groups 1/3/4/8, fp16/bf16; decode, tree-verify, chunked-prefill and mixed
shapes, each with a batch that fills the GPU and a single long sequence that makes the launcher
split the KV range), each kernel is compiled for both targets and the ptxas bundled with Triton
reports registers, spill stores/loads; shared memory comes from the kernel metadata. The other
kernels (KV-cache writes and copies, the weight-only GEMM, the batch-invariant GEMM / RMSNorm /
attention) are compiled at their decode, tree and prefill widths unless ``--no-others``.

    python -m specd_kernels.aot [--shapes decode,tree] [--json FILE] [--check]

Facts this relies on (triton 3.7.1):

* ``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 80 | 90,
  32), options)`` runs the whole CUDA pipeline (ttir, ttgir, llir, ptx, cubin) with no driver and
  no libcuda: only loading/launching a kernel (and ``JITFunction.run``, which asks the driver for
  the current device) needs one. So the specialization a launch would get is rebuilt here with
  the JIT's own binder (``create_function_from_signature`` + ``JITFunction._pack_args``) from the
  launchers' own plans (``_launch_plan`` & co.) built on meta-device tensors (data_ptr 0: 16-byte
  aligned, like the caching allocator's blocks; strides are the real ones).
* The cubin stage runs the bundled ``ptxas`` with ``-v``; ``knobs.nvidia.dump_ptxas_log`` makes
  Triton print that log, captured here ("Used N registers", "N bytes spill stores, M bytes spill
  loads"). Capability 90 compiles for ``sm_90a``. ``metadata.shared`` is the static shared memory
  in bytes (the launchers pass no dynamic shared memory).
* Triton caches compiled kernels by a hash of source, specialization, options, target and ptxas
  version; the ptxas log is stored under that hash (``specd_ptxas.log``) so a cached kernel keeps
  its figures; a cached kernel without one is recompiled.
* ``TRITON_INTERPRET`` must be unset when ``specd_kernels`` is imported (its kernels are then
  ``JITFunction`` objects); :func:`run_clean` runs this module in a subprocess without it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

TARGETS = {"sm_80": 80, "sm_90a": 90}
NUM_SMS = {80: 108, 90: 132}  # A100 and H100 SXM: what the split-KV heuristic sees
SMEM_LIMIT = {80: 166912, 90: 232448}  # max shared memory per block (opt-in), bytes
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEAD_DIMS = (64, 128)
GROUPS = (1, 3, 4, 8)
NUM_KV_HEADS = 8
BLOCK_SIZE = 16  # KV cache block size (the engine's default --block-size)


@dataclass(frozen=True)
class Shape:
    """A kind of attention call: queries per request and whether a tree mask is passed."""

    max_query_len: int
    masked: bool


# decode: one token per request; tree: 16 draft nodes + the pending token (--tree-budget 16);
# prefill: a --prefill-chunk of 256 tokens, causal; mixed: that chunk batched with tree requests.
SHAPES = {"decode": Shape(1, False), "tree": Shape(17, True), "prefill": Shape(256, False), "mixed": Shape(256, True)}
# (batch, max_seq_len): a batch that fills the GPU (no KV split) and one long sequence (split)
PROBLEMS = ((64, 512), (1, 16384))


def _ta():
    return importlib.import_module("specd_kernels.tree_attention")  # the module, not the function


def _check_compiled_kernels() -> None:
    from ._common import interpreting

    if interpreting():
        raise RuntimeError(
            "specd_kernels.aot: TRITON_INTERPRET was set when specd_kernels was imported; "
            "use run_clean() or run `python -m specd_kernels.aot` without it"
        )


def attention_cases(shapes, dtypes=tuple(DTYPES), head_dims=HEAD_DIMS, groups=GROUPS, targets=tuple(TARGETS)):
    """The launcher's first choice for every problem of the matrix: dicts with the row keys and
    ``cfg`` (``TreeAttentionConfig``), ``shape``, ``batch``, ``max_seq_len``, ``cap``."""
    ta = _ta()
    cases = []
    for tname in targets:
        cap = TARGETS[tname]
        for dname in dtypes:
            for d in head_dims:
                for g in groups:
                    for sname in shapes:
                        sh = SHAPES[sname]
                        for batch, max_seq_len in PROBLEMS:
                            cfg = ta.launch_configs(
                                head_dim=d,
                                group=g,
                                num_kv_heads=NUM_KV_HEADS,
                                batch=batch,
                                max_query_len=sh.max_query_len,
                                max_seq_len=max_seq_len,
                                num_sms=NUM_SMS[cap],
                            )[0]
                            cases.append(
                                {
                                    "target": tname,
                                    "cap": cap,
                                    "dtype": dname,
                                    "head_dim": d,
                                    "group": g,
                                    "shape": sname,
                                    "batch": batch,
                                    "max_seq_len": max_seq_len,
                                    "cfg": cfg,
                                }
                            )
    return cases


def _attention_plan(case, dot_f32=None):
    """The launcher's plan for ``case`` on meta tensors; ``dot_f32`` overrides ``DOT_F32``."""
    ta = _ta()
    cfg, sh, dt, d = case["cfg"], SHAPES[case["shape"]], DTYPES[case["dtype"]], case["head_dim"]
    batch, h = case["batch"], NUM_KV_HEADS * case["group"]
    t = batch * sh.max_query_len
    max_blocks = -(-case["max_seq_len"] // BLOCK_SIZE)
    meta = dict(device="meta", dtype=torch.int32)
    q = torch.empty(t, h, d, dtype=dt, device="meta")
    kv = torch.empty(2, batch * max_blocks + 1, BLOCK_SIZE, NUM_KV_HEADS, d, dtype=dt, device="meta")
    ints = (
        torch.empty(batch + 1, **meta),
        torch.empty(batch, **meta),
        torch.empty(batch, **meta),
        torch.empty(batch, max_blocks, **meta),
    )
    mask = torch.empty(t, sh.max_query_len, dtype=torch.bool, device="meta") if sh.masked else None
    dot = ta.dot_operands(dt, dt, interpret=False)
    if dot_f32 is not None:
        dot = (dot_f32, dot[1])
    return ta._launch_plan(q, kv, ints, mask, torch.empty_like(q), d**-0.5, cfg, dot)


def _other_plans(dname, d):
    """``[(kernel label, shape, plan)]`` for write_kv and copy_slots at ``d``."""
    from . import kv_ops

    dt = DTYPES[dname]
    kv = torch.empty(2, 4096, BLOCK_SIZE, NUM_KV_HEADS, d, dtype=dt, device="meta")
    out = []
    for sname, t in (("decode", 64), ("prefill", 1024)):
        k = torch.empty(t, NUM_KV_HEADS, d, dtype=dt, device="meta")
        slots = torch.empty(t, dtype=torch.int64, device="meta")
        out.append(("write_kv", sname, kv_ops._write_kv_plan(kv, k, k, slots)))
    full = torch.empty(24, 2, 1024, BLOCK_SIZE, NUM_KV_HEADS, d, dtype=dt, device="meta")
    for sname, n in (
        ("1 pair", 1),
        ("16 pairs", 16),
        ("32 pairs", 32),
        ("64 pairs", 64),
        ("512 pairs", 512),
        ("4096 pairs", 4096),
    ):  # one tile of BLOCK_P = 1 .. 512, then the temporary
        idx = torch.empty(n, dtype=torch.int64, device="meta")
        out.append(("copy_slots", sname, kv_ops._copy_slots_plan(full, idx, idx)))
    return out


# weight-only GEMM (specd_kernels.woq): a 4096 x 4096 projection (a 7B model's q/o) in GGUF-style
# groups of 32, at decode, tree-verification and prefill-chunk widths; in a batch-invariant step
# (woq.fixed_tiles) the decode tile at every width: the "invariant" shapes (decode's is decode's own)
WOQ_SHAPES = {"decode": 1, "tree": 17, "prefill": 256}
WOQ_INVARIANT_SHAPES = ("tree", "prefill")
WOQ_NK = (4096, 4096)


def _woq_plans(dname):
    """``[(kernel label, shape, plan)]`` for the int8 and int4 weight-only GEMM at every width, and
    with the fixed tiles of a batch-invariant step at the widths where they differ."""
    from . import woq

    dt, (n, k), g = DTYPES[dname], WOQ_NK, 32
    out = []
    for fmt in woq.FORMATS:
        q = torch.empty(
            n, k if fmt == "int8" else k // 2, dtype=torch.int8 if fmt == "int8" else torch.uint8, device="meta"
        )
        scale = torch.empty(n, k // g, device="meta")
        minv = scale if fmt == "int4" else None
        for sname, m in WOQ_SHAPES.items():
            x = torch.empty(m, k, dtype=dt, device="meta")
            y = torch.empty(m, n, dtype=dt, device="meta")
            out.append((f"woq_{fmt}", sname, woq._launch_plan(x, q, scale, minv, None, y, y, g, fmt)))
            if sname in WOQ_INVARIANT_SHAPES:
                plan = woq._launch_plan(x, q, scale, minv, None, y, y, g, fmt, invariant=True)
                out.append((f"woq_{fmt}", f"{sname} invariant", plan))
    return out


# batch-invariant kernels (specd_kernels.batch_invariant): the GEMM at a 4096 x 4096 projection and a
# 128256-row LM head (its wider N tile), RMSNorm over 4096 and 576 (the built-in model), attention at
# head_dim 64 (group 3: SmolLM2) and 128 (group 4: Llama-3.1-8B), causal and tree-masked
INVARIANT_NK = {"proj": (4096, 4096), "lm_head": (128256, 4096)}
INVARIANT_ATTENTION = ((64, 3), (128, 4))


def _invariant_plans(dname):
    """``[(kernel label, shape, head_dim, group, plan)]`` for the batch-invariant kernels."""
    from . import batch_invariant as bi

    dt = DTYPES[dname]
    meta = dict(dtype=dt, device="meta")
    out = []
    for nk_name, (n, k) in INVARIANT_NK.items():
        w = torch.empty(n, k, **meta)
        for sname, m in WOQ_SHAPES.items():
            x, y = torch.empty(m, k, **meta), torch.empty(m, n, **meta)
            cfg = bi.matmul_config(n, k, dt)
            out.append(("bi_matmul", f"{nk_name} {sname}", None, None, bi._matmul_plan(x, w, None, y, y, cfg)))
    for d in (4096, 576):
        x = torch.empty(17, d, **meta)
        out.append(("bi_rms_norm", f"d={d}", None, None, bi._rms_norm_plan(x, torch.empty(1, d, **meta), x, 1e-5)))
    i32 = dict(dtype=torch.int32, device="meta")
    for d, g in INVARIANT_ATTENTION:
        q = torch.empty(64 * 17, NUM_KV_HEADS * g, d, **meta)
        kv = torch.empty(2, 4096, BLOCK_SIZE, NUM_KV_HEADS, d, **meta)
        ints = (torch.empty(65, **i32), torch.empty(64, **i32), torch.empty(64, **i32), torch.empty(64, 64, **i32))
        req = torch.empty(q.shape[0], **i32)
        for sname, cols in (("decode", None), ("tree", torch.empty(q.shape[0], 17, **i32))):
            extra = (req, cols, None if cols is None else req)
            plan = bi._attention_plan(q, kv, ints, extra, torch.empty_like(q), d**-0.5, None)
            out.append(("bi_attention", sname, d, g, plan))
    return out


def compile_spec(kernel, args, kw, cap: int) -> dict:
    """Picklable description of one compile: the specialization ``JITFunction.run`` would build
    for ``kernel[grid](*args, **kw)`` on a device of capability ``cap``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", cap, 32))
    kw = dict(kw, debug=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, specialization, options)
    return {
        "module": kernel.fn.__module__,
        "name": kernel.fn.__name__,
        "cap": cap,
        "signature": signature,
        "constexprs": constexprs,
        "attrs": attrs,
        "options": options.__dict__,
    }


_PTXAS_LOG = "specd_ptxas.log"


def _compile_and_log(spec: dict):
    """``(CompiledKernel, ptxas -v log)``; recompiles a cached kernel that has no stored log."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.cache import get_cache_manager

    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    src = ASTSource(fn, spec["signature"], spec["constexprs"], spec["attrs"])
    target = GPUTarget("cuda", spec["cap"], 32)
    knobs.nvidia.dump_ptxas_log = True
    for force in (False, True):
        buf = io.StringIO()
        with knobs.compilation.scope():
            knobs.compilation.always_compile = force
            with contextlib.redirect_stdout(buf):
                kernel = triton.compile(src, target=target, options=spec["options"])
        cache = get_cache_manager(kernel.hash)
        if "ptxas info" in buf.getvalue():
            cache.put(buf.getvalue(), _PTXAS_LOG, binary=False)
            return kernel, buf.getvalue()
        stored = cache.get_file(_PTXAS_LOG)
        if stored is not None:
            with open(stored) as f:
                return kernel, f.read()
    raise RuntimeError(f"no ptxas log for {spec['name']} (is knobs.nvidia.dump_ptxas_log honoured?)")


def parse_ptxas(log: str) -> dict:
    """Registers and spill bytes from a ``ptxas -v`` log of one entry function."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise ValueError(f"unrecognised ptxas -v log:\n{log}")
    return {"registers": int(regs.group(1)), "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2))}


def mma_kinds(ptx: str) -> list:
    """The MMA instructions of a PTX, reduced to ``"<instr> <A type>"``: ``mma.sync f16``,
    ``wgmma bf16``, ``mma.sync tf32`` ... (``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``
    names D, A, B, C types; ``wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16`` D, A, B)."""
    kinds = set()
    pattern = r"\b(mma\.sync|wgmma\.mma_async\.sync)\.aligned\.m\d+n\d+k\d+(?:\.row\.col)?\.(\w+)\.(\w+)"
    for m in re.finditer(pattern, ptx):
        kinds.add(f"{'wgmma' if m.group(1).startswith('wgmma') else 'mma.sync'} {m.group(3)}")
    return sorted(kinds)


def compile_one(spec: dict) -> dict:
    """Compile ``spec`` (from :func:`compile_spec`) and measure it (runs in a worker process)."""
    kernel, log = _compile_and_log(spec)
    row = parse_ptxas(log)
    row.update(
        shared_bytes=int(kernel.metadata.shared),
        stages=int(kernel.metadata.num_stages),
        warps=int(kernel.metadata.num_warps),
        maxnreg=kernel.metadata.maxnreg,
        mma=mma_kinds(kernel.asm["ptx"]),
    )
    return row


def _key(spec: dict) -> str:
    return repr(
        (
            spec["name"],
            spec["cap"],
            sorted(spec["signature"].items()),
            sorted(spec["constexprs"].items()),
            sorted(spec["attrs"].items()),
            sorted((k, str(v)) for k, v in spec["options"].items()),
        )
    )


def build_jobs(
    shapes,
    *,
    dtypes=tuple(DTYPES),
    head_dims=HEAD_DIMS,
    groups=GROUPS,
    targets=tuple(TARGETS),
    dot_f32=None,
    others=True,
) -> list:
    """``[(row, spec)]``: one row per kernel launch of every case (rows without measurements)."""
    jobs = []
    for case in attention_cases(shapes, dtypes, head_dims, groups, targets):
        cfg = case["cfg"]
        base = {k: case[k] for k in ("target", "dtype", "head_dim", "group", "shape", "batch", "max_seq_len")}
        base.update(block_q=cfg.block_q, block_n=cfg.block_n, block_m=cfg.block_m, split_kv=cfg.splits)
        for kernel, _grid, args, kw in _attention_plan(case, dot_f32):
            label = "tree_attention" if kernel.fn.__name__ == "_tree_attention_kernel" else "tree_attention_combine"
            jobs.append((dict(base, kernel=label), compile_spec(kernel, args, kw, case["cap"])))
    if others:
        for tname in targets:
            for dname in dtypes:
                plans = [(d, None, *p) for d in head_dims for p in _other_plans(dname, d)]
                plans += [(None, None, *p) for p in _woq_plans(dname)]
                plans += [(d, g, label, sname, plan) for label, sname, d, g, plan in _invariant_plans(dname)]
                for d, g, label, sname, plan in plans:
                    row = {
                        "kernel": label,
                        "target": tname,
                        "dtype": dname,
                        "head_dim": d,
                        "group": g,
                        "batch": None,
                        "max_seq_len": None,
                        "shape": sname,
                        "block_q": None,
                        "block_n": None,
                        "block_m": None,
                        "split_kv": None,
                    }
                    for kernel, _grid, args, kw in plan:
                        jobs.append((row, compile_spec(kernel, args, kw, TARGETS[tname])))
    return jobs


def measure(jobs, workers: int | None = None) -> list:
    """Compile the distinct specs of ``jobs`` in ``workers`` processes; the rows with figures."""
    _check_compiled_kernels()
    uniq = {}
    for _row, spec in jobs:
        uniq.setdefault(_key(spec), spec)
    keys = list(uniq)
    workers = max(1, min(workers or os.cpu_count() or 1, len(keys)))
    if workers == 1:
        results = [compile_one(uniq[k]) for k in keys]
    else:
        import multiprocessing

        # fork: the workers start with torch/triton/specd_kernels imported (~5 s each on a slow box);
        # nothing here has started threads or touched a GPU before the fork
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
            results = list(pool.map(compile_one, [uniq[k] for k in keys]))
    by_key = dict(zip(keys, results, strict=True))
    return [dict(row, **by_key[_key(spec)]) for row, spec in jobs]


_OPERAND = {"fp16": "f16", "bf16": "bf16"}
# kernels whose dots must take the 16-bit storage type (an fp32 upcast compiles to tf32 MMAs)
MMA_KERNELS = ("tree_attention", "woq_int8", "woq_int4", "bi_matmul", "bi_attention")


def _mma_cell(per: dict) -> str:
    """MMA kinds of a line; operands of the storage dtype read ``16-bit`` (so fp16/bf16 lines merge)."""
    kinds = set()
    for r in per.values():
        for m in r["mma"]:
            instr, operand = m.split()
            kinds.add(f"{instr} {'16-bit' if operand == _OPERAND.get(r['dtype']) else operand}")
    return ", ".join(sorted(kinds)) or "-"


def _cells(per: dict, key: tuple, targets) -> list:
    """Table cells of one problem (``per``: target -> row)."""
    any_row = next(iter(per.values()))
    splits = sorted({r["split_kv"] for r in per.values() if r["split_kv"] is not None})
    cells = ["-" if v is None else str(v) for v in key[:-1]]
    cells += [
        "/".join(map(str, splits)) or "-",
        str(any_row["warps"]),
        str(any_row["stages"]),
        str(any_row["maxnreg"] or "-"),
    ]
    for t in targets:
        r = per.get(t)
        cells.append(
            "-"
            if r is None
            else f"{r['registers']} / {r['spill_stores']}+{r['spill_loads']} / {r['shared_bytes'] / 1024:.1f} KiB"
        )
    return cells + [_mma_cell(per)]


def to_markdown(rows) -> str:
    """The rows as a markdown table: one line per problem with sm_80 and sm_90a side by side
    (``registers / spill stores+loads bytes / shared memory``); lines that differ only in dtype
    (fp16 vs bf16: same figures) are merged."""
    cols = ("kernel", "dtype", "head_dim", "group", "shape", "batch", "block_q", "block_n")
    merged = {}
    for r in rows:  # one line per problem: the split count may differ per target (SM count)
        key = tuple(r.get(c) for c in cols) + ((r["split_kv"] or 1) > 1 if r["split_kv"] is not None else None,)
        merged.setdefault(key, {})[r["target"]] = r
    targets = [t for t in TARGETS if any(t in v for v in merged.values())]
    lines = {}
    for key, per in merged.items():
        cells = _cells(per, key, targets)
        lines.setdefault(tuple(cells[:1] + cells[2:]), []).append(cells[1])
    head = (
        [
            "kernel",
            "dtype",
            "D",
            "group",
            "shape",
            "batch",
            "BLOCK_Q",
            "BLOCK_N",
            "splits",
            "warps",
            "stages",
            "maxnreg",
        ]
        + [f"{t} regs / spills / smem" for t in targets]
        + ["MMA"]
    )
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cells, dtypes in lines.items():
        out.append("| " + " | ".join([cells[0], ", ".join(dict.fromkeys(dtypes)), *cells[1:]]) + " |")
    return "\n".join(out)


def problems(rows) -> list:
    """Human-readable failures: spills, shared memory over the target's limit, fp32/tf32 MMAs."""
    bad = []
    for r in rows:
        what = f"{r['kernel']} {r['target']} {r['dtype']} D={r['head_dim']} group={r['group']} {r['shape']}"
        if r["spill_stores"] or r["spill_loads"]:
            bad.append(f"{what}: spills {r['spill_stores']} B stores / {r['spill_loads']} B loads")
        if r["shared_bytes"] > SMEM_LIMIT[TARGETS[r["target"]]]:
            bad.append(f"{what}: {r['shared_bytes']} B shared memory")
        want = _OPERAND.get(r["dtype"])
        if r["kernel"] in MMA_KERNELS and {m.split()[1] for m in r["mma"]} != {want}:
            bad.append(f"{what}: MMA operands {r['mma']}, want {want}")
    return bad


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m specd_kernels.aot", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    p.add_argument("--groups", default=",".join(map(str, GROUPS)))
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--dot-f32", action="store_true", help="force the fp32-upcast dot operands (the old kernel)")
    p.add_argument(
        "--no-others", action="store_true", help="tree attention only (no kv_ops, woq or batch-invariant kernels)"
    )
    p.add_argument("--kernels", default="", help="comma list of kernel-name prefixes to keep (e.g. bi_; default all)")
    p.add_argument("--workers", type=int, default=None, help="compile processes (default: CPU count)")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file ('-': stdout only)")
    p.add_argument("--check", action="store_true", help="exit 1 on spills, shared memory over the limit or fp32 MMAs")
    return p.parse_args(argv)


def _csv(s: str) -> list:
    return [x for x in s.split(",") if x]


def main(argv=None) -> int:
    """Print the markdown table (or the JSON rows with ``--json -``); PROBLEM lines on stderr."""
    a = _parse_args(argv)
    jobs = build_jobs(
        _csv(a.shapes),
        dtypes=_csv(a.dtypes),
        head_dims=[int(x) for x in _csv(a.head_dims)],
        groups=[int(x) for x in _csv(a.groups)],
        targets=_csv(a.targets),
        dot_f32=True if a.dot_f32 else None,
        others=not a.no_others,
    )
    if a.kernels:
        jobs = [j for j in jobs if j[0]["kernel"].startswith(tuple(_csv(a.kernels)))]
    rows = measure(jobs, a.workers)
    if a.json == "-":
        print(json.dumps(rows))
    else:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        import triton

        print(f"triton {triton.__version__}, torch {torch.__version__}; compile-time figures (no GPU run)\n")
        print(to_markdown(rows))
    bad = problems(rows)
    for line in bad:
        print("PROBLEM:", line, file=sys.stderr)
    return 1 if (a.check and bad) else 0


def run_clean(argv, timeout: float = 600) -> list:
    """Run ``python -m specd_kernels.aot --json - *argv`` without ``TRITON_INTERPRET`` (usable from a
    process whose kernels are interpreted, e.g. the test suite); returns the rows."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-m", "specd_kernels.aot", "--json", "-", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if r.returncode != 0:
        raise RuntimeError(f"specd_kernels.aot failed (rc={r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
