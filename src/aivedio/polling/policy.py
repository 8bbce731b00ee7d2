"""What the poller decides, as pure functions: intervals, query-outcome handling, breakers.

No I/O here (procrastinate's ``retry.py`` habit): the poller feeds facts in, gets a decision out,
and does the I/O itself. Randomness is injected (any object with ``uniform(a, b)``), time is a
number of seconds given by the caller.

Seed §12.8.3: ``interval(n) = min(cap, base * 2^n) * random(0.8, 1.2)`` with a state-aware
``(base, cap)``; §12.8.4 for the error classes; §12.7.8: a query that fails is never a reason
to fail a task (``status_unknown`` after N consecutive failures instead).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

from aivedio.domain.observation import ProviderStatus
from aivedio.domain.statuses import Status

WEBHOOK_PUSH_S = 30.0
"""A webhook that changed an attempt whose next poll is due within ``WEBHOOK_PUSH_DUE_S`` pushes
it this far out (the ``write_event(s)`` statements in ``db/queries/state.sql`` hold the same
figures). So while webhooks come at least every 15 s a task is never polled, and a webhook
leaves the indexed ``next_poll_at`` alone most of the time (a HOT update of the attempt)."""
WEBHOOK_PUSH_DUE_S = 15.0


class RandomSource(Protocol):
    def uniform(self, a: float, b: float) -> float: ...


# --- intervals -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Backoff:
    """``min(cap, base * 2^n)`` seconds before jitter."""

    base_s: float
    cap_s: float

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError("a backoff needs 0 < base_s <= cap_s")

    def nominal(self, n: int) -> float:
        """The un-jittered interval after ``n`` steps (``n < 0`` counts as 0)."""
        n = max(0, n)
        if n >= 64:  # 2^64 * base is past any cap; avoid float overflow
            return self.cap_s
        return min(self.cap_s, self.base_s * 2.0**n)


class Phase(StrEnum):
    """Which row of the interval table an attempt is in."""

    SUBMITTED = "submitted"  # just submitted: is the job there at all?
    QUEUED = "queued"  # the provider queues it: changes slowly
    RUNNING = "running"  # generating: the user watches the progress
    OVERDUE = "overdue"  # past the expected maximum duration: low frequency + alert


@dataclass(frozen=True, slots=True)
class PollPolicy:
    """The interval table and the error rules. Defaults follow seed §12.8.3; tune per provider.

    - ``submitted_window_s``: how long after the first poll an attempt the provider has not
      reported on yet counts as "just submitted".
    - ``expected_max_s``: past this age an in-flight attempt is overdue.
    - ``not_found_grace_s``: a 404 younger than this is eventual consistency, later a
      reconciliation case.
    - ``unknown_after``: consecutive failed queries before ``status_unknown`` (N).
    - ``malformed_retries``: consecutive malformed answers before a reconciliation flag.
    - ``interest_factor``: the interval of a task someone watches is multiplied by this.
    - ``min_interval_s``: no interval is shorter, whatever the factors.
    - ``jitter``: the ``random(lo, hi)`` factor.
    """

    submitted: Backoff = Backoff(2.0, 5.0)
    queued: Backoff = Backoff(10.0, 30.0)
    running: Backoff = Backoff(5.0, 15.0)
    overdue: Backoff = Backoff(60.0, 300.0)
    errors: Backoff = Backoff(2.0, 120.0)
    rate_limited: Backoff = Backoff(5.0, 300.0)
    not_found: Backoff = Backoff(2.0, 10.0)
    malformed: Backoff = Backoff(10.0, 300.0)
    auth: Backoff = Backoff(60.0, 900.0)
    submitted_window_s: float = 30.0
    expected_max_s: float = 900.0
    not_found_grace_s: float = 30.0
    unknown_after: int = 5
    malformed_retries: int = 3
    interest_factor: float = 0.5
    min_interval_s: float = 1.0
    jitter: tuple[float, float] = (0.8, 1.2)

    def __post_init__(self) -> None:
        lo, hi = self.jitter
        if not 0 < lo <= 1 <= hi:
            raise ValueError("jitter must be (lo, hi) with 0 < lo <= 1 <= hi")
        if self.unknown_after < 1 or self.malformed_retries < 1:
            raise ValueError("unknown_after and malformed_retries must be at least 1")
        if not 0 < self.interest_factor <= 1:
            raise ValueError("interest_factor must be within (0, 1]")
        if self.min_interval_s <= 0:
            raise ValueError("min_interval_s must be positive")

    def table(self, phase: Phase) -> Backoff:
        return {
            Phase.SUBMITTED: self.submitted,
            Phase.QUEUED: self.queued,
            Phase.RUNNING: self.running,
            Phase.OVERDUE: self.overdue,
        }[phase]


def jittered(seconds: float, rand: RandomSource, jitter: tuple[float, float]) -> float:
    """``seconds * random(lo, hi)``, clamped into the bounds whatever the source returns."""
    lo, hi = jitter
    factor = min(hi, max(lo, rand.uniform(lo, hi)))
    return seconds * factor


def interval(backoff: Backoff, n: int, rand: RandomSource, jitter: tuple[float, float]) -> float:
    """Seed §12.8.3: ``min(cap, base * 2^n) * random(0.8, 1.2)``."""
    return jittered(backoff.nominal(n), rand, jitter)


@dataclass(frozen=True, slots=True)
class AttemptFacts:
    """What the poller knows about one attempt when it decides (all ages in seconds)."""

    task_status: Status
    provider_status: ProviderStatus | None
    age_s: float
    """Since polling started for the attempt (about when the submit was accepted)."""
    unchanged: int = 0
    """Consecutive successful polls that taught nothing new."""
    failures: int = 0
    """Consecutive failed polls before this one."""
    watched: bool = False


def phase_of(facts: AttemptFacts, policy: PollPolicy) -> Phase:
    if facts.age_s >= policy.expected_max_s:
        return Phase.OVERDUE
    if facts.task_status is Status.CANCEL_REQUESTED:
        return Phase.RUNNING  # the user waits for the confirmation
    if facts.provider_status is ProviderStatus.RUNNING:
        return Phase.RUNNING
    if facts.provider_status is ProviderStatus.QUEUED:
        return Phase.QUEUED
    if facts.age_s < policy.submitted_window_s:
        return Phase.SUBMITTED
    return Phase.QUEUED


def state_interval(facts: AttemptFacts, policy: PollPolicy) -> float:
    """The nominal (un-jittered, un-stretched) interval of a healthy attempt: the table row of
    its phase at step ``unchanged``, shortened for a watched task."""
    nominal = policy.table(phase_of(facts, policy)).nominal(facts.unchanged)
    if facts.watched:
        nominal *= policy.interest_factor
    return max(policy.min_interval_s, nominal)


# --- query outcomes ------------------------------------------------------------------------


class Outcome(StrEnum):
    """A query's result, as the metrics and the decision rules name it."""

    OK = "ok"
    RATE_LIMITED = "rate_limited"
    UNAVAILABLE = "unavailable"  # 5xx, network failure, timeout
    NOT_FOUND = "not_found"
    AUTH_FAILED = "auth_failed"
    MALFORMED = "malformed"


