"""The pure parts of ``bench e2e``: the schedule, percentiles, the saturation pick, the stages,
the signed requests, and the SSE client's frame parser."""

from __future__ import annotations

import array as arr
import asyncio
import itertools
import math
import os
import socket
import time
from collections import defaultdict
from typing import Any

import pytest
from standardwebhooks import Webhook

from aivedio.bench import e2e
from aivedio.bench.common import BenchUsageError, percentile
from aivedio.bench.e2e_clients import _Client, _Reader
from aivedio.bench.e2e_deploy import RunBus, socket_owners
from aivedio.bench.e2e_load import Generation, LoadResult, _Sender, build_requests
from aivedio.bench.e2e_report import TOP_STATEMENTS, _calls, _print_statements, at_rate
from aivedio.bench.e2e_run import StepFigures
from aivedio.bench.e2e_schedule import (
    STAGES,
    Cursor,
    RateResult,
    build_step,
    parse_rates,
    per_task_limit,
    plan_tasks,
    saturation,
    stage_samples,
)
from aivedio.bench.pg_statements import StatementFigures
from aivedio.config import Settings
from aivedio.sandbox.config import decode_webhook_secret

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
RAMP = [100.0, 250.0, 500.0, 1000.0, 1500.0, 2000.0, 3000.0]


def test_a_task_takes_webhooks_below_progress_100() -> None:
    assert per_task_limit(5) == 19  # progress 5, 10, ..., 95
    assert per_task_limit(1) == 99
    assert per_task_limit(50) == 1
    with pytest.raises(ValueError, match="at least 1"):
        per_task_limit(0)


def test_tasks_suffice_for_the_ramp_and_the_gap() -> None:
    tasks = plan_tasks(RAMP, 10.0, 5, 1.0)
    assert tasks == math.ceil(83_500 / 19)  # the progress budget binds here
    assert tasks / max(RAMP) >= 1.0
    assert plan_tasks([100.0], 1.0, 5, 2.0) == 200  # the gap binds: 100/s, 2 s apart
    assert plan_tasks([10.0], 1.0, 5, 0.1, at_least=50) == 50


def test_the_ramp_never_coalesces_or_supersedes() -> None:
    """Round robin over the tasks: each task's webhooks come in order, ``points`` apart, at
    least ``tasks / rate`` seconds apart, none past the per-task limit, over the whole ramp."""
    duration, points = 2.0, 5
    tasks = plan_tasks(RAMP, duration, points, 1.0)
    cursor = Cursor.start(tasks)
    seen: dict[int, list[tuple[int, float]]] = defaultdict(list)  # task -> (nth, due)
    offset = 0.0
    for rate in RAMP:
        step = build_step(cursor, rate, duration, points)
        assert len(step) == round(rate * duration)
        for i, (task, nth) in enumerate(zip(step.tasks, step.nth, strict=True)):
            seen[task].append((nth, offset + step.due(i)))
        assert step.gap_s(tasks) >= 1.0
        offset += duration + 100  # steps are apart (the chain drains in between)
    for history in seen.values():
        nths = [n for n, _ in history]
        assert nths == list(range(1, len(nths) + 1))  # +points each, sequence + 1 each
        assert nths[-1] * points < 100
        gaps = [b - a for (_, a), (_, b) in itertools.pairwise(history)]
        assert all(g >= tasks / max(RAMP) - 1e-9 for g in gaps)


def test_a_step_that_would_exceed_a_task_refuses() -> None:
    cursor = Cursor.start(2)
    with pytest.raises(ValueError, match="plan more tasks"):
        build_step(cursor, 100.0, 1.0, 5)  # 100 webhooks on 2 tasks of 19 each


def test_rates_parse() -> None:
    assert parse_rates("100, 250,500") == [100.0, 250.0, 500.0]
    for bad in ("", "0,10", "a"):
        with pytest.raises(ValueError, match=r"positive numbers|could not convert"):
            parse_rates(bad)


