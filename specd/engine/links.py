"""The two ``EngineLink``s: where the engine loop runs and how its commands and batches travel.

Both run the one ``specd.engine.loop.EngineLoop`` and exchange the typed messages of
``specd.engine.commands`` (``Submit`` / ``Cancel`` / ``Snapshot`` / ``Stop`` in, ``Batch``es out):

- ``ThreadLink``: the engine steps in a thread of this process (``specd serve --engine-thread``,
  tests). Commands go through a ``CommandQueue``; batches reach the event loop in ONE
  ``call_soon_threadsafe`` per hand-off (while the loop has not taken the previous hand-off yet, the
  next batch joins it: no second wake-up). Outputs are the engine's own ``RequestOutput``s.
- ``ProcessLink``: the engine steps in its own process (the default of ``specd serve``). An
  ``Engine`` stepping in a thread of the server process shares the GIL with the event loop that
  streams its tokens; on a small model a step is mostly Python, so every frame the loop sends is
  time the engine cannot step. In its own process the engine steps on its own core and the server
  process only relays outputs.

The process link's wire: two OS pipes (``Pipe``: pickled messages in length-prefixed frames). The
parent sends ``Start`` (the ``EngineConfig``, log level, stream interval), waits for ``Ready`` (the
child's ``EngineLimits``, after loading and warming up) or ``LoadFailed``, then sends commands as
they are. The child sends each ``Batch`` as builtins (``encode_batch``; pickling a dataclass per
output would cost 1-2 us each on the engine's step path): ``(steps, snapshot, errors, refused)``,
each step ``(records, seconds)``, each record a ``RequestOutput``'s fields in ``RECORD`` order with
the request's ``SeqState`` (timestamps, counters, speculation stats) on its first token and at its
end. ``ProcessLink.decode`` turns it back into a ``Batch`` of ``RequestOutput``s whose ``seq`` is a
``RemoteSeq`` with those figures; the two ends of the encoding are ``pack_outputs`` /
``encode_batch`` and ``decode`` / ``_outputs`` here, and nowhere else. The server validates
requests itself (``EngineLimits.validate``) and tokenizes with its own tokenizer. The event loop
reads the pipe (``loop.add_reader``): no relay thread. A child that dies fails every running request
(``internal``) and turns ``alive`` false, which ``/healthz`` and the systemd watchdog report. The
child ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the parent drains first)
and exits when told to or when the parent's end of the pipe closes.

The child is ``python -m <entry> CMD_FD OUT_FD`` running ``serve_child``: ``specd.engine.links``
itself (plain log lines) or a module that sets up its own logs (``specd.serving.engine_proc``).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
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
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from specd.engine.client import limits_of
from specd.engine.commands import (
    SEQ_FIELDS,
    Batch,
    CheckGrammar,
    Command,
    EngineLimits,
    LoadFailed,
    Ready,
    SeqState,
    Start,
    Step,
    Stop,
    Submit,
)
from specd.engine.loop import DEFAULT_STREAM_INTERVAL_S, EngineLoop, HandOff
from specd.engine.output import RequestOutput
from specd.engine.requests import RequestError
from specd.engine.sequence import SpecStats
from specd.engine.spawn import Spawned, spawn
from specd.model.errors import LoadError
from specd.model.tokenizer_load import load_tokenizer

log = logging.getLogger("specd.engine_link")

__all__ = [
    "CommandQueue",
    "Pipe",
    "ProcessLink",
    "RECORD",
    "RemoteSeq",
    "ThreadLink",
    "encode_batch",
    "pack_outputs",
    "serve_child",
]

CHILD_ENTRY = "specd.engine.links"  # ``python -m`` this: serve_child with plain log lines


# a thread ------------------------------------------------------------------------------------------
class CommandQueue:
    """The loop's inlet in a thread: ``put`` from any thread, ``take`` / ``wait`` on the loop's."""

    def __init__(self):
        self._items: list = []
        self._lock = threading.Lock()
        self._event = threading.Event()
        self.closed = False

    def put(self, cmd: Command) -> None:
        with self._lock:
            self._items.append(cmd)
        self._event.set()

    def wake(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)

    def take(self) -> list:
        with self._lock:
            items, self._items = self._items, []
            self._event.clear()
        return items

    def close(self) -> None:
        self.closed = True
        self._event.set()


class ThreadLink:
    """``EngineLink`` to the engine loop in a thread of this process (see the module docstring)."""

    relaying = False

    def __init__(self, engine, stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S, idle=None):
        HandOff(stream_interval_s)  # (validates)
        self.engine = engine
        self.interval = stream_interval_s
        self.idle = idle  # the loop's idle work (``EngineLoop(idle=...)``: the warm-up's row timings)
        self.inlet = CommandQueue()
        self.thread: threading.Thread | None = None
        self._outbox: list = []
        self._lock = threading.Lock()
        self._posted = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Callable[[Batch], None] = lambda batch: None
        self._died: Callable[[str], None] = lambda msg: None
        self._limits: EngineLimits | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def limits(self) -> EngineLimits:
        if self._limits is None:
            self._limits = limits_of(self.engine)
        return self._limits

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def grammar_compiler(self):
        """The engine's own ``GrammarCompiler`` (one cache: a grammar the server compiled to check it
        is ready when the engine asks for it). Blocking the first time (the vocabulary is built)."""
        return self.engine.constraints.compiler

    def start(
        self, loop: asyncio.AbstractEventLoop, deliver: Callable[[Batch], None], died: Callable[[str], None]
    ) -> None:
        self._loop, self._deliver, self._died = loop, deliver, died
        self.thread = threading.Thread(target=self._run, name="specd-engine", daemon=True)
        self.thread.start()

    def send(self, cmd: Command) -> None:
        self.inlet.put(cmd)

    def wake(self) -> None:
        self.inlet.wake()

    def detach(self) -> None:
        """Stop delivering batches (on the event loop, before ``close``)."""
        self._deliver = lambda batch: None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop and wait for the thread (blocking: call it off the event loop)."""
        self.inlet.close()
        t = self.thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout_s)

    def _run(self) -> None:
        try:
            EngineLoop(self.engine, self.inlet, self._outlet, self.interval, idle=self.idle).run()
        except BaseException as e:  # noqa: BLE001 - the thread is dying: fail everyone, don't hang them
            log.critical("engine thread died", exc_info=True)
            self._post(self._died, f"engine thread died: {type(e).__name__}: {e}")
            raise

    def _outlet(self, batch: Batch) -> bool:
        with self._lock:
            self._outbox.append(batch)
            wake = not self._posted
            self._posted = True
        if wake:
            self._post(self._take, None)
        return True

    def _take(self, _) -> None:
        with self._lock:
            batches, self._outbox = self._outbox, []
            self._posted = False
        for b in batches:
            self._deliver(b)

    def _post(self, fn: Callable, arg) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed (shutdown)
            pass


