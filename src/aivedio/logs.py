"""Structured logs: one JSON object per line, carrying the trace id of the request or callback."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import secrets
import sys
import time
from typing import Any

trace_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("trace_id", default=None)


def new_trace_id() -> str:
    return "trc_" + secrets.token_hex(12)


# A URL's query and fragment: where signed links, callback tokens and stream tokens live.
_URL_TAIL = re.compile(r"""((?:https?|wss?)://[^\s?#"'<>]+)[?#][^\s"'<>]*""")


def redact_urls(text: str) -> str:
    """Every URL in ``text`` without its query string (``?[redacted]`` instead)."""
    return _URL_TAIL.sub(r"\1?[redacted]", text)


class RedactingFilter(logging.Filter):
    """Last line of defence: no log line leaves with a URL's query string, whoever logged it
    (libraries log request URLs: httpx at INFO would log signed output links)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "://" in message:
            record.msg, record.args = redact_urls(message), ()
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            record.fields = {
                k: redact_urls(v) if isinstance(v, str) and "://" in v else v
                for k, v in fields.items()
            }
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        trace_id = trace_id_var.get()
        if trace_id:
            entry["trace_id"] = trace_id
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            entry.update(extra)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # One line per outbound request is noise, and its URL may be a signed link.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def log(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log ``msg`` with structured ``fields`` (never pass secrets or provider payloads here)."""
    logger.log(level, msg, extra={"fields": fields})
