"""Reply text -> OpenAI ``tool_calls``: all at once (:func:`parse_tool_calls`) or as it streams
(:class:`ToolCallParser`), for the format of :mod:`specd.structured.tools`.

Both split a reply into ``content`` and calls the same way, so the streamed pieces joined equal the
non-streamed parse:

- a call is ``<tool_call>`` + ``{"name": "...", "arguments": {...}}`` + ``</tool_call>``; its
  ``arguments`` string is the arguments object's text exactly as generated;
- ``content`` is the text outside calls, without the whitespace at the reply's ends and around
  calls (the newlines of the format); None when nothing is left;
- text that only looks like a call (no ``{"name": "...", "arguments":`` within 512 characters of the
  tag) stays content. A grammar-constrained reply never has one; tags inside the arguments' JSON
  strings are the arguments' text;
- a reply cut short inside a call (``max_tokens``, a stop string) has streamed that call's start:
  ``finish()`` reports it in ``incomplete`` (and ``cut``), and the non-streamed parse gives it too, as
  its last call with the arguments text generated so far and ``complete`` False (OpenAI's calls cut by
  ``max_tokens``: ``finish_reason`` "length", the arguments not valid JSON yet). A reply cut before the
  call's name was complete has streamed nothing of it: neither parse reports it, as content or call.

Streaming, as OpenAI sends it: a call's first delta carries ``index``, ``id``, ``type`` and the
function ``name`` with empty ``arguments``; later deltas carry ``index`` and argument fragments.
Example::

    >>> p = ToolCallParser(ids=lambda i: f"call_{i}")
    >>> d = p.feed('Sure.\\n<tool_call>\\n{"name": "f", "argu')
    >>> d.content, d.tool_calls
    ('Sure.', [])
    >>> d = p.feed('ments": {"x": 1}}\\n</tool_call>')
    >>> [(c.index, c.id, c.name, c.arguments) for c in d.tool_calls]
    [(0, 'call_0', 'f', ''), (0, None, None, '{"x": 1}')]
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from specd.structured.tools import TOOL_CLOSE, TOOL_OPEN

__all__ = ["ParseDelta", "ToolCall", "ToolCallDelta", "ToolCallParser", "new_call_id", "parse_tool_calls"]

HEADER_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
MAX_HEADER = 512  # characters after <tool_call> within which the name must have appeared


def new_call_id(index: int) -> str:
    """An OpenAI-style call id: ``call_`` and 24 random alphanumerics."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One call: ``arguments`` is JSON text (an object), or its start where ``complete`` is False."""

    index: int
    id: str
    name: str
    arguments: str
    complete: bool = True  # False: the reply ended inside this call (arguments cut short)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed call: the first has ``id`` and ``name``, the rest argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        fn = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": fn}


@dataclass
class ParseDelta:
    """What one ``feed`` / ``finish`` adds: content text and call pieces (in order of the text)."""

    content: str = ""
    tool_calls: list = field(default_factory=list)
    incomplete: bool = False  # finish(): the stream ended inside a call


# non-streaming -----------------------------------------------------------------------------------
def parse_tool_calls(text: str, ids: Callable[[int], str] = new_call_id, free_text: bool = True) -> tuple:
    """``(content or None, [ToolCall])`` of a whole reply (see the module docstring): the stream's parse
    of it (:class:`ToolCallParser`, fed the whole text), so the two never differ; a call the reply
    ended inside comes last with ``complete`` False. ``free_text`` False: the reply's grammar allows
    nothing but calls (``tool_choice`` required or named), so text outside them is the format's (a tag
    cut short) and content is None."""
    p = ToolCallParser(ids, free_text)
    parts = [p.feed(text), p.finish()]
    content = "".join(d.content for d in parts)
    calls = list(p.calls)
    if p.cut:  # (its first piece carries the id and name, the rest argument fragments)
        pieces = [c for d in parts for c in d.tool_calls if c.index == len(calls)]
        args = "".join(c.arguments for c in pieces)
        calls.append(ToolCall(len(calls), pieces[0].id or "", pieces[0].name or "", args, complete=False))
    return content or None, calls


