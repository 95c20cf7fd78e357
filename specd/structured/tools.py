"""Tool calls: the request's tool list, ``tool_choice``, the text format calls are written in, and the
grammar that holds a reply to it.

**The tool-call text format** (Hermes-style; for models whose chat template does not render tools,
specd puts :func:`tools_system_prompt` in a system message and parses the reply). A call is::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

an opening tag line, one JSON object with exactly the keys ``name`` (a function of the request's
``tools``) then ``arguments`` (an object valid under that function's ``parameters`` schema), and a
closing tag line. Several calls (``parallel_tool_calls``) follow one another separated by one
newline. Text before the first call is the reply's ``content``.

**What the grammar enforces**, by ``tool_choice``:

- ``"none"`` (or no tools): nothing; the reply is free text and never parsed for calls.
- ``"required"``: the reply is one call (several, newline-separated, with ``parallel_tool_calls``)
  to any of the tools, then the end of the reply; no text before it.
- a named function (``{"type": "function", "function": {"name": "f"}}``): the same, to ``f`` only.
- ``"auto"``: a *lazy* grammar: free text until the opening tag :data:`TOOL_OPEN` appears, then a
  well-formed call; after its closing tag free text again (or, without ``parallel_tool_calls``, the
  end of the reply). Like llama.cpp's lazy grammars (free until a trigger word, then constrained)
  and xgrammar's ``triggered_tags`` structural tag, which is what it compiles to.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specd.structured.errors import GrammarError
from specd.structured.exactness import refuse_unenforced

__all__ = [
    "ARGS_KEY",
    "TOOL_CLOSE",
    "TOOL_OPEN",
    "ToolCallSpec",
    "ToolFunction",
    "call_prefix",
    "structural_tag",
    "tool_call_spec",
    "tools_system_prompt",
]

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
ARGS_KEY = "arguments"
CALL_SEPARATOR = "\n"
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}


@dataclass(frozen=True, eq=False)
class ToolFunction:
    """One function tool: its ``name``, ``parameters`` JSON schema and ``description``."""

    name: str
    parameters: dict
    description: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "parameters": self.parameters, "description": self.description}


@dataclass(frozen=True, eq=False)
class ToolCallSpec:
    """The tools a reply may call and how: ``choice`` is ``"auto"``, ``"required"`` or ``"named"``
    (the function ``name`` only)."""

    functions: tuple
    choice: str
    parallel: bool = True
    name: str | None = None

    def __post_init__(self):
        if self.choice not in ("auto", "required", "named") or (self.choice == "named") != (self.name is not None):
            raise ValueError(f"tool choice {self.choice!r} with name {self.name!r}")

    @property
    def allowed(self) -> tuple:
        """The functions the grammar lets the reply call (one for a named choice)."""
        if self.choice != "named":
            return self.functions
        return tuple(f for f in self.functions if f.name == self.name)

    @property
    def free_text(self) -> bool:
        """Whether the reply may hold text outside its calls (``auto``; else nothing but calls)."""
        return self.choice == "auto"

    def to_json(self) -> dict:
        fns = [f.to_json() for f in self.functions]
        return {"functions": fns, "choice": self.choice, "name": self.name, "parallel": self.parallel}


def call_prefix(name: str) -> str:
    """The text every call to ``name`` starts with, up to its arguments' opening brace."""
    return f'{TOOL_OPEN}\n{{"name": {json.dumps(name)}, "{ARGS_KEY}": '


