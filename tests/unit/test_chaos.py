"""The pure parts of ``aivedio chaos``: the fault schedule and the invariants."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from aivedio.chaos.invariants import ClientLog, TaskOutcome, check_stream, wrong_final_states
from aivedio.chaos.schedule import FaultKind, plan


def test_the_same_seed_gives_the_same_schedule_and_every_kind_appears() -> None:
    one, two = plan(7, 60, 6), plan(7, 60, 6)
    assert one == two
    assert plan(8, 60, 6) != one
    assert {f.kind for f in one} == set(FaultKind)
    assert len(one) == 10


@given(st.integers(0, 10_000), st.floats(5, 300), st.floats(1, 20))
def test_faults_never_overlap(seed: int, window: float, interval: float) -> None:
    faults = plan(seed, window, interval)
    for before, after in itertools.pairwise(faults):
        assert after.at_s >= before.at_s + before.hold_s + 0.99
    for fault in faults:
        if fault.kind in (FaultKind.KILL_PROCESS, FaultKind.CUT_CONNECTIONS):
            assert fault.hold_s == 0
        else:
            assert fault.hold_s > 0


def test_only_the_kinds_asked_for() -> None:
    faults = plan(1, 30, 3, (FaultKind.KILL_PROCESS,))
    assert {f.kind for f in faults} == {FaultKind.KILL_PROCESS}


def frame(seq: int, task: str = "t1", status: str = "running", version: int = 1) -> tuple:
    return ("task.status", seq, {"task_id": task, "status": status, "task_version": version})


def log_of(*frames: tuple, start: int = 0) -> ClientLog:
    log = ClientLog("c", "p", "sse", start_seq=start)
    log.frames = list(frames)
    return log


KEYS = {s: ("t1", "running", "generating") for s in range(1, 10)}
FINALS = {"t1": ("ready", 9)}


def test_an_exact_stream_has_no_violation() -> None:
    frames = [frame(s, version=s) for s in range(1, 9)] + [frame(9, status="ready", version=9)]
    check = check_stream(log_of(*frames), 9, FINALS, KEYS | {9: None})
    assert check == type(check)(0, 0, 0, 0, 0)


def test_gaps_duplicates_misorder_and_missing_finals_are_counted() -> None:
    frames = [frame(1), frame(2), frame(2), frame(5), frame(4)]
    keys: dict[int, tuple[str, str, str] | None] = {s: (f"t{s}", "running", "x") for s in range(6)}
    check = check_stream(log_of(*frames), 6, FINALS, keys)
    assert check.duplicates == 1
    assert check.misordered == 1  # 4 after 5
    assert check.gaps == 2  # 3 and 6 never came
    assert check.finals_missing == 1


def test_a_coalesced_progress_event_is_not_a_gap_but_a_final_one_is() -> None:
    # 2 was older progress of the same task and stage as 3: a slow connection may skip it
    frames = [frame(1), frame(3)]
    assert check_stream(log_of(*frames), 3, {}, KEYS).gaps == 0
    # ... but not when nothing later of the same key arrived
    assert check_stream(log_of(frame(1)), 2, {}, KEYS).gaps == 1
    # ... and never a final event (no coalescing key)
    assert check_stream(log_of(*frames), 3, {}, {1: KEYS[1], 2: None, 3: KEYS[3]}).gaps == 1


def test_a_reset_restarts_the_expected_range_and_is_counted() -> None:
    frames = [frame(1), ("reset", 7, {"cursor": "1-7"}), frame(8)]
    check = check_stream(log_of(*frames), 8, {}, KEYS)
    assert (check.resets, check.gaps) == (1, 0)


def test_wrong_final_states_follow_the_providers_truth() -> None:
    tasks = [
        TaskOutcome("a", "p", "succeeded", "ready", 9),
        TaskOutcome("b", "p", "failed", "failed", 5),
        TaskOutcome("c", "p", "succeeded", "processing_media", 8),
        TaskOutcome("d", "p", None, "queued", 2),
        TaskOutcome("e", "p", "succeeded", "failed", 6, flagged=True),  # for an operator
        TaskOutcome("f", "p", "failed", "processing_media", 7, flagged=True),  # but not stuck
    ]
    assert [t.task_id for t in wrong_final_states(tasks)] == ["c", "d", "f"]
