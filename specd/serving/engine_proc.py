"""The engine in its own process: ``ProcessLink``, the ``EngineLink`` of ``specd serve``'s default.

Why: an ``Engine`` stepping in a thread of the server process shares the GIL with the event loop that
streams its tokens. On a small model a step is mostly Python, so every frame the loop sends is time
the engine cannot step. In its own process the engine steps on its own core; the server process
only relays outputs.

Shape: the child (``python -m specd.serving.engine_proc CMD_FD OUT_FD``) loads the models, warms up,
sends its ``EngineLimits``, then runs ``specd.engine.loop.EngineLoop`` (the same loop as in a thread)
with the command pipe as its inlet and the output pipe as its outlet. Commands are the link's
(``add`` / ``abort`` / ``snapshot`` / ``stop``) pickled as they are. Each batch travels as one
message ``("outs", steps, snapshot, errors, refused)`` (``"state"`` when it has no steps), each step
a list of ``(request_id, token_ids, text, finished, finish_reason, state)`` with the request's state
(timestamps, counters, speculation stats) on its first token and at its end; ``ProcessLink`` turns
them back into ``RequestOutput``s whose ``seq`` is a ``RemoteSeq`` with those figures. The server
validates requests itself (``EngineLimits.validate``) and tokenizes with its own tokenizer.

The event loop reads the pipe (``loop.add_reader``): no relay thread. A child that dies fails every
running request (``internal``) and turns the link's ``alive`` false, which ``/healthz`` and the
systemd watchdog report. The child ignores SIGINT (a terminal's Ctrl-C reaches the whole process
group; the parent drains first) and exits when told to or when the parent's end of the pipe closes.
"""

from __future__ import annotations

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
from collections.abc import Callable
from pathlib import Path

from specd.engine.client import Batch, EngineLimits, limits_of
from specd.engine.engine import RequestOutput
from specd.engine.loop import DEFAULT_STREAM_INTERVAL_S, EngineLoop, HandOff
from specd.engine.sequence import SpecStats
from specd.model.loader import LoadError, load_tokenizer

log = logging.getLogger("specd.engine_proc")

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
    "cached_prefix_tokens",
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
        return bool(self._poll.poll(ms))

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
class _PipeInlet:
    """The command pipe as the engine loop's inlet."""

    def __init__(self, pipe: Pipe):
        self.pipe = pipe

    @property
    def closed(self) -> bool:
        return self.pipe.eof  # the parent is gone

    def wait(self, timeout: float) -> None:
        self.pipe.wait(timeout)

    def take(self) -> list:
        return self.pipe.read()


def _seq_state(seq) -> dict:
    d = {k: getattr(seq, k) for k in _SEQ_FIELDS}
    d["stats"] = seq.stats
    return d


def pack_outputs(outs: list) -> list:
    """A step's outputs as picklable tuples, with the request's state on its first token and at its end."""
    packed = []
    for o in outs:
        seq = o.seq
        first = bool(o.token_ids) and seq.num_output == len(o.token_ids)
        state = _seq_state(seq) if o.finished or first else None
        packed.append((o.request_id, o.token_ids, o.text, o.finished, o.finish_reason, state, o.logprobs))
    return packed


def _send(conn: Pipe, msg) -> bool:
    try:
        conn.send(msg)
        return True
    except OSError:  # the parent is gone (BrokenPipeError)
        return False


def _encode(batch: Batch) -> tuple:
    return ("outs" if batch.steps else "state", batch.steps, batch.snapshot, batch.errors, batch.refused)


def _load(cfg, out_conn: Pipe):
    """Build and warm up the engine; None (after telling the parent why) when that fails."""
    import torch

    from specd.engine.engine import Engine
    from specd.engine.warmup import warm_up
    from specd.model.cpu import set_threads

    set_threads(cfg.threads)
    try:
        eng = Engine(cfg)
        warm_up(eng)
    except LoadError as e:
        out_conn.send(("load_error", str(e)))
        return None
    except BaseException as e:  # noqa: BLE001 - report, then exit
        out_conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return None
    out_conn.send(("ready", limits_of(eng, torch.get_num_threads())))
    return eng


