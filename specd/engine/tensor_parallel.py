"""Tensor parallelism for the target: ``ShardedTarget``, the one interface between rank 0 (the
engine) and ranks 1..N-1 (worker processes).

The engine builder starts the ranks itself (``--tensor-parallel-size N``): ``torch.multiprocessing``
spawn, a ``TCPStore`` on 127.0.0.1 (a free port) for the rendezvous, gloo on a CPU and NCCL on
CUDA, in process-group objects of their own (no global default group, so several engines may live
in one process). Each rank holds one shard of the target (``specd.model.tp_shard``: heads, MLP
columns, LM head rows) and the KV of its own KV heads only. The scheduler, the drafter (or prompt
lookup), verification and the rollback stay on rank 0, which calls the target exactly as it calls a
``LlamaModel`` and the ledger's KV backend:

- ``target(input_ids, positions, kv, meta, backend) -> hidden [T, d]``: the inputs (token ids,
  positions, attention metadata: block tables, slot mapping, tree mask) go to every worker over its
  pipe, then all ranks run their shard with two all-reduces per layer;
- ``compute_logits(hidden [N, d]) -> [N, vocab]``: rows broadcast, each rank computes its vocabulary
  rows, one gather on rank 0 (``lm_head="split"``); or rank 0 alone with the whole head (``"rank0"``);
- ``copy_slots(kv, src, dst)``: the ledger's KV compaction after partial acceptance, on every rank.

Commands travel over one ``multiprocessing`` pipe per worker rather than as a collective: a worker
waiting for the next step is not inside a collective (an idle daemon would hit the collective
timeout), and a worker sees end-of-file the moment rank 0 is gone, so it never outlives it.

Failure: a worker that dies (killed, crashed) makes rank 0's next collective or pipe write fail
(gloo sees the closed connection at once; every collective has a timeout, ``COLLECTIVE_TIMEOUT_S``),
and a watcher thread notices its exit while the engine idles. Either way ``RankFailure`` is raised
on the engine thread with a one-line reason (logged once, critical): it is a ``BaseException``, so
the engine's per-request isolation does not retry it, the engine loop ends, and ``specd serve``
exits non-zero for its service manager to restart it. ``close()`` stops the workers; they also exit
when rank 0's process ends (pipe end-of-file; daemonic processes).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from specd.model.attention import AttentionMetadata, get_backend
from specd.model.llama import LlamaModel
from specd.model.tp_shard import build_shard, plan, shard_forward, shard_logits, shard_weights

log = logging.getLogger("specd.tensor_parallel")

COLLECTIVE_TIMEOUT_S = 30.0  # one collective (or the rendezvous) waits at most this long
START_TIMEOUT_S = 300.0  # a worker has this long to load its shard and report ready
STOP_TIMEOUT_S = 5.0  # close(): a worker that has not exited by then is killed


class RankFailure(BaseException):
    """A tensor-parallel rank died or the ranks' collectives failed: the engine cannot go on.

    A ``BaseException`` (like ``KeyboardInterrupt``): the engine's per-request isolation catches
    ``Exception`` and would blame a request; this must end the engine loop instead."""


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the ranks meet."""

    port: int
    world: int
    device: str  # "cpu" or "cuda:<i>" of rank 0
    timeout_s: float


def make_group(rv: Rendezvous, rank: int, store) -> Any:
    """gloo on a CPU (bound to the loopback device), NCCL on CUDA; every collective times out."""
    timeout = datetime.timedelta(seconds=rv.timeout_s)
    c10d: Any = dist
    if rv.device.startswith("cuda"):
        nccl = c10d.ProcessGroupNCCL
        nopts = nccl.Options()
        nopts._timeout = timeout
        return nccl(store, rank, rv.world, nopts)
    opts = c10d.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, rv.world, opts)


class Comm:
    """The collectives a forward needs, over one process group; rank 0 times them."""

    def __init__(self, pg: Any, rank: int, world: int):
        self.pg, self.rank, self.world = pg, rank, world
        self.seconds = 0.0  # wall time inside all-reduces (waiting for the slower rank included)
        self.calls = 0
        self.logits_seconds = 0.0  # wall time broadcasting hidden rows and gathering logits

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (16-bit tensors are summed in fp32); returns ``t``."""
        t0 = time.perf_counter()
        buf = t if t.dtype == torch.float32 else t.float()
        self.pg.allreduce([buf]).wait()
        if buf is not t:
            t.copy_(buf)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return t

    def broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def gather(self, t: torch.Tensor) -> list:
        """Rank 0: every rank's ``t`` (same shape), in rank order; other ranks: []."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty_like(t) for _ in range(self.world)]] if self.rank == 0 else []
        self.pg.gather(out, [t], opts).wait()
        return out[0] if out else []


