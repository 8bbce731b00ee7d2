"""The poller's pure core: interval table, jitter bounds, error rules, breakers, buckets."""

from __future__ import annotations

import random
import re
from importlib import resources

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aivedio.domain.observation import ProviderStatus
from aivedio.domain.statuses import Status
from aivedio.polling.buckets import Bucket, Limit, take_all
from aivedio.polling.config import RateLimitConfig, parse_limits
from aivedio.polling.policy import (
    WEBHOOK_PUSH_DUE_S,
    WEBHOOK_PUSH_S,
    Alert,
    AttemptFacts,
    Backoff,
    Breaker,
    BreakerConfig,
    BreakerState,
    Outcome,
    Phase,
    PollPolicy,
    Reconcile,
    after_failure,
    after_success,
    interval,
    phase_of,
    scheduled_delay,
    state_interval,
    stretch_factor,
)

POLICY = PollPolicy()


class Fixed:
    """A random source that always returns the same point of the range (0 = low, 1 = high)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.at


class Wild:
    """A broken random source: returns values outside the range."""

    def uniform(self, a: float, b: float) -> float:
        return 10 * b


def facts(**kw: object) -> AttemptFacts:
    base: dict[str, object] = {
        "task_status": Status.RUNNING,
        "provider_status": ProviderStatus.RUNNING,
        "age_s": 60.0,
    }
    base.update(kw)
    return AttemptFacts(**base)  # type: ignore[arg-type]


# --- the interval table ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "provider_status", "age", "phase", "low", "high"),
    [
        (Status.SUBMITTED, None, 0.0, Phase.SUBMITTED, 2.0, 5.0),
        (Status.PROVIDER_QUEUED, ProviderStatus.QUEUED, 40.0, Phase.QUEUED, 10.0, 30.0),
        (Status.RUNNING, ProviderStatus.RUNNING, 40.0, Phase.RUNNING, 5.0, 15.0),
        (Status.RUNNING, ProviderStatus.RUNNING, 901.0, Phase.OVERDUE, 60.0, 300.0),
        (Status.SUBMITTED, None, 45.0, Phase.QUEUED, 10.0, 30.0),
        (Status.CANCEL_REQUESTED, ProviderStatus.QUEUED, 40.0, Phase.RUNNING, 5.0, 15.0),
    ],
)
def test_interval_table(
    status: Status,
    provider_status: ProviderStatus | None,
    age: float,
    phase: Phase,
    low: float,
    high: float,
) -> None:
    f = facts(task_status=status, provider_status=provider_status, age_s=age)
    assert phase_of(f, POLICY) is phase
    assert state_interval(f, POLICY) == low  # first step: the base
    steps = [
        state_interval(AttemptFacts(status, provider_status, age, unchanged=n), POLICY)
        for n in range(10)
    ]
    assert steps[0] == low and steps[-1] == high
    assert steps == sorted(steps)


def test_watched_tasks_poll_sooner_but_never_below_the_floor() -> None:
    f = facts(unchanged=3)
    assert state_interval(facts(unchanged=3, watched=True), POLICY) == pytest.approx(
        state_interval(f, POLICY) * POLICY.interest_factor
    )
    tight = PollPolicy(interest_factor=0.01, min_interval_s=1.5)
    assert state_interval(facts(watched=True), tight) == 1.5


def test_seed_formula_at_the_jitter_edges() -> None:
    b = Backoff(2.0, 30.0)
    assert interval(b, 0, Fixed(0.0), (0.8, 1.2)) == pytest.approx(1.6)
    assert interval(b, 2, Fixed(1.0), (0.8, 1.2)) == pytest.approx(9.6)
    assert interval(b, 10, Fixed(0.5), (0.8, 1.2)) == pytest.approx(30.0)
    assert interval(b, 1000, Fixed(1.0), (0.8, 1.2)) == pytest.approx(36.0)  # no overflow


@given(
    base=st.floats(0.01, 100),
    extra=st.floats(0, 1000),
    n=st.integers(-5, 200),
    seed=st.integers(0, 2**32),
)
def test_jitter_stays_within_bounds(base: float, extra: float, n: int, seed: int) -> None:
    b = Backoff(base, base + extra)
    value = interval(b, n, random.Random(seed), (0.8, 1.2))
    assert 0.8 * b.nominal(n) - 1e-9 <= value <= 1.2 * b.nominal(n) + 1e-9
    assert value <= 1.2 * b.cap_s + 1e-9
    # a source that misbehaves is clamped
    assert interval(b, n, Wild(), (0.8, 1.2)) == pytest.approx(1.2 * b.nominal(n))


@given(base=st.floats(0.01, 100), extra=st.floats(0, 1000), n=st.integers(0, 200))
def test_nominal_is_monotone_and_capped(base: float, extra: float, n: int) -> None:
    b = Backoff(base, base + extra)
    assert b.nominal(n) <= b.nominal(n + 1) <= b.cap_s
    assert b.nominal(0) == base


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="base_s"):
        Backoff(5, 2)
    with pytest.raises(ValueError, match="jitter"):
        PollPolicy(jitter=(1.1, 1.2))
    with pytest.raises(ValueError, match="interest_factor"):
        PollPolicy(interest_factor=0)
    with pytest.raises(ValueError, match="threshold"):
        BreakerConfig(threshold=0)


# --- outcomes --------------------------------------------------------------------------------


def test_success_resets_failures_and_counts_unchanged_polls() -> None:
    f = facts(failures=3, unchanged=2)
    same = after_success(f, False, POLICY, Fixed(0.5))
    assert (same.failures, same.unchanged, same.success) == (0, 3, True)
    assert same.nominal_s == POLICY.running.nominal(3)
    moved = after_success(f, True, POLICY, Fixed(0.5))
    assert moved.unchanged == 0 and moved.nominal_s == POLICY.running.base_s
    # the provider's new status picks the next row of the table
    queued = after_success(
        facts(provider_status=None, age_s=40),
        True,
        POLICY,
        Fixed(0.5),
        provider_status=ProviderStatus.QUEUED,
    )
    assert queued.nominal_s == POLICY.queued.base_s


def test_overdue_success_alerts_and_slows_down() -> None:
    d = after_success(facts(age_s=POLICY.expected_max_s + 1), False, POLICY, Fixed(0.5))
    assert Alert.OVERDUE in d.alerts
    assert d.nominal_s >= POLICY.overdue.base_s


def test_429_honours_retry_after_and_widens() -> None:
    first = after_failure(facts(), Outcome.RATE_LIMITED, POLICY, Fixed(0.0), retry_after_s=40)
    assert first.delay_s >= 40 and first.floor_s == 40
    assert not first.provider_failure  # 429 is not an outage
    widen = [
        after_failure(facts(failures=n), Outcome.RATE_LIMITED, POLICY, Fixed(0.5)).nominal_s
        for n in range(8)
    ]
    assert widen == sorted(widen) and widen[-1] > widen[0]
    assert scheduled_delay(first, 0.5) >= 40  # a stretch never undercuts Retry-After


def test_5xx_backs_off_exponentially_with_a_cap_and_feeds_the_breaker() -> None:
    delays = [
        after_failure(facts(failures=n), Outcome.UNAVAILABLE, POLICY, Fixed(0.5)).nominal_s
        for n in range(20)
    ]
    assert delays[0] == POLICY.errors.base_s and delays[1] == 2 * POLICY.errors.base_s
    assert max(delays) == POLICY.errors.cap_s
    d = after_failure(facts(), Outcome.UNAVAILABLE, POLICY, Fixed(0.5))
    assert d.provider_failure and not d.credential_failure


def test_status_unknown_after_n_failures_never_failed() -> None:
    n = POLICY.unknown_after
    decisions = [
        after_failure(facts(failures=k), Outcome.UNAVAILABLE, POLICY, Fixed(0.5))
        for k in range(n + 3)
    ]
    assert [d.status_unknown for d in decisions] == [k == n - 1 for k in range(n + 3)]
    assert decisions[n - 1].failures == n
    assert Alert.STATUS_UNKNOWN in decisions[n - 1].alerts


def test_404_within_grace_retries_quickly_after_it_reconciles() -> None:
    young = after_failure(facts(age_s=5), Outcome.NOT_FOUND, POLICY, Fixed(0.5))
    assert young.reconcile is None and young.failures == 0  # not a failure yet
    assert young.nominal_s <= POLICY.not_found.cap_s
    old = after_failure(facts(age_s=600), Outcome.NOT_FOUND, POLICY, Fixed(0.5))
    assert old.reconcile is Reconcile.NOT_FOUND and old.failures == 1
    assert old.nominal_s >= POLICY.overdue.base_s


def test_auth_failure_opens_the_credential_breaker_without_hot_retry() -> None:
    d = after_failure(facts(), Outcome.AUTH_FAILED, POLICY, Fixed(0.0))
    assert d.credential_failure and not d.provider_failure
    assert d.delay_s >= POLICY.auth.base_s * POLICY.jitter[0]
    assert Alert.AUTH_FAILED in d.alerts


def test_malformed_is_retried_a_limited_number_of_times_then_flagged() -> None:
    flags = [
        after_failure(facts(failures=k), Outcome.MALFORMED, POLICY, Fixed(0.5)).reconcile
        for k in range(5)
    ]
    limit = POLICY.malformed_retries
    assert flags[: limit - 1] == [None] * (limit - 1)
    assert flags[limit - 1] is Reconcile.MALFORMED


def test_after_failure_refuses_ok() -> None:
    with pytest.raises(ValueError, match="failed outcome"):
        after_failure(facts(), Outcome.OK, POLICY, Fixed(0.5))


@given(
    outcome=st.sampled_from([o for o in Outcome if o is not Outcome.OK]),
    failures=st.integers(0, 50),
    age=st.floats(0, 5000),
    retry_after=st.one_of(st.none(), st.floats(0, 600)),
    at=st.floats(0, 1),
    stretch=st.floats(0.1, 50),
)
def test_failure_delays_are_bounded(
    outcome: Outcome,
    failures: int,
    age: float,
    retry_after: float | None,
    at: float,
    stretch: float,
) -> None:
    d = after_failure(
        facts(failures=failures, age_s=age), outcome, POLICY, Fixed(at), retry_after_s=retry_after
    )
    longest = max(POLICY.auth.cap_s, POLICY.rate_limited.cap_s, POLICY.overdue.cap_s)
    assert POLICY.min_interval_s <= d.delay_s <= max(longest * 1.2, retry_after or 0) + 1e-6
    assert scheduled_delay(d, stretch) >= max(d.floor_s, d.delay_s) - 1e-9
    assert not (d.status_unknown and d.failures != POLICY.unknown_after)


# --- stretch ---------------------------------------------------------------------------------


def test_stretch_factor() -> None:
    assert stretch_factor([(100, 200)], 1.0) == 1.0  # fits: never shrinks intervals
    # the seed's example: 7,200 tasks every 15 s = 480 qps against 200 qps
    assert stretch_factor([(480, 200)], 1.0) == pytest.approx(2.4)
    assert stretch_factor([(480, 200), (50, 10)], 1.0) == pytest.approx(5.0)  # worst level
    assert stretch_factor([(180, 200)], 0.9) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="utilization"):
        stretch_factor([], 0)


# --- breaker ---------------------------------------------------------------------------------

CFG = BreakerConfig(threshold=3, window_s=10, cool_down_s=5, max_cool_down_s=20)


def test_breaker_opens_after_k_failures_in_the_window() -> None:
    b = Breaker(CFG)
    b = b.on_failure(0).on_failure(1)
    assert b.state is BreakerState.CLOSED
    assert b.on_failure(2).state is BreakerState.OPEN
    # failures outside the window do not count
    spread = Breaker(CFG).on_failure(0).on_failure(11).on_failure(22)
    assert spread.state is BreakerState.CLOSED
    # a success clears the count
    assert Breaker(CFG).on_failure(0).on_failure(1).on_success(2).on_failure(3).state is (
        BreakerState.CLOSED
    )


def test_breaker_half_open_probe_then_close_or_reopen() -> None:
    opened = Breaker(CFG).on_failure(0).on_failure(0).on_failure(0)
    assert opened.allow(1)[1] is False
    assert opened.retry_in(1) == pytest.approx(4)
    half = opened.current(5)
    assert half.state is BreakerState.HALF_OPEN
    probing, ok = half.allow(5)
    assert ok
    assert probing.allow(5)[1] is False  # one probe at a time
    assert probing.on_success(6).state is BreakerState.CLOSED
    reopened = probing.on_failure(6)
    assert reopened.state is BreakerState.OPEN and reopened.cool_down_s == 10  # doubled
    again = reopened.current(16).allow(16)[0].on_failure(16)
    assert again.cool_down_s == 20
    capped = again.current(36).allow(36)[0].on_failure(36)
    assert capped.cool_down_s == 20  # max_cool_down_s


@given(events=st.lists(st.tuples(st.booleans(), st.floats(0, 5)), max_size=60))
def test_breaker_invariants(events: list[tuple[bool, float]]) -> None:
    b, now = Breaker(CFG), 0.0
    for failed, dt in events:
        now += dt
        b = b.on_failure(now) if failed else b.on_success(now)
        assert b.state in set(BreakerState)
        assert len(b.failures) < CFG.threshold
        assert b.state is not BreakerState.OPEN or CFG.cool_down_s <= b.cool_down_s <= 20
        if b.current(now).state is BreakerState.CLOSED:
            assert b.allow(now)[1]


# --- buckets ---------------------------------------------------------------------------------


def test_take_all_is_all_or_nothing() -> None:
    a, b = Bucket(5, 0), Bucket(2, 0)
    la, lb = Limit(10, 5), Limit(1, 2)
    grant = take_all([(a, la), (b, lb)], 4, now=0)
    assert grant.granted == 2 and a.tokens == 3 and b.tokens == 0
    denied = take_all([(a, la), (b, lb)], 1, now=0.5)
    assert denied.granted == 0 and denied.wait_s == pytest.approx(0.5)
    assert a.tokens == 3  # untouched
    assert take_all([(a, la), (b, lb)], 1, now=1.0).granted == 1


@given(
    qps=st.floats(1, 500),
    burst=st.floats(1, 50),
    steps=st.lists(st.tuples(st.floats(0, 0.3), st.integers(1, 40)), min_size=1, max_size=200),
)
def test_a_bucket_never_grants_more_than_burst_plus_rate_times_time(
    qps: float, burst: float, steps: list[tuple[float, int]]
) -> None:
    bucket, limit, now, total = Bucket(burst, 0.0), Limit(qps, burst), 0.0, 0
    for dt, want in steps:
        now += dt
        total += take_all([(bucket, limit)], want, now).granted
    assert total <= burst + qps * now + 1e-6


def test_share_divides_for_the_fallback() -> None:
    assert Limit(180, 9).share(3) == Limit(60, 3)
    assert Limit(10, 2).share(4).burst == 1


def test_parse_limits() -> None:
    cfg = parse_limits(
        "global=400/20, provider:sandbox=160/8, model:sandbox/m1=100/5, tenant=60/5, "
        "tenant:t1=10/2, provider=30/3",
        RateLimitConfig(replicas=3),
    )
    assert cfg.global_limit == Limit(400, 20)
    assert cfg.provider_limit("sandbox") == Limit(160, 8)
    assert cfg.provider_limit("other") == Limit(30, 3)
    assert cfg.model_limit("sandbox", "m1") == Limit(100, 5)
    assert cfg.model_limit("sandbox", "m2") is None
    assert cfg.tenant_limit("t1") == Limit(10, 2) and cfg.tenant_limit("t2") == Limit(60, 5)
    assert cfg.replicas == 3
    with pytest.raises(ValueError, match="unknown limit level"):
        parse_limits("planet=1/1")
    with pytest.raises(ValueError, match="qps/burst"):
        parse_limits("global=fast")


def test_webhook_push_matches_the_write_event_statements() -> None:
    sql = (resources.files("aivedio.db") / "queries" / "state.sql").read_text()
    pushes = re.findall(
        r"next_poll_at < now\(\) \+ interval '(\d+) seconds'"
        r"\s+THEN now\(\) \+ interval '(\d+) seconds'",
        sql,
    )
    assert [(float(due), float(out)) for due, out in pushes] == [
        (WEBHOOK_PUSH_DUE_S, WEBHOOK_PUSH_S)
    ] * 2  # write_event and write_events
