"""The Starlette application: every route on the daemon's one HTTP port.

HTTP: ``/healthz``, ``/readyz``, ``/metrics``, ``/`` (the web chat page) and the OpenAI-compatible API
under ``/v1`` (``specd.serving.openai_routes``). Websockets: specd's own protocol on ``/ws`` and ``/``
(``specd.serving.ws``), OpenAI's Responses WebSocket mode on ``/v1/responses``
(``specd.serving.responses_ws``); an upgrade anywhere else gets HTTP 404.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.routing import WebSocketRoute

from specd.serving.routes import operational_routes
from specd.serving.ws import WSServer, deny

__all__ = ["build_app"]


class _NoWebsocketHere:
    """An upgrade on any other path: HTTP 404 (a raw ASGI app; Starlette wraps plain functions)."""

    async def __call__(self, scope, receive, send) -> None:
        await receive()  # websocket.connect
        await deny(send, 404, "websocket endpoints: /ws (specd protocol), /v1/responses (OpenAI Responses)\n")


def build_app(ws: WSServer, http_routes: list, ws_routes: list) -> Starlette:
    """The app over ``ws.front``: operational routes, then ``http_routes``; websockets ``/ws`` and
    ``/`` (specd), then ``ws_routes`` (``WebSocketRoute``s), then the 404 catch-all."""
    routes = operational_routes(ws.front) + list(http_routes)
    routes += [WebSocketRoute("/ws", ws), WebSocketRoute("/", ws), *ws_routes]
    routes.append(WebSocketRoute("/{path:path}", _NoWebsocketHere()))
    return Starlette(routes=routes)
