"""Configuration of the submitter and the cancel worker (built once at the edge)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SubmitterConfig:
    batch_size: int = 16
    """Intents claimed (and submitted concurrently) per round by one replica."""
    lease_s: float = 120.0
    """How long a claimed intent is ours; must exceed the adapters' create read timeout."""
    idle_sleep_s: float = 0.5
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    auth_backoff_s: float = 300.0
    """After 401/403: no hot retry, one try per this many seconds (and an alert log line)."""
    same_key_max_tries: int = 8
    """Sends with the same key after an unknown outcome (key-honouring providers), then the
    intent is marked unknown and reconciled by lookup."""
    unavailable_max_tries: int = 30
    """Sends refused as not sent (5xx / connect errors / 429) before the task fails with
    ``provider_unavailable``; never for an intent that may have been sent (maybe_sent)."""
    first_poll_min_s: float = 2.0
    first_poll_max_s: float = 5.0
    """The first poll of a just-submitted attempt: uniform in [min, max] (the poller takes over)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.lease_s <= 0 or self.first_poll_min_s < 0:
            raise ValueError("batch_size >= 1, lease_s > 0, first_poll_min_s >= 0")
        if self.first_poll_max_s < self.first_poll_min_s:
            raise ValueError("first_poll_max_s must be >= first_poll_min_s")


@dataclass(frozen=True, slots=True)
class CancelConfig:
    batch_size: int = 16
    lease_s: float = 60.0
    idle_sleep_s: float = 0.5
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    auth_backoff_s: float = 300.0
    max_tries: int = 20
    """Provider cancel calls before the intent is marked failed (polling still finds the
    outcome; the task stays ``cancel_requested`` until the provider's terminal)."""
    wait_submit_s: float = 1.0
    """Retry delay while the attempt's submit is in flight (no provider id yet)."""
