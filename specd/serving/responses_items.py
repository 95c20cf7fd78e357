"""A Responses API reply's output items and their streaming events: one assistant ``message`` (its
text) and, for a request with function tools, one ``function_call`` item per call, in the order they
started.

Without tools the message is opened at once (``response.output_item.added``,
``response.content_part.added``) and every step's text is a ``response.output_text.delta``. With
tools the reply is parsed for calls as it streams (``specd.structured.ToolCallParser``): the
message is opened by the first text outside a call (a ``required`` reply has none, and no message
item), and each call is an item of its own, as OpenAI streams them::

    response.output_item.added              {"item": {"type": "function_call", "id": "fc_...", "call_id",
                                             "name", "arguments": "", "status": "in_progress"}}
    response.function_call_arguments.delta  {"item_id", "output_index", "delta"}      (one per step)
    response.function_call_arguments.done   {"item_id", "output_index", "arguments"}
    response.output_item.done               {"item": {... "arguments": the whole text, "status": "completed"}}

A call the reply did not finish (``max_output_tokens``) ends with status ``incomplete``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from specd.structured.tool_parser import ToolCallParser

__all__ = ["OutputItems"]


@dataclass
class _Call:
    id: str  # fc_... (the item's id)
    call_id: str
    name: str
    parts: list = field(default_factory=list)
    done: bool = False

    def item(self, status: str) -> dict:
        args = "".join(self.parts)
        return {
            "type": "function_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": args,
            "status": status,
        }


class OutputItems:
    """One reply's items as it streams. ``event(kind, **fields)``: the turn's event maker (numbers
    them). ``tools``: parse for calls (None: plain text, the message opened at once)."""

    def __init__(self, msg_id: str, event, tools=None):
        self.msg_id, self.event = msg_id, event
        self.parser = ToolCallParser(free_text=tools.free_text) if tools is not None else None
        self.order: list = []  # "message" or a _Call, in the order the items were added
        self.parts: list = []  # the message's text
        self.calls: dict = {}  # call index -> _Call

    @property
    def message_index(self) -> int | None:
        return self.order.index("message") if "message" in self.order else None

    def message(self, status: str) -> dict:
        part = {"type": "output_text", "text": "".join(self.parts), "annotations": [], "logprobs": []}
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": [part]}

    def _loc(self) -> dict:
        return {"item_id": self.msg_id, "output_index": self.message_index, "content_index": 0}

    def start(self) -> list:
        """The events before the first step (the message, when there are no tools)."""
        return self._open_message() if self.parser is None else []

    def _open_message(self) -> list:
        self.order.append("message")
        item = {"type": "message", "id": self.msg_id, "status": "in_progress", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=self.message_index, item=item),
            self.event("response.content_part.added", **self._loc(), part=part),
        ]

    def _text(self, text: str) -> list:
        if not text:
            return []
        out = self._open_message() if self.message_index is None else []
        self.parts.append(text)
        return out + [self.event("response.output_text.delta", **self._loc(), delta=text, logprobs=[])]

    def step(self, text: str, last: bool = False) -> list:
        """The events of one step's text (``last``: the reply's end, held-back text included)."""
        if self.parser is None:
            return self._text(text)
        d = self.parser.feed(text)
        if last:
            end = self.parser.finish()
            d.content += end.content
        out = self._text(d.content)
        for c in d.tool_calls:
            out += self._call_piece(c)
        return out + self._completed()

    def _call_piece(self, c) -> list:
        if c.id is not None:
            call = self.calls[c.index] = _Call("fc_" + uuid.uuid4().hex, c.id, c.name)
            self.order.append(call)
            item = call.item("in_progress")
            return [self.event("response.output_item.added", output_index=len(self.order) - 1, item=item)]
        call = self.calls[c.index]
        call.parts.append(c.arguments)
        loc = {"item_id": call.id, "output_index": self.order.index(call)}
        return [self.event("response.function_call_arguments.delta", **loc, delta=c.arguments)]

    def _completed(self) -> list:
        """Done events of the calls the parser has completed since the last step."""
        out = []
        for done in self.parser.calls:
            call = self.calls[done.index]
            if call.done:
                continue
            call.done = True
            loc = {"item_id": call.id, "output_index": self.order.index(call)}
            out.append(self.event("response.function_call_arguments.done", **loc, arguments="".join(call.parts)))
            item = call.item("completed")
            out.append(self.event("response.output_item.done", output_index=loc["output_index"], item=item))
        return out

    def finish(self, status: str) -> list:
        """The closing events: the message's (an empty one for a reply with neither text nor calls),
        and those of a call the reply did not finish."""
        out = self._open_message() if not self.order else []
        for i, it in enumerate(self.order):
            if it == "message":
                loc, msg = self._loc(), self.message(status)
                out.append(self.event("response.output_text.done", **loc, text=msg["content"][0]["text"], logprobs=[]))
                out.append(self.event("response.content_part.done", **loc, part=msg["content"][0]))
                out.append(self.event("response.output_item.done", output_index=i, item=msg))
            elif not it.done:
                out.append(self.event("response.output_item.done", output_index=i, item=it.item("incomplete")))
        return out

    def output(self, status: str) -> list:
        """The response object's ``output``."""
        return [
            self.message(status) if it == "message" else it.item("completed" if it.done else "incomplete")
            for it in self.order
        ]

    def history(self) -> dict:
        """The reply as a chat message (what a later ``previous_response_id`` continues)."""
        content = "".join(self.parts) if "message" in self.order else None
        m: dict = {"role": "assistant", "content": content}
        calls = [it for it in self.order if it != "message" and it.done]
        if calls:
            m["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": "".join(c.parts)}}
                for c in calls
            ]
        elif content is None:
            m["content"] = ""
        return m