def test_the_bus_adapter_option_picks_aivedio_bus() -> None:
    with pytest.raises(BenchUsageError, match="bus_adapter"):
        e2e.run(Settings(), {"bus_adapter": "kafka"})
    assert e2e.E2EOptions().bus_adapter == "jetstream"
    assert RunBus("nats://n", "S", "p").env()["AIVEDIO_BUS"] == "jetstream"
    env = RunBus("nats://n", "S", "p", "redis-streams").env()
    assert (env["AIVEDIO_BUS"], env["AIVEDIO_BUS_SUBJECT_PREFIX"]) == ("redis-streams", "p")


def test_percentile_interpolates_between_closest_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_saturation_is_the_highest_rate_within_the_limit_with_nothing_lost() -> None:
    results = [
        RateResult(100, 100.0, 20.0, 0),
        RateResult(250, 249.0, 80.0, 0),
        RateResult(500, 498.0, 99.0, 1),  # one lost: out
        RateResult(1000, 990.0, 450.0, 0),  # too slow: out
    ]
    assert saturation(results) == 249.0
    assert saturation(results, p99_limit_ms=500) == 990.0
    assert saturation([RateResult(100, 100.0, math.nan, 0)]) is None
    assert saturation([]) is None


def test_stages_need_both_stamps() -> None:
    nan = math.nan
    stamps: dict[str, list[float]] = {
        "sent": [10.0, 10.0],
        "received": [10.001, 10.001],
        "committed": [10.003, 10.003],
        "applied": [10.010, 10.010],
        "relayed": [10.012, nan],  # the second frame was repaired from PostgreSQL
        "dispatched": [10.013, nan],
        "written": [10.015, nan],
        "read": [10.016, 10.030],
    }
    samples = stage_samples(stamps)
    assert set(samples) == set(STAGES)
    assert samples["received"] == pytest.approx([1.0, 1.0])
    assert samples["applied"] == pytest.approx([7.0, 7.0])
    assert samples["relayed"] == pytest.approx([2.0])
    assert samples["read"] == pytest.approx([1.0])  # not 20 ms "from applied"


def test_the_progress_line_says_which_of_the_lost_were_superseded() -> None:
    step = StepFigures(asked=2000.0, lost=5, superseded=3)
    assert step.superseded_note() == " (3 superseded by a later one of their task)"
    assert StepFigures(asked=2000.0, lost=5).superseded_note() == ""


def test_headline_step_is_the_nearest_rate() -> None:
    steps = [StepFigures(asked=r) for r in (500.0, 1500.0, 2000.0)]
    assert at_rate(steps, 1000.0) is steps[1]  # a tie goes to the higher rate
    assert at_rate(steps, 1900.0) is steps[2]
    assert at_rate([], 1000.0) is None


def test_the_statements_table_shows_the_top_and_counts_all(
    capsys: pytest.CaptureFixture[str],
) -> None:
    figures = [StatementFigures(f"q{i}", calls=i + 1, exec_ms=100.0 - i, rows=i) for i in range(11)]
    step = StepFigures(asked=500.0, sent=10, statements=figures)
    _print_statements(step)
    out = capsys.readouterr().out
    shown = [f"q{i}" for i in range(11) if f"  q{i}\n" in out]
    assert shown == [f"q{i}" for i in range(TOP_STATEMENTS)]
    assert "6.600  " in out and "all 11 statements" in out  # (1 + ... + 11) calls / 10 webhooks
    assert _calls(step) == 6.6
    assert _calls(StepFigures(asked=500.0, sent=10)) is None  # the server keeps no figures


