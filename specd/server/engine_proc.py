"""The engine in its own process: ``RemoteEngine`` is the server-side stand-in for ``Engine``.

Why: an ``Engine`` stepping in a thread of the server process shares the GIL with the event loop that
streams its tokens. On a small model a step is mostly Python, so every frame the loop sends is time
the engine cannot step (issue: websocket delivery >= 95% of in-process tokens/s). In its own process
the engine steps on its own core; the server process only relays outputs.

Shape: ``RemoteEngine`` implements the part of ``Engine`` that ``AsyncEngine``, the servers and the
metrics use. ``add_request`` validates locally (the limits come in the child's handshake) and sends
the request down a pipe. ``AsyncEngine`` has no engine thread in this mode: its event loop watches
the child's pipe (``fileno()``) and relays what ``read_ready()`` returns straight to the streams.
The child (``_child_main``) loads the models, warms up, then loops: take commands, step, send the
outputs (one pickled list per step, with the step's duration) plus, at most every 50 ms and whenever
it goes idle, a snapshot of the state ``/metrics`` reports. A child that has work and sends nothing for the watchdog timeout is stuck.

Lifecycle: the child ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the
parent drains first) and exits when told to or when the parent's end of the pipe closes (the
parent died). A child that dies fails every running request (``internal``) and turns ``alive``
false, which ``/healthz`` and the systemd watchdog report.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Optional

from specd.engine import RequestError, RequestOutput, validate_request
from specd.loader import LoadError, load_tokenizer
from specd.sequence import SpecStats

log = logging.getLogger("specd.engine_proc")

SNAPSHOT_EVERY_S = 0.05
_SEQ_FIELDS = ("priority", "spec", "num_prompt", "num_output", "arrival", "scheduled_time", "first_token_time",
               "finish_time", "num_preemptions", "finish_reason")


# child ---------------------------------------------------------------------------------------------
def _snapshot(eng) -> dict:
    sch = eng.scheduler
    return {"running": [(s.request_id, s.priority) for s in sch.running], "waiting": sch.queue_lengths(),
            "kv_used": eng.kv_blocks_used(), "stats": eng.stats, "preemptions": sch.num_preemptions,
            "spec_budget": sch.last_spec_budget, "depth": sch.last_depth, "prefix": eng.prefix_cache_stats(),
            "steps": eng.num_steps}


def _seq_state(seq) -> dict:
    d = {k: getattr(seq, k) for k in _SEQ_FIELDS}
    d["stats"] = seq.stats
    return d


def _child_main(cfg, cmd_conn, out_conn, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from specd.server.app import setup_logging, warm_up

    setup_logging(logging.getLevelName(log_level))  # the server's JSON lines, on the same stderr
    import torch

    from specd.engine import Engine

    try:
        eng = Engine(cfg)
        warm_up(eng)
    except LoadError as e:
        out_conn.send(("load_error", str(e)))
        return
    except BaseException as e:  # noqa: BLE001 - report, then exit
        out_conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    out_conn.send(("ready", {
        "max_model_len": eng.max_model_len, "block_size": eng.cache.block_size,
        "num_blocks": eng.cache.pool.num_blocks,
        "draft_num_blocks": eng.draft_cache.pool.num_blocks if eng.draft_cache is not None else None,
        "vocab_size": eng.vocab_size, "has_draft": eng.drafter is not None, "threads": torch.get_num_threads()}))
    first_sent: set = set()
    last_snap = 0.0
    while True:
        try:
            idle = not eng.has_work()
            # block for commands only while idle; otherwise take what is there and step
            while cmd_conn.poll(0.5 if idle else 0):
                cmd = cmd_conn.recv()
                op = cmd[0]
                if op == "add":
                    _, rid, ids, p, spec, prio = cmd
                    try:
                        eng.add_request(ids, p, spec, prio, rid)
                    except (RequestError, ValueError) as e:  # the parent validated: only races land here
                        code = getattr(e, "code", "invalid_request")
                        out_conn.send(("outs", [(rid, [], "", True, "error", {"error": (code, str(e))})], None, 0.0))
                elif op == "abort":
                    eng.abort(cmd[1])
                elif op == "snapshot":
                    out_conn.send(("snapshot", _snapshot(eng)))
                elif op == "stop":
                    return
                idle = False
        except (EOFError, OSError):  # the parent is gone
            return
        if not eng.has_work():
            continue
        t_step = time.monotonic()
        try:
            outs = eng.step()
        except Exception as e:  # noqa: BLE001 - report; the parent fails the running requests
            log.exception("engine step failed")
            out_conn.send(("step_error", f"{type(e).__name__}: {e}"))
            continue
        packed = []
        for o in outs:
            seq = o.seq
            state = None
            if o.finished:
                state = _seq_state(seq)
                first_sent.discard(o.request_id)
            elif o.request_id not in first_sent and seq.first_token_time is not None:
                state = _seq_state(seq)
                first_sent.add(o.request_id)
            packed.append((o.request_id, o.token_ids, o.text, o.finished, o.finish_reason, state))
        now = time.monotonic()
        snap = None
        if now - last_snap >= SNAPSHOT_EVERY_S or not eng.has_work():
            snap, last_snap = _snapshot(eng), now
        try:
            out_conn.send(("outs", packed, snap, now - t_step))
        except (BrokenPipeError, OSError):
            return


def _child_entry(cmd_fd: int, out_fd: int) -> None:
    cmd_conn = Connection(cmd_fd, writable=False)
    out_conn = Connection(out_fd, readable=False)
    try:
        cfg, log_level = cmd_conn.recv()
    except (EOFError, OSError):
        return
    _child_main(cfg, cmd_conn, out_conn, log_level)


# parent --------------------------------------------------------------------------------------------
class _Proc:
    """``subprocess.Popen`` with the few ``multiprocessing.Process`` names used here."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self):
        return self.popen.poll()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def join(self, timeout=None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()


def _split_cpus(child_pid: int) -> None:
    """With 2+ usable CPUs: the first for the server process (an event loop: I/O bound, one core
    is plenty), the rest for the engine, so the two never preempt each other. A single
    CPU (or no affinity API) leaves scheduling to the OS."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return
    if len(cpus) < 2:
        return
    try:
        os.sched_setaffinity(child_pid, cpus[1:])
        for tid in os.listdir("/proc/self/task"):  # every thread of the server process
            os.sched_setaffinity(int(tid), cpus[:1])
    except (OSError, ValueError):
        log.warning("could not set CPU affinity; leaving it to the OS", exc_info=True)


class RemoteSeq:
    """What the servers read of a finished (or first-emitting) request, as the child reported it."""

    def __init__(self, rid: str, num_prompt: int, priority: str, spec, arrival: float):
        self.request_id = rid
        self.num_prompt = num_prompt
        self.num_output = 0
        self.priority = priority
        self.spec = spec
        self.arrival = arrival
        self.scheduled_time = self.first_token_time = self.finish_time = None
        self.num_preemptions = 0
        self.finish_reason = None
        self.stats = SpecStats()


class _SchedulerView:
    def __init__(self, eng: "RemoteEngine"):
        self._eng = eng

    @property
    def running(self) -> list:
        return [SimpleNamespace(request_id=r, priority=p) for r, p in self._eng._snap.get("running", ())]

    def queue_lengths(self) -> dict:
        return dict(self._eng._snap.get("waiting", {"interactive": 0, "batch": 0}))

    @property
    def num_preemptions(self) -> int:
        return self._eng._snap.get("preemptions", 0)

    @property
    def last_spec_budget(self) -> int:
        return self._eng._snap.get("spec_budget", 0)

    @property
    def last_depth(self) -> int:
        return self._eng._snap.get("depth", 0)


class RemoteEngine:
    """``Engine``'s serving surface, backed by an engine process. Construct (blocks until the models
    are loaded and warmed up; raises ``LoadError``), hand to ``AsyncEngine``, ``shutdown()`` at the end."""

    def __init__(self, cfg, load_timeout_s: Optional[float] = None, split_cpus: bool = False):
        # a fresh interpreter (`python -m specd.server.engine_proc FD FD`), not multiprocessing's
        # spawn: that re-imports the parent's __main__, which need not be import-safe
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        self.proc = _Proc(subprocess.Popen(
            [sys.executable, "-m", "specd.server.engine_proc", str(cmd_r), str(out_w)],
            pass_fds=(cmd_r, out_w), stdin=subprocess.DEVNULL, close_fds=True))
        os.close(cmd_r)
        os.close(out_w)
        if split_cpus:  # (the daemon; not for a library user's process)
            _split_cpus(self.proc.pid)
        self._cmd = Connection(cmd_w, readable=False)
        self._out = Connection(out_r, writable=False)
        self._cmd.send((cfg, logging.getLogger().level))
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards seqs (AsyncEngine reads it under this lock)
        self.seqs: dict[str, RemoteSeq] = {}
        self._snap: dict = {}
        self._dead: Optional[str] = None
        self._pending_error: Optional[str] = None
        self.last_msg_time = time.monotonic()  # last message from the child (watchdog)
        self.last_add_time = 0.0
        self.reader_attached = False  # an event loop reads the pipe (AsyncEngine)
        kind, info = self._recv_until(load_timeout_s)  # (the child checks the model folder first)
        if kind == "load_error":
            self.shutdown()
            raise LoadError(info)
        if kind != "ready":
            self.shutdown()
            raise LoadError(f"engine process failed to start: {info}")
        try:
            self.tokenizer = load_tokenizer(Path(cfg.target))
        except BaseException:
            self.shutdown()
            raise
        self.info = info
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.cache = SimpleNamespace(block_size=info["block_size"], pool=SimpleNamespace(num_blocks=info["num_blocks"]))
        self.draft_cache = (SimpleNamespace(pool=SimpleNamespace(num_blocks=info["draft_num_blocks"]))
                            if info["draft_num_blocks"] is not None else None)
        self.drafter = True if info["has_draft"] else None
        self.scheduler = _SchedulerView(self)

    def _recv_until(self, timeout: Optional[float]):
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._out.poll(0.2):
                try:
                    return self._out.recv()
                except (EOFError, OSError):
                    return "died", f"engine process exited (code {self.proc.exitcode})"
            if not self.proc.is_alive():
                if self._out.poll(0):
                    continue
                return "died", f"engine process exited (code {self.proc.exitcode})"
            if end is not None and time.monotonic() > end:
                return "died", "timed out waiting for the engine process"

    def _send(self, msg) -> None:
        try:
            with self._send_lock:
                self._cmd.send(msg)
        except (BrokenPipeError, OSError) as e:
            self._dead = self._dead or f"engine process unreachable: {e}"

    # Engine surface ------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._dead is None and self.proc.is_alive()

    def validate(self, prompt_ids: list, params) -> None:
        validate_request(prompt_ids, params, self.max_model_len, self.cache.block_size,
                         self.cache.pool.num_blocks, self.vocab_size)

    def add_request(self, prompt_ids, params, spec, priority: str = "interactive", request_id: Optional[str] = None):
        from specd.sequence import PRIORITIES

        self.validate(prompt_ids, params)
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be interactive|batch, got {priority!r}")
        if not self.alive:
            raise RequestError("internal", self._dead or "the engine process is not running")
        seq = RemoteSeq(request_id, len(prompt_ids), priority, spec, time.monotonic())
        with self._lock:
            if request_id in self.seqs:
                raise RequestError("duplicate_id", f"request id {request_id!r} is already running")
            self.seqs[request_id] = seq
        self.last_add_time = time.monotonic()
        self._send(("add", request_id, list(prompt_ids), params, spec, priority))
        return seq

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.seqs)

    def fileno(self) -> int:
        """The pipe the child writes to: readable when ``read_ready()`` has something."""
        return self._out.fileno()

    def read_ready(self) -> list:
        """Every message the child has sent so far, without blocking: a list of ``(outputs, step
        seconds)``. A failed step stops the read (``take_error()`` returns it); a child that is gone
        turns ``alive`` false."""
        got = []
        while self._dead is None:
            try:
                if not self._out.poll(0):
                    break
                msg = self._out.recv()
            except (EOFError, OSError):
                self._dead = f"engine process exited (code {self.proc.exitcode})"
                break
            if msg[0] == "step_error":
                self.last_msg_time = time.monotonic()
                self._pending_error = msg[1]
                break
            item = self._apply(msg)
            if item is not None:
                got.append(item)
        return got

    def take_error(self) -> Optional[str]:
        """The failed step's message that stopped the last ``read_ready()``, once."""
        e, self._pending_error = self._pending_error, None
        return e

    def _apply(self, msg):
        """One child message -> (outputs, step seconds), or None (a snapshot)."""
        self.last_msg_time = time.monotonic()
        kind = msg[0]
        if kind == "snapshot":
            self._snap = msg[1]
            return None
        if kind != "outs":
            return None
        _, packed, snap, dt = msg
        if snap is not None:
            self._snap = snap
        outs = []
        with self._lock:
            for rid, toks, text, finished, reason, state in packed:
                seq = self.seqs.get(rid)
                if seq is None:
                    continue
                seq.num_output += len(toks)
                if state is not None:
                    if "error" in state:  # refused by the child (a race the parent could not see)
                        del self.seqs[rid]
                        outs.append(RequestOutput(rid, [], "", True, "cancelled", seq))
                        continue
                    seq.__dict__.update(state)  # the child's figures (num_output included) win
                if finished:
                    del self.seqs[rid]
                outs.append(RequestOutput(rid, toks, text, finished, reason, seq))
        return outs, dt

    def kv_blocks_used(self) -> tuple:
        return tuple(self._snap.get("kv_used", (0, 0)))

    @property
    def stats(self) -> SpecStats:
        return self._snap.get("stats") or SpecStats()

    @property
    def num_steps(self) -> int:
        return self._snap.get("steps", 0)

    def prefix_cache_stats(self) -> dict:
        return self._snap.get("prefix", {"query_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0, "evictions": 0})

    def refresh(self, timeout_s: float = 5.0) -> dict:
        """Ask the child for a state snapshot now (tests); returns it once the relay has applied it."""
        before = self._snap
        self._send(("snapshot",))
        end = time.monotonic() + timeout_s
        while self._snap is before and time.monotonic() < end and self.alive:
            if not self.reader_attached and not self.has_work() and self._out.poll(0.05):
                self._apply(self._out.recv())  # nobody else reads the pipe: read it here
            time.sleep(0.01)
        return self._snap

    # lifecycle -----------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._send(("stop",))
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        for c in (self._cmd, self._out):
            try:
                c.close()
            except OSError:
                pass


if __name__ == "__main__":
    _child_entry(int(sys.argv[1]), int(sys.argv[2]))
