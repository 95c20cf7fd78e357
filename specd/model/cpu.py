"""The CPU the engine runs on: its bf16 support, the fastest dtype for a model's step shapes, threads.

CPUs differ. With AVX512-BF16 or AMX, a bf16 matmul of 1 and of 8 rows cost about the same, so bf16
(half the bytes of fp32) wins every step. With AVX2 only, bf16 is emulated: one row is still faster
than fp32 (memory-bound: half the bytes), but several rows are much slower (SmolLM2's linear layers,
1 / 8 / 32 rows: fp32 95 / 149 / 310 ms, emulated bf16 44 / 260 / 967 ms). Speculation verifies
several rows per request, so the right dtype depends on the widths the engine will run.

``choose_dtype(hidden, intermediate, num_layers, widths)`` times the model's largest linear shapes
(every layer's MLP up and down projections, distinct weights) at those widths in fp32 and bf16 and
picks the dtype with the lower total time; the choice is cached per CPU model, flags, torch version, shapes, widths
and threads (in
``$SPECD_CACHE_DIR/cpu-dtype.json``, default ``~/.cache/specd``) so it is timed once per machine.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from specd.model.errors import cache_dir

log = logging.getLogger("specd.cpu")

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


def cpu_info() -> dict:
    """``{"model": str, "flags": set}`` from /proc/cpuinfo (model from ``platform`` elsewhere)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("", platform.machine(), platform.processor()):
                model = val.strip()
            elif key == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        pass
    return {"model": model, "flags": flags}


def native_bf16(flags: set | None = None) -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    flags = cpu_info()["flags"] if flags is None else flags
    return any(f in flags for f in BF16_FLAGS)


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def set_threads(n: int | None = None) -> int:
    """Intra-op threads for the engine's math: ``n`` > 0 as given; 0 = every usable CPU; None =
    ``$OMP_NUM_THREADS`` when set, else every usable CPU. Returns the number set."""
    if n is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        n = int(env) if env.isdigit() else 0
    n = n if n > 0 else usable_cpus()
    torch.set_num_threads(n)
    return n


def _time_pass(rows: int, layers: list, reps: int) -> float:
    """Median seconds of ``rows`` rows through every (up, down) weight pair in turn."""
    x = torch.randn(rows, layers[0][0].shape[1]).to(layers[0][0].dtype)
    times = []
    for _ in range(reps + 1):  # (the first pass warms up)
        t0 = time.perf_counter()
        for up, down in layers:
            torch.nn.functional.linear(torch.nn.functional.linear(x, up), down)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def time_dtypes(hidden: int, intermediate: int, num_layers: int, widths: tuple, reps: int = 3) -> dict:
    """Seconds per ``"dtype@width"``: ``width`` rows through ``num_layers`` distinct MLP up and down
    projections (distinct weights, so that a real model's weights streaming from memory, not a
    cached copy, are what is timed). The dtypes alternate per width, so that a change in the
    machine's load during the timing hits both alike."""
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        weights[name] = [
            (
                (torch.randn(intermediate, hidden, generator=g) * 0.02).to(dt),
                (torch.randn(hidden, intermediate, generator=g) * 0.02).to(dt),
            )
            for _ in range(num_layers)
        ]
    out = {}
    for width in widths:
        for name in ("float32", "bfloat16", "float32", "bfloat16"):  # each twice, interleaved: keep the faster
            t = _time_pass(width, weights[name], reps)
            out[f"{name}@{width}"] = min(t, out.get(f"{name}@{width}", t))
    return out


def pick(times: dict, widths, native: bool) -> str:
    """The dtype name to use given ``time_dtypes`` results. With native bf16: the lower total time.
    Emulated bf16 (AVX2) must be at least 10% faster at EVERY width to be chosen: its several-row
    matmuls are the slow ones, and a noisy one-off timing must not pick a dtype that loses the
    verification steps (or costs a small model's accuracy for nothing)."""
    total = {d: sum(times[f"{d}@{w}"] for w in widths) for d in ("float32", "bfloat16")}
    if native:
        return min(total, key=total.get)
    faster = all(times[f"bfloat16@{w}"] < 0.9 * times[f"float32@{w}"] for w in widths)
    return "bfloat16" if faster else "float32"


def choose_dtype(
    hidden: int, intermediate: int, num_layers: int, widths: tuple, cache: Path | None = None
) -> torch.dtype:
    """fp32 or bf16, whichever runs the given row widths through the model's MLP shapes faster in
    total on this CPU (timed once, then cached)."""
    info = cpu_info()
    threads = torch.get_num_threads()
    key = "|".join(
        [
            info["model"],
            ",".join(sorted(f for f in info["flags"] if "bf16" in f or "amx" in f)),
            torch.__version__,
            f"{hidden}x{intermediate}x{num_layers}",
            ",".join(map(str, widths)),
            f"t{threads}",
        ]
    )
    path = (cache or cache_dir()) / "cpu-dtype.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return getattr(torch, known[key]["dtype"])
    times = time_dtypes(hidden, intermediate, num_layers, tuple(widths))
    best = pick(times, widths, native_bf16(info["flags"]))
    log.info(
        "dtype auto on this CPU: %s",
        best,
        extra={
            "fields": {
                "cpu": info["model"],
                "native_bf16": native_bf16(info["flags"]),
                "threads": threads,
                "widths": list(widths),
                "ms": {k: round(v * 1e3, 3) for k, v in times.items()},
            }
        },
    )
    known[key] = {"dtype": best, "ms": {k: round(v * 1e3, 3) for k, v in times.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=1))
    except OSError:
        log.warning("could not cache the dtype choice in %s", path)
    return getattr(torch, best)