def test_requests_are_the_sandboxes_signed_webhooks() -> None:
    cursor = Cursor.start(2)
    step = build_step(cursor, 3.0, 1.0, 5)
    table = [Generation(f"gen_{i}", {"client_request_id": f"cr_{i}"}) for i in range(2)]
    requests = build_requests(step, table, [decode_webhook_secret(SECRET)], 5, "127.0.0.1:9")
    verifier = Webhook(SECRET)
    seen = []
    for raw in requests:
        head, body = raw.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        assert lines[0] == "POST /v1/callbacks/sandbox HTTP/1.1"
        headers = dict(line.split(": ", 1) for line in lines[1:])
        assert int(headers["content-length"]) == len(body)
        payload: Any = verifier.verify(body, headers)
        data = payload["data"]
        assert payload["type"] == "generation.updated"
        assert headers["webhook-id"] == f"msg_{data['id']}_{data['sequence']}"
        assert data["status"] == "running" and data["metadata"]["client_request_id"]
        seen.append((data["id"], data["progress"], data["sequence"]))
    assert seen == [("gen_0", 5, 2), ("gen_1", 5, 2), ("gen_0", 10, 3)]


def test_sse_parser_reads_frames_timing_and_chunked_bodies() -> None:
    loop = asyncio.new_event_loop()
    try:
        reader = _Reader()
        reader.expected = {("t1", 5), ("t1", 10)}
        client = _Client(b"", reader, loop.create_future())
        frame_a = (
            b'id: 1-7\nevent: task.status\ndata: {"task_id":"t1","task_version":3,"progress":5}\n'
            b": timing 10.000001 10.5 11.25\n\n"
        )
        frame_b = b'id: 1-8\nevent: task.status\ndata: {"task_id":"t1","progress":10}\n\n'
        body = b": start 1-6\n\n" + frame_a + b": ping 1\n\n" + frame_b
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:30], body[30:]))
        response = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunked
        for i in range(0, len(response), 7):  # in awkward pieces
            client.data_received(response[i : i + 7])
        assert client.ready.done()
        f = reader.frames
        assert f.task_id == ["t1", "t1"] and f.progress == [5, 10] and f.version == [3, -1]
        assert (f.relayed[0], f.dispatched[0], f.written[0]) == (10.000001, 10.5, 11.25)
        assert math.isnan(f.written[1])
        assert reader.arrived == 2 and not reader.expected
    finally:
        loop.close()


def test_sender_retries_a_refused_webhook_and_a_closed_connection_like_the_sandbox() -> None:
    """The load generator's pool resends a webhook answered non-2xx, or whose connection the
    server closed before answering, with the sandbox's backoff; answers are matched in order."""

    async def go() -> tuple[LoadResult, list[bytes]]:
        seen: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while not reader.at_eof():
                try:
                    line = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break
                seen.append(line.split(b"\r\n")[0])
                if len(seen) == 1:
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
                elif len(seen) == 2:
                    writer.close()  # closed with the request in flight: no answer
                    return
                else:
                    writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        sender = _Sender(port, 1)
        await sender.ensure(1)
        n = 3
        nan = arr.array("d", [math.nan]) * n
        sender.result = LoadResult(
            arr.array("d", [0.0]) * n, arr.array("d", nan), arr.array("d", nan),
            arr.array("i", [0]) * n, 0.0, 0.0,
        )  # fmt: skip
        requests = [b"POST /r%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(n)]
        await asyncio.wait_for(sender.run(requests, 1000.0, time.time(), 10), 20)
        for conn in sender.conns:
            if conn.transport is not None:
                conn.transport.close()
        await asyncio.sleep(0.05)
        server.close()
        await server.wait_closed()
        return sender.result, seen

    result, seen = asyncio.run(go())
    assert list(result.status) == [204, 204, 204]
    assert result.retried == 2
    assert seen.count(b"POST /r0 HTTP/1.1") == 2  # refused once, then accepted


def test_sockets_are_attributed_to_the_process_holding_them() -> None:
    """How each PostgreSQL backend is charged to the aivedio process it serves: by the local
    port of its client's socket, found in /proc."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            port = client.getsockname()[1]
            assert socket_owners({"me": [os.getpid()]}).get(port) == "me"
            assert port not in socket_owners({"nobody": []})
