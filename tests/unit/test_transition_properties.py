"""Property tests: any interleaving of duplicated, reordered, late, lost and stale-attempt
observations converges to the legal final state, with contiguous versions and no no-op events."""

from __future__ import annotations

import uuid

from hypothesis import HealthCheck, given, settings

from aivedio.domain.observation import PlatformKind, PlatformObservation, ProviderStatus, Source
from aivedio.domain.statuses import SUCCESSORS, Status, is_terminal
from aivedio.domain.transitions import AttemptView, Outcome, decide
from tests.model import FINAL_TARGET, Script, clock_after, evolve, fresh, scripts

CURRENT = uuid.UUID(int=1)
OLD = uuid.UUID(int=2)


def run(script: Script) -> tuple[list[Status], int, int]:
    task = fresh(CURRENT)
    attempt = AttemptView(CURRENT, None, None, None)
    statuses = [task.status]
    applied = 0
    start_version = task.version
    arrivals: list[object] = list(script.arrivals)
    if script.cancel_at is not None:
        arrivals.insert(
            script.cancel_at,
            PlatformObservation(
                kind=PlatformKind.CANCEL_REQUESTED, attempt_id=CURRENT, source=Source.API
            ),
        )
    clocks = clock_after([*script.gaps_ms, 0])
    for obs, now in zip(arrivals, clocks, strict=False):
        old_view = AttemptView(OLD, ProviderStatus.RUNNING, None, None)
        view = old_view if getattr(obs, "attempt_id", None) == OLD else attempt
        decision = decide(task, view, obs, now)  # type: ignore[arg-type]
        before = task
        if view is attempt:
            task, attempt = evolve(task, attempt, decision, now)
        if decision.applied:
            applied += 1
            change = decision.change
            assert change is not None
            # no event for a no-op
            assert (change.status, change.stage, change.progress) != (
                before.status,
                before.stage,
                before.progress,
            )
            # a terminal state is never left
            assert not is_terminal(before.status)
            # every status change is a legal successor
            if change.status is not before.status:
                assert change.status in SUCCESSORS[before.status]
        else:
            assert task == before or decision.outcome is Outcome.IGNORED
        statuses.append(task.status)
    return statuses, task.version - start_version, applied


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(scripts(CURRENT, OLD))
def test_interleavings_converge_to_the_providers_final_state(script: Script) -> None:
    statuses, version_delta, applied = run(script)
    assert statuses[-1] is FINAL_TARGET[script.final]
    assert version_delta == applied  # versions contiguous: one per applied decision


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(scripts(CURRENT, OLD, with_cancel=True))
def test_cancel_converges_by_the_documented_rule(script: Script) -> None:
    statuses, version_delta, applied = run(script)
    assert version_delta == applied
    final = statuses[-1]
    # The provider's terminal decides: success wins over a pending cancel, a confirmed cancel
    # cancels, a failure fails. A cancel asked too late (after provider success) changes nothing.
    assert final is FINAL_TARGET[script.final]


@settings(max_examples=300)
@given(scripts(CURRENT, OLD))
def test_once_terminal_always_terminal(script: Script) -> None:
    statuses, _, _ = run(script)
    first_terminal = next((i for i, s in enumerate(statuses) if is_terminal(s)), None)
    if first_terminal is not None:
        assert len(set(statuses[first_terminal:])) == 1