# the pipe ------------------------------------------------------------------------------------------
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
        self._poll: Any = None  # a select.poll for the reading end
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


# the child -----------------------------------------------------------------------------------------
class PipeInlet:
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


# a RequestOutput on the wire: these fields in this order (state: a SeqState on the first token and at the end)
RECORD = ("request_id", "token_ids", "text", "finished", "finish_reason", "state", "logprobs")


def pack_outputs(outs: list) -> list:
    """A step's ``RequestOutput``s as wire records (``RECORD``), with the request's ``SeqState`` on
    its first token and at its end (the engine loop's ``pack``, as each step ends)."""
    packed = []
    for o in outs:
        seq = o.seq
        first = bool(o.token_ids) and seq.num_output == len(o.token_ids)
        state = SeqState.of(seq) if o.finished or first else None
        packed.append((o.request_id, o.token_ids, o.text, o.finished, o.finish_reason, state, o.logprobs))
    return packed


def encode_batch(b: Batch) -> tuple:
    """A ``Batch`` (its steps' outputs already packed) as the wire's builtins."""
    return ([(s.outputs, s.seconds) for s in b.steps], b.snapshot, b.errors, b.refused, b.checked)


def _send(conn: Pipe, msg) -> bool:
    try:
        conn.send(msg)
        return True
    except OSError:  # the parent is gone (BrokenPipeError)
        return False


def _load(cfg, out: Pipe) -> tuple:
    """Build and warm up the engine: ``(engine, the warm-up's idle work or None)``; ``(None, None)``
    (after telling the parent why) when that fails. The row timings that seed the cost model run
    after ``Ready``, while the engine is idle (``warm_up(defer=True)``), or not at all where a
    previous start measured them for this model and CPU (``CostCache``)."""
    import torch

    from specd.engine.engine import Engine
    from specd.engine.warmup import CostCache, warm_up
    from specd.model.cpu import set_threads

    set_threads(cfg.threads)
    try:
        eng = Engine(cfg)
        seeding = warm_up(eng, defer=True, cache=CostCache.for_engine(eng, cfg.target))
    except LoadError as e:
        out.send(LoadFailed(str(e)))
        return None, None
    except BaseException as e:  # noqa: BLE001 - report, then exit
        out.send(LoadFailed(f"{type(e).__name__}: {e}"))
        return None, None
    out.send(Ready(limits_of(eng, torch.get_num_threads())))
    return eng, seeding


def _plain_logs(level: int) -> None:
    logging.basicConfig(level=level, stream=sys.stderr)


