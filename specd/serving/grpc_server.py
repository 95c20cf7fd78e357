"""gRPC front end: ``specd.v1.Specd/Generate`` (server streaming), grpc.health.v1, reflection.

    server = await start_grpc_server(async_engine, "127.0.0.1", 8766, api_key=None)
    server.port                # the bound port (useful with port 0)
    server.set_serving(False)  # health -> NOT_SERVING at once (e.g. on SIGTERM, before draining)
    await server.stop(grace)   # health -> NOT_SERVING, then grpc's graceful stop

One ``Delta`` per engine step, then one ``Done``; errors end the call with a status code whose
message is ``"<protocol code>: <message>"`` (code also in trailing metadata ``specd-error-code``);
see proto/specd/v1/specd.proto. Constraints (``response_format``, ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` as JSON text, vLLM's ``structured_outputs``) are read by
``specd.structured.grammar_spec`` and compiled before any Delta (a refusal: INVALID_ARGUMENT with the
grammar's code); with tools the ``Done`` carries the reply's parsed ``tool_calls`` and ``content``.

A call the client cancels (or a dropped connection) cancels the
handler task, which closes the engine stream and so aborts the request and frees its KV blocks.

The Generate handler is registered by hand (a generic handler) rather than through the generated
``specd_pb2_grpc``: the request arrives as raw bytes and is parsed here, so a malformed payload gets
INVALID_ARGUMENT with the protocol's ``invalid_request`` code instead of grpc's generic error, and
the server does not depend on the grpcio version the stubs were generated with.

Health (service names "" and "specd.v1.Specd") is SERVING while ``async_engine.ready``, the engine
completes steps (``unhealthy_reason()`` is None) and not switched off by ``set_serving(False)``; it is polled every
``HEALTH_POLL_S``. With ``api_key`` set,
Generate requires metadata ``authorization: Bearer KEY``; health and reflection stay open (probes).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import uuid

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health as _health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.engine.requests import SAMPLING_FIELDS, RequestError
from specd.serving.proto.specd.v1 import specd_pb2 as pb
from specd.serving.request_build import build_request_async, check_id, summarize
from specd.structured.errors import CODES as GRAMMAR_CODES
from specd.structured.tool_parser import parse_tool_calls

log = logging.getLogger("specd.grpc")

__all__ = ["start_grpc_server", "SpecdServicer", "STATUS_OF", "SERVICE_NAME"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Specd"].full_name  # "specd.v1.Specd"
HEALTH_POLL_S = 0.25

STATUS_OF = {
    "invalid_request": grpc.StatusCode.INVALID_ARGUMENT,
    "too_long": grpc.StatusCode.OUT_OF_RANGE,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "shutting_down": grpc.StatusCode.UNAVAILABLE,
    "unauthorized": grpc.StatusCode.UNAUTHENTICATED,
    "duplicate_id": grpc.StatusCode.ALREADY_EXISTS,
    "internal": grpc.StatusCode.INTERNAL,
    **{code: grpc.StatusCode.INVALID_ARGUMENT for code in GRAMMAR_CODES},  # a constraint refused
}
_PRIORITY = {pb.PRIORITY_UNSPECIFIED: None, pb.PRIORITY_INTERACTIVE: "interactive", pb.PRIORITY_BATCH: "batch"}
_MODE = {
    pb.SPECULATION_MODE_UNSPECIFIED: None,
    pb.SPECULATION_MODE_AUTO: "auto",
    pb.SPECULATION_MODE_OFF: "off",
    pb.SPECULATION_MODE_CHAIN: "chain",
    pb.SPECULATION_MODE_TREE: "tree",
    pb.SPECULATION_MODE_HEAD: "head",
    pb.SPECULATION_MODE_NGRAM: "ngram",
    pb.SPECULATION_MODE_HYBRID: "hybrid",
}
_ids = itertools.count()
_INSTANCE = uuid.uuid4().hex[:6]


_FIELDS = pb.GenerateRequest.DESCRIPTOR.fields_by_name


def _sampling(req: pb.GenerateRequest) -> dict:
    """The request's ``SamplingParams`` fields, read by name from the proto fields of the same names
    (an unset optional or an empty repeated field: None, the default)."""
    out = {}
    for name in SAMPLING_FIELDS:
        fd = _FIELDS.get(name)
        if fd is None:  # (not on this wire)
            continue
        v = getattr(req, name)
        if fd.is_repeated:
            out[name] = list(v) if v else None
        else:
            out[name] = v if not fd.has_presence or req.HasField(name) else None
    return out


def _json_field(req: pb.GenerateRequest, name: str, code: str):
    """An optional field holding JSON text, parsed (None when unset)."""
    if not req.HasField(name):
        return None
    try:
        return json.loads(getattr(req, name))
    except ValueError as e:
        raise RequestError(code, f"{name} is not valid JSON: {e}", name) from None


def _tool_choice(req: pb.GenerateRequest):
    if not req.HasField("tool_choice"):
        return None
    v = req.tool_choice
    return _json_field(req, "tool_choice", "invalid_tools") if v.lstrip().startswith("{") else v


def _structured_outputs(req: pb.GenerateRequest) -> dict | None:
    if not req.HasField("structured_outputs"):
        return None
    so = req.structured_outputs
    out = {k: getattr(so, k) for k in ("json", "regex", "grammar") if so.HasField(k)}
    if so.choice:
        out["choice"] = list(so.choice)
    if so.json_object:
        out["json_object"] = True
    return out


def _grammar(req: pb.GenerateRequest):
    """The request's constraint (``specd.structured.grammar_spec`` over the JSON fields), or None."""
    from specd.structured import GrammarError, grammar_spec

    body = {
        "response_format": _json_field(req, "response_format", "invalid_response_format"),
        "tools": _json_field(req, "tools", "invalid_tools"),
        "tool_choice": _tool_choice(req),
        "parallel_tool_calls": req.parallel_tool_calls if req.HasField("parallel_tool_calls") else None,
        "structured_outputs": _structured_outputs(req),
    }
    try:
        return grammar_spec(body)
    except GrammarError as e:
        raise RequestError(e.code, e.message, e.field) from None