class Reconcile(StrEnum):
    """Why the poller flags an attempt for the reconciler."""

    NOT_FOUND = "poll_not_found"
    MALFORMED = "poll_malformed"


class Alert(StrEnum):
    OVERDUE = "overdue"
    STATUS_UNKNOWN = "status_unknown"
    AUTH_FAILED = "auth_failed"
    NOT_FOUND = "not_found"
    MALFORMED = "malformed"


@dataclass(frozen=True, slots=True)
class PollDecision:
    """What to write after one query.

    - ``delay_s``: seconds until the next poll (jittered, before any rate-limit stretch).
    - ``nominal_s``: the un-jittered interval (the poll demand it represents: 1/nominal).
    - ``floor_s``: a delay no stretch or factor may shorten (Retry-After).
    - ``failures`` / ``unchanged``: the new counters.
    - ``status_unknown``: write the ``status_unknown`` platform observation now.
    - ``reconcile``: open a reconciliation item of this kind.
    - ``alerts``: what to log and count as an alert.
    - ``provider_failure`` / ``credential_failure``: feed the breakers; ``success`` closes them.
    """

    delay_s: float
    nominal_s: float
    floor_s: float = 0.0
    failures: int = 0
    unchanged: int = 0
    status_unknown: bool = False
    reconcile: Reconcile | None = None
    alerts: tuple[Alert, ...] = ()
    provider_failure: bool = False
    credential_failure: bool = False
    success: bool = False


