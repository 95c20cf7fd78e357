"""``GrammarCompiler``: specs -> compiled grammars, cached, off the caller's thread, bounded in time and size.

``submit(spec)`` returns at once with a ``concurrent.futures.Future`` of a :class:`Grammar` (the engine
loop polls ``done()``; asyncio code awaits ``asyncio.wrap_future``). The future settles by
``compile_timeout_s`` after the call at the latest: with the grammar, or with a :class:`GrammarError`
naming the problem (``grammar_too_large`` before any work, ``invalid_schema`` / ``invalid_regex`` /
``invalid_grammar`` / ``invalid_tools`` from the library, ``unsatisfiable_schema`` when the first
mask allows no token, ``compile_timeout``).

The cache is keyed by ``sha256(canonical spec, tokenizer fingerprint, compile options)`` and holds the
future itself, so a second request for a schema being compiled shares the one compile, and a refused
spec is refused again at once (LRU, ``cache_entries``). Compiles run on their own threads, at most
``workers`` at a time (xgrammar releases the GIL while it compiles, so the engine thread keeps
running). A compile that overruns its deadline cannot be killed (Python threads cannot be); its
future fails at the deadline, its worker slot is handed on, and it finishes in the background; the
size bounds (:class:`~specd.structured.limits.GrammarLimits`) keep such stragglers short.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import xgrammar as xgr

from specd.structured.allof import merge_object_allof
from specd.structured.errors import GrammarError
from specd.structured.limits import GrammarLimits, check
from specd.structured.matcher import Matcher
from specd.structured.spec import GrammarSpec
from specd.structured.tools import ToolFunction, structural_tag
from specd.structured.vocab import Vocabulary

__all__ = ["CompilerConfig", "Grammar", "GrammarCompiler"]

SEPARATORS = (", ", ": ")  # what models write by themselves; fixed, so keys and punctuation are forced
ERROR_CODE = {"json_schema": "invalid_schema", "json_object": "invalid_schema", "regex": "invalid_regex"}
ERROR_CODE.update(choice="invalid_grammar", grammar="invalid_grammar", tool_calls="invalid_tools")
UNSATISFIABLE = ("cannot accept any value", "Invalid range", "must not be empty")


@dataclass(frozen=True)
class CompilerConfig:
    """``compile_timeout_s``: a future settles within it; ``workers``: compiles at once;
    ``cache_entries``: grammars (and refusals) kept; ``strict_json``: objects with declared
    properties hold only those (xgrammar ``strict_mode``; OpenAI strict semantics); ``lazy_masks``:
    xgrammar's dynamic compilation, each grammar state's token-mask cache built on its first use
    instead of while compiling (compiles ~20x faster, the first visit of a state costs up to ~1 ms:
    docs/benchmarks.md, "Grammar libraries")."""

    compile_timeout_s: float = 10.0
    workers: int = 2
    cache_entries: int = 256
    strict_json: bool = True
    lazy_masks: bool = False
    limits: GrammarLimits = field(default_factory=GrammarLimits)

    def __post_init__(self):
        if not self.compile_timeout_s > 0:
            raise ValueError("compile_timeout_s must be > 0")
        if self.workers < 1 or self.cache_entries < 1:
            raise ValueError("workers and cache_entries must be >= 1")


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar for one vocabulary; ``matcher()`` starts one request's state."""

    spec: GrammarSpec
    key: str
    compiled: xgr.CompiledGrammar = field(repr=False)
    vocab: Vocabulary = field(repr=False)
    compile_s: float

    def matcher(self) -> Matcher:
        return Matcher(self.compiled, self.vocab)


