"""When a failed role loop starts again: jittered exponential backoff, capped, reset by health.

Pure arithmetic, no I/O (the supervisor in :mod:`aivedio.process.supervisor` does the waiting).
A loop that fails ``n`` times in a row waits ``min(cap_s, first_s * 2^(n-1))``, shortened by up to
``jitter`` of it at random so replicas that failed together do not restart together. A run that
lasted ``healthy_s`` or longer before it failed counts as healthy: the count starts over at 1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RestartPolicy", "consecutive_failures", "restart_delay"]


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    first_s: float = 0.5
    """Wait before the first restart."""
    cap_s: float = 30.0
    """Longest wait between two restarts."""
    healthy_s: float = 60.0
    """A run this long (or longer) resets the count of consecutive failures."""
    jitter: float = 0.5
    """Fraction of the wait drawn at random: the wait lies in ``[(1 - jitter) * d, d]``."""

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.cap_s:
            raise ValueError("RestartPolicy needs 0 < first_s <= cap_s")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("RestartPolicy.jitter is a fraction in [0, 1]")
        if self.healthy_s < 0:
            raise ValueError("RestartPolicy.healthy_s must not be negative")


def consecutive_failures(before: int, ran_s: float, policy: RestartPolicy) -> int:
    """The count of consecutive failures once a run of ``ran_s`` seconds failed, ``before``
    being the count until then (0 at start)."""
    return 1 if ran_s >= policy.healthy_s else before + 1


def restart_delay(failures: int, policy: RestartPolicy, rand: float) -> float:
    """Seconds to wait before the restart after the ``failures``-th failure in a row (from 1);
    ``rand`` is a uniform draw from ``[0, 1)``."""
    exponent = min(max(failures, 1) - 1, 62)  # 2**62 * first_s is past any cap
    delay = min(policy.cap_s, policy.first_s * 2.0**exponent)
    return delay * (1.0 - policy.jitter * min(max(rand, 0.0), 1.0))
