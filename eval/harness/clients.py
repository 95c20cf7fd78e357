"""Websocket clients of the load tools: lean raw-socket readers and the ``websockets`` library.

- Lean (:func:`ws_open`, :func:`masked_frame`, :func:`read_until`, :func:`ws_frames`): a raw socket
  that only appends what arrives, each read stamped with its arrival time, and parses the frames
  after the run. On a 2-CPU box the client shares the server's CPU, and a library's per-message
  work (JSON per frame) would compete with the system under test; real clients run elsewhere.
- Library (:func:`connect`, :func:`request` -> :class:`Result`): one request per call on a
  ``websockets`` connection, every delta's arrival time kept (TTFT, inter-token latency).
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from dataclasses import dataclass, field

import orjson


# lean raw-socket clients ------------------------------------------------------------------------
def masked_frame(payload: bytes) -> bytes:
    """One masked client text frame carrying ``payload``."""
    mask = os.urandom(4)
    n = len(payload)
    if n < 126:
        hdr = bytes((0x81, 0x80 | n))
    elif n < 65536:
        hdr = b"\x81\xfe" + n.to_bytes(2, "big")
    else:
        hdr = b"\x81\xff" + n.to_bytes(8, "big")
    return hdr + mask + bytes(b ^ mask[k % 4] for k, b in enumerate(payload))


async def ws_open(port: int, path: str):
    """``(reader, writer)`` of a websocket opened on 127.0.0.1:``port`` at ``path`` (no extensions)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 101 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"websocket upgrade refused: {head[:200]!r}")
    return reader, writer


async def read_until(reader, count_marks, n_ends: int) -> list:
    """``[(arrival time, bytes)]`` reads until ``count_marks(all bytes so far)`` reaches ``n_ends``
    (e.g. the number of ``"type":"done"`` marks: one per request that ended)."""
    chunks, seen, tail = [], 0, b""
    while seen < n_ends:
        chunk = await reader.read(1 << 16)
        if not chunk:
            raise RuntimeError("connection closed by the server")
        chunks.append((time.monotonic(), chunk))
        scan = tail + chunk
        seen += count_marks(scan) - count_marks(tail)
        tail = scan[-40:]
    return chunks


def ws_frames(chunks: list) -> list:
    """``[(arrival time, message dict)]`` of the server's text frames in ``[(time, bytes)]`` reads,
    each stamped with the time of the read that completed it."""
    out, buf = [], bytearray()
    for t, chunk in chunks:
        buf += chunk
        pos = 0
        while len(buf) - pos >= 2:
            ln = buf[pos + 1] & 0x7F
            hl = 2 if ln < 126 else (4 if ln == 126 else 10)
            if len(buf) - pos < hl:
                break
            if ln >= 126:
                ln = int.from_bytes(buf[pos + 2 : pos + hl], "big")
            if len(buf) - pos - hl < ln:
                break
            if buf[pos] & 0x0F == 1:
                out.append((t, orjson.loads(bytes(buf[pos + hl : pos + hl + ln]))))
            pos += hl + ln
        del buf[:pos]
    return out


# the websockets library -------------------------------------------------------------------------
@dataclass
class Result:
    """One request as a client saw it: when it was sent, each delta's arrival, the tokens, the ``done``."""

    t_send: float
    arrivals: list = field(default_factory=list)  # (perf_counter, tokens in the delta)
    token_ids: list = field(default_factory=list)
    text: str = ""
    done: dict | None = None

    @property
    def ttft_ms(self) -> float | None:
        return (self.arrivals[0][0] - self.t_send) * 1000 if self.arrivals else None

    @property
    def t_end(self) -> float:
        return self.arrivals[-1][0] if self.arrivals else self.t_send

    def itl_token_ms(self) -> list:
        """One sample per token after the first delta: gap to the previous delta / tokens in this delta."""
        out = []
        for (t0, _), (t1, n) in zip(self.arrivals, self.arrivals[1:]):
            if n:
                out += [(t1 - t0) * 1000 / n] * n
        return out

    def itl_delta_ms(self) -> list:
        return [(t1 - t0) * 1000 for (t0, _), (t1, _) in zip(self.arrivals, self.arrivals[1:])]


def connect(port: int):
    """A ``websockets`` connection to specd's ``/ws`` on 127.0.0.1:``port`` (no compression, no pings)."""
    from websockets.asyncio.client import connect as ws_connect

    return ws_connect(f"ws://127.0.0.1:{port}/ws", compression=None, max_size=None, ping_interval=None)


async def request(ws, rid: str, body: dict, on_first=None) -> Result:
    """One greedy ``generate`` request (``body``: its fields) on a connection that runs nothing else;
    returns when its ``done`` arrives (an ``error`` frame raises). ``on_first``: called at the first delta."""
    msg = orjson.dumps({"type": "generate", "id": rid, "temperature": 0, **body}).decode()
    r = Result(time.perf_counter())
    await ws.send(msg)
    while True:
        m = orjson.loads(await ws.recv())
        now = time.perf_counter()
        if m.get("id") != rid:
            continue
        typ = m["type"]
        if typ == "delta":
            r.arrivals.append((now, len(m["token_ids"])))
            r.token_ids += m["token_ids"]
            r.text += m["text"]
            if on_first is not None and len(r.arrivals) == 1:
                on_first()
        elif typ == "done":
            r.done = m
            return r
        else:
            raise RuntimeError(f"request {rid}: {m}")


def new_loop():
    """A uvloop event loop where uvloop is installed (as the server's), else asyncio's."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()


def run_async(coro):
    """Run ``coro`` to completion on a fresh :func:`new_loop`."""
    loop = new_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
