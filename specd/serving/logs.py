"""JSON log lines: the daemon's formatter and one line per finished request."""

from __future__ import annotations

import logging
import sys

import orjson

reqlog = logging.getLogger("specd.request")


class JsonFormatter(logging.Formatter):
    def format(self, r: logging.LogRecord) -> str:
        d = {"ts": round(r.created, 3), "level": r.levelname.lower(), "logger": r.name, "msg": r.getMessage()}
        fields = getattr(r, "fields", None)
        if fields:
            d.update(fields)
        if r.exc_info:
            d["exc"] = self.formatException(r.exc_info)
        return orjson.dumps(d, default=str).decode()


def setup_logging(level: str = "info") -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(getattr(logging, str(level).upper(), logging.INFO))
    logging.getLogger("websockets").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # (one info line per websocket otherwise)


def _ms(a, b):
    return None if a is None or b is None else round((b - a) * 1000.0, 3)


def log_request(out) -> None:
    """One JSON line per finished request (engine thread)."""
    if not reqlog.isEnabledFor(logging.INFO):
        return
    s = out.seq
    st = s.stats
    reqlog.info(
        "request",
        extra={
            "fields": {
                "id": out.request_id,
                "finish_reason": out.finish_reason,
                "priority": s.priority,
                "prompt_tokens": s.num_prompt,
                "completion_tokens": s.num_output,
                "spec": {
                    "mode": s.spec.mode,
                    "steps": st.steps,
                    "draft_tokens": st.draft_tokens,
                    "accepted_tokens": st.accepted_tokens,
                    "mean_accepted_length": round(st.mean_accepted_length, 4),
                    "acceptance_rate": round(st.acceptance_rate, 4),
                },
                "timing": {
                    "queue_ms": _ms(s.arrival, s.scheduled_time),
                    "ttft_ms": _ms(s.arrival, s.first_token_time),
                    "total_ms": _ms(s.arrival, s.finish_time),
                },
                "preemptions": s.num_preemptions,
            }
        },
    )
