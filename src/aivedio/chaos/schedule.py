"""The fault schedule of a chaos run: pure, and the same for the same seed.

Every kind of fault appears at least once (in a shuffled order), then kinds are drawn at random
until the run's fault window is filled; faults are spaced ``interval_s`` apart with +-30 % jitter
so that two never overlap (a restarted server is back before the next fault starts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Fault", "FaultKind", "plan"]


class FaultKind(StrEnum):
    KILL_PROCESS = "kill_process"  # SIGKILL a role process; the cluster restarts it
    STOP_PROCESS = "stop_process"  # SIGSTOP a role process for longer than its leases, SIGCONT
    RESTART_POSTGRES = "restart_postgres"  # SIGKILL PostgreSQL, start it again after hold_s
    RESTART_REDIS = "restart_redis"  # the same for Valkey
    RESTART_NATS = "restart_nats"  # the single NATS, or one node of a NATS cluster
    CUT_CONNECTIONS = "cut_connections"  # reset every connection through the TCP proxies


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # seconds after the start of the fault window
    kind: FaultKind
    target: int  # which process (an index, taken modulo the candidates when the fault runs)
    hold_s: float  # how long the server stays down / the process stays stopped

    def describe(self) -> str:
        return f"{self.at_s:6.1f}s {self.kind} target={self.target} hold={self.hold_s:.1f}s"


def plan(
    seed: int,
    window_s: float,
    interval_s: float,
    kinds: tuple[FaultKind, ...] = tuple(FaultKind),
    *,
    down_s: tuple[float, float] = (1.0, 3.0),
    stop_s: float = 8.0,
) -> list[Fault]:
    """The faults of one run within ``window_s`` seconds, one every ``interval_s`` or so."""
    if interval_s <= 0 or window_s <= 0:
        raise ValueError("window_s and interval_s must be positive")
    rng = random.Random(seed)
    count = max(len(kinds), int(window_s // interval_s))
    order = list(kinds)
    rng.shuffle(order)
    order += [rng.choice(kinds) for _ in range(count - len(order))]
    faults = []
    at = interval_s * rng.uniform(0.3, 0.7)
    for kind in order:
        hold = stop_s if kind is FaultKind.STOP_PROCESS else rng.uniform(*down_s)
        if kind in (FaultKind.KILL_PROCESS, FaultKind.CUT_CONNECTIONS):
            hold = 0.0
        faults.append(Fault(at, kind, rng.randrange(1 << 16), hold))
        at += max(interval_s * rng.uniform(0.7, 1.3), hold + 1.0)
    return faults