def settle_heap() -> int:
    """Move every object alive now (the modules, the loaded models' tensors and their Python wrappers: ~370k
    objects at 1.7B) to the collector's permanent generation: they live as long as the engine process, and a
    full collection walking them stalled the engine loop (~220 ms at 1.7B, about once a minute of serving 4
    requests at a time). Returns how many objects are frozen."""
    gc.freeze()
    return gc.get_freeze_count()


def serve_child(cmd_fd: int, out_fd: int, setup_logging: Callable[[int], None] = _plain_logs) -> None:
    """The engine process: wait for ``Start``, set up logging (``setup_logging(level)``), load the
    models, answer ``Ready`` (or ``LoadFailed``), then run the engine loop on the pipes."""
    cmd, out = Pipe(cmd_fd, reader=True), Pipe(out_fd, reader=False)
    first: list = []
    while not first and not cmd.eof:
        cmd.wait(None)
        first = cmd.read()
    if not first or not isinstance(first[0], Start):
        return
    start = first[0]  # (the parent sends nothing else before Ready)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(start.log_level)
    eng, seeding = _load(start.cfg, out)
    if eng is None:
        return
    settle_heap()
    outlet = lambda b: _send(out, encode_batch(b))  # noqa: E731
    idle = seeding.step if seeding is not None else None
    EngineLoop(eng, PipeInlet(cmd), outlet, start.stream_interval_s, pack_outputs, idle=idle).run()


# the parent ----------------------------------------------------------------------------------------
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

    def __init__(self, req: Submit, arrival: float):
        self.request_id = req.request_id
        self.num_prompt = len(req.prompt_ids)
        self.num_output = 0
        self.priority = req.priority
        self.spec = req.spec
        self.arrival = arrival
        self.scheduled_time = self.first_token_time = self.finish_time = None
        self.num_preemptions = 0
        self.cached_prefix_tokens = 0
        self.finish_reason = None
        self.error = None
        self.stats = SpecStats()

    def update(self, state: SeqState) -> None:
        """The child's figures (``num_output`` included) win."""
        for k in SEQ_FIELDS:
            setattr(self, k, getattr(state, k))


