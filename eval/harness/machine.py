"""The machine and the run: where things are, threads, processes, the CPU, versions, the command.

Every report records :func:`run_meta` (the command that reproduces it, the date, versions, the git
commit, the device and CPU); :func:`cpu_info` adds the SIMD flags the math kernels care about.
Process figures (CPU seconds, resident memory) cover a process and its live children: ``specd
serve`` runs its engine in a child process.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
SHARED = Path(os.environ.get("SPECD_SHARED", ROOT.parent / "shared"))  # models and data sets beside it


def log(msg: str) -> None:
    """A progress line on stderr, time-stamped (reports go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def short_path(p) -> str:
    """``p`` relative to the repository or the folder beside it when it is inside them ("-" for none)."""
    if not p:
        return "-"
    p = Path(p).resolve()
    for base in (ROOT, ROOT.parent):
        if p.is_relative_to(base):
            return str(p.relative_to(base))
    return str(p)


# threads and libraries --------------------------------------------------------------------------
def set_threads(n: int) -> None:
    """Pin intra-op threads (the machines are shared: 1-2 threads keeps timings steadier)."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)


def quiet_transformers() -> None:
    """No weight-loading progress bars or deprecation chatter in the reports' console output."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


def cpu_layout(pin: bool):
    """(server CPUs, engine CPUs) as ``specd serve --cpu-split`` assigns them, or None unpinned
    (``pin`` false, or fewer than 2 usable CPUs)."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return set(cpus[:1]), set(cpus[1:])


# processes --------------------------------------------------------------------------------------
def child_pids(pid: int) -> list:
    """Live child process ids of ``pid`` (Linux /proc; [] elsewhere), e.g. `specd serve`'s engine process."""
    out = []
    try:
        for t in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (t / "children").read_text().split()]
    except (OSError, ValueError):
        pass
    return out


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live descendants (the engine process of
    ``specd serve``), from /proc (Linux); 0 elsewhere."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        own = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0
    return own + sum(process_cpu_seconds(c) for c in child_pids(pid))


def process_rss_bytes(pid: int) -> int | None:
    """VmRSS in bytes of a process plus its live descendants, from Linux /proc; None when the
    process is gone."""
    own = None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                own = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if own is None:
        return None
    return own + sum(process_rss_bytes(k) or 0 for k in child_pids(pid))


# the machine and the run ------------------------------------------------------------------------
def versions() -> dict:
    import torch
    import transformers

    try:
        from importlib.metadata import version

        specd_v = version("specd")
    except Exception:  # noqa: BLE001
        specd_v = "unknown"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specd": specd_v,
    }


def git(*args: str) -> str | None:
    """``git ARGS`` in the repository (stripped stdout), None when git fails."""
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except Exception:  # noqa: BLE001
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_commit() -> str | None:
    """Short HEAD, ``+dirty`` when tracked files have changes."""
    head = git("rev-parse", "--short", "HEAD")
    if head is None:
        return None
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_name() -> str:
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "bf16",
    "i8mm",
)


def cpu_info() -> dict:
    """The CPU a benchmark ran on: model, the SIMD flags the math kernels care about (all flags too),
    cores and the cores this process may use (affinity), and torch's chosen kernel level."""
    flags: list = []
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith(("flags", "Features")):
                flags = ln.split(":", 1)[1].split()
                break
    except OSError:
        pass
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    info = {
        "model": cpu_name(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "simd_flags": [f for f in SIMD_FLAGS if f in flags],
        "flags": " ".join(flags),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        import torch

        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001
        pass
    return info


def command_line(command: str, argv: list | None) -> str:
    """The command that reproduces this run: ``python -m eval COMMAND ARGS`` (``command``: the entry
    point and tool, e.g. ``"bench"`` or ``"load soak"``; a module name such as ``"eval.x"``: ``python
    -m eval.x ARGS``; ``argv`` None: this process's own arguments, which the dispatcher leaves to
    the tool alone)."""
    args = sys.argv[1:] if argv is None else list(argv)
    words = [command] if command.startswith("eval.") else ["eval", *command.split()]
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, "-m", *words, *args])


def run_meta(command: str, argv: list | None = None, device: str = "cpu") -> dict:
    """What a report records about its run: the command (:func:`command_line`), date (UTC), versions,
    git commit, device, CPU, threads, host and platform."""
    import torch

    dev = device
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = f"{device} ({torch.cuda.get_device_name()})"
    return {
        "command": command_line(command, argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "git_commit": git_commit(),
        "device": dev,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host": platform.node(),
        "platform": platform.platform(),
    }