def _message(e: Exception) -> str:
    """The library's message without its ``[time] file.cc:line:`` prefix, on one line."""
    text = " ".join(str(e).split())
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", text) or type(e).__name__


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one :class:`Vocabulary` (see the module docstring)."""

    def __init__(self, vocab: Vocabulary, config: CompilerConfig | None = None):
        self.vocab = vocab
        self.config = config or CompilerConfig()
        self._lib = xgr.GrammarCompiler(
            vocab.info, max_threads=1, cache_enabled=False, enable_dynamic_compilation=self.config.lazy_masks
        )
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(self.config.workers)
        self._salt = json.dumps([vocab.fingerprint, self.config.strict_json, self.config.lazy_masks, SEPARATORS])

    def submit(self, spec: GrammarSpec) -> Future:
        """A future of the :class:`Grammar` for ``spec``; settles within ``compile_timeout_s``."""
        try:
            canonical = check(spec, self.config.limits)
        except GrammarError as e:
            return _settled(error=e)
        key = spec.key(self._salt, canonical)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = Future()
            fut.set_running_or_notify_cancel()
            self._cache[key] = fut
            while len(self._cache) > self.config.cache_entries:
                self._cache.popitem(last=False)
        self._start(spec, key, fut)
        return fut

    def compile(self, spec: GrammarSpec) -> Grammar:
        """``submit(spec).result()``: blocks at most ``compile_timeout_s``; raises :class:`GrammarError`."""
        return self.submit(spec).result()

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    # ------------------------------------------------------------------ the work
    def _start(self, spec: GrammarSpec, key: str, fut: Future) -> None:
        """Compile on a thread of its own once a worker slot is free; fail ``fut`` at the deadline, handing
        the slot on if the compile still holds it."""
        lock, holding = threading.Lock(), [False]
        timeout = self.config.compile_timeout_s

        def hand_back() -> None:
            with lock:
                if holding[0]:
                    holding[0] = False
                    self._slots.release()

        def run() -> None:
            self._slots.acquire()
            with lock:
                if fut.done():  # expired while waiting for a slot
                    self._slots.release()
                    return
                holding[0] = True
            try:
                _settle(fut, *self._build(spec, key))
            finally:
                hand_back()

        def expire() -> None:
            msg = f"compiling the constraint took longer than compile_timeout_s ({timeout:g} s)"
            if _settle(fut, error=GrammarError("compile_timeout", msg, spec.field)):
                hand_back()

        timer = threading.Timer(timeout, expire)
        timer.daemon = True
        fut.add_done_callback(lambda _f: timer.cancel())
        timer.start()
        # not a daemon: the interpreter waits for a running compile at exit (native code still running
        # in a daemon thread at shutdown aborts the process)
        threading.Thread(target=run, name="grammar-compile").start()

    def _build(self, spec: GrammarSpec, key: str) -> tuple:
        """``(grammar, None)`` or ``(None, GrammarError)``."""
        t0 = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except GrammarError as e:
            return None, e
        except Exception as e:  # noqa: BLE001 - the library's refusal, as the request's error
            msg = _message(e)
            code = "unsatisfiable_schema" if any(s in msg for s in UNSATISFIABLE) else ERROR_CODE[spec.kind]
            return None, GrammarError(code, f"{spec.field or spec.kind}: {msg}", spec.field)
        grammar = Grammar(spec, key, compiled, self.vocab, time.perf_counter() - t0)
        if not grammar.matcher().allowed().any():
            msg = f"{spec.field or spec.kind}: the constraint admits no output"
            return None, GrammarError("unsatisfiable_schema", msg, spec.field)
        return grammar, None

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        lib, v = self._lib, spec.value
        if spec.kind == "json_object":
            return lib.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=SEPARATORS)
        if spec.kind == "json_schema":  # (object allOf merged first: the library keeps one branch)
            return lib.compile_json_schema(
                json.dumps(merge_object_allof(v)),
                any_whitespace=False,
                separators=SEPARATORS,
                strict_mode=self.config.strict_json,
            )
        if spec.kind == "regex":
            return lib.compile_regex(v)
        if spec.kind == "choice":
            return lib.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in v))
        if spec.kind == "grammar":
            return lib.compile_grammar(v)
        return lib.compile_structural_tag(json.dumps(structural_tag(v, self._arguments)))

    def _arguments(self, fn: ToolFunction) -> dict:
        """A function's arguments as an EBNF format: the same JSON layout as ``json_schema`` replies
        (fixed separators, no free whitespace; a structural tag's own JSON format has free whitespace)."""
        try:
            strict = self.config.strict_json
            schema = json.dumps(fn.parameters)
            ebnf = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=SEPARATORS, strict_mode=strict)
        except Exception as e:  # noqa: BLE001 - the library's refusal of one function's schema
            raise GrammarError("invalid_tools", f"tool {fn.name!r} parameters: {_message(e)}", "tools") from None
        return {"type": "grammar", "grammar": str(ebnf)}


def _settle(fut: Future, grammar: Grammar | None = None, error: Exception | None = None) -> bool:
    """Set ``fut``'s outcome unless it has one already; whether this call set it."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(grammar)
    except InvalidStateError:
        return False
    return True


def _settled(grammar: Grammar | None = None, error: Exception | None = None) -> Future:
    fut: Future = Future()
    fut.set_running_or_notify_cancel()
    _settle(fut, grammar, error)
    return fut