def _message(m: pb.ChatMessage) -> dict:
    out = {"role": m.role, "content": m.content if m.content or not m.tool_calls else None}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _to_engine_args(req: pb.GenerateRequest) -> dict:
    """Proto request -> ``build_request`` keyword arguments (unset optional fields -> None)."""
    check_id(req.id)
    if req.priority not in _PRIORITY:
        raise RequestError("invalid_request", f"unknown priority {req.priority}", "priority")
    sp = req.speculation
    if sp.mode not in _MODE:
        raise RequestError("invalid_request", f"unknown speculation mode {sp.mode}", "speculation")
    speculation = {"mode": _MODE[sp.mode]}
    if sp.HasField("max_draft_tokens"):
        speculation["max_draft_tokens"] = sp.max_draft_tokens
    return dict(
        messages=[_message(m) for m in req.messages] if req.messages else None,
        prompt=req.prompt if req.HasField("prompt") else None,
        priority=_PRIORITY[req.priority],
        speculation=speculation,
        grammar=_grammar(req),
        **_sampling(req),
    )


def _done(seq, finish_reason: str, text: str | None = None, free_text: bool = True) -> pb.Done:
    """The final message; ``text``: the whole reply, parsed for tool calls (a request with tools;
    ``free_text``: its ``ToolCallSpec.free_text``)."""
    s = summarize(seq)
    # proto floats have no null: an event that never happened (None) is 0, as is a negative span
    timing = {k: 0.0 if v is None else max(0.0, v) for k, v in s["timing"].items()}
    done = pb.Done(
        finish_reason=finish_reason or "",
        usage=pb.Usage(**s["usage"]),
        spec=pb.SpecStats(**s["spec"]),
        timing=pb.Timing(**timing),
    )
    if text is not None and finish_reason in ("stop", "length"):
        content, calls = parse_tool_calls(text, free_text=free_text)
        done.finish_reason = "tool_calls" if calls and calls[-1].complete and finish_reason == "stop" else finish_reason
        done.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
        if content is not None:
            done.content = content
    return done