def after_success(
    facts: AttemptFacts,
    changed: bool,
    policy: PollPolicy,
    rand: RandomSource,
    *,
    provider_status: ProviderStatus | None = None,
) -> PollDecision:
    """A query answered. ``changed``: it taught something new (status, sequence, progress).
    ``provider_status``: what the provider said (it picks the table row of the next poll)."""
    unchanged = 0 if changed else facts.unchanged + 1
    after = replace(
        facts,
        unchanged=unchanged,
        failures=0,
        provider_status=provider_status or facts.provider_status,
    )
    nominal = state_interval(after, policy)
    overdue = phase_of(after, policy) is Phase.OVERDUE
    return PollDecision(
        delay_s=max(policy.min_interval_s, jittered(nominal, rand, policy.jitter)),
        nominal_s=nominal,
        unchanged=unchanged,
        alerts=(Alert.OVERDUE,) if overdue else (),
        success=True,
    )


@dataclass(frozen=True, slots=True)
class _FailureClass:
    """How one failed query outcome is treated (seed §12.8.4)."""

    backoff: Backoff
    floor_s: float = 0.0
    counts: bool = True  # towards status_unknown
    reconcile: Reconcile | None = None
    alert: Alert | None = None
    provider_failure: bool = False
    credential_failure: bool = False


def _classify_failure(
    facts: AttemptFacts,
    outcome: Outcome,
    policy: PollPolicy,
    failures: int,
    retry_after_s: float | None,
) -> _FailureClass:
    if outcome is Outcome.RATE_LIMITED:
        # Honour Retry-After and widen: never sooner than the provider asked, and the backoff
        # grows with each consecutive 429.
        return _FailureClass(policy.rate_limited, floor_s=max(0.0, retry_after_s or 0.0))
    if outcome is Outcome.UNAVAILABLE:
        return _FailureClass(policy.errors, provider_failure=True)
    if outcome is Outcome.NOT_FOUND:
        if facts.age_s < policy.not_found_grace_s:
            # eventual consistency just after submit
            return _FailureClass(policy.not_found, counts=False)
        return _FailureClass(policy.overdue, reconcile=Reconcile.NOT_FOUND, alert=Alert.NOT_FOUND)
    if outcome is Outcome.AUTH_FAILED:
        # no hot retry: our credential is the problem
        return _FailureClass(policy.auth, credential_failure=True, alert=Alert.AUTH_FAILED)
    # MALFORMED
    if failures >= policy.malformed_retries:
        return _FailureClass(policy.malformed, reconcile=Reconcile.MALFORMED, alert=Alert.MALFORMED)
    return _FailureClass(policy.malformed)


def after_failure(
    facts: AttemptFacts,
    outcome: Outcome,
    policy: PollPolicy,
    rand: RandomSource,
    *,
    retry_after_s: float | None = None,
) -> PollDecision:
    """A query failed (never a reason to fail the task; seed §12.7.8)."""
    if outcome is Outcome.OK:
        raise ValueError("after_failure needs a failed outcome")
    failures = facts.failures + 1
    n = failures - 1
    kind = _classify_failure(facts, outcome, policy, failures, retry_after_s)
    alerts: list[Alert] = [] if kind.alert is None else [kind.alert]
    if not kind.counts:
        failures = facts.failures
    status_unknown = kind.counts and failures == policy.unknown_after
    if status_unknown:
        alerts.append(Alert.STATUS_UNKNOWN)
    floor = kind.floor_s
    nominal = kind.backoff.nominal(n)
    delay = max(policy.min_interval_s, jittered(nominal, rand, policy.jitter), floor)
    return PollDecision(
        delay_s=delay,
        nominal_s=max(nominal, floor),
        floor_s=floor,
        failures=failures,
        unchanged=facts.unchanged,
        status_unknown=status_unknown,
        reconcile=kind.reconcile,
        alerts=tuple(alerts),
        provider_failure=kind.provider_failure,
        credential_failure=kind.credential_failure,
    )


# --- rate-limit stretch --------------------------------------------------------------------


def stretch_factor(levels: Iterable[tuple[float, float]], utilization: float = 0.9) -> float:
    """How much every interval must grow so that the poll demand fits the rate limits.

    ``levels`` are ``(demand_qps, capacity_qps)`` pairs (global, provider, provider+model,
    tenant that apply to an attempt); demand is the sum of ``1 / nominal interval`` of the
    attempts under that limit. The factor is ``max(1, demand / (capacity * utilization))``
    over the levels: with it, the scheduler targets intervals the limiter can honour, so a
    task is late by queueing only when demand spikes between refreshes.
    """
    if not 0 < utilization <= 1:
        raise ValueError("utilization must be within (0, 1]")
    factor = 1.0
    for demand, capacity in levels:
        if capacity <= 0:
            return math.inf
        factor = max(factor, demand / (capacity * utilization))
    return factor