# the wire ----------------------------------------------------------------------------------------
def meta_to_wire(meta: AttentionMetadata) -> tuple:
    """What a worker needs to rebuild ``meta``: host lists and numpy arrays (never torch tensors,
    which a pipe would move through shared memory)."""
    mask = meta.tree_mask.cpu().numpy() if meta.tree_mask is not None else None
    return (
        meta.query_lens_host, meta.context_lens_host, meta.seq_lens_host,
        meta.block_tables.cpu().numpy(), meta.slot_mapping.cpu().numpy(), mask,
        meta.max_query_len, meta.max_seq_len, meta.block_size,
    )  # fmt: skip


def meta_from_wire(w: tuple, device: torch.device) -> AttentionMetadata:
    qlens, ctxs, seq_lens, tables, slots, mask, max_q, max_s, bs = w
    qsl = np.concatenate([[0], np.cumsum(qlens, dtype=np.int64)]).astype(np.int32)
    return AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).to(device),
        context_lens=torch.tensor(ctxs, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(tables).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        tree_mask=torch.from_numpy(mask).to(device) if mask is not None else None,
        max_query_len=max_q,
        max_seq_len=max_s,
        block_size=bs,
        query_lens_host=list(qlens),
        context_lens_host=list(ctxs),
        seq_lens_host=list(seq_lens),
    )


# workers -----------------------------------------------------------------------------------------
@dataclass
class ShardSpec:
    """A worker's shard and cache: passed to it once at spawn (its weights by shared memory)."""

    cfg: object  # ModelConfig of the whole model
    weights: dict
    max_positions: int
    num_blocks: int
    block_size: int
    kv_dtype: torch.dtype
    backend: str
    threads: int


def _worker_main(rank: int, rv: Rendezvous, spec: ShardSpec, conn) -> None:
    """Rank ``rank`` >= 1: build the shard, then run commands from rank 0 until ``stop`` or until
    rank 0 is gone (end of file, or a failed collective). Any error ends the process non-zero."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for rank 0, which stops us
    torch.set_num_threads(spec.threads)
    dev = torch.device(f"cuda:{rank}") if rv.device.startswith("cuda") else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # (NCCL: one device per rank)
    try:
        store = dist.TCPStore("127.0.0.1", rv.port, rv.world, False, datetime.timedelta(seconds=rv.timeout_s))
        comm = Comm(make_group(rv, rank, store), rank, rv.world)
        p = plan(spec.cfg, rank, rv.world)  # type: ignore[arg-type]
        m = build_shard(spec.cfg, p, spec.weights, spec.max_positions, dev)  # type: ignore[arg-type]
        spec.weights = {}
        c = m.cfg
        shape = (c.num_layers, 2, spec.num_blocks, spec.block_size, c.num_kv_heads, c.head_dim)
        kv = torch.zeros(shape, dtype=spec.kv_dtype, device=dev)
        conn.send(("ready", os.getpid()))
        _serve(conn, comm, m, kv, get_backend(spec.backend, dev), dev)
    except (EOFError, BrokenPipeError):
        return  # rank 0 is gone
    except Exception as e:  # noqa: BLE001 - one line on stderr, exit status 1
        os.write(2, f"specd tensor-parallel rank {rank}: {type(e).__name__}: {e}\n".encode())
        os._exit(1)


def _serve(conn, comm: Comm, m: LlamaModel, kv: torch.Tensor, backend, dev: torch.device) -> None:
    """The worker loop: one command per message, in rank 0's order."""
    while True:
        msg = conn.recv()
        op = msg[0]
        if op == "fwd":
            _, ids, pos, wire = msg
            ids_t = torch.tensor(ids, dtype=torch.int64, device=dev)
            pos_t = torch.tensor(pos, dtype=torch.int64, device=dev)
            shard_forward(m, ids_t, pos_t, kv, meta_from_wire(wire, dev), backend, False, comm.reduce)
        elif op == "logits":
            h = torch.empty((msg[1], m.cfg.hidden_size), dtype=getattr(torch, msg[2]), device=dev)
            comm.broadcast(h)
            comm.gather(shard_logits(m, h))
        elif op == "copy":
            src = torch.tensor(msg[1], dtype=torch.int64, device=dev)
            backend.copy_slots(kv, src, torch.tensor(msg[2], dtype=torch.int64, device=dev))
        elif op == "probe":
            _probe(comm, msg[1], msg[2], m.cfg.hidden_size, dev)
        elif op == "stop":
            return