def _child_main(cfg, cmd_conn: Pipe, out_conn: Pipe, log_level: int, interval_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from specd.serving.logs import setup_logging

    setup_logging(logging.getLevelName(log_level))  # the server's JSON lines, on the same stderr
    eng = _load(cfg, out_conn)
    if eng is None:
        return
    EngineLoop(eng, _PipeInlet(cmd_conn), lambda b: _send(out_conn, _encode(b)), interval_s, pack_outputs).run()


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
    """What the servers read of a request running in the engine process, as the child reported it."""

    def __init__(self, rid: str, num_prompt: int, priority: str, spec, arrival: float):
        self.request_id = rid
        self.num_prompt = num_prompt
        self.num_output = 0
        self.priority = priority
        self.spec = spec
        self.arrival = arrival
        self.scheduled_time = self.first_token_time = self.finish_time = None
        self.num_preemptions = 0
        self.cached_prefix_tokens = 0
        self.finish_reason = None
        self.error = None
        self.stats = SpecStats()


class ProcessLink:
    """``EngineLink`` to an engine process. Construct (blocks until the models are loaded and warmed
    up; raises ``LoadError``), hand to ``AsyncEngine``, which ``close()``s it when it stops."""

    relaying = True
    engine = None  # (no Engine in this process)

    def __init__(
        self,
        cfg,
        load_timeout_s: float | None = None,
        split_cpus: bool = False,
        stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S,
    ):
        HandOff(stream_interval_s)  # (validates)
        # a fresh interpreter, not multiprocessing's spawn: that re-imports the parent's __main__,
        # which need not be import-safe
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specd.serving.engine_proc", str(cmd_r), str(out_w)],
            pass_fds=(cmd_r, out_w),
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
        os.close(cmd_r)
        os.close(out_w)
        if split_cpus:  # (the daemon; not for a library user's process)
            _split_cpus(self.proc.pid)
        self._cmd = Pipe(cmd_w, reader=False)
        self._out = Pipe(out_r, reader=True)
        self._send_lock = threading.Lock()
        self._seqs: dict[str, RemoteSeq] = {}  # requests sent and not finished (event loop)
        self._loop = None
        self._deliver: Callable[[Batch], None] | None = None
        self._died: Callable[[str], None] | None = None
        self._dead: str | None = None
        self._cmd.send((cfg, logging.getLogger().level, stream_interval_s))
        self.limits = self._handshake(load_timeout_s)
        try:
            self._tokenizer = load_tokenizer(Path(cfg.target))
        except BaseException:
            self.close()
            raise

    def _handshake(self, timeout: float | None) -> EngineLimits:
        end = None if timeout is None else time.monotonic() + timeout
        got: list = []
        while not got:
            if self._out.wait(0.2):
                got = self._out.read()
            if not got and (self._out.eof or self.proc.poll() is not None):
                self.close()
                raise LoadError(f"engine process failed to start: it exited (code {self.proc.poll()})")
            if not got and end is not None and time.monotonic() > end:
                self.close()
                raise LoadError("engine process failed to start: timed out waiting for it")
        kind, info = got[0]
        if kind != "ready":
            self.close()
            raise LoadError(info)
        return info

    # EngineLink ----------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fileno(self) -> int:
        """The pipe the child writes to (readable when ``read_raw()`` has something)."""
        return self._out.fileno()

    @property
    def alive(self) -> bool:
        return self._dead is None and self.proc.poll() is None

    def validate(self, prompt_ids: list, params) -> None:
        self.limits.validate(prompt_ids, params)

    def start(self, loop, deliver: Callable[[Batch], None], died: Callable[[str], None]) -> None:
        self._loop, self._deliver, self._died = loop, deliver, died
        loop.add_reader(self._out.fileno(), self._on_readable)

    def send(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, ids, _params, spec, priority, _tenant = cmd
            self._seqs[rid] = RemoteSeq(rid, len(ids), priority, spec, time.monotonic())
        try:
            with self._send_lock:
                self._cmd.send(cmd)
        except (BrokenPipeError, OSError) as e:
            self._dead = self._dead or f"engine process unreachable: {e}"

    def wake(self) -> None:
        """(A command wakes the child; there is nothing else to wake.)"""

    def detach(self) -> None:
        """Stop delivering batches (on the event loop, before ``close``)."""
        self._stop_reading()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the child and close the pipes (blocking: call it off the event loop, after ``detach``)."""
        try:
            with self._send_lock:
                self._cmd.send(("stop",))
        except OSError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        for c in (self._cmd, self._out):
            c.close()

    # the pipe ------------------------------------------------------------------------------------
    def read_raw(self) -> list:
        """Every message the child has sent so far, undecoded, without blocking (tests read the
        wire with it); ``eof`` on the pipe once the child is gone."""
        try:
            return self._out.read()
        except OSError:
            self._out.eof = True
            return []

    def decode(self, msg: tuple) -> Batch | None:
        """One child message as a ``Batch`` (None for other kinds)."""
        kind, steps, snap, errors, refused = msg if len(msg) == 5 else (msg[0], None, None, None, None)
        if kind not in ("outs", "state"):
            return None
        for rid, *_ in refused:
            self._seqs.pop(rid, None)
        return Batch([(self._outputs(packed), dt) for packed, dt in steps], snap, errors, refused)

    def _outputs(self, packed: list) -> list:
        outs = []
        for rid, toks, text, finished, reason, state, lps in packed:
            seq = self._seqs.get(rid)
            if seq is None:
                continue
            seq.num_output += len(toks)
            if state is not None:
                seq.__dict__.update(state)  # the child's figures (num_output included) win
            if finished:
                del self._seqs[rid]
            err = seq.error if reason == "error" else None
            outs.append(RequestOutput(rid, toks, text, finished, reason, seq, err, lps))
        return outs

    def _on_readable(self) -> None:
        msgs = self.read_raw()
        for msg in msgs:
            b = self.decode(msg)
            if b is not None:
                self._deliver(b)
        # (end of file arrives as a read with no messages: only then ask about the process)
        if not msgs and (self._out.eof or self.proc.poll() is not None):
            self._stop_reading()
            self._dead = self._dead or f"engine process died (exit code {self.proc.poll()})"
            self._seqs.clear()
            self._died(self._dead)

    def _stop_reading(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            try:
                loop.remove_reader(self._out.fileno())
            except (OSError, ValueError, RuntimeError):
                pass


if __name__ == "__main__":
    _child_entry(int(sys.argv[1]), int(sys.argv[2]))
