"""The evaluation harness: how every script starts what it measures and how it measures it.

- **Engines and daemons.** :func:`engine_from_flags` builds an ``Engine`` from ``specd serve`` flags
  (optionally sharing loaded weights); :func:`make_engine` one per speculation mode;
  :func:`start_daemon` starts ``specd serve`` either in this process (``ServerThread``, its engine
  on a thread of this process, with a :class:`StepLog` listening) or as a child process
  (``ServerProcess``), and returns a :class:`Daemon` with one ``stop()`` for both.
- **Timings** come from the engine's public statistics, never from wrapping its methods:
  :class:`StepTimer` reads ``engine.timings`` (wall and engine-thread CPU seconds per stage) and the
  drafter's forward counters; :class:`StepLog` records every step (its time, the draft depth the
  policy chose, the draft tokens granted, and each verified request's (depth, accepted) pair, from
  the requests' own ``SpecStats``).
- **Percentiles.** One definition everywhere: :func:`percentile` interpolates linearly between the
  two nearest ranks (numpy's default, Hyndman & Fan type 7); :func:`median` is its 50th percentile.
- **Processes and the machine**: CPU seconds and resident memory of a process tree, the CPU model
  and flags, library versions, the git commit, the command line.
"""

from __future__ import annotations

import copy
import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    """A progress line on stderr, time-stamped (reports go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# percentiles ------------------------------------------------------------------------------------
def percentile(xs: Iterable, q: float) -> float | None:
    """The ``q``-th percentile (0 <= q <= 100) of the samples ``xs`` (``None`` entries ignored),
    interpolating linearly between the two nearest ranks: with the n samples sorted, rank
    ``k = (n - 1) q / 100`` and the value ``s[floor k] + (s[floor k + 1] - s[floor k]) * frac(k)``
    (numpy's default method). ``None`` when there is no sample.

    >>> percentile([1, 2, 3, 4], 50), percentile([10], 99), percentile([], 50)
    (2.5, 10, None)
    """
    s = sorted(x for x in xs if x is not None)
    if not s:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: Iterable, empty: float | None = None) -> float | None:
    """The 50th :func:`percentile` (the usual median); ``empty`` when there is no sample."""
    m = percentile(xs, 50)
    return empty if m is None else m


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


# engines ----------------------------------------------------------------------------------------
def engine_from_flags(flags: list, target=None, draft=None, warm: bool = False):
    """An ``Engine`` configured exactly as ``specd serve FLAGS`` would configure it; ``target`` and
    ``draft`` (``LoadedModel``) share weights already loaded; ``warm``: run the server's warm-up
    (first-call costs paid, speculation totals reset afterwards)."""
    from specd.engine.engine import Engine
    from specd.options import engine_config, serve_parser

    engine = Engine(engine_config(serve_parser().parse_args(list(flags))), target=target, draft=draft)
    if warm:
        from specd.engine.warmup import warm_up

        warm_up(engine)
    return engine


def make_engine(
    mode,
    target,
    draft,
    device: str = "cpu",
    prefix_cache: bool = True,
    memory_bytes: int = 256 << 20,
    max_num_seqs: int = 4,
    head: str | None = None,
):
    """One Engine per speculation mode (``common.Mode``), sharing the loaded models (``off`` gets no
    draft at all). ``prefix_cache=False``: every prompt is prefilled in full, like a peer engine
    without one. ``head``: a feature head folder as the model proposer instead of ``draft``."""
    from specd.config import CacheConfig, EngineConfig, SchedulerConfig
    from specd.engine.engine import Engine

    drafts = mode.kind not in ("off", "ngram")  # the mode uses a model proposer
    use_draft = draft if drafts and head is None else None
    cfg = EngineConfig(
        target=str(target.path),
        head=head if drafts else None,
        draft=str(draft.path) if use_draft is not None else None,
        device=device,
        spec=mode.spec_config(),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, enable_prefix_cache=prefix_cache),
        cache=CacheConfig(memory_bytes=memory_bytes),
    )
    return Engine(cfg, target=target, draft=use_draft)


def kv_bytes_per_token(model) -> int:
    """KV cache bytes one token takes in a loaded model (``LoadedModel``): 2 (K, V) x layers x KV heads x head dim."""
    import torch

    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=model.dtype).element_size()


# timings ----------------------------------------------------------------------------------------
class StepTimer:
    """Per-stage time of one engine since ``reset()``, read from its public statistics
    (``engine.timings``: wall and engine-thread CPU seconds per stage; the drafter's forward
    count and seconds).

    ``as_dict()``: ``steps`` (engine steps that ran a batch), ``draft_forwards`` and
    ``draft_forwards_per_step``, then per clock (wall: no prefix; engine-thread CPU: ``cpu_``) the
    seconds of the whole step (``step_s``), of its stages (``schedule_s``; ``draft_s`` = proposing,
    draft forwards included; ``target_forward_s``; ``verify_s``; ``commit_s``), of the draft model's
    forwards alone (``draft_forward_s``, part of ``draft_s``), and per-step means in ms. The stages
    never add up to more than the step (the policy's bookkeeping after the stages is the rest)."""

    def __init__(self, engine):
        self.engine = engine
        self.reset()

    def _draft_totals(self) -> tuple:
        d = self.engine.drafter
        return (d.forwards, d.forward_wall, d.forward_cpu) if d is not None else (0, 0.0, 0.0)

    def reset(self) -> None:
        self.engine.timings.reset()
        self._d0 = self._draft_totals()

    def as_dict(self) -> dict:
        tm = self.engine.timings
        n_steps = max(1, tm.steps)
        nd, dwall, dcpu = (b - a for a, b in zip(self._d0, self._draft_totals()))
        d = {"steps": tm.steps, "draft_forwards": nd, "draft_forwards_per_step": nd / n_steps}
        for clock, src, dsec in (("", tm.wall, dwall), ("cpu_", tm.cpu, dcpu)):
            d[f"{clock}step_s"] = src["step"]
            d[f"{clock}schedule_s"] = src["schedule"]
            d[f"{clock}draft_s"] = src["draft"]
            d[f"{clock}target_forward_s"] = src["forward"]
            d[f"{clock}verify_s"] = src["verify"]
            d[f"{clock}commit_s"] = src["commit"]
            d[f"{clock}draft_forward_s"] = dsec
            d[f"{clock}step_ms_mean"] = 1e3 * src["step"] / n_steps
            d[f"{clock}draft_ms_per_step"] = 1e3 * src["draft"] / n_steps
            d[f"{clock}target_forward_ms_per_step"] = 1e3 * src["forward"] / n_steps
            d[f"{clock}draft_forward_ms_mean"] = 1e3 * dsec / nd if nd else 0.0
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}


@dataclass(frozen=True)
class StepRow:
    """One logged engine step."""

    seconds: float  # wall time of the step
    cpu_clock: float  # the logging thread's CPU clock (thread_time) after the step: deltas = CPU per step
    depth: int  # draft depth the adaptive policy chose for the step (policy.last_depth)
    spec_budget: int  # draft tokens the scheduler granted in the step
    outputs: int  # requests that got output
    verified: tuple  # (drafted depth, accepted drafts) of each request the step verified


class StepLog:
    """Every step of one engine, from public state only: usable as an ``AsyncEngine`` listener
    (``f(outputs, seconds)``, engine thread) or to drive an engine directly (:meth:`step`,
    :meth:`generate`). A request's (depth, accepted) pair for a step is the change of its own
    ``SpecStats`` since its previous output, so the per-position acceptance is exact even when the
    tree depth varies from step to step. It also snapshots the engine-wide totals
    (``engine.stats``) when created: :meth:`engine_stats` is what the engine counted since."""

    def __init__(self, engine):
        self.engine = engine
        self.rows: list[StepRow] = []
        self._seen: dict = {}  # request id -> (steps, accepted, drafted per depth) at its last output
        self._taken = 0
        self._stats0 = copy.deepcopy(engine.stats)

    def __call__(self, outs: list, seconds: float) -> None:
        eng = self.engine
        verified = tuple(v for v in map(self._verified, outs) if v is not None)
        self.rows.append(
            StepRow(
                seconds, time.thread_time(), eng.policy.last_depth, eng.scheduler.last_spec_budget, len(outs), verified
            )
        )

    def _verified(self, out) -> tuple | None:
        seq = out.seq
        if seq is None:
            return None
        st, rid = seq.stats, seq.request_id
        steps0, acc0, drafted0 = self._seen.get(rid, (0, 0, ()))
        if seq.finished:
            self._seen.pop(rid, None)
        else:
            self._seen[rid] = (st.steps, st.accepted_tokens, tuple(st.drafted_per_depth))
        if st.steps == steps0:
            return None
        depth = sum(1 for i, n in enumerate(st.drafted_per_depth) if n > (drafted0[i] if i < len(drafted0) else 0))
        return depth, st.accepted_tokens - acc0

    def step(self) -> list:
        """One ``engine.step()``, logged; its outputs."""
        t0 = time.perf_counter()
        outs = self.engine.step()
        if outs:
            self(outs, time.perf_counter() - t0)
        return outs

    def generate(self, prompt_ids: list, params, spec):
        """``Engine.generate`` for one request, every step logged; the finished ``Sequence``."""
        seq = self.engine.add_request(prompt_ids, params, spec)
        while not seq.finished:
            self.step()
        return seq

    def mark(self) -> int:
        return len(self.rows)

    def since(self, k: int) -> list[StepRow]:
        return self.rows[k:]

    def take(self) -> list:
        """The (depth, accepted) pairs verified since the previous ``take()``."""
        rows, self._taken = self.rows[self._taken :], len(self.rows)
        return [v for r in rows for v in r.verified]

    def engine_stats(self):
        """``engine.stats`` minus its value when this log was created (a ``SpecStats``)."""
        return stats_difference(self.engine.stats, self._stats0)


def stats_difference(now, before):
    """``now - before`` for two ``SpecStats`` (counters and per-depth lists; trailing zeros dropped,
    as a ``SpecStats`` that counted only the steps in between would have them)."""
    from specd.engine.sequence import SpecStats

    def sub(a: list, b: list) -> list:
        out = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
        while out and out[-1] == 0:
            out.pop()
        return out

    return SpecStats(
        steps=now.steps - before.steps,
        draft_tokens=now.draft_tokens - before.draft_tokens,
        accepted_tokens=now.accepted_tokens - before.accepted_tokens,
        emitted_tokens=now.emitted_tokens - before.emitted_tokens,
        accepted_per_depth=sub(now.accepted_per_depth, before.accepted_per_depth),
        drafted_per_depth=sub(now.drafted_per_depth, before.drafted_per_depth),
        accept_len_hist=sub(now.accept_len_hist, before.accept_len_hist),
        by_proposer={
            name: diff
            for name, row in now.by_proposer.items()
            if any(diff := [x - y for x, y in zip(row, before.by_proposer.get(name, [0, 0, 0]))])
        },
    )


# daemons ----------------------------------------------------------------------------------------
def clean_env() -> dict:
    """This process's environment without what would change a child daemon's behaviour: ``SPECD_*``
    settings (an API key, paths) and systemd's notify/watchdog variables."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SPECD_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")
    }


@dataclass
class Daemon:
    """A running ``specd serve`` on a free loopback port: in this process (``thread``: a
    ``ServerThread``; ``engine`` and ``steplog`` its engine and the :class:`StepLog` listening to it)
    or a child process (``process``: a ``ServerProcess``; ``logs`` its stderr lines)."""

    port: int
    flags: list
    thread: Any = None
    process: Any = None
    engine: Any = None
    steplog: StepLog | None = None
    exit_status: int | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def pid(self) -> int:
        """The process serving (this one when in process): measure its CPU and memory."""
        return self.process.proc.pid if self.process is not None else os.getpid()

    @property
    def app(self):
        return self.thread.app

    @property
    def logs(self) -> list:
        return self.process.logs if self.process is not None else []

    def stop(self, timeout: float = 60.0) -> int | None:
        """Drain and stop. A child gets SIGTERM (killed after ``timeout`` seconds); its exit status
        is returned (and kept in ``exit_status``); in process: None."""
        if self.thread is not None:
            self.thread.stop(timeout)
            return None
        proc = self.process.proc
        proc.terminate()
        try:
            self.exit_status = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            self.exit_status = proc.wait()
        return self.exit_status


def start_daemon(
    flags: list, *, child: bool = False, target=None, draft=None, env: dict | None = None, timeout: float = 300.0
) -> Daemon:
    """Start ``specd serve FLAGS`` on a free port (``--port 0 --grpc-port 0`` are added) and return
    once it is ready.

    In process (default): an ``Engine`` sharing ``target``/``draft`` when given, warmed up like the
    server's, served by a ``ServerThread`` (log level warning unless FLAGS say otherwise) with a
    :class:`StepLog` as a step listener. ``child=True``: ``python -m specd serve`` as a child process
    in the repository root, with :func:`clean_env` unless ``env`` is given (log level info: its
    "listening"/"ready" lines are how readiness is seen)."""
    base = ["--port", "0", "--grpc-port", "0"]
    if child:
        from specd.serving.app import ServerProcess

        args = [*base, "--log-level", "info", *flags]
        sp = ServerProcess(args, env=clean_env() if env is None else env, cwd=ROOT).start(timeout)
        assert sp.port is not None  # known once ready
        return Daemon(sp.port, list(flags), process=sp)
    from specd.serving.app import ServerThread

    args = [*base, "--log-level", "warning", *flags]
    eng = engine_from_flags(args, target, draft, warm=True)
    from specd.options import serve_parser

    srv = ServerThread(serve_parser().parse_args(args), eng).start(timeout)
    steplog = StepLog(eng)
    assert srv.app.ae is not None  # the engine loop runs once the server is ready
    srv.app.ae.listeners.append(steplog)
    return Daemon(srv.port, list(flags), thread=srv, engine=eng, steplog=steplog)


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


def command_line(module: str, argv: list | None) -> str:
    """The command that reproduces this run: ``python -m eval.MODULE ARGS`` (``argv`` None: this
    process's own arguments)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, "-m", f"eval.{module}", *args])


def run_meta(module: str, argv: list | None = None, device: str = "cpu") -> dict:
    """What a report records about its run: the command, date (UTC), versions, git commit, device,
    CPU, threads, host and platform."""
    import torch

    dev = device
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = f"{device} ({torch.cuda.get_device_name()})"
    return {
        "command": command_line(module, argv),
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
