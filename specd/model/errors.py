"""Errors and the model cache's location, shared by the loaders (no imports of their own)."""

from __future__ import annotations

import os
from pathlib import Path


class LoadError(ValueError):
    """A checkpoint that cannot be loaded; the message is one line."""


def cache_dir() -> Path:
    """The model cache: ``$SPECD_CACHE_DIR``, else ``$XDG_CACHE_HOME/specd``, else ``~/.cache/specd``
    (``models/`` fetched files, ``gguf/`` dequantized folders, ``cpu-dtype.json``)."""
    d = os.environ.get("SPECD_CACHE_DIR")
    if d:
        return Path(d)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specd"
