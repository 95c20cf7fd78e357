"""The engine process of ``specd serve``: ``python -m specd.serving.engine_proc CMD_FD OUT_FD``.

``specd.engine.links.serve_child`` (the engine loop on the process link's pipes, see
``specd.engine.links.ProcessLink``) with the daemon's JSON log lines (``specd.serving.logs``) on the
same stderr as the server's. Importing this module costs nothing (``ENTRY``): the server process
starts its engine process before its own imports (``specd.engine.spawn``).
"""

from __future__ import annotations

import logging
import sys

ENTRY = "specd.serving.engine_proc"  # the module ProcessLink(entry=...) runs as the engine process


def _json_logs(level: int) -> None:
    from specd.serving.logs import setup_logging

    setup_logging(logging.getLevelName(level))


if __name__ == "__main__":
    from specd.engine.links import serve_child

    serve_child(int(sys.argv[1]), int(sys.argv[2]), _json_logs)
