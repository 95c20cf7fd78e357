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
outputs (a pickled list of steps, each with its duration: one step, or a few sub-millisecond ones
when ``HandOff`` holds them, see ``--stream-interval-ms``) plus, at most every 50 ms and whenever
it goes idle, a snapshot of the state ``/metrics`` reports. A child that has work and sends nothing for the watchdog
timeout is stuck.

Lifecycle: the child ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the
parent drains first) and exits when told to or when the parent's end of the pipe closes (the
parent died). A child that dies fails every running request (``internal``) and turns ``alive``
false, which ``/healthz`` and the systemd watchdog report.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from specd.engine.engine import RequestError, RequestOutput, validate_request
from specd.engine.health import RateLimitedLog, backoff_s
from specd.engine.sequence import SpecStats
from specd.model.loader import LoadError, load_tokenizer
from specd.serving.engine_loop import DEFAULT_STREAM_INTERVAL_S, HandOff

log = logging.getLogger("specd.engine_proc")

SNAPSHOT_EVERY_S = 0.05
_SEQ_FIELDS = (
    "priority",
    "spec",
    "num_prompt",
    "num_output",
    "arrival",
    "scheduled_time",
    "first_token_time",
    "finish_time",
    "num_preemptions",
    "finish_reason",
    "error",
)