def _probe(comm: Comm, n: int, rows: int, d: int, dev: torch.device) -> float:
    """``n`` back-to-back all-reduces of ``[rows, d]`` fp32 with nothing else to wait for: seconds each."""
    t = torch.zeros((rows, d), device=dev)
    comm.pg.barrier().wait()
    t0 = time.perf_counter()
    for _ in range(n):
        comm.pg.allreduce([t]).wait()
    return (time.perf_counter() - t0) / max(n, 1)


# rank 0 ------------------------------------------------------------------------------------------
def per_rank_threads(threads: int | None, world: int, cpus: int) -> int:
    """Math threads per rank: ``threads`` when given (> 0), else the usable CPUs shared out
    (``cpus // world``, at least 1), so N ranks x T threads never exceed the cores."""
    return threads if threads else max(1, cpus // world)


def _exit_reason(rank: int, p) -> str:
    code = p.exitcode
    how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
    return f"tensor-parallel rank {rank} (pid {p.pid}) died ({how})"


class ShardedTarget:
    """Rank 0's handle on a target split over ``world`` ranks; stands where the engine holds a
    ``LlamaModel`` (``__call__``, ``compute_logits``, ``cfg``) and the ledger its KV backend
    (``copy_slots``). ``kv_heads``: the KV heads of rank 0's cache. ``allreduce_seconds`` /
    ``allreduce_calls`` / ``forwards``: measured on rank 0 (benchmarks read them)."""

    def __init__(
        self,
        model: LlamaModel,
        world: int,
        num_blocks: int,
        block_size: int,
        backend,
        threads: int,
        lm_head: str = "split",
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ):
        if lm_head not in ("split", "rank0"):
            raise ValueError(f"lm_head must be split|rank0, got {lm_head!r}")
        plans = [plan(model.cfg, r, world) for r in range(world)]  # (validates the split)
        weights = [shard_weights(model, p) for p in plans]  # (refuses quantized weights)
        self.cfg, self.world, self.backend = model.cfg, world, backend
        self.device = model.norm.weight.device
        self._failure: str | None = None
        self._closing = False
        self.forwards = 0
        self.kv_copies = 0  # KV compactions sent to every rank
        max_pos = int(cast(torch.Tensor, model.rotary.cos).shape[0])
        dtype = model.norm.weight.dtype
        store = dist.TCPStore(
            "127.0.0.1", 0, world, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        rv = Rendezvous(store.port, world, str(self.device), timeout_s)
        self.procs: list = []
        self.conns: list = []
        try:
            for r in range(1, world):
                spec = ShardSpec(model.cfg, weights[r], max_pos, num_blocks, block_size, dtype, backend.name, threads)
                self._spawn(r, rv, spec)
            self.comm = Comm(make_group(rv, 0, store), 0, world)
            self.shard = build_shard(model.cfg, plans[0], weights[0], max_pos, self.device)
            self._await_ready(START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self._store = store
        self.kv_heads = self.shard.cfg.num_kv_heads
        self._full_head = model.lm_head.weight.detach() if lm_head == "rank0" else None
        threading.Thread(target=self._watch, name="specd-tp-watch", daemon=True).start()

    def _spawn(self, rank: int, rv: Rendezvous, spec: ShardSpec) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_worker_main, args=(rank, rv, spec, theirs), name=f"specd-tp-{rank}", daemon=True)
        p.start()
        theirs.close()  # (only the worker holds its end: rank 0 gone = end of file there)
        self.procs.append(p)
        self.conns.append(ours)

    def _await_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        for r, (p, c) in enumerate(zip(self.procs, self.conns), 1):
            while not c.poll(0.1):
                if not p.is_alive():
                    raise RuntimeError(_exit_reason(r, p) + " while starting")
                if time.monotonic() > end:
                    raise RuntimeError(f"tensor-parallel rank {r} did not start within {timeout_s:.0f} s")
            c.recv()

    # the model surface ---------------------------------------------------------------------------
    def __call__(self, input_ids, positions, kv, meta: AttentionMetadata, backend=None) -> torch.Tensor:
        """``hidden [T, d]``: every rank runs its shard over the same inputs; ``kv`` is rank 0's."""
        self.check()
        self._send(("fwd", input_ids.tolist(), positions.tolist(), meta_to_wire(meta)))
        try:
            hidden = shard_forward(
                self.shard, input_ids, positions, kv, meta, backend or self.backend, True, self.comm.reduce
            )
        except Exception as e:  # noqa: BLE001 - the ranks' collectives are out of step: fatal
            raise self._fatal("forward", e) from e
        self.forwards += 1
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab]`` fp32: each rank's vocabulary rows, gathered on rank 0 (or rank 0's whole head)."""
        if self._full_head is not None:
            return torch.mm(hidden, self._full_head.t()).float()
        self.check()
        h = hidden.contiguous()
        self._send(("logits", h.shape[0], str(h.dtype).removeprefix("torch.")))
        try:
            t0 = time.perf_counter()
            self.comm.broadcast(h)
            t1 = time.perf_counter()
            part = shard_logits(self.shard, h)
            t2 = time.perf_counter()
            parts = self.comm.gather(part)
            self.comm.logits_seconds += t1 - t0 + time.perf_counter() - t2
        except Exception as e:  # noqa: BLE001
            raise self._fatal("logits", e) from e
        return torch.cat(parts, dim=1)[:, : self.cfg.vocab_size]

    def copy_slots(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The ledger's KV compaction (``TorchAttention.copy_slots`` contract) on every rank's cache."""
        if src.numel() == 0:
            return
        self.check()
        self._send(("copy", src.tolist(), dst.tolist()))
        self.backend.copy_slots(kv, src, dst)
        self.kv_copies += 1

    def probe_allreduce(self, n: int = 200, rows: int = 1) -> float:
        """Seconds per all-reduce of ``[rows, hidden]`` fp32 when every rank is ready (benchmarks:
        the collective's own cost, apart from waiting for a slower rank)."""
        self.check()
        self._send(("probe", n, rows))
        return _probe(self.comm, n, rows, self.cfg.hidden_size, self.device)

    @staticmethod
    def quantized() -> bool:
        return False

    @property
    def allreduce_seconds(self) -> float:
        return self.comm.seconds

    @property
    def allreduce_calls(self) -> int:
        return self.comm.calls

    # failure and shutdown ------------------------------------------------------------------------
    @property
    def failed(self) -> str | None:
        """Why the ranks cannot go on (one line), or None."""
        return self._failure

    def check(self) -> None:
        """Raise ``RankFailure`` once a rank has died."""
        if self._failure is not None:
            raise RankFailure(self._failure)

    def _send(self, msg: tuple) -> None:
        for c in self.conns:
            try:
                c.send(msg)
            except (OSError, ValueError) as e:
                raise self._fatal("send", e) from e

    def _dead_rank(self, wait_s: float) -> str | None:
        """The first dead worker's exit, waiting up to ``wait_s`` for one to show."""
        end = time.monotonic() + wait_s
        while True:
            for r, p in enumerate(self.procs, 1):
                if p.exitcode is not None:
                    return _exit_reason(r, p)
            if time.monotonic() >= end:
                return None
            time.sleep(0.02)

    def _fatal(self, what: str, e: BaseException) -> RankFailure:
        reason = self._dead_rank(2.0) or f"tensor-parallel {what} failed: {type(e).__name__}: {e}"
        self._set_failure(reason)
        return RankFailure(reason)

    def _set_failure(self, reason: str) -> None:
        if self._failure is not None or self._closing:
            return
        self._failure = reason
        log.critical("%s: the engine cannot continue", reason)
        for p in self.procs:  # the other ranks' collectives are out of step with ours: stop them
            if p.is_alive():
                p.kill()

    def _watch(self) -> None:
        """Notice a worker's exit while the engine idles (``failed`` turns true; the next step raises)."""
        if self.procs:
            mpc.wait([p.sentinel for p in self.procs])
        if self.procs and not self._closing:
            self._set_failure(self._dead_rank(1.0) or "a tensor-parallel rank exited")

    def close(self) -> None:
        """Stop the workers (killed after ``STOP_TIMEOUT_S``); idempotent."""
        if self._closing:
            return
        self._closing = True
        for c in self.conns:
            try:
                c.send(("stop",))
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for c in self.conns:
            c.close()
