"""The object store contract: one set of tests every ``ObjectStore`` adapter must pass.

Subclass :class:`ObjectStoreContract` as ``Test<Adapter>ObjectStore`` and provide the ``store``
fixture: a fresh, empty store private to the test, cleaned up afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from aivedio.storage import ObjectInfo, ObjectNotFound, ObjectStore


async def read_all(store: ObjectStore, key: str, **kw: int) -> bytes:
    return b"".join([chunk async for chunk in store.read(key, **kw)])


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        await asyncio.sleep(0)
        yield part


class Boom(Exception):
    pass


async def failing(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
    raise Boom("the source failed")


class ObjectStoreContract:
    async def test_put_then_stat_exists_read(self, store: ObjectStore) -> None:
        info = await store.put("a/b/video.mp4", b"hello world", "video/mp4")
        assert info == ObjectInfo("a/b/video.mp4", 11, "video/mp4")
        assert await store.stat("a/b/video.mp4") == info
        assert await store.exists("a/b/video.mp4")
        assert await read_all(store, "a/b/video.mp4") == b"hello world"

    async def test_put_from_an_async_stream(self, store: ObjectStore) -> None:
        info = await store.put("k", chunks(b"ab", b"", b"cde"), "application/octet-stream")
        assert info.size == 5
        assert await read_all(store, "k", chunk_size=2) == b"abcde"

    async def test_missing_object(self, store: ObjectStore) -> None:
        assert await store.stat("nope") is None
        assert not await store.exists("nope")
        with pytest.raises(ObjectNotFound):
            await read_all(store, "nope")
        assert await store.delete("nope") is False

    async def test_put_replaces(self, store: ObjectStore) -> None:
        await store.put("k", b"first version", "text/plain")
        await store.put("k", b"second", "video/mp4")
        assert await store.stat("k") == ObjectInfo("k", 6, "video/mp4")
        assert await read_all(store, "k") == b"second"

    async def test_ranged_read(self, store: ObjectStore) -> None:
        await store.put("k", bytes(range(100)), "application/octet-stream")
        assert await read_all(store, "k", offset=10, length=5) == bytes(range(10, 15))
        assert await read_all(store, "k", offset=95) == bytes(range(95, 100))
        assert await read_all(store, "k", offset=98, length=10) == bytes([98, 99])
        assert await read_all(store, "k", offset=200) == b""

    async def test_delete(self, store: ObjectStore) -> None:
        await store.put("x/y", b"1", "text/plain")
        assert await store.delete("x/y") is True
        assert await store.stat("x/y") is None

    async def test_failed_source_stores_nothing_and_keeps_the_old_object(
        self, store: ObjectStore
    ) -> None:
        with pytest.raises(Boom):
            await store.put("fresh", failing(b"partial"), "video/mp4")
        assert await store.stat("fresh") is None
        await store.put("old", b"kept", "video/mp4")
        with pytest.raises(Boom):
            await store.put("old", failing(b"partial data"), "video/mp4")
        assert await read_all(store, "old") == b"kept"

    async def test_concurrent_puts_leave_one_whole_object(self, store: ObjectStore) -> None:
        bodies = [bytes([i]) * 50_000 for i in range(8)]
        await asyncio.gather(*(store.put("race", chunks(b, b), "video/mp4") for b in bodies))
        got = await read_all(store, "race")
        assert got in [b + b for b in bodies]

    @pytest.mark.parametrize(
        "key", ["", "/abs", "a/../b", "..", "a//b", "trailing/", "sp ace", "a/./b", "x" * 513]
    )
    async def test_invalid_keys(self, store: ObjectStore, key: str) -> None:
        with pytest.raises(ValueError, match="invalid object key"):
            await store.put(key, b"x", "text/plain")
        with pytest.raises(ValueError, match="invalid object key"):
            await store.stat(key)