def scheduled_delay(decision: PollDecision, stretch: float) -> float:
    """The delay to write: the decision's delay stretched, never below its floor."""
    return max(decision.floor_s, decision.delay_s * max(1.0, stretch))


# --- circuit breaker -----------------------------------------------------------------------


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """``threshold`` failures within ``window_s`` open the breaker for ``cool_down_s``; each
    re-open after a failed probe doubles the cool-down up to ``max_cool_down_s``. Half-open
    lets ``probes`` calls through; a success closes it, a failure re-opens it."""

    threshold: int = 5
    window_s: float = 30.0
    cool_down_s: float = 15.0
    max_cool_down_s: float = 300.0
    probes: int = 1

    def __post_init__(self) -> None:
        if self.threshold < 1 or self.probes < 1:
            raise ValueError("threshold and probes must be at least 1")
        if not 0 < self.cool_down_s <= self.max_cool_down_s or self.window_s <= 0:
            raise ValueError("need window_s > 0 and 0 < cool_down_s <= max_cool_down_s")


@dataclass(frozen=True, slots=True)
class Breaker:
    """An immutable breaker; every transition returns a new one."""

    config: BreakerConfig = field(default_factory=BreakerConfig)
    state: BreakerState = BreakerState.CLOSED
    failures: tuple[float, ...] = ()
    opened_at: float = 0.0
    cool_down_s: float = 0.0
    probes_out: int = 0

    def current(self, now: float) -> Breaker:
        """Open turns half-open once the cool-down has passed."""
        if self.state is BreakerState.OPEN and now >= self.opened_at + self.cool_down_s:
            return replace(self, state=BreakerState.HALF_OPEN, probes_out=0)
        return self

    def allow(self, now: float) -> tuple[Breaker, bool]:
        """May a call go out now? Half-open counts the probe it lets through."""
        b = self.current(now)
        if b.state is BreakerState.CLOSED:
            return b, True
        if b.state is BreakerState.HALF_OPEN and b.probes_out < b.config.probes:
            return replace(b, probes_out=b.probes_out + 1), True
        return b, False

    def retry_in(self, now: float) -> float:
        """Seconds until a call may be tried (0 when allowed now)."""
        b = self.current(now)
        if b.state is BreakerState.OPEN:
            return max(0.0, b.opened_at + b.cool_down_s - now)
        if b.state is BreakerState.HALF_OPEN and b.probes_out >= b.config.probes:
            return min(1.0, b.config.cool_down_s)
        return 0.0

    def on_success(self, now: float) -> Breaker:
        b = self.current(now)
        if b.state is BreakerState.OPEN:
            return b  # a late answer of a call sent before it opened proves little
        return Breaker(config=b.config)

    def on_failure(self, now: float) -> Breaker:
        b = self.current(now)
        cfg = b.config
        if b.state is BreakerState.HALF_OPEN:
            cool = min(cfg.max_cool_down_s, max(cfg.cool_down_s, b.cool_down_s * 2))
            return replace(b, state=BreakerState.OPEN, failures=(), opened_at=now, cool_down_s=cool)
        if b.state is BreakerState.OPEN:
            return b
        recent = (*(t for t in b.failures if t > now - cfg.window_s), now)
        if len(recent) >= cfg.threshold:
            return replace(
                b,
                state=BreakerState.OPEN,
                failures=(),
                opened_at=now,
                cool_down_s=cfg.cool_down_s,
            )
        return replace(b, failures=recent)


__all__ = [
    "WEBHOOK_PUSH_DUE_S",
    "WEBHOOK_PUSH_S",
    "Alert",
    "AttemptFacts",
    "Backoff",
    "Breaker",
    "BreakerConfig",
    "BreakerState",
    "Outcome",
    "Phase",
    "PollDecision",
    "PollPolicy",
    "RandomSource",
    "Reconcile",
    "after_failure",
    "after_success",
    "interval",
    "jittered",
    "phase_of",
    "scheduled_delay",
    "state_interval",
    "stretch_factor",
]
