"""``specd chat [URL]``: a terminal chat client that streams replies as they arrive.

Multi-turn: the conversation is kept as chat messages and sent whole each turn (``--raw`` sends each
line as a raw prompt instead, no history). ``--once TEXT`` sends one message, prints the reply, exits.
Ctrl-C while a reply streams cancels it; Ctrl-C / Ctrl-D at the prompt quits. The API key goes in an
``Authorization: Bearer`` header. Exit status: 0, 1 on a protocol/server error, 2 if it cannot connect.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import sys

import orjson


def _stats(done: dict, secs: float) -> str:
    u, sp, tm = done.get("usage", {}), done.get("spec", {}), done.get("timing", {})
    n = u.get("completion_tokens", 0)
    parts = [
        f"{n} tokens",
        f"{n / secs:.1f} tok/s" if secs > 0 else None,
        f"{sp.get('mean_accepted_length', 0):.2f} tokens/step" if sp.get("steps") else None,
        f"TTFT {tm['ttft_ms']:.1f} ms" if tm.get("ttft_ms") is not None else None,
        done.get("finish_reason"),
    ]
    return "-- " + ", ".join(p for p in parts if p)


async def _turn(ws, req: dict, out=sys.stdout) -> dict | None:
    """Send one generate, stream its text to ``out``; returns the done message (None on error)."""
    loop = asyncio.get_running_loop()
    await ws.send(orjson.dumps(req).decode())
    t0 = loop.time()
    cancelled = False
    parts: list = []

    def on_sigint():
        nonlocal cancelled
        if not cancelled:
            cancelled = True
            asyncio.ensure_future(ws.send(orjson.dumps({"type": "cancel", "id": req["id"]}).decode()))

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):
        installed = False
    try:
        while True:
            m = orjson.loads(await ws.recv())
            if m.get("id") not in (None, req["id"]):
                continue
            t = m.get("type")
            if t == "delta":
                parts.append(m["text"])
                out.write(m["text"])
                out.flush()
            elif t == "done":
                out.write("\n")
                err = m.get("error")
                if err:
                    print(f"specd: {err.get('code')}: {err.get('message')}", file=sys.stderr)
                print(_stats(m, loop.time() - t0), file=sys.stderr)
                m["_text"] = "".join(parts)
                return m
            elif t == "error":
                print(f"specd: {m.get('code')}: {m.get('message')}", file=sys.stderr)
                if m.get("id") == req["id"] or m.get("code") == "unauthorized":
                    return None
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)


async def chat(args) -> int:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

    headers = {"Authorization": f"Bearer {args.api_key}"} if getattr(args, "api_key", None) else None
    try:
        ws = await connect(args.url, additional_headers=headers, compression=None, max_size=None, open_timeout=10)
    except InvalidStatus as e:
        print(
            f"specd: {args.url}: HTTP {e.response.status_code} {e.response.body.decode(errors='replace').strip()}",
            file=sys.stderr,
        )
        return 2
    except (OSError, asyncio.TimeoutError, InvalidHandshake) as e:
        print(f"specd: cannot connect to {args.url}: {e}", file=sys.stderr)
        return 2
    ids = itertools.count(1)
    messages: list = []
    base = {"type": "generate", "max_tokens": args.max_tokens, "temperature": args.temperature}
    loop = asyncio.get_running_loop()
    try:
        async with ws:
            while True:
                if args.once is not None:
                    text = args.once
                else:
                    try:
                        text = await loop.run_in_executor(None, input, "> ")
                    except (EOFError, KeyboardInterrupt):
                        print()
                        return 0
                    if not text.strip():
                        continue
                req = dict(base, id=f"t{next(ids)}")
                if args.raw:
                    req["prompt"] = text
                else:
                    messages.append({"role": "user", "content": text})
                    req["messages"] = list(messages)
                done = await _turn(ws, req)
                if done is None:
                    if not args.raw:
                        messages.pop()
                    if args.once is not None:
                        return 1
                    continue
                if not args.raw:
                    messages.append({"role": "assistant", "content": done.get("_text", "")})
                if args.once is not None:
                    return 0 if done.get("finish_reason") != "error" else 1
    except ConnectionClosed as e:
        print(f"\nspecd: connection closed ({e})", file=sys.stderr)
        return 1


def run_chat(args) -> int:
    try:
        return asyncio.run(chat(args))
    except KeyboardInterrupt:
        return 130
