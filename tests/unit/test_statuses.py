"""The status table is the only source of status behaviour (seed 004)."""

from __future__ import annotations

from aivedio.domain.statuses import (
    CANCELABLE,
    FINAL_PUBLIC_STATUSES,
    RETRYABLE,
    STATUS_TABLE,
    SUCCESSORS,
    Status,
    info,
    is_terminal,
)


def test_every_status_has_one_row_and_a_successor_entry() -> None:
    assert set(STATUS_TABLE) == set(Status)
    assert set(SUCCESSORS) == set(Status)


def test_terminal_statuses_have_no_successors_and_others_have_some() -> None:
    for status in Status:
        if info(status).terminal:
            assert SUCCESSORS[status] == frozenset(), status
        else:
            assert SUCCESSORS[status], status


def test_no_status_is_its_own_successor() -> None:
    for status, successors in SUCCESSORS.items():
        assert status not in successors


def test_final_public_statuses_are_exactly_the_contract() -> None:
    assert FINAL_PUBLIC_STATUSES == {"ready", "failed", "canceled"}
    for status in Status:
        assert is_terminal(status) == (info(status).public in FINAL_PUBLIC_STATUSES)


def test_provider_succeeded_is_not_ready() -> None:
    assert not is_terminal(Status.PROVIDER_SUCCEEDED)
    assert info(Status.PROVIDER_SUCCEEDED).public != "ready"
    assert Status.READY in SUCCESSORS[Status.PROVIDER_SUCCEEDED]


def test_every_status_reaches_a_terminal() -> None:
    for start in Status:
        seen, frontier = {start}, [start]
        while frontier:
            for nxt in SUCCESSORS[frontier.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    frontier.append(nxt)
        assert any(is_terminal(s) for s in seen), start


def test_commands_only_from_where_they_make_sense() -> None:
    assert RETRYABLE == {Status.FAILED, Status.CANCELED}
    assert not any(is_terminal(s) for s in CANCELABLE)
    assert Status.PROVIDER_SUCCEEDED not in CANCELABLE
    for status in CANCELABLE:
        assert Status.CANCEL_REQUESTED in SUCCESSORS[status]
