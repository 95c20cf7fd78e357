"""API key and browser-origin checks, shared by every front end on the HTTP port.

One key (``--api-key`` / ``SPECD_API_KEY``) guards the websocket, ``/metrics`` and the OpenAI routes
(``Authorization: Bearer KEY``; keys are compared in constant time). ``namespace(key)`` names what a
key may read back later (stored responses): a digest of the presented key, so that two keys never see
each other's data, also on a server without a key of its own.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from urllib.parse import urlsplit

__all__ = ["Auth"]


class Auth:
    """``api_key``: None or "" = no key required. ``allowed_origins``: comma-separated browser origins
    allowed to open websockets ("" = the server's own host only, "*" = any)."""

    def __init__(self, api_key: str | None = None, allowed_origins: str = ""):
        self.api_key = api_key or None
        origins = [o.strip().rstrip("/") for o in (allowed_origins or "").split(",") if o.strip()]
        self.any_origin = "*" in origins
        self.origins = set(origins) - {"*"}

    def key_ok(self, key: str | None) -> bool:
        """``key`` is the server's key (always True without one)."""
        if self.api_key is None:
            return True
        return key is not None and hmac.compare_digest(key.encode(), self.api_key.encode())

    @staticmethod
    def bearer(headers: Mapping) -> str | None:
        """The key of an ``Authorization: Bearer KEY`` header; None without the header, "" for
        another scheme."""
        h = headers.get("authorization")
        if h is None:
            return None
        scheme, _, token = h.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else ""

    @staticmethod
    def namespace(key: str | None) -> str:
        """Whose data this is: a digest of the presented key ("" and None are one anonymous caller)."""
        return hashlib.sha256((key or "").encode()).hexdigest()[:32]

    @staticmethod
    def tenant(key: str | None) -> str | None:
        """The engine's tenant for a caller (what model-free drafting may read, ``Engine.add_request``):
        its key's namespace, or None for callers without a key."""
        return Auth.namespace(key) if key else None

    def origin_ok(self, headers: Mapping) -> bool:
        """A browser's ``Origin`` is allowed (requests without one are not browsers: allowed)."""
        origin = headers.get("origin")
        if origin is None or self.any_origin:
            return True
        origin = origin.rstrip("/")
        if origin in self.origins:
            return True
        if self.origins:
            return False
        try:  # default: same host only (the page this server serves)
            u = urlsplit(origin)
        except ValueError:
            return False
        host = (headers.get("host") or "").lower()
        net = (u.netloc or "").lower()
        default = {"http": ":80", "https": ":443"}.get(u.scheme, "")
        return bool(net) and (net == host or net + default == host or net == host + default)