class SpecdServicer:
    def __init__(self, async_engine, api_key: str | None = None):
        self.ae = async_engine
        self._auth = f"Bearer {api_key}".encode() if api_key else None

    @staticmethod
    def _tenant(context) -> str | None:
        """The engine's tenant of the call's ``authorization: Bearer KEY`` (None without one)."""
        from specd.serving.auth import Auth

        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                v = value if isinstance(value, str) else bytes(value).decode("latin-1")
                scheme, _, token = v.partition(" ")
                return Auth.tenant(token.strip()) if scheme.lower() == "bearer" else None
        return None

    def _authorized(self, context) -> bool:
        if self._auth is None:
            return True
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                v = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(v, self._auth)
        return False

    @staticmethod
    async def _fail(context, code: str, message: str) -> None:
        await context.abort(
            STATUS_OF.get(code, grpc.StatusCode.INTERNAL),
            f"{code}: {message}",
            trailing_metadata=(("specd-error-code", code),),
        )

    async def generate(self, raw: bytes, context) -> None:
        """The Generate handler (request as raw bytes; responses written with ``context.write``)."""
        try:
            await self._generate(raw, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - a bug must not become an opaque UNKNOWN
            log.exception("Generate failed")
            await self._fail(context, "internal", f"{type(e).__name__}: {e}")

    async def _generate(self, raw: bytes, context) -> None:
        if not self._authorized(context):
            await self._fail(context, "unauthorized", "missing or wrong 'authorization: Bearer KEY' metadata")
        try:
            req = pb.GenerateRequest.FromString(raw)
        except (DecodeError, ValueError) as e:
            await self._fail(context, "invalid_request", f"malformed GenerateRequest: {e}")
        client_id = req.id
        rid = f"grpc-{_INSTANCE}-{next(_ids)}" + (f":{client_id[:64]}" if client_id else "")
        try:
            ae = self.ae
            built = await build_request_async(ae.tokenizer, max_model_len=ae.max_model_len, **_to_engine_args(req))
            if built.grammar is not None:
                await _check_grammar(ae, built.grammar)
        except RequestError as e:
            await self._fail(context, e.code, str(e))
        stream = self.ae.generate(built.submit(rid, self._tenant(context)))
        n, parts = 0, ([] if built.tools is not None else None)
        free = built.tools is None or built.tools.free_text
        try:
            async for out in stream:
                if out.token_ids or out.text:
                    await context.write(
                        pb.GenerateResponse(id=client_id, delta=pb.Delta(seq=n, text=out.text, token_ids=out.token_ids))
                    )
                    n += 1
                if parts is not None:
                    parts.append(out.text)
                if out.finished:
                    text = "".join(parts) if parts is not None else None
                    await context.write(
                        pb.GenerateResponse(id=client_id, done=_done(out.seq, out.finish_reason, text, free))
                    )
                    return
            raise RequestError("internal", "the engine stream ended without finishing the request")
        except RequestError as e:
            await self._fail(context, e.code, str(e))
        finally:
            # Cancelled (client went away) or failed: closing the stream aborts the request in the
            # engine, which frees its KV blocks on its next step. A no-op once it has finished.
            await stream.aclose()


async def _check_grammar(ae, spec) -> None:
    """Compile the request's grammar before any Delta: a refusal ends the call (INVALID_ARGUMENT)."""
    from specd.structured import GrammarError

    try:
        await ae.check_grammar(spec)
    except GrammarError as e:
        raise RequestError(e.code, e.message, e.field) from None


class _Health:
    """grpc.health.v1 status kept equal to ``async_engine.ready``, healthy and not switched off."""

    def __init__(self, async_engine):
        self.ae = async_engine
        self.servicer = _health.aio.HealthServicer()
        self.enabled = True
        self._task: asyncio.Task | None = None
        self._pending: set = set()  # set_serving's update tasks (keep references until done)
        self._last = None

    async def sync(self) -> None:
        ok = self.enabled and bool(self.ae.ready) and self.ae.unhealthy_reason() is None
        st = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        if st != self._last:
            self._last = st
            for name in ("", SERVICE_NAME):
                await self.servicer.set(name, st)

    async def _poll(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception:  # noqa: BLE001 - never let the poller die
                log.exception("health update failed")
            await asyncio.sleep(HEALTH_POLL_S)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll(), name="specd-grpc-health")

    def set_serving(self, serving: bool) -> None:
        self.enabled = bool(serving)
        if self._task is not None:
            t = asyncio.get_running_loop().create_task(self.sync())
            self._pending.add(t)
            t.add_done_callback(self._pending.discard)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self.servicer.enter_graceful_shutdown()


async def start_grpc_server(
    async_engine, host: str, port: int, api_key: str | None = None, max_message_bytes: int = 4 << 20
) -> grpc.aio.Server:
    """Start the gRPC server on ``host:port`` (0 = any free port, see ``server.port``) and return it.

    Raises RuntimeError if the address cannot be bound. The caller owns shutdown:
    ``await server.stop(grace)``.
    """
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),  # a second daemon on the same port must fail, not share it
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
    )
    servicer = SpecdServicer(async_engine, api_key)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE_NAME,
                {
                    "Generate": grpc.unary_stream_rpc_method_handler(
                        servicer.generate,
                        request_deserializer=None,
                        response_serializer=pb.GenerateResponse.SerializeToString,
                    ),
                },
            ),
        )
    )
    health = _Health(async_engine)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    addr = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(addr)
    except RuntimeError as e:
        raise RuntimeError(f"gRPC: cannot bind {addr}: {e}") from None
    if not bound:  # older grpcio returns 0 instead of raising
        raise RuntimeError(f"gRPC: cannot bind {addr}")
    await health.sync()
    await server.start()
    health.start()

    grpc_stop = server.stop

    async def stop(grace: float | None = None):
        await health.shutdown()
        return await grpc_stop(grace)

    server.stop = stop
    server.port = bound
    server.set_serving = health.set_serving
    server.servicer = servicer
    log.info("gRPC listening on %s:%d", host, bound)
    return server
