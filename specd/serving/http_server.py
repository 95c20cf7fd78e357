"""The ASGI stack on the one TCP port: a Starlette app served by uvicorn (httptools for HTTP, the
``websockets`` sans-I/O implementation for websocket endpoints) on the daemon's own event loop.

``HttpServer(app, ws_max_size)``: ``await listen(host, port)`` binds (port 0 = any free port, see
``port``) and serves; ``await close()`` stops accepting, closes idle connections and waits (bounded)
for the others. Websocket frames above ``ws_max_size`` are refused by closing with 1009; pings go
out every 20 s and a client that does not answer within 20 s is dropped; no compression.
Every HTTP answer carries ``Cache-Control: no-store``, ``X-Content-Type-Options: nosniff`` and
``Server: specd`` (``SecurityHeaders``).
"""

from __future__ import annotations

import logging
import socket

import uvicorn

log = logging.getLogger("specd.http")

__all__ = ["HttpServer", "SecurityHeaders"]

_EXTRA = [(b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff"), (b"server", b"specd")]


class SecurityHeaders:
    """ASGI middleware adding ``_EXTRA`` to every HTTP response that does not set them itself."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", ())}
                extra = [(k, v) for k, v in _EXTRA if k not in have]
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class HttpServer:
    """uvicorn serving ``app`` on a socket bound here (so the port is known at once)."""

    def __init__(self, app, ws_max_size: int, graceful_s: int = 5):
        self.config = uvicorn.Config(
            SecurityHeaders(app),
            loop="none",
            http="httptools",
            ws="websockets-sansio",
            ws_max_size=ws_max_size,
            ws_ping_interval=20.0,
            ws_ping_timeout=20.0,
            ws_per_message_deflate=False,
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            date_header=False,
            proxy_headers=False,
            timeout_graceful_shutdown=graceful_s,
        )
        self.server: uvicorn.Server | None = None
        self.sock: socket.socket | None = None

    async def listen(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        sock.listen(2048)
        sock.setblocking(False)
        self.sock = sock
        self.config.load()
        server = uvicorn.Server(self.config)
        server.lifespan = self.config.lifespan_class(self.config)  # (lifespan "off": nothing to run)
        await server.startup(sockets=[sock])
        self.server = server

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def connections(self) -> set:
        """uvicorn's open connections (protocol objects: ``transport``, ``client``), handshaking ones too."""
        return self.server.server_state.connections if self.server is not None else set()

    async def close(self) -> None:
        """Stop accepting, close idle connections, wait up to ``graceful_s`` for the rest."""
        server, self.server = self.server, None
        if server is not None:
            await server.shutdown(sockets=[self.sock])
