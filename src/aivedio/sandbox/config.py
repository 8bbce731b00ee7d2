"""The sandbox provider's configuration: one frozen object, built by the caller (the CLI).

No module of the sandbox reads the environment; ``aivedio sandbox-provider`` builds a
``SandboxConfig`` from ``AIVEDIO_SANDBOX_*`` and passes it to ``create_app`` or ``serve``.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

WEBHOOK_SECRET_PREFIX = "whsec_"  # noqa: S105 (a prefix, not a secret)


def decode_webhook_secret(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret: the base64 part after ``whsec_``."""
    if not secret.startswith(WEBHOOK_SECRET_PREFIX):
        raise ValueError("a webhook secret starts with 'whsec_'")
    try:
        key = base64.b64decode(secret[len(WEBHOOK_SECRET_PREFIX) :], validate=True)
    except binascii.Error as exc:
        raise ValueError("a webhook secret is 'whsec_' + base64") from exc
    if not key:
        raise ValueError("a webhook secret must not be empty")
    return key


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxConfig:
    """Everything the sandbox provider needs; timings in seconds.

    - ``webhook_secrets``: ``whsec_`` keys, newest first; every webhook is signed with each one.
    - ``public_url``: the base URL clients reach the sandbox at; signed file URLs start with it.
    - ``rate_cap_qps``: with a value, ``/v1`` requests beyond it within one unix second get 429.
    - ``queue_s``, ``duration_s``, ``steps``: a generation's default timeline (queued for
      ``queue_s``, then running through ``steps`` progress steps over ``duration_s``), which
      ``params.sandbox`` overrides per generation.
    - ``seed``: seeds the chaos dice; ``None`` draws a random seed.
    """

    api_key: str
    webhook_secrets: tuple[str, ...] = ()
    public_url: str = "http://127.0.0.1:9000"
    rate_cap_qps: float | None = None
    queue_s: float = 1.0
    duration_s: float = 8.0
    steps: int = 4
    output_url_ttl_s: float = 600.0
    webhook_timeout_s: float = 5.0
    webhook_max_attempts: int = 5
    webhook_backoff_s: float = 0.5
    webhook_concurrency: int = 32
    callback_wait_s: float = 10.0
    submit_hold_s: float = 15.0
    reorder_hold_s: float = 2.0
    stats_window_s: int = 3600
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.api_key:
            raise ValueError("the sandbox provider needs an api_key")
        for secret in self.webhook_secrets:
            decode_webhook_secret(secret)
        if self.rate_cap_qps is not None and self.rate_cap_qps <= 0:
            raise ValueError("rate_cap_qps must be positive")
        if self.steps < 1:
            raise ValueError("steps must be at least 1")
        if min(self.queue_s, self.duration_s) < 0:
            raise ValueError("timings must not be negative")
        if self.webhook_max_attempts < 1 or self.webhook_concurrency < 1:
            raise ValueError("webhook_max_attempts and webhook_concurrency must be at least 1")

    @property
    def webhook_keys(self) -> tuple[bytes, ...]:
        return tuple(decode_webhook_secret(s) for s in self.webhook_secrets)

    @property
    def base_url(self) -> str:
        return self.public_url.rstrip("/")
