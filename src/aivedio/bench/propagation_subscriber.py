"""The Redis subscriber of ``aivedio bench propagation``: a bare RESP2 Pub/Sub reader counting every
(task, version) it receives, with its receive time."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass(slots=True)
class Counted:
    """What the subscriber saw."""

    first: dict[tuple[str, int], float] = field(default_factory=dict)  # receive time
    duplicates: int = 0
    out_of_order: int = 0
    last_version: dict[str, int] = field(default_factory=dict)


# -- the subscriber --------------------------------------------------------------------------


class _Subscriber(asyncio.Protocol):
    """A bare RESP2 Pub/Sub reader: the measuring instrument must cost less than the pipeline
    it measures. redis-py's ``PubSub.get_message`` parses each frame in Python at ~250 us of CPU
    per event (py-spy, drain phase): more than the relays and the dispatcher together, on the
    same 2 cores. A gateway node subscribes in its own process; this one shares the machine."""

    PREFIX = b"*3\r\n$7\r\nmessage\r\n$"

    def __init__(self, counted: Counted) -> None:
        self.counted = counted
        self.buffer = bytearray()
        self.subscribed = asyncio.Event()
        self.closed = asyncio.Event()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        if not self.subscribed.is_set():
            # *3 $9 subscribe $n <channel> :1 -- the confirmation ends with the count.
            end = buf.find(b":1\r\n")
            if end < 0:
                return
            del buf[: end + 4]
            self.subscribed.set()
        now = time.time()
        pos = 0
        prefix, size = self.PREFIX, len(self.PREFIX)
        while buf.startswith(prefix, pos):
            head = pos + size
            eol = buf.find(b"\r\n", head)
            if eol < 0:
                break
            data_head = eol + 2 + int(buf[head:eol]) + 3  # past the channel, its CRLF and "$"
            eol = buf.find(b"\r\n", data_head)
            if eol < 0:
                break
            start = eol + 2
            stop = start + int(buf[data_head:eol])
            if len(buf) < stop + 2:
                break
            self._count(json.loads(buf[start:stop]), now)
            pos = stop + 2
        if pos:
            del buf[:pos]

    def _count(self, body: dict[str, Any], now: float) -> None:
        counted = self.counted
        key = (body["task_id"], body["task_version"])
        if key in counted.first:
            counted.duplicates += 1
            return
        counted.first[key] = now
        if key[1] <= counted.last_version.get(key[0], 0):
            counted.out_of_order += 1
        counted.last_version[key[0]] = key[1]


async def _subscribe(redis_url: str, channel: str, counted: Counted) -> asyncio.Transport:
    where = urlsplit(redis_url)
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(
        lambda: _Subscriber(counted), where.hostname or "127.0.0.1", where.port or 6379
    )
    name = channel.encode()
    if where.password:
        secret = where.password.encode()
        transport.write(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(secret), secret))
    transport.write(b"*2\r\n$9\r\nSUBSCRIBE\r\n$%d\r\n%s\r\n" % (len(name), name))
    await asyncio.wait_for(protocol.subscribed.wait(), 10)
    return transport
