"""The in-memory handoff between a process's group commit and its inbox processor."""

from __future__ import annotations

import uuid

from aivedio.db.handoff import Handoff


def test_no_consumer_no_lease() -> None:
    handoff = Handoff()
    assert handoff.lease() is None
    handoff.put(uuid.uuid4(), [{"id": 1}])  # nobody attached: dropped, the table has it
    assert len(handoff) == 0


def test_rows_go_to_the_attached_consumer_oldest_first() -> None:
    handoff = Handoff()
    token = handoff.attach(30.0)
    assert handoff.lease() == (token, 30.0)
    handoff.put(token, [{"id": 1}, {"id": 2}])
    handoff.put(token, [{"id": 3}])
    assert handoff.take(2) == (token, [{"id": 1}, {"id": 2}])
    assert handoff.take(10) == (token, [{"id": 3}])
    assert handoff.take(10) == (token, [])


def test_a_consumer_that_is_behind_gets_no_new_leases() -> None:
    handoff = Handoff(max_rows=2)
    token = handoff.attach(30.0)
    handoff.put(token, [{"id": 1}, {"id": 2}])
    assert handoff.lease() is None
    handoff.take(1)
    assert handoff.lease() == (token, 30.0)


def test_rows_leased_to_a_consumer_that_left_are_dropped() -> None:
    handoff = Handoff()
    old = handoff.attach(30.0)
    handoff.put(old, [{"id": 1}])
    assert handoff.detach() == (old, [{"id": 1}])
    assert handoff.lease() is None
    new = handoff.attach(30.0)
    handoff.put(old, [{"id": 2}])  # committed under the old lease after the old consumer left
    assert new != old and len(handoff) == 0


def test_a_consumer_whose_oldest_row_waited_too_long_gets_no_new_leases() -> None:
    handoff = Handoff(max_wait_s=-1.0)  # any wait is too long, even one of no time
    token = handoff.attach(30.0)
    handoff.put(token, [{"id": 1}])
    assert handoff.lease() is None
    handoff.take(1)
    assert handoff.lease() == (token, 30.0)  # caught up
