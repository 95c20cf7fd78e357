"""The operational HTTP routes: ``/healthz``, ``/readyz``, ``/metrics``, the web chat page (``/``).

``/healthz``: 200 while the engine completes steps; 503 ``unhealthy: <reason>`` when the engine thread
or process died, requests are outstanding and nothing came back within the watchdog timeout, or
``--max-failed-steps`` steps in a row failed. ``/readyz``: 200 only while serving AND healthy; 503
``loading`` / ``draining`` / ``unhealthy: ...``. ``/metrics``: Prometheus text; needs the API key when
one is set. Neither health route ever needs the key (probes).
"""

from __future__ import annotations

from pathlib import Path

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from specd.serving.frontend import Frontend

__all__ = ["JSONResponse", "operational_routes", "text"]

STATIC = Path(__file__).with_name("static")
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src "
    "'unsafe-inline'; connect-src 'self' ws: wss:; img-src data:",
    "Referrer-Policy": "no-referrer",
}


class JSONResponse(Response):
    """A JSON body encoded with orjson (every JSON body the server sends)."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content)


def text(status: int, body: str, headers: dict | None = None) -> Response:
    return Response(body.encode(), status, headers=headers, media_type="text/plain; charset=utf-8")


def operational_routes(front: Frontend) -> list:
    page: list = []

    async def healthz(request: Request) -> Response:
        sick = front.ae.unhealthy_reason() if front.ae is not None else None
        return text(503, f"unhealthy: {sick}\n") if sick else text(200, "ok\n")

    async def readyz(request: Request) -> Response:
        sick = front.ae.unhealthy_reason() if front.ae is not None else None
        if front.ready and sick is None:
            return text(200, "ready\n")
        if front.draining or (front.ae is not None and front.ae.draining):
            return text(503, "draining\n")
        return text(503, f"unhealthy: {sick}\n" if sick else "loading\n")

    async def metrics(request: Request) -> Response:
        if not front.auth.key_ok(front.auth.bearer(request.headers)):
            return text(401, "unauthorized\n", {"WWW-Authenticate": "Bearer"})
        return Response(front.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def index(request: Request) -> Response:
        if not page:
            page.append((STATIC / "index.html").read_bytes())
        return Response(page[0], headers=PAGE_HEADERS, media_type="text/html; charset=utf-8")

    return [
        Route("/healthz", healthz, methods=["GET", "HEAD"]),
        Route("/readyz", readyz, methods=["GET", "HEAD"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/", index, methods=["GET", "HEAD"]),
        Route("/index.html", index, methods=["GET", "HEAD"]),
    ]
