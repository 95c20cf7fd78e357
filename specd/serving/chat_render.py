"""Chat messages with tool calls and tool results, and a request's tools, as the model's prompt.

Messages (already checked: ``request_build.check_prompt``) are ``{"role", "content"}``; an assistant
message may add ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments"}}]``,
``arguments`` JSON text; its ``content`` may then be None) and a tool result (role ``tool``) its
``tool_call_id``. ``tools`` is the request's ``specd.structured.ToolCallSpec`` (None: no tools, or
``tool_choice: "none"``).

- A chat template that renders tools (its text names ``tools``): the messages go to it as Hugging
  Face templates take them (an assistant's calls with their arguments as objects, tool results with
  their ``tool_call_id`` and the function's ``name``) and the functions as ``tools=``.
- Otherwise (no tool-aware template, or no template at all): ``tools_system_prompt(tools)`` joins the
  system message (one is added first when there is none), an assistant's calls are written after
  its content in specd's tool-call text format (``specd.structured.tools``: ``<tool_call>`` / one JSON
  line / ``</tool_call>``), and tool results become user turns ``<tool_response>\\n...\\n</tool_response>``
  (consecutive results merged into one turn, so that templates that want user and assistant turns to
  alternate accept them).
"""

from __future__ import annotations

import json
import re

from specd.structured.tools import TOOL_CLOSE, TOOL_OPEN, ToolCallSpec, tools_system_prompt

__all__ = ["RESPONSE_CLOSE", "RESPONSE_OPEN", "call_text", "renders_tools", "template_messages", "text_messages"]

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_TOOLS_RE = re.compile(r"\btools\b")


def renders_tools(tokenizer) -> bool:
    """The tokenizer's chat template renders a ``tools`` list (a named ``tool_use`` template counts)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "tool_use" in t or any(isinstance(v, str) and _TOOLS_RE.search(v) for v in t.values())
    return isinstance(t, str) and bool(_TOOLS_RE.search(t))


def _arguments(text: str):
    """A call's arguments as the object a template writes (its text when it is no JSON object)."""
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return v if isinstance(v, dict) else text


def call_text(call: dict) -> str:
    """One call in specd's text format (what the grammar makes the model write)."""
    fn = call["function"]
    args = fn["arguments"] if isinstance(_arguments(fn["arguments"]), dict) else json.dumps(fn["arguments"])
    return f'{TOOL_OPEN}\n{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": {args}}}\n{TOOL_CLOSE}'


def _functions(tools: ToolCallSpec | None) -> list | None:
    if tools is None:
        return None
    return [
        {"type": "function", "function": {"name": f.name, "description": f.description, "parameters": f.parameters}}
        for f in tools.allowed
    ]


def template_messages(messages: list, tools: ToolCallSpec | None) -> tuple:
    """``(messages, tools)`` for a chat template that renders tools."""
    names: dict = {}
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                names[c["id"]] = c["function"]["name"]
                fn = {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                calls.append({"id": c["id"], "type": "function", "function": fn})
            m["tool_calls"], m["content"] = calls, m.get("content") or ""
        elif m["role"] == "tool" and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out, _functions(tools)


def text_messages(messages: list, tools: ToolCallSpec | None) -> list:
    """``[{"role", "content"}]`` with tools, calls and results written as text (see the module docstring)."""
    out: list = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if m.get("tool_calls"):
            content = "\n".join(([content] if content else []) + [call_text(c) for c in m["tool_calls"]])
        if role == "tool":
            block = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
                continue
            out.append({"role": "user", "content": block, "_results": True})
            continue
        out.append({"role": role, "content": content})
    if tools is not None:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return [{"role": m["role"], "content": m["content"]} for m in out]
