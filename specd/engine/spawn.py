"""The engine process started before anything heavy is imported.

``spawn(entry)`` runs ``python -m ENTRY CMD_FD OUT_FD`` on two fresh pipes and returns it with the
parent's ends (``Spawned``); this module imports only the standard library, so ``specd serve`` starts
its engine process first thing: the child imports torch and the model code (~1.5 s of CPU) while the
server process imports its own, then waits for the ``Start`` message. ``ProcessLink(cfg,
spawned=...)`` (``specd.engine.links``) takes it over; ``close()`` ends one that was never taken over
(its command pipe closes, so the child exits instead of waiting).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["Spawned", "spawn"]


@dataclass
class Spawned:
    """A started engine process and the parent's ends of its pipes (commands in, messages out)."""

    proc: subprocess.Popen
    cmd_fd: int  # the parent writes commands here
    out_fd: int  # ... and reads the child's messages here

    def close(self, timeout_s: float = 10.0) -> None:
        """End a child that was never taken over: close the pipes (it sees the end of its command
        pipe and exits), wait for it, kill it if it does not go (idempotent)."""
        for fd in (self.cmd_fd, self.out_fd):
            if fd >= 0:
                os.close(fd)
        self.cmd_fd = self.out_fd = -1
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def spawn(entry: str) -> Spawned:
    """``python -m entry CMD_FD OUT_FD`` as a child process (a fresh interpreter, not multiprocessing's
    spawn: that re-imports the parent's ``__main__``, which need not be import-safe)."""
    cmd_r, cmd_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", entry, str(cmd_r), str(out_w)],
            pass_fds=(cmd_r, out_w),
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
    except BaseException:
        for fd in (cmd_w, out_r):
            os.close(fd)
        raise
    finally:
        os.close(cmd_r)
        os.close(out_w)
    return Spawned(proc, cmd_w, out_r)