def _function(i: int, tool: Any) -> ToolFunction:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise GrammarError("invalid_tools", f"{where} must be an object with type 'function'", "tools")
    fn = tool.get("function", tool if "name" in tool else None)  # the Responses API's tools are flat
    if not isinstance(fn, Mapping):
        raise GrammarError("invalid_tools", f"{where}.function must be an object", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise GrammarError("invalid_tools", f"{where}.function.name must match [A-Za-z0-9_-]{{1,64}}", "tools")
    params = fn.get("parameters", EMPTY_PARAMETERS)
    if params is None:
        params = EMPTY_PARAMETERS
    if not isinstance(params, Mapping):
        raise GrammarError("invalid_tools", f"{where}.function.parameters must be a JSON schema object", "tools")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise GrammarError("invalid_tools", f"{where}.function.description must be a string", "tools")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise GrammarError("invalid_tools", f"{where}.function.strict must be a boolean", "tools")
    if strict:
        try:
            refuse_unenforced(params, f"{where}.function.parameters")
        except GrammarError as e:
            raise GrammarError("invalid_tools", e.message, "tools") from None
    return ToolFunction(name, dict(params), desc)


def _choice(tool_choice: Any, names: list) -> tuple:
    """``(choice, name)``: ``("none" | "auto" | "required", None)`` or ``("named", function name)``."""
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")  # Responses API: flat
        if isinstance(name, str) and name in names:
            return "named", name
        raise GrammarError("invalid_tools", f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    raise GrammarError(
        "invalid_tools", "tool_choice must be 'none', 'auto', 'required' or {type: function, ...}", "tool_choice"
    )


def tool_call_spec(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolCallSpec | None:
    """The request's tool fields checked and normalized; None when no grammar applies (no tools, or
    ``tool_choice: "none"``). Chat Completions' tools (``{"type": "function", "function": {...}}``)
    and the Responses API's flat ones (``{"type": "function", "name": ..., "parameters": ...}``)."""
    if tools is None or (isinstance(tools, Sequence) and not isinstance(tools, str) and not tools):
        if tool_choice not in (None, "none", "auto"):
            raise GrammarError("invalid_tools", "tool_choice needs a non-empty tools list", "tool_choice")
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise GrammarError("invalid_tools", "tools must be a list of function tools", "tools")
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise GrammarError("invalid_tools", f"tools has the function name {dup[0]!r} more than once", "tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise GrammarError("invalid_tools", "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    choice, name = _choice(tool_choice, names)
    if choice == "none":
        return None
    return ToolCallSpec(functions, choice, True if parallel_tool_calls is None else parallel_tool_calls, name)


def _schema_content(fn: ToolFunction) -> dict:
    return {"type": "json_schema", "json_schema": fn.parameters}


def structural_tag(spec: ToolCallSpec, content: Callable[[ToolFunction], dict] = _schema_content) -> dict:
    """The xgrammar structural tag for ``spec``: calls separated by newlines (``required`` / named),
    or triggered by :data:`TOOL_OPEN` inside free text (``auto``). ``content(fn)``: the format of
    ``fn``'s arguments (default: its ``parameters`` as a json_schema format)."""
    tags = [
        {"type": "tag", "begin": call_prefix(f.name), "content": content(f), "end": "}\n" + TOOL_CLOSE}
        for f in spec.allowed
    ]
    if spec.choice == "auto":
        fmt = {
            "type": "triggered_tags",
            "triggers": [TOOL_OPEN],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not spec.parallel,
        }
    else:
        fmt = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": CALL_SEPARATOR,
            "at_least_one": True,
            "stop_after_first": not spec.parallel,
        }
    return {"type": "structural_tag", "format": fmt}


def tools_system_prompt(spec: ToolCallSpec) -> str:
    """A system message that tells a model without a tool-aware chat template the tools and the format."""
    lines = [
        "You can call these functions (JSON schema of each one's arguments):",
        *(json.dumps(f.to_json(), ensure_ascii=False) for f in spec.allowed),
        "",
        f"To call a function, reply with {TOOL_OPEN} on a line, then one line "
        f'{{"name": <function name>, "{ARGS_KEY}": <arguments object>}}, then {TOOL_CLOSE} on a line.',
    ]
    if spec.parallel:
        lines.append("You may write several calls, one after another.")
    if spec.choice == "required":
        lines.append("You must call a function.")
    elif spec.choice == "named":
        lines.append(f"You must call {spec.name}.")
    return "\n".join(lines)