class RemoteGrammars:
    """The engine process's grammar compiler seen from the server: ``submit(spec)`` sends a
    ``CheckGrammar`` and returns a future that the answer (``GrammarChecked``, in a batch) settles:
    None when the grammar compiled, else the ``GrammarError`` (a ``RequestError`` when the engine
    could not check it: no tokenizer, or the engine process died)."""

    def __init__(self, send: Callable[[Command], None], dead: Callable[[], str | None] = lambda: None):
        self._send = send
        self._dead = dead  # why the engine process cannot answer (None while it can)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}

    def submit(self, spec) -> Future:
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            cid = next(self._ids)
            self._pending[cid] = fut
        self._send(CheckGrammar(cid, spec))
        why = self._dead()
        if why is not None:  # (sent to a process that is gone, or the pipe broke: nobody will answer)
            self.fail_all(why)
        return fut

    def answered(self, checked: list) -> None:
        """Settle the futures of these ``GrammarChecked`` answers."""
        from specd.structured import GrammarError
        from specd.structured.errors import CODES

        for c in checked:
            with self._lock:
                fut = self._pending.pop(c.check_id, None)
            if fut is None:
                continue
            if c.code is None:
                fut.set_result(None)
            elif c.code in CODES:
                fut.set_exception(GrammarError(c.code, c.message, c.field))
            else:
                fut.set_exception(RequestError(c.code, c.message))

    def fail_all(self, why: str, code: str = "internal") -> None:
        """Nobody will answer (the engine process is gone, or the link is detached): every check
        waiting fails with ``code``."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(RequestError(code, why))


def _on_thread(fn, *args) -> Future:
    """``fn(*args)`` on a daemon thread (a failed start need not wait for it): its future."""
    fut: Future = Future()

    def work() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - the caller gets it from the future
            fut.set_exception(e)

    threading.Thread(target=work, name="specd-tokenizer", daemon=True).start()
    return fut


class ProcessLink:
    """``EngineLink`` to an engine process (see the module docstring). Construct (blocks until the
    models are loaded and warmed up; raises ``LoadError``), hand to ``AsyncEngine``, which
    ``close()``s it when it stops. ``entry``: the module the child runs (``serve_child``);
    ``spawned``: a child already started on it (``specd.engine.spawn``), taken over instead. The
    server's tokenizer loads on a thread while the child loads the models."""

    relaying = True
    engine = None  # (no Engine in this process)

    def __init__(
        self,
        cfg,
        load_timeout_s: float | None = None,
        split_cpus: bool = False,
        stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S,
        entry: str = CHILD_ENTRY,
        spawned: Spawned | None = None,
    ):
        HandOff(stream_interval_s)  # (validates)
        child = spawned if spawned is not None else spawn(entry)
        self.proc = child.proc
        if split_cpus:  # (the daemon; not for a library user's process)
            _split_cpus(self.proc.pid)
        self._cmd = Pipe(child.cmd_fd, reader=False)
        self._out = Pipe(child.out_fd, reader=True)
        child.cmd_fd = child.out_fd = -1  # (the pipes are this link's now)
        self._send_lock = threading.Lock()
        self._seqs: dict[str, RemoteSeq] = {}  # requests sent and not finished (event loop)
        self._loop = None
        self._deliver: Callable[[Batch], None] | None = None
        self._died: Callable[[str], None] = lambda msg: None
        self._dead: str | None = None
        self._grammars = RemoteGrammars(self.send, self._why_dead)
        self._cmd.send(Start(cfg, logging.getLogger().level, stream_interval_s))
        tokenizer = _on_thread(load_tokenizer, Path(cfg.target))
        self.limits = self._handshake(load_timeout_s)
        try:
            self._tokenizer = tokenizer.result()
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
        if not isinstance(got[0], Ready):
            self.close()
            raise LoadError(got[0].message if isinstance(got[0], LoadFailed) else f"unexpected {got[0]!r:.200}")
        return got[0].limits

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

    def grammar_compiler(self) -> RemoteGrammars:
        """What checks a request's grammar: the engine process's own compiler, asked over the pipe
        (``CheckGrammar``), so each grammar is compiled once, in the process that uses it."""
        return self._grammars

    def fileno(self) -> int:
        """The pipe the child writes to (readable when ``read_raw()`` has something)."""
        return self._out.fileno()

    @property
    def alive(self) -> bool:
        return self._dead is None and self.proc.poll() is None

    def start(self, loop, deliver: Callable[[Batch], None], died: Callable[[str], None]) -> None:
        self._loop, self._deliver, self._died = loop, deliver, died
        loop.add_reader(self._out.fileno(), self._on_readable)

    def send(self, cmd: Command) -> None:
        if isinstance(cmd, Submit):
            self._seqs[cmd.request_id] = RemoteSeq(cmd, time.monotonic())
        try:
            with self._send_lock:
                self._cmd.send(cmd)
        except (BrokenPipeError, OSError) as e:
            self._dead = self._dead or f"engine process unreachable: {e}"

    def wake(self) -> None:
        """(A command wakes the child; there is nothing else to wake.)"""

    def detach(self) -> None:
        """Stop delivering batches (on the event loop, before ``close``); grammar checks still
        waiting end (``shutting_down``)."""
        self._stop_reading()
        self._grammars.fail_all("the engine is shutting down", "shutting_down")

    def _why_dead(self) -> str | None:
        """Why the engine process cannot answer a command, or None while it can."""
        if self._dead is None and self.proc.poll() is not None:
            return f"engine process died (exit code {self.proc.poll()})"
        return self._dead

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the child and close the pipes (blocking: call it off the event loop, after ``detach``)."""
        try:
            with self._send_lock:
                self._cmd.send(Stop())
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

    def decode(self, msg) -> Batch | None:
        """A batch from the child (``encode_batch``) as a ``Batch`` of ``RequestOutput``s (None for
        any other message)."""
        if type(msg) is not tuple:
            return None
        steps, snapshot, errors, refused, checked = msg
        for r in refused:
            self._seqs.pop(r.request_id, None)
        self._grammars.answered(checked)
        return Batch([Step(self._outputs(records), dt) for records, dt in steps], snapshot, errors, refused, checked)

    def _outputs(self, records: list) -> list:
        outs = []
        for rid, toks, text, finished, reason, state, lps in records:  # (RECORD)
            seq = self._seqs.get(rid)
            if seq is None:
                continue
            seq.num_output += len(toks)
            if state is not None:
                seq.update(state)
            if finished:
                del self._seqs[rid]
            err = seq.error if reason == "error" else None
            outs.append(RequestOutput(rid, toks, text, finished, reason, seq, err, lps))
        return outs

    def _on_readable(self) -> None:
        msgs = self.read_raw()
        for msg in msgs:
            b = self.decode(msg)
            if b is not None and self._deliver is not None:
                self._deliver(b)
        # (end of file arrives as a read with no messages: only then ask about the process)
        if not msgs and (self._out.eof or self.proc.poll() is not None):
            self._stop_reading()
            self._dead = self._dead or f"engine process died (exit code {self.proc.poll()})"
            self._seqs.clear()
            self._grammars.fail_all(self._dead)
            self._died(self._dead)

    def _stop_reading(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            try:
                loop.remove_reader(self._out.fileno())
            except (OSError, ValueError, RuntimeError):
                pass


if __name__ == "__main__":
    serve_child(int(sys.argv[1]), int(sys.argv[2]))
