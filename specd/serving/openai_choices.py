"""``n`` choices of one chat / completions request (OpenAI's ``n``): each choice is an engine request of
its own (request id ``{id}-{i}``, seed ``seed + i`` when the request is seeded), so the engine batches
them like any requests and the prefix cache serves the shared prompt after the first; the answer is
one response.

- Whole: every choice's reply, ``choices[i]`` with ``index`` i; usage counts the prompt once and the
  choices' completion tokens (and speculation) summed, as OpenAI and vLLM report it.
- Streamed: each choice's chunks (with ``index`` i) as its steps come, interleaved; each choice ends
  with its own ``finish_reason`` chunk; then one usage chunk (``stream_options.include_usage``) and
  ``[DONE]``. A client that disconnects cancels every choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from specd.serving import openai_format as F

__all__ = ["merged_events", "one_response", "summed_usage"]


def summed_usage(uses: list) -> dict:
    """The usage of ``n`` choices: the prompt once, completion tokens and speculation summed."""
    first = uses[0]
    completion = sum(u["completion_tokens"] for u in uses)
    steps = sum(u["speculation"]["steps"] for u in uses)
    drafted = sum(u["speculation"]["draft_tokens"] for u in uses)
    accepted = sum(u["speculation"]["accepted_tokens"] for u in uses)
    return {
        **first,
        "completion_tokens": completion,
        "total_tokens": first["prompt_tokens"] + completion,
        "speculation": {
            "steps": steps,
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "mean_accepted_length": round(1 + accepted / steps, 4) if steps else 1.0,
        },
    }


def one_response(bodies: list) -> dict:
    """The choices' single-choice responses as one (choice i from body i, usage summed)."""
    out = dict(bodies[0])
    out["choices"] = [dict(b["choices"][0], index=i) for i, b in enumerate(bodies)]
    out["usage"] = summed_usage([b["usage"] for b in bodies])
    return out


async def merged_events(gens: list, head: tuple, with_usage: bool, obj: str, uses: list) -> AsyncIterator[bytes]:
    """The choices' event streams (``gens``: each yields its chunks and appends its usage to ``uses``
    when it finishes, without a usage chunk or ``[DONE]`` of its own) as one stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(events) -> None:
        try:
            async for ev in events:
                await queue.put(ev)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        left = len(tasks)
        while left:
            ev = await queue.get()
            if ev is None:
                left -= 1
            else:
                yield ev
        if with_usage and len(uses) == len(gens):
            yield F.sse(F.usage_chunk(*head, obj, summed_usage(uses)))
        yield F.DONE
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
