from __future__ import annotations

import io
import json
import logging

from aivedio.logs import JsonFormatter, RedactingFilter, log, redact_urls


def test_urls_lose_their_query_strings() -> None:
    text = 'GET http://h:1/files/a.mp4?exp=1&sig=abc "done" and https://x.io/cb?token=t#frag'
    assert redact_urls(text) == (
        'GET http://h:1/files/a.mp4?[redacted] "done" and https://x.io/cb?[redacted]'
    )
    assert redact_urls("no url?here=1") == "no url?here=1"


def test_log_lines_never_carry_signed_links() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("test.redaction")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("HTTP Request: GET %s", "http://p/files/x.mp4?exp=9&sig=SECRET")
        log(logger, logging.INFO, "fetched", url="http://p/files/x.mp4?sig=SECRET", size=3)
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "SECRET" not in out
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[0]["msg"] == "HTTP Request: GET http://p/files/x.mp4?[redacted]"
    assert lines[1]["url"] == "http://p/files/x.mp4?[redacted]"
    assert lines[1]["size"] == 3
