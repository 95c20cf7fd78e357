"""Start ``specd serve`` as ``make run`` does, wait until it is ready, ask ``/readyz`` and ``/healthz``,
then stop it with SIGTERM: the server starts, serves its health routes and drains cleanly.

    python -m eval serve-check [SERVE FLAGS]        # e.g. --threads 0 (make run SMOKE=1)

The server runs as a child process (``harness.start_daemon``) on free loopback ports (``--port 0
--grpc-port 0``: nothing else on the machine is disturbed), with the given ``specd serve`` flags
(none: the built-in model). Prints one line per check and a JSON summary; exit status 0 when
``/readyz`` and ``/healthz`` answered 200 and the server exited with status 0.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error

from eval import harness as H

COMMAND = "serve-check"  # python -m eval serve-check (this module's ``main``)


def probe(port: int, path: str) -> tuple:
    """(HTTP status, body) of GET ``path``; (None, the error) when the connection fails."""
    try:
        return 200, H.http_get(port, path).strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace").strip()
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"


def main(argv=None) -> int:
    flags = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(flags):
        print(__doc__)
        return 0
    t0 = time.monotonic()
    srv = H.start_daemon(flags, child=True)
    started = time.monotonic() - t0
    try:
        ready, health = probe(srv.port, "/readyz"), probe(srv.port, "/healthz")
    finally:
        status = srv.stop()
    print(f"serve-check: specd serve {' '.join(flags)} ready on port {srv.port} after {started:.1f} s")
    print(f"serve-check: GET /readyz -> {ready[0]} {ready[1][:80]!r}; GET /healthz -> {health[0]} {health[1][:80]!r}")
    print(f"serve-check: stopped with SIGTERM, exit status {status}")
    ok = ready[0] == 200 and health[0] == 200 and status == 0
    summary = {"flags": flags, "port": srv.port, "start_s": round(started, 1), "readyz": ready[0]}
    summary.update(healthz=health[0], exit_status=status, ok=ok)
    print(json.dumps(summary))
    if not ok:
        print("server log tail:\n" + "".join(srv.logs[-30:]), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
