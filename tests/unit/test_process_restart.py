"""The supervisor's pure restart arithmetic: jittered exponential backoff, capped, reset."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aivedio.process.restart import RestartPolicy, consecutive_failures, restart_delay

POLICY = RestartPolicy(first_s=0.5, cap_s=30.0, healthy_s=60.0, jitter=0.5)


def test_the_delay_doubles_per_failure_in_a_row_up_to_the_cap() -> None:
    no_jitter = [restart_delay(n, POLICY, rand=0.0) for n in range(1, 10)]
    assert no_jitter == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_jitter_shortens_the_delay_by_at_most_its_fraction() -> None:
    assert restart_delay(1, POLICY, rand=0.0) == 0.5
    assert restart_delay(1, POLICY, rand=0.999999) == pytest.approx(0.25, rel=1e-5)
    assert restart_delay(7, POLICY, rand=0.5) == 30.0 * 0.75


def test_a_healthy_run_starts_the_count_over() -> None:
    assert consecutive_failures(0, ran_s=0.1, policy=POLICY) == 1
    assert consecutive_failures(5, ran_s=59.9, policy=POLICY) == 6
    assert consecutive_failures(5, ran_s=60.0, policy=POLICY) == 1
    assert consecutive_failures(5, ran_s=3600.0, policy=POLICY) == 1


def test_a_crash_loop_backs_off_then_a_healthy_spell_resets_it() -> None:
    failures = 0
    delays = []
    for ran_s in (0.0, 0.0, 0.0, 0.0, 120.0, 0.0):
        failures = consecutive_failures(failures, ran_s, POLICY)
        delays.append(restart_delay(failures, POLICY, rand=0.0))
    assert delays == [0.5, 1.0, 2.0, 4.0, 0.5, 1.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"first_s": 0.0},
        {"first_s": 5.0, "cap_s": 1.0},
        {"jitter": -0.1},
        {"jitter": 1.5},
        {"healthy_s": -1.0},
    ],
)
def test_a_policy_that_makes_no_sense_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="RestartPolicy"):
        RestartPolicy(**kwargs)


policies = st.builds(
    RestartPolicy,
    first_s=st.floats(0.001, 10.0),
    cap_s=st.floats(10.0, 600.0),
    healthy_s=st.floats(0.0, 600.0),
    jitter=st.floats(0.0, 1.0),
)


@given(policies, st.integers(-5, 10_000), st.floats(0.0, 1.0))
def test_every_delay_lies_within_the_jitter_band_and_under_the_cap(
    policy: RestartPolicy, failures: int, rand: float
) -> None:
    delay = restart_delay(failures, policy, rand)
    ceiling = min(policy.cap_s, policy.first_s * 2.0 ** min(max(failures, 1) - 1, 62))
    assert (1.0 - policy.jitter) * ceiling - 1e-9 <= delay <= ceiling + 1e-9
    assert 0.0 <= delay <= policy.cap_s + 1e-9


@given(policies, st.integers(1, 200), st.floats(0.0, 1.0))
def test_the_ceiling_never_shrinks_as_failures_repeat(
    policy: RestartPolicy, failures: int, rand: float
) -> None:
    # With the same draw, one failure more never waits less.
    assert restart_delay(failures + 1, policy, rand) >= restart_delay(failures, policy, rand)