class Pipe:
    """One direction of an OS pipe carrying pickled messages as length-prefixed frames.

    Why not ``multiprocessing.connection``: its ``poll()`` builds a selector on every call (~10 us),
    which sat on the engine's step path (checking for commands) and on the server's per-message path.
    Here the reading end is non-blocking with one ``select.poll`` object registered once: ``read()``
    takes whatever has arrived and returns every complete message; ``wait()`` blocks for more.
    The writing end blocks while the pipe is full (a stalled reader holds the writer back)."""

    _HDR = struct.Struct("<I")

    def __init__(self, fd: int, reader: bool):
        self.fd = fd
        self.eof = False
        self._buf = bytearray()
        self._poll = None
        if reader:
            os.set_blocking(fd, False)
            self._poll = select.poll()
            self._poll.register(fd, select.POLLIN)

    def fileno(self) -> int:
        return self.fd

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(self._HDR.pack(len(data)) + data)
        while view:
            view = view[os.write(self.fd, view) :]

    def wait(self, timeout: float | None) -> bool:
        """Block up to ``timeout`` seconds (None: no limit) until data or end of file is readable."""
        ms = None if timeout is None else max(0, int(timeout * 1000))
        while True:
            try:
                return bool(self._poll.poll(ms))
            except InterruptedError:  # (PEP 475 retries; kept for clarity)
                continue

    def read(self) -> list:
        """Every complete message that has arrived, without blocking. ``eof`` turns true once the
        writing end is closed (the messages before it are still returned)."""
        while not self.eof and self._poll.poll(0):  # (a poll is ~10x cheaper than a read that fails)
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                break
            self._buf += chunk
            if len(chunk) < 1 << 16:  # drained for now (a later write makes the fd readable again)
                break
        out, buf, pos, hdr = [], self._buf, 0, self._HDR
        while len(buf) - pos >= hdr.size:
            n = hdr.unpack_from(buf, pos)[0]
            end = pos + hdr.size + n
            if end > len(buf):
                break
            out.append(pickle.loads(buf[pos + hdr.size : end]))
            pos = end
        if pos:
            del buf[:pos]
        return out

    def close(self) -> None:
        """Idempotent (a closed descriptor's number may be reused by then: never close it twice)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


# child ---------------------------------------------------------------------------------------------
def _snapshot(eng) -> dict:
    sch = eng.scheduler
    return {
        "running": [(s.request_id, s.priority) for s in sch.running],
        "waiting": sch.queue_lengths(),
        "kv_used": eng.kv_blocks_used(),
        "stats": eng.stats,
        "preemptions": sch.num_preemptions,
        "spec_budget": sch.last_spec_budget,
        "depth": sch.last_depth,
        "prefix": eng.prefix_cache_stats(),
        "steps": eng.num_steps,
        "health": eng.health_snapshot(),
    }


def _seq_state(seq) -> dict:
    d = {k: getattr(seq, k) for k in _SEQ_FIELDS}
    d["stats"] = seq.stats
    return d


def _child_main(cfg, cmd_conn, out_conn, log_level: int, interval_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from specd.engine.warmup import warm_up
    from specd.serving.logs import setup_logging

    setup_logging(logging.getLevelName(log_level))  # the server's JSON lines, on the same stderr
    import torch

    from specd.engine.engine import Engine
    from specd.model.cpu import set_threads

    set_threads(cfg.threads)
    try:
        eng = Engine(cfg)
        warm_up(eng)
    except LoadError as e:
        out_conn.send(("load_error", str(e)))
        return
    except BaseException as e:  # noqa: BLE001 - report, then exit
        out_conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    out_conn.send(
        (
            "ready",
            {
                "max_model_len": eng.max_model_len,
                "block_size": eng.cache.block_size,
                "num_blocks": eng.cache.pool.num_blocks,
                "draft_num_blocks": eng.draft_cache.pool.num_blocks if eng.draft_cache is not None else None,
                "vocab_size": eng.vocab_size,
                "has_draft": eng.drafter is not None,
                "threads": torch.get_num_threads(),
            },
        )
    )
    first_sent: set = set()
    last_snap = 0.0
    failures = 0  # exceptions that escaped Engine.step() in a row
    errlog = RateLimitedLog(log)
    hand = HandOff(interval_s)
    held: list = []  # [(packed outputs, step seconds)] of steps not sent yet (see HandOff)

    def flush() -> bool:
        nonlocal last_snap
        if not held:
            return True
        now = time.monotonic()
        snap = None
        if now - last_snap >= SNAPSHOT_EVERY_S or not eng.has_work():
            snap, last_snap = _snapshot(eng), now
        ok = _send(out_conn, ("outs", list(held), snap))
        held.clear()
        return ok

    while True:
        idle = not eng.has_work()
        # block for commands only while idle; otherwise take what is there and step
        if idle:
            if not flush():
                return
            cmd_conn.wait(0.5)
        cmds = cmd_conn.read()
        for cmd in cmds:
            op = cmd[0]
            if op == "add":
                _, rid, ids, p, spec, prio = cmd
                try:
                    eng.add_request(ids, p, spec, prio, rid)
                except (RequestError, ValueError) as e:  # the parent validated: only races land here
                    code = getattr(e, "code", "invalid_request")
                    held.append(([(rid, [], "", True, "error", {"refused": (code, str(e))})], 0.0))
            elif op == "abort":
                eng.abort(cmd[1])
            elif op == "snapshot":
                if not flush() or not _send(out_conn, ("snapshot", _snapshot(eng))):
                    return
            elif op == "stop":
                flush()
                return
        if cmd_conn.eof:  # the parent is gone
            return
        if (cmds or eng.num_waiting or not eng.has_work()) and not flush():  # new work may mean a long step
            return
        if not eng.has_work():
            continue
        t_step = time.monotonic()
        try:
            outs = eng.step()
        except Exception as e:  # noqa: BLE001 - a bug outside the engine's stage isolation
            failures += 1
            errlog.error(type(e).__name__, "engine step failed: %s: %s", type(e).__name__, e, exc_info=e)
            if not flush() or not _send(out_conn, ("step_error", f"{type(e).__name__}: {e}")):
                return
            outs = eng.fail_all(e)
        else:
            failures = 0
        wait = backoff_s(max(failures, eng.health.consecutive_failed))
        packed, urgent = _pack(outs, first_sent)
        now = time.monotonic()
        if packed:
            held.append((packed, now - t_step))
        steady = eng.has_work() and not eng.num_waiting
        if (not packed or wait or hand.now(now, now - t_step, urgent, steady)) and not flush():
            return
        if wait:  # steps keep failing: tell the parent (its health follows), back off, never spin
            if not _send(out_conn, ("snapshot", _snapshot(eng))):
                return
            cmd_conn.wait(wait)


def _pack(outs: list, first_sent: set) -> tuple:
    """A step's outputs as picklable tuples, with the request's state on its first token and at its
    end (``first_sent``: requests whose first token went already); ``urgent`` when any carries it."""
    packed, urgent = [], False
    for o in outs:
        seq = o.seq
        state = None
        if o.finished:
            state = _seq_state(seq)
            first_sent.discard(o.request_id)
        elif o.request_id not in first_sent and seq.first_token_time is not None:
            state = _seq_state(seq)
            first_sent.add(o.request_id)
        urgent = urgent or state is not None
        packed.append((o.request_id, o.token_ids, o.text, o.finished, o.finish_reason, state))
    return packed, urgent


def _send(conn: Pipe, msg) -> bool:
    try:
        conn.send(msg)
        return True
    except OSError:  # the parent is gone (BrokenPipeError)
        return False


def _child_entry(cmd_fd: int, out_fd: int) -> None:
    cmd_conn = Pipe(cmd_fd, reader=True)
    out_conn = Pipe(out_fd, reader=False)
    first: list = []
    while not first and not cmd_conn.eof:
        cmd_conn.wait(None)
        first = cmd_conn.read()
    if not first:
        return
    cfg, log_level, interval_s = first[0]
    _child_main(cfg, cmd_conn, out_conn, log_level, interval_s)


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
        self.error = None
        self.stats = SpecStats()


class _SchedulerView:
    def __init__(self, eng: RemoteEngine):
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

    def __init__(
        self,
        cfg,
        load_timeout_s: float | None = None,
        split_cpus: bool = False,
        stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S,
    ):
        HandOff(stream_interval_s)  # (validates)
        # a fresh interpreter (`python -m specd.serving.engine_proc FD FD`), not multiprocessing's
        # spawn: that re-imports the parent's __main__, which need not be import-safe
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        self.proc = _Proc(
            subprocess.Popen(
                [sys.executable, "-m", "specd.serving.engine_proc", str(cmd_r), str(out_w)],
                pass_fds=(cmd_r, out_w),
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        )
        os.close(cmd_r)
        os.close(out_w)
        if split_cpus:  # (the daemon; not for a library user's process)
            _split_cpus(self.proc.pid)
        self._cmd = Pipe(cmd_w, reader=False)
        self._out = Pipe(out_r, reader=True)
        self._inbox: collections.deque = collections.deque()  # read from the pipe, not yet applied
        self._cmd.send((cfg, logging.getLogger().level, stream_interval_s))
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards seqs (AsyncEngine reads it under this lock)
        self.seqs: dict[str, RemoteSeq] = {}
        self._snap: dict = {}
        self._dead: str | None = None
        self._pending_error: str | None = None
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
        self.draft_cache = (
            SimpleNamespace(pool=SimpleNamespace(num_blocks=info["draft_num_blocks"]))
            if info["draft_num_blocks"] is not None
            else None
        )
        self.drafter = True if info["has_draft"] else None
        self.scheduler = _SchedulerView(self)

    def _take(self) -> bool:
        """Move whatever the child has written into the inbox; False once nothing more can come."""
        try:
            self._inbox.extend(self._out.read())
        except OSError:
            self._out.eof = True
        return not self._out.eof

    def _recv_until(self, timeout: float | None):
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._inbox:
                return self._inbox.popleft()
            if self._out.wait(0.2):
                self._take()
                if self._inbox:
                    continue
            if self._out.eof or not self.proc.is_alive():
                self._take()
                if self._inbox:
                    continue
                self.proc.join(1.0)
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
        validate_request(
            prompt_ids, params, self.max_model_len, self.cache.block_size, self.cache.pool.num_blocks, self.vocab_size
        )

    def add_request(self, prompt_ids, params, spec, priority: str = "interactive", request_id: str | None = None):
        from specd.engine.sequence import PRIORITIES

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
        seconds)``. A failed step stops the read (``take_error()`` returns it; ``has_buffered()``
        says whether messages after it wait for the next call); a child that is gone turns
        ``alive`` false."""
        got = []
        inbox = self._inbox
        if self._dead is None and not self._take() and not inbox:
            self._dead = f"engine process exited (code {self.proc.exitcode})"
        while inbox:
            msg = inbox.popleft()
            if msg[0] == "step_error":
                self.last_msg_time = time.monotonic()
                self._pending_error = msg[1]
                break
            got += self._apply(msg)
        return got

    def has_buffered(self) -> bool:
        """Messages already read from the pipe but not returned yet (those after a failed step)."""
        return bool(self._inbox)

    def take_error(self) -> str | None:
        """The failed step's message that stopped the last ``read_ready()``, once."""
        e, self._pending_error = self._pending_error, None
        return e

    def _apply(self, msg) -> list:
        """One child message -> its steps as [(outputs, step seconds)] (none for a snapshot)."""
        self.last_msg_time = time.monotonic()
        kind = msg[0]
        if kind == "snapshot":
            self._snap = msg[1]
            return []
        if kind != "outs":
            return []
        _, steps, snap = msg
        if snap is not None:
            self._snap = snap
        items = []
        with self._lock:
            for packed, dt in steps:
                outs = []
                for rid, toks, text, finished, reason, state in packed:
                    seq = self.seqs.get(rid)
                    if seq is None:
                        continue
                    seq.num_output += len(toks)
                    if state is not None:
                        if "refused" in state:  # refused by the child (a race the parent could not see)
                            del self.seqs[rid]
                            outs.append(RequestOutput(rid, [], "", True, "cancelled", seq))
                            continue
                        seq.__dict__.update(state)  # the child's figures (num_output included) win
                    if finished:
                        del self.seqs[rid]
                    outs.append(
                        RequestOutput(rid, toks, text, finished, reason, seq, seq.error if reason == "error" else None)
                    )
                items.append((outs, dt))
        return items

    def kv_blocks_used(self) -> tuple:
        return tuple(self._snap.get("kv_used", (0, 0)))

    def health_snapshot(self) -> dict | None:
        """The child's ``EngineHealth.snapshot()`` as of its last state snapshot (None before one)."""
        return self._snap.get("health")

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
            if not self.reader_attached and not self.has_work() and self._out.wait(0.05):
                self._take()  # nobody else reads the pipe: read it here
                while self._inbox:
                    self._apply(self._inbox.popleft())
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
