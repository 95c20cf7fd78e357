"""systemd's notify protocol (sd_notify) without a dependency: one datagram to ``$NOTIFY_SOCKET``.

``READY=1`` once models are loaded and sockets listen, ``STOPPING=1`` when draining starts,
``WATCHDOG=1`` every ``WATCHDOG_USEC / 2`` while the engine loop is healthy (see ``app.py``).
A socket path starting with ``@`` is in the abstract namespace. Every call is a no-op without
``NOTIFY_SOCKET``; errors (including a full receiver queue: the
socket is non-blocking) are swallowed: notification must never stall or take the daemon down.
"""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``); True if it was sent."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.setblocking(False)  # never stall the event loop on a full receiver queue
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings systemd expects at most (``WATCHDOG_USEC``), or None when the
    watchdog is off or meant for another process (``WATCHDOG_PID``)."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    try:
        v = int(usec)
    except ValueError:
        return None
    return v / 1e6 if v > 0 else None
