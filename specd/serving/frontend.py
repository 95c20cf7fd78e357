"""What every front end on the HTTP port shares: the engine client, the drain flag, auth, limits, metrics.

``Frontend.admission()`` is the one answer to "may a new request start now?": ``shutting_down`` while
draining, ``overloaded`` while the models load; the engine client then applies ``--max-queue`` and
the request's own validation (``specd.serving.request_build``, ``EngineLimits``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specd.engine.requests import RequestError
from specd.serving.async_engine import AsyncEngine
from specd.serving.auth import Auth
from specd.serving.metrics import Metrics

__all__ = ["Frontend"]


@dataclass
class Frontend:
    """``ae`` is None until the models are loaded; ``max_message_bytes`` bounds a websocket message
    and an HTTP request body alike; ``model_name`` is the id the OpenAI routes serve."""

    auth: Auth
    metrics: Metrics
    max_message_bytes: int = 1 << 20
    max_connections: int = 256
    model_name: str = "specd"
    ae: AsyncEngine | None = None
    draining: bool = False
    created: int = 0
    ws_sets: list = field(default_factory=list)  # each websocket endpoint's set of open connections

    @property
    def open_websockets(self) -> int:
        """Websockets open on the port, both kinds (``--max-connections`` bounds them together)."""
        return sum(len(s) for s in self.ws_sets)

    @property
    def ready(self) -> bool:
        return self.ae is not None and self.ae.ready and not self.draining

    def upgrade_refusal(self, headers, key_required: bool) -> tuple | None:
        """(status, body, headers) refusing a websocket upgrade, or None; counts the refusal. Both
        websocket endpoints check the origin, the connection limit and draining (503: a load balancer
        moves the conversation to another replica at once); a wrong key is always refused, a missing
        one only where ``key_required`` (our protocol may authenticate in-band)."""
        auth, m = self.auth, self.metrics
        if not auth.origin_ok(headers):
            m.count_error("forbidden_origin")
            return 403, "origin not allowed (see --allowed-origins)\n", None
        key = auth.bearer(headers)
        if (key is not None or key_required) and not auth.key_ok(key):
            m.count_error("unauthorized")
            body = "unauthorized: Authorization: Bearer KEY required\n" if key_required else "unauthorized\n"
            return 401, body, {"WWW-Authenticate": "Bearer"}
        if self.open_websockets >= self.max_connections:
            m.count_error("too_many_connections")
            return 503, "too many connections\n", {"Retry-After": "1"}
        if self.draining or (self.ae is not None and self.ae.draining):  # a balancer retries elsewhere at once
            m.count_error("shutting_down")
            return 503, "shutting down\n", {"Retry-After": "1"}
        return None

    def admission(self) -> RequestError | None:
        """Why a new request must be refused now (None: go ahead)."""
        ae = self.ae
        if self.draining or (ae is not None and ae.draining):
            return RequestError("shutting_down", "the server is shutting down")
        if ae is None or not ae.ready:
            return RequestError("overloaded", "the server is not ready yet (models loading); retry later")
        return None