# streaming ---------------------------------------------------------------------------------------
def _partial_open(buf: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of the opening tag."""
    for k in range(min(len(buf), len(TOOL_OPEN) - 1), 0, -1):
        if TOOL_OPEN.startswith(buf[-k:]):
            return k
    return 0


def _object_end(text: str, state: list) -> int:
    """Scan ``text`` as the continuation of one JSON object; ``state`` = [depth, in_string, escaped]
    carries across calls. The index just past the object's closing brace, or -1 (not closed yet)."""
    depth, in_str, esc = state
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                state[:] = [0, False, False]
                return i + 1
    state[:] = [depth, in_str, esc]
    return -1


class ToolCallParser:
    """Incremental :func:`parse_tool_calls`: ``feed(text_delta)`` as the reply streams, ``finish()`` at
    its end; each returns a :class:`ParseDelta`. ``calls`` holds the completed :class:`ToolCall` s; ``cut``
    whether the reply ended inside one more, started (its name sent). ``free_text``: as
    :func:`parse_tool_calls`'."""

    def __init__(self, ids: Callable[[int], str] = new_call_id, free_text: bool = True):
        self._ids = ids
        self._free_text = free_text  # False: no content (as parse_tool_calls)
        self._buf = ""
        self._state = "text"  # text | header | args | tail
        self._skip_ws = True  # at the reply's start and after a call
        self._ws = ""  # trailing whitespace held back (dropped if a call or the end follows)
        self._ws_before = ""
        self._scan = [0, False, False]
        self._name, self._id = "", ""
        self._args: list = []
        self.calls: list = []
        self.cut = False  # finish() found the reply inside a call

    def feed(self, text: str) -> ParseDelta:
        out = ParseDelta()
        self._buf += text
        while self._step(out):
            pass
        return out

    def finish(self) -> ParseDelta:
        out = ParseDelta()
        if self._state == "text":
            self._text(self._buf, out)
        else:
            out.incomplete = True
            self.cut = self._state != "header"  # (a call was started: its name and id were sent)
        self._buf, self._ws = "", ""
        return out

    def _text(self, s: str, out: ParseDelta) -> None:
        if not self._free_text:
            return
        if self._skip_ws:
            s = s.lstrip()
            self._skip_ws = not s
        if not s:
            return
        s = self._ws + s
        body = s.rstrip()
        self._ws = s[len(body) :]
        out.content += body

    def _step(self, out: ParseDelta) -> bool:
        """Consume what the buffer allows in the current state; whether to go on."""
        return getattr(self, "_in_" + self._state)(out)

    def _in_text(self, out: ParseDelta) -> bool:
        k = self._buf.find(TOOL_OPEN)
        if k < 0:
            keep = _partial_open(self._buf)
            self._text(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._text(self._buf[:k], out)
        self._ws_before, self._ws = self._ws, ""  # dropped before a call (restored if it is none)
        self._buf = self._buf[k + len(TOOL_OPEN) :]
        self._state = "header"
        return True

    def _in_header(self, out: ParseDelta) -> bool:
        m = HEADER_RE.match(self._buf)
        if m is None:
            if len(self._buf) > MAX_HEADER or TOOL_CLOSE in self._buf:  # not a call after all
                self._state, self._ws = "text", self._ws_before
                self._text(TOOL_OPEN + self._buf, out)
                self._buf = ""
            return False
        self._name = json.loads('"' + m.group(1) + '"')
        index = len(self.calls)
        self._id = self._ids(index)
        out.tool_calls.append(ToolCallDelta(index, self._id, self._name, ""))
        self._buf, self._state, self._args = self._buf[m.end() :], "args", []
        return True

    def _in_args(self, out: ParseDelta) -> bool:
        if not self._args:
            self._buf = self._buf.lstrip()  # whitespace after "arguments": (a chunk may end inside it)
        end = _object_end(self._buf, self._scan)
        piece = self._buf if end < 0 else self._buf[:end]
        if piece:
            self._args.append(piece)
            out.tool_calls.append(ToolCallDelta(len(self.calls), arguments=piece))
        self._buf = "" if end < 0 else self._buf[end:]
        if end >= 0:
            self._state = "tail"
        return end >= 0

    def _in_tail(self, out: ParseDelta) -> bool:
        k = self._buf.find(TOOL_CLOSE)
        if k < 0:
            return False
        index = len(self.calls)
        self.calls.append(ToolCall(index, self._id, self._name, "".join(self._args)))
        self._buf, self._state, self._skip_ws = self._buf[k + len(TOOL_CLOSE) :], "text", True
        return True
